"""A bucketed hash index: int64 key -> slot, with an int64 score per slot.

``capacity = num_buckets * bucket_size`` slots; a key lives only in its own bucket
(``mix64(key) mod num_buckets``), so a lookup gathers one bucket and compares. Every operation
is a batched tensor op with no Python loop per key, identical on CPU and CUDA, and
deterministic: inserts within a batch are ranked by sort, never raced with atomics.

The whole int64 range is a valid key: occupancy is a separate mask, no key value is reserved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dynarec.embedding.initializers import mix64

__all__ = ["BucketedHashIndex", "InsertPlan"]

_POSITIVE = (1 << 63) - 1


@dataclass
class InsertPlan:
    """Where each new key would go. ``slots[i] == -1``: key ``i`` found no slot (overflow).
    ``evicted_slots`` are the occupied slots the insert takes over (their keys are evicted)."""

    keys: torch.Tensor
    slots: torch.Tensor
    evicted_slots: torch.Tensor

    @property
    def overflow(self) -> torch.Tensor:
        return self.slots < 0


class BucketedHashIndex:
    def __init__(self, num_buckets: int, bucket_size: int, device: torch.device | str = "cpu"):
        if num_buckets < 1 or bucket_size < 1:
            raise ValueError(f"num_buckets and bucket_size must be >= 1, got {num_buckets}, {bucket_size}")
        self.num_buckets = num_buckets
        self.bucket_size = bucket_size
        self.device = torch.device(device)
        cap = num_buckets * bucket_size
        self.keys = torch.zeros(cap, dtype=torch.int64, device=self.device)
        self.scores = torch.zeros(cap, dtype=torch.int64, device=self.device)
        self.occupied = torch.zeros(cap, dtype=torch.bool, device=self.device)
        self._size = 0
        self._lanes = torch.arange(bucket_size, dtype=torch.int64, device=self.device)

    @property
    def capacity(self) -> int:
        return self.num_buckets * self.bucket_size

    def size(self) -> int:
        return self._size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.scores, self.occupied))

    def bucket_of(self, keys: torch.Tensor) -> torch.Tensor:
        return (mix64(keys) & _POSITIVE) % self.num_buckets

    def _bucket_slots(self, buckets: torch.Tensor) -> torch.Tensor:
        return buckets[:, None] * self.bucket_size + self._lanes[None, :]

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slot of each key, ``-1`` where absent. ``keys``: ``[n]`` int64."""
        buckets = self.bucket_of(keys)
        # Gather whole buckets as contiguous rows: one index_select of bucket_size keys each.
        bucket_keys = self.keys.view(self.num_buckets, self.bucket_size).index_select(0, buckets)
        bucket_occ = self.occupied.view(self.num_buckets, self.bucket_size).index_select(0, buckets)
        match = (bucket_keys == keys[:, None]) & bucket_occ
        hit, lane = match.view(torch.uint8).max(dim=1)  # one pass: whether and where
        return torch.where(hit.bool(), buckets * self.bucket_size + lane, torch.full_like(keys, -1))

    def plan_insert(
        self,
        keys: torch.Tensor,
        protected: Optional[torch.Tensor] = None,
        allow_evict: bool = True,
        priority: Optional[torch.Tensor] = None,
    ) -> InsertPlan:
        """Plans inserting ``keys`` (unique, absent), writing nothing.

        Within a bucket, free slots are taken first (in slot order), then occupied slots that
        are not ``protected`` (when ``allow_evict``), lowest score first, ties to the smaller
        slot. New keys claim them in ascending key order, or by descending ``priority`` (ties by
        key) when given; keys left without a slot get ``-1``.
        """
        n = keys.numel()
        if n == 0:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return InsertPlan(keys, empty, empty)
        # Order newcomers by (bucket, priority desc, key asc) with stable sorts.
        perm = torch.argsort(keys, stable=True)
        if priority is not None:
            perm = perm[torch.argsort(-priority[perm], stable=True)]
        buckets = self.bucket_of(keys)
        perm = perm[torch.argsort(buckets[perm], stable=True)]
        sorted_buckets = buckets[perm]
        uniq_buckets, inverse, counts = torch.unique_consecutive(
            sorted_buckets, return_inverse=True, return_counts=True
        )
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(n, device=self.device) - starts[inverse]

        slots = self._bucket_slots(uniq_buckets)
        occ = self.occupied[slots]
        evictable = occ.clone() if allow_evict else torch.zeros_like(occ)
        if protected is not None:
            evictable &= ~protected[slots]
        slot_class = torch.where(~occ, 0, torch.where(evictable, 1, 2))
        score = torch.where(slot_class == 1, self.scores[slots], torch.zeros_like(slots))
        by_score = torch.argsort(score, dim=1, stable=True)
        by_class = torch.argsort(slot_class.gather(1, by_score), dim=1, stable=True)
        lane_order = by_score.gather(1, by_class)
        available = (slot_class < 2).sum(dim=1)

        ok = rank < available[inverse]
        lane = lane_order[inverse, rank.clamp(max=self.bucket_size - 1)]
        chosen = uniq_buckets[inverse] * self.bucket_size + lane
        chosen = torch.where(ok, chosen, torch.full_like(chosen, -1))
        out = torch.empty_like(chosen)
        out[perm] = chosen
        taken = chosen[ok]
        return InsertPlan(keys, out, taken[self.occupied[taken]])

    def commit(self, plan: InsertPlan, scores: torch.Tensor) -> torch.Tensor:
        """Writes a plan's keys with their ``scores``; returns the evicted keys."""
        evicted = self.keys[plan.evicted_slots]
        ok = plan.slots >= 0
        slots = plan.slots[ok]
        self.keys[slots] = plan.keys[ok]
        self.scores[slots] = scores[ok]
        self.occupied[slots] = True
        self._size += slots.numel() - evicted.numel()
        return evicted

    def remove(self, slots: torch.Tensor) -> None:
        """Frees ``slots`` (each occupied, no duplicates)."""
        self.occupied[slots] = False
        self._size -= slots.numel()

    def entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(slots, keys, scores)`` of every occupied slot, ordered by key."""
        slots = torch.nonzero(self.occupied).flatten()
        keys = self.keys[slots]
        order = torch.argsort(keys)
        slots = slots[order]
        return slots, keys[order], self.scores[slots]
