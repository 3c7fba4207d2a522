"""Readers (Parquet, CSV), batch building and the synthetic click log."""

from dynarec.data.batch import Batch, BatchBuilder, DataError, RowOrigin
from dynarec.data.reader import ArrowBatchDataset, make_loader, resolve_files

__all__ = ["ArrowBatchDataset", "Batch", "BatchBuilder", "DataError", "RowOrigin", "make_loader", "resolve_files"]
