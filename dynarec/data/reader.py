"""Parquet and CSV readers (pyarrow): files -> fixed-size batches, in a deterministic order.

Files are read in sorted order, rows in file order; batches hold exactly ``batch_size`` rows
(the last one of an epoch may hold fewer), whatever the files' row groups or the number of
DataLoader workers. A data position (epoch, rows consumed) seeks straight to its row.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from dynarec.data.batch import Batch, BatchBuilder, DataError, RowOrigin

__all__ = [
    "ArrowBatchDataset",
    "DataPosition",
    "data_files",
    "make_loader",
    "num_rows",
    "read_table",
    "resolve_files",
]


def data_files(directory: Union[str, Path]) -> list[str]:
    """The ``.parquet`` / ``.csv`` files of a directory, by name; hidden and ``_``-prefixed names
    are writers' temporaries (Spark's, a streaming writer's before its rename) and are skipped."""
    return [
        str(x)
        for x in sorted(Path(directory).iterdir())
        if x.suffix in (".parquet", ".csv") and not x.name.startswith((".", "_")) and x.is_file()
    ]


def resolve_files(paths: Union[str, Sequence[str]], what: str = "input") -> list[str]:
    """Expands files, directories and glob patterns into a sorted file list."""
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
            raise FileNotFoundError(f"{what} path {p} does not exist")
    if not files:
        raise FileNotFoundError(f"{what} paths {list(paths)} match no .parquet or .csv file")
    return sorted(dict.fromkeys(files))


def _file_type(path: str, input_type: Optional[str]) -> str:
    if input_type:
        return input_type
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith(".csv"):
        return "csv"
    raise DataError(f"{path}: cannot tell parquet from csv; set data.input_type")


def file_schema(path: str, input_type: Optional[str] = None) -> pa.Schema:
    if _file_type(path, input_type) == "parquet":
        try:
            return pq.read_schema(path)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    try:
        with pacsv.open_csv(path) as reader:
            return reader.schema
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}{_csv_row_of(path, input_type)}: cannot be read ({e})") from None


def _record_batches(path: str, columns: list[str], input_type: Optional[str]) -> Iterator[pa.RecordBatch]:
    if _file_type(path, input_type) == "parquet":
        yield from pq.ParquetFile(path).iter_batches(batch_size=65536, columns=columns)
    else:
        opts = pacsv.ConvertOptions(include_columns=columns, strings_can_be_null=False)
        with pacsv.open_csv(path, convert_options=opts) as reader:
            yield from reader


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t)


def num_rows(path: str, input_type: Optional[str] = None) -> int:
    """Rows of a file: a Parquet footer's count, or a CSV file's rows (read once)."""
    if _file_type(path, input_type) == "parquet":
        try:
            return pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{path}: not a readable Parquet file ({e})") from None
    try:
        with pacsv.open_csv(path, convert_options=pacsv.ConvertOptions(include_columns=[])) as reader:
            return sum(b.num_rows for b in reader)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}{_csv_row_of(path, input_type)}: cannot be read ({e})") from None


def _record_batches_from(
    path: str, columns: list[str], input_type: Optional[str], skip: int
) -> Iterator[tuple[int, pa.Table]]:
    """``(first row in file, table)`` of ``path`` from row ``skip`` on; Parquet row groups before
    it are not read."""
    row = 0
    source: Iterator[pa.RecordBatch]
    if _file_type(path, input_type) == "parquet":
        f = pq.ParquetFile(path)
        groups: list[int] = []
        for g in range(f.metadata.num_row_groups):
            n = f.metadata.row_group(g).num_rows
            if not groups and row + n <= skip:  # every group before the one holding row `skip`
                row += n
            else:
                groups.append(g)
        source = f.iter_batches(batch_size=65536, columns=columns, row_groups=groups) if groups else iter(())
    else:
        source = _record_batches(path, columns, input_type)
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

    with open(path, newline="") as f:
        rows = csv.reader(f)
        width = len(next(rows, []))
        for i, fields in enumerate(rows):
            if len(fields) != width:
                return f", row {i}"
    return ""


def read_table(path: str, columns: Optional[list[str]] = None, input_type: Optional[str] = None) -> pa.Table:
    batches = list(_record_batches(path, columns or file_schema(path, input_type).names, input_type))
    return pa.Table.from_batches(batches) if batches else file_schema(path, input_type).empty_table()


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

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    def check_files(self) -> None:
        """Validates every file's schema before anything is read or written: each has every
        column a batch needs, and a column has one type in every file (numbers of any width
        and sign mix: they are widened)."""
        first: dict[str, tuple[str, pa.DataType]] = {}
        for f in self.files:
            schema = file_schema(f, self.input_type)
            self.builder.check_schema(schema, f)
            for column in self.builder.columns():
                t = schema.field(column).type
                seen = first.setdefault(column, (f, t))
                if seen[1] != t and not (_numeric(seen[1]) and _numeric(t)):
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

    def num_steps(self) -> int:
        """Global batches in one pass from ``start_row``."""
        return -(-max(self.num_rows - self.start_row, 0) // self.global_batch_size)

    def _pieces(self) -> Iterator[tuple[str, int, pa.Table]]:
        """``(file, first row in file, slice)`` covering every row from ``start_row`` on."""
        skip = self.start_row
        columns = self.builder.columns()
        for path, count in zip(self.files, self.row_counts()):
            if skip >= count:
                skip -= count
                continue
            for first, table in _record_batches_from(path, columns, self.input_type, skip):
                yield path, first, table
            skip = 0

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
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
        table = pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]
        return self.builder.build(table, RowOrigin(tuple(runs)))


def make_loader(dataset: ArrowBatchDataset, num_workers: int, pin_memory: bool = False) -> DataLoader:
    """A DataLoader over already-built batches (``batch_size=None``); ``pin_memory``: batches in
    page-locked memory (for a CUDA device: their copy then overlaps the GPU's work)."""
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=False,
        multiprocessing_context="fork" if num_workers else None,
    )
