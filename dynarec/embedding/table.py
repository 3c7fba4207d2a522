"""Embedding tables: ids -> rows of a :class:`RowStore`, in three stages.

A table serves one or more features, each with its own pooling (``sum``, ``mean``, or ``none``
for a sequence). Its forward is ``unpack(lookup(pack(features)))`` (see :mod:`.pack`): all of a
step's lookups of a table go to its row store as one list of weighted bags, so the backward
sees every occurrence of a row across all features and updates it once, with the summed
gradient.

A training forward belongs to a step of the table's :class:`StepLifecycle`: ``begin_step()``
first, then ``lookup``; the lookup output's backward commits the step, ``abort_step()`` undoes it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch

from dynarec.embedding.cached_store import CachedRowStore, CacheHold
from dynarec.embedding.config import FeatureConfig, TableConfig, cache_rows_of
from dynarec.embedding.fbgemm_store import FbgemmRowStore
from dynarec.embedding.hash_index import IndexStamp
from dynarec.embedding.initializers import Initializer
from dynarec.embedding.jagged import FeatureSlice
from dynarec.embedding.pack import BagLayout, Bags, pack
from dynarec.embedding.row_store import NativeRowStore, RowStore
from dynarec.embedding.step import Step, StepLifecycle
from dynarec.embedding.streams import HostReadback, current_stream
from dynarec.optim.base import OptimizerSpec
from dynarec.optim.fused import GradReducer
from dynarec.optim.rounding import ROW_DTYPES, RowKeys

__all__ = [
    "EmbeddingTable",
    "FixedTable",
    "FoundKeys",
    "check_id_range",
    "commit_on_backward",
    "late_backward",
    "make_row_store",
]


class FoundKeys:
    """A dynamic table's hash find for one lookup (a lookup unit's find: a group of dynamic tables
    gives one for all its tables, ``GroupFoundKeys``, its flag one a table): ``slots`` ``[n]``
    int64 (-1: no row), found in the index state ``stamp`` (the lookup finds again where the
    index changed in a way that can change the answer), and
    :attr:`all_present`, read on the host when first asked (on a GPU the flag is copied to pinned
    memory behind the find, so a find made ahead is read without waiting)."""

    def __init__(self, slots: torch.Tensor, stamp: IndexStamp, absent: Optional[torch.Tensor] = None):
        """``absent``: a tensor nonzero if a slot is -1 (``[]``; a group's ``[T]``, a table's
        each), when the find computed it."""
        self.slots = slots
        self.stamp = stamp
        absent = (slots < 0).any() if absent is None else absent
        self._absent = HostReadback(tuple(absent.shape), absent.dtype, absent.device)
        self._absent.queue(absent, current_stream(absent.device) if absent.is_cuda else None)
        self._all_present: Optional[bool] = None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The device tensors of the answer (an input stage hands them over to the main stream)."""
        return (self.slots,)

    @property
    def all_present(self) -> bool:
        """Whether every key has a row (the one host read of a warm table's lookup)."""
        if self._all_present is None:
            self._all_present = not bool(self._absent.read())
        return self._all_present


def commit_on_backward(out: torch.Tensor, steps: Sequence[tuple[EmbeddingTable, Step]]) -> None:
    """The backward of ``out`` (one lookup of these tables' rows) commits each table's ``step``
    (and its earlier pending steps), through one hook whatever the number of tables; a second
    backward through it (``retain_graph=True``) would update the rows twice and is refused, and
    so is the backward of a step that ``abort_step`` undid (its rows may hold other keys now),
    before any row is updated."""
    if out.requires_grad:
        out.register_hook(lambda grad: commit_backward(steps))


def commit_backward(steps: Sequence[tuple[EmbeddingTable, Step]]) -> None:
    """Commits each table's ``step`` (and its earlier pending steps) as its lookup's backward:
    refused, before any is committed, for a step that ``abort_step`` undid or whose backward ran
    already. :func:`commit_on_backward`'s hook, and what a step replayed from a CUDA graph does
    after its backward's replay (``dynarec.train.step_graph``)."""
    for table, step in steps:
        if step.state == "aborted":
            raise late_backward(table.name, step, "abort_step() undid that step")
        if step.backward_ran:
            raise RuntimeError(
                f"table '{table.name}': a second backward through the lookup of training step {step.t} "
                "(retain_graph=True?) would apply the fused optimizer to its rows twice; run one backward "
                "per training forward"
            )
    for table, step in steps:
        step.backward_ran = True
        table.steps.commit(step)


def late_backward(table: str, step: Step, why: str) -> RuntimeError:
    """The error of a backward that came too late to update its step's rows."""
    return RuntimeError(
        f"table '{table}': the backward of training step {step.t} came after {why}; its rows may hold other keys "
        "now, so its update is not applied (run each training forward's backward before the next forward, or "
        "abort it)"
    )


def check_id_range(
    table: str, feature: str, ids: torch.Tensor, num_rows: int, id_range: Optional[tuple[int, int]] = None
) -> None:
    """ValueError naming the table, the feature (or the call: ``read_rows``, ``write_rows``) and
    the id, for an id outside ``[0, num_rows)``. ``id_range``: ``(smallest, largest)`` of ``ids``
    where already known (the batch's host statistics; ``(0, -1)``: no ids), read instead of
    ``ids``."""
    if id_range is None:
        if ids.numel() == 0:
            return
        lo_hi = torch.aminmax(ids)
        id_range = (int(lo_hi[0]), int(lo_hi[1]))
    lo, hi = id_range
    if hi < lo:
        return
    if lo < 0 or hi >= num_rows:
        bad = lo if lo < 0 else hi
        who = feature if feature in _ROW_CALLS else f"feature '{feature}'"
        raise ValueError(f"table '{table}', {who}: id {bad} is out of range [0, {num_rows})")


# The calls that read or write rows by id (named as such, where a batch's error names its feature).
_ROW_CALLS = ("read_rows", "write_rows")


_ZERO = Initializer(kind="constant", value=0.0)


def make_row_store(
    config: TableConfig,
    spec: OptimizerSpec,
    num_rows: int,
    device: torch.device,
    grad_reducer: Optional[GradReducer] = None,
    max_rows: Optional[int] = None,
) -> RowStore:
    """The row store of ``config``'s backend; ``grad_reducer``: a data-parallel table's (the
    native backend only: FBGEMM's kernels update the rows before any reduction could run);
    ``max_rows``: the most rows it grows to (a dynamic table's; sizes a host-memory tier's
    cache), default ``num_rows``."""
    if config.backend == "fbgemm":
        if grad_reducer is not None:
            raise ValueError(f"table '{config.name}': a data-parallel table needs backend 'native'")
        return FbgemmRowStore(num_rows, config.dim, spec, device, where=f"table '{config.name}'")
    dtype, seed = ROW_DTYPES[config.data_type], int(config.seed or 0)
    if config.cache_load_factor is not None:
        if grad_reducer is not None:
            raise ValueError(
                f"table '{config.name}': a data-parallel table keeps every row on each device (cache_load_factor "
                "caches a table's own rows; shard it row_wise)"
            )
        cache_rows = cache_rows_of(max_rows or num_rows, config.cache_load_factor)
        return CachedRowStore(num_rows, config.dim, spec, device, cache_rows, config.name, dtype, seed)
    return NativeRowStore(num_rows, config.dim, spec, device, grad_reducer, dtype, rounding_seed=seed)


class EmbeddingTable(ABC):
    """Base of fixed and dynamic tables. Not an ``nn.Module``: its rows are trained by the fused
    optimizer only, so no dense optimizer can pick them up through ``parameters()``."""

    def __init__(self, config: TableConfig, spec: OptimizerSpec, device: torch.device):
        self.config = config
        self.name = config.name
        self.dim = config.dim
        self.spec = spec
        self.device = torch.device(device)
        self.features: tuple[FeatureConfig, ...] = config.feature_configs
        self.initializer = config.initializer or Initializer()
        self.eval_initializer = (config.dynamic and config.dynamic.eval_initializer) or _ZERO
        self.steps = StepLifecycle(f"table '{self.name}'")

    @property
    @abstractmethod
    def store(self) -> RowStore: ...

    # -- the training step ---------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The step counter ``t``: training steps begun and not aborted."""
        return self.steps.t

    def begin_step(self, step_id: Optional[int] = None) -> Step:
        """Opens a training step (of id ``step_id``: ``StepLifecycle.begin``); the next training
        lookup belongs to it."""
        return self.steps.begin(step_id)

    def abort_step(self) -> None:
        """Undoes the latest pending step (a forward whose backward will never run): rows it
        created, keys it evicted, admission counts, growth, and the step count."""
        self.steps.abort()

    def commit_pending(self) -> None:
        """Commits every pending step (a training forward with no backward to wait for)."""
        if self.steps.pending:
            self.steps.commit(self.steps.pending[-1])

    def _commit_on_backward(self, out: torch.Tensor, step: Step) -> None:
        commit_on_backward(out, [(self, step)])

    @property
    def learning_rate(self) -> float:
        return self.store.lr

    def set_learning_rate(self, lr: float) -> None:
        """ValueError naming the table for a rate that is negative or not a finite number."""
        try:
            value = float(lr)
        except (TypeError, ValueError, RuntimeError):
            value = math.nan
        if isinstance(lr, (bool, str)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"table '{self.name}': the learning rate must be a finite number >= 0, got {lr!r}")
        self.store.set_learning_rate(value)

    # -- the three stages ------------------------------------------------------------------------

    def pack(self, slices: Mapping[str, FeatureSlice]) -> tuple[Bags, BagLayout]:
        """Stage 1: this table's features of a batch -> weighted bags (see :func:`.pack.pack`)."""
        return pack([(f.name, self.config.pooling_of(f), slices[f.name]) for f in self.features])

    def find(self, bags: Bags) -> Optional[FoundKeys]:
        """Stage 1's end: where the rows of ``bags`` are, when the table must search for them
        (a dynamic table's hash find); None for a fixed table, whose ids are its rows. Writes
        nothing and reads nothing on the host; a collection runs it on its input stream
        (:mod:`.streams`) ahead of the lookup, possibly a step ahead (``prefetch``)."""
        return None

    def stage_rows(self, bags: Bags, found: Optional[FoundKeys] = None) -> Optional[CacheHold]:
        """Stage 1's last part, for a table whose rows live in host memory: makes the rows of
        ``bags`` (``found``: :meth:`find`'s answer) resident in its device cache ahead of their
        lookup, on the stream the stage runs on (:meth:`CachedRowStore.prefetch`). None for a
        table kept whole on its device, or where its cache cannot take them now."""
        store = self.store
        if not isinstance(store, CachedRowStore):
            return None
        rows = self._rows_of(bags, found)
        return None if rows is None else store.prefetch(rows)

    def _rows_of(self, bags: Bags, found: Optional[FoundKeys]) -> Optional[torch.Tensor]:
        """The store rows of ``bags`` where known before the lookup (for :meth:`stage_rows`)."""
        return None

    @abstractmethod
    def lookup(
        self, bags: Bags, train: bool, found: Optional[FoundKeys] = None, hold: Optional[CacheHold] = None
    ) -> torch.Tensor:
        """Stage 2: bags -> pooled rows ``[num_bags, D]``. ``found``: :meth:`find`'s answer for
        these bags, if already computed (found again if the table was written since); ``hold``:
        :meth:`stage_rows`'s (the caller releases it after the lookup).

        In training (after ``begin_step()``), creates rows as the table's kind does and makes the
        output's backward apply the fused optimizer to the touched rows and commit the step.
        """

    def validate(  # noqa: B027 - a hook: most kinds take any id
        self, feature: str, ids: torch.Tensor, id_range: Optional[tuple[int, int]] = None
    ) -> None:
        """Raises ValueError for ids this table cannot take, before anything is written
        (``id_range``: their ``(smallest, largest)`` where known, read instead of ``ids``,
        which may then be empty: a batch checked before it is split; see :func:`check_id_range`)."""

    def initial_weights(self, ids: torch.Tensor) -> torch.Tensor:
        """Key-seeded initial weights ``[n, D]`` of a new row for each id."""
        return self.initializer.values(ids, self.dim, self.config.seed, self.config.default_bound)  # type: ignore[arg-type]

    # -- rows by id ---------------------------------------------------------------------------

    @abstractmethod
    def read_rows(self, ids: torch.Tensor) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def write_rows(self, ids: torch.Tensor, values: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def dump(self) -> dict[str, torch.Tensor]:
        """Everything needed to restore the table exactly (CPU tensors)."""

    @abstractmethod
    def check_dump(self, dump: Mapping[str, torch.Tensor], weights_only: bool = False) -> list[str]:
        """The row fields :meth:`load` would take from ``dump``; ValueError naming the table and
        what does not fit (a missing field, another dim or row count, another optimizer's
        states unless ``weights_only``), writing nothing."""

    @abstractmethod
    def load(self, dump: dict[str, torch.Tensor], weights_only: bool = False, to_read: bool = False) -> dict[str, int]:
        """Restores from :meth:`dump`; ``weights_only`` resets optimizer states and the step;
        ``to_read``: the table will be read, not trained (a dynamic table then takes every key)."""

    index_fields: tuple[str, ...] = ()
    """A dump's fields besides its rows and ``step`` (a dynamic table's keys, scores, ...)."""

    def row_ids(self, ids, what: str) -> torch.Tensor:
        """``ids`` (a tensor or a sequence of integers) as int64 on the table's device; ValueError
        naming ``what`` for floating-point ids, which a cast would truncate to another row."""
        if (isinstance(ids, torch.Tensor) and ids.is_floating_point()) or any(
            isinstance(i, float) for i in (ids if isinstance(ids, (list, tuple)) else ())
        ):
            raise ValueError(f"table '{self.name}': {what} takes integer ids, got floating-point ones")
        out = torch.as_tensor(ids, dtype=torch.int64, device=self.device)
        if out.dim() != 1:
            raise ValueError(f"table '{self.name}': {what} takes ids [n], got a tensor of shape {list(out.shape)}")
        return out

    def _field_widths(self) -> dict[str, int]:
        """Each row field's width: the table's dim for ``weight``, each optimizer state's own."""
        return {"weight": self.dim, **{s.name: s.width(self.dim) for s in self.spec.state_specs()}}

    def check_row_values(self, values: Mapping[str, Any], n: int, what: str = "write_rows") -> None:
        """ValueError naming the table and the field where ``values`` (``weight`` and states, as
        :meth:`write_rows` takes them) are not ``n`` rows of this table's fields, or not finite
        numbers, or negative in a state that is a sum of squares (its square root would be NaN):
        called before anything is written or any key inserted."""
        widths = self._field_widths()
        nonnegative = {s.name for s in self.spec.state_specs() if s.nonnegative}
        for name, v in values.items():
            if name not in widths:
                raise ValueError(
                    f"table '{self.name}': {what}: unknown row field '{name}'; this table has {sorted(widths)}"
                )
            t = torch.as_tensor(v)
            shape = tuple(t.shape)
            if shape != (n, widths[name]) and not (widths[name] == 1 and shape == (n,)):
                raise ValueError(
                    f"table '{self.name}': {what}: '{name}' must have shape {(n, widths[name])}, got {shape}"
                )
            if n == 0:  # (no rows: nothing to check; reshape(0, -1) is ambiguous)
                continue
            bad = ~torch.isfinite(t) if t.is_floating_point() else torch.zeros(shape, dtype=torch.bool)
            if name in nonnegative:
                bad |= t < 0
            bad = bad.reshape(n, -1)
            if bool(bad.any()):
                row = int(bad.any(dim=1).nonzero()[0])
                value = float(t.reshape(n, -1)[row][bad[row]][0])
                why = "a finite number, at least 0 (a sum of squares)" if name in nonnegative else "a finite number"
                raise ValueError(
                    f"table '{self.name}': {what}: '{name}' holds {value} in row {row} (of the rows given, in "
                    f"order); each value must be {why}"
                )

    def foreign_fields(self, dump: Mapping[str, torch.Tensor]) -> list[str]:
        """The fields of ``dump`` that are another optimizer's states, sorted: states this table
        does not keep, and its own states' names at another width (Adagrad's ``momentum1`` is
        ``[n, dim]``, RowWiseAdagrad's ``[n, 1]``)."""
        own = {"weight", "step", *(s.name for s in self.spec.state_specs()), *self.index_fields}
        other_width = [
            s.name
            for s in self.spec.state_specs()
            if s.name in dump and (dump[s.name].dim() != 2 or dump[s.name].shape[1] != s.width(self.dim))
        ]
        return sorted((set(dump) - own) | set(other_width))

    def lacking_states(self, dump: Mapping[str, torch.Tensor]) -> list[str]:
        """This optimizer's states ``dump`` does not hold (an SGD table's dump has none)."""
        return [s.name for s in self.spec.state_specs() if s.name not in dump]

    def _dump_fields(self, dump: Mapping[str, torch.Tensor], weights_only: bool) -> list[str]:
        """The row fields a load takes from ``dump``; ValueError naming the missing ones, or (but
        for ``weights_only``) the fields of another optimizer's states: Adam's ``momentum1`` has
        Adagrad's name and shape, and would train on as an accumulator. Called before anything
        is replaced, and refused while a training step is pending."""
        self.steps.check_idle("load")
        # The states' names from the spec: the store's views of them could write a cache back.
        fields = ["weight"] if weights_only else ["weight", *(s.name for s in self.spec.state_specs())]
        if "weight" in dump and dump["weight"].dim() == 2 and dump["weight"].shape[1] != self.dim:
            raise ValueError(
                f"table '{self.name}': dump holds weight of dim {dump['weight'].shape[1]}, the table's is {self.dim}"
            )
        optimizer = type(self.spec).__name__
        missing = [f for f in fields + ([] if weights_only else ["step"]) if f not in dump]
        if missing:
            raise ValueError(f"table '{self.name}': dump lacks {missing} (optimizer {optimizer})")
        foreign = self.foreign_fields(dump)
        if foreign and not weights_only:
            raise ValueError(
                f"table '{self.name}': dump holds {foreign}, states optimizer {optimizer} does not keep (saved by "
                "another optimizer?); load its weights only to start this optimizer's states afresh"
            )
        if not weights_only:
            step = dump["step"]
            if step.numel() != 1 or step.is_floating_point() or int(step) < 0:
                raise ValueError(f"table '{self.name}': dump's step {step.tolist()} is not a count of steps")
        return fields

    def _check_rows(self, dump: Mapping[str, torch.Tensor], fields: list[str], rows: int) -> None:
        """ValueError naming the first of ``fields`` that is not ``[rows, width]`` (the table's dim
        for the weight, the state's width for a state), before anything is written."""
        widths = self._field_widths()
        for f in fields:
            if tuple(dump[f].shape) != (rows, widths[f]):
                raise ValueError(
                    f"table '{self.name}': dump holds {f} {tuple(dump[f].shape)}, the table needs {(rows, widths[f])}"
                )

    def _load_rows(
        self,
        rows: torch.Tensor,
        src: torch.Tensor,
        dump: dict[str, torch.Tensor],
        fields: list[str],
        weights_only: bool,
    ) -> None:
        """Writes dump rows ``src`` (``fields``) into ``rows``; sets the step counter."""
        self.store.write(rows, {f: dump[f].to(self.device)[src] for f in fields})
        self.steps.reset(0 if weights_only else int(dump["step"]))

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "kind": self.config.kind,
            "backend": self.config.backend,
            "dim": self.dim,
            "optimizer": repr(self.spec),
            "step": self.step,
            "bytes": self.nbytes,
            "host_bytes": self.store.host_nbytes,  # of them, in host memory
        }

    @property
    def nbytes(self) -> int:
        return self.store.nbytes


class FixedTable(EmbeddingTable):
    """``num_embeddings`` rows; id ``i`` is row ``i``. Initial weights are key-seeded with the
    ids as keys, so a fixed table starts from the rows a dynamic table gives the same keys.

    ``rows``: a row-wise shard holds only the global rows ``[start, end)``, as its local rows
    ``0 .. end - start - 1`` (initialized with their global ids as keys)."""

    def __init__(
        self,
        config: TableConfig,
        spec: OptimizerSpec,
        device: torch.device,
        rows: Optional[tuple[int, int]] = None,
        store: Optional[RowStore] = None,
        grad_reducer: Optional[GradReducer] = None,
    ):
        """``store``: rows of a store shared with other tables (a ``TableGroup``'s slice, of
        exactly this table's rows) instead of a store of its own; ``grad_reducer``: a
        data-parallel table's (see :class:`NativeRowStore`)."""
        super().__init__(config, spec, device)
        assert config.num_embeddings is not None
        start, end = rows if rows is not None else (0, config.num_embeddings)
        self.row_offset = start
        self.num_embeddings = end - start
        if store is not None and store.num_rows != self.num_embeddings:
            raise ValueError(f"table '{self.name}': given a store of {store.num_rows} rows for {self.num_embeddings}")
        if store is None:
            store = make_row_store(config, spec, self.num_embeddings, self.device, grad_reducer)
        store.row_keys = RowKeys(offset=start)  # half-precision rows' rounding draws: by global row id
        self._store = store
        # Each row's initial weights keyed by its global id, written in place (the uniform
        # initializer's without float64 temporaries: Initializer.write_rows), 65,536 rows at a
        # time, on the weights' device (a host tier's rows are on the host).
        weight, chunk = self._store.weight, 1 << 16
        seed, bound = self.config.seed, self.config.default_bound
        with torch.no_grad():
            for first in range(0, self.num_embeddings, chunk):
                ids = torch.arange(first, min(first + chunk, self.num_embeddings), device=weight.device)
                self.initializer.write_rows(weight, ids, ids + start, seed, bound)  # type: ignore[arg-type]

    @property
    def store(self) -> RowStore:
        return self._store

    def validate(self, feature: str, ids: torch.Tensor, id_range: Optional[tuple[int, int]] = None) -> None:
        check_id_range(self.name, feature, ids, self.num_embeddings, id_range)

    def _rows_of(self, bags: Bags, found: Optional[FoundKeys]) -> Optional[torch.Tensor]:
        return bags.ids

    def lookup(
        self, bags: Bags, train: bool, found: Optional[FoundKeys] = None, hold: Optional[CacheHold] = None
    ) -> torch.Tensor:
        step = self.steps.current if train else None
        store_lookup = self.store.lookup if hold is None else hold.lookup  # the hold's slots: no host read
        out = store_lookup(bags.ids, bags.offsets, bags.weights, train, step=step.t if step else 0)
        if step is not None:
            self._commit_on_backward(out, step)
        return out

    def read_rows(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        ids = self.row_ids(ids, "read_rows")
        self.validate("read_rows", ids)
        return self.store.read(ids)

    def write_rows(self, ids: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        ids = self.row_ids(ids, "write_rows")
        self.validate("write_rows", ids)
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"table '{self.name}': write_rows got duplicate ids")
        self.check_row_values(values, ids.numel())
        self.store.write(ids, values)

    def dump(self) -> dict[str, torch.Tensor]:
        out = {"weight": self.store.weight.detach().cpu().clone()}
        out.update({k: v.detach().cpu().clone() for k, v in self.store.states.items()})
        out["step"] = torch.tensor(self.step, dtype=torch.int64)
        return out

    def check_dump(self, dump: Mapping[str, torch.Tensor], weights_only: bool = False) -> list[str]:
        fields = self._dump_fields(dump, weights_only)
        self._check_rows(dump, fields, self.num_embeddings)
        return fields

    @torch.no_grad()
    def load(self, dump: dict[str, torch.Tensor], weights_only: bool = False, to_read: bool = False) -> dict[str, int]:
        fields = self.check_dump(dump, weights_only)
        self.store.reallocate(self.num_embeddings)
        rows = torch.arange(self.num_embeddings, device=self.device)
        self._load_rows(rows, rows, dump, fields, weights_only)
        return {"loaded": self.num_embeddings, "dropped": 0, "admission_dropped": 0}

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "num_embeddings": self.num_embeddings}
