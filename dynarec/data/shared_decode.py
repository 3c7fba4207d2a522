"""Row groups decoded once for all of a loader's workers.

DataLoader worker ``w`` of ``W`` builds steps ``w, w + W, ...`` (so the batches are the same
whatever the number of workers), and so needs rows of every Parquet row group. Each worker
decoding every row group would decode the files ``W`` times over — and decoding is half the data
stage (about 1 µs a row of the demo's schema or a Criteo-shaped one on one core, as much as
building the batch). Instead every row group is decoded once, by all workers together: its
columns are split into ``P = min(W, columns)`` parts of about equal bytes (:func:`column_parts`),
and part ``p`` of the ``u``-th row group of a pass is decoded by worker ``(u * P + p) mod W``
alone, in chunks of ``chunk_rows`` rows, each written as an Arrow IPC file to shared memory
(``/dev/shm``, else the temp directory) and memory-mapped by the workers that need its rows: read
in place, never copied, the parts of a chunk put side by side.

A row group's column decodes sequentially; split by columns, a row group decodes at up to ``P``
cores' pace, and the pass's first row group (which every worker waits for at the start of an
epoch) no longer at one core's. A worker decodes:

- its parts of the chunks that the step it builds needs, first;
- after each step, its parts that the next two rounds of ``W`` steps read (the other workers
  are about to wait for them), then up to ``2 * global batch`` rows' worth of those further
  ahead (up to ``ahead`` rows past the step; a part counts for its share of the columns): in
  the steady state a round of steps asks each worker for about one global batch of decoding, so
  the row groups ahead decode in parallel, spread over the steps, and are ready when the pass
  reaches them;
- while it waits for another's part, its own next ones (up to ``ahead`` rows past the step);
- at the end of its steps, all of its own parts left (another's last steps may read them).

Every worker decodes what its current step needs of its own before it waits for another's, and
waits only for chunks of row groups at or before those of its step: the worker of the earliest
step not yet delivered never waits on an idle decoder, and a pass cannot deadlock. The training
process deletes a chunk's files once every step that reads it was delivered, and the pass's
directory when the pass ends or is abandoned; a worker waiting on a directory gone stops (its
pass was abandoned). A worker that fails (decoding, writing a chunk, building a batch) leaves
its error in the pass's directory, and the workers waiting for its parts raise it too.

A worker's batches travel through the pass's directory too (:func:`write_batch`): a file each,
read into page-locked memory by the training process and deleted there (``BatchFile``).

Memory: the chunks between the earliest step not yet delivered and ``ahead`` rows past the
latest one, in shared memory (``ahead``: ``W`` row groups and two rounds of steps), and up to
``2 W`` batch files (DataLoader's prefetching: two a worker).
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pyarrow as pa

from dynarec.data.batch import Batch, BatchFile, DataError

__all__ = [
    "PassAbandoned",
    "RowGroupExchange",
    "Unit",
    "column_parts",
    "mark_failed",
    "pass_directory",
    "remove_chunks",
    "retire",
    "shared_memory_dir",
    "travelling",
    "write_batch",
]

# How long a worker waits for another's chunk before it calls the pass stuck.
WAIT_TIMEOUT_S = 600.0
# Rows of a published chunk: a file holds a few megabytes of the demo's schema.
CHUNK_ROWS = 16384


class PassAbandoned(Exception):
    """The pass's directory is gone: the training process ended or abandoned the pass."""


@dataclass(frozen=True)
class Unit:
    """One Parquet row group of a pass: the pass's rows ``[start, start + rows)`` are rows
    ``[skip, skip + rows)`` of row group ``row_group`` of ``path``, whose first row is row
    ``first_row`` of the file (``skip`` > 0 only where a pass starts inside the row group)."""

    path: str
    row_group: int
    first_row: int
    skip: int
    start: int
    rows: int
    nbytes: int = 0  # the row group's uncompressed bytes (its footer's; all its columns)
    # The columns read, each with its uncompressed bytes in the row group (the footer's)
    columns: tuple[tuple[str, int], ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.rows

    def num_chunks(self, chunk_rows: int) -> int:
        return -(-(self.skip + self.rows) // chunk_rows)

    def chunk_end(self, i: int, chunk_rows: int) -> int:
        """The pass row after chunk ``i``."""
        return min(self.start - self.skip + (i + 1) * chunk_rows, self.end)

    def chunk_start(self, i: int, chunk_rows: int) -> int:
        """The pass row of chunk ``i``'s first row (before the pass's first for a skipped one)."""
        return self.start - self.skip + i * chunk_rows

    def chunk_rows_in_pass(self, i: int, chunk_rows: int) -> int:
        """Rows of chunk ``i`` that belong to the pass (0 for one wholly before it)."""
        return max(0, self.chunk_end(i, chunk_rows) - max(self.chunk_start(i, chunk_rows), self.start))


def shared_memory_dir() -> str:
    """``/dev/shm`` where it can be written (files there live in memory), else the temp directory."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def pass_directory(root: str, number: int) -> Path:
    return Path(root) / f"pass-{number}"


def chunk_name(u: int, i: int, part: int) -> str:
    return f"{u}.{i}.{part}.arrow"


def column_parts(unit: Unit, workers: int) -> list[tuple[str, ...]]:
    """``unit``'s columns in ``min(workers, columns)`` parts of about equal bytes (each column,
    largest first, to the lightest part so far), each part in the columns' order; the same in
    every process. A unit without columns is one part (every column: ``()``)."""
    if not unit.columns:
        return [()]
    count = min(workers, len(unit.columns))
    loads, members = [0] * count, [[] for _ in range(count)]  # type: list[int], list[list[int]]
    for j in sorted(range(len(unit.columns)), key=lambda j: (-unit.columns[j][1], j)):
        lightest = min(range(count), key=lambda p: (loads[p], p))
        loads[lightest] += unit.columns[j][1]
        members[lightest].append(j)
    return [tuple(unit.columns[j][0] for j in sorted(m)) for m in members]


def part_owner(u: int, part: int, parts: int, workers: int) -> int:
    """The worker that decodes part ``part`` (of ``parts``) of the pass's row group ``u``."""
    return (u * parts + part) % workers


class RowGroupExchange:
    """One worker's view of a pass's row groups (``units``): its own parts of them (see
    :func:`part_owner`) read by ``read_unit`` (the row group's record batches of the part's
    columns, from its first row) and published to ``directory`` in chunks of ``chunk_rows``
    rows, the others' mapped from there. ``frontier``: the pass row before which this worker
    decodes its own parts while it waits (the loop sets it each step)."""

    def __init__(
        self,
        directory: Path,
        worker: int,
        workers: int,
        units: list[Unit],
        read_unit: Callable[[Unit, tuple[str, ...]], Iterator[pa.RecordBatch]],
        chunk_rows: int = CHUNK_ROWS,
    ):
        self.directory = directory
        self.worker = worker
        self.workers = workers
        self.units = units
        self.read_unit = read_unit
        self.chunk_rows = chunk_rows
        self.frontier = 0
        self._parts = [column_parts(unit, workers) for unit in units]
        # (row group, part) this worker decodes, in the pass's order: at most one part of each
        self._own = [
            (u, p)
            for u, parts in enumerate(self._parts)
            for p in range(len(parts))
            if part_owner(u, p, len(parts), workers) == worker
        ]
        self._own_part = dict(self._own)
        self._own_index = 0  # of self._own: the part being decoded
        self._chunks: Optional[Iterator[pa.Table]] = None  # its chunks still to come
        self._next_chunk = 0
        self._mapped: dict[tuple[int, int], pa.Table] = {}

    # -- this worker's own parts ---------------------------------------------------------------

    def _next_own(self) -> Optional[tuple[int, int, int]]:
        """``(row group, part, chunk)`` this worker decodes next, None when it has decoded all."""
        if self._own_index >= len(self._own):
            return None
        u, p = self._own[self._own_index]
        return u, p, self._next_chunk

    def _published(self, u: int, i: int) -> bool:
        """Whether this worker's part of chunk ``(u, i)`` is published."""
        nxt = self._next_own()
        return nxt is None or (u, i) < (nxt[0], nxt[2])

    def decode_one(self) -> float:
        """Decodes and publishes this worker's next chunk of a part; the rows it decoded as a
        share of whole rows (its rows times its share of the columns), 0 when none is left."""
        nxt = self._next_own()
        if nxt is None:
            return 0.0
        u, p, i = nxt
        unit, parts = self.units[u], self._parts[u]
        if self._chunks is None:
            self._chunks = _rechunked(self.read_unit(unit, parts[p]), self.chunk_rows)
        table = next(self._chunks)  # a decoding error fails the worker: mark_failed tells the waiting ones

        def write(f) -> None:
            with pa.ipc.new_file(f, table.schema) as writer:
                writer.write_table(table)

        rows = unit.chunk_rows_in_pass(i, self.chunk_rows)
        if rows > 0:  # (a resumed pass skips rows before it)
            write_atomic(self.directory / chunk_name(u, i, p), write)
        self._next_chunk += 1
        if self._next_chunk == unit.num_chunks(self.chunk_rows):
            self._own_index, self._next_chunk, self._chunks = self._own_index + 1, 0, None
        return max(rows, 1) / len(parts)

    def decode_ahead(self, before: int, rows: Optional[int] = None) -> None:
        """Decodes own parts of chunks starting before pass row ``before``: all of them, or about
        ``rows`` rows' worth of them (a part counting for its share of the columns)."""
        done = 0.0
        while rows is None or done < rows:
            nxt = self._next_own()
            if nxt is None or self.units[nxt[0]].chunk_start(nxt[2], self.chunk_rows) >= before:
                return
            done += self.decode_one()

    def decode_rest(self) -> None:
        """Decodes every own part left."""
        while self.decode_one():
            pass

    # -- rows of any row group -----------------------------------------------------------------

    def rows(self, u: int, a: int, b: int) -> pa.Table:
        """Rows ``[a, b)`` of row group ``u``'s rows of the pass, as one table."""
        c, skip = self.chunk_rows, self.units[u].skip
        first, last = (skip + a) // c, (skip + b - 1) // c
        parts = [self._chunk(u, i) for i in range(first, last + 1)]
        table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        return table.slice(skip + a - first * c, b - a)

    def forget_before(self, row: int) -> None:
        """Lets go of the chunks ending at or before pass row ``row`` (this worker's later steps
        do not read them)."""
        for key in [k for k in self._mapped if self.units[k[0]].chunk_end(k[1], self.chunk_rows) <= row]:
            del self._mapped[key]

    def _chunk(self, u: int, i: int) -> pa.Table:
        """Chunk ``(u, i)``: its parts mapped and put side by side (in the unit's column order)."""
        if (u, i) not in self._mapped:
            if u in self._own_part:
                while not self._published(u, i):
                    self.decode_one()
            parts = [self._map(u, i, p) for p in range(len(self._parts[u]))]
            if len(parts) == 1:
                self._mapped[(u, i)] = parts[0]
            else:
                columns = {name: t.column(name) for t in parts for name in t.column_names}
                order = [name for name, _ in self.units[u].columns]
                self._mapped[(u, i)] = pa.table({name: columns[name] for name in order})
        return self._mapped[(u, i)]

    def _map(self, u: int, i: int, p: int) -> pa.Table:
        """Waits for part ``p`` of chunk ``(u, i)`` (or its decoder's error) and maps it; decodes
        this worker's own parts before the frontier meanwhile."""
        owner = part_owner(u, p, len(self._parts[u]), self.workers)
        path, failed = self.directory / chunk_name(u, i, p), self.directory / worker_failed(owner)
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        pause = 1e-4
        while True:
            try:
                with pa.memory_map(str(path)) as source:
                    return pa.ipc.open_file(source).read_all()
            except FileNotFoundError:
                pass
            if failed.exists():
                with open(failed, "rb") as f:
                    raise pickle.load(f)
            if not self.directory.is_dir():
                raise PassAbandoned
            if time.monotonic() > deadline:
                unit = self.units[u]
                raise TimeoutError(
                    f"{unit.path}: row group {unit.row_group} was not decoded within {WAIT_TIMEOUT_S:.0f}s "
                    f"by DataLoader worker {owner}"
                )
            nxt = self._next_own()
            if nxt is not None and self.units[nxt[0]].chunk_start(nxt[2], self.chunk_rows) < self.frontier:
                self.decode_one()  # work of its own while it waits
                continue
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)


def write_atomic(path: Path, write: Callable) -> None:
    """``write(file)`` into a temporary beside ``path``, then renamed to it; PassAbandoned where
    the directory is gone (the pass was abandoned meanwhile)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except FileNotFoundError:
        raise PassAbandoned from None


def write_batch(directory: Path, step: int, batch: Batch) -> BatchFile:
    """Step ``step``'s batch, packed, written to a file of the pass's ``directory`` (what a
    worker sends in the batch's place); PassAbandoned where the directory is gone."""
    buffer, slots, layout = batch.packed()
    path = directory / f"batch-{step}.bin"
    write_atomic(path, lambda f: f.write(buffer.numpy().data))
    return BatchFile(str(path), buffer.numel(), slots, layout)


def worker_failed(worker: int) -> str:
    """The file a worker leaves in its pass's directory when it fails (its error, pickled): the
    workers waiting for its chunks raise the same error instead of waiting."""
    return f"worker-{worker}.failed"


def mark_failed(directory: Path, worker: int, error: BaseException) -> None:
    try:
        write_atomic(directory / worker_failed(worker), lambda f: pickle.dump(error, f))
    except (PassAbandoned, OSError):  # nothing to tell: the pass is gone, or the disk is full
        pass


def retire(directory: Path, deleter: Optional[Executor] = None) -> None:
    """Removes a pass's directory: renamed first (at once, whole), so a worker still writing
    fails at once instead of leaving a file behind, then deleted (on ``deleter``'s thread, if
    given)."""
    tomb = directory.with_name(f".{directory.name}.retired.{os.getpid()}.{time.monotonic_ns()}")
    try:
        os.rename(directory, tomb)
    except OSError:
        return
    if deleter is None:
        shutil.rmtree(tomb, ignore_errors=True)
    else:
        deleter.submit(shutil.rmtree, tomb, ignore_errors=True)


def _rechunked(batches: Iterator[pa.RecordBatch], rows: int) -> Iterator[pa.Table]:
    """Tables of exactly ``rows`` rows (the last one fewer) of ``batches``' rows in order."""
    pending: list[pa.RecordBatch] = []
    held = 0
    for batch in batches:
        while batch.num_rows:
            take = min(rows - held, batch.num_rows)
            pending.append(batch.slice(0, take))
            held += take
            batch = batch.slice(take)
            if held == rows:
                yield pa.Table.from_batches(pending)
                pending, held = [], 0
    if held:
        yield pa.Table.from_batches(pending)


def travelling(e: BaseException) -> BaseException:
    """``e`` as it can travel to another process: itself, or a DataError of its message where
    it cannot be pickled."""
    try:
        pickle.dumps(e)
    except Exception:
        return DataError(f"{type(e).__name__}: {e}")
    return e


def remove_chunks(directory: Path, chunks: list[tuple[int, int, int]]) -> None:
    """Deletes the files of ``(row group, chunk, parts)`` ``chunks`` (their steps were delivered)."""
    for u, i, parts in chunks:
        for p in range(parts):
            try:
                os.unlink(directory / chunk_name(u, i, p))
            except FileNotFoundError:
                pass
