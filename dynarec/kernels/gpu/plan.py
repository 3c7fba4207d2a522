"""An insert plan on the device: the three steps of the index's planner, in the plain-torch
planner's rounds exactly (``dynarec.kernels.reference.plan``), and the commit of new keys into
free slots.

Keys are given in rank order and claim slots in rounds; every decision of a round reads the state
at the round's start, so a round's outcome does not depend on the order its programs run in:

1. :func:`claim_free_slots`: each key takes a free lane of the emptier of its two buckets (ties:
   the first), a bucket's lanes in ascending order to its keys in rank order;
2. :func:`claim_by_moving`: a key whose buckets are full takes the slot of the first resident of
   its buckets that can move to a free lane of its own other bucket (one cuckoo step);
3. :func:`claim_by_evicting`: a key still left takes the lowest (score, slot) resident of its two
   buckets.

The plan's claims are one int64 bit mask a bucket (``bucket_size`` <= 64); no slot of the index is
written while planning. A round of steps 1-2 is a few kernels, a sort and one host read (how many
keys it placed: whether another round is needed); step 3's rounds read the host once every
:data:`EVICT_ROUNDS_PER_READ` (a slot goes to the best-ranked key by an atomic max of bids, no
sort). :func:`plan_insert` runs the three steps. :func:`place_keys` commits a plan that only
fills free slots, in one kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from dynarec.kernels.gpu._triton import HAVE_TRITON
from dynarec.kernels.gpu.hashing import NO_SLOT, Partitions, partition_args

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from dynarec.kernels.gpu.hashing import EMPTY_TAG, buckets_in, buckets_of, key_tag, mix64

__all__ = [
    "TUNING",
    "PlanState",
    "Tuning",
    "claim_by_evicting",
    "claim_by_moving",
    "claim_free_slots",
    "place_keys",
    "plan_insert",
]


@dataclass(frozen=True)
class Tuning:
    """Launch shapes of this module's kernels: keys a program in step 1's kernels
    (``claim_block``), in steps 2-3's (``displace_block``), slots a program when marking claims
    (``mark_block``) and placing keys (``place_block``, on ``place_warps`` warps). Tuning scripts
    replace :data:`TUNING`; plans do not depend on it."""

    claim_block: int = 128
    displace_block: int = 64
    mark_block: int = 256
    place_block: int = 256
    place_warps: int = 4


TUNING = Tuning()

#: Step 3's rounds between two host reads of how many keys are still in play.
EVICT_ROUNDS_PER_READ = 4


if HAVE_TRITON:
    _NO_SLOT = tl.constexpr(NO_SLOT)
    _EMPTY_TAG = tl.constexpr(EMPTY_TAG)

    @triton.jit
    def _empty_lanes(tags_ptr, bucket, valid, BS: tl.constexpr, BSP: tl.constexpr):
        """``[BLOCK, BSP]`` mask of each ``bucket``'s empty lanes, read only where ``valid``."""
        lanes = tl.arange(0, BSP)
        ok = valid[:, None] & (lanes < BS)[None, :]
        return ok & (tl.load(tags_ptr + bucket[:, None] * BS + lanes[None, :], mask=ok, other=1) == _EMPTY_TAG)

    @triton.jit
    def _free_lanes(tags_ptr, claimed_ptr, bucket, valid, BS: tl.constexpr, BSP: tl.constexpr):
        """``[BLOCK, BSP]`` mask of each ``bucket``'s free lanes: empty and not claimed by the
        insert plan so far (``claimed``: one int64 bit mask per bucket)."""
        lanes = tl.arange(0, BSP)
        claimed = tl.load(claimed_ptr + bucket, mask=valid, other=0)
        empty = _empty_lanes(tags_ptr, bucket, valid, BS, BSP)
        return empty & (((claimed[:, None] >> lanes.to(tl.int64)[None, :]) & 1) == 0)

    @triton.jit(do_not_specialize=["m", "num_buckets"])
    def _choose_kernel(
        tags_ptr, claimed_ptr, keys_ptr, order_ptr, out_ptr, choice_ptr, starts_ptr, parts_ptr, m, num_buckets,
        BS: tl.constexpr, BSP: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Per key still without a slot (rank order): the emptier of its two buckets (hashed here)
        # at the round's start (ties: the first), or num_buckets (sorts last) when both are full.
        p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = p < m
        k = tl.load(order_ptr + p, mask=valid, other=0)
        todo = valid & (tl.load(out_ptr + k, mask=valid, other=0) == _NO_SLOT)
        h = mix64(tl.load(keys_ptr + k, mask=todo, other=0).to(tl.uint64))
        b1, b2, _, _ = buckets_of(h, k, todo, num_buckets, starts_ptr, parts_ptr, PARTS)
        f1 = tl.sum(_free_lanes(tags_ptr, claimed_ptr, b1, todo, BS, BSP).to(tl.int32), axis=1)
        f2 = tl.sum(_free_lanes(tags_ptr, claimed_ptr, b2, todo, BS, BSP).to(tl.int32), axis=1)
        choice = tl.where(f2 > f1, b2, b1)
        choice = tl.where(todo & ((f1 > 0) | (f2 > 0)), choice, num_buckets)
        tl.store(choice_ptr + p, choice.to(tl.int32), mask=valid)

    @triton.jit(do_not_specialize=["m", "num_buckets"])
    def _claim_kernel(
        tags_ptr, claimed_ptr, sorted_ptr, perm_ptr, first_ptr, order_ptr, out_ptr, lane_ptr, placed_ptr, m,
        num_buckets, BS: tl.constexpr, BSP: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Keys sorted by chosen bucket (stable: rank order within a bucket): the r-th key of a
        # bucket takes its r-th free lane (ascending) if the bucket has more than r free lanes
        # (lane -1 where not). Counts the keys placed (an integer sum: the atomics' order does
        # not matter).
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = i < m
        c = tl.load(sorted_ptr + i, mask=valid, other=0).to(tl.int64)
        live = valid & (c < num_buckets)
        rank = (i - tl.load(first_ptr + i, mask=live, other=0)).to(tl.int32)
        free = _free_lanes(tags_ptr, claimed_ptr, c, live, BS, BSP)
        nth = tl.cumsum(free.to(tl.int32), axis=1)
        pick = free & (nth == (rank + 1)[:, None])
        placed = live & (tl.max(pick.to(tl.int32), axis=1) > 0)
        lane = tl.argmax(pick.to(tl.int32), axis=1).to(tl.int64)
        k = tl.load(order_ptr + tl.load(perm_ptr + i, mask=placed, other=0), mask=placed, other=0)
        tl.store(out_ptr + k, c * BS + lane, mask=placed)
        tl.store(lane_ptr + i, tl.where(placed, lane, -1), mask=valid)
        num_placed = tl.sum(placed.to(tl.int32), axis=0)
        tl.atomic_add(placed_ptr, num_placed, mask=num_placed > 0)

    @triton.jit(do_not_specialize=["m"])
    def _mark_claimed_kernel(claimed_ptr, sorted_ptr, lane_ptr, m, BLOCK: tl.constexpr):
        # After the round's claims: their lanes join the buckets' claimed masks (an integer OR:
        # the result does not depend on the order the atomics land in).
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = i < m
        lane = tl.load(lane_ptr + i, mask=valid, other=-1)
        placed = valid & (lane >= 0)
        c = tl.load(sorted_ptr + i, mask=placed, other=0).to(tl.int64)
        tl.atomic_or(claimed_ptr + c, tl.full([BLOCK], 1, tl.int64) << tl.maximum(lane, 0), mask=placed)

    @triton.jit(do_not_specialize=["m"])
    def _mark_slots_kernel(claimed_ptr, slots_ptr, m, BS: tl.constexpr, BLOCK: tl.constexpr):
        # Each slot's lane (NO_SLOT: none) OR-ed into its bucket's claimed mask (an integer OR:
        # the order the atomics land in does not matter).
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(slots_ptr + i, mask=i < m, other=_NO_SLOT)
        ok = s != _NO_SLOT
        s = tl.maximum(s, 0)
        tl.atomic_or(claimed_ptr + s // BS, tl.full([BLOCK], 1, tl.int64) << (s % BS), mask=ok)

    @triton.jit
    def _unpinned(pins_ptr, pin_ids_ptr, num_pins, slot, live):
        """Where ``live``: whether ``slot``'s pin is none of the ``num_pins`` step ids (modulo
        PIN_WRAP, as the pins hold them)."""
        pin = tl.load(pins_ptr + slot, mask=live, other=-1)
        ok = live
        j = 0
        while j < num_pins:
            ok = ok & (pin != tl.load(pin_ids_ptr + j))
            j += 1
        return ok

    @triton.jit
    def _keys_left(
        new_keys_ptr, todo_ptr, m, num_buckets, starts_ptr, parts_ptr, PARTS: tl.constexpr, BLOCK: tl.constexpr
    ):
        """``(p, valid, b1, b2, base, count)``: a program's positions among the ``m`` keys left
        (``todo``: indices into ``new_keys``), each key's two buckets and its partition's first
        bucket and bucket count (``buckets_of``)."""
        p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = p < m
        k = tl.load(todo_ptr + p, mask=valid, other=0)
        h = mix64(tl.load(new_keys_ptr + k, mask=valid, other=0).to(tl.uint64))
        b1, b2, base, count = buckets_of(h, k, valid, num_buckets, starts_ptr, parts_ptr, PARTS)
        return p, valid, b1, b2, base, count

    @triton.jit
    def _displaceable(tags_ptr, pins_ptr, pin_ids_ptr, num_pins, claimed, slot, lane, live):
        """Where ``live``: whether ``slot`` (``lane`` of a bucket whose claimed mask is
        ``claimed``) holds a resident the plan may move or evict: not claimed, occupied, not
        pinned."""
        live = live & (((claimed >> lane) & 1) == 0)
        live = live & (tl.load(tags_ptr + slot, mask=live, other=_EMPTY_TAG) != _EMPTY_TAG)
        return _unpinned(pins_ptr, pin_ids_ptr, num_pins, slot, live)

    @triton.jit
    def _bid(bid_round, p):
        """A key's bid for a slot in an eviction round: ``bid_round << 32 | (2**32 - 1 - p)``, so
        the slot's largest bid is the latest round's best-ranked key (``p``: its position among
        the keys in play, in rank order)."""
        return (bid_round.to(tl.int64) << 32) | (0xFFFFFFFF - p)

    @triton.jit(do_not_specialize=["num_pins", "m", "num_buckets", "bid_round"])
    def _displace_kernel(
        keys_ptr, tags_ptr, scores_ptr, claimed_ptr, pins_ptr, pin_ids_ptr, num_pins, new_keys_ptr, todo_ptr,
        slot_ptr, dst_ptr, live_ptr, bids_ptr, starts_ptr, parts_ptr, bid_round, m, num_buckets, BS: tl.constexpr,
        BSP: tl.constexpr, EVICT: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Per key left (rank order), from the plan's state at the round's start, among the
        # residents of its two buckets (the first bucket's lanes first) that may be displaced
        # (occupied, not claimed, not pinned): EVICT, the lowest (score, slot); else the first
        # that can move to a free lane of its own other bucket, and that bucket. NO_SLOT (and
        # num_buckets, which sorts last) where none.
        # EVICT: only the keys still live (live[p] != 0) choose; each bids for its slot (_bid):
        # the slot's largest bid is this round's best-ranked key wanting it (an integer max: the
        # order the atomics land in does not matter).
        # A resident of a key's buckets is of the key's partition (base, count): it hashes there.
        p, valid, b1, b2, base, count = _keys_left(new_keys_ptr, todo_ptr, m, num_buckets, starts_ptr, parts_ptr,
                                                   PARTS, BLOCK)  # fmt: skip
        in_range = valid
        lanes = BS
        if EVICT:
            valid = valid & (tl.load(live_ptr + p, mask=valid, other=0) != 0)
            lanes = BS * tl.max(valid.to(tl.int32), axis=0)  # a program with no key in play skips the lanes
        best = tl.full([BLOCK], _NO_SLOT, tl.int64)
        best_score = tl.zeros([BLOCK], tl.int64)
        dst = tl.zeros([BLOCK], tl.int64) + num_buckets
        for half in tl.static_range(2):
            bucket = b1 if half == 0 else b2
            claimed = tl.load(claimed_ptr + bucket, mask=valid, other=0)
            lane = 0
            while lane < lanes:
                slot = bucket * BS + lane
                live = valid if EVICT else valid & (best == _NO_SLOT)
                live = _displaceable(tags_ptr, pins_ptr, pin_ids_ptr, num_pins, claimed, slot, lane, live)
                if EVICT:
                    score = tl.load(scores_ptr + slot, mask=live, other=0)
                    better = live & (
                        (best == _NO_SLOT) | (score < best_score) | ((score == best_score) & (slot < best))
                    )
                    best_score = tl.where(better, score, best_score)
                else:
                    resident = tl.load(keys_ptr + slot, mask=live, other=0)
                    r1, r2 = buckets_in(mix64(resident.to(tl.uint64)), base, count)
                    alt = tl.where(r1 == bucket, r2, r1)
                    live = live & (alt != bucket)
                    room = tl.sum(_free_lanes(tags_ptr, claimed_ptr, alt, live, BS, BSP).to(tl.int32), axis=1) > 0
                    better = live & room
                    dst = tl.where(better, alt, dst)
                best = tl.where(better, slot, best)
                lane += 1
        tl.store(slot_ptr + p, best, mask=in_range)
        if EVICT:
            tl.atomic_max(bids_ptr + tl.maximum(best, 0), _bid(bid_round, p), mask=best != _NO_SLOT)
        else:
            tl.store(dst_ptr + p, dst.to(tl.int32), mask=in_range)

    @triton.jit(do_not_specialize=["bid_round", "m"])
    def _settle_kernel(
        slot_ptr, bids_ptr, todo_ptr, out_ptr, won_ptr, live_ptr, claimed_ptr, bid_round, m, BS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        # After a round's bids: a key whose bid is its slot's largest takes the slot (its key's
        # slot in out, the round it won in, the lane claimed); a key that found no slot gives up.
        # Either leaves play; the others bid again next round.
        p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = p < m
        s = tl.load(slot_ptr + p, mask=valid, other=_NO_SLOT)
        has = valid & (s != _NO_SLOT)
        s = tl.maximum(s, 0)
        win = has & (tl.load(bids_ptr + s, mask=has, other=0) == _bid(bid_round, p))
        k = tl.load(todo_ptr + p, mask=win, other=0)
        tl.store(out_ptr + k, s, mask=win)
        tl.store(won_ptr + p, tl.zeros([BLOCK], tl.int32) + bid_round, mask=win)
        tl.atomic_or(claimed_ptr + s // BS, tl.full([BLOCK], 1, tl.int64) << (s % BS), mask=win)
        tl.store(live_ptr + p, tl.zeros([BLOCK], tl.int8), mask=valid & (win | ~has))

    @triton.jit(do_not_specialize=["n"])
    def _place_kernel(
        keys_ptr, scores_ptr, tags_ptr, slots_ptr, new_keys_ptr, new_scores_ptr, n, BLOCK: tl.constexpr
    ):  # fmt: skip
        # Key i goes to slots[i] (NO_SLOT: none) with its score and tag. Slots are distinct: no
        # two programs write one. A free slot's score is 0 already: a score of 0 is not written
        # (a dynamic table inserts with zero scores).
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = i < n
        s = tl.load(slots_ptr + i, mask=valid, other=_NO_SLOT)
        ok = valid & (s != _NO_SLOT)
        k = tl.load(new_keys_ptr + i, mask=ok, other=0)
        score = tl.load(new_scores_ptr + i, mask=ok, other=0)
        tl.store(keys_ptr + s, k, mask=ok)
        tl.store(scores_ptr + s, score, mask=ok & (score != 0))
        tl.store(tags_ptr + s, key_tag(mix64(k.to(tl.uint64))), mask=ok)


class PlanState(NamedTuple):
    """What an insert plan reads of the index (``keys``, ``tags``, ``scores``, ``pins``: its
    arrays), and the plan's claimed lanes (``claimed``: one int64 bit mask a bucket; each step
    adds its claims)."""

    keys: torch.Tensor
    tags: torch.Tensor
    scores: torch.Tensor
    pins: torch.Tensor
    claimed: torch.Tensor
    num_buckets: int
    bucket_size: int
    parts: Optional[Partitions] = None  # a partitioned index's, the new keys' partitions

    @classmethod
    def fresh(
        cls,
        keys: torch.Tensor,
        tags: torch.Tensor,
        scores: torch.Tensor,
        pins: torch.Tensor,
        num_buckets: int,
        bucket_size: int,
        parts: Optional[Partitions] = None,
    ) -> PlanState:
        """The state of a plan that has claimed nothing yet."""
        claimed = torch.zeros(num_buckets, dtype=torch.int64, device=tags.device)
        return cls(keys, tags, scores, pins, claimed, num_buckets, bucket_size, parts)


def plan_insert(
    state: PlanState,
    new_keys: torch.Tensor,
    order: torch.Tensor,
    out: torch.Tensor,
    move_pins: Optional[torch.Tensor],
    evict_pins: Optional[torch.Tensor],
    allow_evict: bool,
    free_slots: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three steps for ``new_keys`` (unique, absent; ``order``: their indices in rank order):
    writes each key's slot into ``out`` (int64, :data:`NO_SLOT` before); returns ``(keys left,
    moved from, moved to, evicted)``. ``move_pins`` / ``evict_pins``: step ids (modulo PIN_WRAP)
    whose pinned residents step 2 does not move / step 3 does not evict; step 3 runs only if
    ``allow_evict``. ``free_slots`` 0 (the index has no empty slot): steps 1 and 2, which would
    place nothing, are skipped (-1: unknown)."""
    device = state.tags.device
    empty = torch.empty(0, dtype=torch.int64, device=device)
    new_keys = new_keys.contiguous()  # the kernels read it by index
    todo = claim_free_slots(state, new_keys, order, out) if free_slots != 0 else order
    moved_from, moved_to, evicted = empty, empty, empty
    if todo.numel() and free_slots != 0:
        todo, moved_from, moved_to = claim_by_moving(state, new_keys, todo, out, move_pins)
    if todo.numel() and allow_evict:
        evicted = claim_by_evicting(state, new_keys, todo, out, evict_pins)
    return todo, moved_from, moved_to, evicted


def claim_free_slots(state: PlanState, keys: torch.Tensor, order: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Step 1: each round, every key without a slot (``order``: indices into ``keys``, in rank
    order) takes, from the free counts at the round's start, the emptier of its two candidate
    buckets (ties: the first); the first ``free`` keys choosing a bucket get its free lanes in
    ascending order. Writes slots into ``out``; returns the keys (indices, rank order) whose two
    buckets are full.

    A round is a kernel choosing buckets (hashing the keys itself), a stable sort by bucket, a
    searchsorted for each key's rank in its bucket, a kernel claiming lanes and counting the keys
    placed, and one OR-ing the claims into ``state.claimed``. Then the host reads the count (one
    read); only if some keys were not placed does it take those for another round, which sorts
    only them. A round that places no key ends it (every key left has two full buckets: a round
    with a live key places at least its bucket's first)."""
    tags, claimed, num_buckets, bucket_size = state.tags, state.claimed, state.num_buckets, state.bucket_size
    device = tags.device
    block = TUNING.claim_block
    consts = dict(BS=bucket_size, BSP=triton.next_power_of_2(bucket_size), BLOCK=block)
    keys = keys.contiguous()
    starts, key_parts, partitioned = partition_args(state.parts, keys)
    while (m := order.numel()) > 0:
        grid = (triton.cdiv(m, block),)
        choice = torch.empty(m, dtype=torch.int32, device=device)
        lane = torch.empty(m, dtype=torch.int64, device=device)
        placed = torch.zeros(1, dtype=torch.int32, device=device)
        _choose_kernel[grid](
            tags, claimed, keys, order, out, choice, starts, key_parts, m, num_buckets, PARTS=partitioned, **consts
        )  # fmt: skip
        sorted_choice, perm, first = _rank_in_groups(choice)
        _claim_kernel[grid](
            tags, claimed, sorted_choice, perm, first, order, out, lane, placed, m, num_buckets, **consts
        )  # fmt: skip
        _mark_claimed_kernel[grid](claimed, sorted_choice, lane, m, BLOCK=block)
        num_placed = int(placed)
        if num_placed == m:
            return order[:0]
        if num_placed == 0:
            break
        order = order[out[order] == NO_SLOT]
    return order


def claim_by_moving(
    state: PlanState, keys: torch.Tensor, todo: torch.Tensor, out: torch.Tensor, pin_ids: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 2: each round, every key left (``todo``: indices into ``keys``, rank order) picks the
    first resident of its buckets that may move to a free lane of its own other bucket (from the
    state at the round's start); the best-ranked key of each resident, then the first ``free`` of
    a target bucket, take it. Writes the keys' slots into ``out``, claims in ``state.claimed``;
    returns ``(keys left, moved from, moved to)``, the moves in round and rank order.
    ``pin_ids``: a resident whose pin is one of these (as ``pins`` holds step ids) does not move.
    One host read a round."""
    tags, claimed, num_buckets, bucket_size = state.tags, state.claimed, state.num_buckets, state.bucket_size
    device = tags.device
    bsp = triton.next_power_of_2(bucket_size)
    pin_ids, num_pins = _pin_ids(pin_ids, device)
    block = TUNING.displace_block
    starts, key_parts, partitioned = partition_args(state.parts, keys)
    froms, tos = [], []
    while (m := todo.numel()) > 0:
        grid = (triton.cdiv(m, block),)
        src = torch.empty(m, dtype=torch.int64, device=device)
        dst = torch.empty(m, dtype=torch.int32, device=device)
        _displace_kernel[grid](
            state.keys, tags, state.scores, claimed, state.pins, pin_ids, num_pins, keys, todo, src, dst, dst, dst,
            starts, key_parts, 0, m, num_buckets, BS=bucket_size, BSP=bsp, EVICT=False, PARTS=partitioned,
            BLOCK=block,
        )  # fmt: skip
        # one mover a resident (the best-ranked), then as many a target bucket as it has free lanes
        dst = torch.where(_first_in_groups(src) & (src != NO_SLOT), dst, num_buckets)
        sorted_dst, perm, first = _rank_in_groups(dst)
        lane = torch.empty(m, dtype=torch.int64, device=device)
        at = torch.full((m,), NO_SLOT, dtype=torch.int64, device=device)
        placed = torch.zeros(1, dtype=torch.int32, device=device)
        _claim_kernel[grid](
            tags, claimed, sorted_dst, perm, first, torch.arange(m, device=device), at, lane, placed, m, num_buckets,
            BS=bucket_size, BSP=bsp, BLOCK=block,
        )  # fmt: skip
        _mark_claimed_kernel[grid](claimed, sorted_dst, lane, m, BLOCK=block)
        moved = at != NO_SLOT
        _mark_slots(claimed, bucket_size, torch.where(moved, src, NO_SLOT))
        out[todo] = torch.where(moved, src, out[todo])
        k = int(placed)  # the one host read: none when no key has a resident to move, or none fits
        if k == 0:
            break
        at_moved = torch.nonzero_static(moved, size=k).squeeze(1)  # sizes known: no more host reads
        froms.append(src[at_moved])
        tos.append(at[at_moved])
        todo = todo[torch.nonzero_static(~moved, size=m - k).squeeze(1)]
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return todo, (torch.cat(froms) if froms else empty), (torch.cat(tos) if tos else empty)


def claim_by_evicting(
    state: PlanState, keys: torch.Tensor, todo: torch.Tensor, out: torch.Tensor, pin_ids: Optional[torch.Tensor]
) -> torch.Tensor:
    """Step 3: each round, every key left (rank order) picks the lowest (score, slot) among the
    residents of its buckets that may be evicted; the best-ranked key of each slot takes it, the
    others try again, and a key with none gives up. Writes the keys' slots into ``out``, claims in
    ``state.claimed``; returns the evicted slots, in round and rank order. ``pin_ids``: a
    resident whose pin is one of these is not evicted.

    A round is two kernels over the keys in play (choose and bid, settle), the ones out of play
    masked. The host reads how many are still in play once every :data:`EVICT_ROUNDS_PER_READ`
    rounds (a round with none left launches kernels that do nothing) and keeps only those for
    the next rounds, so a step's dozen rounds cost a read or three, not one each. The bids take
    one int64 a slot of the index while planning (``docs/memory.md``)."""
    claimed, num_buckets, bucket_size = state.claimed, state.num_buckets, state.bucket_size
    device = claimed.device
    pin_ids, num_pins = _pin_ids(pin_ids, device)
    block = TUNING.displace_block
    consts = dict(BS=bucket_size, BSP=triton.next_power_of_2(bucket_size), BLOCK=block)
    bids = torch.zeros(num_buckets * bucket_size, dtype=torch.int64, device=device)
    starts, key_parts, partitioned = partition_args(state.parts, keys)
    todo = todo.contiguous()
    evicted = []
    bid_round = 0  # rounds so far: a round's bids outbid every earlier round's
    while m := todo.numel():
        grid = (triton.cdiv(m, block),)
        slot = torch.empty(m, dtype=torch.int64, device=device)
        live = torch.ones(m, dtype=torch.int8, device=device)
        won = torch.zeros(m, dtype=torch.int32, device=device)  # the round a key won in (0: none yet)
        for _ in range(EVICT_ROUNDS_PER_READ):
            bid_round += 1
            _displace_kernel[grid](
                state.keys, state.tags, state.scores, claimed, state.pins, pin_ids, num_pins, keys, todo, slot, slot,
                live, bids, starts, key_parts, bid_round, m, num_buckets, EVICT=True, PARTS=partitioned, **consts,
            )  # fmt: skip
            _settle_kernel[grid](
                slot, bids, todo, out, won, live, claimed, bid_round, m, BS=bucket_size, BLOCK=block
            )  # fmt: skip
        in_play, wins = torch.stack([live.sum(dtype=torch.int64), torch.count_nonzero(won)]).tolist()  # the read
        winners = torch.nonzero_static(won, size=wins).squeeze(1)  # rank order
        evicted.append(out[todo[winners[torch.sort(won[winners], stable=True).indices]]])  # round, rank order
        todo = todo[torch.nonzero_static(live, size=in_play).squeeze(1)]
    return torch.cat(evicted) if evicted else torch.empty(0, dtype=torch.int64, device=device)


def place_keys(
    keys: torch.Tensor,
    scores: torch.Tensor,
    tags: torch.Tensor,
    slots: torch.Tensor,
    new_keys: torch.Tensor,
    new_scores: torch.Tensor,
) -> None:
    """Writes ``new_keys[i]`` with ``new_scores[i]`` and its tag into slot ``slots[i]`` (distinct,
    free: key 0 and score 0; :data:`NO_SLOT`: not placed) of a hash index's arrays, in one
    kernel."""
    n = slots.numel()
    if n:
        t = TUNING
        _place_kernel[(triton.cdiv(n, t.place_block),)](
            keys, scores, tags, slots.contiguous(), new_keys.contiguous(), new_scores.contiguous(), n,
            BLOCK=t.place_block, num_warps=t.place_warps,
        )  # fmt: skip


def _mark_slots(claimed: torch.Tensor, bucket_size: int, slots: torch.Tensor) -> None:
    """ORs the lanes of ``slots`` (int64, :data:`NO_SLOT`: skipped) into the masks ``claimed``."""
    if m := slots.numel():
        block = TUNING.mark_block
        _mark_slots_kernel[(triton.cdiv(m, block),)](claimed, slots.contiguous(), m, BS=bucket_size, BLOCK=block)


def _pin_ids(pin_ids: Optional[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, int]:
    """``(ids, count)``: the pins that block, int32 on ``device`` (one unread entry if none)."""
    if pin_ids is None or not pin_ids.numel():
        return torch.zeros(1, dtype=torch.int32, device=device), 0
    pin_ids = pin_ids.to(torch.int32)
    if pin_ids.device.type == "cpu" and device.type == "cuda":
        # from page-locked memory: a copy that does not wait for the stream (a pageable one would)
        return pin_ids.pin_memory().to(device, non_blocking=True), pin_ids.numel()
    return pin_ids.to(device), pin_ids.numel()


def _rank_in_groups(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted groups, perm, first)``: a stable sort of ``groups`` and, per sorted position,
    where its group starts (a key's rank in its group is ``i - first[i]``)."""
    sorted_groups, perm = torch.sort(groups, stable=True)
    return sorted_groups, perm, torch.searchsorted(sorted_groups, sorted_groups)


def _first_in_groups(groups: torch.Tensor) -> torch.Tensor:
    """Mask of the first element (in input order) of each group."""
    _, perm, first = _rank_in_groups(groups)
    out = torch.empty_like(groups, dtype=torch.bool)
    out[perm] = first == torch.arange(groups.numel(), device=groups.device)
    return out
