"""A dynamic table's slots: its hash index, the rows behind it, and how both grow.

Slot ``s`` of the index is row ``s`` of the table's row store. The index starts at
``init_buckets`` buckets and doubles (every key rehashed into the larger index, its row moved
bit-exactly) up to ``max_buckets``; a load installs an index of any size in between. Growth moves
rows, so it waits while a step other than the current one is pending (that step's backward will
update rows at the slots its lookup saw).

The counters of what capacity did to keys live here too, journaled with everything else a step
changes: ``dropped`` (keys left without a row), ``evicted`` (keys whose row a new key took),
``premature`` (of those, evicted while a slot was free somewhere), ``moved`` (residents moved to
their other bucket).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from dynarec.embedding.hash_index import BucketedHashIndex
from dynarec.embedding.row_store import RowStore
from dynarec.embedding.step import Journal

__all__ = ["Capacity", "num_buckets", "rows_before_last_growth", "shard_init_capacity", "whole_buckets"]


def num_buckets(capacity: int, bucket_size: int) -> int:
    """Buckets of ``bucket_size`` slots in ``capacity`` slots (at least one)."""
    return max(1, capacity // bucket_size)


def whole_buckets(capacity: int, bucket_size: int) -> int:
    """The slots of :func:`num_buckets` buckets: ``capacity`` in whole buckets (at least one)."""
    return num_buckets(capacity, bucket_size) * bucket_size


def shard_init_capacity(init_capacity: int, world_size: int, bucket_size: int, capacity_per_rank: int) -> int:
    """A key-hash shard's initial capacity: its share of the table's, whole buckets, at least one,
    at most the shard's max capacity."""
    share = max(bucket_size, -(-init_capacity // world_size // bucket_size) * bucket_size)
    return min(share, capacity_per_rank)


def rows_before_last_growth(init_capacity: int, max_capacity: int, bucket_size: int) -> int:
    """Rows a table growing by doubling from ``init_capacity`` holds just before it grows to
    ``max_capacity`` for the last time (0: it starts there and never grows)."""
    b, max_b = num_buckets(init_capacity, bucket_size), num_buckets(max_capacity, bucket_size)
    if b >= max_b:
        return 0
    while b * 2 < max_b:
        b *= 2
    return b * bucket_size


class Capacity:
    """The index of a dynamic table and its ``store``'s rows, from ``init_buckets`` to
    ``max_buckets`` buckets of ``bucket_size`` slots; an insert grows them when the load would
    pass ``growth_load_factor``."""

    def __init__(
        self,
        store: RowStore,
        bucket_size: int,
        init_buckets: int,
        max_buckets: int,
        growth_load_factor: float,
        device: torch.device,
        index: Optional[BucketedHashIndex] = None,
    ):
        """``index``: a partition of an index shared with other tables (``IndexStorage``; a
        table that never grows: ``init_buckets`` at ``max_buckets``), instead of an index of
        its own; a load copies its keys into it."""
        self.store = store
        self.bucket_size = bucket_size
        self.init_buckets = init_buckets
        self.max_buckets = max_buckets
        self.growth_load_factor = growth_load_factor
        self.device = device
        self.shared = index is not None
        if index is not None and not index.num_buckets == init_buckets == max_buckets:
            raise ValueError(f"a shared index is of a table that never grows, of {max_buckets} buckets")
        self.index = self.new_index(init_buckets) if index is None else index
        self.counters = {"dropped": 0, "evicted": 0, "premature": 0, "moved": 0}

    @property
    def slots(self) -> int:
        """Slots (rows) allocated now."""
        return self.index.capacity

    @property
    def max_slots(self) -> int:
        return self.max_buckets * self.bucket_size

    @property
    def at_max(self) -> bool:
        return self.index.num_buckets == self.max_buckets

    def new_index(self, num_buckets: int) -> BucketedHashIndex:
        """An empty index of ``num_buckets`` buckets of this table's size, on its device."""
        return BucketedHashIndex(num_buckets, self.bucket_size, self.device)

    def can_grow(self, pending_steps: int) -> bool:
        """Whether the index may grow now: below ``max_buckets``, and no step but the current one
        pending (``pending_steps``: how many are)."""
        return self.index.num_buckets < self.max_buckets and pending_steps <= 1

    def crowded(self, new_keys: int) -> bool:
        """Whether ``new_keys`` more keys would pass the growth load."""
        return self.index.size + new_keys > self.growth_load_factor * self.index.capacity

    def buckets_for(self, keys: int, limit: Optional[float] = None) -> int:
        """The fewest buckets, from ``init_buckets`` doubling, that hold ``keys`` keys at the
        growth load (at most ``limit``, default ``max_buckets``)."""
        limit = self.max_buckets if limit is None else limit
        buckets = self.init_buckets
        while buckets < limit and keys > self.growth_load_factor * buckets * self.bucket_size:
            buckets = int(min(limit, buckets * 2))
        return buckets

    def grow(self, journal: Optional[Journal]) -> None:
        """Doubles the buckets (at most ``max_buckets``), moving every row; ``journal`` records
        how to put back the index, the rows and the counters as they were."""
        if journal is None:  # nothing to undo (a host-memory tier's storage() writes its cache back)
            self._rehash(min(self.max_buckets, self.index.num_buckets * 2))
            return
        old = (self.index, self.store.storage(), dict(self.counters))
        self._rehash(min(self.max_buckets, self.index.num_buckets * 2))
        journal.record(lambda: self._restore(*old))

    def install(self, index: BucketedHashIndex) -> None:
        """Replaces the index by ``index`` (a load's), with fresh rows for each of its slots; a
        shared index's partition takes ``index``'s keys in place."""
        self.index = index if not self.shared else self.index.storage.adopt(self.index.part, index)
        self.store.reallocate(index.capacity)

    def count(self, journal: Optional[Journal], **counts: int) -> None:
        """Adds to the counters (``dropped``, ``evicted``, ``premature``, ``moved``);
        ``journal`` records how to take them back."""
        before = dict(self.counters)
        for name, n in counts.items():
            self.counters[name] += n

        def undo() -> None:
            self.counters.update(before)

        if journal is not None and any(counts.values()):
            journal.record(undo)

    def _restore(self, index: BucketedHashIndex, storage: Any, counters: dict[str, int]) -> None:
        self.index = index
        self.store.restore_storage(storage)
        self.counters = counters

    @torch.no_grad()
    def _rehash(self, num_buckets: int) -> None:
        """Moves every row into an index of ``num_buckets`` (more than now) buckets; doubles again
        while a key finds no slot there, below ``max_buckets``."""
        index, src, dst = self.index.rehashed(num_buckets)
        while src.numel() < self.index.size and index.num_buckets < self.max_buckets:  # a bucket pair overflowed
            index, src, dst = self.index.rehashed(min(self.max_buckets, index.num_buckets * 2))
        lost = self.index.size - src.numel()  # only at max_capacity: rare with 16-slot buckets
        self.count(None, evicted=lost, premature=lost)
        self.store.resize(index.capacity, src, dst)
        self.index = index
