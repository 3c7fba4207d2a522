"""Triton kernels of the CUDA path: the hash find, the pooled lookup, and the fused backward +
update of every registered optimizer.

Each kernel computes what the plain-torch code computes (the tests on the device compare them:
identical slots, weights within rtol 1e-5 / atol 1e-6), without its intermediate tensors and
without host syncs:

- :func:`find_two_choice`: one program per block of keys; a key reads its first bucket's 16 tag
  bytes and only then its second's, and a key only where a tag matches.
- :func:`pooled_forward`: one program per bag, rows summed in bag order (weighted).
- :func:`claim_free_slots`, :func:`claim_by_moving`, :func:`claim_by_evicting`: the three steps
  of an insert plan (free slots, one cuckoo move, eviction, in ranked rounds), the plain-torch
  planner's plan exactly, the plan's claims one bit mask a bucket, one host read a round;
  :func:`place_keys`: a plan of new keys into free slots committed in one kernel.
- :func:`bag_update`: the ids of a step sorted once (stable) and cut into fixed blocks; a block's
  runs of equal rows are summed (one occurrence at a time for wide rows, by a segmented scan of
  the block as one tile for narrow ones) and their rows updated in one pass, and a run crossing
  blocks is finished from the blocks' partial sums, in block order. Static grids (no
  ``unique``, no host sync), and no floating-point value is ever accumulated with atomics: the
  result does not depend on timing.

The update kernel is a template over the optimizer: a compile-time code and its scalars, the
``KernelArgs`` each optimizer registers in ``OptimizerDef.kernel``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # the CPU machines: the plain-torch path runs
    HAVE_TRITON = False

__all__ = [
    "HAVE_TRITON",
    "HostReadback",
    "PlanState",
    "available",
    "bag_update",
    "claim_by_evicting",
    "claim_by_moving",
    "claim_free_slots",
    "find_two_choice",
    "place_keys",
    "pooled_forward",
]


# Keys a program and warps of the find and place kernels (benchmarks/tune_index.py)
FIND_BLOCK, FIND_WARPS = 128, 4
PLACE_BLOCK, PLACE_WARPS = 256, 4


def available(device: torch.device) -> bool:
    return HAVE_TRITON and device.type == "cuda"


if HAVE_TRITON:

    @triton.jit
    def _mix64(x):
        x = x ^ (x >> 30)
        x = x * 0xBF58476D1CE4E5B9
        x = x ^ (x >> 27)
        x = x * 0x94D049BB133111EB
        return x ^ (x >> 31)

    @triton.jit
    def _tag(h):
        """A key's tag from its ``mix64`` hash ``h`` (uint64): the top byte, 1 where it is 0
        (``hash_index.key_tags``)."""
        tag = (h >> 56).to(tl.uint8)
        return tl.where(tag == 0, 1, tag).to(tl.uint8)

    @triton.jit
    def _buckets(h, num_buckets):
        """The two candidate buckets of a key from its ``mix64`` hash ``h`` (uint64): its 32-bit
        halves modulo ``num_buckets`` (< 2^32), in 32-bit arithmetic (``candidate_buckets``)."""
        nb = num_buckets.to(tl.uint32)
        b1 = ((h & 0xFFFFFFFF).to(tl.uint32) % nb).to(tl.int64)
        b2 = ((h >> 32).to(tl.uint32) % nb).to(tl.int64)
        return b1, b2

    @triton.jit(do_not_specialize=["num_buckets"])
    def _candidate_buckets_kernel(keys_ptr, b1_ptr, b2_ptr, n, num_buckets, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        b1, b2 = _buckets(_mix64(tl.load(keys_ptr + offs, mask=valid, other=0).to(tl.uint64)), num_buckets)
        tl.store(b1_ptr + offs, b1, mask=valid)
        tl.store(b2_ptr + offs, b2, mask=valid)

    @triton.jit
    def _probe_bucket(keys_ptr, tags_ptr, bucket, q, tag, need, BS: tl.constexpr, BSP: tl.constexpr):
        """``(found, lane)`` of each query ``q`` in its ``bucket`` (``BS`` slots; ``BSP`` the next
        power of two), read only where ``need``: the bucket's ``BS`` tag bytes, then the keys only
        at the lanes whose tag matches (a nonzero tag is an occupied slot)."""
        lanes = tl.arange(0, BSP)
        slots = bucket[:, None] * BS + lanes[None, :]
        need2 = need[:, None] & (lanes < BS)[None, :]
        cand = (tl.load(tags_ptr + slots, mask=need2, other=0) == tag[:, None]) & need2
        hit = cand & (tl.load(keys_ptr + slots, mask=cand, other=0) == q[:, None])
        return tl.max(hit.to(tl.int32), axis=1) > 0, tl.argmax(hit.to(tl.int32), axis=1)

    @triton.jit
    def _find_slot(keys_ptr, tags_ptr, q, h, b1, b2, need, BS: tl.constexpr, BSP: tl.constexpr):
        """Each query's slot, -1 where absent (``h``: its ``mix64`` hash, ``b1``/``b2``: its
        buckets), read only where ``need``: its first bucket's tags (16 bytes, one sector), the
        second bucket's only for keys the first lacks, and a key only where a tag matches (1 lane
        in 255 by chance: an absent key almost never reads one)."""
        tag = _tag(h)
        found1, lane1 = _probe_bucket(keys_ptr, tags_ptr, b1, q, tag, need, BS, BSP)
        found2, lane2 = _probe_bucket(keys_ptr, tags_ptr, b2, q, tag, need & (found1 == 0), BS, BSP)
        return tl.where(found1, b1 * BS + lane1, tl.where(found2, b2 * BS + lane2, -1))

    @triton.jit
    def _empty_lanes(tags_ptr, bucket, valid, BS: tl.constexpr, BSP: tl.constexpr):
        """``[BLOCK, BSP]`` mask of each ``bucket``'s empty lanes (tag 0), read only where ``valid``."""
        lanes = tl.arange(0, BSP)
        ok = valid[:, None] & (lanes < BS)[None, :]
        return ok & (tl.load(tags_ptr + bucket[:, None] * BS + lanes[None, :], mask=ok, other=1) == 0)

    @triton.jit
    def _free_lanes(tags_ptr, claimed_ptr, bucket, valid, BS: tl.constexpr, BSP: tl.constexpr):
        """``[BLOCK, BSP]`` mask of each ``bucket``'s free lanes: empty and not claimed by the
        insert plan so far (``claimed``: one int64 bit mask per bucket)."""
        lanes = tl.arange(0, BSP)
        claimed = tl.load(claimed_ptr + bucket, mask=valid, other=0)
        empty = _empty_lanes(tags_ptr, bucket, valid, BS, BSP)
        return empty & (((claimed[:, None] >> lanes.to(tl.int64)[None, :]) & 1) == 0)

    @triton.jit(do_not_specialize=["num_buckets"])
    def _choose_kernel(
        tags_ptr, claimed_ptr, keys_ptr, order_ptr, out_ptr, choice_ptr, m, num_buckets,
        BS: tl.constexpr, BSP: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Per key still without a slot (rank order): the emptier of its two buckets (hashed here)
        # at the round's start (ties: the first), or num_buckets (sorts last) when both are full.
        p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = p < m
        k = tl.load(order_ptr + p, mask=valid, other=0)
        todo = valid & (tl.load(out_ptr + k, mask=valid, other=0) < 0)
        b1, b2 = _buckets(_mix64(tl.load(keys_ptr + k, mask=todo, other=0).to(tl.uint64)), num_buckets)
        f1 = tl.sum(_free_lanes(tags_ptr, claimed_ptr, b1, todo, BS, BSP).to(tl.int32), axis=1)
        f2 = tl.sum(_free_lanes(tags_ptr, claimed_ptr, b2, todo, BS, BSP).to(tl.int32), axis=1)
        choice = tl.where(f2 > f1, b2, b1)
        choice = tl.where(todo & ((f1 > 0) | (f2 > 0)), choice, num_buckets)
        tl.store(choice_ptr + p, choice.to(tl.int32), mask=valid)

    @triton.jit
    def _claim_kernel(
        tags_ptr, claimed_ptr, sorted_ptr, perm_ptr, first_ptr, order_ptr, out_ptr, lane_ptr, placed_ptr, m,
        num_buckets, BS: tl.constexpr, BSP: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Keys sorted by chosen bucket (stable: rank order within a bucket): the r-th key of a
        # bucket takes its r-th free lane (ascending) if the bucket has more than r free lanes.
        # Counts the keys placed (an integer sum: the atomics' order does not matter).
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

    @triton.jit
    def _mark_claimed_kernel(claimed_ptr, sorted_ptr, lane_ptr, m, BLOCK: tl.constexpr):
        # After the round's claims: their lanes join the buckets' claimed masks (an integer OR:
        # the result does not depend on the order the atomics land in).
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = i < m
        lane = tl.load(lane_ptr + i, mask=valid, other=-1)
        placed = valid & (lane >= 0)
        c = tl.load(sorted_ptr + i, mask=placed, other=0).to(tl.int64)
        tl.atomic_or(claimed_ptr + c, tl.full([BLOCK], 1, tl.int64) << tl.maximum(lane, 0), mask=placed)

    @triton.jit
    def _mark_slots_kernel(claimed_ptr, slots_ptr, m, BS: tl.constexpr, BLOCK: tl.constexpr):
        # Each slot's lane (-1: none) OR-ed into its bucket's claimed mask (an integer OR: the
        # order the atomics land in does not matter).
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(slots_ptr + i, mask=i < m, other=-1)
        ok = s >= 0
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
    def _keys_left(new_keys_ptr, todo_ptr, m, num_buckets, BLOCK: tl.constexpr):
        """``(p, valid, b1, b2)``: a program's positions among the ``m`` keys left (``todo``:
        indices into ``new_keys``) and each key's two buckets."""
        p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = p < m
        k = tl.load(todo_ptr + p, mask=valid, other=0)
        b1, b2 = _buckets(_mix64(tl.load(new_keys_ptr + k, mask=valid, other=0).to(tl.uint64)), num_buckets)
        return p, valid, b1, b2

    @triton.jit
    def _displaceable(tags_ptr, pins_ptr, pin_ids_ptr, num_pins, claimed, slot, lane, live):
        """Where ``live``: whether ``slot`` (``lane`` of a bucket whose claimed mask is
        ``claimed``) holds a resident the plan may move or evict: not claimed, occupied, not
        pinned."""
        live = live & (((claimed >> lane) & 1) == 0)
        live = live & (tl.load(tags_ptr + slot, mask=live, other=0) != 0)
        return _unpinned(pins_ptr, pin_ids_ptr, num_pins, slot, live)

    @triton.jit(do_not_specialize=["num_buckets", "num_pins"])
    def _displace_kernel(
        keys_ptr, tags_ptr, scores_ptr, claimed_ptr, pins_ptr, pin_ids_ptr, num_pins, new_keys_ptr, todo_ptr,
        slot_ptr, dst_ptr, m, num_buckets, BS: tl.constexpr, BSP: tl.constexpr, EVICT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Per key left (rank order), from the plan's state at the round's start, among the
        # residents of its two buckets (the first bucket's lanes first) that may be displaced
        # (occupied, not claimed, not pinned): EVICT, the lowest (score, slot); else the first
        # that can move to a free lane of its own other bucket, and that bucket. -1 (and
        # num_buckets, which sorts last) where none.
        p, valid, b1, b2 = _keys_left(new_keys_ptr, todo_ptr, m, num_buckets, BLOCK)
        best = tl.full([BLOCK], -1, tl.int64)
        best_score = tl.zeros([BLOCK], tl.int64)
        dst = tl.zeros([BLOCK], tl.int64) + num_buckets
        for half in tl.static_range(2):
            bucket = b1 if half == 0 else b2
            claimed = tl.load(claimed_ptr + bucket, mask=valid, other=0)
            lane = 0
            while lane < BS:
                slot = bucket * BS + lane
                live = valid if EVICT else valid & (best < 0)
                live = _displaceable(tags_ptr, pins_ptr, pin_ids_ptr, num_pins, claimed, slot, lane, live)
                if EVICT:
                    score = tl.load(scores_ptr + slot, mask=live, other=0)
                    better = live & ((best < 0) | (score < best_score) | ((score == best_score) & (slot < best)))
                    best_score = tl.where(better, score, best_score)
                else:
                    resident = tl.load(keys_ptr + slot, mask=live, other=0)
                    r1, r2 = _buckets(_mix64(resident.to(tl.uint64)), num_buckets)
                    alt = tl.where(r1 == bucket, r2, r1)
                    live = live & (alt != bucket)
                    room = tl.sum(_free_lanes(tags_ptr, claimed_ptr, alt, live, BS, BSP).to(tl.int32), axis=1) > 0
                    better = live & room
                    dst = tl.where(better, alt, dst)
                best = tl.where(better, slot, best)
                lane += 1
        tl.store(slot_ptr + p, best, mask=valid)
        if not EVICT:
            tl.store(dst_ptr + p, dst.to(tl.int32), mask=valid)

    @triton.jit
    def _place_kernel(
        keys_ptr, scores_ptr, tags_ptr, slots_ptr, new_keys_ptr, new_scores_ptr, n, BLOCK: tl.constexpr
    ):  # fmt: skip
        # Key i goes to slots[i] (-1: none) with its score and tag. Slots are distinct: no two
        # programs write one. A free slot's score is 0 already: a score of 0 is not written (one
        # scattered store fewer a key, for the zero scores a dynamic table inserts with).
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = i < n
        s = tl.load(slots_ptr + i, mask=valid, other=-1)
        ok = valid & (s >= 0)
        k = tl.load(new_keys_ptr + i, mask=ok, other=0)
        score = tl.load(new_scores_ptr + i, mask=ok, other=0)
        tl.store(keys_ptr + s, k, mask=ok)
        tl.store(scores_ptr + s, score, mask=ok & (score != 0))
        tl.store(tags_ptr + s, _tag(_mix64(k.to(tl.uint64))), mask=ok)

    # num_buckets not specialized: Triton makes an int argument equal to 1 a constant, which has
    # no .to() (a one-bucket table would not compile)
    @triton.jit(do_not_specialize=["num_buckets"])
    def _find_kernel(
        keys_ptr, tags_ptr, query_ptr, out_ptr, absent_ptr, n, num_buckets, BS: tl.constexpr, BSP: tl.constexpr,
        FLAG: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Per key, _find_slot. The buckets are mix64's 32-bit halves modulo num_buckets (< 2^32):
        # 32-bit arithmetic; the tag is its top byte (0 -> 1).
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        q = tl.load(query_ptr + offs, mask=valid, other=0)
        h = _mix64(q.to(tl.uint64))
        b1, b2 = _buckets(h, num_buckets)
        slot = _find_slot(keys_ptr, tags_ptr, q, h, b1, b2, valid, BS, BSP)
        tl.store(out_ptr + offs, slot, mask=valid)
        if FLAG:  # a program with an absent key sets the flag (every such store writes 1)
            tl.store(absent_ptr, 1, mask=tl.max((valid & (slot < 0)).to(tl.int32), axis=0) > 0)

    @triton.jit
    def _pooled_kernel(
        weight_ptr, rows_ptr, offsets_ptr, psw_ptr, out_ptr, D, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr
    ):
        # Rows summed one at a time in bag order: on an H200 this beat reading 16 rows a time as
        # one [16, BLOCK_D] tile (133 vs 205 us for 65,536 bags of 16 rows of 128 floats).
        bag = tl.program_id(0).to(tl.int64)
        start = tl.load(offsets_ptr + bag)
        end = tl.load(offsets_ptr + bag + 1)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        i = start
        while i < end:  # (a while loop: Triton's interpreter, used in development, runs it too)
            r = tl.load(rows_ptr + i)
            v = tl.load(weight_ptr + r * D + d, mask=dm, other=0.0)
            if HAS_W:
                v = v * tl.load(psw_ptr + i)
            acc += v
            i += 1
        tl.store(out_ptr + bag * D + d, acc, mask=dm)

    @triton.jit
    def _apply_update(
        weight_ptr, s1_ptr, s2_ptr, row, live, g, d, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay,
        OPT: tl.constexpr, WD_MODE: tl.constexpr,
    ):  # fmt: skip
        """The optimizer step of ``R`` rows (``row``: [R] int64, only where ``live``) from their
        aggregated gradients ``g`` ([R, BLOCK_D] float32)."""
        dm = live[:, None] & (d < D)[None, :]
        off = row[:, None] * D + d[None, :]
        w = tl.load(weight_ptr + off, mask=dm, other=0.0)
        if OPT == 0:  # SGD
            w = w - lr * g
        elif OPT == 1:  # Adagrad: h += g*g; w -= lr * g / (sqrt(h) + eps)
            h = tl.load(s1_ptr + off, mask=dm, other=0.0) + g * g
            tl.store(s1_ptr + off, h, mask=dm)
            w = w - lr * g / (tl.sqrt(h) + eps)
        elif OPT == 2:  # RowWiseAdagrad
            gu = g
            if WD_MODE == 1:
                gu = g + wd * w
            gu = tl.where(dm, gu, 0.0)
            h = tl.load(s1_ptr + row, mask=live, other=0.0) + tl.sum(gu * gu, axis=1) / D
            tl.store(s1_ptr + row, h, mask=live)
            m = (lr / (tl.sqrt(h) + eps))[:, None]
            if WD_MODE == 2:
                w = decay * w - m * g
            else:
                w = w - m * gu
        else:  # Adam with bias correction and decoupled weight decay
            m1 = tl.load(s1_ptr + off, mask=dm, other=0.0) * beta1 + c1 * g
            m2 = tl.load(s2_ptr + off, mask=dm, other=0.0) * beta2 + c2 * g * g
            tl.store(s1_ptr + off, m1, mask=dm)
            tl.store(s2_ptr + off, m2, mask=dm)
            upd = (m1 / bias1) / (tl.sqrt(m2 / bias2) + eps)
            if WD_MODE == 2:
                upd = upd + wd * w
            w = w - lr * upd
        tl.store(weight_ptr + off, w, mask=dm)

    @triton.jit
    def _segmented_add(v1, f1, v2, f2):
        """Combine of a segmented sum scan: a set flag starts a new segment."""
        return tl.where(f2 != 0, v2, v1 + v2), f1 | f2

    # score not specialized: an int argument equal to 1 would become a constant
    @triton.jit(do_not_specialize=["score"])
    def _update_block_kernel(
        weight_ptr, s1_ptr, s2_ptr, grad_ptr, order_ptr, sorted_rows_ptr, bag_ptr, psw_ptr, scores_ptr, score,
        part_first_ptr, part_last_ptr, n, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay,
        OPT: tl.constexpr, WD_MODE: tl.constexpr, HAS_W: tl.constexpr, HAS_SCORES: tl.constexpr,
        BLOCK_D: tl.constexpr, L: tl.constexpr,
    ):  # fmt: skip
        """One program per block of ``L`` sorted occurrences, as one [L, BLOCK_D] tile: their
        gradients gathered, summed per run of equal rows by a segmented scan, and every row whose
        run starts and ends in the block updated. A run crossing the block's start leaves its
        sum here in ``part_first``, one crossing its end in ``part_last``, for
        :func:`_update_crossing_kernel`. ``HAS_SCORES``: ``scores[row] = score`` where a run
        ends (once per row)."""
        b = tl.program_id(0).to(tl.int64)
        lane = tl.arange(0, L)
        p = b * L + lane
        pm = p < n
        row = tl.load(sorted_rows_ptr + p, mask=pm, other=-1).to(tl.int64)
        prev = tl.load(sorted_rows_ptr + p - 1, mask=pm & (p > 0), other=-1).to(tl.int64)
        nxt = tl.load(sorted_rows_ptr + p + 1, mask=(p + 1) < n, other=-1).to(tl.int64)
        i = tl.load(order_ptr + p, mask=pm, other=0)
        bag = tl.load(bag_ptr + i, mask=pm, other=0)
        d = tl.arange(0, BLOCK_D)
        dm = (d < D)[None, :]
        g = tl.load(grad_ptr + bag[:, None] * D + d[None, :], mask=pm[:, None] & dm, other=0.0)
        if HAS_W:
            g = g * tl.load(psw_ptr + i, mask=pm, other=0.0)[:, None]
        starts = ((row != prev) | (lane == 0)).to(tl.int32)
        sums, _ = tl.associative_scan((g, tl.broadcast_to(starts[:, None], (L, BLOCK_D))), 0, _segmented_add)
        ends = pm & (row != nxt)  # the last occurrence of a run (sums: the run's total in the block)
        if HAS_SCORES:
            tl.store(scores_ptr + row, tl.zeros([L], dtype=tl.int64) + score.to(tl.int64), mask=ends)
        row0 = tl.load(sorted_rows_ptr + b * L).to(tl.int64)
        before = tl.load(sorted_rows_ptr + b * L - 1, mask=b > 0, other=-1).to(tl.int64)
        crosses_start = row == (tl.where(before == row0, row0, -2))  # lanes of a run begun earlier
        whole = ends & ~crosses_start
        _apply_update(
            weight_ptr, s1_ptr, s2_ptr, row, whole, sums, d, D, lr, eps, wd, beta1, beta2,
            bias1, bias2, c1, c2, decay, OPT, WD_MODE,
        )  # fmt: skip
        first_end = crosses_start & ((row != nxt) | (lane == L - 1))
        if tl.max(first_end.to(tl.int32), axis=0) > 0:
            part = tl.sum(tl.where(first_end[:, None], sums, 0.0), axis=0)
            tl.store(part_first_ptr + b * BLOCK_D + d, part)
        last = pm & (lane == L - 1) & (row == nxt)  # the block's last run goes on into the next
        if tl.max(last.to(tl.int32), axis=0) > 0:
            tl.store(part_last_ptr + b * BLOCK_D + d, tl.sum(tl.where(last[:, None], sums, 0.0), axis=0))

    @triton.jit(do_not_specialize=["score"])
    def _update_run_kernel(
        weight_ptr, s1_ptr, s2_ptr, grad_ptr, order_ptr, sorted_rows_ptr, bag_ptr, psw_ptr, scores_ptr, score,
        part_first_ptr, part_last_ptr, n, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay,
        OPT: tl.constexpr, WD_MODE: tl.constexpr, HAS_W: tl.constexpr, HAS_SCORES: tl.constexpr,
        BLOCK_D: tl.constexpr, L: tl.constexpr,
    ):  # fmt: skip
        """One program per block of ``L`` sorted occurrences, read one at a time: each gradient
        row added to its run's sum in occurrence order, and a run's row updated where the run
        ends, when it began in the block. A run crossing the block's start leaves its sum in
        ``part_first``, one crossing its end in ``part_last``, for
        :func:`_update_crossing_kernel`. ``HAS_SCORES``: ``scores[row] = score`` where a run
        ends (once per row)."""
        b = tl.program_id(0).to(tl.int64)
        start = b * L
        end = tl.minimum(start + L, n)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        before = tl.load(sorted_rows_ptr + start - 1, mask=b > 0, other=-1).to(tl.int64)
        row = tl.load(sorted_rows_ptr + start).to(tl.int64)
        first = row == before  # the block's first run began in an earlier block
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        p = start
        while p < end:
            i = tl.load(order_ptr + p)
            g = tl.load(grad_ptr + tl.load(bag_ptr + i) * D + d, mask=dm, other=0.0)
            if HAS_W:
                g = g * tl.load(psw_ptr + i)
            acc += g
            nxt = tl.load(sorted_rows_ptr + p + 1, mask=p + 1 < n, other=-1).to(tl.int64)
            if nxt != row:  # the run ends here
                if HAS_SCORES:
                    tl.store(scores_ptr + row, score.to(tl.int64))
                if first:
                    tl.store(part_first_ptr + b * BLOCK_D + d, acc)
                else:
                    _apply_update(
                        weight_ptr, s1_ptr, s2_ptr, tl.zeros([1], dtype=tl.int64) + row, tl.full([1], True, tl.int1),
                        acc[None, :], d, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay, OPT, WD_MODE,
                    )  # fmt: skip
                acc = tl.zeros([BLOCK_D], dtype=tl.float32)
                first = False
                row = nxt
            elif p == end - 1:  # the run goes on into the next block
                tl.store(part_last_ptr + b * BLOCK_D + d, acc)
                if first:  # the block lies inside one run
                    tl.store(part_first_ptr + b * BLOCK_D + d, acc)
            p += 1

    @triton.jit
    def _update_crossing_kernel(
        weight_ptr, s1_ptr, s2_ptr, sorted_rows_ptr, part_first_ptr, part_last_ptr,
        n, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay,
        OPT: tl.constexpr, WD_MODE: tl.constexpr, BLOCK_D: tl.constexpr, L: tl.constexpr, P: tl.constexpr,
    ):  # fmt: skip
        """One program per block whose last run begins in it and goes on past it (a hot row, or
        a run cut by a block boundary): its ``part_last``, then the ``part_first`` of each next
        block that the run covers, ``P`` blocks at a time, in block order; then the update."""
        b = tl.program_id(0).to(tl.int64)
        q = b * L + L - 1
        blocks = tl.cdiv(n, L)
        row = tl.load(sorted_rows_ptr + q, mask=q + 1 < n, other=-1).to(tl.int64)
        nxt = tl.load(sorted_rows_ptr + q + 1, mask=q + 1 < n, other=-2).to(tl.int64)
        row0 = tl.load(sorted_rows_ptr + b * L).to(tl.int64)
        before = tl.load(sorted_rows_ptr + b * L - 1, mask=b > 0, other=-1).to(tl.int64)
        if (row == nxt) & ((row0 != row) | (before != row0)):
            d = tl.arange(0, BLOCK_D)
            g = tl.load(part_last_ptr + b * BLOCK_D + d)
            c = b + 1
            while c < blocks:
                cs = c + tl.arange(0, P)
                on = tl.load(sorted_rows_ptr + cs * L, mask=cs < blocks, other=-1).to(tl.int64) == row
                g += tl.sum(
                    tl.load(part_first_ptr + cs[:, None] * BLOCK_D + d[None, :], mask=on[:, None], other=0.0), 0
                )
                c = tl.where(tl.min(on.to(tl.int32), axis=0) > 0, c + P, blocks)  # a block off the run: done
            _apply_update(
                weight_ptr, s1_ptr, s2_ptr, tl.zeros([1], dtype=tl.int64) + row, tl.full([1], True, tl.int1),
                g[None, :], d, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay, OPT, WD_MODE,
            )  # fmt: skip


def _block_d(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def _update_kernel(block_d: int) -> str:
    """The fused update's block kernel for a row width: ``run`` (occurrences read one at a time)
    from 64 floats, ``scan`` (a block as one tile, summed by a segmented scan) below.
    benchmarks/tune_update.py on an H200, Adagrad on Zipf ids of a 10M-row table (ms, 1M / 4.2M
    ids a step, each kernel at its best block length): D = 128: run 0.77 / 2.45, scan 1.32 /
    4.59; D = 32: scan 0.47 / 1.38, run 0.52 / 1.60."""
    return "run" if block_d >= 64 else "scan"


def _block_length(kernel: str, block_d: int) -> int:
    """Occurrences a block takes: 128 for ``run`` (128 and 256 tie; 64 is 10% slower), for
    ``scan`` a tile of about 4096 floats, 8 to 64 occurrences."""
    return 128 if kernel == "run" else max(8, min(64, 4096 // block_d))


def _tile_warps(elements: int) -> int:
    """Warps for a tile of ``elements`` floats: four a thread (one 16-byte access), 1 to 8."""
    return max(1, min(8, elements // 128))


def find_two_choice(
    table_keys: torch.Tensor,
    tags: torch.Tensor,
    num_buckets: int,
    bucket_size: int,
    query: torch.Tensor,
    absent: Optional[torch.Tensor] = None,
    block: int = FIND_BLOCK,
    num_warps: int = FIND_WARPS,
) -> torch.Tensor:
    """Slot of each query key, -1 where absent (``BucketedHashIndex.find``; ``tags``: its uint8
    tag per slot). ``absent``: a zeroed ``[]`` int32 the same pass sets to 1 if a key is absent.
    ``block`` keys a program, on ``num_warps`` warps (tuning knobs: benchmarks/tune_index.py)."""
    query = query.contiguous()
    out = torch.empty_like(query)
    n = query.numel()
    if n:
        _find_kernel[(triton.cdiv(n, block),)](
            table_keys, tags, query, out, out if absent is None else absent, n, num_buckets, BS=bucket_size,
            BSP=triton.next_power_of_2(bucket_size), FLAG=absent is not None, BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
    return out


def candidate_buckets(keys: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``hash_index.candidate_buckets`` in one kernel: ``(b1, b2)``, ``[n]`` int64 each."""
    keys = keys.contiguous()
    b1, b2 = torch.empty_like(keys), torch.empty_like(keys)
    n = keys.numel()
    if n:
        block = 512
        _candidate_buckets_kernel[(triton.cdiv(n, block),)](keys, b1, b2, n, num_buckets, BLOCK=block)
    return b1, b2


def place_keys(
    keys: torch.Tensor,
    scores: torch.Tensor,
    tags: torch.Tensor,
    slots: torch.Tensor,
    new_keys: torch.Tensor,
    new_scores: torch.Tensor,
    block: int = PLACE_BLOCK,
    num_warps: int = PLACE_WARPS,
) -> None:
    """Writes ``new_keys[i]`` with ``new_scores[i]`` and its tag into slot ``slots[i]`` (distinct,
    free: key 0 and score 0; -1: not placed) of a hash index's arrays, in one kernel. ``block`` /
    ``num_warps``: tuning knobs (benchmarks/tune_index.py)."""
    n = slots.numel()
    if n:
        _place_kernel[(triton.cdiv(n, block),)](
            keys, scores, tags, slots.contiguous(), new_keys.contiguous(), new_scores.contiguous(), n,
            BLOCK=block, num_warps=num_warps,
        )  # fmt: skip


def claim_free_slots(
    tags: torch.Tensor,
    num_buckets: int,
    bucket_size: int,
    keys: torch.Tensor,
    order: torch.Tensor,
    out: torch.Tensor,
    claimed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Step 1 of ``BucketedHashIndex.plan_insert`` on the device, the rounds of its plain-torch
    ``_claim_free_slots`` (and the CPU extension's): each round, every key without a slot
    (``order``: indices into ``keys``, in rank order) takes, from the free counts at the round's
    start, the emptier of its two candidate buckets (ties: the first); the first ``free`` keys
    choosing a bucket get its free lanes in ascending order. Writes slots into ``out`` (int64,
    -1 = none yet); returns the keys (indices, rank order) whose two buckets are full.

    A round is a kernel choosing buckets (hashing the keys itself), a stable sort by bucket, a
    searchsorted for each key's rank in its bucket, a kernel claiming lanes and counting the keys
    placed, and one OR-ing the claims into per-bucket masks (no slot is written to the index: a
    plan writes nothing). Then the host reads the count (one read); only if some keys were not
    placed does it take those for another round, which sorts only them (at load 0.5 the first
    round places nearly every key). A round that places no key ends it (every key left has two
    full buckets: a round with a live key places at least its bucket's first). ``bucket_size``
    <= 64. ``claimed``: the plan's claimed lanes, one int64 bit mask a bucket (updated here), for
    steps 2-3 to go on from; zeros if None."""
    device = tags.device
    bsp = triton.next_power_of_2(bucket_size)
    if claimed is None:
        claimed = torch.zeros(num_buckets, dtype=torch.int64, device=device)
    block = 128
    consts = dict(BS=bucket_size, BSP=bsp, BLOCK=block)
    keys = keys.contiguous()
    while (m := order.numel()) > 0:
        grid = (triton.cdiv(m, block),)
        choice = torch.empty(m, dtype=torch.int32, device=device)
        lane = torch.empty(m, dtype=torch.int64, device=device)
        placed = torch.zeros(1, dtype=torch.int32, device=device)
        _choose_kernel[grid](tags, claimed, keys, order, out, choice, m, num_buckets, **consts)
        sorted_choice, perm = torch.sort(choice, stable=True)
        first = torch.searchsorted(sorted_choice, sorted_choice)  # where each key's bucket starts
        _claim_kernel[grid](
            tags, claimed, sorted_choice, perm, first, order, out, lane, placed, m, num_buckets, **consts
        )  # fmt: skip
        _mark_claimed_kernel[grid](claimed, sorted_choice, lane, m, BLOCK=block)
        num_placed = int(placed)
        if num_placed == m:
            return order[:0]
        if num_placed == 0:
            break
        order = order[out[order] < 0]
    return order


def _mark_slots(claimed: torch.Tensor, bucket_size: int, slots: torch.Tensor) -> None:
    """ORs the lanes of ``slots`` (int64, -1: skipped) into the masks ``claimed``."""
    if m := slots.numel():
        _mark_slots_kernel[(triton.cdiv(m, 256),)](claimed, slots.contiguous(), m, BS=bucket_size, BLOCK=256)


def _pin_ids(pin_ids: Optional[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, int]:
    """``(ids, count)``: the pins that block, int32 on ``device`` (one unread entry if none)."""
    if pin_ids is None or not pin_ids.numel():
        return torch.zeros(1, dtype=torch.int32, device=device), 0
    return pin_ids.to(device=device, dtype=torch.int32), pin_ids.numel()


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


class PlanState(NamedTuple):
    """What steps 2-3 of an insert plan read of the index (``keys``, ``tags``, ``scores``,
    ``pins``: its arrays), and the plan's claimed lanes (``claimed``: one int64 bit mask a
    bucket; the steps add theirs)."""

    keys: torch.Tensor
    tags: torch.Tensor
    scores: torch.Tensor
    pins: torch.Tensor
    claimed: torch.Tensor
    num_buckets: int
    bucket_size: int


def claim_by_moving(
    state: PlanState, keys: torch.Tensor, todo: torch.Tensor, out: torch.Tensor, pin_ids: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 2 of ``BucketedHashIndex.plan_insert`` on the device, the rounds of its plain-torch
    ``_claim_by_moving``: each round, every key left (``todo``: indices into ``keys``, rank
    order) picks the first resident of its buckets that may move to a free lane of its own
    other bucket (from the state at the round's start); the best-ranked key of each resident,
    then the first ``free`` of a target bucket, take it. Writes the keys' slots into ``out``,
    claims in ``claimed``; returns ``(keys left, moved from, moved to)``, the moves in round
    and rank order. ``pin_ids``: a resident whose pin is one of these (as ``pins`` holds step
    ids) does not move. One host read a round."""
    tags, claimed, num_buckets, bucket_size = state.tags, state.claimed, state.num_buckets, state.bucket_size
    device = tags.device
    bsp = triton.next_power_of_2(bucket_size)
    pin_ids, num_pins = _pin_ids(pin_ids, device)
    block = 64
    froms, tos = [], []
    while (m := todo.numel()) > 0:
        grid = (triton.cdiv(m, block),)
        src = torch.empty(m, dtype=torch.int64, device=device)
        dst = torch.empty(m, dtype=torch.int32, device=device)
        _displace_kernel[grid](
            state.keys, tags, state.scores, claimed, state.pins, pin_ids, num_pins, keys, todo, src, dst, m,
            num_buckets, BS=bucket_size, BSP=bsp, EVICT=False, BLOCK=block,
        )  # fmt: skip
        # one mover a resident (the best-ranked), then as many a target bucket as it has free lanes
        dst = torch.where(_first_in_groups(src) & (src >= 0), dst, num_buckets)
        sorted_dst, perm, first = _rank_in_groups(dst)
        lane = torch.empty(m, dtype=torch.int64, device=device)
        at = torch.full((m,), -1, dtype=torch.int64, device=device)
        placed = torch.zeros(1, dtype=torch.int32, device=device)
        _claim_kernel[grid](
            tags, claimed, sorted_dst, perm, first, torch.arange(m, device=device), at, lane, placed, m, num_buckets,
            BS=bucket_size, BSP=bsp, BLOCK=block,
        )  # fmt: skip
        _mark_claimed_kernel[grid](claimed, sorted_dst, lane, m, BLOCK=block)
        moved = at >= 0
        _mark_slots(claimed, bucket_size, torch.where(moved, src, -1))
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
    """Step 3 of ``BucketedHashIndex.plan_insert`` on the device, the rounds of its plain-torch
    ``_claim_by_evicting``: each round, every key left (rank order) picks the lowest (score,
    slot) among the residents of its buckets that may be evicted; the best-ranked key of each
    slot takes it, the others try again, and a key with none gives up. Writes the keys' slots
    into ``out``, claims in ``claimed``; returns the evicted slots, in round and rank order.
    ``pin_ids``: a resident whose pin is one of these is not evicted. One host read a round."""
    claimed, num_buckets, bucket_size = state.claimed, state.num_buckets, state.bucket_size
    device = claimed.device
    pin_ids, num_pins = _pin_ids(pin_ids, device)
    block = 64
    evicted = []
    while (m := todo.numel()) > 0:
        slot = torch.empty(m, dtype=torch.int64, device=device)
        _displace_kernel[(triton.cdiv(m, block),)](
            state.keys, state.tags, state.scores, claimed, state.pins, pin_ids, num_pins, keys, todo, slot, slot, m,
            num_buckets, BS=bucket_size, BSP=triton.next_power_of_2(bucket_size), EVICT=True, BLOCK=block,
        )  # fmt: skip
        has = slot >= 0
        win = has & _first_in_groups(slot)
        lost = has & ~win
        _mark_slots(claimed, bucket_size, torch.where(win, slot, -1))
        out[todo] = torch.where(win, slot, out[todo])
        wins, losses = torch.stack([win.sum(), lost.sum()]).tolist()  # the one host read
        if wins == 0:  # no key has a resident to evict
            break
        evicted.append(slot[torch.nonzero_static(win, size=wins).squeeze(1)])
        todo = todo[torch.nonzero_static(lost, size=losses).squeeze(1)]
    return torch.cat(evicted) if evicted else torch.empty(0, dtype=torch.int64, device=device)


class HostReadback:
    """A small device tensor read on the host without a blocking copy: :meth:`queue` copies it
    into pinned memory behind the work queued so far and records an event; :meth:`read` waits
    for that event only. Work queued between the two runs while the host waits (or, read a step
    later, is not waited for at all). On a CPU device, the values themselves."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        cuda = device.type == "cuda"
        self._pinned = torch.empty(shape, dtype=dtype, pin_memory=True) if cuda else None
        self._done = torch.cuda.Event() if cuda else None
        self._values: Optional[torch.Tensor] = None

    def queue(self, values: torch.Tensor, stream: Optional[torch.cuda.Stream]) -> None:
        """Queues the copy of ``values`` (this shape and dtype, on this device) on the current
        stream, which ``stream`` must be (the caller has asked for it already: the event is
        recorded on it)."""
        if self._pinned is None or self._done is None:
            self._values = values
            return
        self._pinned.copy_(values, non_blocking=True)
        self._done.record(stream)
        self._values = self._pinned

    def read(self) -> torch.Tensor:
        """The values last queued, on the host (waits for their copy)."""
        if self._done is not None:
            self._done.synchronize()
        assert self._values is not None, "read() before queue()"
        return self._values


def pooled_forward(
    weight: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor]
) -> torch.Tensor:
    """``out[b] = sum_{i in bag b} psw[i] * weight[rows[i]]``: ``[num_bags, D]`` float32."""
    num_bags, dim = offsets.numel() - 1, weight.shape[1]
    out = torch.empty(num_bags, dim, dtype=torch.float32, device=weight.device)
    if num_bags:
        psw = per_sample_weights.contiguous() if per_sample_weights is not None else rows
        _pooled_kernel[(num_bags,)](
            weight,
            rows.contiguous(),
            offsets.contiguous(),
            psw,
            out,
            dim,
            HAS_W=per_sample_weights is not None,
            BLOCK_D=_block_d(dim),
        )
    return out


def bag_update(
    args,
    *,
    lr: float,
    weight: torch.Tensor,
    states: dict[str, torch.Tensor],
    rows: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    grad_out: torch.Tensor,
    row_scores=None,
    block: Optional[int] = None,
    kernel: Optional[str] = None,
) -> None:
    """Aggregates each unique row's gradient over its occurrences in weighted bags
    (``psw[i] * grad_out[bag(i)]``) and applies the optimizer (``args``: its ``KernelArgs``) to
    the row, in place.

    The occurrences are sorted by row once (stable; int32 keys where the table has under 2^31
    rows: half the radix passes), then cut into blocks of ``block`` occurrences (a power of
    two). A block's program sums its runs of equal rows (``kernel`` ``run``: one occurrence at a
    time; ``scan``: as one tile, by a segmented scan) and updates each run that starts and ends
    in it; a run crossing blocks (a hot row: a Zipf head can hold a tenth of a step's ids) is
    finished by the block where it starts, from the other blocks' partial sums, in block order.
    ``kernel`` and ``block`` default to :func:`_update_kernel` and :func:`_block_length`. Every
    sum has a fixed order, no floating-point atomics, no host sync; four torch ops and two
    kernels a step. ``row_scores`` (a ``RowScores``): the block where a row's run ends also sets
    its score."""
    n, dim = rows.numel(), weight.shape[1]
    if n == 0:
        return
    lengths = offsets[1:] - offsets[:-1]
    bag_of_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=rows.device), lengths, output_size=n)
    sorted_rows, order = torch.sort(rows.to(torch.int32) if weight.shape[0] < 2**31 else rows, stable=True)
    s1, s2 = states.get("momentum1", weight), states.get("momentum2", weight)
    grad_out = grad_out.contiguous()
    psw = per_sample_weights.contiguous() if per_sample_weights is not None else grad_out
    block_d = _block_d(dim)
    kernel = kernel or _update_kernel(block_d)
    block = block or _block_length(kernel, block_d)
    blocks = triton.cdiv(n, block)
    part_first = torch.empty(blocks, block_d, dtype=torch.float32, device=weight.device)
    part_last = torch.empty_like(part_first)
    scalars = (
        dim,
        float(lr),
        float(args.eps),
        float(args.weight_decay),
        float(args.beta1),
        float(args.beta2),
        float(args.bias1),
        float(args.bias2),
        # 1 - beta and 1 - lr * wd in double, then float32: the bits torch's native update uses
        1.0 - args.beta1,
        1.0 - args.beta2,
        1.0 - lr * args.weight_decay,
    )
    opt = dict(OPT=args.code, WD_MODE=args.weight_decay_mode, BLOCK_D=block_d, L=block)
    scores, score = (sorted_rows, 0) if row_scores is None else (row_scores.scores, int(row_scores.value))
    runs = dict(HAS_W=per_sample_weights is not None, HAS_SCORES=row_scores is not None)
    if kernel == "run":
        _update_run_kernel[(blocks,)](
            weight, s1, s2, grad_out, order, sorted_rows, bag_of_id, psw, scores, score, part_first, part_last, n,
            *scalars, **opt, **runs, num_warps=_tile_warps(block_d),
        )  # fmt: skip
    else:
        _update_block_kernel[(blocks,)](
            weight, s1, s2, grad_out, order, sorted_rows, bag_of_id, psw, scores, score, part_first, part_last, n,
            *scalars, **opt, **runs, num_warps=_tile_warps(block * block_d),
        )  # fmt: skip
    if blocks > 1:
        _update_crossing_kernel[(blocks - 1,)](
            weight, s1, s2, sorted_rows, part_first, part_last, n, *scalars, **opt, P=16,
            num_warps=_tile_warps(block_d),
        )  # fmt: skip
