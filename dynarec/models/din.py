"""DIN: one attention tower over a sequence group, concatenated with every deep group, one MLP."""

from __future__ import annotations

import torch
from torch import nn

from dynarec.config.schema import Config, DINCfg
from dynarec.models.blocks import MLP, DeepGroup, DINAttention, SequenceGroup
from dynarec.models.features import FeatureInputs


class DIN(nn.Module):
    def __init__(self, config: Config, cfg: DINCfg):
        super().__init__()
        self.inputs = FeatureInputs(config)
        tower = cfg.din_tower
        group = config.model.group(tower.input)
        self.seq = SequenceGroup(f"model.feature_groups '{group.group_name}'", group.feature_names, self.inputs)
        self.attention = DINAttention(self.seq.dim, tower.attn_hidden_units, tower.pooling, tower.activation)
        deep = [DeepGroup(config, g, self.inputs) for g in config.model.feature_groups if g.group_type != "sequence"]
        self.deep = nn.ModuleList(deep)
        width = self.seq.dim + self.seq.query_dim  # the attention's output and the query itself
        self.mlp = MLP(width + sum(g.out_dim for g in deep), cfg.deep_hidden_units)
        self.out = nn.Linear(self.mlp.out_dim, 1)

    def forward(self, embeddings, seq_lengths, dense):
        query, keys, lengths = self.seq(embeddings, seq_lengths, dense)
        parts = [self.attention(query, keys, lengths), query] + [g(embeddings, seq_lengths, dense) for g in self.deep]
        return self.out(self.mlp(torch.cat(parts, dim=1))).squeeze(1)
