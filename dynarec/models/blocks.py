"""Building blocks shared by the models: MLPs, DIN attention, feature-group inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dynarec.config.schema import Config, FeatureGroupCfg
from dynarec.models.features import FeatureInputs
from dynarec.models.pooling import masked_mean, sequence_mask

__all__ = ["MLP", "DINAttention", "DeepGroup", "Dice", "SequenceGroup", "masked_mean", "sequence_mask"]


class Dice(nn.Module):
    """DIN's data-adaptive activation (TorchEasyRec's): ``p = sigmoid(batch_norm(x))``,
    ``p * x + (1 - p) * alpha * x`` with ``alpha`` learned per unit (starting at 0). Over
    ``[B, units]`` or ``[B, L, units]`` (the statistics per unit over every row and position; in
    eval the running statistics, so a row's output depends on that row alone)."""

    def __init__(self, units: int):
        super().__init__()
        self.bn = nn.BatchNorm1d(units, affine=False)
        self.alpha = nn.Parameter(torch.zeros(units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        p = torch.sigmoid(self.bn(flat)).reshape(x.shape)
        return p * x + (1 - p) * self.alpha * x


class MLP(nn.Sequential):
    """Linear layers, each followed by ``activation`` (``relu`` or ``dice``): ``[..., in_dim] ->
    [..., hidden_units[-1]]``."""

    out_dim: int

    def __init__(self, in_dim: int, hidden_units: Sequence[int], activation: str = "relu"):
        layers: list[nn.Module] = []
        for units in hidden_units:
            layers += [nn.Linear(in_dim, units), Dice(units) if activation == "dice" else nn.ReLU()]
            in_dim = units
        super().__init__(*layers)
        self.out_dim = in_dim


class DINAttention(nn.Module):
    """Deep Interest Network attention: a query ``[B, D]`` attends over a padded sequence
    ``[B, L, D]`` of ``lengths [B]``; scores from an MLP on ``[q, k, q - k, q * k]``, masked
    softmax over the valid positions; returns ``[B, D]`` (zeros for an empty sequence).

    ``pooling="mean"`` replaces attention with a masked mean (the no-attention baseline).
    """

    def __init__(
        self, dim: int, attn_hidden_units: Sequence[int], pooling: str = "attention", activation: str = "relu"
    ):
        super().__init__()
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
        q = query[:, None, :].expand_as(keys)
        logits = self.score(torch.cat([q, keys, q - keys, q * keys], dim=-1)).squeeze(-1)
        logits = logits.masked_fill(~mask, -1e9)
        w = torch.softmax(logits, dim=1) * mask.to(keys.dtype)
        return torch.bmm(w[:, None, :], keys).squeeze(1)


class DeepGroup(nn.Module):
    """A deep (or wide) group: its members pooled and concatenated, ``[B, out_dim]`` (id
    features' rows, sequences mean-pooled, dense numbers or their dense embeddings; see
    :class:`~dynarec.models.features.FeatureInputs`, shared by the model's groups)."""

    out_dim: int

    def __init__(self, config: Config, group: FeatureGroupCfg, inputs: FeatureInputs):
        super().__init__()
        self.names = list(group.feature_names)
        self.inputs = [inputs]  # in a list: the model owns it (its parameters are not the group's)
        self.out_dim = sum(inputs[n].width for n in self.names)

    def parts(self, embeddings, seq_lengths, dense) -> list[torch.Tensor]:
        return [self.inputs[0].pooled(n, embeddings, seq_lengths, dense) for n in self.names]

    def forward(self, embeddings, seq_lengths, dense) -> torch.Tensor:
        return torch.cat(self.parts(embeddings, seq_lengths, dense), dim=1)


class SequenceGroup(nn.Module):
    """A sequence group: its non-sequence members form the query ``[B, Dq]`` and its sequence
    members the keys ``[B, L, Dq]`` (each concatenated along the last dim, in the group's order;
    id and dense members alike, dense ones as their numbers or dense embeddings); ``L`` the
    longest of its sequences in the batch, the lengths those of its first sequence."""

    dim: int

    def __init__(self, config: Config, group: FeatureGroupCfg, inputs: FeatureInputs):
        super().__init__()
        self.inputs = [inputs]
        kinds = {n: inputs[n].kind for n in group.feature_names}
        self.query = [n for n in group.feature_names if kinds[n] in ("pooled", "dense")]
        self.sequence = [n for n in group.feature_names if kinds[n] in ("sequence", "dense_sequence")]
        where = f"model.feature_groups '{group.group_name}'"
        if not self.query or not self.sequence:
            raise ValueError(f"{where}: a sequence group needs query features and sequence features")
        self.dim = sum(inputs[n].width for n in self.query)
        seq_dim = sum(inputs[n].width for n in self.sequence)
        if seq_dim != self.dim:
            raise ValueError(f"{where}: query widths add up to {self.dim} but sequence widths to {seq_dim}")

    def forward(self, embeddings, seq_lengths, dense):
        inputs = self.inputs[0]
        query = torch.cat([inputs.pooled(n, embeddings, seq_lengths, dense) for n in self.query], dim=1)
        keys = [inputs.positions(n, embeddings, dense) for n in self.sequence]
        longest = max(k.shape[1] for k in keys)
        keys = [k if k.shape[1] == longest else nn.functional.pad(k, (0, 0, 0, longest - k.shape[1])) for k in keys]
        return query, torch.cat(keys, dim=2), seq_lengths[self.sequence[0]]
