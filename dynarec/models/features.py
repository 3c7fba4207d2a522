"""How each feature reaches a dense model, and the dense layers of the features themselves.

A feature feeds the model one of four things (a :class:`FeatureInput`):

- ``pooled``: a table's pooled rows ``[B, D]`` (an id feature);
- ``sequence``: a table's rows of a sequence ``[B, L, D]`` (an id sequence);
- ``dense``: numbers ``[B]`` or ``[B, value_dim]``, or, with ``autodis`` / ``mlp``, their
  embedding ``[B, D]`` computed here (TorchEasyRec's dense embeddings);
- ``dense_sequence``: numbers of a sequence ``[B, L, value_dim]``.

:class:`FeatureInputs` holds the dense embeddings (one per feature, shared by every group that
reads it) and gives each group its members as it needs them: pooled ``[B, width]`` for deep
groups (a sequence mean-pooled over its valid positions), or ``[B, L, width]`` for the keys of a
sequence group.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import sqrt
from typing import Literal, Optional

import torch
from torch import nn

from dynarec.config.features import SequenceFeatureCfg
from dynarec.config.schema import Config
from dynarec.models.pooling import masked_mean

__all__ = ["AutoDisEmbedding", "FeatureInput", "FeatureInputs", "MLPEmbedding", "feature_input", "sequence_names"]

Kind = Literal["pooled", "sequence", "dense", "dense_sequence"]


@dataclass(frozen=True)
class FeatureInput:
    """``name`` reaches the model as ``kind``, ``width`` wide at each position; a dense feature's
    ``value_dim`` numbers (embedded by ``dense_embedding`` when given: ``"autodis"`` / ``"mlp"``)."""

    name: str
    kind: Kind
    width: int
    value_dim: int = 1
    dense_embedding: Optional[str] = None


def feature_input(config: Config, name: str) -> FeatureInput:
    """The :class:`FeatureInput` of feature ``name`` of ``config``."""
    f = config.feature(name)
    if f.embedded:
        return FeatureInput(name, "sequence" if f.is_sequence else "pooled", int(f.embedding_dim))
    value_dim = int(f.value_dim)
    if f.is_sequence:
        return FeatureInput(name, "dense_sequence", value_dim, value_dim)
    width = int(f.embedding_dim) if f.dense_embedding is not None else value_dim
    return FeatureInput(name, "dense", width, value_dim, f.dense_embedding)


def element_poolings(config: Config) -> dict[str, str]:
    """``{name: pooling}`` of the sequence features of several ids an element (``value_dim: 0``):
    how each element's ids are pooled before the model reads the sequence."""
    return {
        f.feature_name: f.pooling
        for f in config.features()
        if isinstance(f, SequenceFeatureCfg) and f.several_ids_an_element
    }


def sequence_names(config: Config) -> list[str]:
    """Every sequence feature of ``config`` (ids or numbers): their lengths reach the model."""
    return [
        f.feature_name
        for f in config.features()
        if feature_input(config, f.feature_name).kind in ("sequence", "dense_sequence")
    ]


class AutoDisEmbedding(nn.Module):
    """AutoDis (Guo et al., 2021; TorchEasyRec's formulas) for one number a row: ``h =
    leaky_relu(w x)`` over ``num_channels`` channels, ``h' = M h + keep_prob * h``, channel weights
    ``softmax(h' / temperature)``, the embedding their mix of ``num_channels`` meta-embeddings:
    ``[B] -> [B, D]``."""

    def __init__(self, dim: int, num_channels: int, temperature: float, keep_prob: float):
        super().__init__()
        self.temperature, self.keep_prob = temperature, keep_prob
        self.meta = nn.Parameter(torch.randn(num_channels, dim))
        self.proj_w = nn.Parameter(torch.randn(num_channels) * sqrt(2 / (1 + num_channels)))
        self.proj_m = nn.Parameter(torch.randn(num_channels, num_channels) * sqrt(1 / num_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = nn.functional.leaky_relu(x.reshape(-1, 1) * self.proj_w)  # [B, C]
        mixed = hidden @ self.proj_m.T + self.keep_prob * hidden
        return torch.softmax(mixed / self.temperature, dim=-1) @ self.meta


class MLPEmbedding(nn.Module):
    """A linear map without bias (TorchEasyRec's ``mlp {}`` dense embedding): ``[B]`` or
    ``[B, value_dim]`` -> ``[B, D]``."""

    def __init__(self, dim: int, value_dim: int):
        super().__init__()
        self.value_dim = value_dim
        self.proj_w = nn.Parameter(torch.randn(value_dim, dim) * sqrt(2 / (value_dim + dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, self.value_dim) @ self.proj_w


def _dense_embedding(config: Config, fi: FeatureInput) -> nn.Module:
    f = config.feature(fi.name)
    if fi.dense_embedding == "autodis":
        a = f.autodis
        if fi.value_dim != 1:
            raise ValueError(f"feature '{fi.name}': autodis embeds one number a row, value_dim is {fi.value_dim}")
        return AutoDisEmbedding(fi.width, a.num_channels, a.temperature, a.keep_prob)
    return MLPEmbedding(fi.width, fi.value_dim)


class FeatureInputs(nn.Module):
    """Every feature of ``config`` as the dense model reads it (see the module doc); owns the
    features' dense embeddings."""

    def __init__(self, config: Config):
        super().__init__()
        self.inputs = {f.feature_name: feature_input(config, f.feature_name) for f in config.features()}
        self.embed = nn.ModuleDict(
            {n: _dense_embedding(config, fi) for n, fi in self.inputs.items() if fi.dense_embedding is not None}
        )

    def __getitem__(self, name: str) -> FeatureInput:
        return self.inputs[name]

    def pooled(self, name: str, embeddings, seq_lengths, dense) -> torch.Tensor:
        """``[B, width]``: a sequence mean-pooled over its valid positions."""
        fi = self.inputs[name]
        if fi.kind == "pooled":
            return embeddings[name]
        if fi.kind == "sequence":
            return masked_mean(embeddings[name], seq_lengths[name])
        if fi.kind == "dense_sequence":
            return masked_mean(dense[name].reshape(*dense[name].shape[:2], -1), seq_lengths[name])
        x = dense[name]
        if fi.dense_embedding is not None:
            return self.embed[name](x)
        return x.reshape(x.shape[0], -1)

    def positions(self, name: str, embeddings, dense) -> torch.Tensor:
        """A sequence's ``[B, L, width]`` (``L`` the batch's longest of this feature)."""
        fi = self.inputs[name]
        if fi.kind == "sequence":
            return embeddings[name]
        x = dense[name]
        return x.reshape(*x.shape[:2], -1)

    def concatenated(self, names: list[str], embeddings, dense) -> torch.Tensor:
        """Sequences read position by position: their :meth:`positions` side by side, ``[B, L, sum of
        widths]``."""
        return torch.cat([self.positions(n, embeddings, dense) for n in names], dim=-1)
