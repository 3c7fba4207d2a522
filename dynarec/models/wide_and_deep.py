"""Wide & Deep: a linear model over the ``wide`` groups plus an MLP over the ``deep`` groups,
summed into one logit, or combined by a final MLP (``final_hidden_units``)."""

from __future__ import annotations

import torch
from torch import nn

from dynarec.config.schema import Config, WideAndDeepCfg
from dynarec.models.blocks import MLP, DeepGroup
from dynarec.models.features import FeatureInputs


class WideAndDeep(nn.Module):
    def __init__(self, config: Config, cfg: WideAndDeepCfg):
        super().__init__()
        groups = config.model.feature_groups
        self.inputs = FeatureInputs(config)
        wide = [DeepGroup(config, g, self.inputs) for g in groups if g.group_type == "wide"]
        deep = [DeepGroup(config, g, self.inputs) for g in groups if g.group_type == "deep"]
        if not wide or not deep:
            raise ValueError("model.wide_and_deep: needs at least one 'wide' and one 'deep' feature group")
        self.wide, self.deep = nn.ModuleList(wide), nn.ModuleList(deep)
        self.linear = nn.Linear(sum(g.out_dim for g in wide), 1)
        self.mlp = MLP(sum(g.out_dim for g in deep), cfg.deep_hidden_units)
        self.final = MLP(1 + self.mlp.out_dim, cfg.final_hidden_units) if cfg.final_hidden_units else None
        self.out = nn.Linear(self.final.out_dim if self.final is not None else self.mlp.out_dim, 1)

    def forward(self, embeddings, seq_lengths, dense):
        wide = self.linear(torch.cat([g(embeddings, seq_lengths, dense) for g in self.wide], dim=1))
        deep = self.mlp(torch.cat([g(embeddings, seq_lengths, dense) for g in self.deep], dim=1))
        if self.final is not None:
            return self.out(self.final(torch.cat([wide, deep], dim=1))).squeeze(1)
        return (wide + self.out(deep)).squeeze(1)
