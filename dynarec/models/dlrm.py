"""DLRM: a bottom MLP over the dense features, pairwise dot products between its output and
every pooled embedding (equal dims), and a top MLP (over the embeddings too, with
``arch_with_sparse``)."""

from __future__ import annotations

import torch
from torch import nn

from dynarec.config.schema import Config, DLRMCfg
from dynarec.models.blocks import MLP
from dynarec.models.features import FeatureInputs


class DLRM(nn.Module):
    def __init__(self, config: Config, cfg: DLRMCfg):
        super().__init__()
        names = [n for g in config.model.feature_groups for n in g.feature_names]
        self.inputs = FeatureInputs(config)
        self.dense_names = [n for n in names if self.inputs[n].kind in ("dense", "dense_sequence")]
        self.sparse_names = [n for n in names if self.inputs[n].kind in ("pooled", "sequence")]
        dims = {self.inputs[n].width for n in self.sparse_names}
        if len(dims) != 1 or not self.dense_names:
            raise ValueError(
                f"model.dlrm: needs dense features and sparse features of one dim, got dims {sorted(dims)}"
            )
        dim = dims.pop()
        self.bottom = MLP(sum(self.inputs[n].width for n in self.dense_names), [*cfg.bottom_hidden_units, dim])
        n = len(self.sparse_names) + 1
        pairs = torch.triu_indices(n, n, offset=1)
        # Each pair's position in the flattened [n, n] interaction matrix: one index_select, whose
        # backward is an index_add (advanced indexing's is a sorting index_put).
        self.register_buffer("pairs", pairs[0] * n + pairs[1], persistent=False)
        self.arch_with_sparse = cfg.arch_with_sparse
        width = dim + pairs.shape[1] + (dim * len(self.sparse_names) if cfg.arch_with_sparse else 0)
        self.top = MLP(width, cfg.top_hidden_units)
        self.out = nn.Linear(self.top.out_dim, 1)

    def forward(self, embeddings, seq_lengths, dense):
        x = self.bottom(
            torch.cat([self.inputs.pooled(n, embeddings, seq_lengths, dense) for n in self.dense_names], dim=1)
        )
        vs = [x] + [self.inputs.pooled(n, embeddings, seq_lengths, dense) for n in self.sparse_names]
        v = torch.stack(vs, dim=1)  # [B, F + 1, D]
        pairs: torch.Tensor = self.pairs  # type: ignore[assignment]
        inter = torch.bmm(v, v.transpose(1, 2)).flatten(1).index_select(1, pairs)
        parts = [x, inter] + ([v[:, 1:].flatten(1)] if self.arch_with_sparse else [])
        return self.out(self.top(torch.cat(parts, dim=1))).squeeze(1)
