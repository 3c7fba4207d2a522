"""Table batching: fixed tables that share one row store and one lookup a step.

FBGEMM's TBE and dynamicemb's table fusion serve every table of a group with one weight buffer
and per-table row offsets, so a step's lookup of all their features is one pooled lookup and its
backward one fused update, whatever the number of tables. A :class:`TableGroup` does that for
fixed float32 tables of one optimizer spec on the native backend: their rows lie in one
:class:`~dynarec.embedding.row_store.PackedRowStore`, each table keeping its own
:class:`~dynarec.embedding.row_store.RowStoreSlice` of it (reads, writes, dumps and loads by
table, as before). Tables of one dim group on any device. Tables of several dims within one row
tile of the kernels (dims 1-16, 17-32, 33-64, ...) group where the ``dynarec`` ops' packed form
has kernels (a GPU with Triton): their rows are packed end to end and a bag's output is the
group's widest dim, each feature given its own dim's columns back; on a CPU, where a lookup
launches nothing, they are looked up apart.

The grouping changes no result beyond float32 summation order: a row's update depends only on
its own aggregated gradient and the table's learning rate and step counter, and each bag pools
in the same order. Where the tables' learning rates or step counters differ (one was set or
loaded apart from the others), the group looks each table up on its own for that step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

import dynarec.kernels.ops
from dynarec.embedding.cached_store import CacheHold
from dynarec.embedding.config import TableConfig
from dynarec.embedding.jagged import FeatureSlice
from dynarec.embedding.pack import BagLayout, Bags, pack
from dynarec.embedding.row_store import PackedRowStore, RowStoreSlice
from dynarec.embedding.table import FixedTable, FoundKeys, commit_on_backward
from dynarec.optim.base import OptimizerSpec
from dynarec.optim.fused import GradReducer
from dynarec.optim.registry import definition

__all__ = ["GroupBags", "ReducerFactory", "TableGroup", "group_key", "packs_dims"]

# A data-parallel table's row-gradient reducer for a store of ``rows`` rows named ``name``.
ReducerFactory = Callable[[str, int], Optional[GradReducer]]


def group_key(config: TableConfig, spec: OptimizerSpec, packs_dims: bool = False) -> Optional[tuple]:
    """What tables must share to be grouped, or None for a table that is looked up on its own
    (dynamic, another backend, half-precision rows: their rounding draws are keyed by the
    table's own rows, or rows in host memory behind a cache). ``packs_dims``
    (:func:`packs_dims`): tables of several dims within one row tile group too (the tile and the
    spec), else the dim and the spec."""
    if config.kind != "fixed" or config.backend != "native" or config.data_type != "fp32":
        return None
    if config.cache_load_factor is not None:  # its rows live in host memory, behind its own cache
        return None
    return (_dim_class(config.dim), spec) if packs_dims else (config.dim, spec)


def _dim_class(dim: int) -> int:
    """The kernels' row tile of ``dim`` floats (the next power of two, at least 16): tables
    packed together share it, so a narrow table's bags are never much wider than its rows (a
    bag's output and gradient take the group's widest dim)."""
    return max(16, 1 << (dim - 1).bit_length())


def packs_dims(spec: OptimizerSpec, device: torch.device, data_parallel: bool) -> bool:
    """Whether tables of several dims may share a packed store on ``device``: where the ops'
    packed form has kernels (Triton on a GPU; on a CPU a lookup launches nothing, and the C++
    kernels take rows of one dim), for an optimizer with kernel arguments, and not for
    data-parallel tables (their row gradients are reduced over ranks at the row's dim)."""
    return dynarec.kernels.ops.packs_rows(device) and definition(spec).kernel is not None and not data_parallel


class TableGroup:
    """Fixed tables sharing one :class:`NativeRowStore`: table ``i``'s row ``r`` is the store's
    row ``bases[i] + r``. A collection uses it where it would use one table: ``pack`` → ``find``
    → ``lookup`` → ``unpack``, the step lifecycle over all its tables."""

    def __init__(
        self,
        configs: Sequence[TableConfig],
        spec: OptimizerSpec,
        device: torch.device,
        reducers: Optional[ReducerFactory] = None,
    ):
        """``reducers``: data-parallel tables' row-gradient reducers, ``reducers(name, rows)``
        (the group's store gets one over all its rows, each table's slice its own)."""
        packs = packs_dims(spec, torch.device(device), reducers is not None)
        if len({group_key(c, spec, packs) for c in configs}) != 1 or group_key(configs[0], spec, packs) is None:
            raise ValueError(f"tables {[c.name for c in configs]} differ in dim, kind or backend: no group")
        shapes = [(int(c.num_embeddings), c.dim) for c in configs]  # type: ignore[arg-type]
        rows = sum(n for n, _ in shapes)
        self.name = "+".join(c.name for c in configs)
        reducer = (lambda name, n: None) if reducers is None else reducers
        self.store = PackedRowStore(shapes, spec, device, reducer(self.name, rows))
        self.tables: list[FixedTable] = []
        self.bases: list[int] = []
        self._shifts: dict[tuple, torch.Tensor] = {}  # _shift's, by the features' id counts
        base = 0
        for i, (config, (n, _)) in enumerate(zip(configs, shapes)):
            store = RowStoreSlice(self.store, i, reducer(config.name, n))
            self.tables.append(FixedTable(config, spec, device, store=store))
            self.bases.append(base)
            base += n

    # -- the step lifecycle, over every table ---------------------------------------------------

    def begin_step(self) -> None:
        for t in self.tables:
            t.begin_step()

    def abort_step(self) -> None:
        for t in reversed(self.tables):
            t.abort_step()

    def commit_pending(self) -> None:
        for t in self.tables:
            t.commit_pending()

    # -- the three stages ----------------------------------------------------------------------

    def pack(self, slices: Mapping[str, FeatureSlice]) -> tuple[GroupBags, BagLayout]:
        """Every feature of every table as one list of bags over the store's rows: each table's
        ids shifted by its base (one op for the whole group)."""
        inputs, bases, counts, parts, dims = [], [], [], [], []
        for table, base in zip(self.tables, self.bases):
            num_bags = num_ids = 0
            for f in table.features:
                s = slices[f.name]
                pooling = table.config.pooling_of(f)
                inputs.append((f.name, pooling, s))
                bases.append(base)
                counts.append(s.num_ids)
                dims.append(table.config.dim)
                num_bags += s.num_ids if pooling == "none" else s.lengths.numel()
                num_ids += s.num_ids
            parts.append((num_bags, num_ids))
        bags, layout = pack(inputs, dims if self.store.layout is not None else None)
        return GroupBags(
            bags.ids + self._shift(bases, counts, bags.ids.device), bags.offsets, bags.weights, tuple(parts)
        ), layout

    def _shift(self, bases: list[int], counts: list[int], device: torch.device) -> torch.Tensor:
        """``[sum(counts)]`` int64: each feature's base, once for each of its ids (``counts``); kept
        for the next batches of the same counts (a batch of one id a feature, say: every step's),
        which then copy and launch nothing for it. Read-only: a step adds it to its ids."""
        # One a stream: a tensor is used on the stream it was made on, so dropping it is safe.
        stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None
        key = (tuple(counts), device, stream)
        shift = self._shifts.pop(key, None)  # put back last: the least recently used goes first
        if shift is None:
            shift = torch.repeat_interleave(
                torch.tensor(bases, dtype=torch.int64).to(device, non_blocking=True),
                torch.tensor(counts, dtype=torch.int64).to(device, non_blocking=True),
                output_size=sum(counts),
            )
            if len(self._shifts) >= 4:  # counts that vary from batch to batch: keep the latest few
                self._shifts.pop(next(iter(self._shifts)))
        self._shifts[key] = shift
        return shift

    def find(self, bags: Bags) -> Optional[FoundKeys]:
        return None  # fixed tables: ids are rows

    def stage_rows(self, bags: Bags, found: Optional[FoundKeys] = None) -> None:
        return None  # its tables' rows are on the device (no table of a host-memory tier is grouped)

    def lookup(
        self, bags: Bags, train: bool, found: Optional[FoundKeys] = None, hold: Optional[CacheHold] = None
    ) -> torch.Tensor:
        """All tables' bags (:meth:`pack`'s) -> pooled rows ``[num_bags, D]``; in training the
        output's backward applies the fused update once to every touched row of every table and
        commits each table's step."""
        if not train:
            return self.store.lookup(bags.ids, bags.offsets, bags.weights, False)
        steps = [t.steps.current for t in self.tables]
        rates = {t.store.lr for t in self.tables}
        if len({s.t for s in steps}) > 1 or len(rates) > 1:
            assert isinstance(bags, GroupBags)
            return self._lookup_apart(bags)
        self.store.set_learning_rate(rates.pop())
        out = self.store.lookup(bags.ids, bags.offsets, bags.weights, True, step=steps[0].t)
        commit_on_backward(out, list(zip(self.tables, steps)))
        return out

    def _lookup_apart(self, bags: GroupBags) -> torch.Tensor:
        """Each table's own training lookup of its part of ``bags`` (its rates or step counters
        differ from the others'), the results in the group's bag order (zero past a table's dim
        in packed rows)."""
        outs = []
        bag_at = id_at = 0
        for table, base, (num_bags, num_ids) in zip(self.tables, self.bases, bags.parts):
            part = Bags(
                bags.ids[id_at : id_at + num_ids] - base,
                bags.offsets[bag_at : bag_at + num_bags + 1] - id_at,
                None if bags.weights is None else bags.weights[id_at : id_at + num_ids],
            )
            out = table.lookup(part, True)
            outs.append(F.pad(out, (0, self.store.dim - out.shape[1])) if out.shape[1] < self.store.dim else out)
            bag_at, id_at = bag_at + num_bags, id_at + num_ids
        return torch.cat(outs)


@dataclass
class GroupBags(Bags):
    """A group's bags, with each table's share: ``parts[i] = (num_bags, num_ids)`` of table ``i``
    (its bags and ids are consecutive, in table order)."""

    parts: tuple[tuple[int, int], ...] = ()
