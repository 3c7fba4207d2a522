"""Parquet and CSV readers (pyarrow): files -> fixed-size batches, in a deterministic order.

Files are read in sorted order, rows in file order; batches hold exactly ``batch_size`` rows
(the last one of an epoch may hold fewer), whatever the files' row groups or the number of
DataLoader workers. A data position (epoch, rows consumed) seeks straight to its row.
"""

from __future__ import annotations

import copy
import fnmatch
import glob
import multiprocessing
import os
import signal
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union, cast

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from dynarec.data import shared_decode
from dynarec.data.batch import Batch, BatchBuilder, BatchFile, DataError, RowOrigin, one_chunk
from dynarec.data.shared_decode import (
    PassAbandoned,
    RowGroupExchange,
    Unit,
    mark_failed,
    pass_directory,
    remove_chunks,
    retire,
    shared_memory_dir,
    travelling,
    write_batch,
)
from dynarec.files import remove_scratch, scratch_directory

__all__ = [
    "ArrowBatchDataset",
    "BatchLoader",
    "DataPosition",
    "data_files",
    "default_num_workers",
    "make_loader",
    "num_rows",
    "read_table",
    "resolve_files",
    "start_worker_server",
    "usable_workers",
    "worker_context",
]


def data_files(directory: Union[str, Path]) -> list[str]:
    """The ``.parquet`` / ``.csv`` files of a directory, by name; hidden and ``_``-prefixed names
    are writers' temporaries (Spark's, a streaming writer's before its rename) and are skipped."""
    return [str(x) for x in sorted(Path(directory).iterdir()) if _named_as_data(x) and x.is_file()]


def _named_as_data(path: Path) -> bool:
    """Whether a directory's listing takes ``path`` as a data file by its name (:func:`data_files`)."""
    return path.suffix in (".parquet", ".csv") and not path.name.startswith((".", "_"))


def resolve_files(paths: Union[str, Sequence[str]], what: str = "input path") -> list[str]:
    """Expands files, directories and glob patterns into a sorted file list; FileNotFoundError
    naming ``what`` (the config field or option that gave them) where one does not exist or none
    holds a file."""
    if isinstance(paths, str):
        paths = [paths]
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            files += data_files(p)
        elif any(c in p for c in "*?["):
            files += sorted(glob.glob(p))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"{what}: {p} does not exist")
    if not files:
        raise FileNotFoundError(f"{what}: {list(paths)} match no .parquet or .csv file")
    return sorted(dict.fromkeys(files))


def lists_as_data(path: str, file: Union[str, Path]) -> bool:
    """Whether :func:`resolve_files` of ``path`` (a file, directory or glob pattern) lists
    ``file`` where it exists: judged by the names alone, so before either is written."""
    f = Path(file).absolute()
    if any(c in path for c in "*?["):
        return fnmatch.fnmatchcase(str(f), str(Path(path).absolute()))
    p = Path(path).absolute()
    return f == p or (f.parent == p and _named_as_data(f))


def check_no_side_tables(files: Sequence[str], side_tables: Sequence[tuple[str, str]], what: str) -> None:
    """DataError where one of ``files`` (the data of ``what``) is one of ``side_tables``
    (``(field, path)``: a sampler's item, edge or tree table): read as rows, it would fail on its
    columns or train on nonsense."""
    sides = {os.path.realpath(path): field for field, path in side_tables}
    for f in files:
        field = sides.get(os.path.realpath(f))
        if field is not None:
            raise DataError(
                f"{what}: {f} is {field}, a sampler's table, not data; move it out of the data's directory and "
                f"set {field} to where it now lies"
            )


def _file_type(path: str, input_type: Optional[str]) -> str:
    if input_type:
        named = next((t for t in ("parquet", "csv") if path.endswith(f".{t}") and t != input_type), None)
        if named is not None:  # (read as the other kind, it would be nonsense)
            raise DataError(
                f"{path}: a .{named} file, but data.input_type is '{input_type}'; set data.input_type: {named}, or "
                "leave it unset to go by the files' names (make-data writes Parquet)"
            )
        return input_type
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith(".csv"):
        return "csv"
    raise DataError(f"{path}: cannot tell parquet from csv; set data.input_type")


ColumnTypes = Optional[dict[str, pa.DataType]]


class _FileFacts:
    """What was read of files in this process (a schema, a row count), each kept while its file
    keeps its size and modification time (in ns): every epoch's dataset and every evaluation's
    checks and counts the same files, a CSV file's count is a pass over the whole file, and a
    Parquet footer is a read a file (a network file system's round trip). A file rewritten
    since has another size or time, and is read anew. At most ``limit`` facts are kept (a
    --follow run's files arrive for ever: the oldest go)."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self._facts: dict[tuple, Any] = {}
        self._limit = limit

    def get(self, path: str, key: tuple, read: Callable[[], Any]) -> Any:
        """The fact of ``path`` (``key``: what else it depends on), ``read()`` where not kept."""
        try:
            stat = os.stat(path)
        except OSError:
            return read()  # (the read names the file)
        version = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns, *key)
        if version in self._facts:
            return self._facts[version]
        fact = read()
        if len(self._facts) >= self._limit:
            del self._facts[next(iter(self._facts))]
        self._facts[version] = fact
        return fact


_SCHEMAS = _FileFacts()
_ROW_COUNTS = _FileFacts()


def file_schema(path: str, input_type: Optional[str] = None, csv_types: ColumnTypes = None) -> pa.Schema:
    """A file's schema (read once while the file stays as it is); a CSV file's columns named in
    ``csv_types`` take those types (the others are inferred)."""
    kind = _file_type(path, input_type)
    if kind == "parquet":
        return _SCHEMAS.get(path, (kind,), lambda: _parquet_schema(path))
    types = tuple(sorted((csv_types or {}).items()))
    return _SCHEMAS.get(path, (kind, types), lambda: _csv_schema(path, input_type, csv_types))


def _parquet_schema(path: str) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None


def _csv_schema(path: str, input_type: Optional[str], csv_types: ColumnTypes) -> pa.Schema:
    try:
        with pacsv.open_csv(path, convert_options=pacsv.ConvertOptions(column_types=csv_types or {})) as reader:
            return reader.schema
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}{_csv_row_of(path, input_type)}: cannot be read ({e})") from None


def _record_batches(
    path: str, columns: list[str], input_type: Optional[str], csv_types: ColumnTypes = None
) -> Iterator[pa.RecordBatch]:
    if _file_type(path, input_type) == "parquet":
        yield from pq.ParquetFile(path).iter_batches(batch_size=65536, columns=columns)
    else:
        opts = pacsv.ConvertOptions(include_columns=columns, strings_can_be_null=False, column_types=csv_types or {})
        with pacsv.open_csv(path, convert_options=opts) as reader:
            yield from reader


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def _compatible(a: pa.DataType, b: pa.DataType, ids: bool, csv_ids: bool) -> bool:
    """Whether one column may have types ``a`` and ``b`` in two files: numbers of any width and
    sign (widened), but integers and floats only where the column holds no ids (``ids``: 5 and
    5.0 hash alike, 12345678901 and 1.2345678901e+10 do not); integers and strings where
    ``csv_ids`` (an id column of a CSV file, read as strings, beside a Parquet file's integers:
    they parse and hash the same)."""
    if _numeric(a) and _numeric(b):
        return not ids or pa.types.is_floating(a) == pa.types.is_floating(b)
    if _kind(a) == _kind(b) == "string":  # (one dictionary-encoded, or large)
        return True
    return csv_ids and {_kind(a), _kind(b)} == {"integer", "string"}


def _kind(t: pa.DataType) -> str:
    if pa.types.is_dictionary(t):  # (read as its values)
        return _kind(t.value_type)
    if pa.types.is_integer(t):
        return "integer"
    return "string" if pa.types.is_string(t) or pa.types.is_large_string(t) else str(t)


def _concat(tables: list[pa.Table]) -> pa.Table:
    """The rows of ``tables`` as one table: numbers widened (integers beside floats to the nearest
    float64: a dense column's, as ``check_files`` refuses the mix in an id column); a column that
    is integer in one table and string in another (ids from Parquet and CSV) becomes strings, as
    ids parse and hash the same either way."""
    for name in tables[0].column_names:
        types = [t.schema.field(name).type for t in tables]
        if len(set(types)) > 1 and any(pa.types.is_dictionary(t) for t in types):  # its values, as _input reads it
            tables = _recast(tables, name, lambda t: t.value_type if pa.types.is_dictionary(t) else None)
            types = [t.schema.field(name).type for t in tables]
        kinds = {_kind(t) for t in types}
        if kinds == {"integer", "string"}:
            tables = _recast(tables, name, lambda t: pa.string())
        elif "integer" in kinds and any(pa.types.is_floating(t) for t in types):
            tables = _recast(tables, name, lambda t: pa.float64() if pa.types.is_integer(t) else None, safe=False)
    return pa.concat_tables(tables, promote_options="permissive")


def _recast(
    tables: list[pa.Table], name: str, target: Callable[[pa.DataType], Optional[pa.DataType]], safe: bool = True
) -> list[pa.Table]:
    """``tables`` with column ``name`` cast to ``target(its type)`` in each where that is not None."""
    out = []
    for t in tables:
        to = target(t.schema.field(name).type)
        if to is not None:
            t = t.set_column(t.schema.get_field_index(name), name, pc.cast(t.column(name), to, safe=safe))
        out.append(t)
    return out


def num_rows(path: str, input_type: Optional[str] = None) -> int:
    """Rows of a file: a Parquet footer's count, or a CSV file's rows (read once while the file
    stays as it is)."""
    kind = _file_type(path, input_type)
    if kind == "parquet":
        return _ROW_COUNTS.get(path, (kind,), lambda: _parquet_metadata(path).num_rows)
    return _ROW_COUNTS.get(path, (kind,), lambda: _csv_rows(path, input_type))


def _csv_rows(path: str, input_type: Optional[str]) -> int:
    try:
        with pacsv.open_csv(path, convert_options=pacsv.ConvertOptions(include_columns=[])) as reader:
            return sum(b.num_rows for b in reader)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}{_csv_row_of(path, input_type)}: cannot be read ({e})") from None


# A dictionary-encoded column chunk's data pages hold a code a row, bit-packed: at most 4 bytes
# a row (codes of up to 32 bits) before compression. More, and the writer fell back to plain
# pages (its dictionary outgrew its size limit, about 1 MB by default): the values are stored.
_CODE_BYTES = 4


def dictionary_encoded(meta: pq.FileMetaData, groups: Sequence[int], candidates: frozenset[str]) -> list[str]:
    """The columns of ``candidates`` stored dictionary-encoded in every row group of ``groups``:
    read as dictionaries, they decode without their values materialized row by row (a Parquet
    reader's dictionary page is the column's distinct values), and a batch builder works a
    value's ids out once (``BatchBuilder.dictionary_columns``)."""
    if not candidates:
        return []
    found: Optional[set[str]] = None
    fields = leaf_fields(meta)
    strings = {f.name for f in meta.schema.to_arrow_schema() if _kind(f.type) == "string"}  # (not nested)
    for g in groups:
        group = meta.row_group(g)
        encoded = set()
        for j in range(group.num_columns):
            chunk = group.column(j)
            if fields[j] not in candidates or fields[j] not in strings or not chunk.has_dictionary_page:
                continue
            dictionary = chunk.data_page_offset - chunk.dictionary_page_offset
            if chunk.total_compressed_size - dictionary <= _CODE_BYTES * group.num_rows:
                encoded.add(fields[j])
        found = encoded if found is None else found & encoded
    return sorted(found or ())


def _record_batches_from(
    path: str,
    columns: list[str],
    input_type: Optional[str],
    skip: int,
    csv_types: ColumnTypes = None,
    dictionaries: frozenset[str] = frozenset(),
) -> Iterator[tuple[int, pa.Table]]:
    """``(first row in file, table)`` of ``path`` from row ``skip`` on; Parquet row groups before
    it are not read. Columns of ``dictionaries`` stored dictionary-encoded are read so."""
    row = 0
    source: Iterator[pa.RecordBatch]
    if _file_type(path, input_type) == "parquet":
        meta = _parquet_metadata(path)
        groups: list[int] = []
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            if not groups and row + n <= skip:  # every group before the one holding row `skip`
                row += n
            else:
                groups.append(g)
        f = pq.ParquetFile(path, metadata=meta, read_dictionary=dictionary_encoded(meta, groups, dictionaries) or None)
        source = f.iter_batches(batch_size=65536, columns=columns, row_groups=groups) if groups else iter(())
    else:
        source = _record_batches(path, columns, input_type, csv_types)
    while True:
        try:
            rb = next(source, None)
        except (pa.ArrowInvalid, OSError) as e:  # a corrupt page, a malformed CSV row
            raise DataError(f"{path}{_csv_row_of(path, input_type)}: cannot be read ({e})") from None
        if rb is None:
            return
        table = pa.Table.from_batches([rb])
        if row + table.num_rows > skip:
            cut = max(skip - row, 0)
            yield row + cut, table.slice(cut)
        row += table.num_rows


def _csv_row_of(path: str, input_type: Optional[str]) -> str:
    """ ", row N" of a CSV file's first row whose field count differs from its header's (pyarrow's
    parse errors quote the row but not its number); "" when there is none or the file is not CSV."""
    if _file_type(path, input_type) != "csv":
        return ""
    import csv

    with open(path, newline="", errors="replace") as f:  # (a file not in UTF-8: the rows still count)
        rows = csv.reader(f)
        width = len(next(rows, []))
        for i, fields in enumerate(rows):
            if len(fields) != width:
                return f", row {i}"
    return ""


def read_table(
    path: str, columns: Optional[list[str]] = None, input_type: Optional[str] = None, csv_types: ColumnTypes = None
) -> pa.Table:
    """The ``columns`` (default all) of a file; a CSV file's columns named in ``csv_types`` take
    those types."""
    schema = file_schema(path, input_type, csv_types)
    batches = list(_record_batches(path, columns or schema.names, input_type, csv_types))
    return pa.Table.from_batches(batches) if batches else schema.empty_table()


@dataclass(frozen=True)
class DataPosition:
    """Where training stands in its input: ``epoch`` and the rows of it already consumed (a
    multiple of the global batch). A checkpoint stores it; a resume seeks to it."""

    epoch: int = 0
    row: int = 0


class ArrowBatchDataset(IterableDataset):
    """Yields :class:`Batch` objects from ``files``, read in order from row ``start_row`` on.

    Step ``s`` consumes rows ``[start_row + s*G, start_row + (s+1)*G)`` of the files' rows in
    order, ``G = batch_size * world_size`` (the global batch); rank ``r`` of ``world_size``
    builds its contiguous ``r``-th share of them (``batch_size`` rows; of a short last global
    batch of ``R`` rows, rows ``[r*R//W, (r+1)*R//W)``). DataLoader worker ``w`` of ``W``
    builds steps ``w, w + W, ...``, so the batches are the same whatever the number of workers.
    Seeking to ``start_row`` reads no row before it: Parquet row groups are skipped by their
    metadata, whole files by their row counts.

    With ``shared_root`` set (by :class:`BatchLoader`, for several workers over Parquet files)
    each row group is decoded by one worker and read by the others from shared memory
    (:mod:`dynarec.data.shared_decode`); otherwise every worker decodes the rows it passes.
    """

    def __init__(
        self,
        files: list[str],
        builder: BatchBuilder,
        batch_size: int,
        input_type: Optional[str] = None,
        start_row: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        super().__init__()
        self.files = files
        self.builder = builder
        self.batch_size = batch_size
        self.input_type = input_type
        self.start_row = start_row
        self.rank = rank
        self.world_size = world_size
        self._row_counts: Optional[list[int]] = None
        self._units: Optional[list[Unit]] = None
        # Shared decoding: the loader's directory of passes, the number of the pass before this
        # copy's next one (each __iter__ in a worker is the next pass), and the rows of a chunk.
        self.shared_root: Optional[str] = None
        self.shared_pass = 0
        self.chunk_rows = shared_decode.CHUNK_ROWS

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def check_files(self) -> None:
        """Validates every file's schema before anything is read or written: each has every
        column a batch needs, and a column has one type in every file (numbers of any width
        and sign mix: they are widened; integers and floats only in a column of no ids)."""
        first: dict[str, tuple[str, pa.DataType]] = {}
        csv_types = self.builder.csv_column_types()
        for f in self.files:
            schema = file_schema(f, self.input_type, csv_types)
            self.builder.check_schema(schema, f)
            for column in self.builder.columns():
                t = schema.field(column).type
                if pa.types.is_null(t):  # no value in this file (a header-only CSV): any type fits
                    continue
                seen = first.setdefault(column, (f, t))
                csv = column in csv_types and "csv" in (
                    _file_type(f, self.input_type),
                    _file_type(seen[0], self.input_type),
                )
                if seen[1] != t and not _compatible(seen[1], t, column in csv_types, csv):
                    raise DataError(
                        f"column '{column}' has type {seen[1]} in {seen[0]} but {t} in {f}; "
                        "give every file the same type"
                    )

    def row_counts(self) -> list[int]:
        """Rows of each file (Parquet: from the footer; CSV: counted once)."""
        if self._row_counts is None:
            self._row_counts = [num_rows(f, self.input_type) for f in self.files]
        return self._row_counts

    @property
    def num_rows(self) -> int:
        return sum(self.row_counts())

    def locate(self, index: int) -> str:
        """``"<file>, row <r>"`` of the ``index``-th row read from ``start_row`` (all ranks'
        rows in order)."""
        row = self.start_row + index
        for path, count in zip(self.files, self.row_counts()):
            if row < count:
                return f"{path}, row {row}"
            row -= count
        raise IndexError(index)

    def check_scores(self, scores, what: str = "score") -> None:
        """ValueError naming the file and row of the first score (``[rows]`` numpy, in row order
        from ``start_row``) that is not a finite number: no metric or prediction is reported
        over it."""
        import numpy as np

        bad = np.flatnonzero(~np.isfinite(scores))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"{self.locate(i)}: the model's {what} is {scores[i]} ({bad.size} of {scores.size} rows are not finite "
                "numbers); the model's weights or this row's values are not finite — no metric or prediction is "
                "reported over them"
            )

    def num_steps(self) -> int:
        """Global batches in one pass from ``start_row``."""
        return -(-max(self.num_rows - self.start_row, 0) // self.global_batch_size)

    def units(self) -> Optional[list[Unit]]:
        """The non-empty Parquet row groups of a pass, from ``start_row`` on (read from the files'
        footers once); None where a file is not Parquet."""
        if self._units is None:
            if any(_file_type(f, self.input_type) != "parquet" for f in self.files):
                return None
            units: list[Unit] = []
            skip, start = self.start_row, 0
            columns = self.builder.columns()
            for path, count in zip(self.files, self.row_counts()):
                if skip >= count:
                    skip -= count
                    continue
                first = 0
                for g, (n, nbytes, sizes) in enumerate(_row_groups(path, columns)):
                    if n and first + n > skip:  # (an empty row group holds nothing to read)
                        cut = max(skip - first, 0)
                        units.append(Unit(path, g, first, cut, start, n - cut, nbytes, sizes))
                        start += n - cut
                    first += n
                skip = 0
            self._units = units
        return self._units

    def _read_unit(self, unit: Unit, columns: Sequence[str]) -> Iterator[pa.RecordBatch]:
        """Row group ``unit``'s record batches of a published chunk's rows (``columns``, of the
        builder's; none: all of them), from its first row: one chunk decoded at a time, but for
        the columns stored dictionary-encoded that the builder takes so, read whole at once (a
        column's codes, 4 bytes a row), as Parquet's reader copies the dictionary into every
        batch it returns. A chunk's file holds its columns' dictionaries whole: one of more
        values than a chunk's rows is decoded to its values instead."""
        columns = list(columns or self.builder.columns())
        group = [unit.row_group]
        try:
            f = pq.ParquetFile(unit.path)
            encoded = set(dictionary_encoded(f.metadata, group, self.builder.dictionary_columns()))
            coded, plain = [c for c in columns if c in encoded], [c for c in columns if c not in encoded]
            others = (
                f.iter_batches(batch_size=self.chunk_rows, row_groups=group, columns=plain, use_threads=False)
                if plain
                else None
            )
            if not coded:
                yield from cast(Iterator[pa.RecordBatch], others)
                return
            whole = pq.ParquetFile(unit.path, metadata=f.metadata, read_dictionary=coded).read_row_group(
                unit.row_group, columns=coded, use_threads=False
            )
            codes = {c: one_chunk(whole.column(c)) for c in coded}
            for c, col in codes.items():
                if len(col.dictionary) > self.chunk_rows:
                    codes[c] = col.dictionary_decode()
            start = 0
            while start < whole.num_rows:  # (the other columns' batches, in step)
                rb = next(others) if others is not None else None
                n = rb.num_rows if rb is not None else min(self.chunk_rows, whole.num_rows - start)
                yield pa.RecordBatch.from_arrays(
                    [codes[c].slice(start, n) if c in codes else cast(pa.RecordBatch, rb).column(c) for c in columns],
                    names=columns,
                )
                start += n
        except (pa.ArrowInvalid, OSError) as e:  # a corrupt page
            raise DataError(f"{unit.path}: cannot be read ({e})") from None

    def _pieces(self) -> Iterator[tuple[str, int, pa.Table]]:
        """``(file, first row in file, slice)`` covering every row from ``start_row`` on."""
        skip = self.start_row
        columns = self.builder.columns()
        for path, count in zip(self.files, self.row_counts()):
            if skip >= count:
                skip -= count
                continue
            csv_types = self.builder.csv_column_types()
            pieces = _record_batches_from(
                path, columns, self.input_type, skip, csv_types, self.builder.dictionary_columns()
            )
            for first, table in pieces:
                yield path, first, table
            skip = 0

    def __iter__(self) -> Iterator[Union[Batch, BatchFile, WorkerFailure]]:
        info = get_worker_info()
        if info is None:
            yield from self._batches(0, 1)
            return
        self.shared_pass += 1
        try:  # in a DataLoader worker: the error travels to the main process as it is
            if self.shared_root is not None and info.num_workers > 1:
                directory = pass_directory(self.shared_root, self.shared_pass)
                yield from self._shared_batches(info.id, info.num_workers, directory)
            else:
                yield from self._batches(info.id, info.num_workers)
        except PassAbandoned:  # the training process moved on: nothing to deliver
            return
        except Exception as e:
            failure = WorkerFailure.of(e)
            if self.shared_root is not None:  # the workers waiting for its chunks fail with it
                mark_failed(pass_directory(self.shared_root, self.shared_pass), info.id, failure.error)
            yield failure

    def _shared_batches(self, worker: int, workers: int, directory: Path) -> Iterator[BatchFile]:
        """Worker ``worker``'s batches, its row groups decoded for all ``workers``, each sent as
        a file of the pass's ``directory`` (see :mod:`dynarec.data.shared_decode`)."""
        units = self.units()
        assert units is not None
        exchange = RowGroupExchange(directory, worker, workers, units, self._read_unit, self.chunk_rows)
        global_batch = self.global_batch_size
        ahead = workers * max((u.rows for u in units), default=0) + 2 * workers * global_batch
        total = units[-1].end if units else 0
        first = 0  # the first row group of the step
        for step in range(worker, self.num_steps(), workers):
            lo, hi = step * global_batch, min((step + 1) * global_batch, total)
            while units[first].end <= lo:
                first += 1
            exchange.decode_ahead(before=hi)  # its own rows up to the step's, before any wait
            exchange.frontier = hi + ahead
            pieces = []
            u = first
            while u < len(units) and units[u].start < hi:
                unit = units[u]
                a, b = max(lo - unit.start, 0), min(hi, unit.end) - unit.start
                pieces.append((unit.path, unit.first_row + unit.skip + a, exchange.rows(u, a, b)))
                u += 1
            exchange.forget_before(lo)
            yield write_batch(directory, step, self._build_share(pieces, hi - lo))
            # Own rows the next two rounds of steps read (the others wait for them), then a share
            # of those further ahead: row groups decode in parallel, spread over the steps.
            exchange.decode_ahead(before=hi + 2 * workers * global_batch)
            exchange.decode_ahead(before=hi + ahead, rows=2 * global_batch)
        exchange.decode_rest()  # the others' last steps may read them

    def _batches(self, worker: int, workers: int) -> Iterator[Batch]:
        global_batch = self.global_batch_size
        pieces: list[tuple[str, int, pa.Table]] = []  # the current global batch
        rows = step = 0
        for path, first, table in self._pieces():
            start = 0
            while start < table.num_rows:
                take = min(table.num_rows - start, global_batch - rows)
                if step % workers == worker:  # only this worker's steps are kept and built
                    pieces.append((path, first + start, table.slice(start, take)))
                rows += take
                start += take
                if rows == global_batch:
                    if pieces:
                        yield self._build_share(pieces, rows)
                    pieces, rows, step = [], 0, step + 1
        if rows and pieces:
            yield self._build_share(pieces, rows)

    def _build_share(self, pieces: list[tuple[str, int, pa.Table]], rows: int) -> Batch:
        """This rank's contiguous share of a global batch of ``rows`` rows."""
        lo, hi = self.rank * rows // self.world_size, (self.rank + 1) * rows // self.world_size
        mine, offset = [], 0
        for path, first, t in pieces:
            a, b = max(lo - offset, 0), min(hi - offset, t.num_rows)
            if a < b:
                mine.append((path, first + a, t.slice(a, b - a)))
            offset += t.num_rows
        if not mine:  # a last global batch of fewer rows than ranks: this rank's share is empty
            path, first, t = pieces[0]
            mine.append((path, first, t.slice(0, 0)))
        return self._build(mine)

    def _build(self, pieces: list[tuple[str, int, pa.Table]]) -> Batch:
        """One Batch from consecutive slices; contiguous slices of a file form one run of the
        batch's :class:`RowOrigin`, so errors name the right file and row."""
        runs: list[tuple[str, int, int]] = []
        for path, first, t in pieces:
            if runs and runs[-1][0] == path and runs[-1][1] + runs[-1][2] == first:
                runs[-1] = (path, runs[-1][1], runs[-1][2] + t.num_rows)
            else:
                runs.append((path, first, t.num_rows))
        tables = [t for _, _, t in pieces]
        table = _concat(tables) if len(tables) > 1 else tables[0]
        return self.builder.build(table, RowOrigin(tuple(runs)))


@dataclass(frozen=True)
class WorkerFailure:
    """An error raised in a DataLoader worker, carried to the main process as a value (torch
    would re-raise it wrapped in the worker's traceback): :class:`BatchLoader` raises it there
    as it was — a DataError stays one line naming the file, row and feature."""

    error: BaseException

    @classmethod
    def of(cls, e: BaseException) -> WorkerFailure:
        return cls(travelling(e))  # an exception that cannot travel: its message can


def worker_context(num_workers: int) -> Optional[str]:
    """How DataLoader workers start: ``fork`` (cheap) while this process has not initialized
    CUDA; ``forkserver`` once it has — a process forked after CUDA initialization cannot use
    CUDA, and torch's worker setup touches it (``CUDA error: initialization error``). The fork
    server is a fresh process with dynarec's data modules imported, so workers start fast."""
    if num_workers == 0:
        return None
    import torch

    if not torch.cuda.is_initialized():
        return "fork"
    start_worker_server()
    return "forkserver"


def start_worker_server() -> None:
    """Starts the fork server of :func:`worker_context` now, if it is not running, and returns
    without waiting for it: its imports (torch's, dynarec's data modules: seconds on a GPU host)
    then overlap this process's own set-up (the model, the tables) instead of delaying the
    first batch. A run that will initialize CUDA and use workers calls it first thing."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["dynarec.data.reader"])
    from multiprocessing import forkserver

    forkserver.ensure_running()


def _init_worker(_: int) -> None:
    """Set up a DataLoader worker: one Arrow thread (Parquet decoding, compute kernels), as torch
    gives it one thread of its own. The workers are the parallelism; eight of them each with an
    Arrow pool of every core oversubscribe the host.

    SIGTERM is ignored: a scheduler stopping a job signals every process of it, and the training
    process handles it (it finishes its step and saves, ``dynarec.train.stop``); a worker killed
    by it would fail that step first. A worker still ends with its parent (torch's watchdog)."""
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def default_num_workers(device_type: str) -> int:
    """``data.num_workers`` left unset: none on a CPU device (the step uses every core), and on
    a GPU as many as the host spares (all cores but two), up to 8."""
    if device_type != "cuda":
        return 0
    return max(1, min(8, (os.cpu_count() or 1) - 2))


def usable_workers(requested: int, cpus: Optional[int] = None) -> tuple[int, Optional[str]]:
    """``data.num_workers`` as this host runs them: at most the CPUs this process may use
    (``cpus``, default the process's affinity), where torch's DataLoader would warn (twice, the
    training and the eval loader: a TorchEasyRec config's 8 workers on a 2-core machine); and the
    one line saying so, else None."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if requested <= cpus:
        return requested, None
    return cpus, (
        f"data.num_workers is {requested}, but this process may use {cpus} CPU(s): {cpus} DataLoader worker(s) "
        "build the batches"
    )


class BatchLoader:
    """The batches of an :class:`ArrowBatchDataset`, built by ``num_workers`` DataLoader workers
    (0: in this process). ``pin_memory``: batches in page-locked memory (for a CUDA device:
    their copy then overlaps the GPU's work). ``persistent``: the workers serve every pass
    over the dataset (each ``iter``), not one. An error in a worker is raised here as it was
    raised there.

    Several workers over Parquet files decode each row group once between them, through a
    directory in shared memory this loader owns (:mod:`dynarec.data.shared_decode`): a pass's
    row groups are deleted as their steps are delivered, the pass's directory when it ends or
    is abandoned, the whole directory with the loader. The deleting runs on a thread of the
    loader's own: freeing a chunk's pages takes the time of a training step's host work. The
    workers' batches come through that directory too, a file each (``BatchFile``), read (by
    the DataLoader's pinning thread, straight into page-locked memory, where it pins) and
    deleted as they arrive."""

    def __init__(
        self, dataset: ArrowBatchDataset, num_workers: int, pin_memory: bool = False, persistent: bool = False
    ):
        self.shared_root: Optional[str] = None
        self.num_workers = num_workers
        self._passes = 0
        # Deletes delivered row groups' chunks (its thread starts at the first: only with shared decoding)
        self._deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynarec-chunk-deleter")
        units = dataset.units() if num_workers > 1 else None
        if units and _shared_memory_holds(units, num_workers, dataset.batch_size):
            dataset = copy.copy(dataset)
            dataset.chunk_rows = shared_decode.CHUNK_ROWS
            self.shared_root, lock = scratch_directory(shared_memory_dir(), "dynarec-rows-")
            dataset.shared_root = self.shared_root
            weakref.finalize(self, remove_scratch, self.shared_root, lock)
        self.dataset = dataset
        self._pin_memory, self._persistent = pin_memory, persistent and num_workers > 0
        self.loader = self._data_loader()

    def _data_loader(self) -> DataLoader:
        """A DataLoader of the dataset (its workers start with its first pass)."""
        return DataLoader(
            self.dataset,
            batch_size=None,
            num_workers=self.num_workers,
            multiprocessing_context=worker_context(self.num_workers),
            worker_init_fn=_init_worker if self.num_workers else None,
            pin_memory=self._pin_memory,
            persistent_workers=self._persistent,
        )

    def __iter__(self) -> Iterator[Batch]:
        try:
            yield from self._pass()
        except Exception:
            # The workers end with the pass: a persistent DataLoader would keep them until the
            # interpreter's exit, where multiprocessing's terminate() cannot end them (they ignore
            # SIGTERM: _init_worker) and its join waits for them forever.
            self.loader = self._data_loader()
            raise

    def _pass(self) -> Iterator[Batch]:
        if self.shared_root is None:
            for item in self.loader:
                yield _delivered(item)
            return
        self._passes += 1
        self.dataset.shared_pass = self._passes - 1  # workers started now count from here
        for old in Path(self.shared_root).glob("pass-*"):  # an abandoned pass: its workers stop waiting
            retire(old)
        directory = pass_directory(self.shared_root, self._passes)
        directory.mkdir()
        units = self.dataset.units() or []
        chunk_rows = self.dataset.chunk_rows
        parts = [len(shared_decode.column_parts(unit, self.num_workers)) for unit in units]
        chunks = [(u, i, parts[u]) for u, unit in enumerate(units) for i in range(unit.num_chunks(chunk_rows))]
        global_batch = self.dataset.global_batch_size
        total = units[-1].end if units else 0
        done = 0  # of chunks: those before it are deleted
        steps = 0
        try:
            for step, item in enumerate(self.loader):
                steps += 1
                yield _delivered(item)
                delivered = min((step + 1) * global_batch, total)
                read = done
                while read < len(chunks) and units[chunks[read][0]].chunk_end(chunks[read][1], chunk_rows) <= delivered:
                    read += 1
                if read > done:
                    self._deleter.submit(remove_chunks, directory, chunks[done:read])
                done = read
            if steps < self.dataset.num_steps():  # the workers found their pass's directory gone
                raise DataError(
                    f"the data loader's shared directory {directory} was removed during the pass ({steps} of "
                    f"{self.dataset.num_steps()} batches delivered); another process deleted it"
                )
        finally:
            retire(directory, self._deleter)


def _delivered(item: Union[Batch, BatchFile, DataError, WorkerFailure]) -> Batch:
    """The batch a worker delivered (read where it came as a file and nothing pinned it); the
    worker's error, or the pinning thread's, raised as it was."""
    if isinstance(item, WorkerFailure):
        raise item.error
    if isinstance(item, DataError):
        raise item
    if isinstance(item, BatchFile):
        return item.load()
    return item


def _shared_memory_holds(units: list[Unit], workers: int, batch_rows: int) -> bool:
    """Whether the shared-memory directory has room for what a pass keeps there at once: about
    ``workers + 2`` of the largest row groups, uncompressed, twice over for Arrow's own layout,
    and the batches of ``batch_rows`` rows (this rank's share of a step) on their way to the
    training process, DataLoader's two a worker, each at 4 times its rows' uncompressed bytes
    (ids and lengths widen to 64 bits; dictionary-encoded columns count small in the footers).
    Where it has not (a container's small /dev/shm), every worker decodes its own rows and
    batches travel as torch sends them."""
    row_bytes = max(u.nbytes / max(u.rows, 1) for u in units)
    need = 2 * (workers + 2) * max(u.nbytes for u in units) + 2 * workers * 4 * batch_rows * row_bytes
    stat = os.statvfs(shared_memory_dir())
    return stat.f_bavail * stat.f_frsize >= need


def leaf_fields(meta: pq.FileMetaData) -> list[str]:
    """The top-level column of each of a Parquet file's leaf columns, in order (a nested
    column's leaves are its own; a column's name may hold dots, as its leaves' paths do)."""

    def leaves(t: pa.DataType) -> int:
        if pa.types.is_struct(t):
            return sum(leaves(t.field(i).type) for i in range(t.num_fields))
        if pa.types.is_map(t):
            return leaves(t.key_type) + leaves(t.item_type)
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            return leaves(t.value_type)
        return 1

    return [f.name for f in meta.schema.to_arrow_schema() for _ in range(leaves(f.type))]


def _parquet_metadata(path: str) -> pq.FileMetaData:
    """A Parquet file's footer; DataError naming the file where it is not one."""
    try:
        return pq.ParquetFile(path).metadata
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from None


def _row_groups(path: str, columns: Sequence[str]) -> list[tuple[int, int, tuple[tuple[str, int], ...]]]:
    """``(rows, uncompressed bytes, ((column, its uncompressed bytes), ...))`` of each row group
    of a Parquet file, the columns those of ``columns`` the file holds, in that order (a nested
    column's bytes are its leaves')."""
    meta = _parquet_metadata(path)
    fields = leaf_fields(meta)
    out = []
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        sizes: dict[str, int] = {}
        for j in range(group.num_columns):
            name = fields[j]
            sizes[name] = sizes.get(name, 0) + group.column(j).total_uncompressed_size
        out.append((group.num_rows, group.total_byte_size, tuple((c, sizes[c]) for c in columns if c in sizes)))
    return out


def make_loader(
    dataset: ArrowBatchDataset, num_workers: int, pin_memory: bool = False, persistent: bool = False
) -> BatchLoader:
    """A :class:`BatchLoader` over ``dataset``."""
    return BatchLoader(dataset, num_workers, pin_memory, persistent)
