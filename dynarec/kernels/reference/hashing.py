"""The hash index's hashing and find, and the key-seeded uniform draws, in plain torch.

``mix64`` is SplitMix64's finalizer over int64 with wrap-around arithmetic (a bijection on 64
bits): the hash of the index, of sharding and of the key-seeded initializer. A key's two candidate
buckets are the low and the high 32 bits of ``mix64(key)``, each modulo the bucket count; its tag
is the top byte, 1 where that byte is 0 (:data:`~dynarec.kernels.layout.EMPTY_TAG` marks an empty
slot).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from dynarec.kernels.layout import EMPTY_TAG, NO_SLOT

__all__ = [
    "candidate_buckets",
    "find",
    "key_tags",
    "mix64",
    "uniform01",
    "uniform01_of_salt",
    "uniform_rows",
    "uniform_salt",
    "uniform_values",
]

_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # SplitMix64 multipliers as signed int64
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_LOW32 = (1 << 32) - 1


def _srl(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer over int64 with wrap-around arithmetic: a bijection on 64 bits."""
    x = x ^ _srl(x, 30)
    x = x * _M1
    x = x ^ _srl(x, 27)
    x = x * _M2
    return x ^ _srl(x, 31)


def candidate_buckets(
    keys: torch.Tensor,
    num_buckets: int,
    part_starts: Optional[torch.Tensor] = None,
    key_parts: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two candidate buckets of each key: ``(b1, b2)``, ``[n]`` int64 each. In a partitioned
    index (``part_starts``: ``[P + 1]`` int64, partition ``p`` holding the buckets from
    ``part_starts[p]`` to ``part_starts[p + 1]``; ``key_parts``: ``[n]`` int64, each key's
    partition), a key's buckets are its partition's first bucket plus the hash halves modulo the
    partition's bucket count: each partition hashes as an index of its own."""
    h = mix64(keys)
    lo, hi = h & _LOW32, (h >> 32) & _LOW32
    if part_starts is None:
        return lo % num_buckets, hi % num_buckets
    assert key_parts is not None, "a partitioned index's keys need their partitions"
    base = part_starts[key_parts]
    count = part_starts[key_parts + 1] - base
    return base + lo % count, base + hi % count


def key_tags(keys: torch.Tensor) -> torch.Tensor:
    """The tag of each key, ``[n]`` uint8 (never :data:`EMPTY_TAG`)."""
    tag = (mix64(keys) >> 56) & 0xFF
    return torch.where(tag == EMPTY_TAG, 1, tag).to(torch.uint8)


def find(
    table_keys: torch.Tensor,
    tags: torch.Tensor,
    num_buckets: int,
    bucket_size: int,
    query: torch.Tensor,
    flag: bool,
    part_starts: Optional[torch.Tensor] = None,
    query_parts: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots, absent)``: the slot of each query key in a two-choice bucketed index (``[n]``
    int64, :data:`NO_SLOT` where absent; ``table_keys`` int64 and ``tags`` uint8, a value a slot);
    ``absent``: with ``flag`` a ``[]`` int32, 1 if a key is absent, else ``[0]``. Gathers both
    buckets of every key and compares. A partitioned index (``part_starts``, ``query_parts``:
    :func:`candidate_buckets`) finds each key in its partition's buckets, and ``absent`` (with
    ``flag``) is ``[P]`` int32: 1 for each partition with an absent key."""
    n, bs = query.numel(), bucket_size
    b1, b2 = candidate_buckets(query, num_buckets, part_starts, query_parts)
    buckets = torch.cat([b1, b2])
    # Both buckets of every key as contiguous rows (one index_select each array).
    bucket_keys = table_keys.view(-1, bs).index_select(0, buckets)
    bucket_occ = tags.view(-1, bs).index_select(0, buckets) != EMPTY_TAG
    match = (bucket_keys == torch.cat([query, query])[:, None]) & bucket_occ
    hit, lane = match.view(torch.uint8).max(dim=1)  # one pass: whether and where
    slots = buckets * bs + lane
    none = torch.full_like(query, NO_SLOT)
    slots = torch.where(hit[:n].bool(), slots[:n], torch.where(hit[n:].bool(), slots[n:], none))
    if not flag:
        return slots, query.new_zeros(0, dtype=torch.int32)
    if part_starts is None:
        return slots, (slots == NO_SLOT).any().to(torch.int32)
    assert query_parts is not None
    absent = torch.zeros(part_starts.numel() - 1, dtype=torch.int32, device=query.device)
    return slots, absent.index_fill_(0, query_parts[slots == NO_SLOT], 1)


@functools.lru_cache(maxsize=1024)
def uniform_salt(seed: int, stream: int) -> int:
    """The salt of the draws of ``(seed, stream)``, an int64 hashed on the host (a scalar sent to
    the GPU would wait for the stream); kept per (seed, stream): a step draws with the same few."""
    return int(mix64(torch.tensor(seed * 4 + stream, dtype=torch.int64)))


def uniform01(keys: torch.Tensor, dim: int, seed: int, stream: int) -> torch.Tensor:
    """``[n, dim]`` float64 in (0, 1), from 53 hash bits of (seed, stream, key, column): column
    ``c`` of key ``k`` is ``(mix64(mix64(k ^ salt) + (c + 1) * golden) >> 11 + 0.5) / 2^53``."""
    return uniform01_of_salt(keys, dim, uniform_salt(seed, stream))


def uniform01_of_salt(keys: torch.Tensor, dim: int, salt: int) -> torch.Tensor:
    """:func:`uniform01` given its salt (any int, taken modulo 2^64)."""
    salt &= (1 << 64) - 1
    base = mix64(keys ^ (salt - (1 << 64) if salt >= 1 << 63 else salt))
    cols = torch.arange(1, dim + 1, dtype=torch.int64, device=keys.device) * _GOLDEN
    h = mix64(base[:, None] + cols[None, :])
    return (_srl(h, 11).double() + 0.5) * (1.0 / (1 << 53))


def uniform_values(u: torch.Tensor, bound: float) -> torch.Tensor:
    """U(-bound, bound) float32 from float64 draws ``u`` in (0, 1): ``(2u - 1) * bound`` in
    float64, each op rounded on its own, then rounded to float32. Writes into ``u``."""
    return u.mul_(2.0).sub_(1.0).mul_(bound).float()


def uniform_rows(
    out: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, seed: int, stream: int, bound: float
) -> None:
    """``out[rows[i]] = uniform_values(uniform01(keys, dim, seed, stream), bound)[i]`` in
    ``out``'s dtype (rounded to nearest): the uniform initializer's rows. ``out``: ``[num_rows,
    dim]``; ``rows``: distinct."""
    values = uniform_values(uniform01(keys, out.shape[1], seed, stream), bound)
    out.index_copy_(0, rows, values.to(out.dtype))
