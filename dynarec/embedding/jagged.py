"""KeyedJaggedTensor-shaped input, with no torchrec dependency.

dynarec's tables accept any object with torchrec ``KeyedJaggedTensor``'s accessors
(``keys()``, ``values()``, ``lengths()``, ``weights_or_none()``): torchrec's KJT where it is
installed, :class:`JaggedBatch` everywhere else. The layout is key-major: ``lengths`` holds
``len(keys) * B`` entries, feature 0's B lengths first.

Splitting a batch into features needs each feature's id count on the host. A
:class:`JaggedBatch` built from CPU tensors computes them (and each feature's longest sample)
once, on the CPU, and carries them through ``to(device)``, so a GPU step never waits on the
device for them; torchrec's KJT gives ``length_per_key()`` (cached by torchrec).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

__all__ = [
    "FeatureSlice",
    "JaggedBatch",
    "KeyedJaggedLike",
    "as_jagged",
    "checked_layout",
    "moved_ids",
    "split_features",
]


class KeyedJaggedLike(Protocol):
    def keys(self) -> list[str]: ...
    def values(self) -> torch.Tensor: ...
    def lengths(self) -> torch.Tensor: ...
    def weights_or_none(self) -> Optional[torch.Tensor]: ...


@dataclass(frozen=True)
class _HostStats:
    """Per key: ids (sum of lengths), longest sample, shortest length (negative: invalid); and
    ``(smallest, largest)`` id where the batch's maker worked them out beside its ids (a
    DataLoader worker: the training process then checks ids against its tables without reading
    them; ``(0, -1)`` for a key without ids), else None; and whether every per-id weight is a
    finite number, where the maker checked it, else None."""

    length_per_key: tuple[int, ...]
    max_length_per_key: tuple[int, ...]
    min_length_per_key: tuple[int, ...]
    id_range_per_key: Optional[tuple[tuple[int, int], ...]] = None
    weights_finite: Optional[bool] = None


# The integer types a batch's ids and lengths may have: a user's (torchrec's KJT: int64 or int32),
# and the narrower ones a batch travels as from a DataLoader worker (dynarec.data.transport).
_ID_TYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _host_stats(keys: Sequence[str], lengths: torch.Tensor) -> _HostStats:
    if not keys:
        if lengths.numel():
            raise ValueError(f"lengths has {lengths.numel()} entries but the batch has no keys")
        return _HostStats((), (), ())
    if lengths.numel() % len(keys) != 0:
        raise ValueError(f"lengths has {lengths.numel()} entries, not a multiple of {len(keys)} keys")
    per_key = lengths.long().view(len(keys), -1)
    if per_key.shape[1] == 0:
        zeros = (0,) * len(keys)
        return _HostStats(zeros, zeros, zeros)
    # One transfer of 3 * F numbers (free when lengths are on the CPU).
    stats = torch.stack([per_key.sum(1), per_key.max(1).values, per_key.min(1).values]).tolist()
    return _HostStats(tuple(stats[0]), tuple(stats[1]), tuple(stats[2]))


@dataclass
class JaggedBatch:
    """A minimal KeyedJaggedTensor: ``values`` int64 ``[sum(lengths)]``, ``lengths`` int64
    ``[len(keys) * B]``, optional float32 ``weights`` aligned with ``values``. On the host,
    ``values`` and ``lengths`` may be of a narrower integer type (a page-locked batch from a
    DataLoader worker, as it travelled: dynarec.data.transport); :meth:`to` a device widens them
    there, after the copy."""

    _keys: list[str]
    _values: torch.Tensor
    _lengths: torch.Tensor
    _weights: Optional[torch.Tensor] = None
    _stats: Optional[_HostStats] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self._stats is None and self._lengths.device.type == "cpu":
            self._stats = _host_stats(self._keys, self._lengths)

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

    def length_per_key(self) -> list[int]:
        return list(self.host_stats().length_per_key)

    def host_stats(self) -> _HostStats:
        if self._stats is None:
            self._stats = _host_stats(self._keys, self._lengths)
        return self._stats

    def with_id_ranges(self, ranges: Sequence[tuple[int, int]], weights_finite: Optional[bool] = None) -> JaggedBatch:
        """This batch, its host statistics holding ``ranges``: each key's ``(smallest, largest)``
        id (``(0, -1)``: none), and ``weights_finite`` (whether every weight is a finite number),
        as its maker computed them."""
        if len(ranges) != len(self._keys):
            raise ValueError(f"{len(ranges)} id ranges for {len(self._keys)} keys")
        ranges = tuple((int(a), int(b)) for a, b in ranges)
        stats = dataclasses.replace(self.host_stats(), id_range_per_key=ranges, weights_finite=weights_finite)
        return JaggedBatch(self._keys, self._values, self._lengths, self._weights, stats)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedBatch:
        """A copy on ``device``, its ids and lengths int64 (widened there where they are narrower)."""
        w = None if self._weights is None else self._weights.to(device, non_blocking=non_blocking)
        return JaggedBatch(
            list(self._keys),
            moved_ids(self._values, device, non_blocking),
            moved_ids(self._lengths, device, non_blocking),
            w,
            self._stats,
        )

    def pin_memory(self) -> JaggedBatch:
        """A copy in page-locked host memory (its copy to a GPU can overlap the GPU's work)."""
        w = None if self._weights is None else self._weights.pin_memory()
        return JaggedBatch(list(self._keys), self._values.pin_memory(), self._lengths.pin_memory(), w, self._stats)

    @classmethod
    def from_lists(
        cls,
        features: Mapping[str, Sequence[Sequence[int]]],
        weights: Optional[Mapping[str, Sequence[Sequence[float]]]] = None,
    ) -> JaggedBatch:
        """Builds a batch from ``{feature: [ids of sample 0, ids of sample 1, ...]}``; every
        feature must have the same number of samples. ``weights`` (optional) mirrors it, a
        weight an id; a feature it leaves out weighs its ids 1.0 (as a batch of a config's
        weighted and unweighted features does). ValueError naming the feature whose weights do
        not match its ids, or a weighted feature the batch lacks."""
        keys = list(features)
        sizes = {len(v) for v in features.values()}
        if len(sizes) > 1:
            raise ValueError(f"features have different batch sizes: {sorted(sizes)}")
        values = [i for k in keys for sample in features[k] for i in sample]
        lengths = [len(sample) for k in keys for sample in features[k]]
        w = None
        if weights is not None:
            unknown = sorted(set(weights) - set(keys))
            if unknown:
                raise ValueError(f"weights of feature(s) {unknown} the batch does not have; its features: {keys}")
            for k, ws in weights.items():
                counts = [len(sample) for sample in features[k]]
                if [len(sample) for sample in ws] != counts:
                    raise ValueError(f"weights of feature '{k}' do not match its ids: {counts} ids a sample")
            w = torch.tensor(
                [x for k in keys for sample in weights.get(k, [[1.0] * len(s) for s in features[k]]) for x in sample],
                dtype=torch.float32,
            )
        return cls(keys, torch.tensor(values, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64), w)


@dataclass
class FeatureSlice:
    """One feature of a batch: ``values [n]`` int64, ``lengths [B]`` int64, ``weights [n]``
    float32 or None; ``num_ids`` (= n) and ``max_length`` (the longest sample) on the host."""

    name: str
    values: torch.Tensor
    lengths: torch.Tensor
    weights: Optional[torch.Tensor]
    num_ids: int
    max_length: int

    def to(self, device: torch.device, non_blocking: bool = False) -> FeatureSlice:
        """A copy on ``device``, its ids and lengths int64 (widened there where they are narrower)."""
        if self.values.device == device and self.values.dtype == self.lengths.dtype == torch.int64:
            return self
        w = None if self.weights is None else self.weights.to(device, non_blocking=non_blocking)
        return FeatureSlice(
            self.name,
            moved_ids(self.values, device, non_blocking),
            moved_ids(self.lengths, device, non_blocking),
            w,
            self.num_ids,
            self.max_length,
        )


def moved_ids(t: torch.Tensor, device: torch.device | str, non_blocking: bool = False) -> torch.Tensor:
    """Integer tensor ``t`` on ``device`` as int64: copied as it is, then widened on the device
    (torch would widen a host tensor bound for a GPU on the host, before its copy)."""
    return t.to(device, non_blocking=non_blocking).long()


def as_jagged(kjt: KeyedJaggedLike) -> JaggedBatch:
    """``kjt`` as a :class:`JaggedBatch` (itself if it is one): its host statistics (lengths per
    key) travel with its copies, so slicing a copy on a GPU reads nothing back."""
    if isinstance(kjt, JaggedBatch):
        return kjt
    return JaggedBatch(list(kjt.keys()), kjt.values(), kjt.lengths(), kjt.weights_or_none())


def split_features(kjt: KeyedJaggedLike, widen: bool = True) -> dict[str, FeatureSlice]:
    """Splits a KJT-shaped batch into per-feature slices, validating its layout; their ids and
    lengths int64 where ``widen``, else in the batch's own integer types (a batch split on the
    host only to be checked, before its copy to a device).

    Raises ValueError naming the feature for a negative length or a feature given twice, and
    for lengths that do not add up to the number of values; and for a variable-batch torchrec
    KJT (a batch size per feature), whose lengths do not split into one per sample and feature.
    """
    keys, values, lengths, weights, stats = checked_layout(kjt)
    if not keys:
        return {}
    # one split a tensor (views), not a slice a feature: this runs on every step's path
    sizes = list(stats.length_per_key)
    if widen:
        values, lengths = values.long(), lengths.long()
    per_key = lengths.view(len(keys), -1).unbind(0)
    ids = values.split(sizes)
    w = weights.float().split(sizes) if weights is not None else (None,) * len(keys)
    return {
        key: FeatureSlice(key, ids[i], per_key[i], w[i], sizes[i], stats.max_length_per_key[i])
        for i, key in enumerate(keys)
    }


def checked_layout(
    kjt: KeyedJaggedLike,
) -> tuple[list[str], torch.Tensor, torch.Tensor, Optional[torch.Tensor], _HostStats]:
    """A KJT-shaped batch's keys, values, lengths, weights and host statistics, its layout
    checked as :func:`split_features` says (no tensor read where the batch carries its
    statistics)."""
    variable_stride = getattr(kjt, "variable_stride_per_key", None)
    if variable_stride is not None and variable_stride() and len(set(kjt.stride_per_key())) > 1:  # type: ignore[attr-defined]
        raise ValueError(
            f"a variable-batch KeyedJaggedTensor (samples per feature {dict(zip(kjt.keys(), kjt.stride_per_key()))}) "  # type: ignore[attr-defined]
            "is not supported: give every feature of a batch the same samples (empty where it has no id)"
        )
    keys = list(kjt.keys())
    values = kjt.values()
    lengths = kjt.lengths()
    weights = kjt.weights_or_none()
    for name, t in (("values", values), ("lengths", lengths), ("weights", weights)):
        if t is not None and t.dim() != 1:
            raise ValueError(
                f"the batch's {name} must be 1-D (a jagged batch: every feature's ids one after another), got "
                f"shape {tuple(t.shape)} (features {keys})"
            )
    if values.dtype not in _ID_TYPES:
        raise ValueError(f"ids must be int64 (or int32), got {values.dtype}")
    if lengths.dtype not in _ID_TYPES:
        raise ValueError(f"lengths must be int64 (or int32), got {lengths.dtype}")
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"feature(s) {twice} appear more than once in the batch's keys {keys}")
    for name, t in (("lengths", lengths), ("weights", weights)):
        if t is not None and t.device != values.device:
            raise ValueError(
                f"{name} are on {t.device} but values on {values.device}; move the whole batch to one device"
            )
    stats = kjt.host_stats() if isinstance(kjt, JaggedBatch) else _host_stats(keys, lengths)
    for key, low in zip(keys, stats.min_length_per_key):
        if low < 0:
            raise ValueError(f"feature '{key}' has a negative length ({low})")
    total = sum(stats.length_per_key)
    if total != values.numel():
        raise ValueError(f"lengths add up to {total} ids but values holds {values.numel()}")
    if weights is not None and weights.numel() != values.numel():
        raise ValueError(f"weights has {weights.numel()} entries, values {values.numel()}")
    return keys, values, lengths, weights, stats
