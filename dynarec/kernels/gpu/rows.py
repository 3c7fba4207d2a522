"""Rows moved between a device cache and the host memory under it, by the device itself.

A host-memory tier's rows live in pinned host memory, which a GPU reads and writes over its link
(PCIe or NVLink-C2C) at the address the host uses (unified virtual addressing): one kernel
gathers the rows a step misses straight into their cache slots and scatters the rows they
displace back, with no staging copy, no host-side gather and no host sync. Each program moves
``block_rows`` whole rows; a row's write-back and its slot's fill are ordered within the
program, so one launch both evicts and loads (the link carries both directions at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from dynarec.kernels.gpu._triton import HAVE_TRITON, row_block

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = ["TUNING", "Tuning", "exchange_rows"]


@dataclass(frozen=True)
class Tuning:
    """A program moves about ``tile`` elements: ``tile // row_block(W)`` rows (1 to
    ``max_rows``), with ``num_warps`` warps."""

    tile: int = 4096
    max_rows: int = 128
    num_warps: int = 4


TUNING = Tuning()


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["n"])
    def _exchange_kernel(
        cache_ptr, slots_ptr, host_ptr, out_ptr, in_ptr, n, W,
        WRITE_OUT: tl.constexpr, READ_IN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = r < n
        w = tl.arange(0, BLOCK_W)
        in_row = w < W
        slot = tl.load(slots_ptr + r, mask=live, other=0).to(tl.int64)
        at_slot = slot[:, None] * W + w[None, :]
        if WRITE_OUT:
            out = tl.load(out_ptr + r, mask=live, other=-1).to(tl.int64)
            m = (live & (out >= 0))[:, None] & in_row[None, :]
            v = tl.load(cache_ptr + at_slot, mask=m)
            tl.store(host_ptr + out[:, None] * W + w[None, :], v, mask=m)
            tl.debug_barrier()  # the slot's old row is read before its new row is written
        if READ_IN:
            src = tl.load(in_ptr + r, mask=live, other=0).to(tl.int64)
            m = live[:, None] & in_row[None, :]
            v = tl.load(host_ptr + src[:, None] * W + w[None, :], mask=m)
            tl.store(cache_ptr + at_slot, v, mask=m)


def exchange_rows(
    cache: torch.Tensor,
    slots: torch.Tensor,
    host: torch.Tensor,
    out_rows: Optional[torch.Tensor],
    in_rows: Optional[torch.Tensor],
) -> None:
    """``dynarec.kernels.reference.exchange_rows`` in one launch: ``cache`` on the device,
    ``host`` on it too or in pinned host memory (read and written by the device in place); both
    contiguous ``[*, W]`` of one dtype."""
    n = slots.numel()
    if n == 0 or (out_rows is None and in_rows is None):
        return
    if cache.dtype != host.dtype or cache.shape[1:] != host.shape[1:]:
        raise ValueError(f"exchange_rows: cache {cache.dtype}{tuple(cache.shape)} and host "
                         f"{host.dtype}{tuple(host.shape)} differ in dtype or width")  # fmt: skip
    if not (cache.is_contiguous() and host.is_contiguous()):
        raise ValueError("exchange_rows: cache and host rows must be contiguous")
    width = cache[0].numel() if cache.dim() > 1 else 1
    block_w = row_block(width)
    block_r = max(1, min(TUNING.max_rows, TUNING.tile // block_w))
    _exchange_kernel[(triton.cdiv(n, block_r),)](
        cache, slots.contiguous(), host,
        slots if out_rows is None else out_rows.contiguous(), slots if in_rows is None else in_rows.contiguous(),
        n, width, WRITE_OUT=out_rows is not None, READ_IN=in_rows is not None, BLOCK_R=block_r, BLOCK_W=block_w,
        num_warps=TUNING.num_warps,
    )  # fmt: skip
