"""MultiTowerDIN: MLP towers over deep feature groups, DIN towers over sequence groups, and a
final MLP over all towers' outputs (TorchEasyRec's MultiTowerDIN)."""

from __future__ import annotations

import torch
from torch import nn

from dynarec.config.schema import Config
from dynarec.models.blocks import MLP, DeepGroup, DINAttention, SequenceGroup


class MultiTowerDIN(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        cfg = config.model.multi_tower_din
        self.groups = nn.ModuleDict()
        self.towers = nn.ModuleDict()
        width = 0
        for t in cfg.towers:
            group = DeepGroup(config, config.model.group(t.input))
            self.groups[t.input] = group
            self.towers[t.input] = MLP(group.out_dim, t.hidden_units)
            width += self.towers[t.input].out_dim
        self.seq_groups = nn.ModuleDict()
        self.din_towers = nn.ModuleDict()
        for t in cfg.din_towers:
            group = SequenceGroup(config, config.model.group(t.input))
            self.seq_groups[t.input] = group
            self.din_towers[t.input] = DINAttention(group.dim, t.attn_hidden_units, t.pooling)
            width += 2 * group.dim  # attention output and the query itself
        self.final = MLP(width, cfg.final_hidden_units)
        self.out = nn.Linear(self.final.out_dim, 1)

    def forward(self, embeddings: dict[str, torch.Tensor], seq_lengths: dict[str, torch.Tensor],
                dense: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [self.towers[n](g(embeddings, seq_lengths, dense)) for n, g in self.groups.items()]
        for n, g in self.seq_groups.items():
            query, keys, lengths = g(embeddings, seq_lengths)
            parts += [self.din_towers[n](query, keys, lengths), query]
        return self.out(self.final(torch.cat(parts, dim=1))).squeeze(1)
