"""Rows moved between a device cache and the host memory under it, and fresh optimizer states, in
plain torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch


def exchange_rows(
    caches: Sequence[torch.Tensor],
    slots: torch.Tensor,
    hosts: Sequence[torch.Tensor],
    out_rows: Optional[torch.Tensor],
    in_rows: Optional[torch.Tensor],
) -> None:
    """For every field ``f`` and every ``i``: row ``slots[i]`` of ``caches[f]`` is written to row
    ``out_rows[i]`` of ``hosts[f]`` (skipped where ``out_rows[i] < 0``), then row ``in_rows[i]``
    of ``hosts[f]`` is read into row ``slots[i]`` of ``caches[f]``. Either list may be None (that
    half skipped).

    ``caches[f]`` and ``hosts[f]``: ``[*, W]`` of one dtype (one field of a table's rows: its
    weights or a state), on any devices (a host field may be a strided view: fields of one
    record a row); ``slots`` (distinct), ``out_rows``, ``in_rows``: ``[n]`` int64, on the caches'
    device. Bits are moved, never converted. The rows written out and the rows read in are
    distinct (a row is in the cache or in host memory, not both).

    Every field is written out before any is read in, and the rows read in are gathered before
    any cache row is written: where it raises (out of memory), no cache row has changed."""
    if len(caches) != len(hosts):
        raise ValueError(f"exchange_rows: {len(caches)} cache fields and {len(hosts)} host fields")
    if out_rows is not None:
        kept = out_rows >= 0
        src, dst = slots[kept], out_rows[kept]
        for cache, host in zip(caches, hosts):
            host.index_copy_(0, dst.to(host.device), cache.index_select(0, src).to(host.device))
    if in_rows is not None:
        values = [host.index_select(0, in_rows.to(host.device)).to(cache.device) for cache, host in zip(caches, hosts)]
        for cache, v in zip(caches, values):
            cache.index_copy_(0, slots, v)


def fill_rows(t: torch.Tensor, rows: torch.Tensor, value: float) -> None:
    """``t[rows[i], :] = value`` for every ``i`` (duplicates allowed): ``rows``' optimizer states
    at their initial value. ``t``: ``[num_rows, width]``; ``rows``: ``[n]`` int64."""
    t.index_fill_(0, rows, value)
