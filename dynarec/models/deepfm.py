"""DeepFM, in TorchEasyRec's layout: a first-order term over the wide groups, FM interactions
over the FM group's id features, a deep MLP over the deep groups; summed into one logit, or
combined by a final MLP."""

from __future__ import annotations

import torch
from torch import nn

from dynarec.config.schema import Config, DeepFMCfg
from dynarec.models.blocks import MLP, DeepGroup
from dynarec.models.features import FeatureInputs


class DeepFM(nn.Module):
    """First order: a linear layer over the ``wide`` groups (every group when the model has
    none). FM: ``0.5 * ((sum_i v_i)^2 - sum_i v_i^2)`` over ``fm_group``'s id features
    (default: every non-wide group's; equal dims). Deep: an MLP over the non-wide groups other
    than ``fm_group``. Logit: ``first + sum(FM) + linear(deep)``, or with
    ``final_hidden_units`` ``linear(final_mlp([first, FM, deep]))``."""

    def __init__(self, config: Config, cfg: DeepFMCfg):
        super().__init__()
        groups = config.model.feature_groups
        wide = [g for g in groups if g.group_type == "wide"]
        deep = [g for g in groups if g.group_type != "wide" and g.group_name != cfg.fm_group]
        fm = [config.model.group(cfg.fm_group)] if cfg.fm_group else [g for g in groups if g.group_type != "wide"]
        if not deep:
            raise ValueError("model.deepfm: needs a deep feature group besides fm_group")
        self.inputs = FeatureInputs(config)
        first = [DeepGroup(config, g, self.inputs) for g in (wide or groups)]
        deep_groups = [DeepGroup(config, g, self.inputs) for g in deep]
        self.first, self.deep = nn.ModuleList(first), nn.ModuleList(deep_groups)
        self.first_order = nn.Linear(sum(g.out_dim for g in first), 1)
        self.fm_features = [n for g in fm for n in g.feature_names if self.inputs[n].kind in ("pooled", "sequence")]
        dims = {self.inputs[n].width for n in self.fm_features}
        if len(dims) != 1:
            raise ValueError(f"model.deepfm: FM needs id features of one embedding dim, got {sorted(dims) or 'none'}")
        self.mlp = MLP(sum(g.out_dim for g in deep_groups), cfg.deep_hidden_units)
        fm_dim = dims.pop()
        self.final = MLP(1 + fm_dim + self.mlp.out_dim, cfg.final_hidden_units) if cfg.final_hidden_units else None
        self.out = nn.Linear(self.final.out_dim if self.final is not None else self.mlp.out_dim, 1)

    def forward(self, embeddings, seq_lengths, dense):
        first = self.first_order(torch.cat([g(embeddings, seq_lengths, dense) for g in self.first], dim=1))
        v = torch.stack([self.inputs.pooled(n, embeddings, seq_lengths, dense) for n in self.fm_features], dim=1)
        fm = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1))  # [B, D]
        deep = self.mlp(torch.cat([g(embeddings, seq_lengths, dense) for g in self.deep], dim=1))
        if self.final is not None:
            return self.out(self.final(torch.cat([first, fm, deep], dim=1))).squeeze(1)
        return first.squeeze(1) + fm.sum(1) + self.out(deep).squeeze(1)
