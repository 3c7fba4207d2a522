"""The trainer: the step loop, with periodic eval and checkpoints, and exact resume.

A :class:`Trainer` composes parts with one job each: :class:`~dynarec.train.input.TrainInput`
(batches from a data position, epochs, ``--follow``), the step loop here (learning rates, the
step, when to evaluate and save), :class:`~dynarec.train.evaluate.Evaluator` (predictions and
metrics), :class:`~dynarec.train.checkpoint.CheckpointManager` (atomic checkpoints) with
:mod:`~dynarec.train.state` (what may resume from them), and
:class:`~dynarec.train.sink.TrainingLog` (progress, TensorBoard, history, metrics.json, curves).

Model directory layout::

    config.yaml            the config this directory was trained with (dynarec.train.model_dir)
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
import gc
import math
import signal
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from dynarec.config.load import ConfigError, config_fingerprint, config_sections, sections_as_today
from dynarec.config.schema import Config
from dynarec.data.batch import Batch, DataError
from dynarec.data.reader import DataPosition, data_files
from dynarec.data.tdm_sampler import tree_digest, tree_files
from dynarec.devices import check_device, start_device
from dynarec.distributed.context import DistContext, StepFailedError, single_process
from dynarec.distributed.reshard import plan_state, tables_for_rank
from dynarec.embedding.cached_store import CacheFullError
from dynarec.embedding.collection import EmbeddingCollection
from dynarec.embedding.dynamic import TableFullError
from dynarec.embedding.streams import current_stream
from dynarec.files import DirectoryBusyError, DirectoryLock
from dynarec.models.variational_dropout import VariationalDropout, penalties
from dynarec.train.checkpoint import CheckpointError, CheckpointManager
from dynarec.train.evaluate import Evaluator
from dynarec.train.input import EVAL_PATH, TRAIN_PATH, FollowOptions, Item, ReadAhead, TrainInput
from dynarec.train.loss_scaling import LossScaler
from dynarec.train.model_dir import check_not_another_kind, config_record, write_config_record
from dynarec.train.optimizer_graph import OptimizerStepGraph, captures_step
from dynarec.train.sink import TrainingLog
from dynarec.train.state import StepRng, check_resumable
from dynarec.train.step_graph import StepGraphs, step_graph_refusal
from dynarec.train.stop import EvaluationStopped, TrainingStopped
from dynarec.train.task import RankingTask

__all__ = ["FollowOptions", "ReadAhead", "Trainer", "TrainingError"]


def _call_if_alive(method: Callable[[], Optional[Callable[..., None]]], reason: str, **kwargs: Any) -> None:
    """Calls the method a ``weakref.WeakMethod`` refers to, if its object still lives."""
    bound = method()
    if bound is not None:
        bound(reason, **kwargs)


def _alive(trainer: weakref.ref) -> Trainer:
    """The trainer a weak reference refers to (its step graphs call back into it while it lives)."""
    alive = trainer()
    assert alive is not None, "the trainer is gone"
    return alive


class TrainingError(RuntimeError):
    """Training cannot go on (a NaN loss under nan_policy 'error'); the message names the step."""


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
        self.config_sections = config_sections(config)  # (kept in checkpoints: what differs is named)
        tdm = config.data.tdm_sampler  # a TDM model's node ids are its tree's: checkpoints pin the tree
        self.tree = None if tdm is None else {**tree_files(tdm), "sha256": tree_digest(tdm)}
        self.model_dir = Path(model_dir)
        if ctx is None or not ctx.distributed:  # a named error where there is no such device, not torch's assertion
            check_device(str(device), f"Trainer(device='{device}')")
        self.ctx = ctx or single_process(device)
        self.device = self.ctx.device if self.ctx.distributed else torch.device(device)
        start_device(self.device)  # its kernels load beside the set-up
        self.input = TrainInput(config, self.ctx, self.device, follow)
        # The dense model's initial weights come from the config's seed, and a step's random
        # draws (dropout) from a stream of their own: neither touches the process's global RNG.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(config.train.seed)
            self.task = RankingTask(config, self.device, self.ctx)
        self.variational_dropouts = [m for m in self.task.dense.modules() if isinstance(m, VariationalDropout)]
        draws = bool(self.variational_dropouts) or any(isinstance(m, nn.Dropout) for m in self.task.dense.modules())
        self.rng = StepRng(config.train.seed, self.device, draws)
        self.evaluator = Evaluator(config, self.task, self.input, self.ctx)
        self.tasks = self.evaluator.tasks
        self._frozen_tables = {f.table_name for f in config.features() if f.embedded and not f.trainable}
        self._dense_params = list(self.task.dense.parameters())  # (a walk of every module: once, not a step)
        self.dense_optimizer = config.train.dense_optimizer.build(self._dense_params)
        # On a GPU the fused Adam's step replays from a CUDA graph (its host work is a step's tenth)
        self._optimizer_graph = (
            OptimizerStepGraph(self.dense_optimizer)
            if config.train.cuda_graphs and captures_step(self.dense_optimizer)
            else None
        )
        self._dense_base_lr = [g["lr"] for g in self.dense_optimizer.param_groups]
        self.checkpoints = CheckpointManager(self.model_dir, keep=config.train.keep_checkpoints)
        self.log = TrainingLog(self.model_dir, progress=progress, enabled=self.ctx.is_main)
        self.step = 0
        self.skipped_batches = 0  # batches with a non-finite loss, under nan_policy 'skip_batch'
        self._restored_world_size: Optional[int] = None  # the ranks that wrote the checkpoint restored
        scaling = config.train.grad_scaler
        self.loss_scaler = LossScaler(scaling) if scaling is not None else None
        # On a GPU a recurring step of fixed tables replays whole from CUDA graphs (its host work
        # bounds it otherwise); weakly: the graphs must not hold their trainer alive (a cycle).
        alive = weakref.ref(self)
        self.step_graph_refusal = step_graph_refusal(
            self.task.embeddings,
            self.task.dense,
            self.dense_optimizer,
            device=self.device,
            distributed=self.ctx.distributed,
            cuda_graphs=config.train.cuda_graphs,
            whole_step=config.train.whole_step_graphs,
            eager_lookups=config.train.whole_step_graphs_eager_lookups,
            mixed_precision=config.train.mixed_precision,
            accumulation_steps=config.train.gradient_accumulation_steps,
            loss_scaling=self.loss_scaler is not None,
            draws=self.rng.draws,
        )
        self.step_graphs: Optional[StepGraphs] = None
        if self.step_graph_refusal is None:
            assert isinstance(self.task.embeddings, EmbeddingCollection)
            self.step_graphs = StepGraphs(
                self.task.embeddings,
                self.dense_optimizer,
                lambda batch, rows: _alive(alive)._forward_loss(batch, rows)[0],
                lambda: _alive(alive)._dense_step(),
                self.task,
            )
        for graphs, what, switch in (
            (self.task.graphs, "the dense model runs", "cuda_graphs"),
            (self.step_graphs, "the whole step runs", "whole_step_graphs"),
        ):
            if graphs is not None:
                refused = weakref.WeakMethod(self._graphs_refused)
                graphs.on_refusal = partial(_call_if_alive, refused, what=what, switch=switch)
        self.scores_candidates = config.candidate_feature() is not None  # a label a candidate, not a row
        # TDM: a batch's rows and its sampled tree nodes' rows, all of them labelled
        self.tree_samples = config.data.tdm_sampler is not None
        self.position = DataPosition()
        self.stop_signal = self.input.stop_signal  # SIGTERM during fit: stop after the step, saved
        self._stopping = False

    def _graphs_refused(self, reason: str, what: str, switch: str) -> None:
        print(
            f"step {self.step + 1}: {what} eagerly: its CUDA graph capture failed ({reason}); "
            f"train.{switch}: false skips the attempt",
            file=sys.stderr,
            flush=True,
        )

    @property
    def global_batch_size(self) -> int:
        """Rows of one training step over all ranks (``data.batch_size`` is per rank)."""
        return self.input.global_batch_size

    def example_batch(self, rows: int = 256) -> Batch:
        """The first ``rows`` rows of the eval (else train) data, without labels."""
        return self.input.example_batch(rows)

    def export(self, export_dir: str | Path, since: Optional[str | Path] = None) -> Path:
        """:func:`~dynarec.train.export.export_model` of this model at its step, its dense program
        traced on the data's first 256 rows — fewer where their rows overflow the cache of a table
        kept in host memory (the trace needs their shapes, not their number)."""
        from dynarec.embedding.cached_store import CacheFullError
        from dynarec.train.export import export_model

        rows = 256
        while True:
            try:
                return export_model(self.task, self.example_batch(rows), export_dir, step=self.step, since=since)
            except CacheFullError:
                if rows == 2:
                    raise
                rows = max(rows // 4, 2)

    def predict(self, paths, with_labels: bool = True, max_steps: Optional[int] = None, per_row: bool = False):
        """:meth:`Evaluator.predict` of this model."""
        return self.evaluator.predict(paths, with_labels, max_steps, per_row)

    def evaluate(self, paths=None) -> dict[str, float]:
        """:meth:`Evaluator.evaluate` of this model."""
        return self.evaluator.evaluate(paths)

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
            "config_sections": self.config_sections,
            **({"tdm_tree": self.tree} if self.tree is not None else {}),
            "history": self.log.state(),
            "plan": plan_state(self.task.plan),
            "followed_files": [list(f) for f in self.input.followed_files],
            "train_files": [list(f) for f in self.input.files_of(self.position.epoch)],
            "step_rng": self.rng.state(),
            **({"loss_scaler": self.loss_scaler.state()} if self.loss_scaler is not None else {}),
            # inside an accumulation window: the dense gradients summed so far (each rank's the same),
            # each step's at this weight (its share of the window, times the loss scale)
            "dense_grads": [None if p.grad is None else p.grad.detach().cpu() for p in self._dense_params],
            "dense_grads_weight": self._window_weight(),
        }

    def save(self) -> Path:
        """A checkpoint of this step (every rank calls it: each writes the tables it holds, a
        data-parallel table only once). Saving changes nothing of the training: dense gradients
        accumulated since the last dense step (train.gradient_accumulation_steps) are saved as
        they are, and a run resumed from it takes its dense step where a straight run would."""
        tables = {
            name: t.dump()
            for name, t in self.task.embeddings.tables.items()
            if self.ctx.is_main or self.task.plan.table(name).sharding.kind != "data_parallel"
        }
        return self.checkpoints.save(self.step, self._state() if self.ctx.is_main else {}, tables, ctx=self.ctx)

    def restore(self, path: Optional[Path] = None, training: bool = True) -> Path:
        """Loads ``path`` (default: the latest checkpoint of the model directory), written by any
        number of ranks: every rank takes its own part of every table (see distributed.reshard).
        ``training``: to continue training (the global batch must match the checkpoint's)."""
        path, state, shards = self.checkpoints.load(path)
        if training:
            self._check_data_position_kind(path, state)
        if training and hasattr(self.task.dense, "finish_training"):
            raise CheckpointError(
                f"{path}: model '{self.config.model.name}' samples its training rows in memory, which checkpoints do "
                "not hold (it is fitted once, when training ends): train it again from the start"
            )
        saved_plan = state.get("plan")
        if not isinstance(saved_plan, dict):
            raise CheckpointError(f"{path} holds no plan (written by an older dynarec); train into another model_dir")
        self._restored_world_size = saved_plan["world_size"]
        saved_sections = state.get("config_sections")
        if isinstance(saved_sections, dict):  # (a field the schema gained since is not a change)
            state = {**state, "config_sections": sections_as_today(self.config, saved_sections)}
        check_resumable(
            state,
            path,
            self.fingerprint,
            self.config_sections,
            self.tree,
            self.global_batch_size,
            {t.table.name: type(t.optimizer).__name__ for t in self.task.plan.tables},
            saved_plan["tables"],
            self.dense_optimizer,
            training,
            self.ctx.world_size,
        )
        self.task.dense.load_state_dict(state["dense"])
        if training:
            self._load_dense_optimizer(state["dense_optimizer"])
        try:
            dumps = tables_for_rank(self.task.plan, self.ctx.rank, saved_plan, shards)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
        for name, dump in dumps.items():
            table = self.task.embeddings.tables[name]
            # Read, not trained: another optimizer's states (a config changed since) are not needed.
            weights_only = not training and bool(table.foreign_fields(dump) or table.lacking_states(dump))
            report = table.load(dump, weights_only=weights_only, to_read=not training)
            if report["dropped"]:  # (training: a table to be read takes every key)
                world = saved_plan["world_size"]
                raise CheckpointError(
                    f"{path}: table '{name}' on rank {self.ctx.rank}: {report['dropped']} of "
                    f"{report['loaded'] + report['dropped']} keys find no row in this run's shard (its share of "
                    f"max_capacity; the checkpoint's {world} rank(s) filled theirs); resume it with "
                    f"--nproc {world}, the world size it was written at (evaluate, export and predict read it in "
                    "one process as it is)"
                )
            if report.get("admission_dropped"):  # (a counter is bounded: nearly full, another layout drops some)
                warnings.warn(
                    f"{path}: table '{name}' on rank {self.ctx.rank}: {report['admission_dropped']} of "
                    f"{int(dump['admission_keys'].numel())} admission counts (the lowest) found no room in this run's "
                    "counter (another world size lays it out anew); those keys count their sightings from 0 again",
                    stacklevel=2,
                )
        self.step = state["step"]
        self.position = DataPosition(state["epoch"], state["row"])
        self.input.followed_files = [(str(n), int(r)) for n, r in state.get("followed_files", [])]
        self.log.load_state(state["history"], self.step if training else None)
        if training:
            recorded = [(str(n), int(r)) for n, r in state.get("train_files", [])]
            self.input.check_position(self.position, recorded, str(path))
            self.rng.load_state(state.get("step_rng") or {})
            if self.loss_scaler is not None and "loss_scaler" in state:
                self.loss_scaler.load_state(state["loss_scaler"])
            self._restore_window(state)
        if self.step_graphs is not None:  # they hold the tables' and states' memory by address
            self.step_graphs.reset()
        return path

    def _load_dense_optimizer(self, saved: dict[str, Any]) -> None:
        """The checkpoint's dense optimizer states (moments, step counts) under this config's
        settings (betas, eps, weight decay, momentum; the learning rate is set every step), as a
        table's optimizer states load under its config's spec: torch's ``load_state_dict`` would
        also put back the checkpoint's settings, and a changed setting would silently not apply."""
        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.dense_optimizer.param_groups]
        self.dense_optimizer.load_state_dict(saved)
        for group, mine in zip(self.dense_optimizer.param_groups, settings):
            group.update(mine)

    def _check_data_position_kind(self, path: Path, state: dict[str, Any]) -> None:
        """CheckpointError where a checkpoint's data position counts through other files than
        this run reads: written by ``train --follow`` (the followed directory's files consumed)
        and resumed without it, or written mid-epoch by a run over data.train_input_path's files
        and resumed with --follow (before any table is loaded)."""
        followed, row = state.get("followed_files") or [], int(state.get("row", 0))
        if followed and self.input.follow is None:
            raise CheckpointError(
                f"{path} was written by `train --follow`: its data position (row {row}) counts through the "
                f"{len(followed)} file(s) consumed in the followed directory, not through data.train_input_path's "
                "files as an epoch reads them; continue it with --follow --resume"
            )
        if not followed and row and self.input.follow is not None:
            raise CheckpointError(
                f"{path} was written mid-epoch (epoch {state.get('epoch')}, row {row}) by a run over "
                "data.train_input_path's files as epochs: its position counts through them, not through a followed "
                "directory's files; resume it without --follow (or let it end its epoch first)"
            )

    def _restore_window(self, state: dict[str, Any]) -> None:
        """The dense gradients of the accumulation window a checkpoint was saved in (none: its
        next step begins one), made as this run's would be: each step's share is 1 /
        gradient_accumulation_steps, scaled by the loss scale under fp16 loss scaling, so a
        resume that changes either takes the saved steps at this run's weight."""
        grads = state.get("dense_grads") or [None] * len(self._dense_params)
        saved, now = state.get("dense_grads_weight", 1.0), self._window_weight()
        for p, g in zip(self._dense_params, grads):
            p.grad = None if g is None else (g * (now / saved) if now != saved else g).to(p.device)

    def _window_weight(self) -> float:
        """The weight of a step's dense gradients in its accumulation window: its share (1 /
        gradient_accumulation_steps), times the loss scale under fp16 loss scaling."""
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        return scale / self.config.train.gradient_accumulation_steps

    # -- training --------------------------------------------------------------------------

    def _set_learning_rates(self) -> None:
        train = self.config.train
        for name, table in self.task.embeddings.tables.items():
            if name not in self._frozen_tables:  # trainable: false keeps learning rate 0 (the planner's SGD)
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
        window_goes_on = (self.step + 1) % self.config.train.gradient_accumulation_steps != 0
        try:
            with self.task.dense_gradients_kept_local() if window_goes_on else contextlib.nullcontext():
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
        if self.step_graphs is not None:
            replayed = self.step_graphs.forward(batch, global_rows)
            if replayed is not None:  # the step's forward replayed from its CUDA graph
                loss, finite = replayed
                if self._skipped(loss, finite):
                    return None
                self.step_graphs.backward()  # the fused updates and the dense optimizer's step
                self.step += 1
                return loss
        if batch.ready is not None:  # a batch kept on the device, copied there on another stream
            current_stream(self.device).wait_event(batch.ready)
        bypass: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.step_graphs is not None and self.step_graphs.captures_next and self.task.graphs is not None:
            bypass = self.task.graphs.bypassed()  # (the whole step's graphs replace the dense model's)
        with bypass:
            loss, held = self._forward_loss(batch, global_rows)
        if self._skipped(loss):
            return None
        accumulate = self.config.train.gradient_accumulation_steps
        share = loss / accumulate if accumulate > 1 else loss  # (no op a step without accumulation)
        if self.loss_scaler is None:
            share.backward()  # the fused sparse optimizer updates the touched rows here
        else:
            self._scaled_backward(share, held)
        self.step += 1
        if self.step % accumulate == 0:
            self._dense_step()
        if self.step_graphs is not None:
            self.step_graphs.ran_eagerly()
        return loss.detach()

    def read_ahead(self, batches: Iterator[Item]) -> ReadAhead:
        """The training loop's read-ahead of ``batches`` (:class:`ReadAhead`): a step replayed
        from CUDA graphs has its input stage run ahead for the units looked up around them
        alone (``StepGraphs.ahead_units``)."""
        graphs = self.step_graphs
        return ReadAhead(batches, self.task.embeddings, None if graphs is None else graphs.ahead_units)

    def _forward_loss(
        self, batch: Batch, global_rows: Optional[int]
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The step's forward and loss: ``(loss, held)``, ``held`` the embedding outputs and
        the leaves the dense model read them as, under loss scaling (else empty)."""
        train = self.config.train
        held: list[tuple[torch.Tensor, torch.Tensor]] = []
        with self.rng.active():
            if self.loss_scaler is None:
                logits = self.task(batch, precision=train.mixed_precision)
            else:  # the tables' backward runs after the overflow check (dynarec/train/loss_scaling.py)
                logits, held = self.task.forward_detached(batch, precision=train.mixed_precision)
        labels = batch.labels.to(self.device, non_blocking=True)
        global_sum = partial(self.ctx.all_reduce_sum, what="the tasks' sample weights")
        sessions = None if batch.sessions is None else batch.sessions.to(self.device, non_blocking=True)
        teaching = getattr(self.task.dense, "teaching", None)  # a teacher net's part (RocketLaunching)
        count: Union[int, torch.Tensor] = global_rows or batch.num_rows
        if self.scores_candidates or self.tree_samples:  # the mean over every rank's candidates / rows
            count = labels.shape[0]
            if self.ctx.distributed:
                count = global_sum(torch.tensor(float(count), device=self.device))
        hard = batch.hard_negative_rows
        hard = None if hard is None else hard.to(self.device, non_blocking=True)
        loss = self.tasks.loss(logits, labels, count, global_sum, sessions, teaching, hard)
        penalty = penalties(
            self.variational_dropouts, batch.num_rows, count if self.tree_samples else global_rows or batch.num_rows
        )
        if penalty is not None:
            loss = loss + penalty
        return loss, held

    def _skipped(self, loss: torch.Tensor, finite: Optional[torch.Tensor] = None) -> bool:
        """The check of a step's loss before its backward (``finite``: whether it is finite,
        where worked out already), agreed by every rank: where it is NaN or infinite, the tables'
        step is undone and True returned (nan_policy 'skip_batch'), or TrainingError raised."""
        bad = not bool(torch.isfinite(loss) if finite is None else finite)
        # A stop asked of any rank (SIGTERM) is agreed here too, so that every rank stops after
        # the same step: the step's one collective check carries both flags.
        self._stopping = self.stop_signal.requested is not None
        if self.ctx.distributed:
            bad, self._stopping = self.ctx.any_each([bad, self._stopping], f"the loss of step {self.step + 1}")
        if bad:
            self.task.embeddings.abort_step()
            if self.config.train.nan_policy == "skip_batch":
                self.skipped_batches += 1
                return True
            latest = self.checkpoints.latest()
            raise TrainingError(
                f"step {self.step + 1}: the loss is {float(loss.detach())}"
                f"{' on some rank' if self.ctx.distributed else ''}; "
                "nothing of this step "
                "was written "
                f"({f'the latest checkpoint is {latest}' if latest else 'no checkpoint was written'}); "
                "check the input around this step, lower the learning rates, or set train.nan_policy: skip_batch"
            )
        return False

    def _scaled_backward(self, loss: torch.Tensor, held: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """FP16 loss scaling (dynarec/train/loss_scaling.py): the scaled loss's backward through the dense
        model to the embedding leaves ``held``; then, where every gradient of the step is finite on every
        rank (and none overflowed earlier in the accumulation window), the tables' backward on the leaves'
        gradients divided by the scale; else the tables' step is aborted."""
        scaler = self.loss_scaler
        assert scaler is not None
        (loss * scaler.scale).backward()
        grads = [leaf.grad for _, leaf in held if leaf.grad is not None]
        dense = [p.grad for p in self._dense_params if p.grad is not None]
        overflow = scaler.overflowed or not scaler.finite(grads + dense)
        if self.ctx.distributed:
            overflow = self.ctx.any(overflow, f"the gradients' overflow check of step {self.step + 1}")
        scaler.overflowed = overflow
        if overflow:
            self.task.embeddings.abort_step()
            return
        outputs = [out for out, leaf in held if leaf.grad is not None]
        torch.autograd.backward(outputs, [g / scaler.scale for g in grads])  # the fused updates run here

    def _dense_step(self) -> None:
        """The dense optimizer's step on the gradients summed since the last one (unscaled first under
        loss scaling, and skipped where they overflowed; clipped when train.gradient_clipping says
        so), then zeroed."""
        params = self._dense_params
        take = True
        if self.loss_scaler is not None:
            self.loss_scaler.unscale_(params)
            take = self.loss_scaler.update()
        clipping = self.config.train.gradient_clipping
        if take and clipping is not None:
            nn.utils.clip_grad_norm_(params, clipping.max_norm, clipping.norm_type)
        if take:
            self._optimizer_graph.step() if self._optimizer_graph is not None else self.dense_optimizer.step()
        self.dense_optimizer.zero_grad(set_to_none=True)

    def fit(self, resume: bool = False) -> dict[str, Any]:
        """Trains to ``num_steps`` (or ``num_epochs``), evaluating and checkpointing on the way;
        returns the final report (eval metrics empty without eval data).

        Called in the main thread, it handles SIGTERM while it runs (the handler before it is put
        back after): the step in progress finishes, the steps trained are saved, and it raises
        :class:`~dynarec.train.stop.TrainingStopped` naming the checkpoint."""
        cfg = self.config
        if self.input.follow is None or data_files(str(cfg.data.train_input_path)):
            self.input.dataset(
                cfg.data.train_input_path, cfg.data.batch_size, training=True, what=TRAIN_PATH
            )  # check every file first
        if cfg.data.eval_input_path:
            self.input.dataset(cfg.data.eval_input_path, self.input.eval_batch_size, what=EVAL_PATH)
        check_not_another_kind(self.model_dir)  # before its lock file is written there
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
            stack.callback(self.input.close)
            stack.enter_context(self.stop_signal.installed())
            return self._fit_locked(resume)

    def _fit_locked(self, resume: bool) -> dict[str, Any]:
        cfg = self.config
        self._stopping = self.input.stopped = False
        existing = self.checkpoints.list()
        if resume:
            if existing:
                path = self.restore()
                if self.ctx.is_main:
                    print(
                        f"resumed from {path} (step {self.step}, epoch {self.position.epoch}, row {self.position.row})",
                        file=sys.stderr,
                        flush=True,
                    )
                self._check_not_past_the_end(path)
            elif self.ctx.is_main:  # (a job restarted with --resume from its first launch on, say)
                print(f"--resume: {self.model_dir} holds no checkpoint yet; training from the start", file=sys.stderr)
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
        batches = self.input.batches(self.position)
        first = next(batches, None) if self._more_steps() else None
        if first is not None and self.ctx.distributed:
            self.ctx.agree(first[0] if isinstance(first[0], DataError) else None, "reading the first batch")
        if self.ctx.is_main:
            self.model_dir.mkdir(parents=True, exist_ok=True)
            if config_text is not None:
                write_config_record(self.model_dir, config_text)
        self.log.start(self.step, cfg.train.num_steps)
        start_step = self.step
        evaluated_at = None
        # A resume that trains nothing writes nothing, unless the checkpoint is to be laid out anew
        # for this run's ranks (a resume at another world size that trains no step reshards it).
        saved_at = self.step if resume and existing and self._restored_world_size == self.ctx.world_size else None
        item = first
        ahead = self.read_ahead(batches)
        # Not in a multi-process run (its input stage is collective), nor when following a
        # directory (reading ahead would hold a step's backward until the next file arrives).
        read_ahead = not self.ctx.distributed and self.input.follow is None
        window: Optional[torch.Tensor] = None  # the losses' sum since the last record, and its steps
        window_steps = 0
        try:
            with _heap_frozen():  # the objects built so far are not scanned again
                while item is not None:
                    batch, position, rows = item
                    loss = self.train_step(batch, rows)
                    self.position = position  # (not before: a failed step's checkpoint resumes with its batch)
                    if loss is not None:  # (None: skipped, nan_policy 'skip_batch')
                        if read_ahead and self._more_steps() and not self._stopping:  # while the backward runs
                            ahead.read(self._steps_left())
                        record = self.step % cfg.train.log_step_count_steps == 0 or self.step == 1
                        # The losses since the last record, summed on the device (no read a step).
                        step_loss = loss.detach().float()  # (in float32 whatever the loss's dtype)
                        window = step_loss if window is None else window + step_loss
                        window_steps += 1
                        value = mean = None
                        if record:  # (each rank's loss is its share of the global batch's mean: the ranks' sum is it)
                            both = self.ctx.all_reduce_sum(torch.stack([step_loss, window]), "the step's loss")
                            value, mean = float(both[0]), float(both[1]) / window_steps
                            window, window_steps = None, 0
                        self.log.train_step(self.step, value, self.position.epoch, record, mean)
                        evaluate = cfg.train.eval_every_steps and self.step % cfg.train.eval_every_steps == 0
                        if evaluate and cfg.data.eval_input_path and not self._stopping:
                            try:
                                self.log.eval(self.step, self.evaluate())
                                evaluated_at = self.step
                            except EvaluationStopped:  # SIGTERM: the steps are saved now, not after it
                                self._stopping = True
                        epochs = cfg.train.save_checkpoints_epochs
                        epoch_done = epochs is not None and self.position.row == 0 and self.position.epoch % epochs == 0
                        every = cfg.train.save_checkpoints_steps
                        if (every and self.step % every == 0) or epoch_done:
                            self.save()
                            saved_at = self.step
                            self.log.line(self.step, "checkpoint saved")
                    if self.position.row == 0 and self.input.follow is None:  # this batch ended an epoch
                        # (its evaluation and checkpoint included)
                        self.log.epoch_end(self.step, self.position.epoch - 1)
                    if not self.ctx.distributed and self.stop_signal.requested is not None:
                        self._stopping = True  # (asked during this step's evaluation or save: no step more)
                    if self._stopping:
                        break
                    item = ahead.next() if self._more_steps() else None
        except (DataError, StepFailedError, TableFullError, CacheFullError) as e:  # the failed step was undone
            raise self._progress_kept(e, saved_at, start_step) from None
        seconds = self.log.seconds
        finish = getattr(self.task.dense, "finish_training", None)  # a model fitted once training ends
        if finish is not None:
            self.log.line(self.step, finish())
            saved_at = None
        self._stopping = self._stopping or self.input.stopped  # (--follow, stopped while waiting for files)
        if saved_at != self.step:
            self.save()
        if self._stopping:
            signum = self.stop_signal.requested or signal.SIGTERM  # (another rank's, in a multi-process run)
            flags = "--follow --resume" if self.input.follow is not None else "--resume"
            then = f"continue with {flags}" if finish is None else "this model cannot resume: train it from the start"
            raise TrainingStopped(
                f"stopped by {signal.Signals(signum).name} after step {self.step}; the model is saved in "
                f"{self.checkpoints.latest()} ({then})",
                signum,
            )
        final: dict[str, Any] = {}
        if cfg.data.eval_input_path:
            if evaluated_at == self.step:
                final = self.log.history["eval"][-1][1]
            else:
                try:
                    final = self.evaluate()
                except (DataError, StepFailedError) as e:  # the model trained is saved (above)
                    raise type(e)(
                        f"{e}; the trained model is saved in {self.checkpoints.latest()}: `dynarec evaluate` "
                        "evaluates it once the data is fixed"
                    ) from None
                except EvaluationStopped as e:
                    signum = self.stop_signal.requested or signal.SIGTERM
                    raise TrainingStopped(
                        f"stopped by {signal.Signals(signum).name} during the final evaluation ({e}); the model "
                        f"trained to step {self.step} is saved in {self.checkpoints.latest()}: `dynarec evaluate` "
                        "evaluates it",
                        signum,
                    ) from None
                self.log.eval(self.step, final)
        report = {
            "step": self.step,
            "train_seconds": seconds,
            "skipped_batches": self.skipped_batches,
            **({"loss_scale": self.loss_scaler.scale} if self.loss_scaler is not None else {}),
            **({"overflow_skipped_steps": self.loss_scaler.skipped_steps} if self.loss_scaler is not None else {}),
            "steps_per_second": (self.step - start_step) / seconds if seconds > 0 else math.nan,
            "epochs": self.log.epochs,
            **({"cuda_graphs": self.cuda_graphs_report()} if self.device.type == "cuda" else {}),
            "eval": final,
        }
        self.log.finish(report)
        return report

    def cuda_graphs_report(self) -> dict[str, Any]:
        """How the training steps on a GPU used CUDA graphs since this trainer was made: the
        whole step's (``whole_step_replayed_steps``, ``whole_step_captures`` of signatures, or
        ``whole_step_refused``: why this setup's steps never replay) and the dense model's
        (``dense_replays``, ``dense_refused``). A run whose whole steps seldom replay has batches
        whose signature changes (``dynarec.train.step_graph``: histories of varying length)."""
        steps, dense = self.step_graphs, self.task.graphs
        return {
            "whole_step_replayed_steps": steps.replays if steps is not None else 0,
            "whole_step_captures": steps.captures if steps is not None else 0,
            "whole_step_refused": self.step_graph_refusal if steps is None else steps.refused,
            "dense_replays": dense.replays if dense is not None else 0,
            "dense_refused": dense.refused if dense is not None else self.task.dense_graph_refusal,
        }

    def _check_not_past_the_end(self, path: Path) -> None:
        """CheckpointError where the checkpoint just restored (``path``) trained past this config's
        ``train.num_steps``, or into an epoch past its ``num_epochs``: nothing would train, and the
        model directory's config record would be rewritten to the smaller count."""
        train, at = self.config.train, self.position
        if train.num_steps is not None and self.step > train.num_steps:
            raise CheckpointError(
                f"{path} is at step {self.step}, past this config's train.num_steps {train.num_steps}: "
                "nothing to train; raise num_steps, or evaluate / export the checkpoint as it is"
            )
        if train.num_steps is None and self.input.follow is None and (at.epoch, at.row) > (train.epochs, 0):
            where = f"epoch {at.epoch + 1}, row {at.row}" if at.row else f"the end of epoch {at.epoch}"
            raise CheckpointError(
                f"{path} is at {where}, past this config's train.num_epochs {train.epochs}: nothing to train; "
                "raise num_epochs, or evaluate / export the checkpoint as it is"
            )

    def _progress_kept(self, error: Exception, saved_at: Optional[int], start_step: int) -> Exception:
        """``error`` once the steps trained since the last checkpoint are saved: a batch that
        could not be read, evaluation data, a full table or cache (the tables and the dense model
        are those of the last whole step: the failed one was undone). A data error's message
        then says where they are (for the others the CLI names the latest checkpoint). Returned
        as it is: one rank's own DataError in a multi-process run (a save is collective, and the
        other ranks are not failing with it), and the error of a model fitted when training ends
        (``finish_training``: it cannot resume)."""
        if (isinstance(error, DataError) and self.ctx.distributed) or hasattr(self.task.dense, "finish_training"):
            return error
        latest = self.checkpoints.latest()
        if self.step == start_step or saved_at == self.step:
            kept = f"the latest checkpoint is {latest}" if latest else "no checkpoint was written"
        else:
            try:
                latest = self.save()
                kept = f"the {self.step - start_step} steps trained are saved in {latest}"
            except Exception as failed:
                kept = f"saving the steps trained failed too ({type(failed).__name__}: {failed})"
                latest = None
        if not isinstance(error, (DataError, StepFailedError)):
            return error
        then = ""
        if latest:
            then = "; --resume continues from it" + (" once the data is fixed" if isinstance(error, DataError) else "")
        return type(error)(f"{error}; {kept}{then}")

    def _more_steps(self) -> bool:
        """Whether another step is to run (``num_steps`` permitting)."""
        return self.config.train.num_steps is None or self.step < self.config.train.num_steps

    def _steps_left(self) -> Optional[int]:
        """Steps still to run (None: until the data ends)."""
        n = self.config.train.num_steps
        return None if n is None else max(n - self.step, 0)


@contextlib.contextmanager
def _heap_frozen() -> Iterator[None]:
    """Around the training loop: Python's cyclic garbage collector leaves the objects that exist
    now (the model, tables, data stage, imported modules: some 300k of them) out of its
    collections until the block ends (``gc.freeze``). A full collection scanned them all: 0.12 s
    once in a 98-step epoch of the demo on a 2-core CPU; the steps' own garbage is still
    collected. Nothing is frozen where the process
    froze objects itself (``gc.get_freeze_count()``), nor with the collector disabled."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
