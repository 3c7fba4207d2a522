"""Building blocks shared by the models: MLPs, DIN attention, feature-group inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dynarec.config.schema import Config, FeatureGroupCfg, RawFeatureCfg, SequenceFeatureCfg

__all__ = ["MLP", "DINAttention", "DeepGroup", "SequenceGroup", "masked_mean", "sequence_mask"]


class MLP(nn.Sequential):
    """Linear + ReLU layers: ``[B, in_dim] -> [B, hidden_units[-1]]``."""

    out_dim: int

    def __init__(self, in_dim: int, hidden_units: Sequence[int]):
        layers: list[nn.Module] = []
        for units in hidden_units:
            layers += [nn.Linear(in_dim, units), nn.ReLU()]
            in_dim = units
        super().__init__(*layers)
        self.out_dim = in_dim


def sequence_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[B, max_len]`` bool: position ``l`` of sample ``b`` holds an element (``l < lengths[b]``)."""
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


def masked_mean(seq: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean of each sample's first ``lengths[b]`` rows of a padded ``[B, L, D]``: ``[B, D]``,
    zeros for an empty sequence. What the padding holds, and how long ``L`` is (the longest
    sequence of the batch), never changes the result: a row's score depends on that row alone.
    Every model pools a sequence through here."""
    mask = sequence_mask(lengths, seq.shape[1]).to(seq.dtype)
    return torch.bmm(mask[:, None, :], seq).squeeze(1) / lengths.clamp(min=1).to(seq.dtype)[:, None]


class DINAttention(nn.Module):
    """Deep Interest Network attention: a query ``[B, D]`` attends over a padded sequence
    ``[B, L, D]`` of ``lengths [B]``; scores from an MLP on ``[q, k, q - k, q * k]``, masked
    softmax over the valid positions; returns ``[B, D]`` (zeros for an empty sequence).

    ``pooling="mean"`` replaces attention with a masked mean (the no-attention baseline).
    """

    def __init__(self, dim: int, attn_hidden_units: Sequence[int], pooling: str = "attention"):
        super().__init__()
        self.pooling = pooling
        if pooling == "attention":
            # No bias on the last layer: a softmax ignores a shift of all scores, so its gradient
            # is zero in theory and pure rounding noise in practice (which Adam would amplify).
            self.score = nn.Sequential(MLP(4 * dim, attn_hidden_units), nn.Linear(attn_hidden_units[-1], 1, bias=False))

    def forward(self, query: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if self.pooling == "mean":
            return masked_mean(keys, lengths)
        mask = sequence_mask(lengths, keys.shape[1])  # [B, L]
        q = query[:, None, :].expand_as(keys)
        logits = self.score(torch.cat([q, keys, q - keys, q * keys], dim=-1)).squeeze(-1)
        logits = logits.masked_fill(~mask, -1e9)
        w = torch.softmax(logits, dim=1) * mask.to(keys.dtype)
        return torch.bmm(w[:, None, :], keys).squeeze(1)


def _dims(config: Config) -> dict[str, int]:
    return {f.feature_name: (1 if isinstance(f, RawFeatureCfg) else f.embedding_dim) for f in config.features()}


class DeepGroup(nn.Module):
    """A deep (or wide) group: its pooled embeddings and dense features concatenated,
    ``[B, out_dim]``. Sequence features in a deep group are mean-pooled."""

    out_dim: int

    def __init__(self, config: Config, group: FeatureGroupCfg):
        super().__init__()
        dims = _dims(config)
        self.names = list(group.feature_names)
        self.kinds = {
            n: (
                "dense"
                if isinstance(config.feature(n), RawFeatureCfg)
                else "sequence"
                if isinstance(config.feature(n), SequenceFeatureCfg)
                else "pooled"
            )
            for n in self.names
        }
        self.out_dim = sum(dims[n] for n in self.names)

    def parts(self, embeddings, seq_lengths, dense) -> list[torch.Tensor]:
        out = []
        for n in self.names:
            kind = self.kinds[n]
            if kind == "dense":
                out.append(dense[n][:, None])
            elif kind == "sequence":
                out.append(masked_mean(embeddings[n], seq_lengths[n]))
            else:
                out.append(embeddings[n])
        return out

    def forward(self, embeddings, seq_lengths, dense) -> torch.Tensor:
        return torch.cat(self.parts(embeddings, seq_lengths, dense), dim=1)


class SequenceGroup(nn.Module):
    """A sequence group: its id features form the query ``[B, Dq]`` and its sequence features
    the keys ``[B, L, Dq]`` (each concatenated along the dim, in the group's order)."""

    dim: int

    def __init__(self, config: Config, group: FeatureGroupCfg):
        super().__init__()
        dims = _dims(config)
        self.query = [
            n for n in group.feature_names if not isinstance(config.feature(n), (SequenceFeatureCfg, RawFeatureCfg))
        ]
        self.sequence = [n for n in group.feature_names if isinstance(config.feature(n), SequenceFeatureCfg)]
        where = f"model.feature_groups '{group.group_name}'"
        if any(isinstance(config.feature(n), RawFeatureCfg) for n in group.feature_names):
            raise ValueError(f"{where}: a sequence group takes id and sequence features, not raw features")
        if not self.query or not self.sequence:
            raise ValueError(f"{where}: a sequence group needs query (id) features and sequence features")
        self.dim = sum(dims[n] for n in self.query)
        seq_dim = sum(dims[n] for n in self.sequence)
        if seq_dim != self.dim:
            raise ValueError(f"{where}: query dims add up to {self.dim} but sequence dims to {seq_dim}")

    def forward(self, embeddings, seq_lengths):
        query = torch.cat([embeddings[n] for n in self.query], dim=1)
        keys = torch.cat([embeddings[n] for n in self.sequence], dim=2)
        return query, keys, seq_lengths[self.sequence[0]]
