"""Planning an insert into a :class:`~dynarec.embedding.hash_index.BucketedHashIndex`: which slot
each new key takes, which residents move to their other bucket to make room, which are evicted.
A plan writes nothing; the index's ``commit`` writes it.

Keys are ranked (by descending priority when given, then ascending key) and claim slots in rounds,
in that order, never raced: the plan follows from the keys and the index alone. Three planners
give the same plan, bit for bit: the Triton kernels where they run (``kernels.gpu.plan``), the
C++ extension on a CPU (one call), and plain torch on any device (:func:`plan_insert_reference`,
which the tests hold the other two to).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from dynarec.embedding.key_hash import EMPTY_TAG, NO_SLOT, candidate_buckets, candidate_buckets_reference
from dynarec.kernels import cpu as cpu_kernels
from dynarec.kernels import gpu as gpu_kernels
from dynarec.kernels.gpu import plan as gpu_plan

__all__ = [
    "PIN_WRAP",
    "IndexArrays",
    "InsertPlan",
    "claim_free_slots_reference",
    "plan_insert",
    "plan_insert_reference",
]

PIN_WRAP = (1 << 31) - 1  # step ids are stored modulo this in the int32 pins
_MAX_KERNEL_BUCKET = 64  # the C++ and Triton planners keep a bucket's claims in one 64-bit mask

Hash = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


class IndexArrays(Protocol):
    """What a planner reads of an index: its arrays (one entry a slot) and its shape."""

    keys: torch.Tensor
    tags: torch.Tensor
    scores: torch.Tensor
    pins: torch.Tensor
    num_buckets: int
    bucket_size: int
    device: torch.device


@dataclass
class InsertPlan:
    """Where each new key goes, and what moves to make room.

    ``slots[i] == NO_SLOT``: key ``i`` found no slot (overflow). ``evicted_slots``: occupied slots
    whose key is evicted (the new key takes the slot). ``moved_from`` / ``moved_to``: residents
    moved to their other bucket (one cuckoo step); a new key takes each ``moved_from`` slot.
    ``num_placed``: how many keys got a slot, when the planner knows it on the host (else
    :attr:`placed` reads it once).
    """

    keys: torch.Tensor
    slots: torch.Tensor
    evicted_slots: torch.Tensor
    moved_from: torch.Tensor
    moved_to: torch.Tensor
    num_placed: Optional[int] = None

    @property
    def placed(self) -> int:
        """Keys that got a slot (a host read only if the planner did not count them)."""
        if self.num_placed is None:
            self.num_placed = int((self.slots != NO_SLOT).sum())
        return self.num_placed

    @property
    def dropped(self) -> int:
        """Keys left without a slot."""
        return self.keys.numel() - self.placed

    @property
    def only_adds(self) -> bool:
        """Whether the plan only places new keys in free slots (no resident evicted or moved)."""
        return not (self.evicted_slots.numel() or self.moved_from.numel())

    @property
    def overwritten_slots(self) -> torch.Tensor:
        """Slots whose previous contents a commit replaces (evicted and moved residents' rows)."""
        return torch.cat([self.evicted_slots, self.moved_from])


def plan_insert(
    index: IndexArrays,
    keys: torch.Tensor,
    pinned_by: Optional[torch.Tensor] = None,
    allow_evict: bool = True,
    priority: Optional[torch.Tensor] = None,
    movable_pins: Optional[torch.Tensor] = None,
    keys_ascending: bool = False,
) -> InsertPlan:
    """Plans inserting ``keys`` (unique, absent from ``index``), writing nothing
    (``BucketedHashIndex.plan_insert`` says what a plan is); by the Triton kernels where they run
    on the index's device, else by the C++ extension on a CPU, else in plain torch."""
    n = keys.numel()
    if n == 0:
        return _no_keys(index, keys)
    out = torch.full((n,), NO_SLOT, dtype=torch.int64, device=index.device)
    order = _rank_order(keys, priority, keys_ascending)
    kernel_buckets = index.bucket_size <= _MAX_KERNEL_BUCKET
    if kernel_buckets and gpu_kernels.available(index.device):  # the kernels hash the keys themselves
        state = gpu_plan.PlanState.fresh(
            index.keys, index.tags, index.scores, index.pins, index.num_buckets, index.bucket_size
        )
        move_pins = _wrapped(_move_pins(pinned_by, movable_pins))  # step ids, maybe on the host: moved only now
        left, moved_from, moved_to, evicted = gpu_plan.plan_insert(
            state, keys, order, out, move_pins, _wrapped(pinned_by), allow_evict
        )
        return _plan(keys, out, left, moved_from, moved_to, evicted)
    b1, b2 = candidate_buckets(keys, index.num_buckets)
    if pinned_by is not None:  # the callers' step ids may be on the host: moved only now
        pinned_by = pinned_by.to(index.device)
    move_pins = _move_pins(pinned_by, movable_pins)
    cpu_ops = cpu_kernels.ops() if kernel_buckets and index.device.type == "cpu" else None
    if cpu_ops is not None:  # the three steps in one C++ call
        empty = torch.empty(0, dtype=torch.int64)
        left, moved_from, moved_to, evicted = cpu_ops.plan_insert(
            index.tags, index.keys, index.scores, index.pins, index.num_buckets, index.bucket_size, b1, b2, order,
            out, empty if move_pins is None else (move_pins % PIN_WRAP).long(),
            empty if pinned_by is None else (pinned_by % PIN_WRAP).long(), allow_evict,
        )  # fmt: skip
        return _plan(keys, out, left, moved_from, moved_to, evicted)
    return _plan_in_torch(index, keys, order, out, b1, b2, pinned_by, move_pins, allow_evict, candidate_buckets)


def plan_insert_reference(
    index: IndexArrays,
    keys: torch.Tensor,
    pinned_by: Optional[torch.Tensor] = None,
    allow_evict: bool = True,
    priority: Optional[torch.Tensor] = None,
    movable_pins: Optional[torch.Tensor] = None,
    keys_ascending: bool = False,
) -> InsertPlan:
    """:func:`plan_insert` by plain-torch ops alone (any device): the reference the C++ and
    Triton planners are tested against."""
    n = keys.numel()
    if n == 0:
        return _no_keys(index, keys)
    out = torch.full((n,), NO_SLOT, dtype=torch.int64, device=index.device)
    order = _rank_order(keys, priority, keys_ascending)
    b1, b2 = candidate_buckets_reference(keys, index.num_buckets)
    if pinned_by is not None:
        pinned_by = pinned_by.to(index.device)
    move_pins = _move_pins(pinned_by, movable_pins)
    return _plan_in_torch(
        index, keys, order, out, b1, b2, pinned_by, move_pins, allow_evict, candidate_buckets_reference
    )


def claim_free_slots_reference(
    index: IndexArrays, b1: torch.Tensor, b2: torch.Tensor, order: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Step 1 of a plan alone, in plain torch, for keys with candidate buckets ``b1`` / ``b2``
    (``order``: their indices in rank order): writes slots into ``out``; returns the keys
    (indices, rank order) whose two buckets are full. The reference of the kernels' step 1."""
    return _claim_free_slots(_WorkingBuckets(index, torch.cat([b1, b2])), order, b1, b2, out)


def _no_keys(index: IndexArrays, keys: torch.Tensor) -> InsertPlan:
    empty = torch.empty(0, dtype=torch.int64, device=index.device)
    return InsertPlan(keys, empty, empty, empty, empty, 0)


def _plan(
    keys: torch.Tensor,
    out: torch.Tensor,
    left: torch.Tensor,
    moved_from: torch.Tensor,
    moved_to: torch.Tensor,
    evicted: torch.Tensor,
) -> InsertPlan:
    # every key left after step 2 that got a slot took an evicted one
    return InsertPlan(keys, out, evicted, moved_from, moved_to, keys.numel() - left.numel() + evicted.numel())


def _rank_order(keys: torch.Tensor, priority: Optional[torch.Tensor], keys_ascending: bool) -> torch.Tensor:
    """The keys' indices in rank order: descending ``priority`` (when given), then ascending key
    (``keys_ascending``: the keys are in ascending order already, so no sort)."""
    if keys_ascending:
        order = torch.arange(keys.numel(), device=keys.device)
    else:
        order = torch.argsort(keys, stable=True)
    if priority is not None:
        order = order[torch.argsort(-priority[order], stable=True)]
    return order


def _wrapped(step_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Step ids as the pins hold them (modulo :data:`PIN_WRAP`)."""
    return None if step_ids is None else step_ids % PIN_WRAP


def _move_pins(pinned_by: Optional[torch.Tensor], movable_pins: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The steps whose rows a plan may not move: ``pinned_by`` but ``movable_pins`` (on
    ``pinned_by``'s device)."""
    if pinned_by is None or movable_pins is None:
        return pinned_by
    return pinned_by[~torch.isin(pinned_by, movable_pins.to(pinned_by.device))]


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
    """A working copy of some buckets' occupancy during one plan in plain torch (nothing is
    written to the index). ``claimed`` marks slots the plan gives away (to a new key or a moved
    resident): they are neither free, nor movable, nor evictable again."""

    def __init__(self, index: IndexArrays, buckets: torch.Tensor):
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
        """Occupied slots holding a resident that may be moved or evicted (not pinned, not
        claimed)."""
        ok = (self.index.tags[slots] != EMPTY_TAG) & ~self.is_claimed(slots)
        if pinned_by is not None and pinned_by.numel():
            ok &= ~torch.isin(self.index.pins[slots], pinned_by % PIN_WRAP)
        return ok


def _plan_in_torch(
    index: IndexArrays,
    keys: torch.Tensor,
    order: torch.Tensor,
    out: torch.Tensor,
    b1: torch.Tensor,
    b2: torch.Tensor,
    pinned_by: Optional[torch.Tensor],
    move_pins: Optional[torch.Tensor],
    allow_evict: bool,
    hash_keys: Hash,
) -> InsertPlan:
    """The three steps in plain-torch rounds over a working copy of the keys' buckets;
    ``hash_keys``: the candidate buckets of the residents step 2 would move."""
    empty = torch.empty(0, dtype=torch.int64, device=index.device)
    work = _WorkingBuckets(index, torch.cat([b1, b2]))
    todo = _claim_free_slots(work, order, b1, b2, out)
    moved_from, moved_to = empty, empty
    if todo.numel():
        todo, moved_from, moved_to = _claim_by_moving(work, todo, b1, b2, out, move_pins, hash_keys)
    evicted = empty
    if todo.numel() and allow_evict:
        evicted = _claim_by_evicting(work, todo, b1, b2, out, pinned_by)
    return _plan(keys, out, todo, moved_from, moved_to, evicted)


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
    hash_keys: Hash,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 2: each round, every key left takes the slot of the first resident of its buckets
    (first bucket's lanes first) that may move to a free slot of its own other bucket (one
    cuckoo step); one mover per resident (the best-ranked key), then as many per target bucket
    as it has free slots. Returns the keys left, and the moves ``(from, to)``."""
    index = work.index
    bs = index.bucket_size
    froms, tos = [], []
    while todo.numel():
        cand = work.candidates(todo, b1, b2)  # [m, 2bs]
        flat = cand.flatten()
        r1, r2 = hash_keys(index.keys[flat], index.num_buckets)
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
