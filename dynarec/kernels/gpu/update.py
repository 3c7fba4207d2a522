"""The fused backward + update on the device: each unique row's gradient aggregated over its
occurrences in a step's weighted bags, and the optimizer applied to the row, in place.

The ids of a step are sorted by row once (stable), each occurrence's bag and weight gathered
into that order, and cut into fixed blocks. A block's runs of equal rows are summed (``run``: one
occurrence at a time, for wide rows, its loads one occurrence ahead and a run's row and states
read when the run before it ends; ``scan``: the block as one tile, by a segmented scan, for
narrow ones) and their rows updated in one pass; a run crossing blocks is finished from the
blocks' partial sums, in block order. Static grids (no ``unique``, no host sync), and no
floating-point value is ever accumulated with atomics: every sum has a fixed order, and the
result does not depend on timing.

The update is a template over the optimizer: a compile-time code (``KernelCode``) and weight-decay
mode (``WeightDecayCode``) of ``dynarec.optim.kernel``'s table, one case each in
:func:`_apply_update`, and the scalars each optimizer registers (``OptimizerDef.kernel``,
``KernelArgs``).

The kernels read the step's id count (its offsets' last) and scalars (learning rate, Adam's bias
corrections, the score, the rounding draws' base: :data:`HYPER`) from device memory, so one
launch serves every step of a shape: on a GPU, once a table's step shape recurs, the update is a
CUDA graph replayed on fixed buffers (:class:`StaticBagUpdate`), a few copies and one launch of
host work instead of a dozen launches.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from dynarec.devices import capture_graph
from dynarec.kernels.gpu._triton import HAVE_TRITON, INTERPRETED, row_block
from dynarec.kernels.reference.bags import bags_of_ids
from dynarec.optim.kernel import KernelCode, WeightDecayCode
from dynarec.optim.rounding import ROUNDING_CODES

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from dynarec.kernels.gpu.packed import table_of, table_place

__all__ = [
    "CAPTURE",
    "HYPER",
    "TUNING",
    "Capture",
    "HostStaging",
    "StaticBagUpdate",
    "Tuning",
    "bag_update",
    "capacity_for",
    "hyper_values",
]

UpdateKernel = Literal["run", "scan"]


@dataclass(frozen=True)
class Tuning:
    """How the update cuts a step into programs. ``kernel``: ``run`` (occurrences read one at a
    time) or ``scan`` (a block as one tile, summed by a segmented scan); None: ``run`` for row
    tiles of ``run_from`` floats or more, ``scan`` below, each the faster there on the GPU.
    ``block``: occurrences a block (a power of two); None: ``run_block`` for ``run``, for
    ``scan`` a tile of about ``scan_tile`` floats, ``scan_blocks[0]`` to ``scan_blocks[1]``
    occurrences. ``crossing_blocks``: the blocks a run crossing blocks reads at a time. Tuning
    scripts replace :data:`TUNING`; every choice gives the same result within float32
    rounding (the tests hold each to the reference)."""

    kernel: Optional[UpdateKernel] = None
    block: Optional[int] = None
    run_from: int = 64
    run_block: int = 128
    scan_tile: int = 4096
    scan_blocks: tuple[int, int] = (8, 64)
    crossing_blocks: int = 16

    def kernel_for(self, block_d: int) -> UpdateKernel:
        """The block kernel for a row tile of ``block_d`` floats."""
        if self.kernel is not None:
            return self.kernel
        return "run" if block_d >= self.run_from else "scan"

    def block_for(self, kernel: UpdateKernel, block_d: int) -> int:
        """Occurrences a block of ``kernel`` takes, for a row tile of ``block_d`` floats."""
        if self.block is not None:
            return self.block
        if kernel == "run":
            return self.run_block
        low, high = self.scan_blocks
        return max(low, min(high, self.scan_tile // block_d))


TUNING = Tuning()


def _tile_warps(elements: int) -> int:
    """Warps for a tile of ``elements`` floats: four a thread (one 16-byte access), 1 to 8."""
    return max(1, min(8, elements // 128))


if HAVE_TRITON:
    _SGD = tl.constexpr(int(KernelCode.SGD))
    _ADAGRAD = tl.constexpr(int(KernelCode.ADAGRAD))
    _ROWWISE_ADAGRAD = tl.constexpr(int(KernelCode.ROWWISE_ADAGRAD))
    _ADAM = tl.constexpr(int(KernelCode.ADAM))
    _WD_L2 = tl.constexpr(int(WeightDecayCode.L2))
    _WD_DECOUPLED = tl.constexpr(int(WeightDecayCode.DECOUPLED))

    @triton.jit
    def _fmix32(h):
        """murmur3's 32-bit finalizer, in uint32 arithmetic (``dynarec.optim.rounding``'s)."""
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def _store_rows(weight_ptr, off, dm, w, row, live, d, keys_ptr, key_offset, round_base, ROUND, HAS_KEYS):
        """Stores the updated rows ``w`` ([R, BLOCK_D] float32): as they are (``ROUND`` 0), or
        by stochastic rounding to bfloat16 (1) or float16 (2) with the draws of
        ``dynarec.optim.rounding`` (a row's key: ``keys[row]``, or ``row + key_offset``)."""
        if ROUND == 0:
            tl.store(weight_ptr + off, w, mask=dm)
        else:
            if HAS_KEYS:
                key = tl.load(keys_ptr + row, mask=live, other=0).to(tl.int64)
            else:
                key = row + key_offset
            high = _fmix32((key >> 32).to(tl.uint32) ^ round_base.to(tl.uint32))
            r = _fmix32((key.to(tl.uint32) * 0x27D4EB2F) ^ high)
            h = _fmix32(r[:, None] * 0x165667B1 + d[None, :].to(tl.uint32))
            u = (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
            half = weight_ptr.dtype.element_ty  # bfloat16 (ROUND 1) or float16 (ROUND 2)
            nearest = w.to(half)
            bits = nearest.to(tl.int16, bitcast=True).to(tl.int32)
            # sign-magnitude: one less in the int16 view is one step toward zero, for either sign
            lo_bits = tl.where(tl.abs(nearest.to(tl.float32)) > tl.abs(w), bits - 1, bits)
            hi_bits = lo_bits + 1
            lo = lo_bits.to(tl.int16).to(half, bitcast=True).to(tl.float32)
            hi = hi_bits.to(tl.int16).to(half, bitcast=True).to(tl.float32)
            out = tl.where(u < (w - lo) / (hi - lo), hi_bits, lo_bits).to(tl.int16).to(half, bitcast=True)
            tl.store(weight_ptr + off, out, mask=dm)

    @triton.jit
    def _row_place(row, D, layout_ptr, T, PACKED: tl.constexpr):
        """``(first element, dim)`` of rows ``row`` ([R] int64): of ``[num_rows, D]`` rows, or
        (``PACKED``) of group rows in packed rows of layout ``[3, T + 1]``."""
        if PACKED:
            start, element_start, dim = table_place(table_of(row, layout_ptr, T), layout_ptr, T)
            base = element_start + (row - start) * dim
        else:
            base = row * D
            dim = row * 0 + D
        return base, dim

    @triton.jit
    def _load_rows(weight_ptr, s1_ptr, s2_ptr, row, live, base, dim, d, OPT: tl.constexpr):
        """What the update of rows ``row`` ([R] int64, only where ``live``; ``(base, dim)``: their
        :func:`_row_place`) reads: ``(w, h1, h2)``, their weights in float32 ([R, BLOCK_D]) and
        the optimizer's states (Adagrad's and Adam's first: [R, BLOCK_D], RowWise Adagrad's: [R];
        Adam's second: [R, BLOCK_D]; a state the optimizer has not: ``w``, never read). Loaded
        ahead of :func:`_update_loaded`, they are in flight while a program does other work."""
        dm = live[:, None] & (d[None, :] < dim[:, None])
        off = base[:, None] + d[None, :]
        w = tl.load(weight_ptr + off, mask=dm, other=0.0).to(tl.float32)
        h1 = w
        h2 = w
        if OPT == _ADAGRAD:
            h1 = tl.load(s1_ptr + off, mask=dm, other=0.0)
        elif OPT == _ROWWISE_ADAGRAD:
            h1 = tl.load(s1_ptr + row, mask=live, other=0.0)
        elif OPT == _ADAM:
            h1 = tl.load(s1_ptr + off, mask=dm, other=0.0)
            h2 = tl.load(s2_ptr + off, mask=dm, other=0.0)
        return w, h1, h2

    @triton.jit
    def _update_loaded(
        weight_ptr, s1_ptr, s2_ptr, row, live, base, dim, w, h1, h2, g, d, lr, eps, wd, beta1, beta2, bias1, bias2,
        c1, c2, decay, keys_ptr, key_offset, round_base,
        OPT: tl.constexpr, WD_MODE: tl.constexpr, ROUND: tl.constexpr, HAS_KEYS: tl.constexpr,
    ):  # fmt: skip
        """The optimizer step of ``R`` rows (``row``: [R] int64, only where ``live``; ``(base,
        dim)``: their :func:`_row_place`) from their aggregated gradients ``g`` ([R, BLOCK_D]
        float32) and what :func:`_load_rows` read of them (``w``, ``h1``, ``h2``): one case per
        ``KernelCode`` (a code without one does not compile); the states and the rows stored.
        Rows of a half-precision table (``ROUND``) are stored by :func:`_store_rows`. A row-wise
        state is indexed by ``row`` (group rows, in packed rows), the weights and element-wise
        states by ``base``."""
        dm = live[:, None] & (d[None, :] < dim[:, None])
        off = base[:, None] + d[None, :]
        if OPT == _SGD:
            w = w - lr * g
        elif OPT == _ADAGRAD:  # h += g*g; w -= lr * g / (sqrt(h) + eps)
            h = h1 + g * g
            tl.store(s1_ptr + off, h, mask=dm)
            w = w - lr * g / (tl.sqrt(h) + eps)
        elif OPT == _ROWWISE_ADAGRAD:
            gu = g
            if WD_MODE == _WD_L2:
                gu = g + wd * w
            gu = tl.where(dm, gu, 0.0)
            h = h1 + tl.sum(gu * gu, axis=1) / dim.to(tl.float32)
            tl.store(s1_ptr + row, h, mask=live)
            m = (lr / (tl.sqrt(h) + eps))[:, None]
            if WD_MODE == _WD_DECOUPLED:
                w = decay * w - m * g
            else:
                w = w - m * gu
        elif OPT == _ADAM:  # bias correction, decoupled weight decay
            m1 = h1 * beta1 + c1 * g
            m2 = h2 * beta2 + c2 * g * g
            tl.store(s1_ptr + off, m1, mask=dm)
            tl.store(s2_ptr + off, m2, mask=dm)
            upd = (m1 / bias1) / (tl.sqrt(m2 / bias2) + eps)
            if WD_MODE == _WD_DECOUPLED:
                upd = upd + wd * w
            w = w - lr * upd
        else:
            tl.static_assert(False, "_update_loaded has no case for this kernel code")
        _store_rows(weight_ptr, off, dm, w, row, live, d, keys_ptr, key_offset, round_base, ROUND, HAS_KEYS)

    @triton.jit
    def _apply_update(
        weight_ptr, s1_ptr, s2_ptr, row, live, g, d, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay,
        keys_ptr, key_offset, round_base, layout_ptr, T,
        OPT: tl.constexpr, WD_MODE: tl.constexpr, ROUND: tl.constexpr, HAS_KEYS: tl.constexpr, PACKED: tl.constexpr,
    ):  # fmt: skip
        """:func:`_load_rows`, then :func:`_update_loaded`: the update of rows read where it runs.
        ``PACKED``: ``row`` are group rows of packed rows of layout ``layout_ptr``
        (:func:`_row_place`)."""
        base, dim = _row_place(row, D, layout_ptr, T, PACKED)
        w, h1, h2 = _load_rows(weight_ptr, s1_ptr, s2_ptr, row, live, base, dim, d, OPT)
        _update_loaded(
            weight_ptr, s1_ptr, s2_ptr, row, live, base, dim, w, h1, h2, g, d, lr, eps, wd, beta1, beta2, bias1,
            bias2, c1, c2, decay, keys_ptr, key_offset, round_base, OPT, WD_MODE, ROUND, HAS_KEYS,
        )  # fmt: skip

    @triton.jit
    def _segmented_add(v1, f1, v2, f2):
        """Combine of a segmented sum scan: a set flag starts a new segment."""
        return tl.where(f2 != 0, v2, v1 + v2), f1 | f2

    @triton.jit
    def _hyper(h):
        """The step's scalars from ``hyper`` (float64, :data:`HYPER`'s order): the optimizer's in
        float32 (as a float argument would be), the score and the rounding draws' in int64."""
        return (
            tl.load(h + 0).to(tl.float32), tl.load(h + 1).to(tl.float32), tl.load(h + 2).to(tl.float32),
            tl.load(h + 3).to(tl.float32), tl.load(h + 4).to(tl.float32), tl.load(h + 5).to(tl.float32),
            tl.load(h + 6).to(tl.float32), tl.load(h + 7).to(tl.float32), tl.load(h + 8).to(tl.float32),
            tl.load(h + 9).to(tl.float32),
            tl.load(h + 10).to(tl.int64), tl.load(h + 11).to(tl.int64), tl.load(h + 12).to(tl.int64),
        )  # fmt: skip

    @triton.jit
    def _update_block_kernel(
        weight_ptr, s1_ptr, s2_ptr, grad_ptr, sorted_rows_ptr, bag_ptr, psw_ptr, scores_ptr,
        part_first_ptr, part_last_ptr, n_ptr, hyper_ptr, D, keys_ptr, layout_ptr, T,
        OPT: tl.constexpr, WD_MODE: tl.constexpr, ROUND: tl.constexpr, HAS_KEYS: tl.constexpr, PACKED: tl.constexpr,
        HAS_W: tl.constexpr, HAS_SCORES: tl.constexpr, BLOCK_D: tl.constexpr, L: tl.constexpr,
    ):  # fmt: skip
        """One program per block of ``L`` sorted occurrences, as one [L, BLOCK_D] tile: their
        gradients gathered, summed per run of equal rows by a segmented scan, and every row whose
        run starts and ends in the block updated. A run crossing the block's start leaves its
        sum here in ``part_first``, one crossing its end in ``part_last``, for
        :func:`_update_crossing_kernel`. ``HAS_SCORES``: ``scores[row] = score`` where a run
        ends (once per row)."""
        n = tl.load(n_ptr).to(tl.int64)
        lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay, score, key_offset, round_base = _hyper(hyper_ptr)
        b = tl.program_id(0).to(tl.int64)
        lane = tl.arange(0, L)
        p = b * L + lane
        pm = p < n
        row = tl.load(sorted_rows_ptr + p, mask=pm, other=-1).to(tl.int64)
        prev = tl.load(sorted_rows_ptr + p - 1, mask=pm & (p > 0), other=-1).to(tl.int64)
        nxt = tl.load(sorted_rows_ptr + p + 1, mask=(p + 1) < n, other=-1).to(tl.int64)
        bag = tl.load(bag_ptr + p, mask=pm, other=0)
        d = tl.arange(0, BLOCK_D)
        dm = (d < D)[None, :]
        g = tl.load(grad_ptr + bag[:, None] * D + d[None, :], mask=pm[:, None] & dm, other=0.0)
        if HAS_W:
            g = g * tl.load(psw_ptr + p, mask=pm, other=0.0)[:, None]
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
            bias1, bias2, c1, c2, decay, keys_ptr, key_offset, round_base, layout_ptr, T,
            OPT, WD_MODE, ROUND, HAS_KEYS, PACKED,
        )  # fmt: skip
        first_end = crosses_start & ((row != nxt) | (lane == L - 1))
        if tl.max(first_end.to(tl.int32), axis=0) > 0:
            part = tl.sum(tl.where(first_end[:, None], sums, 0.0), axis=0)
            tl.store(part_first_ptr + b * BLOCK_D + d, part)
        last = pm & (lane == L - 1) & (row == nxt)  # the block's last run goes on into the next
        if tl.max(last.to(tl.int32), axis=0) > 0:
            tl.store(part_last_ptr + b * BLOCK_D + d, tl.sum(tl.where(last[:, None], sums, 0.0), axis=0))

    @triton.jit
    def _update_run_kernel(
        weight_ptr, s1_ptr, s2_ptr, grad_ptr, sorted_rows_ptr, bag_ptr, psw_ptr, scores_ptr,
        part_first_ptr, part_last_ptr, n_ptr, hyper_ptr, D, keys_ptr, layout_ptr, T,
        OPT: tl.constexpr, WD_MODE: tl.constexpr, ROUND: tl.constexpr, HAS_KEYS: tl.constexpr, PACKED: tl.constexpr,
        HAS_W: tl.constexpr, HAS_SCORES: tl.constexpr, BLOCK_D: tl.constexpr, L: tl.constexpr,
    ):  # fmt: skip
        """One program per block of ``L`` sorted occurrences, read one at a time: each gradient
        row added to its run's sum in occurrence order, and a run's row updated where the run
        ends, when it began in the block. A run crossing the block's start leaves its sum in
        ``part_first``, one crossing its end in ``part_last``, for
        :func:`_update_crossing_kernel`. ``HAS_SCORES``: ``scores[row] = score`` where a run
        ends (once per row)."""
        n = tl.load(n_ptr).to(tl.int64)
        lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay, score, key_offset, round_base = _hyper(hyper_ptr)
        b = tl.program_id(0).to(tl.int64)
        start = b * L
        end = tl.minimum(start + L, n)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        before = tl.load(sorted_rows_ptr + start - 1, mask=b > 0, other=-1).to(tl.int64)
        row = tl.load(sorted_rows_ptr + start).to(tl.int64)
        first = row == before  # the block's first run began in an earlier block
        one = tl.full([1], True, tl.int1)
        # a run's row and states are read when the run before it ends, so they arrive while the
        # run's gradients are summed (only this program updates a row that starts and ends here)
        base, dim = _row_place(tl.zeros([1], dtype=tl.int64) + row, D, layout_ptr, T, PACKED)
        wr, h1, h2 = _load_rows(
            weight_ptr, s1_ptr, s2_ptr, tl.zeros([1], dtype=tl.int64) + row, one & (start < end) & ~first, base, dim,
            d, OPT,
        )  # fmt: skip
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        # loads run one occurrence ahead of the sum: the next gradient row and the bag after it
        # are in flight while this one is added (the sum's order is the occurrences')
        g = tl.load(grad_ptr + tl.load(bag_ptr + start) * D + d, mask=dm & (start < end), other=0.0)
        bag = tl.load(bag_ptr + start + 1, mask=start + 1 < end, other=0)
        if HAS_W:
            sw = tl.load(psw_ptr + start)
        p = start
        while p < end:
            ahead = p + 1 < end
            g_next = tl.load(grad_ptr + bag * D + d, mask=dm & ahead, other=0.0)
            bag = tl.load(bag_ptr + p + 2, mask=p + 2 < end, other=0)
            if HAS_W:
                sw_next = tl.load(psw_ptr + p + 1, mask=ahead, other=0.0)
                g = g * sw
                sw = sw_next
            acc += g
            g = g_next
            nxt = tl.load(sorted_rows_ptr + p + 1, mask=p + 1 < n, other=-1).to(tl.int64)
            if nxt != row:  # the run ends here
                if HAS_SCORES:
                    tl.store(scores_ptr + row, score.to(tl.int64))
                base_next, dim_next = _row_place(tl.zeros([1], dtype=tl.int64) + nxt, D, layout_ptr, T, PACKED)
                wr_next, h1_next, h2_next = _load_rows(
                    weight_ptr, s1_ptr, s2_ptr, tl.zeros([1], dtype=tl.int64) + nxt, one & (p + 1 < end), base_next,
                    dim_next, d, OPT,
                )  # fmt: skip
                if first:
                    tl.store(part_first_ptr + b * BLOCK_D + d, acc)
                else:
                    _update_loaded(
                        weight_ptr, s1_ptr, s2_ptr, tl.zeros([1], dtype=tl.int64) + row, one, base, dim, wr, h1, h2,
                        acc[None, :], d, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay,
                        keys_ptr, key_offset, round_base, OPT, WD_MODE, ROUND, HAS_KEYS,
                    )  # fmt: skip
                base, dim, wr, h1, h2 = base_next, dim_next, wr_next, h1_next, h2_next
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
        weight_ptr, s1_ptr, s2_ptr, sorted_rows_ptr, part_first_ptr, part_last_ptr, n_ptr, hyper_ptr, D, keys_ptr,
        layout_ptr, T,
        OPT: tl.constexpr, WD_MODE: tl.constexpr, ROUND: tl.constexpr, HAS_KEYS: tl.constexpr, PACKED: tl.constexpr,
        BLOCK_D: tl.constexpr, L: tl.constexpr, P: tl.constexpr,
    ):  # fmt: skip
        """One program per block whose last run begins in it and goes on past it (a hot row, or
        a run cut by a block boundary): its ``part_last``, then the ``part_first`` of each next
        block that the run covers, ``P`` blocks at a time, in block order; then the update."""
        n = tl.load(n_ptr).to(tl.int64)
        lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay, _, key_offset, round_base = _hyper(hyper_ptr)
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
                g[None, :], d, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay,
                keys_ptr, key_offset, round_base, layout_ptr, T, OPT, WD_MODE, ROUND, HAS_KEYS, PACKED,
            )  # fmt: skip


#: The step's scalars, in the order of the float64 tensor the kernels read them from: a captured
#: update (:class:`StaticBagUpdate`) replays with this step's values. ``c1``, ``c2``: ``1 - beta``,
#: ``decay``: ``1 - lr * weight_decay``, in double (the bits torch's native update uses), then
#: float32 like every optimizer scalar; the last three are integers under 2^53, exact in float64.
HYPER = (
    "lr", "eps", "weight_decay", "beta1", "beta2", "bias1", "bias2", "c1", "c2", "decay",
    "score", "key_offset", "rounding_base",
)  # fmt: skip


def hyper_values(args, lr: float, score: int = 0, key_offset: int = 0, rounding_base: int = 0) -> list[float]:
    """A step's :data:`HYPER` values (``args``: the optimizer's ``KernelArgs``)."""
    for name, value in (("score", score), ("key_offset", key_offset), ("rounding_base", rounding_base)):
        if abs(int(value)) >= 2**53:
            raise ValueError(f"bag_update: {name} {value} is not under 2^53 in magnitude")
    return [
        float(lr), float(args.eps), float(args.weight_decay), float(args.beta1), float(args.beta2),
        float(args.bias1), float(args.bias2), 1.0 - args.beta1, 1.0 - args.beta2, 1.0 - lr * args.weight_decay,
        float(score), float(key_offset), float(rounding_base),
    ]  # fmt: skip


def _pinned(values: list[float]) -> torch.Tensor:
    """``values`` in a float64 host tensor, page-locked: copied to a GPU without blocking the host
    (torch's host allocator keeps it until the copy is done)."""
    return torch.tensor(values, dtype=torch.float64, pin_memory=True)


@dataclass(frozen=True)
class Launch:
    """What one update launch compiles for and how it cuts the step: the kernels' constexprs, the
    row tile and the block kernel (:data:`TUNING`'s choice at the time)."""

    code: int
    weight_decay_mode: int
    round: int
    has_keys: bool
    packed: bool
    has_w: bool
    has_scores: bool
    dim: int
    int32_rows: bool
    tuning: Tuning

    @property
    def block_d(self) -> int:
        return row_block(self.dim)

    @property
    def kernel(self) -> UpdateKernel:
        return self.tuning.kernel_for(self.block_d)

    @property
    def block(self) -> int:
        return self.tuning.block_for(self.kernel, self.block_d)

    @staticmethod
    def of(args, weight, per_sample_weights, grad_out, scores, row_keys, layout) -> Launch:
        """The launch of a step of these tensors (``args``: the optimizer's ``KernelArgs``)."""
        return Launch(
            code=int(args.code), weight_decay_mode=int(args.weight_decay_mode), round=ROUNDING_CODES[weight.dtype],
            has_keys=row_keys is not None, packed=layout is not None, has_w=per_sample_weights is not None,
            has_scores=scores is not None, dim=grad_out.shape[1] if layout is not None else weight.shape[1],
            int32_rows=weight.shape[0] < 2**31, tuning=TUNING,
        )  # fmt: skip


def _run(
    launch: Launch,
    weight: torch.Tensor,
    states: dict[str, torch.Tensor],
    rows: torch.Tensor,
    offsets: torch.Tensor,
    live: torch.Tensor,
    psw: Optional[torch.Tensor],
    grad_out: torch.Tensor,
    scores: Optional[torch.Tensor],
    row_keys: Optional[torch.Tensor],
    layout: Optional[torch.Tensor],
    hyper: torch.Tensor,
) -> None:
    """The update's device work, no host read: ``rows`` ``[m]`` (int32 where ``launch`` says),
    the first ``live[0]`` of them the step's, any after it greater than every row (they sort
    last and are never read); ``offsets`` CSR of all ``m``; ``hyper`` the :data:`HYPER` values
    (float64, on the device)."""
    m = rows.numel()
    sorted_rows, order = torch.sort(rows, stable=True)
    # each occurrence's bag and weight in sorted order: the kernels then read them in sequence
    # (one gather here instead of a random read a step in every program's loop)
    sorted_bags = bags_of_ids(offsets, m).index_select(0, order)
    sorted_psw = psw.index_select(0, order) if psw is not None else grad_out  # not read without weights
    s1, s2 = states.get("momentum1", weight), states.get("momentum2", weight)
    block_d, block = launch.block_d, launch.block
    blocks = triton.cdiv(m, block)
    part_first = torch.empty(blocks, block_d, dtype=torch.float32, device=weight.device)
    part_last = torch.empty_like(part_first)
    rest = (
        live, hyper, launch.dim, row_keys if row_keys is not None else sorted_rows,
        layout if layout is not None else sorted_rows, 0 if layout is None else layout.shape[1] - 1,
    )  # fmt: skip
    opt = dict(
        OPT=launch.code, WD_MODE=launch.weight_decay_mode, ROUND=launch.round, HAS_KEYS=launch.has_keys,
        PACKED=launch.packed, BLOCK_D=block_d, L=block,
    )  # fmt: skip
    runs = dict(HAS_W=launch.has_w, HAS_SCORES=launch.has_scores)
    scores = scores if scores is not None else sorted_rows  # not read
    if launch.kernel == "run":
        _update_run_kernel[(blocks,)](
            weight, s1, s2, grad_out, sorted_rows, sorted_bags, sorted_psw, scores, part_first, part_last, *rest,
            **opt, **runs, num_warps=_tile_warps(block_d),
        )  # fmt: skip
    else:
        _update_block_kernel[(blocks,)](
            weight, s1, s2, grad_out, sorted_rows, sorted_bags, sorted_psw, scores, part_first, part_last, *rest,
            **opt, **runs, num_warps=_tile_warps(block * block_d),
        )  # fmt: skip
    if blocks > 1:
        _update_crossing_kernel[(blocks - 1,)](
            weight, s1, s2, sorted_rows, part_first, part_last, *rest, **opt, P=launch.tuning.crossing_blocks,
            num_warps=_tile_warps(block_d),
        )  # fmt: skip


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
    scores: Optional[torch.Tensor] = None,
    score: int = 0,
    row_keys: Optional[torch.Tensor] = None,
    key_offset: int = 0,
    rounding_base: int = 0,
    layout: Optional[torch.Tensor] = None,
    hyper: Optional[torch.Tensor] = None,
) -> None:
    """Aggregates each unique row's gradient over its occurrences in weighted bags
    (``psw[i] * grad_out[bag(i)]``) and applies the optimizer (``args``: its ``KernelArgs``) to
    the row, in place. ``offsets``: CSR from 0, its last ``rows.numel()`` (the kernels read the
    id count there).

    The occurrences are sorted by row once (stable; int32 keys where the table has under 2^31
    rows: half the radix passes), then cut into blocks (:data:`TUNING`). A block's program sums
    its runs of equal rows and updates each run that starts and ends in it; a run crossing blocks
    (a hot row) is finished by the block where it starts, from the other blocks' partial sums, in
    block order. ``scores`` (``[num_rows]`` int64): the block where a row's run ends also sets
    ``scores[row] = score``. A ``weight`` of bfloat16 or float16 is updated in float32 and
    stored by stochastic rounding, each row's draws keyed by ``row_keys[row]`` (or ``row +
    key_offset``) from ``rounding_base`` (:mod:`dynarec.optim.rounding`). With a ``layout``
    (:mod:`dynarec.kernels.packed`): ``weight`` and the states are packed rows of several tables,
    ``rows`` group rows and ``grad_out`` ``[num_bags, width]``.

    On a GPU the step's host work is a few copies and one graph launch once its shapes recur
    (:data:`CAPTURE`, :class:`StaticBagUpdate`); the kernels and their results are the same.

    ``hyper``: the step's scalars already on the device (float64, :data:`HYPER`'s order), read
    by the kernels in place of ``args``, ``lr``, ``score``, ``key_offset`` and
    ``rounding_base``: an update captured in a CUDA graph with the rest of its step
    (``dynarec.train.step_graph``), whose owner writes them before each replay. Inside a capture
    they are required: scalars copied from the host at the capture would be read again, from
    memory the host has reused since, at every replay."""
    if hyper is not None:
        if hyper.dtype != torch.float64 or hyper.numel() != len(HYPER) or hyper.device != weight.device:
            raise ValueError(
                f"bag_update: hyper must be {len(HYPER)} float64 on {weight.device}, got {hyper.numel()} "
                f"{hyper.dtype} on {hyper.device}"
            )
    elif weight.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "bag_update captured in a CUDA graph without hyper: its scalars would be read at every replay from "
            "host memory given back at the capture; give the update a device buffer of its scalars"
        )
    if rows.numel() == 0:
        return
    launch = Launch.of(args, weight, per_sample_weights, grad_out, scores, row_keys, layout)
    if hyper is None:
        values = hyper_values(args, lr, score, key_offset, rounding_base)
        static = _CAPTURED.lookup(launch, weight, states, rows, offsets, per_sample_weights, grad_out, scores,
                                  row_keys, layout)  # fmt: skip
        if static is not None:
            static(rows, offsets, per_sample_weights, grad_out, values)
            return
        hyper = (
            _pinned(values).to(weight.device, non_blocking=True)
            if weight.is_cuda
            else torch.tensor(values, dtype=torch.float64, device=weight.device)
        )
    _run(
        launch, weight, states, rows.to(torch.int32) if launch.int32_rows else rows, offsets, offsets[-1:],
        per_sample_weights.contiguous() if per_sample_weights is not None else None, grad_out.contiguous(),
        scores, row_keys, layout, hyper,
    )  # fmt: skip


def capacity_for(n: int) -> int:
    """The ids a static update of ``n`` ids holds: ``n`` rounded up to 16 sizes an octave (at
    most 1/16 more), at least 256: steps of nearby sizes share one."""
    step = max(256, 1 << max(0, n.bit_length() - 5))
    return -(-n // step) * step


class StaticBagUpdate:
    """:func:`bag_update` on fixed buffers, for steps of up to ``capacity`` ids in
    ``num_bags`` bags of one table (its rows, states, scores, keys and layout as given here).
    A call copies the step's ids, offsets, weights, output gradient and scalars into the buffers
    (ids past the step's: a row greater than every row, which sorts last and is never read; the
    step's id count read by the kernels from its offsets) and runs the update. With ``capture``
    (a GPU), the first call also captures the update in a CUDA graph, which every later call
    replays: a step's host work is then five copies and one launch, whatever the kernels."""

    def __init__(
        self,
        launch: Launch,
        weight: torch.Tensor,
        states: dict[str, torch.Tensor],
        scores: Optional[torch.Tensor],
        row_keys: Optional[torch.Tensor],
        layout: Optional[torch.Tensor],
        capacity: int,
        num_bags: int,
        grad_width: int,
        capture: bool,
    ):
        device = weight.device
        dtype = torch.int32 if launch.int32_rows else torch.int64
        self.launch, self.weight, self.states = launch, weight, states
        self.scores, self.row_keys, self.layout = scores, row_keys, layout
        self.capacity, self.num_bags, self.capture = capacity, num_bags, capture
        self.beyond = torch.iinfo(dtype).max  # greater than every row: sorts last
        self.rows = torch.full((capacity,), self.beyond, dtype=dtype, device=device)
        # one more bag holds the ids past the step's, so the offsets always cover the capacity
        self.offsets = torch.full((num_bags + 2,), capacity, dtype=torch.int64, device=device)
        self.psw = torch.zeros(capacity, dtype=torch.float32, device=device) if launch.has_w else None
        self.grad = torch.zeros(num_bags, grad_width, dtype=torch.float32, device=device)
        self.hyper = torch.zeros(len(HYPER), dtype=torch.float64, device=device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._live = 0  # rows[live:] hold ``beyond`` (all of them, until a step's are copied in)
        self._staging = HostStaging(len(HYPER), device)

    def __call__(
        self,
        rows: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor],
        grad_out: torch.Tensor,
        hyper: list[float],
    ) -> None:
        n = rows.numel()
        if n > self.capacity or offsets.numel() != self.num_bags + 1:
            raise ValueError(
                f"StaticBagUpdate holds {self.capacity} ids in {self.num_bags} bags, got {n} in {offsets.numel() - 1}"
            )
        self.rows[:n].copy_(rows)
        if n < self._live:  # the last step's ids past this one's
            self.rows[n : self._live].fill_(self.beyond)
        self._live = n
        self.offsets[:-1].copy_(offsets)
        if self.psw is not None and per_sample_weights is not None:
            self.psw[:n].copy_(per_sample_weights)
        self.grad.copy_(grad_out)
        self._staging.copy_to(self.hyper, hyper)
        if self.graph is not None:
            self.graph.replay()
            return
        self._run()  # compiles the kernels: a capture must not
        if self.capture:
            self.capture = False
            try:
                self.graph = self._captured()
            except RuntimeError as error:  # this step is done: later ones run as it ran
                warnings.warn(f"bag_update: the update could not be captured in a CUDA graph ({error}); it runs "
                              f"launched", stacklevel=2)  # fmt: skip
                return
            # the graph holds the rows by address (the key of this update); the tensors themselves
            # are not kept alive by it: a table that grew frees its old rows
            self.weight, self.states, self.scores, self.row_keys, self.layout = _RELEASED, {}, None, None, None

    def _run(self) -> None:
        _run(
            self.launch, self.weight, self.states, self.rows, self.offsets, self.offsets[-2:-1], self.psw,
            self.grad, self.scores, self.row_keys, self.layout, self.hyper,
        )  # fmt: skip

    def _captured(self) -> torch.cuda.CUDAGraph:
        """The update captured on a side stream (its temporaries in the graph's own memory pool);
        the current stream waits for the capture, which runs nothing."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.grad.device), capture_graph(graph):
            self._run()
        return graph


class HostStaging:
    """A few small rows of page-locked host memory, used in turn to copy values to one device
    tensor without blocking the host: a row is written again only once its last copy is done
    (on a GPU; elsewhere values are copied as they are)."""

    def __init__(self, width: int, device: torch.device, rows: int = 8):
        cuda = device.type == "cuda"
        self._rows = torch.zeros(rows, width, dtype=torch.float64, pin_memory=cuda)
        self._views = list(self._rows)
        self._values = self._rows.numpy()
        self._done: list[Optional[torch.cuda.Event]] = [None] * rows
        self._next = 0
        self._cuda = cuda

    def copy_to(self, out: torch.Tensor, values: list[float]) -> None:
        i = self._next
        self._next = (i + 1) % len(self._views)
        done = self._done[i]
        if done is not None:
            done.synchronize()
        self._values[i] = values
        out.copy_(self._views[i], non_blocking=self._cuda)
        if self._cuda:
            done = done or torch.cuda.Event()
            done.record(torch.cuda.current_stream(out.device))
            self._done[i] = done


@dataclass(frozen=True)
class Capture:
    """When :func:`bag_update` replays captured updates (:class:`StaticBagUpdate`): on CUDA
    tensors, compiled kernels, outside another capture, from the second step of one table,
    shapes and stream (the first runs as it is); at most ``max_updates`` kept (the least
    recently used dropped), and none captured after ``max_captures`` (a model whose steps never
    recur runs as it is). ``enabled`` False: never. Tests and tools replace :data:`CAPTURE`."""

    enabled: bool = True
    max_updates: int = 64
    max_captures: int = 1024


CAPTURE = Capture()


class _Captured:
    """The captured updates of this process, by what they were captured for."""

    def __init__(self) -> None:
        self._updates: OrderedDict[tuple, StaticBagUpdate] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self.captures = 0

    def lookup(self, launch, weight, states, rows, offsets, psw, grad_out, scores, row_keys, layout):
        """The static update for this step, made on its shapes' second step; None: run it as it is."""
        capture = CAPTURE
        if not (capture.enabled and weight.is_cuda and not INTERPRETED) or torch.cuda.is_current_stream_capturing():
            return None
        if (psw is not None and psw.dtype != torch.float32) or grad_out.dtype != torch.float32:
            return None  # the buffers are float32: another dtype is updated as it is
        n, num_bags = rows.numel(), offsets.numel() - 1
        stream = torch.cuda.current_stream(weight.device)
        key = (
            launch, capacity_for(n), num_bags, grad_out.shape[1], stream.stream_id, weight.device,
            *(_identity(t) for t in (weight, scores, row_keys, layout)),
            *((name, _identity(t)) for name, t in sorted(states.items())),
        )  # fmt: skip
        static = self._updates.get(key)
        if static is not None:
            self._updates.move_to_end(key)
            return static
        if key not in self._seen or self.captures >= capture.max_captures:
            self._seen[key] = None
            while len(self._seen) > 4 * capture.max_updates:
                self._seen.popitem(last=False)
            return None
        del self._seen[key]
        self.captures += 1
        static = StaticBagUpdate(
            launch, weight, states, scores, row_keys, layout, key[1], num_bags, grad_out.shape[1], capture=True
        )
        self._updates[key] = static
        while len(self._updates) > capture.max_updates:
            _drop(self._updates.popitem(last=False)[1])
        return static

    def clear(self) -> None:
        """Drops every captured update (and forgets the shapes seen)."""
        while self._updates:
            _drop(self._updates.popitem()[1])
        self._seen.clear()


def _drop(static: StaticBagUpdate) -> None:
    """Waits for the device before a captured update is freed: its graph may still be running,
    its buffers and memory pool in use."""
    torch.cuda.synchronize(static.grad.device)


_RELEASED = torch.empty(0)  # a captured update's rows, once its graph holds them by address


def _identity(t: Optional[torch.Tensor]) -> Optional[tuple]:
    """Where a tensor is and how it lies: a captured update is bound to exactly that memory."""
    return None if t is None else (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


_CAPTURED = _Captured()
