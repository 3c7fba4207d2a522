"""DeepFM: first-order linear term + FM second-order interactions over the deep groups' pooled
embeddings (equal dims) + a deep MLP, summed into one logit."""

from __future__ import annotations

import torch
from torch import nn

from dynarec.config.schema import Config, DeepFMCfg, RawFeatureCfg
from dynarec.models.blocks import MLP, DeepGroup, masked_mean


class DeepFM(nn.Module):
    def __init__(self, config: Config, cfg: DeepFMCfg):
        super().__init__()
        groups = [DeepGroup(config, g) for g in config.model.feature_groups]
        self.groups = nn.ModuleList(groups)
        self.fm_features = [
            n
            for g in config.model.feature_groups
            for n in g.feature_names
            if not isinstance(config.feature(n), RawFeatureCfg)
        ]
        dims = {config.feature(n).embedding_dim for n in self.fm_features}
        if len(dims) > 1:
            raise ValueError(f"model.deepfm: FM needs equal embedding dims, got {sorted(dims)}")
        width = sum(g.out_dim for g in groups)
        self.first_order = nn.Linear(width, 1)
        self.mlp = MLP(width, cfg.deep_hidden_units)
        self.out = nn.Linear(self.mlp.out_dim, 1)

    def forward(self, embeddings, seq_lengths, dense):
        x = torch.cat([g(embeddings, seq_lengths, dense) for g in self.groups], dim=1)
        v = torch.stack(
            [
                embeddings[n] if embeddings[n].dim() == 2 else masked_mean(embeddings[n], seq_lengths[n])
                for n in self.fm_features
            ],
            dim=1,
        )  # [B, F, D]
        fm = 0.5 * (v.sum(1).pow(2) - v.pow(2).sum(1)).sum(1)
        return self.first_order(x).squeeze(1) + fm + self.out(self.mlp(x)).squeeze(1)
