"""A bucketed hash index: int64 key -> slot, with an int64 score and a pin per slot.

``capacity = num_buckets * bucket_size`` slots; a key lives only in its own bucket
(``mix64(key) mod num_buckets``), so a lookup gathers one bucket and compares. Every operation
is a batched tensor op with no Python loop per key, identical on CPU and CUDA, and
deterministic: inserts within a batch are ranked by sort, never raced with atomics.

The whole int64 range is a valid key: occupancy is a separate mask, no key value is reserved.

The index owns its arrays; callers change them only through its methods (``commit``, ``remove``,
``touch``, ``add``, ``pin``). Each mutating method takes an optional :class:`Journal` and records
how to undo itself, so a failed training step can be rolled back exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dynarec.embedding.initializers import mix64
from dynarec.embedding.step import Journal

__all__ = ["BucketedHashIndex", "InsertPlan"]

_POSITIVE = (1 << 63) - 1
PIN_WRAP = (1 << 31) - 1  # step ids are stored modulo this in the int32 pins


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
        # The id of the last training step that pinned the slot (-1: never); a slot is pinned while
        # that step is pending (StepLifecycle). Step ids are never reused (int32: they wrap after
        # 2^31 steps, when a row untouched that long could look pinned for one step), so the pin
        # of an aborted step pins nothing and needs no undo.
        self.pins = torch.full((cap,), -1, dtype=torch.int32, device=self.device)
        self._size = 0
        self._lanes = torch.arange(bucket_size, dtype=torch.int64, device=self.device)

    @property
    def capacity(self) -> int:
        return self.num_buckets * self.bucket_size

    @property
    def size(self) -> int:
        """Occupied slots."""
        return self._size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.scores, self.occupied, self.pins))

    def bucket_of(self, keys: torch.Tensor) -> torch.Tensor:
        return (mix64(keys) & _POSITIVE) % self.num_buckets

    def _bucket_slots(self, buckets: torch.Tensor) -> torch.Tensor:
        return buckets[:, None] * self.bucket_size + self._lanes[None, :]

    # -- reads -------------------------------------------------------------------------------

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slot of each key, ``-1`` where absent. ``keys``: ``[n]`` int64."""
        buckets = self.bucket_of(keys)
        # Gather whole buckets as contiguous rows: one index_select of bucket_size keys each.
        bucket_keys = self.keys.view(self.num_buckets, self.bucket_size).index_select(0, buckets)
        bucket_occ = self.occupied.view(self.num_buckets, self.bucket_size).index_select(0, buckets)
        match = (bucket_keys == keys[:, None]) & bucket_occ
        hit, lane = match.view(torch.uint8).max(dim=1)  # one pass: whether and where
        return torch.where(hit.bool(), buckets * self.bucket_size + lane, torch.full_like(keys, -1))

    def entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(slots, keys, scores)`` of every occupied slot, ordered by key."""
        slots = torch.nonzero(self.occupied).flatten()
        keys = self.keys[slots]
        order = torch.argsort(keys)
        slots = slots[order]
        return slots, keys[order], self.scores[slots]

    def plan_insert(
        self,
        keys: torch.Tensor,
        pinned_by: Optional[torch.Tensor] = None,
        allow_evict: bool = True,
        priority: Optional[torch.Tensor] = None,
    ) -> InsertPlan:
        """Plans inserting ``keys`` (unique, absent), writing nothing.

        Within a bucket, free slots are taken first (in slot order), then occupied slots that
        are not pinned by one of the steps ``pinned_by`` (when ``allow_evict``), lowest score first,
        ties to the smaller slot. New keys claim them in ascending key order, or by descending
        ``priority`` (ties by key) when given; keys left without a slot get ``-1``.
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
        if pinned_by is not None and pinned_by.numel():
            evictable &= ~torch.isin(self.pins[slots], pinned_by % PIN_WRAP)
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

    # -- writes ------------------------------------------------------------------------------

    def _record(self, journal: Optional[Journal], slots: torch.Tensor) -> None:
        """Records how to restore ``slots`` (keys, scores, occupancy) and the size as they are now."""
        if journal is None:
            return
        saved = (slots.clone(), self.keys[slots], self.scores[slots], self.occupied[slots])
        size = self._size

        def undo() -> None:
            s, k, sc, occ = saved
            self.keys[s], self.scores[s], self.occupied[s] = k, sc, occ
            self._size = size

        journal.record(undo)

    def commit(self, plan: InsertPlan, scores: torch.Tensor, journal: Optional[Journal] = None) -> torch.Tensor:
        """Writes a plan's keys with their ``scores``; returns the evicted keys."""
        ok = plan.slots >= 0
        slots = plan.slots[ok]
        self._record(journal, slots)
        evicted = self.keys[plan.evicted_slots]
        self.keys[slots] = plan.keys[ok]
        self.scores[slots] = scores[ok]
        self.occupied[slots] = True
        self._size += slots.numel() - evicted.numel()
        return evicted

    def remove(self, slots: torch.Tensor, journal: Optional[Journal] = None) -> None:
        """Frees ``slots`` (each occupied, no duplicates)."""
        self._record(journal, slots)
        self.occupied[slots] = False
        self._size -= slots.numel()

    def touch(self, slots: torch.Tensor, score: int) -> None:
        """Sets the score of ``slots`` (duplicates allowed)."""
        self.scores[slots] = score

    def add(self, slots: torch.Tensor, amounts: torch.Tensor, journal: Optional[Journal] = None) -> None:
        """Adds ``amounts`` to the scores of ``slots`` (duplicates accumulate)."""
        self._record(journal, slots)
        self.scores.index_add_(0, slots, amounts)

    def pin(self, slots: torch.Tensor, step_id: int) -> None:
        """Pins ``slots`` for the step ``step_id`` (duplicates allowed)."""
        self.pins[slots] = step_id % PIN_WRAP

    def rehashed(self, num_buckets: int) -> tuple[BucketedHashIndex, torch.Tensor, torch.Tensor]:
        """A new index of ``num_buckets`` holding every key with its score and pin, and the
        ``(old slots, new slots)`` of the keys moved. Keys are placed by descending score (ties
        to the smaller key); a multiple of the bucket count never overflows a bucket, any other
        count may, and a key that finds no slot is left out (``len(old slots) < size``)."""
        slots, keys, scores = self.entries()
        index = BucketedHashIndex(num_buckets, self.bucket_size, self.device)
        plan = index.plan_insert(keys, allow_evict=False, priority=scores)
        ok = plan.slots >= 0
        slots = slots[ok]
        index.commit(InsertPlan(keys[ok], plan.slots[ok], plan.evicted_slots), scores[ok])
        index.pins[plan.slots[ok]] = self.pins[slots]
        return index, slots, plan.slots[ok]

    def install(self, slots: torch.Tensor, keys: torch.Tensor, scores: torch.Tensor) -> None:
        """Places ``keys`` at the given ``slots`` (a fresh index restoring a dump's layout)."""
        self.keys[slots] = keys
        self.scores[slots] = scores
        self.occupied[slots] = True
        self._size = int(self.occupied.sum())
