"""An epoch's built batches kept for the epochs after it (``data.cache_batches``).

Building a batch (Parquet decoding, hashing, splitting) costs more than a training step on a
CPU at small batches, and bounds a GPU's step without enough loader workers. Later epochs of a
run read the same rows into the same batches, so the first whole epoch's batches are kept:

- ``memory``: the batches themselves (every batch's tensors held for the run; for a GPU, a copy
  in its memory, which the steps of every epoch train on: see :class:`MemoryBatchCache`);
- ``disk``: each batch packed into one file (``Batch.packed``, as a DataLoader worker sends it)
  of a directory of the run's own under ``data.batch_cache_dir`` (default: the system's temp
  directory), read back in order — one read a batch (into page-locked memory for a GPU), no
  decoding. The directory is removed when the run ends, and by the next run where a killed
  process left it (it is locked while its process lives).

Either gives the later epochs the same batches, bit for bit. A ``batch_cache_dir`` where no
directory can be made is a config error when the run starts; a cache that cannot be made or
written later (the disk full) ends with a warning, and the later epochs build their batches
again; a cached file that cannot be read back (removed) has the rest of that epoch built again.
"""

from __future__ import annotations

import errno
import os
import tempfile
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Optional, Union

import torch

from dynarec.config.load import ConfigError
from dynarec.data.batch import Batch, BatchFile, DataError
from dynarec.data.shared_decode import PassAbandoned, write_batch
from dynarec.embedding.streams import batch_stream
from dynarec.files import describe_os_error, remove_scratch, scratch_directory

__all__ = ["BatchCacheLost", "DiskBatchCache", "MemoryBatchCache", "batch_cache", "check_cache_dir"]


class MemoryBatchCache:
    """An epoch's batches, held. For a CUDA ``device``, a copy of each batch is kept in the
    device's memory (while the copies take at most ``device_bytes``, default an eighth of the
    device's memory; the batches past that stay in host memory), and the step trains on that
    copy: each batch crosses to the device once for the whole run. Keeping the page-locked host
    batches instead would hold every page-locked block of the first epoch: torch's host
    allocator could reuse none, and each batch would be a fresh ``cudaHostAlloc`` beside the
    step (on an H100 that made the first epoch's steps of TorchEasyRec's dlrm_criteo at batch
    8,192 about 50% slower: benchmarks/results/2026-12-05-h100-dlrm-batch-cache.md)."""

    def __init__(self, device: Optional[torch.device] = None, device_bytes: Optional[int] = None) -> None:
        self._batches: list[Batch] = []
        self.failed = False
        self.device = device if device is not None and device.type == "cuda" else None
        if self.device is not None and device_bytes is None:
            device_bytes = torch.cuda.get_device_properties(self.device).total_memory // 8
        self.device_bytes = device_bytes or 0
        self.bytes_on_device = 0

    def add(self, batch: Batch) -> Batch:
        """Keeps ``batch`` and returns the batch the step is to train on: the device's copy
        where one was made (copied on the device's batch stream; its ``ready`` event follows the
        copy), else ``batch`` itself."""
        size = batch.nbytes
        if self.device is not None and self.bytes_on_device + size <= self.device_bytes:
            stream = batch_stream(self.device)
            with torch.cuda.stream(stream):
                batch = batch.to(self.device)
                batch.ready = torch.cuda.Event()
                batch.ready.record(stream)
            self.bytes_on_device += size
        self._batches.append(batch)
        return batch

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self._batches)

    def close(self) -> None:
        """Drops the batches. Device copies are freed once the device has done all its work
        (their memory returns to the batch stream's pool, and the steps read them on others)."""
        if self.bytes_on_device:
            torch.cuda.synchronize(self.device)
        self._batches = []
        self.bytes_on_device = 0


class BatchCacheLost(Exception):
    """A cached batch's file could not be read back (removed, truncated): the epoch's batches
    from there on are to be built from the files again."""


class DiskBatchCache:
    """An epoch's batches, a packed file each in a locked directory of its own under ``parent``
    (None: the system's temp directory); read back page-locked where ``pin``. Where the directory
    cannot be made, or a batch cannot be written, the cache ends with a warning (:attr:`failed`):
    the run goes on without it."""

    PREFIX = "dynarec-batch-cache-"

    def __init__(self, parent: Optional[str], pin: bool = False) -> None:
        self.pin = pin
        self.failed = False
        self.directory: Optional[Path] = None
        self._files: list[BatchFile] = []
        base = _base(parent)
        try:
            root, lock = scratch_directory(base, self.PREFIX)
        except OSError as e:
            self._fail(f"no directory could be made in {base} ({describe_os_error(e)})")
            return
        self.directory = Path(root)
        self._remove = weakref.finalize(self, remove_scratch, root, lock)

    def _fail(self, why: str) -> None:
        warnings.warn(f"data.cache_batches: disk: {why}; the later epochs build their batches again", stacklevel=3)
        self.failed = True
        self.close()

    def add(self, batch: Batch) -> Batch:
        """Writes ``batch`` as the next file, and returns it; a write that fails ends the cache
        (a warning, the files removed): it is never complete, and the run goes on."""
        if self.failed:
            return batch
        assert self.directory is not None
        try:
            self._files.append(write_batch(self.directory, len(self._files), batch))
        except (OSError, PassAbandoned) as e:
            why = describe_os_error(e) if isinstance(e, OSError) else "its directory was removed"
            self._fail(f"batch {len(self._files)} could not be written to {self.directory} ({why})")
        return batch

    def __len__(self) -> int:
        return len(self._files)

    def __iter__(self) -> Iterator[Batch]:
        """The batches in order; BatchCacheLost where a file cannot be read back."""
        for i, f in enumerate(self._files):
            try:
                yield f.load(pin=self.pin, keep=True)
            except DataError as e:
                raise BatchCacheLost(f"cached batch {i} could not be read back ({e})") from None

    def close(self) -> None:
        """Removes the directory and its files."""
        self._files = []
        if self.directory is not None:
            self._remove()


def check_cache_dir(parent: Optional[str]) -> None:
    """ConfigError naming ``data.batch_cache_dir`` where the disk cache's directory could not be
    made under ``parent`` (checked when a run starts; a later failure is a warning)."""
    base = _base(parent)
    try:
        Path(base).mkdir(parents=True, exist_ok=True)
        if not os.access(base, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), base)
    except OSError as e:
        raise ConfigError(
            f"data.batch_cache_dir: cannot make the batch cache in {base} ({describe_os_error(e)})"
        ) from None


def _base(parent: Optional[str]) -> str:
    """``data.batch_cache_dir``, or the system's temp directory where it is unset."""
    return parent if parent is not None else tempfile.gettempdir()


def batch_cache(kind: str, directory: Optional[str], device: torch.device) -> Union[MemoryBatchCache, DiskBatchCache]:
    """The cache ``data.cache_batches`` names (``memory`` or ``disk``) of batches bound for
    ``device`` (a CUDA device's: kept in its memory, or read back page-locked)."""
    return MemoryBatchCache(device) if kind == "memory" else DiskBatchCache(directory, pin=device.type == "cuda")
