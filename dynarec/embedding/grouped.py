"""Table batching: tables that share one row store and one lookup a step.

FBGEMM's TBE and dynamicemb's table fusion serve every table of a group with one weight buffer
and per-table row offsets, so a step's lookup of all their features is one pooled lookup and its
backward one fused update, whatever the number of tables.

A :class:`TableGroup` does that for fixed float32 tables of one optimizer spec on the native
backend: their rows lie in one :class:`~dynarec.embedding.row_store.PackedRowStore`, each table
keeping its own :class:`~dynarec.embedding.row_store.RowStoreSlice` of it (reads, writes, dumps
and loads by table, as before). Tables of one dim group on any device. Tables of several dims
within one row tile of the kernels (dims 1-16, 17-32, 33-64, ...) group where the ``dynarec``
ops' packed form has kernels (a GPU with Triton): their rows are packed end to end and a bag's
output is the group's widest dim, each feature given its own dim's columns back; on a CPU, where
a lookup launches nothing, they are looked up apart.

A :class:`DynamicTableGroup` does it for dynamic tables of one dim and spec that never grow
(``init_capacity`` at ``max_capacity``: their slots are rows of the shared store for good),
float32 rows on the native backend, with admission or without: each table keeps its own hash
index, finds, inserts, evictions, pins, scores and admission counter; the group pools all their
slots at once and updates them in one pass. A key without a row (evaluation, a dropped key, a
key not yet admitted) adds its table's eval (or admission) initializer to its bag, as a table
alone does; a training step where the tables' learning
rates or step counters differ looks each table up on its own.

The grouping changes no result beyond float32 summation order: a row's update depends only on
its own aggregated gradient and the table's learning rate and step counter, and each bag pools
in the same order. Where the tables' learning rates or step counters differ (one was set or
loaded apart from the others), the group looks each table up on its own for that step. A dynamic
group's fused update writes no scores: each table writes its touched rows' scores when its step
commits (the path an FBGEMM store takes), the same values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

import dynarec.kernels.ops
from dynarec.embedding.cached_store import CacheHold
from dynarec.embedding.capacity import whole_buckets
from dynarec.embedding.config import TableConfig
from dynarec.embedding.dynamic import AbsentKeys, DynamicTable, present_bags
from dynarec.embedding.jagged import FeatureSlice
from dynarec.embedding.pack import BagLayout, Bags, pack
from dynarec.embedding.row_store import PackedRowStore, RowStoreSlice
from dynarec.embedding.table import EmbeddingTable, FixedTable, FoundKeys, commit_on_backward
from dynarec.kernels.reference import bags_of_ids
from dynarec.optim.base import OptimizerSpec
from dynarec.optim.fused import GradReducer
from dynarec.optim.registry import definition

__all__ = [
    "DynamicTableGroup",
    "GroupBags",
    "GroupFoundKeys",
    "ReducerFactory",
    "TableGroup",
    "group_key",
    "packs_dims",
]

# A data-parallel table's row-gradient reducer for a store of ``rows`` rows named ``name``.
ReducerFactory = Callable[[str, int], Optional[GradReducer]]


def group_key(config: TableConfig, spec: OptimizerSpec, packs_dims: bool = False) -> Optional[tuple]:
    """What tables must share to be grouped, or None for a table that is looked up on its own
    (another backend, half-precision rows: their rounding draws are keyed by the table's own
    rows, rows in host memory behind a cache, a dynamic table that grows). Fixed
    tables: with ``packs_dims`` (:func:`packs_dims`) tables of several dims within one row tile
    group too (the tile and the spec), else the dim and the spec; dynamic tables: the dim and
    the spec (each keeps its own index, of any bucket size)."""
    if config.backend != "native" or config.data_type != "fp32":
        return None
    if config.cache_load_factor is not None:  # its rows live in host memory, behind its own cache
        return None
    if config.dynamic is not None:
        d = config.dynamic
        grows = whole_buckets(d.init_capacity, d.bucket_size) < whole_buckets(d.max_capacity, d.bucket_size)  # type: ignore[arg-type]
        if grows:
            return None
        return ("dynamic", config.dim, spec)
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


class _Group:
    """What a group of tables does as one: the step lifecycle over all its tables, and a batch's
    features of every table as one list of bags, in table order."""

    tables: Sequence[EmbeddingTable]
    name: str
    bases: list[int]  # each table's first row in the shared store
    _shifts: dict[tuple, torch.Tensor]  # _shift's, by the id counts

    def begin_step(self) -> None:
        for t in self.tables:
            t.begin_step()

    def abort_step(self) -> None:
        for t in reversed(self.tables):
            t.abort_step()

    def commit_pending(self) -> None:
        for t in self.tables:
            t.commit_pending()

    def stage_rows(self, bags: Bags, found: Optional[FoundKeys] = None) -> None:
        return None  # its tables' rows are on the device (no table of a host-memory tier is grouped)

    def _pack(
        self, slices: Mapping[str, FeatureSlice], dims_apart: bool = False
    ) -> tuple[Bags, BagLayout, list[int], tuple[tuple[int, int], ...]]:
        """Every feature of every table as one list of bags: ``(bags, layout, ids a feature, each
        table's (bags, ids))``; ``dims_apart``: each feature's dim in the layout (packed rows)."""
        inputs, counts, parts, dims = [], [], [], []
        for table in self.tables:
            num_bags = num_ids = 0
            for f in table.features:
                s = slices[f.name]
                pooling = table.config.pooling_of(f)
                inputs.append((f.name, pooling, s))
                counts.append(s.num_ids)
                dims.append(table.config.dim)
                num_bags += s.num_ids if pooling == "none" else s.lengths.numel()
                num_ids += s.num_ids
            parts.append((num_bags, num_ids))
        bags, layout = pack(inputs, dims if dims_apart else None)
        return bags, layout, counts, tuple(parts)

    def _shift(self, bases: list[int], counts: list[int], device: torch.device) -> torch.Tensor:
        """``[sum(counts)]`` int64: ``bases[i]`` once for each of ``counts[i]`` ids (a feature's or
        table's first row, or a table's index); kept for the next batches of the same bases and
        counts (a batch of one id a feature, say: every step's), which then copy and launch
        nothing for it. Read-only: a step adds it or indexes with it."""
        # One a stream: a tensor is used on the stream it was made on, so dropping it is safe.
        stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None
        key = (tuple(bases), tuple(counts), device, stream)
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


class TableGroup(_Group):
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
        self._shifts = {}
        base = 0
        for i, (config, (n, _)) in enumerate(zip(configs, shapes)):
            store = RowStoreSlice(self.store, i, reducer(config.name, n))
            self.tables.append(FixedTable(config, spec, device, store=store))
            self.bases.append(base)
            base += n

    # -- the three stages ----------------------------------------------------------------------

    def pack(self, slices: Mapping[str, FeatureSlice]) -> tuple[GroupBags, BagLayout]:
        """Every feature of every table as one list of bags over the store's rows: each table's
        ids shifted by its base (one op for the whole group)."""
        bags, layout, counts, parts = self._pack(slices, dims_apart=self.store.layout is not None)
        bases = [base for table, base in zip(self.tables, self.bases) for _ in table.features]
        shift = self._shift(bases, counts, bags.ids.device)
        return GroupBags(bags.ids + shift, bags.offsets, bags.weights, parts), layout

    def find(self, bags: Bags) -> Optional[FoundKeys]:
        return None  # fixed tables: ids are rows

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
        for table, base, part in zip(self.tables, self.bases, bags.split()):
            out = table.lookup(Bags(part.ids - base, part.offsets, part.weights), True)
            outs.append(F.pad(out, (0, self.store.dim - out.shape[1])) if out.shape[1] < self.store.dim else out)
        return torch.cat(outs)


class DynamicTableGroup(_Group):
    """Dynamic tables sharing one :class:`PackedRowStore`: table ``i``'s slot ``s`` is the
    store's row ``bases[i] + s``. A collection uses it where it would use one table: ``pack`` →
    ``find`` → ``lookup`` → ``unpack``, the step lifecycle over all its tables."""

    def __init__(self, configs: Sequence[TableConfig], spec: OptimizerSpec, device: torch.device):
        keys = {group_key(c, spec) for c in configs}
        if len(keys) != 1 or None in keys or configs[0].dynamic is None:
            raise ValueError(f"tables {[c.name for c in configs]} differ in dim, kind or options: no group")
        slots = []  # each table's, for good: it never grows
        for c in configs:
            assert c.dynamic is not None
            slots.append(whole_buckets(c.dynamic.max_capacity, c.dynamic.bucket_size))
        self.name = "+".join(c.name for c in configs)
        self.store = PackedRowStore([(n, configs[0].dim) for n in slots], spec, device)
        self.tables: list[DynamicTable] = []
        self.bases: list[int] = []
        self._shifts = {}
        base = 0
        for i, (config, n) in enumerate(zip(configs, slots)):
            self.tables.append(DynamicTable(config, spec, device, store=RowStoreSlice(self.store, i)))
            self.bases.append(base)
            base += n

    # -- the three stages ----------------------------------------------------------------------

    def pack(self, slices: Mapping[str, FeatureSlice]) -> tuple[GroupBags, BagLayout]:
        """Every feature of every table as one list of bags over keys (each table's own)."""
        bags, layout, _, parts = self._pack(slices)
        return GroupBags(bags.ids, bags.offsets, bags.weights, parts), layout

    def find(self, bags: Bags) -> GroupFoundKeys:
        assert isinstance(bags, GroupBags)
        return GroupFoundKeys([t.find_keys(keys) for t, keys in zip(self.tables, bags.table_ids())])

    def lookup(
        self, bags: Bags, train: bool, found: Optional[FoundKeys] = None, hold: Optional[CacheHold] = None
    ) -> torch.Tensor:
        """All tables' bags (:meth:`pack`'s) -> pooled rows ``[num_bags, D]``: each table finds
        (and in training inserts) its keys, then one lookup pools every table's rows; in
        training its backward applies the fused update once to every touched row of every table
        and commits each table's step."""
        assert isinstance(bags, GroupBags)
        table_ids = bags.table_ids()
        num_ids = [n for _, n in bags.parts]
        earlier = found.parts if isinstance(found, GroupFoundKeys) else [None] * len(table_ids)
        steps = [t.steps.current if train else None for t in self.tables]
        founds = [t.found_again(keys, f) for t, keys, f in zip(self.tables, table_ids, earlier)]
        absents: list[Optional[AbsentKeys]] = [None] * len(founds)
        inserting = [i for i, f in enumerate(founds) if train and not f.all_present]
        if len(inserting) > 1:  # their absent keys in one pass (a fixed number of ops and host reads)
            # Over every table (one with no absent key adds none): the table of each key is then
            # kept for the batches of the same id counts, as the rows' shift is.
            table_of_key = self._shift(list(range(len(self.tables))), num_ids, bags.ids.device)
            shares = AbsentKeys.of_tables(table_ids, [f.slots for f in founds], table_of_key)
            for i in inserting:
                absents[i] = shares[i]
        slots, present = [], []
        for table, keys, f, step, absent_keys in zip(self.tables, table_ids, founds, steps, absents):
            s, p = table.slots_for(keys, f, step, absent_keys)
            slots.append(s)
            present.append(p)
        rates = {t.store.lr for t in self.tables}
        if train and (len({s.t for s in steps if s is not None}) > 1 or len(rates) > 1):
            parts = zip(self.tables, bags.split(), slots, present, steps)
            return torch.cat([t.pooled_at(part, s, p, step) for t, part, s, p, step in parts])
        found_slots = torch.cat(slots)
        rows = found_slots + self._shift(self.bases, num_ids, bags.ids.device)
        offsets, weights, missing_out = bags.offsets, bags.weights, None
        if not all(present):  # keys without a row: their initializer's values, the others pooled
            rows = torch.where(found_slots >= 0, rows, found_slots)
            bag_of_id, at = bags_of_ids(bags.offsets, bags.ids.numel()), 0
            for table, keys, s, p, step in zip(self.tables, table_ids, slots, present, steps):
                absent, ids_at = s < 0, slice(at, at + s.numel())
                at += s.numel()
                w = None if weights is None else weights[ids_at]
                values = None if p else table.absent_values(keys, w, absent, step)
                if values is not None:
                    if missing_out is None:
                        missing_out = values.new_zeros(bags.num_bags, self.store.dim)
                    missing_out.index_add_(0, bag_of_id[ids_at][absent], values)
            rows, offsets, weights = present_bags(bags, rows, bag_of_id)
            slots = [s if p else s[s >= 0] for s, p in zip(slots, present)]
        if not train:
            out = self.store.lookup(rows, offsets, weights, False)
        else:
            begun = [(table, step) for table, step in zip(self.tables, steps) if step is not None]
            for (table, step), s in zip(begun, slots):
                table.score_policy.schedule(s, step, fused=False)  # written at commit, by each index
            self.store.set_learning_rate(rates.pop())
            out = self.store.lookup(rows, offsets, weights, True, step=begun[0][1].t)
            commit_on_backward(out, begun)
        return out if missing_out is None else out + missing_out


class GroupFoundKeys(FoundKeys):
    """A :class:`DynamicTableGroup`'s find: each table's, in table order (the group reads them;
    it has no slots or stamp of its own)."""

    def __init__(self, parts: list[FoundKeys]):  # (not FoundKeys.__init__: each part has its own)
        self.parts = parts

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for p in self.parts for t in p.tensors)

    @property
    def all_present(self) -> bool:
        return all(p.all_present for p in self.parts)


@dataclass
class GroupBags(Bags):
    """A group's bags, with each table's share: ``parts[i] = (num_bags, num_ids)`` of table ``i``
    (its bags and ids are consecutive, in table order)."""

    parts: tuple[tuple[int, int], ...] = ()

    def table_ids(self) -> list[torch.Tensor]:
        """Each table's ids, in table order (views)."""
        out, at = [], 0
        for _, num_ids in self.parts:
            out.append(self.ids[at : at + num_ids])
            at += num_ids
        return out

    def split(self) -> list[Bags]:
        """Each table's bags, in table order (views of these: ids and weights as they are,
        offsets from the table's first id)."""
        out = []
        bag_at = id_at = 0
        for num_bags, num_ids in self.parts:
            out.append(
                Bags(
                    self.ids[id_at : id_at + num_ids],
                    self.offsets[bag_at : bag_at + num_bags + 1] - id_at,
                    None if self.weights is None else self.weights[id_at : id_at + num_ids],
                )
            )
            bag_at, id_at = bag_at + num_bags, id_at + num_ids
        return out
