"""Arrow record batches -> model inputs (a KJT-shaped sparse batch, dense features, labels).

Every feature kind of docs/features.md is computed here, in dependency order (a ``feature:<name>``
input reads another feature's output after its bucketizer): ids go to the KJT (with per-id
weights where a feature is ``weighted``), numbers to ``Batch.dense`` (``[B]``, ``[B, k]``, or a
dense sequence ``[B, L, k]`` with its lengths in ``Batch.dense_lengths``).

The common kinds take the C++ feature-generation paths (``dynarec.features.native``: split and
hash, split and parse); the rest is whole-column pyarrow and NumPy work
(``dynarec.features.values``). Per-row Python runs only for an ``expr_feature`` whose variables hold
a different number of values row to row, and for EditDistance where the C++ extension is not built.

Every bad value is an error naming the feature, the column, the file and the row: a missing
column, a null id, a NaN or null dense value, a malformed multi-value field, a negative or
out-of-range id of a fixed feature, a row with the wrong number of values, a binary task's label
outside {0, 1}.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from dynarec.config.features import (
    BoolMaskFeatureCfg,
    ComboFeatureCfg,
    CustomFeatureCfg,
    ExprFeatureCfg,
    Feature,
    IdFeatureCfg,
    Input,
    KvDotProductCfg,
    LookupFeatureCfg,
    MatchFeatureCfg,
    OverlapFeatureCfg,
    RawFeatureCfg,
    SequenceFeatureCfg,
    SequenceRawFeatureCfg,
    TokenizeFeatureCfg,
    dependency_order,
    parse_input,
)
from dynarec.config.schema import Config
from dynarec.config.tasks import label_rules, session_field
from dynarec.data.sampler import negative_sampler
from dynarec.data.tdm_sampler import TreeSamples, node_columns, tdm_sampler, with_node_columns
from dynarec.data.transport import Slot, narrowest_integer, pack, read_into, unpack
from dynarec.devices import to_device
from dynarec.embedding.jagged import JaggedBatch
from dynarec.features import native
from dynarec.features.expression import Expression
from dynarec.features.hashing import DYNAMIC_KEY_BUCKETS, HashFunction, hash_buckets, to_hash_bucket_fast
from dynarec.features.values import (
    Jagged,
    RowError,
    as_strings,
    combine,
    edit_distance,
    empty_tokens,
    fill_missing,
    jagged,
    join_keys,
    keep_last,
    kv_dot,
    map_entries,
    mask_values,
    numbers,
    offsets_of,
    overlap,
    product,
    vectors,
)
from dynarec.metrics import NULL_GROUP

__all__ = ["Batch", "BatchBuilder", "BatchFile", "DataError", "RowOrigin"]


class DataError(ValueError):
    """Bad input data; the message names the feature/column, the file and the row."""


@dataclass
class Batch:
    """One batch of rows.

    ``sparse``: every feature with a table, KJT layout (key-major lengths ``[F * B]``; per-id
    weights when a feature is weighted, 1.0 for the others); in a page-locked batch from a
    DataLoader worker, its ids and lengths are in the narrowest integer type holding them, as
    they travelled, and widen to int64 on their copy to the device. ``dense``: ``{feature: [B]}``
    float32 (normalized) for one number a row, ``[B, k]`` for ``value_dim`` k, ``[B, L, k]`` for a
    dense sequence (zero-padded to the batch's longest; its lengths in ``dense_lengths``, ``[B]``
    int64). ``labels``: ``[B, L]`` float32, one column per ``Config.label_fields()`` entry
    (a single-task model's ``data.label_field`` alone). ``groups``: ``[B]`` int64 ids of the grouped-AUC
    field (or None). A model scoring each row's candidates (``Config.candidate_feature()``) has a
    label a candidate: ``labels`` is ``[C, L]`` over the batch's ``C`` candidates, row after row,
    and ``groups`` and ``sessions`` give each candidate its row's id.
    """

    sparse: JaggedBatch
    dense: dict[str, torch.Tensor]
    labels: torch.Tensor
    groups: Optional[torch.Tensor]
    num_rows: int
    dense_lengths: dict[str, torch.Tensor] = field(default_factory=dict)
    # A sequence of several ids an element (value_dim 0): [B, L] int64, the ids of each element
    # (0 past a row's elements). Its KJT lengths count ids; sequence_lengths() counts elements.
    element_lengths: dict[str, torch.Tensor] = field(default_factory=dict)
    # [B] int64 session ids of the tasks' JRC losses (their session_name column), or None.
    sessions: Optional[torch.Tensor] = None
    # Rows after the first num_rows: a retrieval model's sampled items (data.negative_sampler),
    # holding item features only (the others empty) and no labels. Features are [num_rows + sampled_rows].
    sampled_rows: int = 0
    # The last H sampled rows are hard negatives (data.negative_sampler.hard_negatives): [H] int64,
    # the row of the user each belongs to (ascending), or None.
    hard_negative_rows: Optional[torch.Tensor] = None
    # A TDM batch (data.tdm_sampler): [num_rows] int64, the data row each row holds the values of
    # (the batch's rows their own, a sampled tree node's row the row it was sampled for); else None.
    source_rows: Optional[torch.Tensor] = None
    # Where the tensors are views of one packed buffer (a batch just arrived from a DataLoader
    # worker, which pins it before anything else sees it): the buffer and how to rebuild the
    # batch from it, so that pin_memory copies it once.
    _packed: Optional[tuple[torch.Tensor, list[Slot], _Layout]] = field(default=None, repr=False, compare=False)
    # A batch copied to a GPU on a stream of its own (a cached epoch's, MemoryBatchCache): the
    # event after its copy, which a stream reading the batch waits for. None: nothing to wait for.
    ready: Optional[torch.cuda.Event] = field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        # A field replaced on a packed batch: the buffer no longer holds the batch (a step replayed
        # from a CUDA graph, or a copy to a device, would read the old field from it).
        if name not in ("_packed", "ready") and self.__dict__.get("_packed") is not None:
            object.__setattr__(self, "_packed", None)
        object.__setattr__(self, name, value)

    def packed(self) -> tuple[torch.Tensor, list[Slot], _Layout]:
        """``(buffer, slots, layout)``: every tensor of the batch packed into one buffer (see
        dynarec.data.transport), and what rebuilds the batch from it besides."""
        tensors, layout = self._parts()
        buffer, slots = pack(tensors, self._narrowest_ids())
        return buffer, slots, layout

    def _narrowest_ids(self) -> list[Optional[torch.dtype]]:
        """The integer types the sparse ids and lengths travel as (see dynarec.data.transport):
        the narrowest holding them, from the host statistics their maker worked out (ids are
        left as they are where it did not)."""
        stats = self.sparse.host_stats()
        lengths = narrowest_integer(min(stats.min_length_per_key, default=0), max(stats.max_length_per_key, default=-1))
        ranges = [r for r in stats.id_range_per_key or () if r[0] <= r[1]]
        ids = None
        if stats.id_range_per_key is not None:
            ids = narrowest_integer(min((r[0] for r in ranges), default=0), max((r[1] for r in ranges), default=-1))
        return [ids, lengths]

    def _parts(self) -> tuple[list[torch.Tensor], _Layout]:
        """Every tensor of the batch, in the order :func:`_assembled` takes them, and the rest."""
        s = self.sparse
        optional = [s.weights_or_none(), self.groups, self.sessions, self.hard_negative_rows, self.source_rows]
        dicts = (self.dense, self.dense_lengths, self.element_lengths)
        tensors = [s.values(), s.lengths(), self.labels, *(t for t in optional if t is not None)]
        for d in dicts:
            tensors += d.values()
        layout = _Layout(
            s.keys(),
            s.host_stats(),
            [t is not None for t in optional],
            [list(d) for d in dicts],
            self.num_rows,
            self.sampled_rows,
        )
        return tensors, layout

    def packed_buffer(self) -> Optional[tuple[torch.Tensor, list[Slot], _Layout]]:
        """``(buffer, slots, layout)`` where the batch's tensors are views of one buffer (a batch
        from a DataLoader worker, page-locked, or its copy on a device, none of its fields replaced
        since; a tensor of its dicts replaced in place is not seen), else None; its ids and
        lengths may lie in it narrower than they are (see :mod:`dynarec.data.transport`).
        :meth:`unpacked` makes the batch of such a buffer, wherever it was copied to."""
        return self._packed

    @staticmethod
    def unpacked(buffer: torch.Tensor, slots: list[Slot], layout: _Layout) -> Batch:
        """The batch of :meth:`packed_buffer`'s parts, its tensors views of ``buffer`` (its ids
        and lengths widened to int64 where ``buffer`` is)."""
        return _unpacked_batch(buffer, slots, layout)

    @property
    def nbytes(self) -> int:
        """The bytes of the batch's tensors as :meth:`to` puts them on a device: a packed batch's
        buffer, and its ids and lengths widened out of it where they travelled narrower."""
        if self._packed is None:
            return sum(t.numel() * t.element_size() for t in self._parts()[0])
        buffer, slots, _ = self._packed
        widened = [math.prod(shape) * dtype.itemsize for _, kept, shape, dtype in slots if kept != dtype]
        return buffer.numel() + sum(widened)

    def to(self, device: torch.device) -> Batch:
        """A copy of the batch on ``device``, queued on the current stream (``non_blocking``: a
        page-locked batch's copy runs beside the host); a packed batch is copied in one piece."""
        if self._packed is not None:
            buffer, slots, layout = self._packed
            return _unpacked_batch(buffer.to(device, non_blocking=True), slots, layout)
        tensors, layout = self._parts()
        return _assembled(iter(to_device(tensors, device)), layout)

    def __reduce__(self):
        """Pickled (by a DataLoader worker, for the training process) as one buffer: one shared
        memory file a batch, and one page-locked copy there (see dynarec.data.transport)."""
        return (_unpacked_batch, self.packed())

    def pin_memory(self) -> Batch:
        """A copy in page-locked host memory (the DataLoader calls it for a CUDA trainer)."""
        if self._packed is not None:
            buffer, slots, layout = self._packed
            return _unpacked_batch(buffer.pin_memory(), slots, layout, widen=False)
        return Batch(
            self.sparse.pin_memory(),
            {k: v.pin_memory() for k, v in self.dense.items()},
            self.labels.pin_memory(),
            None if self.groups is None else self.groups.pin_memory(),
            self.num_rows,
            {k: v.pin_memory() for k, v in self.dense_lengths.items()},
            {k: v.pin_memory() for k, v in self.element_lengths.items()},
            None if self.sessions is None else self.sessions.pin_memory(),
            self.sampled_rows,
            None if self.hard_negative_rows is None else self.hard_negative_rows.pin_memory(),
            None if self.source_rows is None else self.source_rows.pin_memory(),
        )

    def sequence_lengths(self, names: list[str]) -> dict[str, torch.Tensor]:
        """``{name: [B] int64}``: the elements of each sequence feature (ids or numbers); a
        page-locked batch's may be of a narrower integer type (see ``Batch.sparse``)."""
        b = self.num_rows + self.sampled_rows
        keys = self.sparse.keys()
        lengths = self.sparse.lengths().view(len(keys), b) if keys else None
        out = {}
        for n in names:
            if n in self.dense_lengths:
                out[n] = self.dense_lengths[n]
            elif n in self.element_lengths:
                out[n] = (self.element_lengths[n] > 0).sum(1)  # an element holds at least one id
            else:
                assert lengths is not None, f"no sequence feature '{n}' in the batch"
                out[n] = lengths[keys.index(n)]
        return out


@dataclass(frozen=True)
class _Layout:
    """What a packed batch holds besides its tensors (see ``Batch.packed``): the sparse keys
    and host statistics, which of weights, groups, sessions, hard-negative rows and source rows
    are present, the keys of the dense, dense-lengths and element-lengths dicts, and the rows."""

    keys: list[str]
    stats: Any
    present: list[bool]
    dict_keys: list[list[str]]
    num_rows: int
    sampled_rows: int


def _unpacked_batch(buffer: torch.Tensor, slots: list[Slot], layout: _Layout, widen: bool = True) -> Batch:
    """The batch of ``Batch.packed`` (pickled, or sent as a ``BatchFile``), its tensors views
    of ``buffer``; its sparse ids and lengths widened to int64 where ``widen`` (else as they
    travelled: a page-locked batch bound for a device, which its copy there widens)."""
    batch = _assembled(iter(unpack(buffer, slots, widen)), layout)
    batch._packed = (buffer, slots, layout)
    return batch


def _assembled(tensors: Iterator[torch.Tensor], layout: _Layout) -> Batch:
    """The batch of ``tensors`` in the order of ``Batch._parts``, and ``layout``."""
    values, lengths, labels = next(tensors), next(tensors), next(tensors)
    weights, groups, sessions, hard_negative_rows, source_rows = (next(tensors) if p else None for p in layout.present)
    dense, dense_lengths, element_lengths = ({k: next(tensors) for k in keys} for keys in layout.dict_keys)
    sparse = JaggedBatch(list(layout.keys), values, lengths, weights, layout.stats)
    return Batch(
        sparse,
        dense,
        labels,
        groups,
        layout.num_rows,
        dense_lengths,
        element_lengths,
        sessions,
        layout.sampled_rows,
        hard_negative_rows,
        source_rows,
    )


@dataclass(frozen=True)
class BatchFile:
    """A batch a DataLoader worker wrote, packed (``Batch.packed``), to a file of its loader's
    shared directory (in shared memory, else the temp directory): what travels to the training
    process in its place — a path and a layout, where a pickled tensor would be a shared-memory
    mapping whose descriptor is handed over a socket, in Python, by the loader's thread in the
    training process. That thread competes for the interpreter with the training loop; reading
    a file holds the interpreter for a few calls. The training process reads the file once
    (into page-locked memory where the batch is bound for a GPU: :meth:`pin_memory`, which the
    DataLoader's pinning thread calls) and deletes it."""

    path: str
    nbytes: int
    slots: list[Slot]
    layout: _Layout

    def load(self, pin: bool = False, keep: bool = False) -> Batch:
        """The batch (in page-locked memory if ``pin``); the file is deleted unless ``keep`` (a
        cached epoch's, read again each epoch). DataError naming the file where it cannot be
        read."""
        try:
            with open(self.path, "rb", buffering=0) as f:
                buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
                read_into(f, buffer)
            if not keep:
                os.unlink(self.path)
        except OSError as e:
            why = (e.strerror if isinstance(e, FileNotFoundError) else None) or str(e)
            if not os.path.isdir(os.path.dirname(self.path)):
                why += "; its pass's directory is gone: the pass was abandoned, or another process removed it"
            raise DataError(f"batch file {self.path} could not be read ({why})") from None
        return _unpacked_batch(buffer, self.slots, self.layout, widen=not pin)

    def pin_memory(self) -> Union[Batch, DataError]:
        """The batch in page-locked memory; an error as a value, raised where the training loop
        takes the batch (raised here, torch would wrap it in its pinning thread's traceback)."""
        try:
            return self.load(pin=True)
        except DataError as e:
            return e.with_traceback(None)  # (its frames would hold the buffer until it is raised)


@dataclass(frozen=True)
class RowOrigin:
    """Where a batch's rows came from: contiguous runs ``(file, first row in file, rows)``, in
    batch order, so that an error about batch row ``i`` names its own file and row."""

    runs: tuple[tuple[str, int, int], ...]

    @classmethod
    def of(cls, source: str, rows: int, first_row: int = 0) -> RowOrigin:
        return cls(((source, first_row, rows),))

    @property
    def label(self) -> str:
        extra = len({path for path, _, _ in self.runs}) - 1
        return self.runs[0][0] + (f" (+{extra} more file(s))" if extra else "")

    def locate(self, i: int) -> str:
        for path, first, rows in self.runs:
            if i < rows:
                return f"{path}, row {first + i}"
            i -= rows
        raise IndexError(i)


@dataclass
class _Ids:
    """A feature's ids: ``values`` int64 of rows of ``lengths``, ``weights`` float32 or None."""

    values: np.ndarray
    lengths: np.ndarray
    weights: Optional[np.ndarray] = None
    # Several ids an element: the ids of each element (flat, row-major) and the elements a row.
    element_lengths: Optional[np.ndarray] = None
    elements: Optional[np.ndarray] = None


@dataclass(frozen=True)
class _ValueIds:
    """The ids of each of a column's distinct values (a row each; a missing value's last, where
    a default fills it) and where each value's start in ``ids.values``; where no value has more
    than one, ``single`` holds each value's id (0 for none) and ``single_weights`` its weight."""

    ids: _Ids
    starts: np.ndarray
    single: Optional[np.ndarray]
    single_weights: Optional[np.ndarray]
    ones: Optional[int]  # the values (all but a missing one), where each has one id; else None

    @classmethod
    def of(cls, ids: _Ids, values: int) -> _ValueIds:
        """``ids`` of ``values`` values (and of a missing one after them, where they hold one)."""
        starts = np.cumsum(ids.lengths) - ids.lengths
        single = single_weights = None
        if (ids.lengths <= 1).all():
            has = ids.lengths == 1
            single = np.zeros(len(ids.lengths), dtype=ids.values.dtype)
            single[has] = ids.values
            if ids.weights is not None:
                single_weights = np.zeros(len(ids.lengths), dtype=ids.weights.dtype)
                single_weights[has] = ids.weights
        ones = values if (ids.lengths[:values] == 1).all() else None
        return cls(ids, starts, single, single_weights, ones)

    def take(self, codes: np.ndarray) -> _Ids:
        """The ids of rows holding values ``codes`` (positions in the values)."""
        ids = self.ids
        codes = codes.astype(np.intp, copy=False)  # (numpy gathers faster by native-width positions)
        if self.single is not None and self.ones is not None and codes.size and codes.max() < self.ones:
            weights = None if self.single_weights is None else self.single_weights[codes]
            return _Ids(self.single[codes], np.ones(len(codes), dtype=ids.lengths.dtype), weights)
        lengths = ids.lengths[codes]
        if self.single is not None:
            values, weights = self.single[codes], None if self.single_weights is None else self.single_weights[codes]
            if len(values) and not lengths.all():  # (rows without an id)
                has = lengths.astype(bool)
                values, weights = values[has], None if weights is None else weights[has]
            return _Ids(values, lengths, weights)
        ends = np.cumsum(lengths)
        positions = np.arange(ends[-1] if len(ends) else 0) + np.repeat(self.starts[codes] - (ends - lengths), lengths)
        return _Ids(ids.values[positions], lengths, None if ids.weights is None else ids.weights[positions])


@dataclass
class _SeenValues:
    """A feature's last dictionary (its buffers ``key``, held so that they stay those), the rows
    read with it or an equal one, and its values' ids once worked out (None before, and where
    they cannot be)."""

    key: tuple[int, ...]
    values: pa.Array
    rows: int = 0
    worked_out: bool = False
    ids: Optional[_ValueIds] = None

    def work_out(self, ids_of: Callable[[pa.Array], _Ids], missing: bool) -> None:
        """The values' ids by ``ids_of`` (the row path, over the values as rows), with a missing
        value's (a null) after them where ``missing``."""
        self.worked_out = True
        read = pa.concat_arrays([self.values, pa.nulls(1, self.values.type)]) if missing else self.values
        try:
            ids = ids_of(read)
        except Exception:  # (the row path raises it where a row holds the value)
            return
        if ids.elements is None and ids.element_lengths is None:  # (not ids of several elements)
            self.ids = _ValueIds.of(ids, len(self.values))


@dataclass
class _Dense:
    """A feature's numbers ``[B]`` or ``[B, k]``: float32 for the model, float64 as computed (a
    ``feature:`` input reads these)."""

    x32: np.ndarray
    x64: np.ndarray


@dataclass
class _DenseSequence:
    """A dense sequence: ``x`` float32 ``[elements, k]`` of rows of ``lengths``."""

    x: np.ndarray
    lengths: np.ndarray


_Output = Union[_Ids, _Dense, _DenseSequence]


def _draw_key(path: str) -> str:
    """A data file's part of its batches' negative draws: its name under its directory's name
    (``train/part-0.parquet``, ``dt=1/part-0.parquet``), so that the draws do not depend on where
    the data lies."""
    p = Path(path)
    return f"{p.parent.name}/{p.name}"


def _or_empty(x: Optional[np.ndarray]) -> np.ndarray:
    return x if x is not None else np.empty(0, np.int64)


def _empty(f: Feature, rows: int) -> _Output:
    """``rows`` empty rows of feature ``f``: no ids, or zeros."""
    if f.embedded:
        several = isinstance(f, SequenceFeatureCfg) and f.several_ids_an_element
        nothing = np.empty(0, np.int64)
        return _Ids(
            nothing,
            np.zeros(rows, np.int64),
            None,
            nothing if several else None,
            np.zeros(rows, np.int64) if several else None,
        )
    k = int(f.value_dim)
    if f.is_sequence:
        return _DenseSequence(np.zeros((0, k), np.float32), np.zeros(rows, np.int64))
    x = np.zeros(rows if k == 1 else (rows, k))
    return _Dense(x.astype(np.float32), x)


def _appended(out: _Output, extra: _Output) -> _Output:
    """``out``'s rows followed by ``extra``'s (of the same kind; :func:`_empty` for empty rows)."""
    if isinstance(out, _Ids):
        assert isinstance(extra, _Ids)
        weights = None
        if out.weights is not None or extra.weights is not None:
            weights = np.concatenate([
                out.weights if out.weights is not None else np.ones(len(out.values), np.float32),
                extra.weights if extra.weights is not None else np.ones(len(extra.values), np.float32),
            ])  # fmt: skip
        element_lengths = elements = None
        if out.element_lengths is not None:  # several ids an element: the extra rows' elements
            element_lengths = np.concatenate([out.element_lengths, _or_empty(extra.element_lengths)])
            elements = np.concatenate(
                [out.elements, extra.elements if extra.elements is not None else np.zeros(len(extra.lengths), np.int64)]
            )
        return _Ids(
            np.concatenate([out.values, extra.values]), np.concatenate([out.lengths, extra.lengths]), weights,
            element_lengths, elements,
        )  # fmt: skip
    if isinstance(out, _Dense):
        assert isinstance(extra, _Dense)
        return _Dense(np.concatenate([out.x32, extra.x32]), np.concatenate([out.x64, extra.x64]))
    assert isinstance(extra, _DenseSequence)
    return _DenseSequence(np.concatenate([out.x, extra.x]), np.concatenate([out.lengths, extra.lengths]))


def _jagged_take(lengths: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The flat positions of ``rows``' values, row after row, in values laid out by ``lengths``."""
    starts = np.concatenate([[0], np.cumsum(lengths)])[:-1][rows]
    counts = lengths[rows]
    return np.repeat(starts - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))


def _taken(out: _Output, rows: np.ndarray) -> _Output:
    """``out``'s rows ``rows`` (int64, any order, repeats allowed)."""
    if isinstance(out, _Ids):
        element_lengths = elements = None
        if out.element_lengths is not None and out.elements is not None:  # several ids an element
            at = _jagged_take(out.elements, rows)
            element_lengths, elements = out.element_lengths[at], out.elements[rows]
            at = _jagged_take(out.element_lengths, at)
        else:
            at = _jagged_take(out.lengths, rows)
        weights = out.weights[at] if out.weights is not None else None
        return _Ids(out.values[at], out.lengths[rows], weights, element_lengths, elements)
    if isinstance(out, _Dense):
        return _Dense(out.x32[rows], out.x64[rows])
    return _DenseSequence(out.x[_jagged_take(out.lengths, rows)], out.lengths[rows])


@dataclass(frozen=True)
class _Plan:
    """What a feature's bucketizer needs on every batch, worked out once: the bucketizer, whether
    values are hashed (and by what, modulo what), whether the table is dynamic, a fixed table's
    rows."""

    kind: Optional[str]
    hashed: bool
    hash_function: HashFunction
    modulus: int
    dynamic: bool
    rows: Optional[int]

    @classmethod
    def of(cls, f: Feature) -> _Plan:
        dynamic = f.dynamic
        rows = f.table_rows if f.embedded else None
        modulus = DYNAMIC_KEY_BUCKETS if dynamic else (rows or 1)
        return cls(f.bucketizer, f.hashed, getattr(f, "hash_function", "farmhash"), modulus, dynamic, rows)


_VOCABS = ("vocab_list", "vocab_dict", "vocab_file")


def sequence_elements(column: Union[pa.Array, pa.ChunkedArray], separator: str) -> pa.ChunkedArray:
    """Every element of a column of sequences (lists, or strings joined by ``separator``), row
    after row; empty strings dropped."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    out = []
    for chunk in chunks:
        if pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type):
            out.append(pc.list_flatten(chunk))
        elif pa.types.is_string(chunk.type) or pa.types.is_large_string(chunk.type):
            parts = pc.list_flatten(pc.split_pattern(chunk, separator))
            out.append(parts.filter(pc.not_equal(parts, "")))
        else:
            out.append(chunk)
    return pa.chunked_array(out, type=out[0].type if out else pa.int64())


class BatchBuilder:
    """Builds :class:`Batch` objects from Arrow tables for one config."""

    def __init__(
        self,
        config: Config,
        with_labels: bool = True,
        negatives: int = 0,
        empty_features: frozenset[str] = frozenset(),
        tree_samples: bool = False,
    ):
        """``negatives``: the sampled items each batch gets (``data.negative_sampler``; 0: none);
        ``empty_features``: features not read from the data but empty in every row (no ids, zeros),
        their columns not needed (a retrieval model's other tower, serving one tower's table);
        ``tree_samples``: each batch gets a TDM model's layer-wise sampled rows
        (``data.tdm_sampler``, with labels)."""
        self.config = config
        self.with_labels = with_labels
        self.empty_features = empty_features
        features = config.features()
        self.sparse_features = [f for f in features if f.embedded]  # the KJT's keys, in config order
        self.dense_features = [f for f in features if not f.embedded]
        # Computed ids first, then numbers, each after the features it reads.
        self.order: list[Feature] = dependency_order(self.sparse_features + self.dense_features)
        self.features = {f.feature_name: f for f in features}
        self.referenced = {name for f in features for name in f.feature_inputs}
        self.weighted = any(getattr(f, "weighted", False) for f in self.sparse_features)
        self.plans = {f.feature_name: _Plan.of(f) for f in features}
        self._feature_columns = [
            (f.feature_name, c)
            for f in self.sparse_features + self.dense_features
            if f.feature_name not in empty_features
            for c in f.columns
        ]
        self.label_fields = config.label_fields()
        self.candidate_feature = config.candidate_feature()
        self.label_rules = label_rules(config.tasks())
        self.group_field = self._group_field()
        self.session_field = session_field(config.tasks())
        sampler = config.data.negative_sampler
        self.sampler = negative_sampler(sampler, config.train.seed) if sampler is not None and negatives else None
        self.negatives = negatives if self.sampler is not None else 0
        # The features the sampled items hold: those reading only their attributes (through the features they read).
        self.sampled_features: set[str] = set()
        if self.sampler is not None:
            attrs = set(self.sampler.cfg.attr_fields)
            self.sampled_features = {
                f.feature_name for f in features if set(config.columns_read(f.feature_name)) <= attrs
            }
        tdm = config.data.tdm_sampler
        self.tdm = tdm_sampler(tdm, config.train.seed) if tdm is not None and tree_samples and with_labels else None
        # A sampled tree node's row: features of its item columns alone are computed from its
        # attributes, those of none copied from the row, the others computed over the row's
        # values with the node's in its item columns.
        self.node_features: set[str] = set()
        self.mixed_features: set[str] = set()
        if tdm is not None:
            item_columns = set(tdm.item_columns)
            for f in features:
                read = set(config.columns_read(f.feature_name))
                if read and read <= item_columns:
                    self.node_features.add(f.feature_name)
                elif read & item_columns:
                    self.mixed_features.add(f.feature_name)
        # what the mixed features read, computed with them over the combined rows
        self.mixed_inputs = {n for m in self.mixed_features for n in config.features_read(m)}
        if self.tdm is not None:
            self._check_node_ids(config)
        sequences = {f.feature_name for f in features if f.is_sequence}
        aligned = (
            list(dict.fromkeys(n for n in names if n in sequences)) for names in config.model.aligned_sequences()
        )
        self.sequence_groups = [names for names in aligned if len(names) > 1]
        # The separator of each column a sequence feature reads (an id column may hold a row's ids).
        self._sequence_separators = {
            c: f.separator for f in features if isinstance(f, SequenceFeatureCfg) for c in f.columns
        }
        # The dictionary of each feature's last dictionary-encoded column (_ids_by_value)
        self._by_value: dict[str, _SeenValues] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_by_value": {}}  # (a DataLoader worker starts without the parent's)

    def dictionary_columns(self) -> frozenset[str]:
        """The string columns a reader may give dictionary-encoded to gain from it: those read
        by id and sequence features alone (their ids are then worked out once a distinct value,
        :meth:`_ids_by_value`). Every other use of a column reads its values, so a dictionary would
        only be decoded there."""
        if self.sampler is not None or self.tdm is not None:  # (sampled rows are built from other tables)
            return frozenset()
        ids = {
            c
            for f in self.sparse_features + self.dense_features
            if isinstance(f, (IdFeatureCfg, SequenceFeatureCfg))
            for c in f.columns
        }
        others = {
            c
            for name, c in self._feature_columns
            if not isinstance(self.features[name], (IdFeatureCfg, SequenceFeatureCfg))
        }
        others |= set(self.label_fields) | {c for c in (self.group_field, self.session_field) if c}
        return frozenset(ids - others)

    def _check_node_ids(self, config: Config) -> None:
        """A fixed table of the item ids (``num_buckets``) must hold the tree's inner nodes'
        ids too (the largest item id + a code + 1): ValueError naming the feature otherwise,
        before any batch."""
        assert self.tdm is not None
        cfg, top = self.tdm.cfg, int(self.tdm.tree.ids.max())
        for f in self.sparse_features:
            if f.bucketizer == "num_buckets" and config.columns_read(f.feature_name) == [cfg.item_id_field]:
                if f.table_rows is not None and top >= f.table_rows:
                    raise ValueError(
                        f"feature '{f.feature_name}': num_buckets {f.table_rows}, but the tree of "
                        f"{cfg.item_input_path} has node ids up to {top} (an inner node's: the largest item id + "
                        f"its code + 1), which data.tdm_sampler.item_id_field '{cfg.item_id_field}' holds in its "
                        f"sampled rows; give num_buckets above {top}, or hash the ids (hash_bucket_size)"
                    )

    def _label_owner(self, label: str) -> str:
        if not self.config.model.task_towers:
            return "data.label_field"
        task = next(t for t in self.config.tasks() if label in (t.label_name, t.task_space_indicator_label))
        role = "label_name" if label == task.label_name else "task_space_indicator_label"
        return f"task '{task.tower_name}''s {role}"

    def _group_field(self) -> Optional[str]:
        if not any("grouped_auc" in t.eval_metrics for t in self.config.tasks()):
            return None
        if self.config.eval.grouped_auc_field:
            return self.config.eval.grouped_auc_field
        ids = [f for f in self.sparse_features if isinstance(f, IdFeatureCfg) and not f.input.feature]
        return ids[0].input.name if ids else None

    def columns(self) -> list[str]:
        """Every column a batch needs, in a stable order."""
        cols = [c for _, c in self._feature_columns]
        if self.with_labels:
            cols += self.label_fields
        if self.group_field and self.with_labels:
            cols.append(self.group_field)
        if self.session_field and self.with_labels:
            cols.append(self.session_field)
        if self.sampler is not None:
            cols.append(self.sampler.cfg.item_id_field)
            if self.sampler.cfg.hard_negatives is not None:
                cols.append(self.sampler.cfg.hard_negatives.user_id_field)
        if self.tdm is not None:
            cols.append(self.tdm.cfg.item_id_field)
        return list(dict.fromkeys(cols))

    def csv_column_types(self) -> dict[str, pa.DataType]:
        """Columns a CSV reader must take as strings, whatever they look like: ids, words, maps,
        keys (a string id ``001001`` is not ``1001``, ``1e3`` is not ``1000``; an integer id never
        goes through a float). Numbers (dense values, bucketized numbers, expression variables)
        are left to inference."""
        out: dict[str, pa.DataType] = {}
        for f in self.sparse_features + self.dense_features:
            if isinstance(f, (RawFeatureCfg, SequenceRawFeatureCfg, ExprFeatureCfg)) or (
                isinstance(f, IdFeatureCfg) and f.boundaries is not None
            ):
                continue
            for c in f.columns:
                out[c] = pa.string()
        return out

    def check_schema(self, schema: pa.Schema, source: str) -> None:
        """Raises DataError naming the first missing column (and the feature that needs it)."""
        names = set(schema.names)
        for column in self.columns():
            count = schema.names.count(column)
            if count > 1:
                raise DataError(f"{source}: column '{column}' appears {count} times; give every column one name")
        for name, c in self._feature_columns:
            if c not in names:
                raise DataError(f"{source}: missing column '{c}' (feature '{name}')")
        for label in self.label_fields if self.with_labels else []:
            if label not in names:
                raise DataError(f"{source}: missing column '{label}' ({self._label_owner(label)})")
        if self.with_labels and self.group_field and self.group_field not in names:
            raise DataError(f"{source}: missing column '{self.group_field}' (eval.grouped_auc_field)")
        if self.with_labels and self.session_field and self.session_field not in names:
            raise DataError(f"{source}: missing column '{self.session_field}' (jrc_loss.session_name)")
        if self.sampler is not None and self.sampler.cfg.item_id_field not in names:
            raise DataError(
                f"{source}: missing column '{self.sampler.cfg.item_id_field}' (data.negative_sampler.item_id_field)"
            )
        hard = self.sampler.cfg.hard_negatives if self.sampler is not None else None
        if hard is not None and hard.user_id_field not in names:
            raise DataError(
                f"{source}: missing column '{hard.user_id_field}' (data.negative_sampler.hard_negatives.user_id_field)"
            )
        if self.tdm is not None and self.tdm.cfg.item_id_field not in names:
            raise DataError(f"{source}: missing column '{self.tdm.cfg.item_id_field}' (data.tdm_sampler.item_id_field)")

    def build(self, table: pa.Table, origin: Union[RowOrigin, str]) -> Batch:
        """``table``'s rows -> Batch. ``origin`` says where the rows came from (a file name:
        all of them, from its row 0), for error messages."""
        if isinstance(origin, str):
            origin = RowOrigin.of(origin, table.num_rows)
        self.check_schema(table.schema, origin.label)
        n = table.num_rows
        if self.empty_features:
            read = {f.feature_name for f in self.order} - self.empty_features
            computed = self._features(table, origin, read)
            computed.update({f.feature_name: _empty(f, n) for f in self.order if f.feature_name not in read})
        else:
            computed = self._features(table, origin)
        self._check_sequence_groups(computed, origin)
        sampled, hard_rows = 0, None
        if self.sampler is not None:
            computed, sampled, hard_rows = self._with_sampled_items(computed, table, origin)
        tree = None
        if self.tdm is not None:
            computed, tree = self._with_tree_samples(computed, table, origin)
            n += len(tree.rows)
        rows = n + sampled
        sparse = self._kjt(computed)
        dense: dict[str, torch.Tensor] = {}
        dense_lengths: dict[str, torch.Tensor] = {}
        for f in self.dense_features:
            out = computed[f.feature_name]
            if isinstance(out, _DenseSequence):
                dense[f.feature_name] = torch.from_numpy(_padded(out.x, out.lengths, rows))
                dense_lengths[f.feature_name] = torch.from_numpy(out.lengths)
            else:
                assert isinstance(out, _Dense)
                dense[f.feature_name] = torch.from_numpy(out.x32)
        element_lengths = {
            name: torch.from_numpy(_padded(out.element_lengths, out.elements, rows, np.int64))
            for name, out in computed.items()
            if isinstance(out, _Ids) and out.element_lengths is not None and out.elements is not None
        }
        # A model scoring each row's candidates reads a label a candidate: its rows are theirs.
        counts = None
        if self.candidate_feature is not None:
            ids = computed[self.candidate_feature]
            assert isinstance(ids, _Ids)
            counts = ids.lengths[:n]
        labels = torch.zeros(n if counts is None else int(counts.sum()), len(self.label_fields))
        groups = sessions = None
        if self.with_labels:
            columns = [self._labels(table.column(c), c, origin, counts) for c in self.label_fields]
            if tree is not None:  # the sampled tree nodes' rows: 1 an ancestor, 0 a negative
                columns = [torch.cat([c, torch.from_numpy(tree.labels)]) for c in columns]
            if columns:  # (a semantic-ID model reads none)
                labels = torch.stack(columns, dim=1)
            if self.group_field:
                groups = self._per_candidate(self._group_ids(table.column(self.group_field)), counts)
            if self.session_field:
                sessions = self._per_candidate(self._group_ids(table.column(self.session_field)), counts)
            if tree is not None:  # a sampled row is its row's
                at = torch.from_numpy(tree.rows)
                groups = None if groups is None else torch.cat([groups, groups[at]])
                sessions = None if sessions is None else torch.cat([sessions, sessions[at]])
        source = None
        if tree is not None:
            source = torch.from_numpy(np.concatenate([np.arange(table.num_rows), tree.rows]))
        return Batch(
            sparse, dense, labels, groups, n, dense_lengths, element_lengths, sessions, sampled, hard_rows, source
        )

    @staticmethod
    def _per_candidate(ids: torch.Tensor, counts: Optional[np.ndarray]) -> torch.Tensor:
        """A row's id for each of its candidates (``counts`` a row), or the rows' ids as they are."""
        return ids if counts is None else torch.repeat_interleave(ids, torch.from_numpy(counts))

    def _with_sampled_items(
        self, computed: dict[str, _Output], table: pa.Table, origin: RowOrigin
    ) -> tuple[dict[str, _Output], int, Optional[torch.Tensor]]:
        """``(outputs, sampled rows, hard-negative rows)``: every feature with the sampled items'
        rows appended (the ``negatives`` drawn, then each row's hard negatives): the item features
        computed from their attributes, every other feature empty there (no ids, zeros)."""
        assert self.sampler is not None
        cfg = self.sampler.cfg
        items = self._int_ids(table, cfg.item_id_field, "data.negative_sampler.item_id_field", "item", origin)
        path, first, _ = origin.runs[0]
        key = f"{_draw_key(path)}:{first}"
        picks = self.sampler.draw(items, self.negatives, key)
        hard_rows = None
        if cfg.hard_negatives is not None:
            field = cfg.hard_negatives.user_id_field
            users = self._int_ids(table, field, "data.negative_sampler.hard_negatives.user_id_field", "user", origin)
            hard, rows = self.sampler.hard(users, key)
            picks = np.concatenate([picks, hard])
            hard_rows = torch.from_numpy(rows)
        types = {c: table.schema.field(c).type for c in cfg.attr_fields if c in table.schema.names}
        items_table = pa.table(self.sampler.columns(picks, types))
        # An error names the sampled item and its row of the item table.
        ids = self.sampler.ids[picks]
        where = RowOrigin(tuple((f"{cfg.input_path}, item {i}", int(p), 1) for i, p in zip(ids, picks)))
        extra = self._features(items_table, where, self.sampled_features)
        outputs = {
            name: _appended(out, extra[name] if name in extra else _empty(self.features[name], len(picks)))
            for name, out in computed.items()
        }
        return outputs, len(picks), hard_rows

    def _with_tree_samples(
        self, computed: dict[str, _Output], table: pa.Table, origin: RowOrigin
    ) -> tuple[dict[str, _Output], TreeSamples]:
        """``(outputs, samples)``: every feature with the rows of the batch's sampled tree nodes
        appended (dynarec.data.tdm_sampler), and what was sampled."""
        assert self.tdm is not None
        cfg, tree = self.tdm.cfg, self.tdm.tree
        items = self._int_ids(table, cfg.item_id_field, "data.tdm_sampler.item_id_field", "item", origin)
        leaves = tree.leaf_nodes(items)
        if (leaves < 0).any():
            i = int(np.nonzero(leaves < 0)[0][0])
            raise DataError(
                f"{origin.locate(i)}: item {items[i]} (column '{cfg.item_id_field}') is no leaf of the tree "
                f"{cfg.item_input_path} (data.tdm_sampler): build the tree over every item the data holds"
            )
        path, first, _ = origin.runs[0]
        samples = self.tdm.sample(leaves, f"{_draw_key(path)}:{first}")
        types = {c: table.schema.field(c).type for c in cfg.item_columns if c in table.schema.names}
        columns = node_columns(cfg, tree, samples.nodes, types)
        # An error names the node table and the rows the nodes were sampled for.
        where = RowOrigin(((f"{cfg.item_input_path} (the nodes sampled for {origin.label})", 0, len(samples.rows)),))
        extra = self._features(pa.table(columns), where, self.node_features)
        if self.mixed_features:
            rows = with_node_columns(table.take(pa.array(samples.rows)), columns)
            mixed = self._features(rows, where, self.mixed_inputs)
            extra.update({name: mixed[name] for name in self.mixed_features})
        outputs = {
            name: _appended(out, extra[name] if name in extra else _taken(out, samples.rows))
            for name, out in computed.items()
        }
        return outputs, samples

    def _int_ids(self, table: pa.Table, column: str, field: str, what: str, origin: RowOrigin) -> np.ndarray:
        values: Union[pa.Array, pa.ChunkedArray] = table.column(column)
        separator = self._sequence_separators.get(column)
        if separator is not None:  # hstu_match: the column of each row's candidates, their ids the positives
            values = sequence_elements(values, separator)
        try:
            return values.combine_chunks().cast(pa.int64()).to_numpy(zero_copy_only=False)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            raise DataError(
                f"{origin.label}: column '{column}' ({field}) holds something other than integer {what} ids"
            ) from None

    def _features(self, table: pa.Table, origin: RowOrigin, names: Optional[set[str]] = None) -> dict[str, _Output]:
        """Every feature (of ``names``, default all) computed over ``table``'s rows, each after
        the features it reads; a bad value is a DataError naming the row ``origin`` locates."""
        n = table.num_rows
        outputs: dict[str, pa.Array] = {}
        computed: dict[str, _Output] = {}
        for f in self.order:
            if names is not None and f.feature_name not in names:
                continue
            try:
                out = self._feature(f, table, outputs, origin, n)
            except RowError as e:
                raise DataError(f"{self._where(f, origin, e.row)}: {e.message}") from None
            computed[f.feature_name] = out
            if f.feature_name in self.referenced:
                outputs[f.feature_name] = _as_column(out, n)
        return computed

    def _kjt(self, computed: dict[str, _Output]) -> JaggedBatch:
        keys, values, lengths, weights = [], [], [], []
        for f in self.sparse_features:
            out = computed[f.feature_name]
            assert isinstance(out, _Ids)
            keys.append(f.feature_name)
            values.append(out.values)
            lengths.append(out.lengths)
            if self.weighted:
                weights.append(out.weights if out.weights is not None else np.ones(len(out.values), np.float32))
        kjt = JaggedBatch(
            keys,
            torch.from_numpy(np.concatenate(values)) if values else torch.empty(0, dtype=torch.int64),
            torch.from_numpy(np.concatenate(lengths)) if lengths else torch.empty(0, dtype=torch.int64),
            torch.from_numpy(np.concatenate(weights)) if weights else None,
        )
        # Worked out here (in a DataLoader worker, beside the ids): the training process checks
        # the ids against its tables from these, without a pass over them on its main thread.
        finite = None if not weights else bool(all(np.isfinite(w).all() for w in weights))
        return kjt.with_id_ranges([(int(v.min()), int(v.max())) if len(v) else (0, -1) for v in values], finite)

    def _check_sequence_groups(self, computed: dict[str, _Output], origin: RowOrigin) -> None:
        """The sequence features of one sequence group are concatenated position by position: in
        every row they must have the same length."""
        for names in self.sequence_groups:
            lengths: dict[str, np.ndarray] = {}
            for name in names:
                out = computed[name]
                assert isinstance(out, (_Ids, _DenseSequence))
                elements = out.elements if isinstance(out, _Ids) else None
                lengths[name] = elements if elements is not None else out.lengths
            first = names[0]
            for other in names[1:]:
                bad = np.nonzero(lengths[first] != lengths[other])[0]
                if bad.size:
                    i = int(bad[0])
                    raise DataError(
                        f"{origin.locate(i)}: sequence features '{first}' and '{other}' of one sequence group "
                        f"have {lengths[first][i]} and {lengths[other][i]} elements; every sequence of a group "
                        "needs one length per row (a dlrm_hstu model's history groups are one group, its candidate "
                        "groups another)"
                    )

    # -- where ---------------------------------------------------------------------------

    def _where(self, f: Feature, origin: RowOrigin, i: int) -> str:
        """Batch row ``i`` of feature ``f``, located in its source file."""
        inputs = f.inputs
        if len(inputs) == 1:
            what = f"column '{inputs[0].name}'" if not inputs[0].feature else f"input {inputs[0]}"
        else:
            what = "inputs " + ", ".join(f"'{i}'" for i in inputs)
        return f"{origin.locate(i)}: feature '{f.feature_name}' ({what})"

    # -- the kinds -----------------------------------------------------------------------

    def _input(self, inp: Input, table: pa.Table, outputs: dict[str, pa.Array], encoded: bool = False) -> pa.Array:
        """Input ``inp`` as one array; a dictionary-encoded column as its values, unless ``encoded``."""
        col = outputs[inp.name] if inp.feature else table.column(inp.name)
        if isinstance(col, pa.ChunkedArray):
            # (dictionary codes as they are, a slice of the codes decoded with them: copied by
            # combine_chunks, they would seem all there is; other columns are copied, as the C++
            # extension reads only writable memory and a loader's chunks are mapped read-only)
            col = one_chunk(col) if pa.types.is_dictionary(col.type) else col.combine_chunks()
        # (a dictionary-encoded column, as pandas' categoricals are written: its values, as any column's)
        return col.dictionary_decode() if pa.types.is_dictionary(col.type) and not encoded else col

    def _feature(self, f: Feature, table: pa.Table, outputs: dict[str, pa.Array], origin: RowOrigin, n: int):
        col = lambda i=0: self._input(f.inputs[i], table, outputs)
        if isinstance(f, (IdFeatureCfg, SequenceFeatureCfg)):
            return self._ids(f, self._input(f.inputs[0], table, outputs, encoded=True), origin)
        if isinstance(f, TokenizeFeatureCfg):
            return self._tokenize(f, col())
        if isinstance(f, OverlapFeatureCfg):
            x = overlap(jagged(col(0), f.separator), jagged(col(1), f.separator), f.method)
            return self._finish(f, x[:, None], np.ones(n, dtype=bool), origin)
        if isinstance(f, KvDotProductCfg):
            return self._kv_dot(f, col(0), col(1), origin, n)
        if isinstance(f, BoolMaskFeatureCfg):
            values, mask = jagged(col(0), f.separator), jagged(col(1), f.separator)
            kept, lengths = mask_values(values, mask)
            j = fill_missing(Jagged(kept, lengths, lengths == 0), f.default_value or None)
            return _Ids(self._bucketize(f, j.values, j.lengths, origin), j.lengths)
        if isinstance(f, RawFeatureCfg):
            return self._raw(f, col(), origin)
        if isinstance(f, SequenceRawFeatureCfg):
            return self._sequence_raw(f, col(), origin)
        if isinstance(f, ComboFeatureCfg):
            return self._combo(f, [col(i) for i in range(len(f.inputs))], origin)
        if isinstance(f, LookupFeatureCfg):
            return self._lookup(f, col(0), col(1), origin, n)
        if isinstance(f, MatchFeatureCfg):
            return self._match(f, table, outputs, origin, n)
        if isinstance(f, ExprFeatureCfg):
            return self._expr(f, [col(i) for i in range(len(f.inputs))], origin, n)
        assert isinstance(f, CustomFeatureCfg)
        return self._custom(f, [col(i) for i in range(len(f.inputs))], origin, n)

    def _ids(self, f: Union[IdFeatureCfg, SequenceFeatureCfg], col: pa.Array, origin: RowOrigin) -> _Ids:
        if pa.types.is_dictionary(col.type):
            by_value = self._ids_by_value(f, col)
            if by_value is not None:
                return by_value
            col = col.dictionary_decode()
        dv = f.default_value
        numbers = isinstance(f, IdFeatureCfg) and f.boundaries is not None  # (bucketized: a NaN is no number)
        if not numbers and pa.types.is_floating(col.type) and len(col) and pc.any(pc.is_nan(col)).as_py():
            col = pc.if_else(pc.is_nan(col), pa.scalar(None, col.type), col)  # a NaN id is missing, as a null
        if dv is None and col.null_count:
            raise DataError(f"{self._where(f, origin, int(pc.index(col.is_null(), True).as_py()))}: missing value")
        if isinstance(f, IdFeatureCfg) and f.max_values is not None:
            col = self._first_of_rows(f, col, origin)
        if isinstance(f, IdFeatureCfg) and f.weighted:
            return self._weighted(f, col, origin)
        if isinstance(f, IdFeatureCfg) and f.boundaries is not None:
            return self._bucketized_numbers(f, col, origin)
        if isinstance(f, SequenceFeatureCfg) and f.several_ids_an_element:
            return self._element_ids(f, col, origin)
        if isinstance(f, SequenceFeatureCfg) and _is_string(col.type):
            col = _first_values(col, f.separator, f.value_separator)
        separator = f.separator if isinstance(f, SequenceFeatureCfg) or f.separator else None
        t = col.type
        plan = self.plans[f.feature_name]
        if dv is None and plan.kind not in _VOCABS and not _is_list(t):
            if separator is None:  # one value a row, none missing
                if _is_string(t) and len(col):
                    empty = pc.equal(pc.utf8_length(col), 0)
                    if empty.true_count:  # as a null: the value is missing
                        raise DataError(
                            f"{self._where(f, origin, int(pc.index(empty, True).as_py()))}: missing value (an empty "
                            'string; a default_value fills a missing value, "" for no id)'
                        )
                lengths = np.ones(len(col), dtype=np.int64)
                return _Ids(self._token_ids(f, col, lengths, origin), lengths)
        if plan.kind not in _VOCABS and separator is not None and _is_string(t):
            ids_ = self._split_natively(f, col, separator, origin)
            if ids_ is not None:
                return ids_
        j = jagged(col, separator, empty_token=dv)
        if _is_list(t) and _is_string(j.values.type) and plan.kind not in _VOCABS:  # "" as an empty token
            # (a vocabulary looks "" up as any word, in a list as one a row)
            try:
                values, lengths = empty_tokens(
                    j.values, j.lengths, dv, 'an empty string in the list (a default_value fills it, "" drops it)'
                )
            except RowError as e:
                raise DataError(f"{self._where(f, origin, e.row)}: {e.message}") from None
            j = Jagged(values, lengths, j.missing)
        if dv is not None:
            empty = None
            if separator is None and _is_string(t) and len(j.values):  # one value a row: "" is missing
                empty = np.asarray(pc.fill_null(pc.equal(pc.utf8_length(col), 0), False))
            elif _is_list(t):  # an empty list is missing, as TorchEasyRec's feature generation reads it
                empty = j.lengths == 0
            j = fill_missing(j, dv, empty)
        ids = self._bucketize(f, j.values, j.lengths, origin)
        return _Ids(*_keep_last(f, ids, j.lengths))

    def _ids_by_value(self, f: Union[IdFeatureCfg, SequenceFeatureCfg], col: pa.DictionaryArray) -> Optional[_Ids]:
        """A dictionary-encoded string column's ids, worked out once for each distinct value and
        taken for each row: what the row-by-row path gives, as a row's ids depend on its value
        alone. The values' ids are kept while the next slices' dictionary is the same (the same
        buffers, or equal values: a Parquet row group's batches each hold a copy of its
        dictionary, and so do a loader's chunks of it).

        None where the row path runs: until the rows read with these values (or the rows decoded
        with them, of which ``col`` is a slice) are as many as the values, so that working them
        out never costs more than the rows did; for a row missing without a default; for ids of
        several elements; and after an error in any value (some row may not hold it; the row
        path names the row that does)."""
        if f.default_value is None and col.null_count:
            return None
        values = col.dictionary
        key = (values.offset, len(values), *(0 if b is None else b.address for b in values.buffers()))
        seen = self._by_value.get(f.feature_name)
        if seen is None or seen.key != key:
            if seen is not None and len(seen.values) == len(values) and seen.values.equals(values):
                seen.key, seen.values = key, values  # (a copy: the same values)
            elif _is_string(values.type) and not values.null_count:
                seen = self._by_value[f.feature_name] = _SeenValues(key, values)
            else:
                return None
        seen.rows += len(col)
        if not seen.worked_out:
            decoded = col.indices.buffers()[1].size // col.indices.type.byte_width  # (a slice's buffer is all of them)
            if max(seen.rows, decoded) < len(values):
                return None
            seen.work_out(lambda read: self._ids(f, read, RowOrigin.of("", len(read))), f.default_value is not None)
        if seen.ids is None:
            return None
        codes = col.indices.cast(pa.int64()).fill_null(len(values)) if col.null_count else col.indices
        return seen.ids.take(codes.to_numpy(zero_copy_only=False))

    def _split_natively(
        self, f: Union[IdFeatureCfg, SequenceFeatureCfg], col: pa.Array, separator: str, origin: RowOrigin
    ) -> Optional[_Ids]:
        """A separator-joined string column's ids in the C++ extension's one pass (split, then
        hash or parse), or None where pyarrow's path is needed. Without a default every field is
        present and an empty token is an error. A default of "" (TorchEasyRec's) adds nothing:
        null and empty fields hold no id and empty tokens are dropped. Another default is taken
        here only where no field is missing (pyarrow's path fills it in)."""
        dv = f.default_value
        plan = self.plans[f.feature_name]
        if dv is not None and col.null_count:
            col = pc.fill_null(col, "")
        drop_empty = dv == ""
        if plan.hashed:
            hashed = native.split_hash(col, separator, plan.modulus, plan.hash_function, drop_empty)
            if hashed is None:
                return None
            ids, lengths, bad = hashed
            if bad >= 0:
                if dv is None:
                    raise self._empty_token(f, origin, bad, separator)
                return None
        else:
            parsed = native.split_parse_int64(col, separator, drop_empty)
            if parsed is None:
                return None
            ids, lengths = parsed
        if dv and not lengths.all():
            return None
        if not plan.hashed:
            ids = self._checked_range(f, ids, lengths, origin)
        return _Ids(*_keep_last(f, ids, lengths))

    def _element_ids(self, f: SequenceFeatureCfg, col: pa.Array, origin: RowOrigin) -> _Ids:
        """Several ids an element (``value_dim: 0``): elements split on ``separator`` (the last
        ``sequence_length`` kept; a missing row holds ``default_value``'s one element), each
        element's ids on ``value_separator``. The KJT gets every id of a row; the batch, the ids
        of each element."""
        outer = jagged(col, f.separator, empty_token=None, what="sequence")
        if f.default_value is not None:  # (an empty list too, as TorchEasyRec's feature generation reads it)
            outer = fill_missing(outer, f.default_value, outer.lengths == 0 if _is_list(col.type) else None)
        index, elements = keep_last(np.arange(len(outer.values)), outer.lengths, f.sequence_length)
        kept = outer.values if len(index) == len(outer.values) else outer.values.take(pa.array(index))
        row_of_element = np.repeat(np.arange(len(elements)), elements)
        try:
            inner = jagged(kept, f.value_separator, what="sequence element")
            empty = np.nonzero(inner.lengths == 0)[0]
            if empty.size:
                raise RowError(int(empty[0]), "a sequence element without ids")
        except RowError as e:  # located by element: the element's row
            raise RowError(int(row_of_element[e.row]), e.message) from None
        ids_per_row = np.bincount(row_of_element, weights=inner.lengths, minlength=len(elements)).astype(np.int64)
        ids = self._bucketize(f, inner.values, ids_per_row, origin)
        return _Ids(ids, ids_per_row, element_lengths=inner.lengths.astype(np.int64), elements=elements)

    def _tokenize(self, f: TokenizeFeatureCfg, col: pa.Array) -> _Ids:
        """Texts -> token ids: a string column (a list column: each text's tokens in order),
        each text normalized, then ``default_value`` in place of a text left empty and of a row
        without one (``""``: no ids), then tokenized. Each distinct text of the batch is
        normalized and tokenized once (titles repeat across rows)."""
        j = jagged(col, None)
        counts, dv = j.lengths, f.default_value
        encoded = as_strings(j.values).dictionary_encode()
        distinct = encoded.dictionary.to_pylist()
        if f.text_normalizer is not None:
            normalize = f.text_normalizer.normalizer()
            distinct = [normalize(t) for t in distinct]
        distinct = [t or dv for t in distinct] + [dv]  # the last: a row without a text (not normalized)
        token_ids, per_distinct = f.tokenizer().encode(distinct)
        index = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        if dv and not counts.all():  # a row without a text holds the default's one text
            texts = np.where(counts == 0, 1, counts)
            row = np.repeat(np.arange(len(counts)), counts)
            placed = np.full(int(texts.sum()), len(distinct) - 1, dtype=np.int64)
            placed[offsets_of(texts)[:-1][row] + np.arange(len(index)) - offsets_of(counts)[:-1][row]] = index
            index, counts = placed, texts
        per_text = per_distinct[index]
        starts = offsets_of(per_distinct)[:-1][index]
        gather = np.repeat(starts - offsets_of(per_text)[:-1], per_text) + np.arange(int(per_text.sum()))
        lengths = np.bincount(np.repeat(np.arange(len(counts)), counts), weights=per_text, minlength=len(counts))
        return _Ids(token_ids[gather], lengths.astype(np.int64))

    def _kv_dot(self, f: KvDotProductCfg, query: pa.Array, document: pa.Array, origin: RowOrigin, n: int):
        """kv_dot_product: each input's ``(keys, weights, lengths)`` (a map column's entries, or
        ``key:weight`` terms split on ``separator``: the weight after the last ``kv_delimiter``, 1
        without one), their dot products; a row missing either side takes ``default_value``."""

        def weighted(col: pa.Array, what: str):
            if pa.types.is_map(col.type):
                lengths, keys, w = map_entries(col)
                return as_strings(keys), numbers(w, lengths, f"{what} weight"), lengths
            j = jagged(col, f.separator)
            terms = as_strings(j.values)
            has = pc.match_substring(terms, f.kv_delimiter)  # a key alone weighs 1
            terms = pc.if_else(has, terms, pc.binary_join_element_wise(terms, "1", f.kv_delimiter))
            parts = pc.split_pattern(terms, f.kv_delimiter, max_splits=1, reverse=True)
            keys = pc.list_element(parts, 0)
            w = numbers(pc.list_element(parts, 1), j.lengths, f"{what} weight")
            return keys, w, j.lengths

        dots, empty = kv_dot(weighted(query, "query"), weighted(document, "document"))
        return self._finish(f, dots[:, None], ~empty, origin)

    def _first_of_rows(self, f: IdFeatureCfg, col: pa.Array, origin: RowOrigin) -> pa.Array:
        """``col`` with each row cut to its first ``f.max_values`` values: a list column's
        elements, a string column's ``separator``-joined values (TorchEasyRec's ``value_dim``)."""
        k = f.max_values
        assert k is not None
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        if _is_list(col.type):
            return pc.list_slice(col, 0, k)
        if pa.types.is_map(col.type):
            raise DataError(
                f"{self._where(f, origin, 0)}: max_values cuts a list or a string of values; a map column's entries "
                "have no order to keep the first of"
            )
        if not _is_string(col.type) or f.separator is None or not _holds(col, f.separator):  # one value a row
            return col
        return pc.binary_join(pc.list_slice(pc.split_pattern(col, f.separator, max_splits=k), 0, k), f.separator)

    def _weighted(self, f: IdFeatureCfg, col: pa.Array, origin: RowOrigin) -> _Ids:
        """``id:weight`` pairs (joined by ``separator``, default ``\\x1d``; or a list of them), or
        a map column ``id -> weight``: the ids bucketized, the weights per id."""
        if pa.types.is_map(col.type):
            null = col.is_null().to_numpy(zero_copy_only=False)
            lengths, keys, w = map_entries(col)
            j = Jagged(keys, lengths, null)
            if f.default_value:  # "id:weight"
                key, _, weight = f.default_value.rpartition(":")
                keys = fill_missing(Jagged(keys, j.lengths, null), key).values
                w = fill_missing(Jagged(as_strings(w), j.lengths, null), weight).values
                j = Jagged(keys, np.where(null, 1, j.lengths), null)
            weights = numbers(w, j.lengths, "weight")
            tokens, lengths = j.values, j.lengths
        else:
            j = jagged(col, f.separator or "\x1d", empty_token=f.default_value)
            j = fill_missing(j, f.default_value)
            tokens, lengths = as_strings(j.values), j.lengths
            parts = pc.split_pattern(tokens, ":", max_splits=1, reverse=True)
            bad = pc.not_equal(pc.list_value_length(parts), 2)
            if bad.true_count:
                i = int(pc.index(bad, True).as_py())
                raise RowError(
                    _row(lengths, i), f"weighted value {tokens[i].as_py()!r} is not 'id:weight' (a ':' between them)"
                )
            tokens = pc.list_element(parts, 0)
            weights = numbers(pc.list_element(parts, 1), lengths, "weight")
        bad_w = np.nonzero(~np.isfinite(weights))[0]
        if bad_w.size:
            raise RowError(_row(lengths, int(bad_w[0])), f"weight {weights[bad_w[0]]} is not a finite number")
        ids = self._bucketize(f, tokens, lengths, origin)
        return _Ids(ids, lengths, weights.astype(np.float32))

    def _bucketized_numbers(self, f: IdFeatureCfg, col: pa.Array, origin: RowOrigin) -> _Ids:
        """An id_feature with boundaries: a number a row -> its bucket."""
        col = _empty_as_null(col)
        if f.default_value is None:
            x = self._finite_float64(f, col, origin, " (boundaries)")
            return _Ids(_buckets(_boundaries(f), x), np.ones(len(col), dtype=np.int64))
        j = fill_missing(jagged(col, None), f.default_value)
        x = self._finite(f, numbers(j.values, j.lengths), j.lengths, origin, " (boundaries)")
        return _Ids(_buckets(_boundaries(f), x), j.lengths)

    def _bucketize(self, f: Feature, tokens: pa.Array, lengths: np.ndarray, origin: RowOrigin) -> np.ndarray:
        """Values -> ids by the feature's bucketizer (vocabulary, boundaries, hash, or integer
        ids, range-checked for a fixed table)."""
        kind = self.plans[f.feature_name].kind
        if kind in _VOCABS:
            return f.vocabulary().lookup(as_strings(tokens))
        if kind == "boundaries":
            x = self._finite(f, numbers(tokens, lengths), lengths, origin, " (boundaries)")
            return _buckets(_boundaries(f), x)
        return self._token_ids(f, tokens, lengths, origin)

    def _empty_token(self, f: Feature, origin: RowOrigin, row: int, separator: str) -> DataError:
        return DataError(
            f"{self._where(f, origin, row)}: malformed multi-value field (empty token between '{separator}' separators)"
        )

    def _finite_float64(self, f: Feature, col, origin: RowOrigin, what: str = "") -> np.ndarray:
        """A number per row as float64; DataError naming the row of a missing, NaN or infinite
        value (``what``: a note on why the feature needs numbers)."""
        x = _float64(col, lambda i: self._where(f, origin, i), origin.label)
        return self._finite(f, x, None, origin, what)

    def _finite(
        self, f: Feature, x: np.ndarray, lengths: Optional[np.ndarray], origin: RowOrigin, what: str = ""
    ) -> np.ndarray:
        """``x`` (numbers of rows of ``lengths``; None: one a row); DataError naming the row of a
        NaN or infinite one."""
        if np.isfinite(x).all():
            return x
        i = int(np.nonzero(~np.isfinite(x))[0][0])
        row = _row(lengths, i) if lengths is not None else i
        raise DataError(f"{self._where(f, origin, row)}: value {x[i]} is not a finite number{what}")

    def _token_ids(self, f, tokens: pa.Array, lengths: np.ndarray, origin: RowOrigin) -> np.ndarray:
        is_string = _is_string(tokens.type)
        plan = self.plans[f.feature_name]
        if plan.hashed:  # a string column in C++ where the extension is built; the string form of others
            return hash_buckets(as_strings(tokens), plan.modulus, plan.hash_function)
        if is_string:
            try:  # most ids have no surrounding whitespace: trim only when the plain cast fails
                tokens = _cast_int64(tokens)
            except pa.ArrowInvalid:
                strings = tokens.to_pylist()
                i = next(k for k, s in enumerate(strings) if not _is_int64(s))
                why = "does not fit int64" if _is_int(strings[i]) else "value_type 'int' expects integer ids"
                raise DataError(
                    f"{self._where(f, origin, _row(lengths, i))}: malformed value {strings[i]!r} ({why})"
                ) from None
        elif not pa.types.is_integer(tokens.type):
            raise DataError(
                f"{origin.label}: feature '{f.feature_name}' ({_inputs(f)}) has type "
                f"{tokens.type}; value_type 'int' expects integers"
            )
        elif tokens.type == pa.uint64() and len(tokens) and pc.max(tokens).as_py() >= 1 << 63:
            i = int(pc.index(pc.greater_equal(tokens, pa.scalar(1 << 63, pa.uint64())), True).as_py())
            raise DataError(
                f"{self._where(f, origin, _row(lengths, i))}: id {tokens[i].as_py()} does not fit int64 "
                "(uint64 ids of 2^63 and more would wrap to negative keys)"
            )
        ids = tokens.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        return self._checked_range(f, ids, lengths, origin)

    def _checked_range(self, f, ids: np.ndarray, lengths: np.ndarray, origin: RowOrigin) -> np.ndarray:
        """``ids``; DataError naming the row of the first id outside a fixed table's rows."""
        plan = self.plans[f.feature_name]
        if not plan.dynamic and ids.size:
            rows = plan.rows
            assert rows is not None
            if int(ids.min()) < 0 or int(ids.max()) >= rows:
                i = int(np.nonzero((ids < 0) | (ids >= rows))[0][0])
                raise DataError(
                    f"{self._where(f, origin, _row(lengths, i))}: id {int(ids[i])} is out of range "
                    f"[0, {rows}) (num_buckets)"
                )
        return ids

    # -- numbers ---------------------------------------------------------------------------

    def _raw(self, f: RawFeatureCfg, col: pa.Array, origin: RowOrigin) -> _Output:
        k = f.value_dim
        if k == 1:
            col = _empty_as_null(col)
        if k == 1 and not _is_list(col.type) and (f.default_value is None or not col.null_count):
            if f.default_value is None and col.null_count:
                i = int(pc.index(col.is_null(), True).as_py())
                raise DataError(
                    f"{self._where(f, origin, i)}: missing value (a dense feature needs a number; a null, or in CSV "
                    "an empty field or a null marker: NaN, null, N/A, NA...; a default_value fills it)"
                )
            x = self._finite_float64(f, col, origin)[:, None]
            present = np.ones(len(col), dtype=bool)
        else:
            j = jagged(col, f.separator if k > 1 else None)
            x = numbers(j.values, j.lengths)
            present = ~j.missing
            if f.default_value is not None and _is_list(col.type):  # an empty list is missing too
                present &= j.lengths > 0
            x = self._finite(f, x, j.lengths, origin)
            full = np.zeros((len(col), k))
            full[present] = vectors(x, j.lengths[present], k, np.nonzero(present)[0])
            x = full
        return self._finish(f, x, present, origin)

    def _finish(self, f: Feature, x: np.ndarray, present: np.ndarray, origin: RowOrigin) -> _Output:
        """Numbers ``[B, k]`` of the rows ``present`` -> normalized; the other rows take the
        default (not normalized); then ids (boundaries) or dense numbers."""
        k = x.shape[1]
        every = bool(present.all())
        raw = x
        if getattr(f, "normalizer", None) is not None:
            if every:
                x = self._normalized(f, x.reshape(-1), None, k, origin).reshape(-1, k)
            elif present.any():
                x = x.copy()
                rows = np.repeat(np.nonzero(present)[0], k)
                x[present] = self._normalized(f, x[present].reshape(-1), rows, k, origin).reshape(-1, k)
        no_value = None
        if not every:
            dv = getattr(f, "default_value", None)
            missing = ~present
            if dv is None:
                raise DataError(f"{self._where(f, origin, int(np.nonzero(missing)[0][0]))}: missing value")
            if dv == "":
                no_value = missing
            else:
                x = x.copy()
                x[missing] = _default_numbers(f, dv, k)
        if self.plans[f.feature_name].kind == "boundaries":
            if no_value is None:
                per_row = np.full(len(x), k, dtype=np.int64)
                values = x.reshape(-1)
            else:
                per_row = np.where(no_value, 0, k).astype(np.int64)
                values = x[~no_value].reshape(-1)
            values = self._finite(f, values, per_row, origin, " (boundaries)")
            return _Ids(_buckets(_boundaries(f), values), per_row)
        return self._dense_out(f, x, origin, raw if raw is not x else None)

    def _dense_out(self, f: Feature, x: np.ndarray, origin: RowOrigin, raw: Optional[np.ndarray] = None) -> _Dense:
        """Numbers ``[B, k]`` -> the model's float32; DataError naming the row of a value that is
        not finite there (``raw``: the numbers before the normalizer, for the message)."""
        with np.errstate(over="ignore", invalid="ignore"):
            x32 = x.astype(np.float32)
        if not np.isfinite(x32).all():
            i = int(np.nonzero(~np.isfinite(x32).all(axis=1))[0][0])
            if not np.isfinite(x[i]).all():
                raise DataError(f"{self._where(f, origin, i)}: value {x[i].tolist()} is not finite")
            v, r = x[i].tolist(), (raw[i].tolist() if raw is not None else None)
            if len(v) == 1:
                shown = f"value {r[0] if r is not None else v[0]:g}"
                shown += f" (normalized: {v[0]:g})" if r is not None and r[0] != v[0] else ""
            else:
                shown = f"value {r if r is not None else v}" + (
                    f" (normalized: {v})" if r is not None and r != v else ""
                )
            raise DataError(
                f"{self._where(f, origin, i)}: {shown} is beyond float32's range (about ±3.4e38); "
                "scale the feature or give it a normalizer"
            )
        if x.shape[1] == 1:
            return _Dense(x32.reshape(-1), x.reshape(-1))
        return _Dense(x32, x)

    def _normalized(
        self, f: Feature, x: np.ndarray, rows: Optional[np.ndarray], k: int, origin: RowOrigin
    ) -> np.ndarray:
        """``x`` (numbers; number ``i`` of batch row ``rows[i]``, or ``i // k`` when None) through
        the feature's normalizer; DataError naming the row where the result is not finite."""
        norm = getattr(f, "normalizer", None)
        if norm is None:
            return x
        row = lambda i: int(rows[i]) if rows is not None else i // k
        raw = x
        if norm.expression is not None:
            x = Expression(norm.expression)(x)
            if not np.isfinite(x).all():
                i = int(np.nonzero(~np.isfinite(x))[0][0])
                raise DataError(
                    f"{self._where(f, origin, row(i))}: normalizer {norm.expression!r} gives {x[i]} for this "
                    f"row's value {raw[i]:g}; the expression must be finite on the data"
                )
        if norm.log1p:
            if (x <= -1).any():
                i = int(np.nonzero(x <= -1)[0][0])
                raise DataError(f"{self._where(f, origin, row(i))}: log1p normalizer needs values > -1, got {x[i]}")
            x = np.log1p(x)
        return (x - norm.mean) / norm.std

    def _sequence_raw(self, f: SequenceRawFeatureCfg, col: pa.Array, origin: RowOrigin) -> _Output:
        dv = f.default_value
        if dv is None and col.null_count:
            raise DataError(f"{self._where(f, origin, int(pc.index(col.is_null(), True).as_py()))}: missing value")
        k = f.value_dim
        if _is_list(col.type) and _is_list(col.type.value_type):  # list<list<number>>: elements of k
            elements = jagged(col, None)
            inner = jagged(elements.values, None, what="element")
            x = numbers(inner.values, inner.lengths)
            x = vectors(x, inner.lengths, k, np.repeat(np.arange(len(col)), elements.lengths), "an element")
            lengths = elements.lengths
            if dv:
                lengths, x = _with_default_element(lengths, x, elements.missing, _default_numbers(f, dv, k))
        else:
            if dv and k > 1 and len(dv.split(f.value_separator)) == 1:  # one number: the element of k of it
                dv = f.value_separator.join([dv] * k)
            elements = jagged(col, f.separator, empty_token=dv, what="sequence")
            elements = fill_missing(elements, dv)
            lengths = elements.lengths
            if k == 1:
                x = numbers(elements.values, lengths)[:, None]
            else:
                inner = jagged(as_strings(elements.values), f.value_separator, what="element")
                x = numbers(inner.values, inner.lengths)
                x = vectors(x, inner.lengths, k, np.repeat(np.arange(len(col)), lengths), "an element")
        x = self._finite(f, x.reshape(-1), np.repeat(lengths, k), origin).reshape(-1, k)
        x, lengths = keep_last(x, lengths, f.sequence_length)
        rows = np.repeat(np.arange(len(col)), lengths)
        if f.normalizer is not None and len(x):
            x = self._normalized(f, x.reshape(-1), np.repeat(rows, k), k, origin).reshape(-1, k)
        if f.bucketizer == "boundaries":
            return _Ids(_buckets(_boundaries(f), x[:, 0]), lengths)
        with np.errstate(over="ignore"):
            x32 = x.astype(np.float32)
        bad = np.nonzero(~np.isfinite(x32).all(axis=1))[0]
        if bad.size:
            i = int(bad[0])
            raise DataError(
                f"{self._where(f, origin, int(rows[i]))}: value {x[i].tolist()} is beyond float32's range "
                "(about ±3.4e38); scale the feature or give it a normalizer"
            )
        return _DenseSequence(x32, lengths)

    # -- multi-input kinds -----------------------------------------------------------------

    def _combo(self, f: ComboFeatureCfg, cols: list[pa.Array], origin: RowOrigin) -> _Ids:
        parts = [jagged(c, f.separator, empty_token="") for c in cols]
        strings, lengths = product(parts)
        j = fill_missing(Jagged(strings, lengths, lengths == 0), f.default_value)
        return _Ids(self._bucketize(f, j.values, j.lengths, origin), j.lengths)

    def _map_entries(self, col: pa.Array, separator: str, what: str) -> tuple[np.ndarray, pa.Array, pa.Array]:
        """A map column's ``(row, key, value)`` entries: a map type, or ``k:v`` strings joined by
        ``separator`` (or a list of them)."""
        if pa.types.is_map(col.type):
            lengths, keys, values = map_entries(col)
            return np.repeat(np.arange(len(col)), lengths), keys, values
        j = jagged(col, separator, empty_token="", what=what)
        pairs = pc.split_pattern(as_strings(j.values), ":", max_splits=1)
        bad = pc.not_equal(pc.list_value_length(pairs), 2)
        if bad.true_count:
            i = int(pc.index(bad, True).as_py())
            raise RowError(_row(j.lengths, i), f"malformed {what} entry {j.values[i].as_py()!r} (expected key:value)")
        return j.rows, pc.list_element(pairs, 0), pc.list_element(pairs, 1)

    def _found(
        self, f: Union[LookupFeatureCfg, MatchFeatureCfg], values: pa.Array, rows: np.ndarray, n: int, origin
    ) -> _Output:
        """The values found for each row (``rows`` ascending) -> ids (discrete) or numbers
        combined by the combiner; a row with none takes the default."""
        counts = np.bincount(rows, minlength=n).astype(np.int64)
        if f.discrete:
            j = fill_missing(Jagged(values, counts, counts == 0), f.default_value)
            if f.bucketizer == "boundaries":  # need_discrete: every value its own bucket
                x = numbers(j.values, j.lengths)
                present_rows = np.repeat(np.arange(n), j.lengths)
                if f.normalizer is not None and len(x):
                    found = np.repeat(counts > 0, j.lengths)
                    x[found] = self._normalized(f, x[found], present_rows[found], 1, origin)
                x = self._finite(f, x, j.lengths, origin, " (boundaries)")
                return _Ids(_buckets(_boundaries(f), x), j.lengths)
            return _Ids(self._bucketize(f, j.values, j.lengths, origin), j.lengths)
        k = getattr(f, "value_dim", 1)
        if k == 1:
            x = numbers(values, counts)
        else:
            inner = jagged(as_strings(values), getattr(f, "value_separator"), what="value")  # noqa: B009
            x = vectors(numbers(inner.values, inner.lengths), inner.lengths, k, rows, "a value found")
        x = self._finite(f, x.reshape(-1), np.repeat(counts, k), origin).reshape(len(rows), k)
        combined, has = combine(x, rows, n, f.combiner)
        return self._finish(f, combined.reshape(n, k), has, origin)

    def _lookup(self, f: LookupFeatureCfg, map_col: pa.Array, key_col: pa.Array, origin: RowOrigin, n: int):
        rows, keys, values = self._map_entries(map_col, f.separator, "map")
        query = jagged(key_col, f.separator, empty_token="")
        found, entry = join_keys(rows, [keys], query.rows, [query.values])
        return self._found(f, values.take(pa.array(entry)), query.rows[found], n, origin)

    def _nested_entries(self, col: pa.Array, separator: str) -> tuple[np.ndarray, pa.Array, pa.Array, pa.Array]:
        """A nested map's ``(row, pkey, skey, value)`` entries: ``"pk^sk:v,sk:v|pk^..."`` strings,
        a map column ``pk -> "sk:v,sk:v"``, or a map of maps."""
        if pa.types.is_map(col.type):
            rows, pkeys, inner = self._map_entries(col, separator, "nested map")
            if pa.types.is_map(inner.type):
                inner_rows, skeys, values = self._map_entries(inner, separator, "nested map")
                return rows[inner_rows], pkeys.take(pa.array(inner_rows)), skeys, values
            entries, pk = as_strings(inner), pkeys
        else:
            j = jagged(col, "|", empty_token="", what="nested map")
            parts = pc.split_pattern(as_strings(j.values), "^", max_splits=1)
            bad = pc.not_equal(pc.list_value_length(parts), 2)
            if bad.true_count:
                i = int(pc.index(bad, True).as_py())
                raise RowError(
                    _row(j.lengths, i), f"malformed nested map entry {j.values[i].as_py()!r} (expected pkey^skey:value)"
                )
            rows, pk, entries = j.rows, pc.list_element(parts, 0), pc.list_element(parts, 1)
        inner_j = jagged(entries, ",", empty_token="", what="nested map")
        inner_rows, skeys, values = self._map_entries(inner_j.values, ",", "nested map")
        owner = inner_j.rows[inner_rows]  # the entry each skey:value belongs to
        return rows[owner], pk.take(pa.array(owner)), skeys, values

    def _match(self, f: MatchFeatureCfg, table, outputs, origin: RowOrigin, n: int):
        col = self._input(parse_input(f.nested_map), table, outputs)
        rows, pkeys, skeys, values = self._nested_entries(col, f.separator)
        table_keys, queries = [], []
        query_rows: Optional[np.ndarray] = None
        for name, keys in (("pkey", pkeys), ("skey", skeys)):
            ref = getattr(f, name)
            if ref == "ALL":
                continue
            q = jagged(self._input(parse_input(ref), table, outputs), f.separator, empty_token="")
            table_keys.append(keys)
            queries.append(q)
        if not queries:
            hit = np.arange(len(rows))
        else:
            if len(queries) == 2:  # every (pkey, skey) pair of a row
                (q_rows, a, b) = _pairs(queries[0], queries[1])
                query_values = [queries[0].values.take(pa.array(a)), queries[1].values.take(pa.array(b))]
                query_rows = q_rows
            else:
                query_values, query_rows = [queries[0].values], queries[0].rows
            # Every entry whose (row, keys) some query asks for, in the map's order.
            hit, _ = join_keys(query_rows, query_values, rows, table_keys)
        return self._found(f, values.take(pa.array(hit)), rows[hit], n, origin)

    def _expr(self, f: ExprFeatureCfg, cols: list[pa.Array], origin: RowOrigin, n: int) -> _Output:
        present = np.ones(n, dtype=bool)
        parsed = []
        for c in cols:
            j = jagged(c, f.separator)
            x = numbers(j.values, j.lengths)
            present &= ~j.missing & (j.lengths > 0)
            parsed.append((x, j.lengths))
        formula = f.formula()
        names = f.variable_names
        env: dict[str, np.ndarray] = {}
        ragged = False
        for name, (x, lengths) in zip(names, parsed):
            widths = set(lengths[present].tolist())
            if len(widths) > 1:
                ragged = True
                break
            m = widths.pop() if widths else 1
            full = np.zeros((n, m))
            full[present] = x[np.repeat(present, lengths)].reshape(-1, m)
            env[name] = full[:, 0] if m == 1 else full
        if not ragged:
            try:
                out = formula.evaluate(env, n)
            except ValueError:  # vectors of different lengths: row by row
                ragged = True
        if ragged:  # per-row Python: variables of different lengths row to row
            starts = {name: offsets_of(lengths) for name, (_, lengths) in zip(names, parsed)}
            out = np.zeros(n)
            for r in np.nonzero(present)[0]:
                row_env = {
                    name: x[starts[name][r] : starts[name][r + 1]][None, :] for name, (x, _) in zip(names, parsed)
                }
                v = formula.evaluate(row_env, 1)
                if v.ndim != 1:
                    raise RowError(int(r), f"expression {f.expression!r} gives {v.shape[1]} numbers; it must give one")
                out[r] = v[0]
        if out.ndim != 1:
            raise RowError(0, f"expression {f.expression!r} gives {out.shape[1]} numbers a row; it must give one")
        result = np.where(present, out, 0.0)
        bad = np.nonzero(present & ~np.isfinite(out))[0]
        if bad.size:
            i = int(bad[0])
            shown = ", ".join(f"{name}={_shown(x, lengths, i)}" for name, (x, lengths) in zip(names, parsed))
            raise RowError(i, f"expression {f.expression!r} gives {out[i]} for this row ({shown})")
        return self._finish(f, result[:, None], present, origin)

    def _custom(self, f: CustomFeatureCfg, cols: list[pa.Array], origin: RowOrigin, n: int) -> _Output:
        if f.operator_name == "RegexReplace":
            return self._regex_replace(f, cols[0], origin)
        present = np.ones(n, dtype=bool)
        strings = []
        for c in cols:
            if _is_list(c.type):
                raise DataError(f"{origin.label}: feature '{f.feature_name}': EditDistance takes strings, not lists")
            s = as_strings(c)
            present &= ~np.asarray(pc.fill_null(pc.equal(pc.utf8_length(s), 0), True))
            strings.append(s)
        keep = pa.array(present)
        d = np.zeros(n)
        if present.any():
            d[present] = edit_distance(strings[0].filter(keep), strings[1].filter(keep), f.encoding == "utf-8")
        if f.bucketizer in (None, "boundaries"):
            return self._finish(f, d[:, None], present, origin)
        values = pc.cast(pa.array(d[present].astype(np.int64)), pa.string())
        return self._ids_where_present(f, values, present, origin)

    def _regex_replace(self, f: CustomFeatureCfg, col: pa.Array, origin: RowOrigin) -> _Ids:
        """RegexReplace: each string with every match replaced (pyarrow's RE2, vectorized), then
        bucketized; a missing or empty string (or one the replacement empties) is
        ``default_value`` (``""``: no id)."""
        if _is_list(col.type):
            raise DataError(f"{origin.label}: feature '{f.feature_name}': RegexReplace takes strings, not lists")
        pattern, replacement = f.replacement
        out = pc.replace_substring_regex(as_strings(col), pattern, replacement)
        present = np.asarray(pc.fill_null(pc.greater(pc.utf8_length(out), 0), False).to_numpy(zero_copy_only=False))
        return self._ids_where_present(f, out.filter(pa.array(present)), present, origin)

    def _ids_where_present(self, f: CustomFeatureCfg, values: pa.Array, present: np.ndarray, origin: RowOrigin) -> _Ids:
        """One value a row where ``present`` (``values``, theirs in order), ``default_value`` in the
        other rows (``""``: no id), bucketized."""
        j = fill_missing(Jagged(values, present.astype(np.int64), ~present), f.default_value)
        return _Ids(self._bucketize(f, j.values, j.lengths, origin), j.lengths)

    # -- labels ----------------------------------------------------------------------------

    def _labels(self, col, name: str, origin: RowOrigin, counts: Optional[np.ndarray] = None) -> torch.Tensor:
        """Label column ``name`` as float32 ``[B]``: finite numbers, and class indices (0 or 1 for
        a binary task; integers from 0 for a bitmask) where a classification task reads it. With
        ``counts`` (each row's candidates) the column holds a list a row, one value a candidate:
        ``[sum(counts)]``, row after row."""
        locate = lambda i: f"{origin.locate(i)}: label column '{name}'"
        if counts is not None:
            col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
            if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
                raise DataError(
                    f"{origin.label}: label column '{name}' has type {col.type}; the model scores each row's "
                    f"candidates (feature '{self.candidate_feature}'): give a list a row, one value a candidate"
                )
            lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False)
            wrong = np.flatnonzero(lengths != counts)
            if wrong.size:
                i = int(wrong[0])
                raise DataError(
                    f"{locate(i)} holds {lengths[i]} value(s) for the row's {counts[i]} candidate(s) (feature "
                    f"'{self.candidate_feature}')"
                )
            rows = np.repeat(np.arange(len(lengths)), lengths)
            col = col.flatten()
            x = _float64(col, lambda j: locate(int(rows[j])), origin.label)
        else:
            rows = None
            x = _float64(col, locate, origin.label)
        classes, rule = self.label_rules.get(name, (None, "labels must be finite numbers"))
        bad = ~np.isfinite(x)
        if classes == 0:  # a bitmask
            bad |= (x < 0) | (x != np.round(x))
        elif classes is not None:
            bad |= (x < 0) | (x >= classes) | (x != np.round(x))
        i = int(np.argmax(bad)) if bad.any() else -1
        if i >= 0:
            value = "no value (null)" if col.null_count and not col[i].is_valid else x[i]
            raise DataError(f"{locate(i if rows is None else int(rows[i]))} holds {value}; {rule}")
        return torch.from_numpy(x.astype(np.float32))

    def _group_ids(self, col) -> torch.Tensor:
        """A grouping column's ids (grouped AUC, JRC sessions), int64 ``[B]``: integers as they
        are, strings hashed as a dynamic table's keys (in C++ where the extension is built), other
        values as ``str(x)``; the rows without a value (null) form one group, :data:`NULL_GROUP`."""
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        null = col.is_null().to_numpy(zero_copy_only=False) if col.null_count else None
        if pa.types.is_integer(col.type):
            if null is not None:
                col = pc.fill_null(col, 0)
            ids = col.to_numpy(zero_copy_only=False).astype(np.int64)
        else:
            strings = pc.fill_null(col, "") if _is_string(col.type) else [str(s) for s in col.to_pylist()]
            ids = to_hash_bucket_fast(strings, DYNAMIC_KEY_BUCKETS)
        if null is not None:
            ids[null] = NULL_GROUP
        return torch.from_numpy(ids)


def _pairs(a: Jagged, b: Jagged) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (a value, b value) pair of each row: ``(row, index into a, index into b)``."""
    n = len(a.lengths)
    total = a.lengths * b.lengths
    row = np.repeat(np.arange(n), total)
    j = np.arange(int(total.sum())) - offsets_of(total)[:-1][row]
    blen = np.maximum(b.lengths[row], 1)
    return row, offsets_of(a.lengths)[:-1][row] + j // blen, offsets_of(b.lengths)[:-1][row] + j % blen


def _with_default_element(lengths, x, missing, default) -> tuple[np.ndarray, np.ndarray]:
    """A dense sequence's missing rows given one element ``default``."""
    if not missing.any():
        return lengths, x
    new = np.where(missing, 1, lengths)
    out = np.zeros((int(new.sum()), x.shape[1]))
    row = np.repeat(np.arange(len(lengths)), new)
    pos = np.arange(len(out)) - offsets_of(new)[:-1][row]
    src = offsets_of(lengths)[:-1][row] + pos
    take = ~missing[row]
    out[take] = x[src[take]]
    out[~take] = default
    return new, out


def _default_numbers(f: Feature, dv: str, k: int) -> np.ndarray:
    """A numeric feature's default value as ``k`` numbers (one number is repeated)."""
    sep = getattr(f, "value_separator", None) if isinstance(f, (LookupFeatureCfg, SequenceRawFeatureCfg)) else None
    sep = sep or getattr(f, "separator", None)
    parts = dv.split(sep) if sep and k > 1 else [dv]
    values = np.array([float(p) for p in parts])
    return np.repeat(values, k) if len(values) == 1 else values


def _boundaries(f: Feature) -> list[float]:
    return getattr(f, "boundaries")  # noqa: B009 - typed per kind (a field, or a ClassVar None)


def _buckets(boundaries, x: np.ndarray) -> np.ndarray:
    """Numbers -> buckets: ``i`` for ``boundaries[i-1] <= x < boundaries[i]``."""
    return np.searchsorted(np.asarray(boundaries, dtype=np.float64), x, side="right").astype(np.int64)


def _as_column(out: _Output, n: int) -> pa.Array:
    """A feature's output as a column another feature reads (``feature:<name>``): ids as a list
    column, one number a row as float64, ``k`` numbers as a list column."""
    if isinstance(out, _Ids):
        return pa.ListArray.from_arrays(pa.array(offsets_of(out.lengths).astype(np.int32)), pa.array(out.values))
    assert isinstance(out, _Dense)
    if out.x64.ndim == 1:
        return pa.array(out.x64)
    k = out.x64.shape[1]
    return pa.ListArray.from_arrays(pa.array(np.arange(0, n * k + 1, k, dtype=np.int32)), pa.array(out.x64.reshape(-1)))


def _padded(x: np.ndarray, lengths: np.ndarray, n: int, dtype: type = np.float32) -> np.ndarray:
    """Elements ``[N, ...]`` of rows of ``lengths`` -> ``[n, L, ...]`` zero-padded (``L`` the
    longest), of ``dtype``."""
    longest = int(lengths.max()) if len(lengths) else 0
    out = np.zeros((n, longest, *x.shape[1:]), dtype=dtype)
    row = np.repeat(np.arange(n), lengths)
    pos = np.arange(len(x)) - offsets_of(lengths)[:-1][row]
    out[row, pos] = x
    return out


def _shown(x: np.ndarray, lengths: np.ndarray, row: int) -> str:
    start = int(np.sum(lengths[:row]))
    values = x[start : start + int(lengths[row])].tolist()
    return "missing" if not values else str(values[0] if len(values) == 1 else values)


def _inputs(f: Feature) -> str:
    inputs = f.inputs
    if len(inputs) == 1:
        return f"column '{inputs[0].name}'" if not inputs[0].feature else f"input {inputs[0]}"
    return "inputs " + ", ".join(f"'{i}'" for i in inputs)


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _row(lengths: np.ndarray, i: int) -> int:
    """The batch row of token ``i`` of rows of ``lengths`` tokens."""
    return int(np.searchsorted(np.cumsum(lengths), i, side="right"))


def _first_values(col: pa.Array, separator: str, value_separator: str) -> pa.Array:
    """A string column of ``separator``-joined elements, each element holding several values
    joined by ``value_separator`` cut to its first: one id an element (TorchEasyRec's
    ``value_dim: 1``, a sequence element's default, truncates an element's values so)."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if not _holds(col, value_separator):
        return col
    elements = pc.split_pattern(col, separator)
    first = pc.list_element(pc.split_pattern(pc.list_flatten(elements), value_separator, max_splits=1), 0)
    cut = pa.ListArray.from_arrays(elements.offsets, first, mask=elements.is_null())
    return pc.binary_join(cut, separator)


def one_chunk(col: pa.ChunkedArray) -> pa.Array:
    """``col`` as one array: its one chunk as it is, or its chunks combined (dictionaries
    unified)."""
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def _holds(col: pa.Array, text: str) -> bool:
    """Whether any value of the string array ``col`` (one chunk) holds ``text``: a search of its
    bytes, 20x faster than pyarrow's match over histories that hold none."""
    data = col.buffers()[2] if len(col) else None
    return data is not None and data.to_pybytes().find(text.encode()) >= 0


def _empty_as_null(col: pa.Array) -> pa.Array:
    """A string column of one number a row with its empty strings as nulls: a missing value, as
    TorchEasyRec's feature generation reads ``""`` (its default_value, else a named error)."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if not _is_string(col.type):
        return col
    empty = pc.equal(col, pa.scalar("", col.type))
    return pc.if_else(empty, pa.scalar(None, col.type), col) if pc.any(empty).as_py() else col


def _cast_int64(tokens: pa.Array) -> pa.Array:
    """Decimal strings (surrounding whitespace allowed) -> int64; ArrowInvalid if one is not."""
    try:
        return pc.cast(tokens, pa.int64())
    except pa.ArrowInvalid:
        return pc.cast(pc.utf8_trim_whitespace(tokens), pa.int64())


def _float64(col, where, label: str) -> np.ndarray:
    """A numeric (or numeric-string) column as float64 (nulls become NaN); DataError naming the
    row (``where(i)``) and the value that is not a number."""
    if pa.types.is_dictionary(col.type):  # (a categorical column: its values)
        col = col.cast(col.type.value_type)
    if pa.types.is_integer(col.type):  # (to the nearest float64 past 2**53: a timestamp in microseconds)
        return pc.cast(col, pa.float64(), safe=False).to_numpy(zero_copy_only=False)
    try:
        return pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    if _is_string(col.type):
        try:  # numbers with surrounding whitespace (as a CSV reader would take them)
            return pc.cast(pc.utf8_trim_whitespace(col), pa.float64()).to_numpy(zero_copy_only=False)
        except pa.ArrowInvalid:
            for i, v in enumerate(col.to_pylist()):
                try:
                    if v is not None:
                        pc.cast(pa.array([v.strip()]), pa.float64())
                except pa.ArrowInvalid:
                    raise DataError(f"{where(i)}: {v!r} is not a number") from None
    feature = f": {where(0).rsplit(': ', 1)[-1]}" if len(col) else ""  # ("feature 'x' (column 'c')")
    raise DataError(f"{label}{feature}: a column of type {col.type} is not numeric") from None


# An integer as Arrow's cast reads one (Python's int() also takes "+2", "1_0" and non-ASCII digits).
_INTEGER = re.compile(r"\s*-?[0-9]+\s*")


def _is_int(s: str) -> bool:
    return isinstance(s, str) and _INTEGER.fullmatch(s) is not None


def _is_int64(s: str) -> bool:
    return _is_int(s) and -(1 << 63) <= int(s.strip()) < (1 << 63)


def _keep_last(f: Feature, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A sequence feature keeps the last ``sequence_length`` ids of each row (histories end with
    the most recent); any other feature's ids pass through."""
    if not isinstance(f, SequenceFeatureCfg):
        return ids, lengths
    return keep_last(ids, lengths, f.sequence_length)
