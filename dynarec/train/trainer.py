"""The trainer: the step loop, with periodic eval and checkpoints, and exact resume.

Three parts, each with one job: this step loop (data position, learning rates, the step, eval),
:class:`~dynarec.train.checkpoint.CheckpointManager` (atomic checkpoints) and
:class:`~dynarec.train.sink.TrainingLog` (progress, TensorBoard, history, metrics.json, curves).

Model directory layout::

    config.yaml            the config this directory was trained with
    checkpoints/ckpt-N/    atomic checkpoints (see dynarec.train.checkpoint); checkpoints/latest
    tb/                    TensorBoard logs
    curves.png             training loss and eval metrics
    metrics.json           loss and eval history, final eval metrics

Nothing is written until the config and the input files have been checked and the first batch
has been read, so bad input leaves an empty (or untouched) model directory. A checkpoint holds
the data position (epoch, rows consumed): a resume seeks straight to it, reading no earlier row.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import nn

from dynarec.config.load import ConfigError, config_fingerprint
from dynarec.config.schema import Config
from dynarec.data.batch import Batch, BatchBuilder, DataError
from dynarec.data.reader import (
    ArrowBatchDataset,
    DataPosition,
    data_files,
    default_num_workers,
    make_loader,
    resolve_files,
)
from dynarec.distributed.context import DistContext, single_process
from dynarec.distributed.reshard import plan_state, single_process_plan_state, tables_for_rank
from dynarec.files import DirectoryBusyError, DirectoryLock
from dynarec.metrics import auc, grouped_auc, log_loss
from dynarec.train.checkpoint import CheckpointError, CheckpointManager
from dynarec.train.model_dir import config_record, write_config_record
from dynarec.train.sink import TrainingLog
from dynarec.train.task import RankingTask

__all__ = ["FollowOptions", "Trainer", "TrainingError"]


class TrainingError(RuntimeError):
    """Training cannot go on (a NaN loss under nan_policy 'error'); the message names the step."""


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


class Trainer:
    """Trains one model directory, in one process or as one rank of a multi-process run
    (``ctx``): the same code, each rank taking its share of every global batch."""

    def __init__(
        self,
        config: Config,
        model_dir: str | Path,
        device: str = "cpu",
        progress: bool = True,
        ctx: Optional[DistContext] = None,
        follow: Optional[FollowOptions] = None,
    ):
        self.config = config
        # Once: a checkpoint written every few steps serializes nothing (a Ctrl-C inside pydantic's
        # serializer would come out as a serialization error, not as KeyboardInterrupt).
        self.fingerprint = config_fingerprint(config)
        self.follow = follow
        if follow is not None:
            _check_followable(config)
        self.model_dir = Path(model_dir)
        self.ctx = ctx or single_process(device)
        self.device = self.ctx.device if self.ctx.distributed else torch.device(device)
        self._pin = self.device.type == "cuda"  # page-locked batches: their copy overlaps the GPU's work
        workers = config.data.num_workers
        self.num_workers = default_num_workers(self.device.type) if workers is None else workers
        # The dense model's initial weights come from the config's seed, without touching the
        # process's global RNG (nothing else in a training step draws random numbers).
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(config.train.seed)
            self.task = RankingTask(config, self.device, self.ctx)
        self.dense_optimizer = config.train.dense_optimizer.build(self.task.dense.parameters())
        self._dense_base_lr = [g["lr"] for g in self.dense_optimizer.param_groups]
        self.checkpoints = CheckpointManager(self.model_dir, keep=config.train.keep_checkpoints)
        self.log = TrainingLog(self.model_dir, progress=progress, enabled=self.ctx.is_main)
        self.step = 0
        self.skipped_batches = 0  # batches with a non-finite loss, under nan_policy 'skip_batch'
        self.position = DataPosition()
        # --follow: the files consumed so far (names and row counts, in order); they must stay the
        # first files of the directory, so that a row position always means the same rows.
        self.followed_files: list[tuple[str, int]] = []

    @property
    def global_batch_size(self) -> int:
        """Rows of one training step over all ranks (``data.batch_size`` is per rank)."""
        return self.config.data.batch_size * self.ctx.world_size

    # -- data ------------------------------------------------------------------------------

    def _dataset(
        self, paths, batch_size: int, with_labels: bool = True, start_row: int = 0, sharded: bool = True
    ) -> ArrowBatchDataset:
        """This rank's share of ``paths`` (``sharded``) or all of it."""
        ds = ArrowBatchDataset(
            resolve_files(paths),
            BatchBuilder(self.config, with_labels),
            batch_size,
            self.config.data.input_type,
            start_row=start_row,
            rank=self.ctx.rank if sharded else 0,
            world_size=self.ctx.world_size if sharded else 1,
        )
        ds.check_files()
        return ds

    def example_batch(self, rows: int = 256) -> Batch:
        """The first ``rows`` rows of the eval (else train) data, without labels."""
        cfg = self.config
        paths = cfg.data.eval_input_path or cfg.data.train_input_path
        dataset = self._dataset(paths, rows, with_labels=False, sharded=False)
        return next(iter(make_loader(dataset, 0)))

    def _eval_batch_size(self) -> int:
        return self.config.data.eval_batch_size or self.config.data.batch_size

    def _follow_batches(self) -> Iterator[tuple[Union[Batch, DataError], DataPosition, int]]:
        """``--follow``: full global batches of the directory's rows as files arrive."""
        assert self.follow is not None
        directory = Path(str(self.config.data.train_input_path))
        position, idle_since = self.position, time.monotonic()
        seen: list[tuple[str, int]] = []  # the listing last read, with file sizes
        while True:
            listing, timed_out = self._poll(directory, idle_since)
            names = [n for n, _ in listing]
            dataset, steps = None, 0
            if listing and listing != seen:  # schemas and row counts are read only when files change
                dataset = self._dataset(
                    [str(directory / n) for n in names], self.config.data.batch_size, start_row=position.row
                )
                self._check_prefix(directory, names, dataset.row_counts())
                steps = (dataset.num_rows - position.row) // self.global_batch_size
                seen = listing
            if steps == 0:
                if timed_out:
                    if self.ctx.is_main:
                        print(
                            f"follow: no new file in {self.follow.idle_timeout_seconds}s; stopping at step {self.step} "
                            f"({position.row} rows of {len(self.followed_files)} file(s) consumed)",
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
            batches = iter(make_loader(dataset, self.num_workers, self._pin))
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

    def _poll(self, directory: Path, idle_since: float) -> tuple[list[tuple[str, int]], bool]:
        """The directory's data files (name and size in bytes), and whether no new file came for
        the idle timeout — rank 0's view, on every rank, so that all ranks stop at the same poll."""
        assert self.follow is not None
        timeout = self.follow.idle_timeout_seconds
        files = [(Path(f).name, Path(f).stat().st_size) for f in data_files(directory)]
        view = (files, timeout is not None and time.monotonic() - idle_since >= timeout)
        if self.ctx.distributed:
            view = self.ctx.all_gather_objects(view, "polling the followed directory")[0]
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

    def _train_batches(self) -> Iterator[tuple[Union[Batch, DataError], DataPosition, int]]:
        """``(batch, the data position after it, the global batch's rows)`` from the current
        position on, epoch after epoch (with ``num_steps``: as many epochs as it takes). In a
        multi-process run a batch this rank cannot read is yielded as its DataError, so that
        every rank takes part in the step that fails."""
        if self.follow is not None:
            yield from self._follow_batches()
            return
        cfg = self.config
        position = self.position
        while cfg.train.num_steps is not None or position.epoch < cfg.train.epochs:
            dataset = self._dataset(cfg.data.train_input_path, cfg.data.batch_size, start_row=position.row)
            if dataset.num_rows == 0:
                raise DataError(f"data.train_input_path: the input holds no rows ({', '.join(dataset.files)})")
            batches = iter(make_loader(dataset, self.num_workers, self._pin))
            for _ in range(dataset.num_steps()):
                rows = min(self.global_batch_size, dataset.num_rows - position.row)
                batch = self._next_batch(batches)
                end = position.row + rows
                position = (
                    DataPosition(position.epoch, end) if end < dataset.num_rows else DataPosition(position.epoch + 1, 0)
                )
                yield batch, position, rows
                if isinstance(batch, DataError):
                    return  # the step failed on every rank
            if position.row:  # the input ended early (files changed since the position was saved)
                position = DataPosition(position.epoch + 1, 0)

    # -- checkpoints -----------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.position.epoch,
            "row": self.position.row,
            "global_batch_size": self.global_batch_size,
            "dense": self.task.dense.state_dict(),
            "dense_optimizer": self.dense_optimizer.state_dict(),
            "dense_optimizer_class": type(self.dense_optimizer).__name__,
            "fingerprint": self.fingerprint,
            "history": self.log.state(),
            "plan": plan_state(self.task.plan),
            "followed_files": [list(f) for f in self.followed_files],
        }

    def save(self) -> Path:
        """A checkpoint of this step (every rank calls it: each writes the tables it holds, a
        data-parallel table only once)."""
        tables = {
            name: t.dump()
            for name, t in self.task.embeddings.tables.items()
            if self.ctx.is_main or self.task.plan.table(name).sharding.kind != "data_parallel"
        }
        return self.checkpoints.save(self.step, self._state() if self.ctx.is_main else {}, tables, ctx=self.ctx)

    def _check_compatible(self, state: dict, where: Path, training: bool) -> None:
        mine = self.fingerprint
        theirs = state.get("fingerprint", {})
        differ = [k for k in mine if theirs.get(k) != mine[k]]
        if differ:
            raise CheckpointError(
                f"{where} was written with a different config: its {' and '.join(differ)} differ from this "
                f"config's; use the config it was trained with, or another model_dir"
            )
        if training and state.get("global_batch_size", self.global_batch_size) != self.global_batch_size:
            raise CheckpointError(
                f"{where} was trained with a global batch of {state['global_batch_size']} rows, this run's is "
                f"{self.global_batch_size} (data.batch_size); resume with the same batch size"
            )

    def _check_dense_optimizer(self, state: dict, where: Path) -> None:
        """CheckpointError when the checkpoint's dense optimizer state is not this config's
        optimizer's (another kind: its state cannot carry over, and would fail at the first step)."""
        saved = state.get("dense_optimizer", {}).get("param_groups") or [{}]
        mine = self.dense_optimizer.param_groups[0]
        theirs_class = state.get("dense_optimizer_class")
        my_class = type(self.dense_optimizer).__name__
        if (theirs_class is not None and theirs_class != my_class) or set(saved[0]) - {"params"} != set(mine) - {
            "params"
        }:
            raise CheckpointError(
                f"{where} was trained with another dense optimizer ({theirs_class or 'its settings differ'}) than "
                f"this config's train.dense_optimizer ({my_class}); its state cannot carry over: resume with the "
                "dense optimizer it was trained with, or train into another model_dir"
            )

    def restore(self, path: Optional[Path] = None, training: bool = True) -> Path:
        """Loads ``path`` (default: the latest checkpoint of the model directory), written by any
        number of ranks: every rank takes its own part of every table (see distributed.reshard).
        ``training``: to continue training (the global batch must match the checkpoint's)."""
        path, state, shards = self.checkpoints.load(path)
        self._check_compatible(state, path, training)
        saved_plan = state.get("plan") or single_process_plan_state(shards[0])
        theirs, mine = set(saved_plan["tables"]), {t.table.name for t in self.task.plan.tables}
        if theirs != mine:
            raise CheckpointError(f"{path}: holds tables {sorted(theirs)}, the config has {sorted(mine)}")
        self._check_dense_optimizer(state, path)
        self.task.dense.load_state_dict(state["dense"])
        self.dense_optimizer.load_state_dict(state["dense_optimizer"])
        try:
            dumps = tables_for_rank(self.task.plan, self.ctx.rank, saved_plan, shards)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
        for name, dump in dumps.items():
            report = self.task.embeddings.tables[name].load(dump)
            if report["dropped"]:
                raise CheckpointError(
                    f"{path}: table '{name}' on rank {self.ctx.rank}: {report['dropped']} of "
                    f"{report['loaded'] + report['dropped']} keys find no row in this run's shard (its "
                    "max_capacity share); raise dynamicemb.max_capacity, or resume with the world size it was "
                    "written at"
                )
        self.step = state["step"]
        self.position = DataPosition(state["epoch"], state["row"])
        self.followed_files = [(str(n), int(r)) for n, r in state.get("followed_files", [])]
        self.log.load_state(state["history"])
        return path

    # -- training --------------------------------------------------------------------------

    def _set_learning_rates(self) -> None:
        train = self.config.train
        for table in self.task.embeddings.tables.values():
            table.set_learning_rate(train.sparse_lr_schedule.learning_rate(self.step, table.spec.lr))
        for g, base in zip(self.dense_optimizer.param_groups, self._dense_base_lr):
            g["lr"] = train.dense_lr_schedule.learning_rate(self.step, base)

    def train_step(
        self,
        batch: Union[Batch, DataError],
        global_rows: Optional[int] = None,
    ) -> Optional[torch.Tensor]:
        """One step; returns the loss (on the device: reading it is the caller's choice), or None
        when the batch was skipped (its loss was not finite, under nan_policy 'skip_batch').

        The loss is this rank's share of the global batch's mean (``global_rows`` rows over all
        ranks), so summing every rank's gradients gives the gradient of the global mean. A loss
        that is NaN or infinite (on any rank) writes nothing: the forward is undone on every
        table (rows it created, evictions, admission counts) before any update. This check is the
        step's one host sync by design: every rank must agree on a step's outcome before it
        commits.

        Nothing else waits for the device: when it returns, the backward and the optimizer steps
        are queued, and the caller may read the next batch and start its input stage
        (``EmbeddingCollection.prefetch``) while they run, as :meth:`fit` does."""
        if not self.task.training:  # (train() walks every module: a cost per step when repeated)
            self.task.train()
        self._set_learning_rates()
        if isinstance(batch, DataError):  # this rank could not read its share: the step fails everywhere
            self.task.embeddings(None, error=batch)
            raise AssertionError("unreachable: the failed step raises on every rank")
        try:
            return self._step(batch, global_rows)
        except torch.OutOfMemoryError as e:
            latest = self.checkpoints.latest()
            kept = f"the latest checkpoint is {latest}" if latest else "no checkpoint was written"
            raise TrainingError(
                f"step {self.step + 1}: out of memory on {self.device} ({str(e).splitlines()[0][:160]}); the model in "
                f"memory is not saved ({kept}); lower data.batch_size (now {self.config.data.batch_size} per rank) "
                "or the model's sizes"
            ) from None

    def _step(self, batch: Batch, global_rows: Optional[int]) -> Optional[torch.Tensor]:
        logits = self.task(batch)
        labels = batch.labels.to(self.device, non_blocking=True)
        global_rows = global_rows or batch.num_rows
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum") / global_rows
        bad = not bool(torch.isfinite(loss))
        if self.ctx.distributed:
            bad = self.ctx.any(bad, f"the loss of step {self.step + 1}")
        if bad:
            self.task.embeddings.abort_step()
            if self.config.train.nan_policy == "skip_batch":
                self.skipped_batches += 1
                return None
            latest = self.checkpoints.latest()
            raise TrainingError(
                f"step {self.step + 1}: the loss is {float(loss.detach())}"
                f"{' on some rank' if self.ctx.distributed else ''}; "
                "nothing of this step "
                "was written "
                f"({f'the latest checkpoint is {latest}' if latest else 'no checkpoint was written'}); "
                "check the input around this step, lower the learning rates, or set train.nan_policy: skip_batch"
            )
        self.dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the fused sparse optimizer updates the touched rows here
        self.dense_optimizer.step()
        self.step += 1
        return loss.detach()

    def fit(self, resume: bool = False) -> dict[str, Any]:
        """Trains to ``num_steps`` (or ``num_epochs``), evaluating and checkpointing on the way;
        returns the final report (eval metrics empty without eval data)."""
        cfg = self.config
        if self.follow is None or data_files(str(cfg.data.train_input_path)):
            self._dataset(cfg.data.train_input_path, cfg.data.batch_size)  # check every file before writing
        if cfg.data.eval_input_path:
            self._dataset(cfg.data.eval_input_path, self._eval_batch_size())
        with contextlib.ExitStack() as stack:  # one writer per model directory: rank 0 holds the lock
            error = None
            if self.ctx.is_main:
                try:
                    stack.enter_context(DirectoryLock(self.model_dir))
                except DirectoryBusyError as e:
                    error = e
            self.ctx.agree(error, f"locking {self.model_dir}")
            # However the run ends (done, a Ctrl-C, an error), its TensorBoard writer is closed:
            # its thread stopped, its event file flushed and closed. A process that trains again
            # and again kept one of each per run.
            stack.callback(self.log.close)
            return self._fit_locked(resume)

    def _fit_locked(self, resume: bool) -> dict[str, Any]:
        cfg = self.config
        existing = self.checkpoints.list()
        if resume:
            if existing:
                self.restore()
        elif existing:
            raise CheckpointError(
                f"{self.model_dir} already holds checkpoints ({existing[-1].name}); "
                "pass --resume to continue, or choose another model_dir"
            )
        # The config record and the first batch are checked (on every rank) before anything is written.
        config_text: Optional[str] = None
        refused: Optional[ConfigError] = None
        if self.ctx.is_main:
            try:
                config_text = config_record(self.model_dir, cfg)
            except ConfigError as e:
                refused = e
        self.ctx.agree(refused, f"checking {self.model_dir / 'config.yaml'}")
        batches = self._train_batches()
        first = next(batches, None) if self._more_steps() else None
        if first is not None and self.ctx.distributed:
            self.ctx.agree(first[0] if isinstance(first[0], DataError) else None, "reading the first batch")
        if self.ctx.is_main:
            self.model_dir.mkdir(parents=True, exist_ok=True)
            if config_text is not None:
                write_config_record(self.model_dir, config_text)
        self.log.start(self.step, cfg.train.num_steps)
        start_step = self.step
        evaluated_at = saved_at = None
        item = first
        ahead = ReadAhead(batches, self.task.embeddings)
        # Not in a multi-process run (its input stage is collective), nor when following a
        # directory (reading ahead would hold a step's backward until the next file arrives).
        read_ahead = not self.ctx.distributed and self.follow is None
        while item is not None:
            batch, self.position, rows = item
            loss = self.train_step(batch, rows)
            if loss is None:  # skipped (nan_policy 'skip_batch')
                item = ahead.next() if self._more_steps() else None
                continue
            if read_ahead and self._more_steps():  # while the step's backward runs on the device
                ahead.read(self._steps_left())
            record = self.step % cfg.train.log_step_count_steps == 0 or self.step == 1
            self.log.train_step(self.step, float(loss) if record else None, self.position.epoch, record)
            if cfg.train.eval_every_steps and self.step % cfg.train.eval_every_steps == 0 and cfg.data.eval_input_path:
                self.log.eval(self.step, self.evaluate())
                evaluated_at = self.step
            if cfg.train.save_checkpoints_steps and self.step % cfg.train.save_checkpoints_steps == 0:
                self.save()
                saved_at = self.step
                self.log.line(self.step, "checkpoint saved")
            item = ahead.next() if self._more_steps() else None
        seconds = self.log.seconds
        if saved_at != self.step:
            self.save()
        final: dict[str, Any] = {}
        if cfg.data.eval_input_path:
            if evaluated_at == self.step:
                final = self.log.history["eval"][-1][1]
            else:
                final = self.evaluate()
                self.log.eval(self.step, final)
        report = {
            "step": self.step,
            "train_seconds": seconds,
            "skipped_batches": self.skipped_batches,
            "steps_per_second": (self.step - start_step) / seconds if seconds > 0 else math.nan,
            "eval": final,
        }
        self.log.finish(report)
        return report

    def _more_steps(self) -> bool:
        """Whether another step is to run (``num_steps`` permitting)."""
        return self.config.train.num_steps is None or self.step < self.config.train.num_steps

    def _steps_left(self) -> Optional[int]:
        """Steps still to run (None: until the data ends)."""
        n = self.config.train.num_steps
        return None if n is None else max(n - self.step, 0)

    # -- evaluation ------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, paths, with_labels: bool = True, max_steps: Optional[int] = None):
        """Eval-mode predictions over ``paths``, in row order: ``(probabilities, labels,
        groups)`` numpy arrays (labels/groups None without labels). In a multi-process run every
        rank scores its share of each global batch and every rank gets all predictions."""
        self.task.eval()
        dataset = self._dataset(paths, self._eval_batch_size(), with_labels)
        probs, labels, groups = [], [], []
        steps = dataset.num_steps() if max_steps is None else min(max_steps, dataset.num_steps())
        batches = iter(make_loader(dataset, self.num_workers, self._pin))
        for _ in range(steps):
            batch = next(batches)
            probs.append(torch.sigmoid(self.task(batch)).cpu().numpy())
            labels.append(batch.labels.numpy())
            if batch.groups is not None:
                groups.append(batch.groups.numpy())
        self.task.train()
        if self.ctx.distributed:  # global batch s is rank 0's share, then rank 1's, ...
            parts = self.ctx.all_gather_objects((probs, labels, groups), "the eval predictions")
            probs = [p for s in range(steps) for part in parts for p in part[0][s : s + 1]]
            labels = [x for s in range(steps) for part in parts for x in part[1][s : s + 1]]
            groups = [x for s in range(steps) for part in parts for x in part[2][s : s + 1]]
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0)
        scores = cat(probs)
        dataset.check_scores(scores, "click probability")
        return scores, (cat(labels) if with_labels else None), (cat(groups) if groups else None)

    def evaluate(self, paths=None) -> dict[str, float]:
        paths = paths or self.config.data.eval_input_path
        if not paths:
            raise ValueError("no eval data: set data.eval_input_path")
        probs, labels, groups = self.predict(paths, max_steps=self.config.eval.max_steps)
        if probs.size == 0:
            raise DataError(f"nothing to evaluate: {paths} holds no rows")
        metrics: dict[str, float] = {"num_examples": float(probs.size)}
        for m in self.config.eval.metrics:
            if m == "auc":
                metrics["auc"] = auc(probs, labels)
            elif m == "log_loss":
                metrics["log_loss"] = log_loss(probs, labels)
            elif m == "grouped_auc" and groups is not None:
                metrics["grouped_auc"] = grouped_auc(probs, labels, groups)
        return metrics


class ReadAhead:
    """The training loop's next batches, read once a step's backward is queued, while the device
    runs it: the host's work on them (reading, checks, packing) and the embeddings' input stage
    (their copy to the GPU and their hash finds: ``prefetch``) overlap that backward. Up to the
    embeddings' ``prefetch_depth`` batches are held. An error reading one is raised where the
    loop asks for that batch, after the steps before it: the step it interrupts is not the one
    it belongs to."""

    def __init__(self, batches: Iterator[tuple[Union[Batch, DataError], DataPosition, int]], embeddings):
        self._batches = batches
        self._embeddings = embeddings
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
                self._embeddings.prefetch(item[0].sparse)

    def next(self) -> Optional[tuple[Union[Batch, DataError], DataPosition, int]]:
        """The oldest batch read ahead, else the next one."""
        if not self._read:
            return next(self._batches, None)
        kind, value = self._read.popleft()
        if kind == "error":
            raise value
        return value
