"""Triton kernels of the CUDA path: the hash find, the pooled lookup, and the fused backward +
update of every registered optimizer.

Each kernel computes what the plain-torch code computes (the tests on the device compare them:
identical slots, weights within rtol 1e-5 / atol 1e-6), without its intermediate tensors and
without host syncs:

- :func:`find_two_choice`: one program per block of keys; a key reads its first bucket (16 keys,
  one 128-byte line) and only then its second.
- :func:`pooled_forward`: one program per bag, rows summed in bag order (weighted).
- :func:`bag_update`: the ids of a step sorted once (stable); each run of equal rows is a segment
  whose program sums its gradient occurrences in sorted order and applies the optimizer to the
  row's weight and states in one pass. Segment starts come from a ``scatter_reduce(amin)`` into
  a buffer of ``n`` slots, so the grid is static (no ``unique``, no host sync), and no
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
    def _find_kernel(keys_ptr, occ_ptr, query_ptr, out_ptr, n, num_buckets, BS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        q = tl.load(query_ptr + offs, mask=valid, other=0)
        h = _mix64(q.to(tl.uint64))
        nb = num_buckets.to(tl.uint64)
        b1 = ((h & 0xFFFFFFFF) % nb).to(tl.int64)
        b2 = ((h >> 32) % nb).to(tl.int64)
        lanes = tl.arange(0, BS)
        s1 = b1[:, None] * BS + lanes[None, :]
        k1 = tl.load(keys_ptr + s1, mask=valid[:, None], other=0)
        o1 = tl.load(occ_ptr + s1, mask=valid[:, None], other=0)
        hit1 = (k1 == q[:, None]) & (o1 != 0)
        found1 = tl.max(hit1.to(tl.int32), axis=1) > 0
        lane1 = tl.argmax(hit1.to(tl.int32), axis=1)
        need2 = valid & (found1 == 0)  # the second line is read only for keys the first lacks
        s2 = b2[:, None] * BS + lanes[None, :]
        k2 = tl.load(keys_ptr + s2, mask=need2[:, None], other=0)
        o2 = tl.load(occ_ptr + s2, mask=need2[:, None], other=0)
        hit2 = (k2 == q[:, None]) & (o2 != 0) & need2[:, None]
        found2 = tl.max(hit2.to(tl.int32), axis=1) > 0
        lane2 = tl.argmax(hit2.to(tl.int32), axis=1)
        slot = tl.where(found1, b1 * BS + lane1, tl.where(found2, b2 * BS + lane2, -1))
        tl.store(out_ptr + offs, slot, mask=valid)

    @triton.jit
    def _pooled_kernel(
        weight_ptr, rows_ptr, offsets_ptr, psw_ptr, out_ptr, D, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr
    ):
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
    def _update_kernel(
        weight_ptr,
        s1_ptr,
        s2_ptr,
        grad_ptr,
        order_ptr,
        sorted_rows_ptr,
        seg_start_ptr,
        bag_ptr,
        psw_ptr,
        n,
        D,
        lr,
        eps,
        wd,
        beta1,
        beta2,
        bias1,
        bias2,
        c1,
        c2,
        decay,
        OPT: tl.constexpr,
        WD_MODE: tl.constexpr,
        HAS_W: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        seg = tl.program_id(0).to(tl.int64)
        start = tl.load(seg_start_ptr + seg)
        if start < n:
            end = tl.load(seg_start_ptr + seg + 1)
            row = tl.load(sorted_rows_ptr + start)
            d = tl.arange(0, BLOCK_D)
            dm = d < D
            g = tl.zeros([BLOCK_D], dtype=tl.float32)
            q = start
            while q < end:  # the row's occurrences, in sorted (stable) order
                i = tl.load(order_ptr + q)
                bag = tl.load(bag_ptr + i)
                gi = tl.load(grad_ptr + bag * D + d, mask=dm, other=0.0)
                if HAS_W:
                    gi = gi * tl.load(psw_ptr + i)
                g += gi
                q += 1
            w = tl.load(weight_ptr + row * D + d, mask=dm, other=0.0)
            if OPT == 0:  # SGD
                w = w - lr * g
            elif OPT == 1:  # Adagrad: h += g*g; w -= lr * g / (sqrt(h) + eps)
                h = tl.load(s1_ptr + row * D + d, mask=dm, other=0.0) + g * g
                tl.store(s1_ptr + row * D + d, h, mask=dm)
                w = w - lr * g / (tl.sqrt(h) + eps)
            elif OPT == 2:  # RowWiseAdagrad
                gu = g
                if WD_MODE == 1:
                    gu = g + wd * w
                gu = tl.where(dm, gu, 0.0)
                h = tl.load(s1_ptr + row) + tl.sum(gu * gu, axis=0) / D
                tl.store(s1_ptr + row, h)
                m = lr / (tl.sqrt(h) + eps)
                if WD_MODE == 2:
                    w = decay * w - m * g
                else:
                    w = w - m * gu
            else:  # Adam with bias correction and decoupled weight decay
                m1 = tl.load(s1_ptr + row * D + d, mask=dm, other=0.0) * beta1 + c1 * g
                m2 = tl.load(s2_ptr + row * D + d, mask=dm, other=0.0) * beta2 + c2 * g * g
                tl.store(s1_ptr + row * D + d, m1, mask=dm)
                tl.store(s2_ptr + row * D + d, m2, mask=dm)
                upd = (m1 / bias1) / (tl.sqrt(m2 / bias2) + eps)
                if WD_MODE == 2:
                    upd = upd + wd * w
                w = w - lr * upd
            tl.store(weight_ptr + row * D + d, w, mask=dm)


def _block_d(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def find_two_choice(
    table_keys: torch.Tensor, occupied: torch.Tensor, num_buckets: int, bucket_size: int, query: torch.Tensor
) -> torch.Tensor:
    """Slot of each query key, -1 where absent (``BucketedHashIndex.find``)."""
    query = query.contiguous()
    out = torch.empty_like(query)
    n = query.numel()
    if n:
        block = 128
        _find_kernel[(triton.cdiv(n, block),)](
            table_keys, occupied.view(torch.int8), query, out, n, num_buckets, BS=bucket_size, BLOCK=block
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


def _segments(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, sorted rows, segment starts [n + 1])``: a stable sort by row, and the start of
    each run of equal rows (runs beyond the last hold ``n``). Static shapes: no host sync."""
    n = rows.numel()
    sorted_rows, order = torch.sort(rows, stable=True)
    head = torch.ones(n, dtype=torch.bool, device=rows.device)
    head[1:] = sorted_rows[1:] != sorted_rows[:-1]
    seg = torch.cumsum(head.to(torch.int64), 0) - 1
    starts = torch.full((n + 1,), n, dtype=torch.int64, device=rows.device)
    starts.scatter_reduce_(0, seg, torch.arange(n, device=rows.device), reduce="amin", include_self=True)
    return order, sorted_rows, starts


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
) -> None:
    """Aggregates each unique row's gradient over its occurrences in weighted bags
    (``psw[i] * grad_out[bag(i)]``) and applies the optimizer (``args``: its ``KernelArgs``) to
    the row, in place."""
    n, dim = rows.numel(), weight.shape[1]
    if n == 0:
        return
    lengths = offsets[1:] - offsets[:-1]
    bag_of_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=rows.device), lengths, output_size=n)
    order, sorted_rows, starts = _segments(rows)
    s1, s2 = states.get("momentum1", weight), states.get("momentum2", weight)
    psw = per_sample_weights.contiguous() if per_sample_weights is not None else rows
    _update_kernel[(n,)](
        weight,
        s1,
        s2,
        grad_out.contiguous(),
        order,
        sorted_rows,
        starts,
        bag_of_id,
        psw,
        n,
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
        OPT=args.code,
        WD_MODE=args.weight_decay_mode,
        HAS_W=per_sample_weights is not None,
        BLOCK_D=_block_d(dim),
    )
