"""MultiTowerDIN: MLP towers over deep feature groups, DIN towers over sequence groups, and a
final MLP over all towers' outputs (TorchEasyRec's MultiTowerDIN)."""

from __future__ import annotations

import torch
from torch import nn

from dynarec.config.schema import Config, MultiTowerDINCfg
from dynarec.models.blocks import MLP, DeepGroup, DINAttention, SequenceGroup
from dynarec.models.features import FeatureInputs


class MultiTowerDIN(nn.Module):
    def __init__(self, config: Config, cfg: MultiTowerDINCfg):
        super().__init__()
        self.inputs = FeatureInputs(config)
        self.groups = nn.ModuleDict()
        self.towers = nn.ModuleDict()
        width = 0
        for tower in cfg.towers:
            group = DeepGroup(config, config.model.group(tower.input), self.inputs)
            mlp = MLP(group.out_dim, tower.hidden_units, tower.activation)
            self.groups[tower.input], self.towers[tower.input] = group, mlp
            width += mlp.out_dim
        self.seq_groups = nn.ModuleDict()
        self.din_towers = nn.ModuleDict()
        for din in cfg.din_towers:
            names = config.model.group(din.input).feature_names
            seq = SequenceGroup(f"model.feature_groups '{din.input}'", names, self.inputs)
            self.seq_groups[din.input] = seq
            self.din_towers[din.input] = DINAttention(seq.dim, din.attn_hidden_units, din.pooling, din.activation)
            width += seq.dim + seq.query_dim  # attention output and the query itself
        self.final = MLP(width, cfg.final_hidden_units, cfg.final_activation)
        self.out = nn.Linear(self.final.out_dim, 1)

    def forward(
        self, embeddings: dict[str, torch.Tensor], seq_lengths: dict[str, torch.Tensor], dense: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        parts = [self.towers[n](g(embeddings, seq_lengths, dense)) for n, g in self.groups.items()]
        for n, g in self.seq_groups.items():
            query, keys, lengths = g(embeddings, seq_lengths, dense)
            parts += [self.din_towers[n](query, keys, lengths), query]
        return self.out(self.final(torch.cat(parts, dim=1))).squeeze(1)
