"""Rankers over explicit feature interactions, in TorchEasyRec's layout: DCN (v1), DCN v2,
xDeepFM, MaskNet and WuKong. Each reads its config's feature groups (the first group, unless
the model names its groups) and ends in one logit."""

from __future__ import annotations

import torch
from torch import nn

from dynarec.config.schema import Config, DCNCfg, DCNV2Cfg, MaskNetCfg, WuKongCfg, XDeepFMCfg
from dynarec.models.blocks import MLP, DeepGroup
from dynarec.models.features import FeatureInputs
from dynarec.models.interaction import CIN, Cross, CrossV2, MaskNetModule, WuKongLayer

__all__ = ["DCN", "DCNV2", "MaskNet", "WuKong", "XDeepFM"]


def _fields(inputs: FeatureInputs, names: list[str], where: str) -> int:
    """The common width of ``names`` (fields of an interaction: equal widths); ValueError naming
    the widths otherwise."""
    widths = {inputs[n].width for n in names}
    if len(widths) != 1:
        raise ValueError(f"{where}: its features are interaction fields of one width, got {sorted(widths)}")
    return widths.pop()


def _stack(inputs: FeatureInputs, names: list[str], embeddings, seq_lengths, dense) -> torch.Tensor:
    return torch.stack([inputs.pooled(n, embeddings, seq_lengths, dense) for n in names], dim=1)


class DCN(nn.Module):
    """Deep & Cross (v1): cross layers and an MLP over the first group, a final MLP over both."""

    def __init__(self, config: Config, cfg: DCNCfg):
        super().__init__()
        self.inputs = FeatureInputs(config)
        self.group = DeepGroup(config, config.model.feature_groups[0], self.inputs)
        self.cross = Cross(self.group.out_dim, cfg.cross_num)
        self.deep = MLP(self.group.out_dim, cfg.deep_hidden_units)
        self.final = MLP(self.group.out_dim + self.deep.out_dim, cfg.final_hidden_units)
        self.out = nn.Linear(self.final.out_dim, 1, bias=False)

    def forward(self, embeddings, seq_lengths, dense):
        x = self.group(embeddings, seq_lengths, dense)
        return self.out(self.final(torch.cat([self.cross(x), self.deep(x)], dim=1))).squeeze(1)


class DCNV2(nn.Module):
    """DCN v2: an optional backbone MLP, low-rank cross layers over it, an optional deep MLP over
    the first group beside them, a final MLP."""

    def __init__(self, config: Config, cfg: DCNV2Cfg):
        super().__init__()
        self.inputs = FeatureInputs(config)
        self.group = DeepGroup(config, config.model.feature_groups[0], self.inputs)
        width = self.group.out_dim
        self.backbone = MLP(width, cfg.backbone_hidden_units) if cfg.backbone_hidden_units else None
        if self.backbone is not None:
            width = self.backbone.out_dim
        self.cross = CrossV2(width, cfg.cross_num, cfg.low_rank)
        self.deep = MLP(self.group.out_dim, cfg.deep_hidden_units) if cfg.deep_hidden_units else None
        self.final = MLP(width + (self.deep.out_dim if self.deep is not None else 0), cfg.final_hidden_units)
        self.out = nn.Linear(self.final.out_dim, 1, bias=False)

    def forward(self, embeddings, seq_lengths, dense):
        x = self.group(embeddings, seq_lengths, dense)
        net = self.cross(self.backbone(x) if self.backbone is not None else x)
        if self.deep is not None:
            net = torch.cat([net, self.deep(x)], dim=1)
        return self.out(self.final(net)).squeeze(1)


class XDeepFM(nn.Module):
    """xDeepFM: a compressed interaction network over the ``wide`` group's fields (one width), an
    MLP over the ``deep`` group, a final MLP over both."""

    def __init__(self, config: Config, cfg: XDeepFMCfg):
        super().__init__()
        self.inputs = FeatureInputs(config)
        self.wide = list(config.model.group(cfg.wide_group).feature_names)
        _fields(self.inputs, self.wide, f"model.xdeepfm, group '{cfg.wide_group}'")
        self.cin = CIN(len(self.wide), cfg.cin_layer_size)
        self.deep_group = DeepGroup(config, config.model.group(cfg.deep_group), self.inputs)
        self.deep = MLP(self.deep_group.out_dim, cfg.deep_hidden_units)
        self.final = MLP(self.cin.out_dim + self.deep.out_dim, cfg.final_hidden_units)
        self.out = nn.Linear(self.final.out_dim, 1)

    def forward(self, embeddings, seq_lengths, dense):
        cin = self.cin(_stack(self.inputs, self.wide, embeddings, seq_lengths, dense))
        deep = self.deep(self.deep_group(embeddings, seq_lengths, dense))
        return self.out(self.final(torch.cat([cin, deep], dim=1))).squeeze(1)


class MaskNet(nn.Module):
    """MaskNet: mask blocks over the first group (parallel or serial), a top MLP, one logit."""

    def __init__(self, config: Config, cfg: MaskNetCfg):
        super().__init__()
        self.inputs = FeatureInputs(config)
        self.group = DeepGroup(config, config.model.feature_groups[0], self.inputs)
        width = self.group.out_dim
        block = cfg.mask_block
        aggregation = block.aggregation_dim or max(int(width * block.reduction_ratio), 1)
        self.masknet = MaskNetModule(
            width, cfg.n_mask_blocks, block.hidden_dim, aggregation, cfg.top_hidden_units, cfg.use_parallel
        )
        self.out = nn.Linear(self.masknet.out_dim, 1, bias=False)

    def forward(self, embeddings, seq_lengths, dense):
        return self.out(self.masknet(self.group(embeddings, seq_lengths, dense))).squeeze(1)


class WuKong(nn.Module):
    """WuKong: the ``sparse`` group's fields (one width ``D``), with the ``dense`` group's MLP
    output as one more field when the model has that group, through WuKong layers; a final MLP
    over the last layer's fields."""

    def __init__(self, config: Config, cfg: WuKongCfg):
        super().__init__()
        self.inputs = FeatureInputs(config)
        groups = {g.group_name: g for g in config.model.feature_groups}
        sparse = groups.get(cfg.sparse_group) or config.model.feature_groups[0]
        self.sparse = list(sparse.feature_names)
        dim = _fields(self.inputs, self.sparse, f"model.wukong, group '{sparse.group_name}'")
        self.dense_group = (
            DeepGroup(config, groups[cfg.dense_group], self.inputs) if cfg.dense_group in groups else None
        )
        self.dense_mlp = None
        fields = len(self.sparse)
        if self.dense_group is not None:
            self.dense_mlp = MLP(self.dense_group.out_dim, cfg.dense_hidden_units)
            if self.dense_mlp.out_dim != dim:
                raise ValueError(
                    f"model.wukong.dense_hidden_units: its last layer ({self.dense_mlp.out_dim}) must equal the "
                    f"sparse fields' width ({dim})"
                )
            fields += 1
        layers = []
        for layer in cfg.wukong_layers:
            wk = WuKongLayer(
                dim, fields, layer.lcb_feature_num, layer.fmb_feature_num, layer.compressed_feature_num,
                layer.feature_num_hidden_units,
            )  # fmt: skip
            layers.append(wk)
            fields = wk.out_fields
        self.layers = nn.Sequential(*layers)
        self.final = MLP(fields * dim, cfg.final_hidden_units)
        self.out = nn.Linear(self.final.out_dim, 1)

    def forward(self, embeddings, seq_lengths, dense):
        x = _stack(self.inputs, self.sparse, embeddings, seq_lengths, dense)
        if self.dense_group is not None and self.dense_mlp is not None:
            d = self.dense_mlp(self.dense_group(embeddings, seq_lengths, dense))
            x = torch.cat([x, d[:, None, :]], dim=1)
        return self.out(self.final(self.layers(x).flatten(1))).squeeze(1)
