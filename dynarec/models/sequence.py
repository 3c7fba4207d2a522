"""Sequence groups and the encoders that read them.

A sequence group is a query (its features of one value a row: ids or numbers) and a sequence
(its sequence features, concatenated position by position). It is either a feature group of its
own (``group_type: sequence``, read by DIN towers) or nested in a deep group
(``sequence_groups``), where a ``sequence_encoders`` entry turns it into one ``[B, D]`` part of the
group's output: DIN attention, dot-product attention or pooling (TorchEasyRec's
``din_encoder`` / ``simple_attention`` / ``pooling_encoder``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dynarec.config.schema import SequenceEncoderCfg
from dynarec.models.features import FeatureInputs
from dynarec.models.mlp import MLP
from dynarec.models.pooling import masked_mean, masked_sum, sequence_mask

__all__ = ["DINAttention", "SequenceGroup", "SequencePooling", "SimpleAttention", "sequence_encoder"]


class SequenceGroup(nn.Module):
    """Sequence group ``name``: its features of one value a row form the query ``[B, query_dim]``
    and its sequence features the sequence ``[B, L, dim]`` (each concatenated along the last dim,
    in the group's order; id and dense members alike, dense ones as their numbers or dense
    embeddings); ``L`` the longest of its sequences in the batch, the lengths those of its first
    sequence (the batch builder checks they agree row by row).

    The query may be narrower than the sequence (an attention zero-pads it, as TorchEasyRec's
    DIN encoder does), never wider. ``need_query=False`` (pooling) allows a group without one.
    """

    query_dim: int
    dim: int

    def __init__(self, where: str, feature_names: Sequence[str], inputs: FeatureInputs, need_query: bool = True):
        super().__init__()
        self.inputs = [inputs]  # in a list: the model owns it (its parameters are not the group's)
        kinds = {n: inputs[n].kind for n in feature_names}
        self.query = [n for n in feature_names if kinds[n] in ("pooled", "dense")]
        self.sequence = [n for n in feature_names if kinds[n] in ("sequence", "dense_sequence")]
        if not self.sequence or (need_query and not self.query):
            raise ValueError(f"{where}: a sequence group needs query features and sequence features")
        self.query_dim = sum(inputs[n].width for n in self.query)
        self.dim = sum(inputs[n].width for n in self.sequence)
        if self.query_dim > self.dim:
            raise ValueError(
                f"{where}: query widths add up to {self.query_dim} but sequence widths to {self.dim}; "
                "the query may be narrower than the sequence (zero-padded), not wider"
            )

    def forward(self, embeddings, seq_lengths, dense) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(query [B, query_dim], sequence [B, L, dim], lengths [B])``; a group without query
        features gives a ``[B, 0]`` query."""
        inputs = self.inputs[0]
        keys = [inputs.positions(n, embeddings, dense) for n in self.sequence]
        longest = max(k.shape[1] for k in keys)
        keys = [k if k.shape[1] == longest else F.pad(k, (0, 0, 0, longest - k.shape[1])) for k in keys]
        sequence = torch.cat(keys, dim=2)
        parts = [inputs.pooled(n, embeddings, seq_lengths, dense) for n in self.query]
        query = torch.cat(parts, dim=1) if parts else sequence.new_zeros(sequence.shape[0], 0)
        return query, sequence, seq_lengths[self.sequence[0]]


def _pad_query(query: torch.Tensor, dim: int) -> torch.Tensor:
    return query if query.shape[1] == dim else F.pad(query, (0, dim - query.shape[1]))


class DINAttention(nn.Module):
    """Deep Interest Network attention: a query ``[B, Dq]`` (zero-padded to ``D``) attends over a
    padded sequence ``[B, L, D]`` of ``lengths [B]``; scores from an MLP on ``[q, k, q - k, q * k]``,
    masked softmax over the valid positions; returns ``[B, D]`` (zeros for an empty sequence).

    ``pooling="mean"`` replaces attention with a masked mean (the no-attention baseline).
    """

    def __init__(
        self, dim: int, attn_hidden_units: Sequence[int], pooling: str = "attention", activation: str = "relu"
    ):
        super().__init__()
        self.dim = dim
        self.pooling = pooling
        if pooling == "attention":
            # No bias on the last layer: a softmax ignores a shift of all scores, so its gradient
            # is zero in theory and pure rounding noise in practice (which Adam would amplify).
            self.score = nn.Sequential(
                MLP(4 * dim, attn_hidden_units, activation), nn.Linear(attn_hidden_units[-1], 1, bias=False)
            )

    def forward(self, query: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if self.pooling == "mean":
            return masked_mean(keys, lengths)
        mask = sequence_mask(lengths, keys.shape[1])  # [B, L]
        return _attend(self._scores(_pad_query(query, self.dim), keys), mask, keys)

    def _scores(self, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[B, L]``: the score MLP on ``[q, k, q - k, q * k]`` at every position, its first
        layer ``W = [Wq | Wk | Wd | Wm]`` factored — ``(Wq + Wd) q + b`` once a row, ``(Wk - Wd) k
        + Wm (q * k)`` at each position: the same function with half the first layer's work and
        no ``[B, L, 4D]`` input (on a CPU the attention's forward and backward took 1.4x as long
        the plain way)."""
        mlp, out = self.score[0], self.score[1]
        assert isinstance(mlp, MLP)
        first = mlp[0]
        assert isinstance(first, nn.Linear)
        wq, wk, wd, wm = first.weight.split(self.dim, dim=1)
        row = F.linear(q, wq + wd, first.bias)  # [B, H]
        h = F.linear(keys, wk - wd) + F.linear(q[:, None, :] * keys, wm) + row[:, None, :]
        for layer in list(mlp)[1:]:
            h = layer(h)
        return out(h).squeeze(-1)


def _attend(logits: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Masked softmax of ``logits [B, L]`` over the valid positions, the keys ``[B, L, D]`` summed
    by it: ``[B, D]``, zeros for an empty sequence."""
    # the dtype's lowest value (float16's is -65504): its exp is 0 beside any valid position's
    w = torch.softmax(logits.masked_fill(~mask, torch.finfo(logits.dtype).min), dim=1) * mask.to(keys.dtype)
    return torch.bmm(w[:, None, :], keys).squeeze(1)


class SimpleAttention(nn.Module):
    """Dot-product attention without parameters (TorchEasyRec's ``simple_attention``): softmax of
    ``keys @ query`` over the valid positions sums the keys, ``[B, D]``; the query as wide as the
    sequence."""

    def forward(self, query: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        logits = torch.bmm(keys, query[:, :, None]).squeeze(-1)
        return _attend(logits, sequence_mask(lengths, keys.shape[1]), keys)


class SequencePooling(nn.Module):
    """The sequence's valid positions averaged or summed (``pooling_type``), ``[B, D]``."""

    def __init__(self, pooling_type: str):
        super().__init__()
        self.pooling_type = pooling_type

    def forward(self, query: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return masked_mean(keys, lengths) if self.pooling_type == "mean" else masked_sum(keys, lengths)


def sequence_encoder(where: str, cfg: SequenceEncoderCfg, group: SequenceGroup) -> nn.Module:
    """The encoder ``cfg`` over ``group``: a module ``(query, sequence, lengths) -> [B, group.dim]``."""
    if cfg.din_encoder is not None:
        e = cfg.din_encoder
        return DINAttention(group.dim, e.attn_hidden_units, "attention", e.activation)
    if cfg.simple_attention is not None:
        if group.query_dim != group.dim:
            raise ValueError(
                f"{where}: simple_attention takes a query as wide as the sequence; "
                f"query widths add up to {group.query_dim}, sequence widths to {group.dim}"
            )
        return SimpleAttention()
    assert cfg.pooling_encoder is not None
    return SequencePooling(cfg.pooling_encoder.pooling_type)
