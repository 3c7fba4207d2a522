"""The pooled lookup on the device: each bag's rows summed (weighted) in bag order, one program a
bag, equal to ``torch.nn.functional.embedding_bag(mode="sum")`` within float32 rounding; of one
table's rows, or of a packed group of tables of different dims (:mod:`dynarec.kernels.packed`)."""

from __future__ import annotations

from typing import Optional

import torch

from dynarec.kernels.gpu._triton import HAVE_TRITON, row_block

if HAVE_TRITON:
    from dynarec.kernels.gpu.packed import table_of, table_place

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = ["pooled_forward"]


if HAVE_TRITON:

    @triton.jit
    def _pooled_kernel(
        weight_ptr, rows_ptr, offsets_ptr, psw_ptr, out_ptr, D, layout_ptr, T,
        HAS_W: tl.constexpr, PACKED: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """``D``: the rows' dim, and the output's (``PACKED``: the output's; each bag's rows are
        its table's, placed by the layout ``[3, T + 1]``)."""
        # Rows summed one at a time, in bag order (a fixed summation order), not as a tile of
        # several rows: the faster of the two on the GPU.
        bag = tl.program_id(0).to(tl.int64)
        start = tl.load(offsets_ptr + bag)
        end = tl.load(offsets_ptr + bag + 1)
        d = tl.arange(0, BLOCK_D)
        row_start, element_start, dim = 0, 0, D
        if PACKED:  # the bag's table, from its first row (an empty bag is zeros whatever it is)
            t = table_of(tl.load(rows_ptr + start, mask=start < end, other=0).to(tl.int64), layout_ptr, T)
            row_start, element_start, dim = table_place(t, layout_ptr, T)
        dm = d < dim
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        i = start
        while i < end:  # a while loop: Triton's interpreter runs it too
            r = tl.load(rows_ptr + i).to(tl.int64)
            v = tl.load(weight_ptr + element_start + (r - row_start) * dim + d, mask=dm, other=0.0).to(tl.float32)
            if HAS_W:
                v = v * tl.load(psw_ptr + i)
            acc += v
            i += 1
        tl.store(out_ptr + bag * D + d, acc, mask=d < D)


def pooled_forward(
    weight: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    layout: Optional[torch.Tensor] = None,
    width: int = 0,
) -> torch.Tensor:
    """``out[b] = sum_{i in bag b} psw[i] * weight[rows[i]]``: ``[num_bags, D]`` float32 (summed in
    float32 whatever the rows' dtype). With a ``layout``: ``weight`` packed rows, ``rows`` group
    rows, the output ``[num_bags, width]``, zero past each bag's table's dim."""
    num_bags, dim = offsets.numel() - 1, (width if layout is not None else weight.shape[1])
    out = torch.empty(num_bags, dim, dtype=torch.float32, device=weight.device)
    if num_bags:
        psw = per_sample_weights.contiguous() if per_sample_weights is not None else rows
        _pooled_kernel[(num_bags,)](
            weight, rows.contiguous(), offsets.contiguous(), psw, out, dim,
            layout if layout is not None else offsets, 0 if layout is None else layout.shape[1] - 1,
            HAS_W=per_sample_weights is not None, PACKED=layout is not None, BLOCK_D=row_block(dim),
        )  # fmt: skip
    return out
