"""KeyedJaggedTensor-shaped input, with no torchrec dependency.

dynarec's tables accept any object with torchrec ``KeyedJaggedTensor``'s accessors
(``keys()``, ``values()``, ``lengths()``, ``weights_or_none()``): torchrec's KJT where it is
installed, :class:`JaggedBatch` everywhere else. The layout is key-major: ``lengths`` holds
``len(keys) * B`` entries, feature 0's B lengths first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Protocol, Sequence

import torch

__all__ = ["KeyedJaggedLike", "JaggedBatch", "FeatureSlice", "split_features"]


class KeyedJaggedLike(Protocol):
    def keys(self) -> list[str]: ...
    def values(self) -> torch.Tensor: ...
    def lengths(self) -> torch.Tensor: ...
    def weights_or_none(self) -> Optional[torch.Tensor]: ...


@dataclass
class JaggedBatch:
    """A minimal KeyedJaggedTensor: ``values`` int64 ``[sum(lengths)]``, ``lengths`` int64
    ``[len(keys) * B]``, optional float32 ``weights`` aligned with ``values``."""

    _keys: list[str]
    _values: torch.Tensor
    _lengths: torch.Tensor
    _weights: Optional[torch.Tensor] = None

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return torch.cat([self._lengths.new_zeros(1), torch.cumsum(self._lengths, 0)])

    def weights_or_none(self) -> Optional[torch.Tensor]:
        return self._weights

    def stride(self) -> int:
        return self._lengths.numel() // max(len(self._keys), 1)

    def to(self, device: torch.device | str) -> "JaggedBatch":
        w = None if self._weights is None else self._weights.to(device)
        return JaggedBatch(list(self._keys), self._values.to(device), self._lengths.to(device), w)

    @classmethod
    def from_lists(
        cls,
        features: Mapping[str, Sequence[Sequence[int]]],
        weights: Optional[Mapping[str, Sequence[Sequence[float]]]] = None,
    ) -> "JaggedBatch":
        """Builds a batch from ``{feature: [ids of sample 0, ids of sample 1, ...]}``; every
        feature must have the same number of samples. ``weights`` (optional) mirrors it."""
        keys = list(features)
        sizes = {len(v) for v in features.values()}
        if len(sizes) > 1:
            raise ValueError(f"features have different batch sizes: {sorted(sizes)}")
        values = [i for k in keys for sample in features[k] for i in sample]
        lengths = [len(sample) for k in keys for sample in features[k]]
        w = None
        if weights is not None:
            w = torch.tensor(
                [x for k in keys for sample in weights[k] for x in sample], dtype=torch.float32
            )
        return cls(
            keys,
            torch.tensor(values, dtype=torch.int64),
            torch.tensor(lengths, dtype=torch.int64),
            w,
        )


@dataclass
class FeatureSlice:
    """One feature of a batch: ``values [n]`` int64, ``lengths [B]`` int64, ``weights [n]``."""

    name: str
    values: torch.Tensor
    lengths: torch.Tensor
    weights: Optional[torch.Tensor]


def split_features(kjt: KeyedJaggedLike) -> dict[str, FeatureSlice]:
    """Splits a KJT-shaped batch into per-feature slices, validating its layout.

    Raises ValueError naming the feature for negative lengths, and for lengths that do not
    add up to the number of values.
    """
    keys = list(kjt.keys())
    values = kjt.values()
    lengths = kjt.lengths()
    weights = kjt.weights_or_none()
    if values.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ids must be int64 (or int32), got {values.dtype}")
    values = values.long()
    lengths = lengths.long()
    if keys and lengths.numel() % len(keys) != 0:
        raise ValueError(f"lengths has {lengths.numel()} entries, not a multiple of {len(keys)} keys")
    batch = lengths.numel() // max(len(keys), 1)
    per_key = lengths.view(len(keys), batch) if keys else lengths.view(0, 0)
    if lengths.numel() and bool((lengths < 0).any()):
        bad = int(torch.nonzero((per_key < 0).any(dim=1))[0])
        raise ValueError(
            f"feature '{keys[bad]}' has a negative length ({int(per_key[bad].min())})"
        )
    totals = per_key.sum(dim=1).tolist()
    if sum(totals) != values.numel():
        raise ValueError(
            f"lengths add up to {sum(totals)} ids but values holds {values.numel()}"
        )
    if weights is not None and weights.numel() != values.numel():
        raise ValueError(f"weights has {weights.numel()} entries, values {values.numel()}")
    out: dict[str, FeatureSlice] = {}
    start = 0
    for i, key in enumerate(keys):
        end = start + int(totals[i])
        out[key] = FeatureSlice(
            key,
            values[start:end],
            per_key[i],
            None if weights is None else weights[start:end].float(),
        )
        start = end
    return out
