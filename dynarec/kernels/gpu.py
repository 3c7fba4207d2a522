"""Triton kernels of the CUDA path: the hash find, the pooled lookup, and the fused backward +
update of every registered optimizer.

Each kernel computes what the plain-torch code computes (the tests on the device compare them:
identical slots, weights within rtol 1e-5 / atol 1e-6), without its intermediate tensors and
without host syncs:

- :func:`find_two_choice`: one program per block of keys; a key reads its first bucket's 16 tag
  bytes and only then its second's, and a key only where a tag matches.
- :func:`pooled_forward`: one program per bag, rows summed in bag order (weighted).
- :func:`bag_update`: the ids of a step sorted once (stable); each run of equal rows is a segment,
  whose gradient occurrences are summed in sorted order and whose row's weight and states the
  optimizer updates in one pass, several segments a program as one tile. Segment starts are
  scattered into a buffer of ``n`` slots, so the grid is static (no ``unique``, no host sync), and no
  floating-point value is ever accumulated with atomics: the result does not depend on timing.

The update kernel is a template over the optimizer: a compile-time code and its scalars, the
``KernelArgs`` each optimizer registers in ``OptimizerDef.kernel``.
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # the CPU machines: the plain-torch path runs
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "available", "bag_update", "find_two_choice", "pooled_forward"]


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
    def _probe_bucket(keys_ptr, tags_ptr, bucket, q, tag, need, BS: tl.constexpr):
        """``(found, lane)`` of each query ``q`` in its ``bucket`` (``BS`` slots), read only where
        ``need``: the bucket's ``BS`` tag bytes, then the keys only at the lanes whose tag matches
        (a nonzero tag is an occupied slot)."""
        slots = bucket[:, None] * BS + tl.arange(0, BS)[None, :]
        cand = (tl.load(tags_ptr + slots, mask=need[:, None], other=0) == tag[:, None]) & need[:, None]
        hit = cand & (tl.load(keys_ptr + slots, mask=cand, other=0) == q[:, None])
        return tl.max(hit.to(tl.int32), axis=1) > 0, tl.argmax(hit.to(tl.int32), axis=1)

    @triton.jit
    def _find_kernel(keys_ptr, tags_ptr, query_ptr, out_ptr, n, num_buckets, BS: tl.constexpr, BLOCK: tl.constexpr):
        # Per key: the tags of its first bucket (16 bytes, one sector), the second bucket's only for
        # keys the first lacks, and a key only where a tag matches (1 lane in 255 by chance: an
        # absent key almost never reads one). The buckets are mix64's 32-bit halves modulo
        # num_buckets (< 2^32): 32-bit arithmetic; the tag is its top byte (0 -> 1).
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        q = tl.load(query_ptr + offs, mask=valid, other=0)
        h = _mix64(q.to(tl.uint64))
        nb = num_buckets.to(tl.uint32)
        b1 = ((h & 0xFFFFFFFF).to(tl.uint32) % nb).to(tl.int64)
        b2 = ((h >> 32).to(tl.uint32) % nb).to(tl.int64)
        tag = (h >> 56).to(tl.uint8)
        tag = tl.where(tag == 0, 1, tag).to(tl.uint8)
        found1, lane1 = _probe_bucket(keys_ptr, tags_ptr, b1, q, tag, valid, BS)
        found2, lane2 = _probe_bucket(keys_ptr, tags_ptr, b2, q, tag, valid & (found1 == 0), BS)
        slot = tl.where(found1, b1 * BS + lane1, tl.where(found2, b2 * BS + lane2, -1))
        tl.store(out_ptr + offs, slot, mask=valid)

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
    def _occurrence_sum(grad_ptr, order_ptr, bag_ptr, psw_ptr, p0, end, D, d, dm, HAS_W: tl.constexpr, L: tl.constexpr):
        """Sum of ``psw[i] * grad[bag(i)]`` over the sorted occurrences ``p0 .. end-1`` (at most
        ``L``), as one [L, BLOCK_D] tile: a fixed reduction order, whatever the timing."""
        p = p0 + tl.arange(0, L)
        pm = p < end
        i = tl.load(order_ptr + p, mask=pm, other=0)
        bag = tl.load(bag_ptr + i, mask=pm, other=0)
        gi = tl.load(grad_ptr + bag[:, None] * D + d[None, :], mask=pm[:, None] & dm[None, :], other=0.0)
        if HAS_W:
            gi = gi * tl.load(psw_ptr + i, mask=pm, other=0.0)[:, None]
        return tl.sum(gi, axis=0)

    @triton.jit
    def _update_cold_kernel(
        weight_ptr, s1_ptr, s2_ptr, grad_ptr, order_ptr, sorted_rows_ptr, seg_start_ptr, bag_ptr, psw_ptr,
        n, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay,
        OPT: tl.constexpr, WD_MODE: tl.constexpr, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr, L: tl.constexpr,
        R: tl.constexpr,
    ):  # fmt: skip
        """One program per ``R`` consecutive segments of at most ``L`` occurrences each (most rows:
        one or two), as one [R, BLOCK_D] tile: each row's gradient summed in sorted order, then
        the ``R`` rows updated. ``R`` rows' loads in flight at once hide the latency of the
        dependent reads (occurrence -> bag -> gradient row)."""
        segs = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
        start = tl.load(seg_start_ptr + segs, mask=segs < n, other=n)
        end = tl.load(seg_start_ptr + segs + 1, mask=segs < n, other=n)
        count = end - start
        live = (start < n) & (count <= L)
        if tl.max(live.to(tl.int32), axis=0) > 0:
            d = tl.arange(0, BLOCK_D)
            dm = (d < D)[None, :]
            count = tl.where(live, count, 0)
            g = tl.zeros([R, BLOCK_D], dtype=tl.float32)
            j = 0
            longest = tl.max(count, axis=0)
            while j < longest:
                m = j < count
                i = tl.load(order_ptr + start + j, mask=m, other=0)
                bag = tl.load(bag_ptr + i, mask=m, other=0)
                gi = tl.load(grad_ptr + bag[:, None] * D + d[None, :], mask=m[:, None] & dm, other=0.0)
                if HAS_W:
                    gi = gi * tl.load(psw_ptr + i, mask=m, other=0.0)[:, None]
                g += gi
                j += 1
            row = tl.load(sorted_rows_ptr + start, mask=live, other=0).to(tl.int64)
            _apply_update(
                weight_ptr, s1_ptr, s2_ptr, row, live, g, d, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2,
                decay, OPT, WD_MODE,
            )  # fmt: skip

    @triton.jit
    def _hot_chunk_kernel(
        grad_ptr, order_ptr, bag_ptr, psw_ptr, chunk_start_ptr, chunk_end_ptr, partial_ptr, n, D,
        HAS_W: tl.constexpr, BLOCK_D: tl.constexpr, L: tl.constexpr,
    ):  # fmt: skip
        """One program per chunk of ``L`` occurrences of a hot row: its partial gradient sum."""
        c = tl.program_id(0).to(tl.int64)
        p0 = tl.load(chunk_start_ptr + c)
        if p0 < n:
            d = tl.arange(0, BLOCK_D)
            dm = d < D
            end = tl.load(chunk_end_ptr + c)
            g = _occurrence_sum(grad_ptr, order_ptr, bag_ptr, psw_ptr, p0, end, D, d, dm, HAS_W, L)
            tl.store(partial_ptr + c * D + d, g, mask=dm)

    @triton.jit
    def _update_hot_kernel(
        weight_ptr, s1_ptr, s2_ptr, partial_ptr, hot_row_ptr, hot_first_ptr, hot_chunks_ptr,
        D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay,
        OPT: tl.constexpr, WD_MODE: tl.constexpr, BLOCK_D: tl.constexpr, P: tl.constexpr,
    ):  # fmt: skip
        """One program per hot row: its chunks' partial sums, ``P`` at a time, then the update."""
        h = tl.program_id(0).to(tl.int64)
        row = tl.load(hot_row_ptr + h).to(tl.int64)
        if row >= 0:
            d = tl.arange(0, BLOCK_D)
            dm = d < D
            first = tl.load(hot_first_ptr + h)
            last = first + tl.load(hot_chunks_ptr + h)
            g = tl.zeros([BLOCK_D], dtype=tl.float32)
            c = first
            while c < last:
                cs = c + tl.arange(0, P)
                part = tl.load(
                    partial_ptr + cs[:, None] * D + d[None, :], mask=(cs < last)[:, None] & dm[None, :], other=0.0
                )
                g += tl.sum(part, axis=0)
                c += P
            _apply_update(
                weight_ptr, s1_ptr, s2_ptr, tl.zeros([1], dtype=tl.int64) + row, tl.full([1], True, tl.int1),
                g[None, :], d, D, lr, eps, wd, beta1, beta2, bias1, bias2, c1, c2, decay, OPT, WD_MODE,
            )  # fmt: skip


def _block_d(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def _row_warps(block_d: int) -> int:
    """Warps of a one-row program: four floats a thread (one 16-byte access), at most 4 warps.
    Latency-bound programs: fewer warps each let more of them be resident per multiprocessor."""
    return max(1, min(4, block_d // 128))


def _cold_rows(block_d: int) -> int:
    """Rows a cold-update program takes: a [R, BLOCK_D] tile of at most 1024 floats and 8 rows
    (benchmarks/tune_update.py on an H200: at D = 128, 8 rows take 1.49 ms a 1M-id update, 1 row
    1.92 ms; at D = 32, 8 rows are within 3% of the best of 1-16 at 1M and 4M ids). One row a
    program leaves an H200 at 32 resident one-warp programs per multiprocessor: half its warps."""
    return max(1, min(8, 1024 // block_d))


def find_two_choice(
    table_keys: torch.Tensor, tags: torch.Tensor, num_buckets: int, bucket_size: int, query: torch.Tensor
) -> torch.Tensor:
    """Slot of each query key, -1 where absent (``BucketedHashIndex.find``; ``tags``: its uint8
    tag per slot)."""
    query = query.contiguous()
    out = torch.empty_like(query)
    n = query.numel()
    if n:
        block = 128
        _find_kernel[(triton.cdiv(n, block),)](
            table_keys, tags, query, out, n, num_buckets, BS=bucket_size, BLOCK=block
        )
    return out


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


def _segments(rows: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, sorted rows, segment starts [n + 1], segment of each sorted position)``: a stable
    sort by row, and the start of each run of equal rows (runs beyond the last hold ``n``; the
    heads scatter their positions, the rest go to a spare slot). Static shapes: no host sync.
    Rows of a table under 2^31 rows are sorted as int32: half the radix passes of int64."""
    n = rows.numel()
    sorted_rows, order = torch.sort(rows.to(torch.int32) if num_rows < 2**31 else rows, stable=True)
    head = torch.ones(n, dtype=torch.bool, device=rows.device)
    head[1:] = sorted_rows[1:] != sorted_rows[:-1]
    seg = torch.cumsum(head.to(torch.int64), 0) - 1
    starts = torch.full((n + 2,), n, dtype=torch.int64, device=rows.device)
    starts.scatter_(0, torch.where(head, seg, n + 1), torch.arange(n, device=rows.device))  # heads only
    return order, sorted_rows, starts[: n + 1], seg


def _compact(mask: torch.Tensor, values: torch.Tensor, size: int, fill: int) -> torch.Tensor:
    """``values[mask]`` in order, padded with ``fill`` to ``size`` (>= mask.sum()): a static
    shape, so no host sync."""
    out = torch.full((size + 1,), fill, dtype=values.dtype, device=values.device)
    index = torch.where(mask, torch.cumsum(mask.to(torch.int64), 0) - 1, size)
    return out.scatter_(0, index, values)[:size]


def _hot_chunks(
    starts: torch.Tensor, seg: torch.Tensor, sorted_rows: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, ...]:
    """The segments longer than ``chunk`` (hot rows) split into chunks of ``chunk`` occurrences.

    Returns ``(chunk_start, chunk_end, hot_row, hot_first, hot_chunks)``: each chunk's sorted
    positions (start ``n`` = no chunk), and each hot row with its first chunk and chunk count
    (row ``-1`` = none). Sizes are bounds known from ``n`` alone: at most ``n // chunk`` hot rows
    and ``2 n // chunk`` chunks."""
    n = seg.numel()
    dev = seg.device
    counts = starts[1:] - starts[:-1]  # [n]; 0 past the last segment
    pos = torch.arange(n, device=dev)
    seg_start = starts[seg]
    hot_pos = counts[seg] > chunk
    head = hot_pos & ((pos - seg_start) % chunk == 0)
    max_chunks, max_hot = 2 * (n // chunk) + 1, n // chunk + 1
    chunk_start = _compact(head, pos, max_chunks, n)
    seg_end = starts[seg + 1]
    chunk_end = _compact(head, torch.minimum(pos + chunk, seg_end), max_chunks, n)
    chunk_id = torch.cumsum(head.to(torch.int64), 0) - 1  # at a hot segment's start: its first chunk
    hot_seg = counts > chunk
    first_pos = starts[:n].clamp(max=n - 1)
    hot_row = _compact(hot_seg, sorted_rows[first_pos], max_hot, -1)
    hot_first = _compact(hot_seg, chunk_id[first_pos], max_hot, 0)
    hot_chunks = _compact(hot_seg, (counts + chunk - 1) // chunk, max_hot, 0)
    return chunk_start, chunk_end, hot_row, hot_first, hot_chunks


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
    chunk: int = 32,
    rows_per_program: Optional[int] = None,
) -> None:
    """Aggregates each unique row's gradient over its occurrences in weighted bags
    (``psw[i] * grad_out[bag(i)]``) and applies the optimizer (``args``: its ``KernelArgs``) to
    the row, in place.

    A row of at most ``chunk`` occurrences is summed and updated by one program. A hot row (a
    Zipf head can hold a tenth of a step's ids) is summed in parallel chunks of ``chunk``
    occurrences, whose partial sums one program then adds in chunk order and applies: no
    program walks a long row alone, and every sum has a fixed order. ``rows_per_program``: the
    cold programs' tile height (default :func:`_cold_rows`; a tuning knob, same results)."""
    n, dim = rows.numel(), weight.shape[1]
    if n == 0:
        return
    lengths = offsets[1:] - offsets[:-1]
    bag_of_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=rows.device), lengths, output_size=n)
    order, sorted_rows, starts, seg = _segments(rows, weight.shape[0])
    s1, s2 = states.get("momentum1", weight), states.get("momentum2", weight)
    grad_out = grad_out.contiguous()
    psw = per_sample_weights.contiguous() if per_sample_weights is not None else grad_out
    has_w = per_sample_weights is not None
    block_d = _block_d(dim)
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
    opt = dict(OPT=args.code, WD_MODE=args.weight_decay_mode)
    warps = _row_warps(block_d)
    cold_rows = rows_per_program or _cold_rows(block_d)
    _update_cold_kernel[(triton.cdiv(n, cold_rows),)](
        weight, s1, s2, grad_out, order, sorted_rows, starts, bag_of_id, psw, n, *scalars,
        **opt, HAS_W=has_w, BLOCK_D=block_d, L=chunk, R=cold_rows, num_warps=max(1, min(4, cold_rows * block_d // 128)),
    )  # fmt: skip
    if n > chunk:  # a hot row needs more than `chunk` ids (the grid sizes depend on n alone)
        chunk_start, chunk_end, hot_row, hot_first, hot_chunks = _hot_chunks(starts, seg, sorted_rows, chunk)
        partial = torch.empty(chunk_start.numel(), dim, dtype=torch.float32, device=weight.device)
        _hot_chunk_kernel[(chunk_start.numel(),)](
            grad_out, order, bag_of_id, psw, chunk_start, chunk_end, partial, n, dim,
            HAS_W=has_w, BLOCK_D=block_d, L=chunk,
        )  # fmt: skip
        _update_hot_kernel[(hot_row.numel(),)](
            weight, s1, s2, partial, hot_row, hot_first, hot_chunks, *scalars, **opt, BLOCK_D=block_d, P=16,
            num_warps=warps,
        )  # fmt: skip
