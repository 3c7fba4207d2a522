"""Rows moved between a device cache and the host memory under it, by the device itself.

A host-memory tier's rows live in pinned host memory, which a GPU reads and writes over its link
(PCIe or NVLink-C2C) at the address the host uses (unified virtual addressing): one kernel
gathers the rows a step misses straight into their cache slots and scatters the rows they
displace back, with no staging copy, no host-side gather and no host sync. Each program moves
``block_rows`` whole rows, every field of them (the weights and each optimizer state): a row's
write-back and its slot's fill are ordered within the program, so one launch both evicts and
loads (the link carries both directions at once), and where a row's fields lie side by side in
host memory (a host-memory tier's one record a row) the device reaches them at one place — its
translation of host addresses, not the link's bandwidth, bounds rows spread over a large table
(``docs/memory.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from dynarec.kernels.gpu._triton import HAVE_TRITON, row_block

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = ["FIELDS_PER_LAUNCH", "TUNING", "Tuning", "exchange_rows"]


@dataclass(frozen=True)
class Tuning:
    """A program moves about ``tile`` elements of each row's fields: ``tile`` over the sum of
    their ``row_block(W)`` rows (1 to ``max_rows``), with ``num_warps`` warps."""

    tile: int = 4096
    max_rows: int = 128
    num_warps: int = 4


TUNING = Tuning()


#: Fields (weights, each state) one launch moves together.
FIELDS_PER_LAUNCH = 3


if HAVE_TRITON:

    @triton.jit
    def _move_field(from_ptr, from_row, from_stride, to_ptr, to_row, to_stride, W, mask, BLOCK_W: tl.constexpr):
        """One field of the programs' rows: row ``from_row`` of one side -> row ``to_row`` of the
        other (where ``mask``); a cache's rows have stride ``W``, a host's their own."""
        w = tl.arange(0, BLOCK_W)
        m = mask[:, None] & (w < W)[None, :]
        v = tl.load(from_ptr + from_row[:, None] * from_stride + w[None, :], mask=m)
        tl.store(to_ptr + to_row[:, None] * to_stride + w[None, :], v, mask=m)

    @triton.jit(do_not_specialize=["n"])
    def _exchange_kernel(
        slots_ptr, out_ptr, in_ptr, n,
        cache0, host0, W0, stride0, cache1, host1, W1, stride1, cache2, host2, W2, stride2,
        FIELDS: tl.constexpr, WRITE_OUT: tl.constexpr, READ_IN: tl.constexpr, BLOCK_R: tl.constexpr,
        B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = r < n
        slot = tl.load(slots_ptr + r, mask=live, other=0).to(tl.int64)
        if WRITE_OUT:
            out = tl.load(out_ptr + r, mask=live, other=-1).to(tl.int64)
            keep = live & (out >= 0)
            _move_field(cache0, slot, W0, host0, out, stride0, W0, keep, B0)
            if FIELDS > 1:
                _move_field(cache1, slot, W1, host1, out, stride1, W1, keep, B1)
            if FIELDS > 2:
                _move_field(cache2, slot, W2, host2, out, stride2, W2, keep, B2)
            tl.debug_barrier()  # the slot's old row is read before its new row is written
        if READ_IN:
            src = tl.load(in_ptr + r, mask=live, other=0).to(tl.int64)
            _move_field(host0, src, stride0, cache0, slot, W0, W0, live, B0)
            if FIELDS > 1:
                _move_field(host1, src, stride1, cache1, slot, W1, W1, live, B1)
            if FIELDS > 2:
                _move_field(host2, src, stride2, cache2, slot, W2, W2, live, B2)


def exchange_rows(
    caches: Sequence[torch.Tensor],
    slots: torch.Tensor,
    hosts: Sequence[torch.Tensor],
    out_rows: Optional[torch.Tensor],
    in_rows: Optional[torch.Tensor],
) -> None:
    """``dynarec.kernels.reference.exchange_rows``, every field of a row in the same launch (up
    to :data:`FIELDS_PER_LAUNCH` a launch): ``caches`` on the device, contiguous ``[*, W]``;
    ``hosts`` on it too or in pinned host memory (read and written by the device in place),
    ``[*, W]`` rows of any stride whose elements are contiguous (fields of one record a row lie
    side by side: a row's fields are then reached at one place)."""
    n = slots.numel()
    if n == 0 or (out_rows is None and in_rows is None):
        return
    if len(caches) != len(hosts):
        raise ValueError(f"exchange_rows: {len(caches)} cache fields and {len(hosts)} host fields")
    widths = []
    for cache, host in zip(caches, hosts):
        if cache.dtype != host.dtype or cache.shape[1:] != host.shape[1:]:
            raise ValueError(f"exchange_rows: cache {cache.dtype}{tuple(cache.shape)} and host "
                             f"{host.dtype}{tuple(host.shape)} differ in dtype or width")  # fmt: skip
        width = cache[0].numel() if cache.dim() > 1 else 1
        if not cache.is_contiguous() or (host.dim() > 1 and host.stride(-1) != 1) or host.stride(0) < width:
            raise ValueError("exchange_rows: cache rows must be contiguous, a host row's elements too")
        widths.append(width)
    slots = slots.contiguous()
    out_arg = slots if out_rows is None else out_rows.contiguous()
    in_arg = slots if in_rows is None else in_rows.contiguous()
    for first in range(0, len(caches), FIELDS_PER_LAUNCH):
        part = range(first, min(first + FIELDS_PER_LAUNCH, len(caches)))
        blocks = [row_block(widths[i]) for i in part]
        block_r = 1 << (max(1, min(TUNING.max_rows, TUNING.tile // sum(blocks))).bit_length() - 1)  # a power of 2
        fields = []
        for k in range(FIELDS_PER_LAUNCH):
            i = part[min(k, len(part) - 1)]  # unused slots repeat the last field (never read)
            fields += [caches[i], hosts[i], widths[i], hosts[i].stride(0)]
        blocks += [blocks[-1]] * (FIELDS_PER_LAUNCH - len(blocks))
        _exchange_kernel[(triton.cdiv(n, block_r),)](
            slots, out_arg, in_arg, n, *fields,
            FIELDS=len(part), WRITE_OUT=out_rows is not None, READ_IN=in_rows is not None, BLOCK_R=block_r,
            B0=blocks[0], B1=blocks[1], B2=blocks[2], num_warps=TUNING.num_warps,
        )  # fmt: skip
