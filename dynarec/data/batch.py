"""Arrow record batches -> model inputs (a KJT-shaped sparse batch, dense features, labels).

Every bad value is an error naming the feature, the column, the file and the row: a missing
column, a null id, a NaN or null dense value, a malformed multi-value field, a negative or
out-of-range id of a fixed feature, a label outside {0, 1}.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from dynarec.config.schema import Config, IdFeatureCfg, RawFeatureCfg, SequenceFeatureCfg
from dynarec.embedding.jagged import JaggedBatch
from dynarec.features import native
from dynarec.features.expression import Expression
from dynarec.features.hashing import DYNAMIC_KEY_BUCKETS, to_hash_bucket_fast

__all__ = ["Batch", "BatchBuilder", "DataError", "RowOrigin"]


class DataError(ValueError):
    """Bad input data; the message names the feature/column, the file and the row."""


@dataclass
class Batch:
    """One batch of rows.

    ``sparse``: every id and sequence feature, KJT layout (key-major lengths ``[F * B]``).
    ``dense``: ``{feature: [B]}`` float32, normalized. ``labels``: ``[B]`` float32 in {0, 1}.
    ``groups``: ``[B]`` int64 ids of the grouped-AUC field (or None).
    """

    sparse: JaggedBatch
    dense: dict[str, torch.Tensor]
    labels: torch.Tensor
    groups: Optional[torch.Tensor]
    num_rows: int

    def pin_memory(self) -> Batch:
        """A copy in page-locked host memory (the DataLoader calls it for a CUDA trainer)."""
        return Batch(
            self.sparse.pin_memory(),
            {k: v.pin_memory() for k, v in self.dense.items()},
            self.labels.pin_memory(),
            None if self.groups is None else self.groups.pin_memory(),
            self.num_rows,
        )

    def sequence_lengths(self, names: list[str]) -> dict[str, torch.Tensor]:
        b = self.num_rows
        keys = self.sparse.keys()
        lengths = self.sparse.lengths().view(len(keys), b)
        return {n: lengths[keys.index(n)] for n in names}


Feature = Union[IdFeatureCfg, SequenceFeatureCfg, RawFeatureCfg]


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


class BatchBuilder:
    """Builds :class:`Batch` objects from Arrow tables for one config."""

    def __init__(self, config: Config, with_labels: bool = True):
        self.config = config
        self.with_labels = with_labels
        self.sparse_features = [f for f in config.features() if not isinstance(f, RawFeatureCfg)]
        self.dense_features = [f for f in config.features() if isinstance(f, RawFeatureCfg)]
        self.label_field = config.data.label_field
        self.group_field = self._group_field()
        sequences = {f.feature_name for f in self.sparse_features if isinstance(f, SequenceFeatureCfg)}
        self.sequence_groups = [
            [n for n in g.feature_names if n in sequences]
            for g in config.model.feature_groups
            if g.group_type == "sequence" and sum(n in sequences for n in g.feature_names) > 1
        ]

    def _group_field(self) -> Optional[str]:
        if "grouped_auc" not in self.config.eval.metrics:
            return None
        if self.config.eval.grouped_auc_field:
            return self.config.eval.grouped_auc_field
        ids = [f for f in self.sparse_features if isinstance(f, IdFeatureCfg)]
        return ids[0].column if ids else None

    def columns(self) -> list[str]:
        """Every column a batch needs, in a stable order."""
        cols = [f.column for f in self.sparse_features] + [f.column for f in self.dense_features]
        if self.with_labels:
            cols.append(self.label_field)
        if self.group_field and self.with_labels:
            cols.append(self.group_field)
        return list(dict.fromkeys(cols))

    def csv_column_types(self) -> dict[str, pa.DataType]:
        """Columns a CSV reader must take as strings, whatever they look like: ids (a string id
        ``001001`` is not ``1001``, ``1e3`` is not ``1000``; an integer id never goes through a
        float). Bucketized numbers and dense values are left to inference."""
        return {f.column: pa.string() for f in self.sparse_features if f.boundaries is None}

    def check_schema(self, schema: pa.Schema, source: str) -> None:
        """Raises DataError naming the first missing column (and the feature that needs it)."""
        names = set(schema.names)
        for column in self.columns():
            count = schema.names.count(column)
            if count > 1:
                raise DataError(f"{source}: column '{column}' appears {count} times; give every column one name")
        for f in self.sparse_features + self.dense_features:
            if f.column not in names:
                raise DataError(f"{source}: missing column '{f.column}' (feature '{f.feature_name}')")
        if self.with_labels and self.label_field not in names:
            raise DataError(f"{source}: missing column '{self.label_field}' (data.label_field)")
        if self.with_labels and self.group_field and self.group_field not in names:
            raise DataError(f"{source}: missing column '{self.group_field}' (eval.grouped_auc_field)")

    def build(self, table: pa.Table, origin: Union[RowOrigin, str]) -> Batch:
        """``table``'s rows -> Batch. ``origin`` says where the rows came from (a file name:
        all of them, from its row 0), for error messages."""
        if isinstance(origin, str):
            origin = RowOrigin.of(origin, table.num_rows)
        self.check_schema(table.schema, origin.label)
        n = table.num_rows
        keys, values, lengths = [], [], []
        for f in self.sparse_features:
            ids, lens = self._ids(f, table.column(f.column), origin)
            keys.append(f.feature_name)
            values.append(ids)
            lengths.append(lens)
        self._check_sequence_groups(dict(zip(keys, lengths)), origin)
        sparse = JaggedBatch(
            keys,
            torch.from_numpy(np.concatenate(values)) if values else torch.empty(0, dtype=torch.int64),
            torch.from_numpy(np.concatenate(lengths)) if lengths else torch.empty(0, dtype=torch.int64),
        )
        dense = {f.feature_name: self._dense(f, table.column(f.column), origin) for f in self.dense_features}
        labels = torch.zeros(n)
        groups = None
        if self.with_labels:
            labels = self._labels(table.column(self.label_field), origin)
            if self.group_field:
                groups = self._group_ids(table.column(self.group_field))
        return Batch(sparse, dense, labels, groups, n)

    def _check_sequence_groups(self, lengths: dict[str, np.ndarray], origin: RowOrigin) -> None:
        """The sequence features of one sequence group are concatenated position by position: in
        every row they must have the same length."""
        for names in self.sequence_groups:
            first = names[0]
            for other in names[1:]:
                bad = np.nonzero(lengths[first] != lengths[other])[0]
                if bad.size:
                    i = int(bad[0])
                    raise DataError(
                        f"{origin.locate(i)}: sequence features '{first}' and '{other}' of one sequence group "
                        f"have {lengths[first][i]} and {lengths[other][i]} elements; every sequence of a group "
                        "needs one length per row"
                    )

    # -- columns ---------------------------------------------------------------------------

    def _where(self, f: Feature, origin: RowOrigin, i: int) -> str:
        """Batch row ``i`` of feature ``f``, located in its source file."""
        return f"{origin.locate(i)}: feature '{f.feature_name}' (column '{f.column}')"

    def _ids(self, f: Union[IdFeatureCfg, SequenceFeatureCfg], col: pa.ChunkedArray, origin: RowOrigin):
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        if col.null_count:
            raise DataError(f"{self._where(f, origin, int(pc.index(col.is_null(), True).as_py()))}: missing value")
        if f.boundaries is not None:
            return self._bucketized(f, col, origin), np.ones(len(col), dtype=np.int64)
        separator = f.separator if isinstance(f, SequenceFeatureCfg) or f.separator else None
        t = col.type
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            tokens, lengths = col.flatten(), np.diff(col.offsets.to_numpy()).astype(np.int64)
            if tokens.null_count:
                row = _row_of(lengths, int(pc.index(tokens.is_null(), True).as_py()))
                raise DataError(f"{self._where(f, origin, row)}: a null element in the list of ids")
        elif separator is not None and _is_string(t):
            if f.hashed:  # the C++ extension's one pass: split and hash
                hashed = native.split_hash(col, separator, _num_buckets(f))
                if hashed is not None:
                    ids, lengths, bad = hashed
                    if bad >= 0:
                        raise self._empty_token(f, origin, bad, separator)
                    return _keep_last(f, ids, lengths)
            else:  # the C++ extension's one pass: split and parse
                parsed = native.split_parse_int64(col, separator)
                if parsed is not None:
                    ids, lengths = parsed
                    return _keep_last(f, self._checked_range(f, ids, lengths, origin), lengths)
            tokens, lengths = self._split(f, col, separator, origin)
        else:
            tokens, lengths = col, np.ones(len(col), dtype=np.int64)
        return _keep_last(f, self._token_ids(f, tokens, lengths, origin), lengths)

    def _split(self, f: Feature, col: pa.Array, separator: str, origin: RowOrigin) -> tuple[pa.Array, np.ndarray]:
        """``(tokens, lengths)`` of a separator-joined column, by pyarrow: one split; an empty field
        is an empty list (its one empty token dropped); DataError naming the row of an empty token."""
        parts = pc.split_pattern(col, separator)
        per_row = np.diff(parts.offsets.to_numpy()).astype(np.int64)
        empty = (pc.utf8_length(col).to_numpy(zero_copy_only=False) == 0) & (per_row == 1)
        lengths = np.where(empty, 0, per_row)
        tokens = parts.flatten()
        if empty.any():
            tokens = tokens.filter(pa.array(np.repeat(~empty, per_row)))
        bad = pc.equal(pc.utf8_length(tokens), 0)
        if bad.true_count:
            raise self._empty_token(f, origin, _row_of(lengths, int(pc.index(bad, True).as_py())), separator)
        return tokens, lengths

    def _empty_token(self, f: Feature, origin: RowOrigin, row: int, separator: str) -> DataError:
        return DataError(
            f"{self._where(f, origin, row)}: malformed multi-value field (empty token between '{separator}' separators)"
        )

    def _finite_float64(self, f: Feature, col, origin: RowOrigin, what: str = "") -> np.ndarray:
        """A number per row as float64; DataError naming the row of a missing, NaN or infinite
        value (``what``: a note on why the feature needs numbers)."""
        x = _float64(col, lambda i: self._where(f, origin, i), origin.label)
        bad = np.nonzero(~np.isfinite(x))[0]
        if bad.size:
            i = int(bad[0])
            raise DataError(f"{self._where(f, origin, i)}: value {x[i]} is not a finite number{what}")
        return x

    def _bucketized(self, f: IdFeatureCfg, col, origin: RowOrigin) -> np.ndarray:
        """A number per row -> its bucket: ``i`` for ``boundaries[i-1] <= x < boundaries[i]``."""
        x = self._finite_float64(f, col, origin, " (boundaries)")
        return np.searchsorted(np.asarray(f.boundaries, dtype=np.float64), x, side="right").astype(np.int64)

    def _token_ids(self, f, tokens: pa.Array, lengths: np.ndarray, origin: RowOrigin) -> np.ndarray:
        is_string = _is_string(tokens.type)
        if f.hashed:  # a string column in C++ where the extension is built; str(x) of other values
            strings = tokens if is_string else [str(x) for x in tokens.to_pylist()]
            return to_hash_bucket_fast(strings, _num_buckets(f))
        if is_string:
            try:  # most ids have no surrounding whitespace: trim only when the plain cast fails
                tokens = _cast_int64(tokens)
            except pa.ArrowInvalid:
                strings = tokens.to_pylist()
                i = next(k for k, s in enumerate(strings) if not _is_int64(s))
                why = "does not fit int64" if _is_int(strings[i]) else "value_type 'int' expects integer ids"
                raise DataError(
                    f"{self._where(f, origin, _row_of(lengths, i))}: malformed value {strings[i]!r} ({why})"
                ) from None
        elif not pa.types.is_integer(tokens.type):
            raise DataError(
                f"{origin.label}: feature '{f.feature_name}' (column '{f.column}') has type "
                f"{tokens.type}; value_type 'int' expects integers"
            )
        elif tokens.type == pa.uint64() and len(tokens) and pc.max(tokens).as_py() >= 1 << 63:
            i = int(pc.index(pc.greater_equal(tokens, pa.scalar(1 << 63, pa.uint64())), True).as_py())
            raise DataError(
                f"{self._where(f, origin, _row_of(lengths, i))}: id {tokens[i].as_py()} does not fit int64 "
                "(uint64 ids of 2^63 and more would wrap to negative keys)"
            )
        ids = tokens.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        return self._checked_range(f, ids, lengths, origin)

    def _checked_range(self, f, ids: np.ndarray, lengths: np.ndarray, origin: RowOrigin) -> np.ndarray:
        """``ids``; DataError naming the row of the first id outside a fixed table's rows."""
        if f.dynamicemb is None and ids.size:
            bad = np.nonzero((ids < 0) | (ids >= f.table_rows))[0]
            if bad.size:
                i = int(bad[0])
                raise DataError(
                    f"{self._where(f, origin, _row_of(lengths, i))}: id {int(ids[i])} is out of range "
                    f"[0, {f.table_rows}) (num_buckets)"
                )
        return ids

    def _dense(self, f: RawFeatureCfg, col, origin: RowOrigin) -> torch.Tensor:
        x = self._finite_float64(f, col, origin)
        norm = f.normalizer
        if norm is not None:
            if norm.expression is not None:
                x = Expression(norm.expression)(x)
                bad = np.nonzero(~np.isfinite(x))[0]
                if bad.size:
                    i = int(bad[0])
                    raise DataError(
                        f"{self._where(f, origin, i)}: normalizer {norm.expression!r} gives {x[i]} for this row's "
                        "value; the expression must be finite on the data"
                    )
            if norm.log1p:
                if (x <= -1).any():
                    i = int(np.nonzero(x <= -1)[0][0])
                    raise DataError(f"{self._where(f, origin, i)}: log1p normalizer needs values > -1, got {x[i]}")
                x = np.log1p(x)
            x = (x - norm.mean) / norm.std
        with np.errstate(over="ignore"):
            x32 = x.astype(np.float32)
        bad = np.nonzero(~np.isfinite(x32))[0]
        if bad.size:  # finite in float64, not in the model's float32 (1e39)
            i = int(bad[0])
            raw = float(_float64(col, lambda k: self._where(f, origin, k), origin.label)[i])
            shown = f"value {raw:g}" + (f" (normalized: {float(x[i]):g})" if float(x[i]) != raw else "")
            raise DataError(
                f"{self._where(f, origin, i)}: {shown} is beyond float32's range (about ±3.4e38); "
                "scale the feature or give it a normalizer"
            )
        return torch.from_numpy(x32)

    def _labels(self, col, origin: RowOrigin) -> torch.Tensor:
        x = _float64(col, lambda i: f"{origin.locate(i)}: label column '{self.label_field}'", origin.label)
        bad = np.nonzero(~((x == 0) | (x == 1)))[0]
        if bad.size:
            i = int(bad[0])
            raise DataError(
                f"{origin.locate(i)}: label column '{self.label_field}' holds {x[i]}; labels must be 0 or 1"
            )
        return torch.from_numpy(x.astype(np.float32))

    def _group_ids(self, col) -> torch.Tensor:
        """The grouped-AUC field's ids, int64 ``[B]``: integers as they are, strings hashed as a
        dynamic table's keys (in C++ where the extension is built), other values as ``str(x)``."""
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        if pa.types.is_integer(col.type):
            return torch.from_numpy(col.to_numpy(zero_copy_only=False).astype(np.int64))
        strings = col if _is_string(col.type) else [str(s) for s in col.to_pylist()]
        return torch.from_numpy(to_hash_bucket_fast(strings, DYNAMIC_KEY_BUCKETS))


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _row_of(lengths: np.ndarray, i: int) -> int:
    """The batch row of token ``i`` of rows of ``lengths`` tokens."""
    return int(np.searchsorted(np.cumsum(lengths), i, side="right"))


def _num_buckets(f: Union[IdFeatureCfg, SequenceFeatureCfg]) -> int:
    """What a hashed feature's fingerprints are taken modulo: a dynamic table's key range, or a
    fixed table's rows."""
    if f.dynamicemb is not None:
        return DYNAMIC_KEY_BUCKETS
    assert f.table_rows is not None  # a fixed table has its rows (the config's validation)
    return f.table_rows


def _cast_int64(tokens: pa.Array) -> pa.Array:
    """Decimal strings (surrounding whitespace allowed) -> int64; ArrowInvalid if one is not."""
    try:
        return pc.cast(tokens, pa.int64())
    except pa.ArrowInvalid:
        return pc.cast(pc.utf8_trim_whitespace(tokens), pa.int64())


def _float64(col, where, label: str) -> np.ndarray:
    """A numeric (or numeric-string) column as float64 (nulls become NaN); DataError naming the
    row (``where(i)``) and the value that is not a number."""
    try:
        return pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        values = col.to_pylist()
        for i, v in enumerate(values):
            try:
                float(v) if v is not None else None
            except (TypeError, ValueError):
                raise DataError(f"{where(i)}: {v!r} is not a number") from None
        raise DataError(f"{label}: a column of type {col.type} is not numeric") from None


def _is_int(s: str) -> bool:
    try:
        int(s.strip())
        return True
    except (ValueError, AttributeError):
        return False


def _is_int64(s: str) -> bool:
    return _is_int(s) and -(1 << 63) <= int(s.strip()) < (1 << 63)


def _keep_last(f: Feature, ids: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A sequence feature keeps the last ``sequence_length`` ids of each row (histories end with
    the most recent); any other feature's ids pass through."""
    if not isinstance(f, SequenceFeatureCfg) or not (lengths > f.sequence_length).any():
        return ids, lengths
    max_len = f.sequence_length
    ends = np.cumsum(lengths)
    starts = ends - lengths
    row = np.repeat(np.arange(lengths.size), lengths)
    pos = np.arange(ids.size) - starts[row]
    keep = pos >= (lengths - max_len)[row]
    return ids[keep], np.minimum(lengths, max_len)
