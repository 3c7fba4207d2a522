"""Where training's batches come from, and where they stand.

:class:`TrainInput` cuts the config's input into every rank's share of each global batch, from
a data position on: epoch after epoch (``num_epochs``), cycling (``num_steps``), or as files
arrive in a directory (``--follow``, :class:`FollowOptions`), remembering the files consumed so
that a row position always means the same rows. :class:`ReadAhead` reads the next batches while
the device runs a step's backward.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from dynarec.config.schema import Config
from dynarec.data.batch import Batch, BatchBuilder, DataError
from dynarec.data.batch_cache import BatchCacheLost, DiskBatchCache, MemoryBatchCache, batch_cache, check_cache_dir
from dynarec.data.reader import (
    ArrowBatchDataset,
    BatchLoader,
    DataPosition,
    check_no_side_tables,
    data_files,
    default_num_workers,
    make_loader,
    resolve_files,
    start_worker_server,
    usable_workers,
)
from dynarec.distributed.context import DistContext, StepFailedError
from dynarec.train.stop import StopSignal

__all__ = ["EVAL_PATH", "TRAIN_PATH", "FollowOptions", "Item", "ReadAhead", "TrainInput"]

# The config fields an input path comes from, as errors name them.
TRAIN_PATH = "data.train_input_path"
EVAL_PATH = "data.eval_input_path"

# A training batch (or, in a multi-process run, the DataError of this rank's share), the data
# position after it, and the global batch's rows.
Item = tuple[Union[Batch, DataError], DataPosition, int]

# What an epoch's batches are built from: the input files and their row counts.
InputKey = tuple[tuple[str, ...], tuple[int, ...]]


def _input_key(dataset: ArrowBatchDataset) -> InputKey:
    return tuple(dataset.files), tuple(dataset.row_counts())


def _file_rows(key: InputKey) -> list[tuple[str, int]]:
    """``(file name, rows)`` of each file of an input, in order (names without their directory:
    a data directory moved keeps its position's meaning)."""
    return [(Path(f).name, int(rows)) for f, rows in zip(*key)]


@dataclass(frozen=True)
class FollowOptions:
    """Streaming input (``dynarec train --follow``): ``data.train_input_path`` is a directory
    that keeps receiving files (each renamed in when complete; hidden and ``_``-prefixed names
    are ignored). Training consumes full global batches in file-name order as rows arrive, and
    stops after ``num_steps``, or once no new file came for ``idle_timeout_seconds`` (None:
    never; Ctrl-C stops it with a checkpoint)."""

    poll_seconds: float = 5.0
    idle_timeout_seconds: Optional[float] = None


def _check_followable(config: Config) -> None:
    path = config.data.train_input_path
    if not isinstance(path, str) or not Path(path).is_dir():
        raise ValueError(
            f"data.train_input_path: --follow polls one directory for new files; got {path!r}, which is not one"
        )
    if config.train.num_epochs is not None:
        raise ValueError("train.num_epochs: --follow reads a growing input; give train.num_steps, or neither")


class TrainInput:
    """The input of one training run (one rank of it, under ``ctx``): datasets of the config's
    files, DataLoader workers (``data.num_workers``, automatic by default) and page-locked
    batches for a CUDA ``device_type``."""

    def __init__(
        self,
        config: Config,
        ctx: DistContext,
        device: Union[str, torch.device],
        follow: Optional[FollowOptions] = None,
    ) -> None:
        self.config = config
        self.ctx = ctx
        self.follow = follow
        if follow is not None:
            _check_followable(config)
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"  # page-locked batches: their copy overlaps the GPU's work
        workers = config.data.num_workers
        self.num_workers, note = usable_workers(default_num_workers(self.device.type) if workers is None else workers)
        if note is not None and ctx.is_main:
            print(note, file=sys.stderr, flush=True)
        if self.pin and self.num_workers > 0:
            start_worker_server()  # its workers' imports overlap the model's set-up
        # --follow: the files consumed so far (names and row counts, in order); they must stay the
        # first files of the directory, so that a row position always means the same rows.
        self.followed_files: list[tuple[str, int]] = []
        # data.cache_batches: a whole epoch's batches, built once (and the files and row counts
        # they were built from).
        self._epoch_cache: Optional[Union[MemoryBatchCache, DiskBatchCache]] = None
        self._cache_key: Optional[InputKey] = None
        if config.data.batch_cache == "disk":
            check_cache_dir(config.data.batch_cache_dir)
        # The loader of whole epochs (from row 0), its workers kept from one epoch to the next:
        # starting a DataLoader's workers again each epoch costs seconds on a GPU host (8 workers
        # from the fork server, each importing torch). Keyed by the files and their row counts.
        self._epoch_loader: Optional[BatchLoader] = None
        self._epoch_loader_key: Optional[InputKey] = None
        # The training files (names) and their row counts a data position counts in, by epoch
        # (read-ahead may have begun the next epoch when a checkpoint records the position's);
        # not for --follow, which has followed_files.
        self._epoch_files: dict[int, list[tuple[str, int]]] = {}
        # --follow: read between polls (the trainer's SIGTERM); a stop requested ends the input
        # there (``stopped``), rather than waiting for files. The signal object, not a callback
        # into the trainer: the trainer holds this input, and a cycle would keep both (and their
        # process group's work) alive until the interpreter's exit.
        self.stop_signal = StopSignal()
        self.stopped = False

    @property
    def global_batch_size(self) -> int:
        """Rows of one training step over all ranks (``data.batch_size`` is per rank)."""
        return self.config.data.batch_size * self.ctx.world_size

    @property
    def eval_batch_size(self) -> int:
        return self.config.data.eval_batch_size or self.config.data.batch_size

    def dataset(
        self,
        paths,
        batch_size: int,
        with_labels: bool = True,
        start_row: int = 0,
        sharded: bool = True,
        training: bool = False,
        sampled: bool = True,
        what: str = "input path",
    ) -> ArrowBatchDataset:
        """This rank's share of ``paths`` (``sharded``) or all of it, every file's schema checked;
        ``training``: batches of the training data (their sampled items: ``num_sample``, else
        ``num_eval_sample``, or ``num_sample`` where that is 0); ``sampled``: False for batches
        of the data's rows alone (an export's example); ``what``: the config field or option that
        gave ``paths``, named by the error where they hold no file."""
        sampler = self.config.data.negative_sampler
        negatives = 0
        if sampler is not None and sampled:
            negatives = sampler.num_sample if training else (sampler.num_eval_sample or sampler.num_sample)
        files = resolve_files(paths, what)
        check_no_side_tables(files, self.config.data.side_tables(), what)
        ds = ArrowBatchDataset(
            files,
            BatchBuilder(self.config, with_labels, negatives, tree_samples=sampled),
            batch_size,
            self.config.data.input_type,
            start_row=start_row,
            rank=self.ctx.rank if sharded else 0,
            world_size=self.ctx.world_size if sharded else 1,
        )
        ds.check_files()
        return ds

    def loader(self, dataset: ArrowBatchDataset) -> BatchLoader:
        return make_loader(dataset, self.num_workers, self.pin)

    def example_batch(self, rows: int = 256) -> Batch:
        """The first ``rows`` rows of the eval (else train) data, without labels."""
        cfg = self.config
        paths = cfg.data.eval_input_path or cfg.data.train_input_path
        dataset = self.dataset(paths, rows, with_labels=False, sharded=False, sampled=False)
        return next(iter(make_loader(dataset, 0)))

    def batches(self, position: DataPosition) -> Iterator[Item]:
        """``(batch, the data position after it, the global batch's rows)`` from ``position``
        on, epoch after epoch (with ``num_steps``: as many epochs as it takes), or as files
        arrive (``--follow``). In a multi-process run a batch this rank cannot read is yielded as
        its DataError, so that every rank takes part in the step that fails."""
        if self.follow is not None:
            yield from self._follow(position)
            return
        cfg = self.config

        def training_rows(start_row: int) -> ArrowBatchDataset:
            return self.dataset(
                cfg.data.train_input_path, cfg.data.batch_size, start_row=start_row, training=True, what=TRAIN_PATH
            )

        while cfg.train.num_steps is not None or position.epoch < cfg.train.epochs:
            dataset = training_rows(position.row)
            if dataset.num_rows == 0:
                raise DataError(f"data.train_input_path: the input holds no rows ({', '.join(dataset.files)})")
            key = _input_key(dataset)
            self._epoch_files = {e: f for e, f in self._epoch_files.items() if e >= position.epoch - 1}
            self._epoch_files[position.epoch] = _file_rows(key)
            if self.ctx.distributed:
                self._check_same_files(position.epoch)
            cached = self._epoch_cache if position.row == 0 and self._cache_key == key else None
            kind = cfg.data.batch_cache
            built = None
            if kind is not None and position.row == 0 and cached is None:
                built = batch_cache(kind, cfg.data.batch_cache_dir, self.device)
            try:
                batches = iter(cached if cached is not None else self._epoch_batches(dataset, position, key))
                for _ in range(dataset.num_steps()):
                    rows = min(self.global_batch_size, dataset.num_rows - position.row)
                    try:
                        batch = self._next_batch(batches)
                    except BatchCacheLost as e:  # the rest of the epoch from the files again
                        warnings.warn(f"data.cache_batches: disk: {e}; the epoch goes on from the files", stacklevel=2)
                        self._drop_epoch_cache()
                        batches = iter(self.loader(training_rows(position.row)))
                        batch = self._next_batch(batches)
                    if built is not None and isinstance(batch, Batch):
                        batch = built.add(batch)  # (a GPU's memory cache: its copy on the device)
                    end = position.row + rows
                    position = (
                        DataPosition(position.epoch, end)
                        if end < dataset.num_rows
                        else DataPosition(position.epoch + 1, 0)
                    )
                    yield batch, position, rows
                    if isinstance(batch, DataError):
                        return  # the step failed on every rank
                if built is not None and not built.failed and len(built) == dataset.num_steps():  # a whole epoch
                    self._drop_epoch_cache()
                    self._epoch_cache, self._cache_key, built = built, key, None
            finally:
                if built is not None:  # not a whole epoch: nothing kept
                    built.close()
            if position.row:  # the input ended early (files changed since the position was saved)
                position = DataPosition(position.epoch + 1, 0)

    def _check_same_files(self, epoch: int) -> None:
        """StepFailedError on every rank where the ranks do not see the same training files for
        ``epoch`` (names and row counts, in order: each rank reads its share of every global
        batch from them, so node-local copies that differ would train on inconsistent batches,
        or leave a rank waiting in a collective); names the first file that differs. One
        collective an epoch."""
        files = self._epoch_files[epoch]
        seen = self.ctx.all_gather_objects(files, f"the training files of epoch {epoch + 1}")
        for rank, theirs in enumerate(seen):
            if theirs == seen[0]:
                continue
            i = next((i for i, (a, b) in enumerate(zip(seen[0], theirs)) if a != b), min(len(seen[0]), len(theirs)))
            first, other = (
                f"'{f[i][0]}' with {f[i][1]:,} rows" if i < len(f) else "no file" for f in (seen[0], theirs)
            )
            raise StepFailedError(
                f"{TRAIN_PATH}: the ranks do not read the same training files: file {i + 1} of epoch {epoch + 1} is "
                f"{first} on rank 0 and {other} on rank {rank} ({len(seen[0])} and {len(theirs)} files); give every "
                "rank the same files (node-local copies must match)"
            )

    def files_of(self, epoch: int) -> list[tuple[str, int]]:
        """``(file name, rows)`` of the training files of ``epoch`` (empty: not read yet)."""
        return list(self._epoch_files.get(epoch, []))

    def check_position(self, position: DataPosition, recorded: list[tuple[str, int]], where: str) -> None:
        """Warns when a mid-epoch ``position`` (``where``'s, counted in the files ``recorded``)
        no longer means the same rows: a training file it counts through (one starting before
        its row) was renamed, removed, reordered or changed its row count (files after it change
        nothing). Training goes on from that row of the files as they are; the warning says what
        changed. The recorded files stay the position's, for the next checkpoint."""
        if self.follow is not None or position.row == 0 or not recorded:
            return
        self._epoch_files[position.epoch] = list(recorded)
        cfg = self.config
        dataset = self.dataset(cfg.data.train_input_path, cfg.data.batch_size, start_row=0, training=True)
        now = _file_rows(_input_key(dataset))
        start = 0
        for i, (name, rows) in enumerate(recorded):
            if start >= position.row:
                return
            start += rows
            current = now[i] if i < len(now) else None
            if current != (name, rows) and self.ctx.is_main:
                found = f"'{current[0]}' with {current[1]} rows" if current else "no file"
                warnings.warn(
                    f"{where}: its data position (epoch {position.epoch}, row {position.row}) counts through the "
                    f"training files as they were; file {i + 1} was '{name}' with {rows} rows, and is {found} now: "
                    f"training goes on from row {position.row} of the files as they are (rows may be skipped or "
                    "read twice in this epoch)",
                    stacklevel=2,
                )
                return

    def close(self) -> None:
        """Lets the workers kept for whole epochs go and drops the cached epoch (the run is
        over)."""
        self._epoch_loader = self._epoch_loader_key = None
        self._drop_epoch_cache()

    def _drop_epoch_cache(self) -> None:
        if self._epoch_cache is not None:
            self._epoch_cache.close()
        self._epoch_cache, self._cache_key = None, None

    def _epoch_batches(self, dataset: ArrowBatchDataset, position: DataPosition, key: InputKey) -> BatchLoader:
        """The loader of an epoch's batches (``key``: its input's): from row 0 with workers, the one
        whose workers outlive the epoch (the same files, the same rows); else a loader of its own."""
        if position.row != 0 or self.num_workers == 0:
            return self.loader(dataset)
        if self._epoch_loader is None or self._epoch_loader_key != key:
            self._epoch_loader = make_loader(dataset, self.num_workers, self.pin, persistent=True)
            self._epoch_loader_key = key
        return self._epoch_loader

    def _follow(self, position: DataPosition) -> Iterator[Item]:
        """``--follow``: full global batches of the directory's rows as files arrive."""
        assert self.follow is not None
        directory = Path(str(self.config.data.train_input_path))
        idle_since = time.monotonic()
        seen: list[tuple[str, int]] = []  # the listing last read, with file sizes
        listed_rows = 0  # the rows of its files
        while True:
            listing, timed_out, stop = self._poll(directory, idle_since)
            if stop:
                self.stopped = True
                return
            names = [n for n, _ in listing]
            dataset, steps = None, 0
            if listing and listing != seen:  # schemas and row counts are read only when files change
                # A file arrived: the idle time counts from here, whether or not it completes a batch
                # (every rank sees rank 0's listing, so every rank decides alike).
                idle_since, timed_out = time.monotonic(), False
                dataset = self.dataset(
                    [str(directory / n) for n in names],
                    self.config.data.batch_size,
                    start_row=position.row,
                    training=True,
                )
                self._check_prefix(directory, names, dataset.row_counts())
                steps = (dataset.num_rows - position.row) // self.global_batch_size
                seen, listed_rows = listing, dataset.num_rows
            if steps == 0:
                if timed_out and position.row == 0:  # nothing arrived: no model to write
                    raise DataError(_nothing_followed(directory, self.follow.idle_timeout_seconds, listing))
                if timed_out:
                    if self.ctx.is_main:
                        left = listed_rows - position.row
                        waiting = (
                            f"; {left} rows after them wait for a full global batch of {self.global_batch_size}: "
                            "--follow --resume trains them once more rows arrive"
                            if left > 0
                            else ""
                        )
                        print(
                            f"follow: no new file in {self.follow.idle_timeout_seconds}s; stopping "
                            f"({position.row} rows of {len(self.followed_files)} file(s) consumed{waiting})",
                            file=sys.stderr,
                            flush=True,
                        )
                    return
                time.sleep(self.follow.poll_seconds)
                continue
            assert dataset is not None
            idle_since = time.monotonic()
            end_row = position.row + steps * self.global_batch_size
            consumed, total = [], 0
            for n, c in zip(names, dataset.row_counts()):  # the files the rows up to end_row come from
                if total >= end_row:
                    break
                consumed.append((n, c))
                total += c
            batches = iter(self.loader(dataset))
            for _ in range(steps):
                batch = self._next_batch(batches)
                position = DataPosition(0, position.row + self.global_batch_size)
                self.followed_files = consumed
                yield batch, position, self.global_batch_size
                if isinstance(batch, DataError):
                    return

    def _next_batch(self, batches: Iterator[Batch]) -> Union[Batch, DataError]:
        """The next batch; in a multi-process run a batch this rank cannot read comes back as its
        DataError, so that every rank takes part in the step that fails."""
        try:
            return next(batches)
        except DataError as e:
            if not self.ctx.distributed:
                raise
            return e

    def _poll(self, directory: Path, idle_since: float) -> tuple[list[tuple[str, int]], bool, bool]:
        """The directory's data files (name and size in bytes), whether no new file came for the
        idle timeout (rank 0's view of both), and whether the run is to stop (asked of any rank):
        the same on every rank, so that all ranks stop at the same poll."""
        assert self.follow is not None
        timeout = self.follow.idle_timeout_seconds
        files = [(Path(f).name, Path(f).stat().st_size) for f in data_files(directory)]
        view = (
            files,
            timeout is not None and time.monotonic() - idle_since >= timeout,
            self.stop_signal.requested is not None,
        )
        if self.ctx.distributed:  # rank 0's listing; a stop asked of any rank
            views = self.ctx.all_gather_objects(view, "polling the followed directory")
            view = (views[0][0], views[0][1], any(v[2] for v in views))
        return view

    def _check_prefix(self, directory: Path, names: list[str], counts: list[int]) -> None:
        """The files consumed so far must still be the first files, unchanged: a row position
        is an offset into the files in name order."""
        for i, (name, rows) in enumerate(self.followed_files):
            if i >= len(names) or names[i] != name:
                now = names[i] if i < len(names) else "nothing"
                raise DataError(
                    f"{directory}: '{now}' sorts where the consumed file '{name}' was: files must arrive in "
                    "name order (timestamped names) and consumed files stay in place"
                )
            if counts[i] != rows:
                raise DataError(f"{directory / name}: held {rows} rows when it was consumed, {counts[i]} now")


def _nothing_followed(directory: Path, timeout: Optional[float], listing: list[tuple[str, int]]) -> str:
    """The error of a followed directory that gave no full batch before the idle timeout."""
    held = f"its {len(listing)} file(s) hold less than one batch" if listing else "no data file arrived"
    nested = sum(1 for p in directory.rglob("*") if p.suffix in (".parquet", ".csv") and p.parent != directory)
    note = f"; {nested} data file(s) lie in its subdirectories, which --follow does not read" if nested else ""
    return f"follow: {directory}: {held} in {timeout}s (--idle-timeout); nothing trained, nothing written{note}"


class ReadAhead:
    """The training loop's next batches, read once a step's backward is queued, while the device
    runs it: the host's work on them (reading, checks, packing) and the embeddings' input stage
    (their copy to the GPU and their hash finds: ``prefetch``) overlap that backward. Up to the
    embeddings' ``prefetch_depth`` batches are held. An error reading one is raised where the
    loop asks for that batch, after the steps before it: the step it interrupts is not the one
    it belongs to."""

    def __init__(
        self,
        batches: Iterator[Item],
        embeddings,
        ahead_units: Optional[Callable[[Batch, Optional[int]], Optional[Sequence[str]]]] = None,
    ):
        """``ahead_units(batch, global rows)``: the units (by name) whose input stage is run
        ahead for the step of a batch, None for all (``StepGraphs.ahead_units``: a step replayed
        from CUDA graphs, which copy and split the batch themselves, needs it for the units
        looked up around them alone)."""
        self._batches = batches
        self._embeddings = embeddings
        self._ahead_units = ahead_units
        self._read: deque[tuple[str, Any]] = deque()

    def read(self, steps_left: Optional[int] = None) -> None:
        """Reads (and prefetches) batches until ``prefetch_depth`` are held, or as many as the
        ``steps_left`` (None: no limit) need, or the data ends or fails."""
        want = (
            self._embeddings.prefetch_depth if steps_left is None else min(self._embeddings.prefetch_depth, steps_left)
        )
        while len(self._read) < want:
            if self._read and (self._read[-1][0] == "error" or self._read[-1][1] is None):
                return  # the data ended or failed: nothing more to read
            try:
                item = next(self._batches, None)
            except Exception as e:  # raised by next(), after the steps before it
                self._read.append(("error", e))
                return
            self._read.append(("item", item))
            if item is not None and isinstance(item[0], Batch):
                units = None if self._ahead_units is None else self._ahead_units(item[0], item[2])
                if units is None or units:  # (None: every unit's)
                    self._embeddings.prefetch(item[0].sparse, item[0].ready, units=units)

    def next(self) -> Optional[Item]:
        """The oldest batch read ahead, else the next one."""
        if not self._read:
            return next(self._batches, None)
        kind, value = self._read.popleft()
        if kind == "error":
            raise value
        return value
