"""A host-memory tier: a table's rows in host memory, its hot rows cached on the device.

FBGEMM TBE's managed caching and dynamicemb's caching mode keep a table's rows (weights and
optimizer states together) in host memory and the rows a step touches in a cache on the device.
:class:`CachedRowStore` does that for a fixed table's rows and for a dynamic table's slots:
``cache_rows`` slots on the device, each holding one row of the table with its states, over
every row in host memory. A dynamic table's hash index stays on the device (a key is found,
inserted or evicted there whether its row is cached or not: the rows move, the keys do not), and
its rows grow in host memory; the cache keeps its size (the share of the table's largest).

A lookup first makes every row of its bags resident. The batch's rows missing from the cache
take the slots of the least recently used rows (empty slots first); the rows they displace are
written back to host memory with their states first. A slot a training lookup used is kept until
that lookup's fused update has run (or its output was dropped without a backward): gradient
accumulation and late backwards find their rows where they left them. A batch needing more rows
than the cache can give is a named error. The lookup and its fused update then run on the cache
exactly as on a table's own rows (:class:`NativeRowStore`), cache slots standing for rows: each
row's values are moved, never recomputed, so a cached table trains as the same table kept whole
on the device (bit for bit on the CPU, whose update sums a row's gradients in occurrence order
whatever the rows' numbering; to float32 summation order on a GPU, whose update blocks depend
on the numbering).

Rows read, written or reset from outside (``read``, ``write``, ``reset_rows``: a dynamic
table's inserts, moves and evictions, ``write_rows``) go to wherever each row lives, the cache
or host memory. Whole-table views (``weight``, ``states``: dumps) write the cache back and empty
it, refused while a training lookup's update is still to come. A growth moves the rows in host
memory and renumbers the cached ones in place. On the device the cache keeps a map from every
row of the table to its slot (4 bytes a row; FBGEMM's set-associative cache needs none: not
built).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from dynarec.embedding.row_store import NativeRowStore, RowStore
from dynarec.embedding.step import StepPendingError
from dynarec.optim.base import OptimizerSpec
from dynarec.optim.fused import RowScores
from dynarec.optim.rounding import RowKeys

__all__ = ["CacheFullError", "CachedRowStore"]


class CacheFullError(RuntimeError):
    """A batch needs more rows on the device than a table's cache can give it."""


class CachedRowStore(RowStore):
    """``num_rows`` rows in host memory, ``cache_rows`` of them at a time on ``device`` (see the
    module's doc). ``name`` names the table in errors. ``dtype`` and ``rounding_seed``: the
    rows' storage, as :class:`NativeRowStore`'s; half-precision rows' rounding draws are keyed by
    :attr:`row_keys` (set by the owning table, in its rows' numbering) whatever slot a row takes."""

    def __init__(
        self,
        num_rows: int,
        dim: int,
        spec: OptimizerSpec,
        device: torch.device | str,
        cache_rows: int,
        name: str = "",
        dtype: torch.dtype = torch.float32,
        rounding_seed: int = 0,
    ):
        super().__init__(num_rows, dim, spec, torch.device(device))
        if cache_rows < 1:
            raise ValueError(f"table '{name}': a cache needs at least one row, got {cache_rows}")
        self.name = name
        self.cache_rows = cache_rows
        self.row_keys = RowKeys()
        self.host = NativeRowStore(num_rows, dim, spec, "cpu", dtype=dtype, rounding_seed=rounding_seed)
        self.cache = NativeRowStore(self.cache_rows, dim, spec, self.device, dtype=dtype, rounding_seed=rounding_seed)
        self.cache.row_keys = RowKeys(keys=self._slot_keys)  # a slot's draws are its row's
        self.counters = {"loaded": 0, "written_back": 0}
        self._clock = 0  # one tick a lookup
        self._in_flight: set[int] = set()  # ticks of training lookups whose update is still to come
        self._reset_cache(num_rows)

    def _slot_keys(self) -> torch.Tensor:
        """The key (:attr:`row_keys`) of each cache slot's row (an empty slot's: any)."""
        return self.row_keys.of(self._row_of_slot.clamp(min=0))

    def _reset_cache(self, num_rows: int) -> None:
        device = self.device
        self._slot_of_row = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
        self._row_of_slot = torch.full((self.cache_rows,), -1, dtype=torch.int64, device=device)
        self._last_used = torch.full((self.cache_rows,), -1, dtype=torch.int64, device=device)

    # -- the lookup ----------------------------------------------------------------------------

    def lookup(self, rows, offsets, per_sample_weights, train, step=0, row_scores: Optional[RowScores] = None):
        self._clock += 1
        tick = self._clock
        slots = self._resident(rows, tick)
        if not (train and torch.is_grad_enabled()):
            return self.cache.lookup(slots, offsets, per_sample_weights, train, step)
        self._in_flight.add(tick)
        out = self.cache.lookup(slots, offsets, per_sample_weights, True, step, on_update=lambda: self._release(tick))
        weakref.finalize(out, self._release, tick)  # dropped without a backward (an aborted step)
        return out

    def _release(self, tick: int) -> None:
        self._in_flight.discard(tick)

    def _resident(self, rows: torch.Tensor, tick: int) -> torch.Tensor:
        """The cache slot (int64) of every row of ``rows``, loading the missing ones."""
        unique = torch.unique(rows)
        slots = self._slot_of_row[unique].long()
        self._last_used[slots[slots >= 0]] = tick
        missing = unique[slots < 0]
        if missing.numel():
            self._load(missing, min(self._in_flight, default=tick))
        self._last_used[self._slot_of_row[unique].long()] = tick
        return self._slot_of_row[rows].long()

    @torch.no_grad()
    def _load(self, missing: torch.Tensor, keep_from: int) -> None:
        """Gives the ``missing`` rows (unique) the least recently used slots used before tick
        ``keep_from`` (the oldest lookup whose update is still to come, or this one)."""
        order = torch.argsort(self._last_used, stable=True)  # empty slots (-1) first
        free = int((self._last_used < keep_from).sum())
        if free < missing.numel():
            raise CacheFullError(
                f"table '{self.name}': a lookup needs {missing.numel()} rows more on the device, but its cache of "
                f"{self.cache_rows} rows can give {free} (the others hold this batch's rows or rows whose update is "
                f"still to come); raise cache_load_factor"
            )
        victims = order[: missing.numel()]
        old = self._row_of_slot[victims]
        held = old >= 0
        if bool(held.any()):
            self.host.write(old[held].cpu(), {k: v.cpu() for k, v in self.cache.read(victims[held]).items()})
            self._slot_of_row[old[held]] = -1
            self.counters["written_back"] += int(held.sum())
        self.cache.write(victims, self.host.read(missing.cpu()))
        self._slot_of_row[missing] = victims.to(torch.int32)
        self._row_of_slot[victims] = missing
        self.counters["loaded"] += missing.numel()

    @torch.no_grad()
    def _write_back(self, empty: bool) -> None:
        """Writes every cached row back to host memory (``empty``: and empties the cache, refused
        while a training lookup's update is still to come: it would update an emptied slot)."""
        if empty and self._in_flight:
            raise StepPendingError(
                f"table '{self.name}': its rows are written or viewed whole while a training step's update is "
                "still to come (its cache holds rows the update writes); run the backward first"
            )
        held = torch.nonzero(self._row_of_slot >= 0).squeeze(1)
        if held.numel():
            rows = self._row_of_slot[held]
            self.host.write(rows.cpu(), {k: v.cpu() for k, v in self.cache.read(held).items()})
        if empty:
            self._reset_cache(self.num_rows)

    # -- the rows from outside -----------------------------------------------------------------

    @property
    def weight(self) -> torch.Tensor:
        """The host rows ``[num_rows, dim]`` (on the CPU), the cache written back and emptied:
        writing the view writes the table until the next lookup caches rows again."""
        self._write_back(empty=True)
        return self.host.weight

    @property
    def states(self) -> dict[str, torch.Tensor]:
        self._write_back(empty=True)
        return self.host.states

    def _where(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(cached mask on the device, their slots, the others' rows on the CPU)`` of ``rows``."""
        rows = rows.to(self.device)
        slots = self._slot_of_row[rows].long()
        cached = slots >= 0
        return cached, slots[cached], rows[~cached].cpu()

    def read(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of the rows' weights and states (on ``rows``' device), from wherever each lives."""
        cached, slots, elsewhere = self._where(rows)
        if not slots.numel():
            return {k: v.to(rows.device) for k, v in self.host.read(rows.cpu()).items()}
        from_cache = self.cache.read(slots)
        if not elsewhere.numel():
            return {k: v.to(rows.device) for k, v in from_cache.items()}
        from_host = self.host.read(elsewhere.cpu())  # the rows of ~cached, in order
        out = {}
        for k, h in from_host.items():
            v = h.new_empty((rows.numel(), *h.shape[1:]), device=self.device)
            v[~cached] = h.to(self.device)
            v[cached] = from_cache[k].to(v.dtype)
            out[k] = v.to(rows.device)
        return out

    @torch.no_grad()
    def write(self, rows: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        for name, v in values.items():  # before the split: a shape error names the field, as the other stores do
            if v.shape[0] != rows.numel():
                raise ValueError(f"'{name}' must have {rows.numel()} rows, got shape {tuple(v.shape)}")
        cached, slots, elsewhere = self._where(rows)
        values = {k: v.to(self.device) for k, v in values.items()}
        if elsewhere.numel():
            self.host.write(elsewhere, {k: v[~cached].cpu() for k, v in values.items()})
        if slots.numel():
            self.cache.write(slots, {k: v[cached] for k, v in values.items()})

    @torch.no_grad()
    def reset_rows(self, rows: torch.Tensor, weight: torch.Tensor) -> None:
        cached, slots, elsewhere = self._where(rows)
        weight = weight.to(self.device)
        if elsewhere.numel():
            self.host.reset_rows(elsewhere, weight[~cached].cpu())
        if slots.numel():
            self.cache.reset_rows(slots, weight[cached])

    @torch.no_grad()
    def resize(self, num_rows: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """A growth: rows ``src`` become rows ``dst`` of ``num_rows``, in host memory (moved) and in
        the cache (renumbered in place); cached rows not in ``src`` (lost) free their slots."""
        self.host.resize(num_rows, src.cpu(), dst.cpu())
        src, dst = src.to(self.device), dst.to(self.device)
        slots = self._slot_of_row[src].long()
        held = slots >= 0
        slot_of_row = torch.full((num_rows,), -1, dtype=torch.int32, device=self.device)
        slot_of_row[dst[held]] = slots[held].to(torch.int32)
        row_of_slot = torch.full_like(self._row_of_slot, -1)
        row_of_slot[slots[held]] = dst[held]
        self._last_used[row_of_slot < 0] = -1  # the lost rows' slots are free
        self._slot_of_row, self._row_of_slot = slot_of_row, row_of_slot
        self.num_rows = num_rows

    def _allocate(self, num_rows: int) -> None:
        """A load: fresh rows in host memory, an empty cache (the cache's rows are replaced with
        the others; a table refuses a load while a step is pending, so no slot kept for an update
        still to come is needed: an aborted step's lookup may still hold some)."""
        self._in_flight.clear()
        self.host.reallocate(num_rows)
        self.cache.reallocate(self.cache_rows)
        self._reset_cache(num_rows)

    def set_learning_rate(self, lr: float) -> None:
        super().set_learning_rate(lr)
        self.cache.set_learning_rate(lr)

    def storage(self):
        """The rows as they are now (the cache written back) and where the cache holds them:
        :meth:`restore_storage` puts back the rows of before a growth, the cache emptied."""
        self._write_back(empty=False)
        return self.host.storage(), self.num_rows

    def restore_storage(self, handle) -> None:
        """Undoes a growth (its step aborted: nothing of it is kept; a table grows only while no
        other lookup's update is to come, so the aborted step's are the only ones in flight):
        the host rows of :meth:`storage`, which the cache had been written back into; the
        cache's rows since are dropped."""
        host, self.num_rows = handle
        self.host.restore_storage(host)
        self._in_flight.clear()
        self._reset_cache(self.num_rows)

    @property
    def nbytes(self) -> int:
        """The host copy's bytes and the device cache's (see :attr:`host_nbytes`)."""
        return self.host.nbytes + self.cache.nbytes

    @property
    def host_nbytes(self) -> int:  # type: ignore[override]
        return self.host.nbytes
