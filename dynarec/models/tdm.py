"""TDM's ranking model (TorchEasyRec's ``TDM``): a multi-window DIN over the model's sequence
group, concatenated with every deep group, through the final MLP to one logit. It scores a
(user, tree node) row; training rows come from the tree (dynarec.data.tdm_sampler), retrieval is
a beam search down the tree (dynarec.tdm)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dynarec.config.schema import Config
from dynarec.config.tdm import TDMCfg
from dynarec.models.blocks import MLP, DeepGroup, SequenceGroup
from dynarec.models.features import FeatureInputs
from dynarec.models.pooling import sequence_mask

__all__ = ["TDM", "MultiWindowDIN"]


class MultiWindowDIN(nn.Module):
    """DIN attention summed window by window (TorchEasyRec's ``MultiWindowDINEncoder``).

    A query ``[B, Dq]`` (zero-padded to ``D``) weighs each valid position of a sequence
    ``[B, L, D]`` by ``PReLU(linear(MLP([s, q * s, q])))`` (no softmax); the weighted positions
    are summed over consecutive windows of ``windows_len`` positions (the first window the first
    positions; positions past their sum dropped) and each sum divided by the valid positions in
    its window (at least 1). Returns ``[B, (W + 1) * D]``: the ``W`` windows, then the padded
    query."""

    windows_len: torch.Tensor
    window_ends: torch.Tensor
    window_starts: torch.Tensor

    def __init__(self, dim: int, windows_len: Sequence[int], attn_hidden_units: Sequence[int], activation: str):
        super().__init__()
        self.dim = dim
        self.num_windows = len(windows_len)
        lengths = torch.tensor(list(windows_len), dtype=torch.int64)
        ends = torch.cumsum(lengths, 0)
        self.register_buffer("windows_len", lengths, persistent=False)
        self.register_buffer("window_ends", ends, persistent=False)
        self.register_buffer("window_starts", ends - lengths, persistent=False)
        self.mlp = MLP(3 * dim, attn_hidden_units, activation)
        self.linear = nn.Linear(self.mlp.out_dim, 1)
        self.active = nn.PReLU()

    @property
    def out_dim(self) -> int:
        return (self.num_windows + 1) * self.dim

    def forward(self, query: torch.Tensor, sequence: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        q = query if query.shape[1] == self.dim else F.pad(query, (0, self.dim - query.shape[1]))
        weights = self.active(self.linear(self._hidden(q, sequence)))  # [B, L, 1]
        mask = sequence_mask(lengths, sequence.shape[1])
        weighted = weights * mask[:, :, None].to(sequence.dtype) * sequence  # [B, L, D]
        # position l belongs to the window whose end is the first above l (none past the last)
        window = torch.bucketize(torch.arange(sequence.shape[1], device=sequence.device), self.window_ends, right=True)
        member = F.one_hot(window, self.num_windows + 1)[:, : self.num_windows].to(sequence.dtype)  # [L, W]
        sums = torch.einsum("lw,bld->bwd", member, weighted)
        valid = torch.minimum(lengths[:, None] - self.window_starts[None, :], self.windows_len[None, :])
        sums = sums / valid.clamp(min=1)[:, :, None].to(sums.dtype)
        return torch.cat([sums, q[:, None, :]], dim=1).reshape(sums.shape[0], -1)

    def _hidden(self, q: torch.Tensor, sequence: torch.Tensor) -> torch.Tensor:
        """The attention MLP on ``[s, q * s, q]`` at every position, its first layer ``W = [Ws |
        Wm | Wq]`` factored (``Wq q + b`` once a row): no ``[B, L, 3D]`` input."""
        first = self.mlp[0]
        assert isinstance(first, nn.Linear)
        ws, wm, wq = first.weight.split(self.dim, dim=1)
        h = F.linear(sequence, ws) + F.linear(q[:, None, :] * sequence, wm) + F.linear(q, wq, first.bias)[:, None, :]
        for layer in list(self.mlp)[1:]:
            h = layer(h)
        return h


class TDM(nn.Module):
    def __init__(self, config: Config, cfg: TDMCfg):
        super().__init__()
        self.inputs = FeatureInputs(config)
        group = next(g for g in config.model.feature_groups if g.group_type == "sequence")
        self.seq = SequenceGroup(f"model.feature_groups '{group.group_name}'", group.feature_names, self.inputs)
        w = cfg.multiwindow_din
        self.multiwindow = MultiWindowDIN(self.seq.dim, w.windows_len, w.attn_hidden_units, w.attn_activation)
        deep = [DeepGroup(config, g, self.inputs) for g in config.model.feature_groups if g.group_type == "deep"]
        self.deep = nn.ModuleList(deep)
        width = self.multiwindow.out_dim + sum(g.out_dim for g in deep)
        self.final = MLP(width, cfg.final_hidden_units, cfg.final_activation, batch_norm=cfg.final_batch_norm)
        self.out = nn.Linear(self.final.out_dim, 1)

    def forward(self, embeddings, seq_lengths, dense):
        query, keys, lengths = self.seq(embeddings, seq_lengths, dense)
        parts = [self.multiwindow(query, keys, lengths)] + [g(embeddings, seq_lengths, dense) for g in self.deep]
        return self.out(self.final(torch.cat(parts, dim=1))).squeeze(1)

    def item_embedding(self, embeddings, seq_lengths, dense) -> torch.Tensor:
        """``[B, Dq]``: the sequence group's query, an item's embedding for clustering the tree
        (TorchEasyRec's ``TDMEmbedding``)."""
        query, _, _ = self.seq(embeddings, seq_lengths, dense)
        return query
