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

A :class:`DynamicTableGroup` does it for dynamic tables of one dim, spec, bucket size and score
strategy that never grow (``init_capacity`` at ``max_capacity``: their slots are rows of the
shared store for good), float32 rows on the native backend, with admission or without. Their
hash indexes are the partitions of one index (:class:`~dynarec.embedding.hash_index.IndexStorage`:
each table's keys in its own buckets, a slot of it a row of the store), so a step makes one find,
one insert plan and commit, one pooled lookup and one fused update (which writes the scores)
for all its tables, whatever their number; each table keeps its own keys, evictions, moves,
pins, counters, ``check_mode`` and admission counter. A key without a row (evaluation, a
dropped key, a key not yet admitted) adds its table's eval (or admission) initializer to its
bag, as a table alone does.

The grouping changes no result beyond float32 summation order: a row's update depends only on
its own aggregated gradient and the table's learning rate and step counter, each bag pools in
the same order, and a partition's plan is the plan of its table alone (``dynarec.kernels.ops``).
Where the tables' learning rates or step counters differ (one was set or loaded apart from the
others), the group looks each table up on its own for that step. One difference stays: the
group's update reaches every row its step looked up, with a zero gradient where the loss left out
every feature of a table (as FBGEMM TBE and torchrec, whose outputs are one tensor, do), where a
table alone then gets no backward. A zero gradient moves a row under Adam (its moments) and
weight decay only; SGD and Adagrad train as apart.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

import dynarec.kernels.ops
from dynarec.embedding.cached_store import CacheHold
from dynarec.embedding.capacity import whole_buckets
from dynarec.embedding.config import Pooling, TableConfig
from dynarec.embedding.dynamic import (
    AbsentKeys,
    DynamicTable,
    move_rows,
    present_bags,
    refuse_moved_rows,
)
from dynarec.embedding.hash_index import IndexStamp, IndexStorage
from dynarec.embedding.insert_plan import InsertPlan
from dynarec.embedding.jagged import FeatureSlice
from dynarec.embedding.pack import BagLayout, Bags, pack
from dynarec.embedding.row_store import PackedRowStore, RowStoreSlice
from dynarec.embedding.scores import ScorePolicy
from dynarec.embedding.step import Step
from dynarec.embedding.table import EmbeddingTable, FixedTable, FoundKeys, commit_on_backward
from dynarec.kernels.reference import bags_of_ids, uniform_salt
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
    group too (the tile and the spec), else the dim and the spec; dynamic tables: the dim, the
    spec, the bucket size and the score strategy (their indexes are one index's partitions, and
    one plan evicts, or not, for all)."""
    if config.backend != "native" or config.data_type != "fp32":
        return None
    if config.cache_load_factor is not None:  # its rows live in host memory, behind its own cache
        return None
    if config.dynamic is not None:
        d = config.dynamic
        grows = whole_buckets(d.init_capacity, d.bucket_size) < whole_buckets(d.max_capacity, d.bucket_size)  # type: ignore[arg-type]
        if grows:
            return None
        return ("dynamic", config.dim, spec, d.bucket_size, d.score_strategy)
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
    _kept_shifts: dict[tuple, torch.Tensor]  # _shift's read by captured CUDA graphs (never dropped)

    def begin_step(self) -> None:
        """Opens a step of every table, with one id (a group's plan pins its rows for all)."""
        step_id = max(t.steps.last_id for t in self.tables) + 1
        for t in self.tables:
            t.begin_step(step_id)

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
        features, dims, ends = self._features
        inputs = [(name, pooling, slices[name]) for name, pooling in features]
        counts = [s.num_ids for _, _, s in inputs]
        bags, layout = pack(inputs, dims if dims_apart else None)
        bag_ends = [0, *itertools.accumulate(f.num_bags for f in layout.features)]
        id_ends = [0, *itertools.accumulate(counts)]
        parts = tuple((bag_ends[b] - bag_ends[a], id_ends[b] - id_ends[a]) for a, b in itertools.pairwise(ends))
        return bags, layout, counts, parts

    @functools.cached_property
    def _features(self) -> tuple[list[tuple[str, Pooling]], list[int], list[int]]:
        """Every table's features in order: ``(name, pooling)`` and dim of each, and where each
        table's begin and end in that list (``[0, ..., number of features]``)."""
        features = [(f.name, t.config.pooling_of(f)) for t in self.tables for f in t.features]
        dims = [t.config.dim for t in self.tables for _ in t.features]
        return features, dims, [0, *itertools.accumulate(len(t.features) for t in self.tables)]

    def _shift(self, bases: list[int], counts: list[int], device: torch.device) -> torch.Tensor:
        """``[sum(counts)]`` int64: ``bases[i]`` once for each of ``counts[i]`` ids (a feature's or
        table's first row, or a table's index); kept for the next batches of the same bases and
        counts (a batch of one id a feature, say: every step's), which then copy and launch
        nothing for it. Read-only: a step adds it or indexes with it."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return self._captured_shift(bases, counts, device)
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

    def _captured_shift(self, bases: list[int], counts: list[int], device: torch.device) -> torch.Tensor:
        """:meth:`_shift` inside a CUDA graph's capture, which copies nothing from the host: one
        made already (on any stream), kept for the process's life, since a graph reads it by
        address at every replay; else one built by the graph itself, which rewrites it at each
        replay. That one is not kept for other captures: graphs sharing a memory pool may reuse
        its memory while this graph is not replayed."""
        key = (tuple(bases), tuple(counts), device)
        shift = self._kept_shifts.get(key)
        if shift is None:
            made = [t for k, t in self._shifts.items() if k[:3] == key]
            if not made:
                return torch.cat([torch.full((c,), b, dtype=torch.int64, device=device) for b, c in zip(bases, counts)])
            shift = self._kept_shifts[key] = made[0]
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
        self._shifts, self._kept_shifts = {}, {}
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
        shared = self.shared_step()
        if shared is None:
            assert isinstance(bags, GroupBags)
            return self._lookup_apart(bags)
        lr, t = shared
        self.store.set_learning_rate(lr)
        out = self.store.lookup(bags.ids, bags.offsets, bags.weights, True, step=t)
        commit_on_backward(out, [(table, table.steps.current) for table in self.tables])
        return out

    def shared_step(self) -> Optional[tuple[float, int]]:
        """``(learning rate, step counter)`` where every table's are the same (of the step open,
        or before one opens): a training lookup of all the tables' rows then makes one lookup and
        one fused update at that rate and step; None where they differ (each table is looked up
        and updated as its own)."""
        rates = {t.store.lr for t in self.tables}
        counters = {t.step for t in self.tables}
        if len(rates) > 1 or len(counters) > 1:
            return None
        return rates.pop(), counters.pop()

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
    """Dynamic tables sharing one :class:`PackedRowStore` and one partitioned hash index
    (:class:`IndexStorage`, a table a partition): table ``i``'s slot ``s`` is the storage's slot
    and the store's row ``bases[i] + s``. A collection uses it where it would use one table:
    ``pack`` → ``find`` → ``lookup`` → ``unpack``, the step lifecycle over all its tables.

    A training step finds every table's keys in one find, inserts every table's new keys in one
    plan and one commit (each table's keys in its own buckets: its own evictions, moves and
    pins), pools every table's rows in one lookup and updates them, with their scores, in one
    pass. Each table keeps its admission counter, its counters and its ``check_mode``; a step
    whose tables differ in step or learning rate looks each table up on its own. Its tables'
    steps open, commit and abort together (the collection's ``abort_step`` aborts every table):
    the changes of the group's one insert to the shared index and rows are journaled in its
    first table's step, each table's counters and admission counts in its own."""

    def __init__(self, configs: Sequence[TableConfig], spec: OptimizerSpec, device: torch.device):
        keys = {group_key(c, spec) for c in configs}
        if len(keys) != 1 or None in keys or configs[0].dynamic is None:
            raise ValueError(f"tables {[c.name for c in configs]} differ in dim, kind or options: no group")
        options = configs[0].dynamic
        slots = []  # each table's, for good: it never grows
        for c in configs:
            assert c.dynamic is not None
            slots.append(whole_buckets(c.dynamic.max_capacity, c.dynamic.bucket_size))
        self.name = "+".join(c.name for c in configs)
        self.store = PackedRowStore([(n, configs[0].dim) for n in slots], spec, device)
        indexes = IndexStorage.partitions([n // options.bucket_size for n in slots], options.bucket_size, device)
        #: The tables' shared hash index: table ``i`` is its partition ``i``.
        self.index = indexes[0].storage
        self.tables: list[DynamicTable] = []
        self.bases: list[int] = []
        self._shifts, self._kept_shifts = {}, {}
        base = 0
        for i, (config, n) in enumerate(zip(configs, slots)):
            table = DynamicTable(config, spec, device, store=RowStoreSlice(self.store, i), index=indexes[i])
            self.tables.append(table)
            self.bases.append(base)
            assert self.index.first_slot(i) == base  # a slot is a row of the store
            base += n
        self.score_policy = ScorePolicy(options.score_strategy, self._current_index)  # (a method: see DynamicTable)
        self._first_slots = torch.tensor(self.bases, dtype=torch.int64, device=device)  # a table's first slot
        # The new rows' uniform initializers by bound (_init_rows): each table's class (-1: not
        # uniform), on the host and the device, and each class's bound.
        self._uniform_bounds: list[float] = []
        self._uniform_class: list[int] = []
        for t in self.tables:
            init = t.initializer
            if init.kind != "uniform":
                self._uniform_class.append(-1)
                continue
            bound = float(t.config.default_bound if init.bound is None else init.bound)
            if bound not in self._uniform_bounds:
                self._uniform_bounds.append(bound)
            self._uniform_class.append(self._uniform_bounds.index(bound))
        self._uniform_class_on = torch.tensor(self._uniform_class, dtype=torch.int64, device=device)
        # Each table's uniform-draw salt (stream 0) xor-ed with the first table's: a key xor-ed
        # with its table's fold is drawn with the first table's seed as with its own.
        self._fold_seed = configs[0].seed
        assert self._fold_seed is not None and all(c.seed is not None for c in configs)  # (a config's is set)
        fold_salt = uniform_salt(self._fold_seed, 0)
        folds = [uniform_salt(c.seed, 0) ^ fold_salt for c in configs]
        self._seed_folds = torch.tensor(folds, dtype=torch.int64, device=device)

    def _current_index(self) -> IndexStorage:
        return self.index

    # -- the three stages ----------------------------------------------------------------------

    def pack(self, slices: Mapping[str, FeatureSlice]) -> tuple[GroupBags, BagLayout]:
        """Every feature of every table as one list of bags over keys (each table's own)."""
        bags, layout, _, parts = self._pack(slices)
        return GroupBags(bags.ids, bags.offsets, bags.weights, parts), layout

    def find(self, bags: Bags) -> GroupFoundKeys:
        """Every table's keys found in one pass over the shared index (on a GPU, on any stream:
        ``IndexStorage.find_flagged``): their slots are rows of the store."""
        assert isinstance(bags, GroupBags)
        slots, absent = self.index.find_flagged(bags.ids, self._table_of_key(bags))
        return GroupFoundKeys(slots, [t.index.stamp for t in self.tables], absent)

    def _table_of_key(self, bags: GroupBags) -> torch.Tensor:
        """``[num_ids]`` int64: the table of each id (kept for batches of the same id counts)."""
        return self._shift(list(range(len(self.tables))), [n for _, n in bags.parts], bags.ids.device)

    def _still_holds(self, found: FoundKeys) -> bool:
        """Whether an earlier find gives this lookup's slots: it holds for every table."""
        if not isinstance(found, GroupFoundKeys):
            return False
        absent = found.absent_tables
        return all(t.still_holds(stamp, not a) for t, stamp, a in zip(self.tables, found.stamps, absent))

    def lookup(
        self, bags: Bags, train: bool, found: Optional[FoundKeys] = None, hold: Optional[CacheHold] = None
    ) -> torch.Tensor:
        """All tables' bags (:meth:`pack`'s) -> pooled rows ``[num_bags, D]``: every table's keys
        found (in training, new keys inserted) at once, then one lookup pools every table's rows;
        in training its backward applies the fused update once to every touched row of every
        table, sets their scores and commits each table's step. A key without a row adds its
        table's eval (in training with admission: admission) initializer to its bag."""
        assert isinstance(bags, GroupBags)
        steps = [t.steps.current for t in self.tables] if train else []
        if train and not self._in_one_step(steps):
            return self._lookup_apart(bags)
        if found is None or not self._still_holds(found):
            found = self.find(bags)
        assert isinstance(found, GroupFoundKeys)
        if train:
            rows, present = self._rows_for_training(bags, found, steps[0])
        else:
            rows, present = found.slots, [not a for a in found.absent_tables]
        offsets, weights, missing_out = bags.offsets, bags.weights, None
        if not all(present):  # keys without a row: their initializer's values, the others pooled
            missing_out, rows, offsets, weights = self._without_rows(bags, rows, present, steps)
        if not train:
            out = self.store.lookup(rows, offsets, weights, False)
        else:
            step = steps[0]  # every table's, in one: the scores written once for all
            row_scores = self.score_policy.schedule(
                rows, step, self.store.writes_row_scores and torch.is_grad_enabled()
            )
            self.store.set_learning_rate(self.tables[0].store.lr)
            out = self.store.lookup(rows, offsets, weights, True, step=step.t, row_scores=row_scores)
            if out.requires_grad:  # (the group never grows: no update to count as still to come)
                refuse_moved_rows(out, step, rows, lambda: self.index.keys, self._tables_of)
            commit_on_backward(out, list(zip(self.tables, steps)))
        return out if missing_out is None else out + missing_out

    def _tables_of(self, slots: torch.Tensor) -> str:
        """The names of the tables whose rows ``slots`` are (an error's), joined by ', '."""
        tables = torch.searchsorted(self._first_slots, slots, right=True) - 1
        return "', '".join(self.tables[i].name for i in sorted(set(tables.tolist())))

    def _in_one_step(self, steps: list[Step]) -> bool:
        """Whether the tables' steps act as one: one id and step counter, the same steps pending,
        one learning rate, and each table serving this step for the first time or each again
        (one plan's pins and moves then hold for every table)."""
        first, lead = steps[0], self.tables[0]
        pending = [s.id for s in lead.steps.pending]
        served = lead.served_step == first.id
        return all(
            s.id == first.id
            and s.t == first.t
            and t.store.lr == lead.store.lr
            and (t.served_step == first.id) == served
            and [p.id for p in t.steps.pending] == pending
            for t, s in zip(self.tables, steps)
        )

    def _lookup_apart(self, bags: GroupBags) -> torch.Tensor:
        """Each table's own training lookup of its part of ``bags`` (its step or learning rate
        differs from the others'), in the group's bag order."""
        return torch.cat([t.lookup(part, True) for t, part in zip(self.tables, bags.split())])

    def _rows_for_training(self, bags: GroupBags, found: GroupFoundKeys, step: Step) -> tuple[torch.Tensor, list[bool]]:
        """The row of every id (-1: none), absent keys inserted first (admission permitting), and
        whether each table's ids all have one: what each table's own lookup finds
        (``DynamicTable._slots_for``), for every table at once (one plan and one commit)."""
        tables, index = self.tables, self.index
        slots = found.slots
        if found.all_present:
            index.pin_later(slots, step.id)  # pins matter only to an insert while this step is pending
            for t in tables:
                t.served_step = step.id
            return slots, [True] * len(tables)
        # The keys found (-1s skipped), before inserting (as DynamicTable._slots_for_training pins)
        index.pin(slots, step.id, journal=step.journal if len(tables[0].steps.pending) > 1 else None)
        absent, key_tables, distinct = AbsentKeys.of_parts(bags.ids, slots, self._table_of_key(bags), len(tables))
        new_keys, new_tables, new_of, admitted = absent.unique, key_tables, distinct, None
        if any(t.admission is not None and n for t, n in zip(tables, distinct)):
            admitted, new_of = self._admitted(absent, distinct)
            new_keys, new_tables = new_keys[admitted], new_tables[admitted]
        present = [n == m for n, m in zip(distinct, new_of)]
        if new_keys.numel():
            new_slots, placed_of, plan = self._insert(new_keys, new_tables, new_of, step)
            present = [p and n == m for p, n, m in zip(present, placed_of, new_of)]
            if admitted is not None:
                new_slots = torch.full_like(absent.unique, -1).index_copy_(0, admitted, new_slots)
            if plan.moved_from.numel():  # cuckoo moves: the keys found in a moved row follow it
                slots = torch.ops.dynarec.follow_moves(slots, plan.moved_from, plan.moved_to)
            slots.index_copy_(0, absent.positions, new_slots[absent.inverse])
        for t in tables:
            t.served_step = step.id
        return slots, present

    def _admitted(self, absent: AbsentKeys, distinct: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Which of ``absent``'s unique keys their tables admit (indices, ascending), and how many
        a table: each table with admission counts its own keys (in its own step: its journal
        takes the counts back), with one host read for all of them."""
        keep, counting, at = [], [], 0
        for i, (table, n) in enumerate(zip(self.tables, distinct)):
            uniq, counts = absent.unique[at : at + n], absent.counts[at : at + n]
            if table.admission is None or not n:
                keep.append(torch.ones(n, dtype=torch.bool, device=uniq.device))
            else:
                keep.append(table.admission.count(uniq, counts, table.steps.current, table.pending_ids()))
                counting.append(i)
            at += n
        admitted_of = list(distinct)
        for i, n in zip(counting, torch.stack([keep[i].sum() for i in counting]).tolist()):
            admitted_of[i] = n
        admitted = torch.nonzero_static(torch.cat(keep), size=sum(admitted_of)).squeeze(1)
        return admitted, admitted_of

    def _insert(
        self, keys: torch.Tensor, key_tables: torch.Tensor, keys_of: list[int], step: Step
    ) -> tuple[torch.Tensor, list[int], InsertPlan]:
        """Gives rows to every table's new ``keys`` (unique, ordered by table, then key;
        ``keys_of``: how many a table) in one plan and commit: each table's own insert
        (``DynamicTable._insert``: pins, moves, evictions, ``check_mode``, counters, fresh rows),
        its changes journaled in the first table's step (the group's steps are undone together).
        Returns each key's slot (-1: none), how many a table placed, and the plan."""
        tables, index, journal = self.tables, self.index, step.journal
        plan = index.plan_insert(
            keys,
            key_tables,
            pinned_by=tables[0].pending_ids(),
            allow_evict=self.score_policy.evicts,  # (at max_capacity: a grouped table never grows)
            movable_pins=tables[0].movable_pins(step),
        )
        if plan.only_adds and plan.placed == keys.numel():  # counted on the host already
            placed_of, evicted_of, moved_of = keys_of, [0] * len(tables), [0] * len(tables)
        else:  # one host read for every table's counts
            counts = torch.zeros(3, len(tables), dtype=torch.int64, device=keys.device)
            counts[0].index_add_(0, key_tables, (plan.slots >= 0).long())
            for row, slots in ((1, plan.evicted_slots), (2, plan.moved_from)):
                of_slot = torch.searchsorted(self._first_slots, slots, right=True) - 1
                counts[row].index_add_(0, of_slot, torch.ones_like(of_slot))
            placed_of, evicted_of, moved_of = counts.tolist()
        for t, n, placed, evicted, moved in zip(tables, keys_of, placed_of, evicted_of, moved_of):
            t.count_insert(t.steps.current.journal, placed, n - placed, evicted, moved, depth=-1)
        move_rows(self.store, plan, journal)
        index.commit(plan, torch.zeros_like(keys), [p - e for p, e in zip(placed_of, evicted_of)], journal)
        new_slots, new_keys, new_tables = plan.slots, keys, key_tables
        if plan.placed < keys.numel():
            ok = plan.slots >= 0
            new_slots, new_keys, new_tables = plan.slots[ok], keys[ok], key_tables[ok]
        self._init_rows(new_slots, new_keys, new_tables, placed_of)
        index.pin(new_slots, step.id)
        return plan.slots, placed_of, plan

    def _init_rows(self, rows: torch.Tensor, keys: torch.Tensor, row_tables: torch.Tensor, rows_of: list[int]) -> None:
        """New rows (``rows``, of ``keys``, ``rows_of[i]`` of table ``i``'s, in table order; each
        row's table ``row_tables``): each table's initializer's weights (``RowStore.init_rows``),
        and every state at its initial value (one spec: in one op). The uniform initializers of
        one bound write in one op whatever their tables' seeds: a uniform draw hashes ``key ^
        salt(seed)``, so a table's seed folds into its keys (``key ^ salt(seed) ^ salt(seed_0)``
        drawn with ``seed_0`` is ``key`` drawn with ``seed``); the others, an op a table. No host
        read, no copy to the device."""
        rows_of_class = [0] * len(self._uniform_bounds)
        at = 0
        for t, n, c in zip(self.tables, rows_of, self._uniform_class):
            if n and c >= 0:
                rows_of_class[c] += n
            elif n:
                seed = t.config.seed
                assert seed is not None  # (a table config's is set)
                init = t.initializer
                init.write_rows(self.store.weight, rows[at : at + n], keys[at : at + n], seed, t.config.default_bound)
            at += n
        folded = None  # every new key with its table's seed folded in (drawn with _fold_seed)
        for c, n in enumerate(rows_of_class):
            if not n:
                continue
            if folded is None:
                folded = keys ^ self._seed_folds[row_tables]
            at_rows, at_keys = rows, folded
            if n < rows.numel():  # not every new row: this class's (sizes known: no host read)
                pick = torch.nonzero_static(self._uniform_class_on[row_tables] == c, size=n).squeeze(1)
                at_rows, at_keys = rows[pick], folded[pick]
            torch.ops.dynarec.uniform_rows(
                self.store.weight, at_rows, at_keys, self._fold_seed, 0, self._uniform_bounds[c]
            )
        self.store.reset_states(rows)

    def _without_rows(
        self, bags: GroupBags, rows: torch.Tensor, present: list[bool], steps: list[Step]
    ) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """What the ids without a row (``rows`` -1) of the tables not all ``present`` add to
        their bags (``[num_bags, D]``, None where their initializers are zero), and ``(rows,
        offsets, weights)`` of the bags without them."""
        bag_of_id, missing_out, at = bags_of_ids(bags.offsets, bags.ids.numel()), None, 0
        for i, (table, keys) in enumerate(zip(self.tables, bags.table_ids())):
            ids_at = slice(at, at + keys.numel())
            at += keys.numel()
            if present[i]:
                continue
            absent = rows[ids_at] < 0
            w = None if bags.weights is None else bags.weights[ids_at]
            values = table.absent_values(keys, w, absent, steps[i] if steps else None)
            if values is not None:
                if missing_out is None:
                    missing_out = values.new_zeros(bags.num_bags, self.store.dim)
                missing_out.index_add_(0, bag_of_id[ids_at][absent], values)
        rows, offsets, weights = present_bags(bags, rows, bag_of_id)
        return missing_out, rows, offsets, weights


class GroupFoundKeys(FoundKeys):
    """A :class:`DynamicTableGroup`'s find: ``slots`` ``[n]`` of the group's shared index (rows of
    its store; -1: no row), each table's index stamp then, and which tables have an absent key
    (``[T]`` on the device, read on the host when first asked)."""

    def __init__(self, slots: torch.Tensor, stamps: list[IndexStamp], absent: torch.Tensor):
        super().__init__(slots, stamps[0], absent)
        self.stamps = stamps
        self._absent_tables: Optional[list[bool]] = None

    @property
    def absent_tables(self) -> list[bool]:
        """Whether each table has a key without a row (one host read, the first time)."""
        if self._absent_tables is None:
            self._absent_tables = [bool(a) for a in self._absent.read().tolist()]
        return self._absent_tables

    @property
    def all_present(self) -> bool:
        return not any(self.absent_tables)


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
