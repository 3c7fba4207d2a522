"""A host-memory tier: a fixed table's rows in host memory, its hot rows cached on the device.

FBGEMM TBE's managed caching and dynamicemb's caching mode keep a table's rows (weights and
optimizer states together) in host memory and the rows a step touches in a cache on the device.
:class:`CachedRowStore` does that for a fixed table: ``cache_rows`` slots on the device, each
holding one row of the table with its states, over the whole table in host memory (page-locked
on a GPU).

A lookup first makes every row of its bags resident. The batch's rows missing from the cache
take the slots of the least recently used rows (empty slots first); the rows they displace are
written back to host memory with their states first. A slot used by a training step whose
backward has not run yet is never taken (gradient accumulation keeps several pending), and a
batch needing more rows than the cache can give is a named error. The lookup and its fused update
then run on the cache exactly as on a table's own rows (:class:`NativeRowStore`), cache slots
standing for rows: each row's values are moved, never recomputed, so a cached table trains as the
same table kept whole on the device (bit for bit on the CPU, whose update sums a row's gradients
in occurrence order whatever the rows' numbering; to float32 summation order on a GPU, whose
update blocks depend on the numbering).

Reading the rows from outside (dumps, ``read_rows``) writes the cache back first; writing them
(loads, ``write_rows``) also empties it. Both are refused while a training step is pending.
"""

from __future__ import annotations

from typing import Optional

import torch

from dynarec.embedding.row_store import NativeRowStore, RowStore
from dynarec.embedding.step import StepLifecycle
from dynarec.optim.base import OptimizerSpec
from dynarec.optim.fused import RowScores

__all__ = ["CacheFullError", "CachedRowStore"]


class CacheFullError(RuntimeError):
    """A batch needs more rows on the device than a table's cache can give it."""


class CachedRowStore(RowStore):
    """``num_rows`` rows in host memory, ``cache_rows`` of them at a time on ``device`` (float32
    rows; see the module's doc). ``name`` names the table in errors. :attr:`steps` (the owning
    table's step lifecycle, bound by it) tells which slots pending steps still need."""

    def __init__(
        self, num_rows: int, dim: int, spec: OptimizerSpec, device: torch.device | str, cache_rows: int, name: str = ""
    ):
        super().__init__(num_rows, dim, spec, torch.device(device))
        if cache_rows < 1:
            raise ValueError(f"table '{name}': a cache needs at least one row, got {cache_rows}")
        self.name = name
        self.cache_rows = min(cache_rows, num_rows)
        self.host = NativeRowStore(num_rows, dim, spec, "cpu", pinned=self.device.type == "cuda")
        self.cache = NativeRowStore(self.cache_rows, dim, spec, self.device)
        self.steps: Optional[StepLifecycle] = None
        self.counters = {"loaded": 0, "written_back": 0}
        self._clock = 0  # one tick a lookup
        self._step_clock: dict[int, int] = {}  # a pending step's id -> the tick of its lookup
        self._reset_cache()

    def _reset_cache(self) -> None:
        device = self.device
        self._slot_of_row = torch.full((self.num_rows,), -1, dtype=torch.int64, device=device)
        self._row_of_slot = torch.full((self.cache_rows,), -1, dtype=torch.int64, device=device)
        self._last_used = torch.full((self.cache_rows,), -1, dtype=torch.int64, device=device)

    # -- the lookup ----------------------------------------------------------------------------

    def lookup(self, rows, offsets, per_sample_weights, train, step=0, row_scores: Optional[RowScores] = None):
        slots = self._resident(rows, train and torch.is_grad_enabled())
        return self.cache.lookup(slots, offsets, per_sample_weights, train, step)

    def _resident(self, rows: torch.Tensor, training: bool) -> torch.Tensor:
        """The cache slot of every row of ``rows``, loading the missing ones."""
        self._clock += 1
        pending = [s.id for s in self.steps.pending] if self.steps is not None else []
        self._step_clock = {i: c for i, c in self._step_clock.items() if i in pending}
        if training and pending:
            self._step_clock[pending[-1]] = self._clock
        keep_from = min(self._step_clock.values(), default=self._clock)  # ticks of pending steps' lookups
        unique = torch.unique(rows)
        slots = self._slot_of_row[unique]
        self._last_used[slots[slots >= 0]] = self._clock
        missing = unique[slots < 0]
        if missing.numel():
            self._load(missing, keep_from)
        self._last_used[self._slot_of_row[unique]] = self._clock
        return self._slot_of_row[rows]

    @torch.no_grad()
    def _load(self, missing: torch.Tensor, keep_from: int) -> None:
        """Gives the ``missing`` rows (unique) the least recently used slots not kept."""
        order = torch.argsort(self._last_used, stable=True)  # empty slots (-1) first
        free = int((self._last_used < keep_from).sum())
        if free < missing.numel():
            raise CacheFullError(
                f"table '{self.name}': a lookup needs {missing.numel()} rows more on the device, but its cache of "
                f"{self.cache_rows} rows can give {free} (the others hold this batch's rows or a pending step's); "
                f"raise cache_load_factor"
            )
        victims = order[: missing.numel()]
        old = self._row_of_slot[victims]
        held = old >= 0
        if bool(held.any()):
            self.host.write(old[held].cpu(), {k: v.cpu() for k, v in self.cache.read(victims[held]).items()})
            self._slot_of_row[old[held]] = -1
            self.counters["written_back"] += int(held.sum())
        self.cache.write(victims, self.host.read(missing.cpu()))
        self._slot_of_row[missing] = victims
        self._row_of_slot[victims] = missing
        self.counters["loaded"] += missing.numel()

    @torch.no_grad()
    def _write_back(self, empty: bool) -> None:
        """Writes every cached row back to host memory (``empty``: and empties the cache)."""
        if self.steps is not None and self.steps.pending:
            raise RuntimeError(
                f"table '{self.name}': its rows are read or written from outside while a training step is "
                f"pending (its cache holds rows the step's backward updates)"
            )
        held = torch.nonzero(self._row_of_slot >= 0).squeeze(1)
        if held.numel():
            rows = self._row_of_slot[held]
            self.host.write(rows.cpu(), {k: v.cpu() for k, v in self.cache.read(held).items()})
        if empty:
            self._reset_cache()

    # -- the rows from outside -----------------------------------------------------------------

    @property
    def weight(self) -> torch.Tensor:
        """The host rows ``[num_rows, dim]`` (on the CPU), the cache written back and emptied:
        writing the view writes the table."""
        self._write_back(empty=True)
        return self.host.weight

    @property
    def states(self) -> dict[str, torch.Tensor]:
        self._write_back(empty=True)
        return self.host.states

    def read(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        self._write_back(empty=False)
        return {k: v.to(rows.device) for k, v in self.host.read(rows.cpu()).items()}

    @torch.no_grad()
    def write(self, rows: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        self._write_back(empty=True)
        self.host.write(rows.cpu(), values)

    @torch.no_grad()
    def reset_rows(self, rows: torch.Tensor, weight: torch.Tensor) -> None:
        self._write_back(empty=True)
        self.host.reset_rows(rows.cpu(), weight.cpu())

    def _allocate(self, num_rows: int) -> None:
        """A load: fresh rows in host memory, an empty cache."""
        self.host.reallocate(num_rows)
        self.cache.reallocate(self.cache_rows)
        self._reset_cache()

    def set_learning_rate(self, lr: float) -> None:
        super().set_learning_rate(lr)
        self.cache.set_learning_rate(lr)

    def storage(self):
        raise NotImplementedError("a fixed table's cached store is never resized")

    def restore_storage(self, handle) -> None:
        raise NotImplementedError("a fixed table's cached store is never resized")

    @property
    def nbytes(self) -> int:
        return self.host.nbytes + self.cache.nbytes
