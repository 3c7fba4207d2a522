"""An epoch's built batches kept for the epochs after it (``data.cache_batches``).

Building a batch (Parquet decoding, hashing, splitting) costs more than a training step on a
CPU at small batches, and bounds a GPU's step without enough loader workers. Later epochs of a
run read the same rows into the same batches, so the first whole epoch's batches are kept:

- ``memory``: the batches themselves (every batch's tensors held for the run);
- ``disk``: each batch packed into one file (``Batch.packed``, as a DataLoader worker sends it)
  of a directory of the run's own under ``data.batch_cache_dir`` (default: the system's temp
  directory), read back in order — one read a batch (into page-locked memory for a GPU), no
  decoding. The directory is removed when the run ends, and by the next run where a killed
  process left it (it is locked while its process lives).

Either gives the later epochs the same batches, bit for bit. A batch that cannot be written
(the disk full) ends the disk cache with a warning: later epochs build their batches again.
"""

from __future__ import annotations

import tempfile
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Optional, Union

from dynarec.config.load import ConfigError
from dynarec.data.batch import Batch, BatchFile
from dynarec.data.shared_decode import PassAbandoned, write_batch
from dynarec.files import describe_os_error, remove_scratch, scratch_directory

__all__ = ["DiskBatchCache", "MemoryBatchCache", "batch_cache"]


class MemoryBatchCache:
    """An epoch's batches, held."""

    def __init__(self) -> None:
        self._batches: list[Batch] = []
        self.failed = False

    def add(self, batch: Batch) -> None:
        self._batches.append(batch)

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self._batches)

    def close(self) -> None:
        self._batches = []


class DiskBatchCache:
    """An epoch's batches, a packed file each in a locked directory of its own under ``parent``
    (None: the system's temp directory); read back page-locked where ``pin``."""

    PREFIX = "dynarec-batch-cache-"

    def __init__(self, parent: Optional[str], pin: bool = False) -> None:
        base = parent if parent is not None else tempfile.gettempdir()
        try:
            Path(base).mkdir(parents=True, exist_ok=True)
            root, lock = scratch_directory(base, self.PREFIX)
        except OSError as e:
            raise ConfigError(
                f"data.batch_cache_dir: cannot make the batch cache in {base} ({describe_os_error(e)})"
            ) from None
        self.directory = Path(root)
        self.pin = pin
        self.failed = False
        self._files: list[BatchFile] = []
        self._remove = weakref.finalize(self, remove_scratch, root, lock)

    def add(self, batch: Batch) -> None:
        """Writes ``batch`` as the next file; a write that fails ends the cache (a warning, the
        files removed): it is never complete, and the run goes on."""
        if self.failed:
            return
        try:
            self._files.append(write_batch(self.directory, len(self._files), batch))
        except (OSError, PassAbandoned) as e:
            why = describe_os_error(e) if isinstance(e, OSError) else "its directory was removed"
            warnings.warn(
                f"data.cache_batches: disk: batch {len(self._files)} could not be written to {self.directory} "
                f"({why}); the later epochs build their batches again",
                stacklevel=2,
            )
            self.failed = True
            self.close()

    def __len__(self) -> int:
        return len(self._files)

    def __iter__(self) -> Iterator[Batch]:
        for f in self._files:
            yield f.load(pin=self.pin, keep=True)

    def close(self) -> None:
        """Removes the directory and its files."""
        self._files = []
        self._remove()


def batch_cache(kind: str, directory: Optional[str], pin: bool) -> Union[MemoryBatchCache, DiskBatchCache]:
    """The cache ``data.cache_batches`` names (``memory`` or ``disk``)."""
    return MemoryBatchCache() if kind == "memory" else DiskBatchCache(directory, pin)
