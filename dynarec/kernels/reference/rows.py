"""Rows moved between a device cache and the host memory under it, in plain torch."""

from __future__ import annotations

from typing import Optional

import torch


def exchange_rows(
    cache: torch.Tensor,
    slots: torch.Tensor,
    host: torch.Tensor,
    out_rows: Optional[torch.Tensor],
    in_rows: Optional[torch.Tensor],
) -> None:
    """For every ``i``: row ``slots[i]`` of ``cache`` is written to row ``out_rows[i]`` of
    ``host`` (skipped where ``out_rows[i] < 0``), then row ``in_rows[i]`` of ``host`` is read into
    row ``slots[i]`` of ``cache``. Either list may be None (that half skipped).

    ``cache`` and ``host``: ``[*, W]`` of one dtype (the same field of a table's rows: weights or
    a state), on any devices; ``slots`` (distinct), ``out_rows``, ``in_rows``: ``[n]`` int64, on
    ``cache``'s device. Bits are moved, never converted. The rows written out and the rows read
    in are distinct (a row is in the cache or in host memory, not both)."""
    if out_rows is not None:
        kept = out_rows >= 0
        values = cache.index_select(0, slots[kept])
        host.index_copy_(0, out_rows[kept].to(host.device), values.to(host.device))
    if in_rows is not None:
        values = host.index_select(0, in_rows.to(host.device))
        cache.index_copy_(0, slots, values.to(cache.device))
