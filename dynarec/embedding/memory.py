"""What tables will hold in memory, checked before anything is allocated.

A table's bytes at its largest: weights and optimizer states of every row (``num_embeddings``,
or ``max_capacity`` of a dynamic table), plus a dynamic table's index (key, score, pin and
occupancy per slot) and admission counter. A dynamic table that starts below ``max_capacity``
holds more than that for a while: growing by doubling, it keeps the allocation it grew from
(rows, states, index) until the step that grew it commits, so that the step can be undone — its
peak is its largest plus what it held before its last growth. :func:`check_fits` refuses a
collection whose tables do not fit the memory available on their device at that peak, naming the
tables and the numbers — instead of an allocation failure, or the OOM killer, hours into a run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from dynarec.embedding.capacity import rows_before_last_growth, whole_buckets
from dynarec.embedding.config import TableConfig, cache_rows_of
from dynarec.optim.base import OptimizerSpec
from dynarec.optim.rounding import ROW_DTYPES

__all__ = ["INDEX_BYTES_PER_SLOT", "TableBytes", "available_memory", "check_fits", "format_bytes", "table_bytes"]

INDEX_BYTES_PER_SLOT = 8 + 8 + 4 + 1  # key, score, pin, occupancy
CACHE_MAP_BYTES_PER_ROW = 4  # a cached table's map from each row to its cache slot (int32)
CACHE_BYTES_PER_SLOT = 8 + 8  # a cache slot's row and last use


@dataclass(frozen=True)
class TableBytes:
    """Bytes on the device (weights, states, index) and, for a table whose rows live in host
    memory (``cache_load_factor``), ``host``: every row's weights and states there."""

    rows: int
    weights: int
    states: int
    index: int
    host: int = 0
    # A dynamic table's last growth: the allocation it grows from, held until the step commits
    # (on the device; ``host_growth``: a host-memory tier's rows there).
    growth: int = 0
    host_growth: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.states + self.index

    @property
    def peak(self) -> int:
        """Bytes on the device at the table's last growth (``total`` for a table that never grows)."""
        return self.total + self.growth

    @property
    def host_peak(self) -> int:
        return self.host + self.host_growth


def table_bytes(
    config: TableConfig,
    spec: OptimizerSpec,
    rows: Optional[int] = None,
    world_size: int = 1,
    init_rows: Optional[int] = None,
) -> TableBytes:
    """Bytes of ``config`` trained by ``spec`` at ``rows`` rows (default: its largest; weights
    in the table's ``data_type``, states float32; a cached table's device bytes are its cache's); a
    key-hash shard of ``world_size`` holds a ``1/world_size`` share of the admission counter. A
    dynamic table's growth: from ``init_rows`` (default: its ``init_capacity``, where ``rows`` is
    its largest; else none) to ``rows``."""
    d = config.dynamic
    if rows is None:
        if d is None:
            rows = config.num_embeddings
        else:
            rows = whole_buckets(d.max_capacity, d.bucket_size)
            init_rows = d.init_capacity if init_rows is None else init_rows
    assert rows is not None
    grown_from = rows_before_last_growth(init_rows, rows, d.bucket_size) if d is not None and init_rows else 0
    state_width = sum(s.width(config.dim) for s in spec.state_specs())
    index = 0
    if d is not None:
        index = rows * INDEX_BYTES_PER_SLOT
        if d.admission is not None:
            counter = d.admission.capacity or d.max_capacity
            index += -(-counter // world_size) * INDEX_BYTES_PER_SLOT
    weight_row, state_row = ROW_DTYPES[config.data_type].itemsize * config.dim, state_width * 4
    if config.cache_load_factor is not None:  # on the device its cache and slot map; every row in host memory
        cached = cache_rows_of(rows, config.cache_load_factor)
        index += CACHE_MAP_BYTES_PER_ROW * rows + CACHE_BYTES_PER_SLOT * cached  # a dynamic table's index stays
        return TableBytes(
            rows,
            cached * weight_row,
            cached * state_row,
            index,
            host=rows * (weight_row + state_row),
            growth=grown_from * (INDEX_BYTES_PER_SLOT + CACHE_MAP_BYTES_PER_ROW),  # (the cache stays as it is)
            host_growth=grown_from * (weight_row + state_row),
        )
    growth = grown_from * (weight_row + state_row + INDEX_BYTES_PER_SLOT)
    return TableBytes(rows, rows * weight_row, rows * state_row, index, growth=growth)


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on ``device`` (free GPU memory; the OS's MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def check_fits(
    tables: Sequence[tuple[TableConfig, OptimizerSpec]],
    device: torch.device,
    budget: Optional[int] = None,
    sizes: Optional[Sequence[int]] = None,
) -> None:
    """Raises ValueError when the tables at their peak (their largest, and a dynamic table's last
    growth) exceed ``budget`` bytes (default: the memory available on ``device``), naming each
    table's bytes and the knob that sets them. ``sizes``: the tables' bytes when they are shards
    (default: whole tables)."""
    budget = available_memory(device) if budget is None else budget
    breakdown = [(config, table_bytes(config, spec)) for config, spec in tables]
    if sizes is not None:  # shards: their share of each table
        breakdown = [(config, _scaled(b, n)) for (config, b), n in zip(breakdown, sizes)]
    host = sum(b.host_peak for _, b in breakdown)
    if host:  # rows kept in host memory (cache_load_factor): the host must hold them
        in_ram = host + (sum(b.peak for _, b in breakdown) if device.type == "cpu" else 0)
        free = available_memory(torch.device("cpu"))
        if in_ram > free:
            on_cpu = device.type == "cpu"  # the "device" bytes (caches, slot maps, whole tables) are in RAM too
            lines = [
                f"  table '{c.name}': "
                + ", ".join(
                    part
                    for part in (
                        f"{format_bytes(b.host)} of rows in host memory" if b.host else "",
                        f"{format_bytes(b.host_growth)} more while it grows" if b.host_growth else "",
                        f"{format_bytes(b.peak)} on the device, which is host memory on a CPU" if on_cpu else "",
                    )
                    if part
                )
                for c, b in breakdown
                if b.host or on_cpu
            ]
            raise ValueError(
                f"the tables need {format_bytes(in_ram)} of host memory but {format_bytes(free)} is available:\n"
                + "\n".join(lines)
                + "\nlower them, or train with more memory"
            )
    total = sum(b.peak for _, b in breakdown)
    if total <= budget:
        return
    lines = [
        f"  table '{c.name}': {format_bytes(b.total)} = {b.rows:,} rows x dim {c.dim} (weights "
        f"{format_bytes(b.weights)}, optimizer states {format_bytes(b.states)}, index {format_bytes(b.index)})"
        + (
            f", {format_bytes(b.growth)} more while it grows to them (dynamicemb.init_capacity below max_capacity)"
            if b.growth
            else ""
        )
        + f"; set by {'num_buckets' if c.dynamic is None else 'dynamicemb.max_capacity'} and embedding_dim"
        for c, b in sorted(breakdown, key=lambda x: -x[1].peak)
    ]
    growing = any(b.growth for _, b in breakdown)
    what = "at their peak (a growing table's last growth included)" if growing else "at their largest"
    raise ValueError(
        f"the tables need {format_bytes(total)} {what} but {format_bytes(budget)} is "
        f"available on {device}:\n" + "\n".join(lines) + "\nlower them, or train with more memory"
    )


def _scaled(full: TableBytes, total: int) -> TableBytes:
    """``full``'s breakdown scaled to ``total`` bytes (a shard holding that share of it)."""
    f = total / max(full.total, 1)
    return TableBytes(
        int(full.rows * f),
        int(full.weights * f),
        int(full.states * f),
        int(full.index * f),
        int(full.host * f),
        int(full.growth * f),
        int(full.host_growth * f),
    )
