"""An insert plan into a two-choice bucketed hash index, and the index writes of a commit and a
touch, in plain torch.

A plan's keys are given in rank order and claim slots in rounds, in that order; every decision of
a round reads the state at the round's start, so the plan follows from the keys and the index
alone:

1. a free slot of the emptier of the key's two buckets (ties: the first bucket), a bucket's lanes
   in ascending order to its keys in rank order;
2. when both are full: the slot of a resident of one of its buckets (first bucket's lanes first)
   that moves to a free slot of its own other bucket (one cuckoo step); one mover per resident
   (the best-ranked key), then as many per target bucket as it has free slots;
3. when eviction is allowed and that fails too: the slot of the lowest (score, slot) resident of
   its two buckets that no earlier key claimed.

Residents pinned by one of the given step ids are neither moved (step 2) nor evicted (step 3).
In a partitioned index (``part_starts``, ``key_parts``: ``hashing.candidate_buckets``) each key
plans within its partition's buckets, and a resident of them moves within them: the plan of keys
of several partitions is the union of each partition's own plan of its keys (no step reads a
bucket of another partition; rounds that place nothing in a partition change nothing there).
Nothing is written while planning: a working copy of the keys' buckets' occupancy holds the
plan's claims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dynarec.kernels.layout import EMPTY_TAG, NO_SLOT
from dynarec.kernels.reference.hashing import candidate_buckets, key_tags

__all__ = [
    "absent_keys",
    "claim_free_slots",
    "fill_at",
    "fill_slots",
    "follow_moves",
    "place_keys",
    "plan_insert",
    "slot_positions",
]


@dataclass(frozen=True)
class _Index:
    """What a plan reads of an index: its arrays (a value a slot) and its shape."""

    keys: torch.Tensor
    tags: torch.Tensor
    scores: torch.Tensor
    pins: torch.Tensor
    num_buckets: int
    bucket_size: int
    part_starts: Optional[torch.Tensor] = None  # a partitioned index's (hashing.candidate_buckets)

    @property
    def device(self) -> torch.device:
        return self.tags.device


def plan_insert(
    tags: torch.Tensor,
    keys: torch.Tensor,
    scores: torch.Tensor,
    pins: torch.Tensor,
    num_buckets: int,
    bucket_size: int,
    new_keys: torch.Tensor,
    order: torch.Tensor,
    move_pins: Optional[torch.Tensor],
    evict_pins: Optional[torch.Tensor],
    allow_evict: bool,
    free_slots: int = -1,
    part_starts: Optional[torch.Tensor] = None,
    key_parts: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan of inserting ``new_keys`` (``[n]`` int64, unique, absent; ``order``: their
    indices in rank order) into the index of arrays ``tags`` (uint8), ``keys``, ``scores`` (int64)
    and ``pins`` (int32). ``move_pins`` / ``evict_pins``: step ids (as ``pins`` holds them, on any
    device) whose residents step 2 does not move / step 3 does not evict; step 3 runs only if
    ``allow_evict``. ``free_slots``: how many slots of the index are empty, when the caller
    knows (-1: unknown); with none, steps 1 and 2 would place no key and are skipped (the same
    plan, without their rounds: a full table's every insert).

    Returns ``(slots, left, moved_from, moved_to, evicted)``, int64: each key's slot
    (:data:`NO_SLOT`: none); the keys (indices, rank order) still without a slot after step 2;
    the moves (round and rank order); the evicted slots (round and rank order)."""
    index = _Index(keys, tags, scores, pins, num_buckets, bucket_size, part_starts)
    device = tags.device
    out = torch.full((new_keys.numel(),), NO_SLOT, dtype=torch.int64, device=device)
    b1, b2 = candidate_buckets(new_keys, num_buckets, part_starts, key_parts)
    move_pins = None if move_pins is None else move_pins.to(device)
    evict_pins = None if evict_pins is None else evict_pins.to(device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    work = _WorkingBuckets(index, torch.cat([b1, b2]))
    todo = _claim_free_slots(work, order, b1, b2, out) if free_slots != 0 else order
    moved_from, moved_to = empty, empty
    if todo.numel() and free_slots != 0:
        todo, moved_from, moved_to = _claim_by_moving(work, todo, b1, b2, out, move_pins, key_parts)
    evicted = empty
    if todo.numel() and allow_evict:
        evicted = _claim_by_evicting(work, todo, b1, b2, out, evict_pins)
    if todo.untyped_storage().data_ptr() == order.untyped_storage().data_ptr():  # no key placed
        todo = todo.clone()
    return out, todo, moved_from, moved_to, evicted


def claim_free_slots(
    tags: torch.Tensor, bucket_size: int, b1: torch.Tensor, b2: torch.Tensor, order: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Step 1 of a plan alone, for keys with candidate buckets ``b1`` / ``b2`` (``order``: their
    indices in rank order) in an index of ``tags``: writes slots into ``out``; returns the keys
    (indices, rank order) whose two buckets are full. (The C++ extension's ``claim_free_slots``
    twin, for the tests.)"""
    empty = torch.empty(0, dtype=torch.int64, device=tags.device)
    index = _Index(empty, tags, empty, empty, tags.numel() // bucket_size, bucket_size)
    return _claim_free_slots(_WorkingBuckets(index, torch.cat([b1, b2])), order, b1, b2, out)


def place_keys(
    keys: torch.Tensor,
    scores: torch.Tensor,
    tags: torch.Tensor,
    slots: torch.Tensor,
    new_keys: torch.Tensor,
    new_scores: torch.Tensor,
) -> None:
    """Writes ``new_keys[i]`` with ``new_scores[i]`` and its tag into slot ``slots[i]`` of an
    index's arrays (distinct free slots; :data:`NO_SLOT`: not placed)."""
    ok = slots != NO_SLOT
    at, placed = slots[ok], new_keys[ok]
    keys[at] = placed
    scores[at] = new_scores[ok]
    tags[at] = key_tags(placed)


def fill_at(t: torch.Tensor, idx: torch.Tensor, value: int) -> None:
    """``t[idx[i]] = value`` for every ``i`` (duplicates allowed)."""
    t.scatter_(0, idx, value)


def fill_slots(t: torch.Tensor, slots: torch.Tensor, value: int, offset: int = 0) -> None:
    """``t[slots[i] + offset] = value`` for every ``i``, a negative slot (:data:`NO_SLOT`: a key
    without a row) writing ``t``'s last element: the spare an index's pins keep past their slots
    (a step's pins; duplicates allowed). ``t``: ``[capacity + 1]`` int32 or int64; ``slots``:
    ``[n]`` int64. No host read: the spare takes the writes a mask would drop."""
    t.index_fill_(0, slot_positions(slots, offset, t.numel() - 1), value)


def slot_positions(slots: torch.Tensor, offset: int, spare: int) -> torch.Tensor:
    """Where :func:`fill_slots` writes each of ``slots`` ``[n]``: ``slot + offset``, a negative
    slot at ``spare``."""
    return torch.where(slots < 0, spare, slots if offset == 0 else slots + offset)


def absent_keys(
    keys: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys of a find without a row: ``(positions, unique, inverse, counts)``, the positions
    ``[m]`` (ascending) of the negative ``slots`` ``[n]`` and ``keys[positions]`` as
    ``torch.unique`` gives them: ``unique`` ``[u]`` (ascending), ``inverse`` ``[m]`` (each
    position's index into ``unique``), ``counts`` ``[u]`` (on a GPU: a host read for ``m``, one
    for ``u``)."""
    positions = torch.nonzero(slots < 0).squeeze(1)
    unique, inverse, counts = torch.unique(keys[positions], return_inverse=True, return_counts=True)
    return positions, unique, inverse, counts


def follow_moves(slots: torch.Tensor, moved_from: torch.Tensor, moved_to: torch.Tensor) -> torch.Tensor:
    """``slots`` ``[n]`` (negative: none) with each slot ``moved_from[i]`` replaced by
    ``moved_to[i]`` (a plan's cuckoo moves: distinct sources, at least one), without a host read."""
    order = torch.argsort(moved_from)
    src, dst = moved_from[order], moved_to[order]
    at = torch.searchsorted(src, slots).clamp_(max=src.numel() - 1)
    return torch.where(src[at] == slots, dst[at], slots)


def _rank_within(groups: torch.Tensor) -> torch.Tensor:
    """Position of each element among the elements of its group, in input order."""
    order = torch.argsort(groups, stable=True)
    sorted_groups = groups[order]
    _, inverse, counts = torch.unique_consecutive(sorted_groups, return_inverse=True, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(groups)
    rank[order] = torch.arange(groups.numel(), device=groups.device) - starts[inverse]
    return rank


def _first_per_group(groups: torch.Tensor) -> torch.Tensor:
    """Mask of the first element (in input order) of each group."""
    return _rank_within(groups) == 0


class _WorkingBuckets:
    """A working copy of some buckets' occupancy during one plan (nothing is written to the
    index). ``claimed`` marks slots the plan gives away (to a new key or a moved resident): they
    are neither free, nor movable, nor evictable again."""

    def __init__(self, index: _Index, buckets: torch.Tensor):
        self.index = index
        bs, device = index.bucket_size, index.device
        self.lanes = torch.arange(bs, dtype=torch.int64, device=device)
        self.ids = torch.empty(0, dtype=torch.int64, device=device)
        self.occupied = torch.empty(0, bs, dtype=torch.bool, device=device)
        self.claimed = torch.empty(0, bs, dtype=torch.bool, device=device)
        self.add(buckets)

    def add(self, buckets: torch.Tensor) -> None:
        """Brings ``buckets`` into the working set (those already in it keep their state)."""
        new = torch.unique(buckets)
        new = new[~torch.isin(new, self.ids)]
        if not new.numel():
            return
        occupied = self.index.tags.view(-1, self.index.bucket_size).index_select(0, new) != EMPTY_TAG
        ids = torch.cat([self.ids, new])
        order = torch.argsort(ids)
        self.ids = ids[order]
        self.occupied = torch.cat([self.occupied, occupied])[order]
        self.claimed = torch.cat([self.claimed, torch.zeros_like(occupied)])[order]

    def rows(self, buckets: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.ids, buckets)

    def free(self, buckets: torch.Tensor) -> torch.Tensor:
        """Free (unoccupied, unclaimed) slots of each bucket."""
        r = self.rows(buckets)
        return (~(self.occupied[r] | self.claimed[r])).sum(1)

    def claim_free(self, buckets: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
        """The ``rank``-th free lane (ascending) of each bucket, claimed; returns its slot."""
        r = self.rows(buckets)
        taken = (self.occupied[r] | self.claimed[r]).to(torch.int8)
        lane = torch.argsort(taken, dim=1, stable=True).gather(1, rank[:, None]).squeeze(1)
        self.claimed[r, lane] = True
        return buckets * self.index.bucket_size + lane

    def claim(self, slots: torch.Tensor) -> None:
        bs = self.index.bucket_size
        self.claimed[self.rows(slots // bs), slots % bs] = True

    def is_claimed(self, slots: torch.Tensor) -> torch.Tensor:
        bs = self.index.bucket_size
        return self.claimed[self.rows(slots // bs), slots % bs]

    def candidates(self, todo: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
        """``[m, 2 * bucket_size]`` slots of each key's two buckets (first bucket's lanes first)."""
        bs = self.index.bucket_size
        return torch.cat([b1[todo, None] * bs + self.lanes, b2[todo, None] * bs + self.lanes], dim=1)

    def movable(self, slots: torch.Tensor, pinned_by: Optional[torch.Tensor]) -> torch.Tensor:
        """Occupied slots holding a resident that may be moved or evicted (not pinned by one of
        ``pinned_by``, not claimed)."""
        ok = (self.index.tags[slots] != EMPTY_TAG) & ~self.is_claimed(slots)
        if pinned_by is not None and pinned_by.numel():
            ok &= ~torch.isin(self.index.pins[slots], pinned_by)
        return ok


def _claim_free_slots(
    work: _WorkingBuckets, todo: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Step 1: each round, every key without a slot (``todo``, rank order) takes, from the free
    counts at the round's start, the emptier of its two buckets (ties: the first); the first
    ``free`` keys choosing a bucket get its free lanes in ascending order. Returns the keys
    whose two buckets are full."""
    while todo.numel():
        f1, f2 = work.free(b1[todo]), work.free(b2[todo])
        live = (f1 > 0) | (f2 > 0)
        if not bool(live.any()):
            break
        keys, f1, f2 = todo[live], f1[live], f2[live]
        choice = torch.where(f2 > f1, b2[keys], b1[keys])
        rank = _rank_within(choice)  # keys are in rank order: better-ranked keys go first
        ok = rank < torch.maximum(f1, f2)  # every round places at least each bucket's first key
        out[keys[ok]] = work.claim_free(choice[ok], rank[ok])
        todo = todo[out[todo] == NO_SLOT]
    return todo


def _claim_by_moving(
    work: _WorkingBuckets,
    todo: torch.Tensor,
    b1: torch.Tensor,
    b2: torch.Tensor,
    out: torch.Tensor,
    pinned_by: Optional[torch.Tensor],
    key_parts: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 2: each round, every key left takes the slot of the first resident of its buckets
    (first bucket's lanes first) that may move to a free slot of its own other bucket (one
    cuckoo step); one mover per resident (the best-ranked key), then as many per target bucket
    as it has free slots. Returns the keys left, and the moves ``(from, to)``. ``key_parts``: in a
    partitioned index, each key's partition (its buckets' residents': theirs)."""
    index = work.index
    bs = index.bucket_size
    froms, tos = [], []
    while todo.numel():
        cand = work.candidates(todo, b1, b2)  # [m, 2bs]
        flat = cand.flatten()
        parts = None if key_parts is None else key_parts[todo].repeat_interleave(cand.shape[1])
        r1, r2 = candidate_buckets(index.keys[flat], index.num_buckets, index.part_starts, parts)
        own = flat // bs
        alt = torch.where(r1 == own, r2, r1)
        work.add(alt)
        ok = work.movable(flat, pinned_by) & (alt != own) & (work.free(alt) > 0)
        ok = ok.view(cand.shape)
        has = ok.any(dim=1)
        if not bool(has.any()):
            break
        pick = ok.to(torch.int8).argmax(dim=1)  # the first movable resident with room elsewhere
        keys_idx, src = todo[has], cand[has, pick[has]]
        dst_bucket = alt.view(cand.shape)[has, pick[has]]
        first = _first_per_group(src)
        keys_idx, src, dst_bucket = keys_idx[first], src[first], dst_bucket[first]
        rank = _rank_within(dst_bucket)
        fits = rank < work.free(dst_bucket)
        keys_idx, src, dst_bucket, rank = keys_idx[fits], src[fits], dst_bucket[fits], rank[fits]
        if not keys_idx.numel():
            break
        dst = work.claim_free(dst_bucket, rank)
        work.claim(src)
        out[keys_idx] = src
        froms.append(src)
        tos.append(dst)
        todo = todo[out[todo] == NO_SLOT]
    empty = torch.empty(0, dtype=torch.int64, device=index.device)
    return todo, (torch.cat(froms) if froms else empty), (torch.cat(tos) if tos else empty)


def _claim_by_evicting(
    work: _WorkingBuckets,
    todo: torch.Tensor,
    b1: torch.Tensor,
    b2: torch.Tensor,
    out: torch.Tensor,
    pinned_by: Optional[torch.Tensor],
) -> torch.Tensor:
    """Step 3: each round, every key left takes the lowest (score, slot) among the residents of
    its two buckets that may be evicted; two keys wanting one slot: the better-ranked one wins,
    the others try their next-lowest; keys with no candidate give up. Returns the evicted
    slots."""
    index = work.index
    evicted = []
    while todo.numel():
        cand = work.candidates(todo, b1, b2)
        ok = work.movable(cand.flatten(), pinned_by).view(cand.shape)
        has = ok.any(dim=1)
        if not bool(has.any()):
            break
        scores = torch.where(ok, index.scores[cand], torch.iinfo(torch.int64).max)
        best_score = scores.min(dim=1, keepdim=True).values
        tie = ok & (scores == best_score)
        slot = torch.where(tie, cand, torch.iinfo(torch.int64).max).min(dim=1).values
        keys_idx, slot = todo[has], slot[has]
        first = _first_per_group(slot)
        work.claim(slot[first])
        out[keys_idx[first]] = slot[first]
        evicted.append(slot[first])
        todo = keys_idx[~first]
    return torch.cat(evicted) if evicted else torch.empty(0, dtype=torch.int64, device=index.device)
