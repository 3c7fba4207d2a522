"""EmbeddingCollection: many tables (fixed and dynamic), several features per table."""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional, Protocol, Union

import torch
from torch import nn

from dynarec.devices import check_device
from dynarec.embedding.cached_store import CacheHold
from dynarec.embedding.config import FeatureConfig, TableConfig
from dynarec.embedding.dynamic import DynamicTable
from dynarec.embedding.grouped import DynamicTableGroup, ReducerFactory, TableGroup, group_key, packs_dims
from dynarec.embedding.jagged import (
    FeatureSlice,
    JaggedBatch,
    KeyedJaggedLike,
    as_jagged,
    checked_layout,
    split_features,
)
from dynarec.embedding.memory import check_fits
from dynarec.embedding.pack import BagLayout, Bags, unpack
from dynarec.embedding.streams import StagedInput, input_stage
from dynarec.embedding.table import EmbeddingTable, FixedTable, FoundKeys
from dynarec.optim.base import OptimizerSpec

__all__ = ["EmbeddingCollection", "check_batch", "check_stays", "checked_slices"]


def checked_slices(
    kjt: KeyedJaggedLike,
    features: Sequence[str],
    validate: Callable[[str, torch.Tensor, Optional[tuple[int, int]]], None],
    widen: bool = True,
) -> dict[str, FeatureSlice]:
    """The batch split by feature, checked where it is (a CPU batch: no device sync) before any
    table creates, evicts or updates a row: exactly the ``features`` served, ``validate(name,
    ids, id_range)`` (a table's id check; ``id_range``: the ids' ``(smallest, largest)`` where
    the batch's maker worked it out, else None), finite per-sample weights (read where the maker
    did not check them). Errors name the features. ``widen``: as :func:`split_features` (False:
    a batch checked on the host, bound for a device)."""
    slices = split_features(kjt, widen)
    stats = kjt.host_stats() if isinstance(kjt, JaggedBatch) else None
    ranges = stats.id_range_per_key if stats is not None else None
    weights_checked = stats is not None and stats.weights_finite is True
    range_of = dict(zip(kjt.keys(), ranges)) if ranges is not None else {}
    _check_names(list(slices), features)
    for name, s in slices.items():
        validate(name, s.values, range_of.get(name))
        if s.weights is not None and s.num_ids and not weights_checked and not bool(torch.isfinite(s.weights).all()):
            bad = s.weights[~torch.isfinite(s.weights)][0].item()
            raise ValueError(f"feature '{name}': per-sample weight {bad} is not a finite number")
    return slices


def check_batch(
    kjt: KeyedJaggedLike,
    features: Sequence[str],
    validate: Callable[[str, torch.Tensor, Optional[tuple[int, int]]], None],
) -> None:
    """:func:`checked_slices`' checks of a batch bound for another device, which is split there:
    without splitting it here where it carries what they read (its ids' ranges, and its weights
    found finite or none), else on its split."""
    stats = kjt.host_stats() if isinstance(kjt, JaggedBatch) else None
    if (
        stats is None
        or stats.id_range_per_key is None
        or (kjt.weights_or_none() is not None and not stats.weights_finite)
    ):
        checked_slices(kjt, features, validate, widen=False)
        return
    keys, values, *_ = checked_layout(kjt)
    _check_names(keys, features)
    unsplit = values[:0]  # (validate reads a given range, not the ids: EmbeddingTable.validate)
    for name, id_range in zip(keys, stats.id_range_per_key):
        validate(name, unsplit, id_range)


def _check_names(keys: Sequence[str], features: Sequence[str]) -> None:
    """ValueError naming the batch's features that no table serves, or the served ones it lacks."""
    served, given = set(features), set(keys)  # (every step: not a list's scan a feature)
    unknown = [k for k in keys if k not in served]
    if unknown:
        raise ValueError(f"batch feature(s) {unknown} are not served by any table; known: {list(features)}")
    missing = [f for f in features if f not in given]
    if missing:
        raise ValueError(f"batch is missing feature(s) {missing}")


def _keys_without_room(
    where: str, left_out: int, dump: Mapping[str, torch.Tensor], table: EmbeddingTable, loaded: bool = False
) -> str:
    """The error of a dynamic table's dump with more keys than its ``max_capacity`` places
    (``loaded``: found as it loaded, the others kept)."""
    dynamic = table.config.dynamic
    assert dynamic is not None
    then = "the table holds the others" if loaded else "no table was loaded"
    return (
        f"{where}: {left_out} of its {dump['keys'].numel()} keys {'found' if loaded else 'would find'} no row "
        f"(max_capacity {dynamic.max_capacity}); {then}: give the table a max_capacity that holds them"
    )


def _build_table(
    config: TableConfig, spec: OptimizerSpec, device: torch.device, row_reducers: Optional[ReducerFactory]
) -> EmbeddingTable:
    """A table looked up on its own (``row_reducers``: see :class:`EmbeddingCollection`)."""
    if config.kind == "fixed":
        reducer = row_reducers(config.name, int(config.num_embeddings)) if row_reducers else None  # type: ignore[arg-type]
        return FixedTable(config, spec, device, grad_reducer=reducer)
    if row_reducers is not None:
        raise ValueError(
            f"table '{config.name}': a dynamic table cannot be data-parallel (its replicas would hold different "
            "keys); shard it by key_hash"
        )
    return DynamicTable(config, spec, device)


def check_stays(fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device, tables: Sequence[str]) -> None:
    """Refuses what ``nn.Module._apply`` would do with ``fn`` (``.to()``, ``.cuda()``,
    ``.double()``, ...) where it moves tensors off ``device`` or changes a float32 tensor's
    dtype: a collection's tables are built for their device and keep their rows' storage type,
    and a silent no-op would leave a model's embeddings where its dense layers are not."""
    probe = torch.empty(0, device=device)
    moved = fn(probe)
    if moved.device != probe.device or moved.dtype != probe.dtype:
        raise RuntimeError(
            f"the embedding tables {list(tables)} stay where they were built ({device}, float32 outputs; rows in "
            f"each table's data_type): moving them to {moved.device} / {moved.dtype} is not supported; build the "
            "collection with device=... (and data_type per table), or move only the dense layers"
        )


def warn_if_replicated(tables: Sequence[str]) -> None:
    """Warns where this process is one of several of a ``torch.distributed`` job: a collection's
    tables are this process's own, and DistributedDataParallel does not synchronize them (they
    are not parameters), so each rank's rows would drift apart."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        warnings.warn(
            f"an EmbeddingCollection trains in a job of {dist.get_world_size()} processes: its tables {list(tables)} "
            "are this process's own, and DistributedDataParallel does not synchronize them (they are not "
            "parameters), so each rank's rows drift apart. Shard them with "
            "dynarec.distributed.ShardedEmbeddingCollection (as `dynarec train` under torchrun does), unless each "
            "process trains a model of its own.",
            stacklevel=4,
        )


class TableFreezing:
    """``requires_grad_(False)`` freezes a collection's tables (an ``nn.Module`` mixin): in
    training mode it then looks up as in evaluation (no step, no new key, no update) until
    ``requires_grad_(True)``, whatever ``train()``/``eval()`` do meanwhile. torch keeps the flag on
    parameters, and a collection has none: ``model.requires_grad_(False)`` of a model holding a
    collection does not reach it; call it on the collection."""

    frozen = False

    def requires_grad_(self, requires_grad: bool = True):
        super().requires_grad_(requires_grad)  # type: ignore[misc]
        for module in self.modules():  # type: ignore[attr-defined]
            if isinstance(module, TableFreezing):
                module.frozen = not requires_grad
        return self

    @property
    def trains_tables(self) -> bool:
        """Whether a forward is a training step of the tables: training mode, not frozen."""
        return self.training and not self.frozen  # type: ignore[attr-defined]


class LookupUnit(Protocol):
    """What a collection looks up as one: a table, a :class:`TableGroup` of fixed tables or a
    :class:`DynamicTableGroup` of dynamic ones."""

    name: str

    def pack(self, slices: Mapping[str, FeatureSlice]) -> tuple[Bags, BagLayout]: ...
    def find(self, bags: Bags) -> Optional[FoundKeys]: ...
    def stage_rows(self, bags: Bags, found: Optional[FoundKeys] = None) -> Optional[CacheHold]: ...
    def lookup(
        self, bags: Bags, train: bool, found: Optional[FoundKeys] = None, hold: Optional[CacheHold] = None
    ) -> torch.Tensor: ...
    def begin_step(self) -> object: ...
    def abort_step(self) -> None: ...
    def commit_pending(self) -> None: ...


@dataclass
class _Prepared:
    """A batch's input stage (:meth:`EmbeddingCollection.prefetch`): its packed bags, finds and
    holds of rows made resident (tables in host memory) per table, and what the main stream
    takes before using them."""

    kjt: KeyedJaggedLike
    packed: dict[str, tuple[Bags, BagLayout]]
    found: dict[str, Optional[FoundKeys]]
    staged: StagedInput
    holds: dict[str, Optional[CacheHold]] = field(default_factory=dict)

    def covers(self, names: Iterable[str]) -> bool:
        """Whether the stage was run for the units ``names`` (at least)."""
        return all(name in self.packed for name in names)

    def release(self) -> None:
        """Lets the rows made resident go (once the lookup has its own stamps on them)."""
        for hold in self.holds.values():
            if hold is not None:
                hold.release()


class EmbeddingCollection(TableFreezing, nn.Module):
    """Looks up every configured feature of a KeyedJaggedTensor-shaped batch.

    Args:
        tables: the tables; feature names must be unique across tables.
        optimizer: the sparse optimizer of every table without its own ``TableConfig.optimizer``.
        device: where the tables live.
        memory_budget: bytes the tables may take at their largest (default: the memory available
            on ``device``); more is refused before anything is allocated.
        prefetch_depth: how many batches :meth:`prefetch` keeps ready (default 2 on a GPU: a
            batch's copy and finds then get a whole step to finish; 1 elsewhere, where a stage
            runs in place and a find made two steps ahead is redone more often).
        group_tables: fixed float32 tables of one optimizer spec on the native backend share one
            row store, looked up and updated once a step for all of them
            (:class:`~dynarec.embedding.grouped.TableGroup`; the results are the same either
            way, within float32 summation order, but for a step whose loss leaves out a
            table's features: see :mod:`~dynarec.embedding.grouped`): tables of one dim on any device, tables of
            several dims packed end to end where the kernels take them (a GPU). So do dynamic
            tables of one dim, spec, bucket size and score strategy that never grow, with
            admission or without (:class:`~dynarec.embedding.grouped.DynamicTableGroup`: their
            indexes are one index's partitions, found and inserted into once a step; each
            keeps its own keys and admission counter).
        row_reducers: data-parallel tables (a sharded run's replicas): ``row_reducers(name,
            rows)`` gives each native fixed store the reducer that sums its row gradients over
            the ranks before the update (see :class:`~dynarec.embedding.row_store.NativeRowStore`).

    ``forward(kjt)`` returns ``{feature: tensor}``: ``[B, D]`` for pooled features (sum or mean)
    and ``[B, L, D]`` for sequence features (pooling ``none``), zero-padded to the batch's longest
    sequence; a sample's length is in ``kjt.lengths()``. In training mode, backward applies each
    table's fused optimizer to the touched rows (no dense optimizer is involved: the collection
    has no parameters; ``requires_grad_(False)`` freezes the tables: :class:`TableFreezing`);
    per-sample weights that require grad get their gradient (the rows as the
    forward read them), as a position-weighted feature's learned weights need.
    """

    _replicas_checked = False  # (a collection pickled before this flag existed)
    _inputs_checked = False  # (inputs_checked)
    _given: Mapping[str, tuple[torch.Tensor, BagLayout]] = {}  # (inputs_checked)

    def __init__(
        self,
        tables: Sequence[TableConfig],
        optimizer: Optional[OptimizerSpec] = None,
        device: torch.device | str = "cpu",
        memory_budget: Optional[int] = None,
        prefetch_depth: Optional[int] = None,
        group_tables: bool = True,
        row_reducers: Optional[ReducerFactory] = None,
    ):
        super().__init__()
        self.device = torch.device(device)
        if self.device.type == "cuda":
            check_device(str(self.device), f"EmbeddingCollection(device='{self.device}')")  # not torch's assertion
        if prefetch_depth is not None and prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be at least 1, got {prefetch_depth}")
        self.prefetch_depth = prefetch_depth or (2 if self.device.type == "cuda" else 1)
        self._prefetched: deque[_Prepared] = deque()
        self.tables: dict[str, EmbeddingTable] = {}
        self._features: dict[str, tuple[EmbeddingTable, FeatureConfig]] = {}
        specs: dict[str, OptimizerSpec] = {}
        for config in tables:
            if config.name in specs:
                raise ValueError(f"table '{config.name}' is configured twice")
            spec = config.optimizer or optimizer
            if spec is not None and not isinstance(spec, OptimizerSpec):
                raise ValueError(
                    f"table '{config.name}': the optimizer must be an OptimizerSpec (e.g. dynarec.optim.SGD(lr=0.1)), "
                    f"got {spec!r}"
                )
            if spec is None:
                raise ValueError(
                    f"table '{config.name}' has no optimizer: give the collection one or the table its own"
                )
            specs[config.name] = spec
        # Before allocating anything: the tables at their largest must fit the device's memory.
        check_fits([(c, specs[c.name]) for c in tables], self.device, memory_budget)
        # Fixed tables of one optimizer spec (and one dim, where rows of several dims cannot be
        # packed) share a row store and a lookup (TableGroup), as do dynamic tables that never
        # grow (DynamicTableGroup; not data-parallel: _build_table refuses those); the others are
        # looked up on their own. Units keep the tables' order.
        groups: dict[tuple, list[TableConfig]] = {}
        if group_tables:
            for config in tables:
                spec = specs[config.name]
                key = group_key(config, spec, packs_dims(spec, self.device, row_reducers is not None))
                if key is not None and not (config.dynamic is not None and row_reducers is not None):
                    groups.setdefault(key, []).append(config)
        grouped = {c.name: members for members in groups.values() if len(members) > 1 for c in members}
        self._units: list[LookupUnit] = []
        for config in tables:
            members = grouped.get(config.name)
            if members is None:
                table = _build_table(config, specs[config.name], self.device, row_reducers)
                self._units.append(table)
                self._add(table)
            elif config is members[0]:  # the others are built with the group's first table
                group: Union[TableGroup, DynamicTableGroup]
                if config.dynamic is None:
                    group = TableGroup(members, specs[config.name], self.device, row_reducers)
                else:
                    group = DynamicTableGroup(members, specs[config.name], self.device)
                self._units.append(group)
                for member in group.tables:
                    self._add(member)
        self.tables = {c.name: self.tables[c.name] for c in tables}  # in the configured order
        # A trainer of several processes must share the tables' updates; checked at the first
        # training lookup (serving and evaluation in such a job are fine).
        self._replicas_checked = row_reducers is not None

    def _add(self, table: EmbeddingTable) -> None:
        self.tables[table.name] = table
        config = table.config
        for feature in config.feature_configs:
            if feature.name in self._features:
                raise ValueError(
                    f"feature '{feature.name}' is served by tables "
                    f"'{self._features[feature.name][0].name}' and '{config.name}'"
                )
            self._features[feature.name] = (table, feature)

    @property
    def lookup_groups(self) -> list[tuple[str, ...]]:
        """The tables of each lookup a step makes, in order: several names for a
        :class:`TableGroup` or :class:`DynamicTableGroup` (one shared row store), one for a table
        looked up on its own."""
        return [
            tuple(t.name for t in u.tables) if isinstance(u, (TableGroup, DynamicTableGroup)) else (u.name,)
            for u in self._units
        ]

    @property
    def feature_names(self) -> list[str]:
        return list(self._features)

    def table_of(self, feature: str) -> EmbeddingTable:
        return self._features[feature][0]

    def prefetch(
        self, kjt: KeyedJaggedLike, ready: Optional[torch.cuda.Event] = None, units: Optional[Sequence[str]] = None
    ) -> None:
        """Runs the input stage of ``kjt``, a batch of a coming forward, now: its checks, its
        copy to the device, its packing and the dynamic tables' hash finds. Call it once this
        step's backward is queued: on a GPU the host's part then overlaps the backward, the copy
        and the finds run on the input stream beside it, and the batch's forward reads the
        finds' answer without waiting. A batch already on the GPU is read once the work that
        made it is done: give ``ready``, a CUDA event recorded after it was made (on any
        stream; the stage's stream records its use of the batch's tensors), or the stage waits
        for all the work queued so far on the current stream, this step's backward included
        (its checks and finds then run after it, not beside it).

        Up to :attr:`prefetch_depth` batches are kept (the oldest is dropped), each for the
        forward of that very batch object: a forward of one of them drops those prefetched
        before it; a forward of another batch (an evaluation between training steps) leaves
        them.

        A find made ahead holds while the table only gains keys in free slots; where it may
        not (the table grew, evicted, moved or removed keys, was loaded, an aborted step was
        undone, or an absent key may have been inserted since), the forward finds again. A
        table whose rows live in host memory makes the batch's rows resident in its device
        cache here too (:meth:`EmbeddingTable.stage_rows`): on a GPU they move beside this step.
        A batch the checks refuse is left to its own forward, which raises the error.

        ``units`` (names of :attr:`units`): the stage of those alone, for :meth:`lookup_units`
        (a step replayed from CUDA graphs, which look the others up themselves); a forward of
        the batch runs the whole stage again."""
        try:
            prepared = self._prepare(kjt, ready, ahead=True, units=units)
        except Exception:  # its own forward raises it, at its own step
            return
        self._prefetched.append(prepared)
        while len(self._prefetched) > self.prefetch_depth:
            self._prefetched.popleft()

    def _take_prefetched(self, kjt: KeyedJaggedLike) -> Optional[_Prepared]:
        """The prefetched stage of ``kjt``, dropping those before it; None (keeping them all:
        an eval forward between training steps) where ``kjt`` was not prefetched."""
        for i, prepared in enumerate(self._prefetched):
            if prepared.kjt is kjt:
                for _ in range(i + 1):
                    self._prefetched.popleft()
                return prepared
        return None

    def _prepare(
        self,
        kjt: KeyedJaggedLike,
        ready: Optional[torch.cuda.Event] = None,
        ahead: bool = False,
        units: Optional[Sequence[str]] = None,
    ) -> _Prepared:
        """Stage 1, before any table writes: on the input stream (CUDA) the checks, the copy, the
        packing and the hash finds run beside the main stream's work (see :mod:`.streams`;
        ``ready``: the event after a device batch was made); ``ahead`` (a batch of a coming
        step), the rows of tables in host memory are made resident too. The checks run there
        too: a device batch's id conversions and the host reads of its checks then follow its
        ``ready`` event, not the main stream's backward. ``units``: those units' stage alone
        (default: every unit's)."""
        selected = [unit for unit in self._units if units is None or unit.name in units]
        values = kjt.values()
        with input_stage(self.device, batch_on_host=values.device.type == "cpu", ready=ready) as staged:
            staged.reads(values, kjt.lengths(), kjt.weights_or_none())
            if values.device != self.device:  # checked here; one copy of each of its tensors, split there
                self.check(kjt)
                slices = split_features(as_jagged(kjt).to(self.device, non_blocking=True))
            else:
                slices = checked_slices(kjt, list(self._features), self._validate)
            packed = {unit.name: unit.pack(slices) for unit in selected}
            found = {unit.name: unit.find(packed[unit.name][0]) for unit in selected}
            holds = {}
            if ahead:
                holds = {unit.name: unit.stage_rows(packed[unit.name][0], found[unit.name]) for unit in selected}
            staged.hand_over(*(t for s in slices.values() for t in (s.values, s.lengths, s.weights)))
            staged.hand_over(*(t for bags, _ in packed.values() for t in (bags.ids, bags.offsets, bags.weights)))
            staged.hand_over(*(t for f in found.values() if f is not None for t in f.tensors))
            staged.hand_over(*(h.slots for h in holds.values() if h is not None))
        return _Prepared(kjt, packed, found, staged, holds)

    @property
    def units(self) -> list[LookupUnit]:
        """The lookups a step makes, in order: a :class:`TableGroup` or
        :class:`DynamicTableGroup`, or a table looked up on its own."""
        return list(self._units)

    def check(self, kjt: KeyedJaggedLike) -> None:
        """The checks :meth:`forward` makes of a batch before any table writes (its features,
        layout and ids, named in the errors), on the batch where it is (no device read for a
        batch on the host that carries its id ranges), without looking anything up."""
        check_batch(kjt, list(self._features), self._validate)

    def _validate(self, feature: str, ids: torch.Tensor, id_range: Optional[tuple[int, int]]) -> None:
        self._features[feature][0].validate(feature, ids, id_range)

    @contextlib.contextmanager
    def inputs_checked(self, given: Mapping[str, tuple[torch.Tensor, BagLayout]] = {}) -> Iterator[None]:
        """Within it, :meth:`forward` takes batches already on this device and checked (by
        :meth:`check`, on the host): split as they are, with no check, no input stream and
        nothing prefetched; nothing it runs reads the device. ``given``: the units (by name)
        looked up already, each its output and layout (:meth:`lookup_units`'s): their features
        are read from it, their tables neither packed nor looked up. A training step captured in
        a CUDA graph is looked up so (``dynarec.train.step_graph``)."""
        self._inputs_checked, self._given = True, given
        try:
            yield
        finally:
            self._inputs_checked, self._given = False, {}

    def prefetched(self, kjt: KeyedJaggedLike, names: Sequence[str]) -> bool:
        """Whether the input stage of ``kjt`` was run ahead (:meth:`prefetch`) for the units
        ``names`` (:attr:`units`' names) at least, and is kept."""
        return any(p.kjt is kjt and p.covers(names) for p in self._prefetched)

    def lookup_units(self, kjt: KeyedJaggedLike, names: Sequence[str]) -> dict[str, tuple[torch.Tensor, BagLayout]]:
        """The lookups of the units ``names`` (:attr:`units`' names) alone: ``{name: (output,
        layout)}``, of a batch whose stage was run ahead for them (:meth:`prefetched`: its packed
        bags and finds are taken from there), else of a batch on this device and checked
        (:meth:`check`). In training, as in :meth:`forward`, each unit's step is opened (aborted
        again where one of them raises) and its output's backward is its update. A step replayed
        from CUDA graphs looks up so the units it does not capture, and gives their outputs to
        the graph (:meth:`inputs_checked`)."""
        prepared = self._take_prefetched(kjt)
        if prepared is not None and prepared.covers(names):
            prepared.staged.take()
            try:
                return self._pooled({n: prepared.packed[n] for n in names}, prepared.found, prepared.holds)[0]
            finally:
                prepared.release()
        if prepared is not None:  # (the stage of other units: its rows made resident let go)
            prepared.release()
        slices = split_features(kjt)
        packed = {unit.name: unit.pack(slices) for unit in self._units if unit.name in names}
        found = {unit.name: unit.find(packed[unit.name][0]) for unit in self._units if unit.name in packed}
        return self._pooled(packed, found)[0]

    def forward(self, kjt: KeyedJaggedLike) -> dict[str, torch.Tensor]:
        if self._inputs_checked:
            return self.lookup_slices(split_features(kjt))
        prepared = self._take_prefetched(kjt)
        if prepared is not None and not prepared.covers(u.name for u in self._units):  # (some units' alone)
            prepared.release()
            prepared = None
        if prepared is None:
            prepared = self._prepare(kjt)
        prepared.staged.take()
        try:
            return self._lookup(prepared.packed, prepared.found, prepared.holds)
        finally:
            prepared.release()  # the lookup's own stamps keep its rows from here

    def lookup_slices(self, slices: Mapping[str, FeatureSlice]) -> dict[str, torch.Tensor]:
        """The forward of features already split, checked and on the device (a sharded
        collection's replicated tables); ``slices`` may hold other features too."""
        units = [unit for unit in self._units if unit.name not in self._given]
        packed = {unit.name: unit.pack(slices) for unit in units}
        found = {unit.name: unit.find(packed[unit.name][0]) for unit in units}
        return self._lookup(packed, found)

    def _lookup(
        self,
        packed: Mapping[str, tuple[Bags, BagLayout]],
        found: Mapping[str, Optional[FoundKeys]],
        holds: Mapping[str, Optional[CacheHold]] = {},
    ) -> dict[str, torch.Tensor]:
        """Stages 2 and 3 of every unit, as one training step of every table (or none); the
        units of ``inputs_checked(given)`` read from their given outputs."""
        if self.trains_tables and not self._replicas_checked:
            self._replicas_checked = True
            warn_if_replicated(list(self.tables))
        pooled, begun = self._pooled(packed, found, holds)
        out: dict[str, torch.Tensor] = {}
        for unit in self._units:
            out.update(unpack(*(self._given[unit.name] if unit.name in self._given else pooled[unit.name])))
        if self.trains_tables and not torch.is_grad_enabled():  # no backward will come to commit it
            for unit in begun:
                unit.commit_pending()
        return out

    def _pooled(
        self,
        packed: Mapping[str, tuple[Bags, BagLayout]],
        found: Mapping[str, Optional[FoundKeys]],
        holds: Mapping[str, Optional[CacheHold]] = {},
    ) -> tuple[dict[str, tuple[torch.Tensor, BagLayout]], list[LookupUnit]]:
        """Stage 2 of the units ``packed`` holds, in order: ``({name: (output, layout)}, the
        units whose training step it opened)``; where one raises, the steps opened are aborted
        (the step never happened, on any table)."""
        out: dict[str, tuple[torch.Tensor, BagLayout]] = {}
        begun: list[LookupUnit] = []
        try:
            for unit in self._units:
                if unit.name not in packed:
                    continue
                if self.trains_tables:
                    unit.begin_step()
                    begun.append(unit)
                bags, layout = packed[unit.name]
                out[unit.name] = (unit.lookup(bags, self.trains_tables, found[unit.name], holds.get(unit.name)), layout)
        except BaseException:
            for unit in reversed(begun):
                unit.abort_step()
            raise
        return out, begun

    def abort_step(self) -> None:
        """Undoes the last training forward on every table (its backward will not run, e.g. its
        loss was NaN): rows it created, keys it evicted, admission counts, growth, step counts."""
        if self.frozen:  # its forwards began no step
            return
        for table in reversed(list(self.tables.values())):
            table.abort_step()

    def read_rows(self, table: str, ids) -> dict[str, torch.Tensor]:
        """Weights and optimizer states at ``ids`` (row ids of a fixed table, keys of a dynamic
        one; a dynamic table adds a ``present`` mask)."""
        return self._table(table).read_rows(ids)

    def write_rows(self, table: str, ids, values: dict[str, torch.Tensor]) -> None:
        self._table(table).write_rows(ids, values)

    def set_learning_rate(self, lr: float, table: Optional[str] = None) -> None:
        """Sets the current learning rate of one table, or of every table."""
        for t in [self._table(table)] if table is not None else self.tables.values():
            t.set_learning_rate(lr)

    def extra_repr(self) -> str:
        """A line a table, as ``print(model)`` shows it: rows (a dynamic table's keys held of its
        capacity), dim, row dtype, features, optimizer, and the device."""
        lines = [f"device={self.device}"]
        for name, t in self.tables.items():
            c = t.config
            rows = f"dynamic {t.size}/{t.capacity} keys" if isinstance(t, DynamicTable) else f"{c.num_embeddings} rows"
            features = ", ".join(f.name for f in c.feature_configs)
            lines.append(f"({name}): {rows} x {c.dim} {c.data_type} [{features}] {t.spec!r}")
        return "\n".join(lines)

    def _apply(self, fn, recurse: bool = True):
        check_stays(fn, self.device, list(self.tables))
        return super()._apply(fn, recurse)

    # -- torch's module state: the tables travel in state_dict() ---------------------------------

    def _save_to_state_dict(self, destination, prefix: str, keep_vars: bool) -> None:
        """Every table's :meth:`~EmbeddingTable.dump` as ``{prefix}tables.{table}.{field}``: its
        weights, optimizer states and step (a dynamic table's keys, scores and bucket layout too),
        as CPU copies. So the ``state_dict()`` of any module holding this collection carries its
        embeddings (torchrec's ``embedding_bags.{table}.weight``), and ``load_state_dict`` on a
        collection of the same tables restores them exactly. Refused while a training step is
        pending (StepPendingError): its new keys and step count are in the tables, its update is
        not, and a snapshot between the two would restore neither state."""
        for table in self.tables.values():
            table.steps.check_idle("state_dict")
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, table in self.tables.items():
            for key, value in table.dump().items():
                destination[f"{prefix}tables.{name}.{key}"] = value

    def _load_from_state_dict(
        self, state_dict, prefix: str, local_metadata, strict: bool, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        """Loads each table from its ``{prefix}tables.{table}.*`` entries (:meth:`_save_to_state_dict`).
        A table without entries is a missing key (``tables.{table}.weight``); entries of a table
        this collection lacks are unexpected keys; a dump that does not fit its table (another
        dim or row count, a malformed dynamic table's keys) is an error naming the table, checked
        for every table before any table is loaded (none is then), as is a dynamic table that
        could not keep every key (its ``max_capacity`` is smaller). A dump of another
        optimizer's table (states this table does not keep or keeps at another width: Adam's
        ``momentum1`` would train on as Adagrad's accumulator, Adagrad's as RowWiseAdagrad's; or
        none of this optimizer's: an SGD table's) loads its weights alone, this optimizer's
        states afresh and the step at 0, its states reported as unexpected keys and the states it
        lacks as missing ones: ``strict=False`` is a warm start, a strict load raises torch's
        error naming them (having loaded, as torch does for any unexpected key)."""
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        for table in self.tables.values():  # before any table changes
            table.steps.check_idle("load_state_dict")
        head = f"{prefix}tables."
        ours = [k for k in state_dict if k.startswith(head)]
        dumps: dict[str, dict[str, torch.Tensor]] = {name: {} for name in self.tables}
        by_length = sorted(self.tables, key=len, reverse=True)  # "a.b.weight": table "a.b" before "a"
        for key in ours:
            if key in unexpected_keys:  # the base class flags every key of no parameter or buffer
                unexpected_keys.remove(key)
            rest = key[len(head) :]
            name = next((n for n in by_length if rest.startswith(f"{n}.")), None)
            if name is None:
                unexpected_keys.append(key)
            else:
                dumps[name][rest[len(name) + 1 :]] = state_dict[key]
        missing_keys.extend(f"{head}{name}.weight" for name, dump in dumps.items() if not dump)
        dumps = {name: dump for name, dump in dumps.items() if dump}
        # Every table's dump is checked before any table is loaded: one that does not fit (another
        # dim, say) leaves every table as it was, and is the one error named.
        weights_only: dict[str, bool] = {}
        errors = len(error_msgs)  # (other modules' come first)
        for name, dump in dumps.items():
            table = self.tables[name]
            foreign, lacking = table.foreign_fields(dump), table.lacking_states(dump)
            try:
                table.check_dump(dump, weights_only=bool(foreign or lacking))
            except ValueError as e:
                error_msgs.append(f"{head}{name}: {e}")
                continue
            if isinstance(table, DynamicTable) and (left_out := table.keys_without_room(dump)):
                error_msgs.append(_keys_without_room(f"{head}{name}", left_out, dump, table))
                continue
            # Another optimizer's table: its weights alone (this optimizer's states afresh), its
            # states unexpected keys and ours it lacks missing ones (strict: torch's error naming
            # them, as for any such key).
            weights_only[name] = bool(foreign or lacking)
            if foreign or lacking:
                states = [s.name for s in table.spec.state_specs() if s.name in dump]
                unexpected_keys.extend(f"{head}{name}.{f}" for f in sorted({*foreign, *states}))
                missing_keys.extend(f"{head}{name}.{f}" for f in lacking)
        if len(error_msgs) > errors:
            return
        for name, dump in dumps.items():
            try:
                report = self.tables[name].load(dump, weights_only=weights_only[name])
            except ValueError as e:
                error_msgs.append(f"{head}{name}: {e}")
                continue
            if report["dropped"]:  # (a group's shared index places its keys as it loads them)
                error_msgs.append(
                    _keys_without_room(f"{head}{name}", report["dropped"], dump, self.tables[name], loaded=True)
                )

    def _table(self, name: str) -> EmbeddingTable:
        if name not in self.tables:
            raise KeyError(f"no table named '{name}'; tables: {list(self.tables)}")
        return self.tables[name]
