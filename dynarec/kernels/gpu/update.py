"""The fused backward + update on the device: each unique row's gradient aggregated over its
occurrences in a step's weighted bags, and the optimizer applied to the row, in place.

The ids of a step are sorted by row once (stable) and cut into fixed blocks. A block's runs of
equal rows are summed (``run``: one occurrence at a time, for wide rows; ``scan``: the block as
one tile, by a segmented scan, for narrow ones) and their rows updated in one pass; a run
crossing blocks is finished from the blocks' partial sums, in block order. Static grids (no
``unique``, no host sync), and no floating-point value is ever accumulated with atomics: every
sum has a fixed order, and the result does not depend on timing.

The update is a template over the optimizer: a compile-time code (``KernelCode``) and weight-decay
mode (``WeightDecayCode``) of ``dynarec.optim.kernel``'s table, one case each in
:func:`_apply_update`, and the scalars each optimizer registers (``OptimizerDef.kernel``,
``KernelArgs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from dynarec.kernels.gpu._triton import HAVE_TRITON, row_block
from dynarec.optim.kernel import KernelCode, WeightDecayCode
from dynarec.optim.rounding import ROUNDING_CODES

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from dynarec.kernels.gpu.packed import table_of, table_place

__all__ = ["TUNING", "Tuning", "bag_update"]

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
    def _apply_update(
        weight_ptr, s1_ptr, s2_ptr, row, live, g, d, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay,
        keys_ptr, key_offset, round_base, layout_ptr, T,
        OPT: tl.constexpr, WD_MODE: tl.constexpr, ROUND: tl.constexpr, HAS_KEYS: tl.constexpr, PACKED: tl.constexpr,
    ):  # fmt: skip
        """The optimizer step of ``R`` rows (``row``: [R] int64, only where ``live``) from their
        aggregated gradients ``g`` ([R, BLOCK_D] float32): one case per ``KernelCode`` (a code
        without one does not compile). Rows of a half-precision table (``ROUND``) are read into
        float32 and stored by :func:`_store_rows`. ``PACKED``: ``row`` are group rows of packed
        rows (a row-wise state is indexed by them, the weights and element-wise states by
        :func:`_row_place`)."""
        base, dim = _row_place(row, D, layout_ptr, T, PACKED)
        dm = live[:, None] & (d[None, :] < dim[:, None])
        off = base[:, None] + d[None, :]
        w = tl.load(weight_ptr + off, mask=dm, other=0.0).to(tl.float32)
        if OPT == _SGD:
            w = w - lr * g
        elif OPT == _ADAGRAD:  # h += g*g; w -= lr * g / (sqrt(h) + eps)
            h = tl.load(s1_ptr + off, mask=dm, other=0.0) + g * g
            tl.store(s1_ptr + off, h, mask=dm)
            w = w - lr * g / (tl.sqrt(h) + eps)
        elif OPT == _ROWWISE_ADAGRAD:
            gu = g
            if WD_MODE == _WD_L2:
                gu = g + wd * w
            gu = tl.where(dm, gu, 0.0)
            h = tl.load(s1_ptr + row, mask=live, other=0.0) + tl.sum(gu * gu, axis=1) / dim.to(tl.float32)
            tl.store(s1_ptr + row, h, mask=live)
            m = (lr / (tl.sqrt(h) + eps))[:, None]
            if WD_MODE == _WD_DECOUPLED:
                w = decay * w - m * g
            else:
                w = w - m * gu
        elif OPT == _ADAM:  # bias correction, decoupled weight decay
            m1 = tl.load(s1_ptr + off, mask=dm, other=0.0) * beta1 + c1 * g
            m2 = tl.load(s2_ptr + off, mask=dm, other=0.0) * beta2 + c2 * g * g
            tl.store(s1_ptr + off, m1, mask=dm)
            tl.store(s2_ptr + off, m2, mask=dm)
            upd = (m1 / bias1) / (tl.sqrt(m2 / bias2) + eps)
            if WD_MODE == _WD_DECOUPLED:
                upd = upd + wd * w
            w = w - lr * upd
        else:
            tl.static_assert(False, "_apply_update has no case for this kernel code")
        _store_rows(weight_ptr, off, dm, w, row, live, d, keys_ptr, key_offset, round_base, ROUND, HAS_KEYS)

    @triton.jit
    def _segmented_add(v1, f1, v2, f2):
        """Combine of a segmented sum scan: a set flag starts a new segment."""
        return tl.where(f2 != 0, v2, v1 + v2), f1 | f2

    # score not specialized: an int argument equal to 1 would become a constant
    @triton.jit(do_not_specialize=["score"])
    def _update_block_kernel(
        weight_ptr, s1_ptr, s2_ptr, grad_ptr, order_ptr, sorted_rows_ptr, bag_ptr, psw_ptr, scores_ptr, score,
        part_first_ptr, part_last_ptr, n, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay,
        keys_ptr, key_offset, round_base, layout_ptr, T,
        OPT: tl.constexpr, WD_MODE: tl.constexpr, ROUND: tl.constexpr, HAS_KEYS: tl.constexpr, PACKED: tl.constexpr,
        HAS_W: tl.constexpr, HAS_SCORES: tl.constexpr, BLOCK_D: tl.constexpr, L: tl.constexpr,
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

    @triton.jit(do_not_specialize=["score"])
    def _update_run_kernel(
        weight_ptr, s1_ptr, s2_ptr, grad_ptr, order_ptr, sorted_rows_ptr, bag_ptr, psw_ptr, scores_ptr, score,
        part_first_ptr, part_last_ptr, n, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay,
        keys_ptr, key_offset, round_base, layout_ptr, T,
        OPT: tl.constexpr, WD_MODE: tl.constexpr, ROUND: tl.constexpr, HAS_KEYS: tl.constexpr, PACKED: tl.constexpr,
        HAS_W: tl.constexpr, HAS_SCORES: tl.constexpr, BLOCK_D: tl.constexpr, L: tl.constexpr,
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
                        acc[None, :], d, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay,
                        keys_ptr, key_offset, round_base, layout_ptr, T, OPT, WD_MODE, ROUND, HAS_KEYS, PACKED,
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
        n, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay, keys_ptr, key_offset, round_base,
        layout_ptr, T,
        OPT: tl.constexpr, WD_MODE: tl.constexpr, ROUND: tl.constexpr, HAS_KEYS: tl.constexpr, PACKED: tl.constexpr,
        BLOCK_D: tl.constexpr, L: tl.constexpr, P: tl.constexpr,
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
                g[None, :], d, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay,
                keys_ptr, key_offset, round_base, layout_ptr, T, OPT, WD_MODE, ROUND, HAS_KEYS, PACKED,
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
) -> None:
    """Aggregates each unique row's gradient over its occurrences in weighted bags
    (``psw[i] * grad_out[bag(i)]``) and applies the optimizer (``args``: its ``KernelArgs``) to
    the row, in place.

    The occurrences are sorted by row once (stable; int32 keys where the table has under 2^31
    rows: half the radix passes), then cut into blocks (:data:`TUNING`). A block's program sums
    its runs of equal rows and updates each run that starts and ends in it; a run crossing blocks
    (a hot row) is finished by the block where it starts, from the other blocks' partial sums, in
    block order. Four torch ops and two kernels a step. ``scores`` (``[num_rows]`` int64): the
    block where a row's run ends also sets ``scores[row] = score``. A ``weight`` of bfloat16 or
    float16 is updated in float32 and stored by stochastic rounding, each row's draws keyed by
    ``row_keys[row]`` (or ``row + key_offset``) from ``rounding_base``
    (:mod:`dynarec.optim.rounding`). With a ``layout`` (:mod:`dynarec.kernels.packed`):
    ``weight`` and the states are packed rows of several tables, ``rows`` group rows and
    ``grad_out`` ``[num_bags, width]``."""
    n, dim = rows.numel(), (grad_out.shape[1] if layout is not None else weight.shape[1])
    if n == 0:
        return
    lengths = offsets[1:] - offsets[:-1]
    bag_of_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=rows.device), lengths, output_size=n)
    sorted_rows, order = torch.sort(rows.to(torch.int32) if weight.shape[0] < 2**31 else rows, stable=True)
    s1, s2 = states.get("momentum1", weight), states.get("momentum2", weight)
    grad_out = grad_out.contiguous()
    psw = per_sample_weights.contiguous() if per_sample_weights is not None else grad_out
    tuning = TUNING
    block_d = row_block(dim)
    kernel = tuning.kernel_for(block_d)
    block = tuning.block_for(kernel, block_d)
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
    keys_and_layout = (
        row_keys if row_keys is not None else sorted_rows, int(key_offset), int(rounding_base),
        layout if layout is not None else sorted_rows, 0 if layout is None else layout.shape[1] - 1,
    )  # fmt: skip
    opt = dict(
        OPT=int(args.code), WD_MODE=int(args.weight_decay_mode), ROUND=ROUNDING_CODES[weight.dtype],
        HAS_KEYS=row_keys is not None, PACKED=layout is not None, BLOCK_D=block_d, L=block,
    )  # fmt: skip
    runs = dict(HAS_W=per_sample_weights is not None, HAS_SCORES=scores is not None)
    if scores is None:
        scores = sorted_rows  # not read
    if kernel == "run":
        _update_run_kernel[(blocks,)](
            weight, s1, s2, grad_out, order, sorted_rows, bag_of_id, psw, scores, score, part_first, part_last, n,
            *scalars, *keys_and_layout, **opt, **runs, num_warps=_tile_warps(block_d),
        )  # fmt: skip
    else:
        _update_block_kernel[(blocks,)](
            weight, s1, s2, grad_out, order, sorted_rows, bag_of_id, psw, scores, score, part_first, part_last, n,
            *scalars, *keys_and_layout, **opt, **runs, num_warps=_tile_warps(block * block_d),
        )  # fmt: skip
    if blocks > 1:
        _update_crossing_kernel[(blocks - 1,)](
            weight, s1, s2, sorted_rows, part_first, part_last, n, *scalars, *keys_and_layout, **opt,
            P=tuning.crossing_blocks, num_warps=_tile_warps(block_d),
        )  # fmt: skip
