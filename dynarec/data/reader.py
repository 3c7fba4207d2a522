"""Parquet and CSV readers (pyarrow): files -> fixed-size batches, in a deterministic order.

Files are read in sorted order, rows in file order; batches hold exactly ``batch_size`` rows
(the last one of an epoch may hold fewer), whatever the files' row groups. With DataLoader
workers, worker ``w`` of ``W`` reads files ``w, w + W, ...`` and the loader interleaves their
batches round-robin, which is deterministic too.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from dynarec.data.batch import Batch, BatchBuilder, DataError, RowOrigin

__all__ = ["resolve_files", "ArrowBatchDataset", "make_loader", "read_table"]


def resolve_files(paths: Union[str, Sequence[str]], what: str = "input") -> list[str]:
    """Expands files, directories and glob patterns into a sorted file list."""
    if isinstance(paths, str):
        paths = [paths]
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            files += [str(x) for x in sorted(Path(p).iterdir()) if x.suffix in (".parquet", ".csv")]
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
    with pacsv.open_csv(path) as reader:
        return reader.schema


def _record_batches(path: str, columns: list[str], input_type: Optional[str]) -> Iterator[pa.RecordBatch]:
    if _file_type(path, input_type) == "parquet":
        yield from pq.ParquetFile(path).iter_batches(batch_size=65536, columns=columns)
    else:
        opts = pacsv.ConvertOptions(include_columns=columns, strings_can_be_null=False)
        with pacsv.open_csv(path, convert_options=opts) as reader:
            yield from reader


def read_table(path: str, columns: Optional[list[str]] = None, input_type: Optional[str] = None) -> pa.Table:
    batches = list(_record_batches(path, columns or file_schema(path, input_type).names, input_type))
    return pa.Table.from_batches(batches) if batches else file_schema(path, input_type).empty_table()


class ArrowBatchDataset(IterableDataset):
    """Yields :class:`Batch` objects from ``files``; ``skip`` batches (of this dataset's own
    stream, before worker interleaving) are read and dropped first."""

    def __init__(self, files: list[str], builder: BatchBuilder, batch_size: int, input_type: Optional[str] = None):
        super().__init__()
        self.files = files
        self.builder = builder
        self.batch_size = batch_size
        self.input_type = input_type

    def check_files(self) -> None:
        """Validates every file's schema before anything is read or written."""
        for f in self.files:
            self.builder.check_schema(file_schema(f, self.input_type), f)

    def _my_files(self) -> list[str]:
        info = get_worker_info()
        if info is None:
            return self.files
        return self.files[info.id :: info.num_workers]

    def __iter__(self) -> Iterator[Batch]:
        columns = self.builder.columns()
        pieces: list[tuple[str, int, pa.Table]] = []  # (file, first row in file, zero-copy slice)
        rows = 0
        for path in self._my_files():
            row_in_file = 0
            for rb in _record_batches(path, columns, self.input_type):
                table = pa.Table.from_batches([rb])
                start = 0
                while start < table.num_rows:
                    take = min(table.num_rows - start, self.batch_size - rows)
                    pieces.append((path, row_in_file + start, table.slice(start, take)))
                    rows += take
                    start += take
                    if rows == self.batch_size:
                        yield self._build(pieces)
                        pieces, rows = [], 0
                row_in_file += table.num_rows
        if pieces:
            yield self._build(pieces)

    def _build(self, pieces: list[tuple[str, int, pa.Table]]) -> Batch:
        """One Batch from consecutive slices; contiguous slices of a file form one run of the
        batch's :class:`RowOrigin`, so errors name the right file and row."""
        runs: list[tuple[str, int, int]] = []
        for path, first, t in pieces:
            if runs and runs[-1][0] == path and runs[-1][1] + runs[-1][2] == first:
                runs[-1] = (path, runs[-1][1], runs[-1][2] + t.num_rows)
            else:
                runs.append((path, first, t.num_rows))
        table = pa.concat_tables([t for _, _, t in pieces]) if len(pieces) > 1 else pieces[0][2]
        return self.builder.build(table, RowOrigin(tuple(runs)))


def make_loader(dataset: ArrowBatchDataset, num_workers: int) -> DataLoader:
    """A DataLoader over already-built batches (``batch_size=None``)."""
    return DataLoader(dataset, batch_size=None, num_workers=num_workers,
                      persistent_workers=False, multiprocessing_context="fork" if num_workers else None)

