"""The pooled lookup on the device: each bag's rows summed (weighted) in bag order, one program a
bag, equal to ``torch.nn.functional.embedding_bag(mode="sum")`` within float32 rounding."""

from __future__ import annotations

from typing import Optional

import torch

from dynarec.kernels.gpu._triton import HAVE_TRITON, row_block

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = ["pooled_forward"]


if HAVE_TRITON:

    @triton.jit
    def _pooled_kernel(
        weight_ptr, rows_ptr, offsets_ptr, psw_ptr, out_ptr, D, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr
    ):
        # Rows summed one at a time, in bag order (a fixed summation order), not as a tile of
        # several rows: the faster of the two on the GPU.
        bag = tl.program_id(0).to(tl.int64)
        start = tl.load(offsets_ptr + bag)
        end = tl.load(offsets_ptr + bag + 1)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        i = start
        while i < end:  # a while loop: Triton's interpreter runs it too
            r = tl.load(rows_ptr + i)
            v = tl.load(weight_ptr + r * D + d, mask=dm, other=0.0).to(tl.float32)  # half-precision rows too
            if HAS_W:
                v = v * tl.load(psw_ptr + i)
            acc += v
            i += 1
        tl.store(out_ptr + bag * D + d, acc, mask=dm)


def pooled_forward(
    weight: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor]
) -> torch.Tensor:
    """``out[b] = sum_{i in bag b} psw[i] * weight[rows[i]]``: ``[num_bags, D]`` float32 (summed in
    float32 whatever the rows' dtype)."""
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
            BLOCK_D=row_block(dim),
        )
    return out
