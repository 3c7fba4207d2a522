"""The trainer: train with periodic eval, evaluate, checkpoint and resume.

Model directory layout::

    config.yaml            the config this directory was trained with
    checkpoints/ckpt-N/    atomic checkpoints (see dynarec.train.checkpoint); checkpoints/latest
    tb/                    TensorBoard logs
    curves.png             training loss and eval metrics
    metrics.json           loss and eval history, final eval metrics

Nothing is written until the config and the input files have been checked and the first batch
has been read, so bad input leaves an empty (or untouched) model directory.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
import yaml
from torch import nn

from dynarec.config.load import config_fingerprint
from dynarec.config.schema import Config
from dynarec.data.batch import Batch, BatchBuilder
from dynarec.data.reader import ArrowBatchDataset, make_loader, resolve_files
from dynarec.metrics import auc, grouped_auc, log_loss
from dynarec.train.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from dynarec.train.task import RankingTask

__all__ = ["Trainer"]


class Trainer:
    def __init__(self, config: Config, model_dir: str | Path, device: str = "cpu", progress: bool = True):
        self.config = config
        self.model_dir = Path(model_dir)
        self.ckpt_dir = self.model_dir / "checkpoints"
        self.device = torch.device(device)
        self.progress = progress
        torch.manual_seed(config.train.seed)
        self.task = RankingTask(config, self.device)
        self.dense_optimizer = config.train.dense_optimizer.build(self.task.dense.parameters())
        self._dense_base_lr = [g["lr"] for g in self.dense_optimizer.param_groups]
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.history: dict[str, list] = {"train_loss": [], "eval": []}
        self._writer = None

    # -- data ------------------------------------------------------------------------------

    def _dataset(self, paths, batch_size: int, with_labels: bool = True) -> ArrowBatchDataset:
        ds = ArrowBatchDataset(resolve_files(paths), BatchBuilder(self.config, with_labels), batch_size,
                               self.config.data.input_type)
        ds.check_files()
        return ds

    def example_batch(self, rows: int = 256) -> Batch:
        """The first ``rows`` rows of the eval (else train) data, without labels."""
        cfg = self.config
        dataset = self._dataset(cfg.data.eval_input_path or cfg.data.train_input_path, rows, with_labels=False)
        return next(iter(make_loader(dataset, 0)))

    def _eval_batch_size(self) -> int:
        return self.config.data.eval_batch_size or self.config.data.batch_size

    # -- checkpoints -----------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {
            "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
            "dense": self.task.dense.state_dict(),
            "dense_optimizer": self.dense_optimizer.state_dict(),
            "fingerprint": config_fingerprint(self.config),
            "torch_rng": torch.get_rng_state(),
            "history": json.dumps(self.history),
        }

    def save(self) -> Path:
        tables = {name: t.dump() for name, t in self.task.embeddings.tables.items()}
        return save_checkpoint(self.ckpt_dir, self.step, self._state(), tables, keep=self.config.train.keep_checkpoints)

    def _check_fingerprint(self, state: dict, where: Path) -> None:
        mine = config_fingerprint(self.config)
        theirs = state.get("fingerprint", {})
        differ = [k for k in mine if theirs.get(k) != mine[k]]
        if differ:
            raise CheckpointError(
                f"{where} was written with a different config: its {' and '.join(differ)} differ from this "
                f"config's; use the config it was trained with, or another model_dir"
            )

    def restore(self, path: Optional[Path] = None) -> Path:
        """Loads ``path`` (default: the latest checkpoint of the model directory)."""
        path = path or latest_checkpoint(self.ckpt_dir)
        if path is None:
            raise CheckpointError(f"no checkpoint in {self.ckpt_dir}")
        state, tables = load_checkpoint(path)
        self._check_fingerprint(state, path)
        mine = set(self.task.embeddings.tables)
        if set(tables) != mine:
            raise CheckpointError(f"{path}: holds tables {sorted(tables)}, the config has {sorted(mine)}")
        self.task.dense.load_state_dict(state["dense"])
        self.dense_optimizer.load_state_dict(state["dense_optimizer"])
        for name, dump in tables.items():
            self.task.embeddings.tables[name].load(dump)
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        torch.set_rng_state(state["torch_rng"])
        self.history = json.loads(state["history"])
        return path

    # -- training --------------------------------------------------------------------------

    def _set_learning_rates(self) -> None:
        train = self.config.train
        f = train.sparse_lr_schedule.factor(self.step)
        for table in self.task.embeddings.tables.values():
            table.set_learning_rate(table.spec.lr * f)
        f = train.dense_lr_schedule.factor(self.step)
        for g, base in zip(self.dense_optimizer.param_groups, self._dense_base_lr):
            g["lr"] = base * f

    def train_step(self, batch: Batch) -> float:
        self.task.train()
        self._set_learning_rates()
        logits = self.task(batch)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.to(self.device))
        self.dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the fused sparse optimizer updates the touched rows here
        self.dense_optimizer.step()
        self.step += 1
        return float(loss.detach())

    def _batches(self, dataset: ArrowBatchDataset) -> Iterator[tuple[int, int, Batch]]:
        """(epoch, index in epoch, batch) from the current data position on."""
        while self.epoch < self.config.train.num_epochs:
            for i, batch in enumerate(make_loader(dataset, self.config.data.num_workers)):
                if i < self.batch_in_epoch:
                    continue  # consumed before the checkpoint this run resumed from
                yield self.epoch, i, batch
            self.epoch += 1
            self.batch_in_epoch = 0

    def fit(self, resume: bool = False) -> dict[str, Any]:
        """Trains to ``num_steps`` (or ``num_epochs``), evaluating and checkpointing on the way;
        returns the final eval metrics (empty without eval data)."""
        cfg = self.config
        dataset = self._dataset(cfg.data.train_input_path, cfg.data.batch_size)
        if cfg.data.eval_input_path:
            self._dataset(cfg.data.eval_input_path, self._eval_batch_size())  # check before writing
        existing = list_checkpoints(self.ckpt_dir)
        if resume:
            if existing:
                self.restore()
        elif existing:
            raise CheckpointError(f"{self.model_dir} already holds checkpoints ({existing[-1].name}); "
                                  "pass --resume to continue, or choose another model_dir")
        batches = self._batches(dataset)
        first = next(batches, None)  # reads (and validates) the first batch before anything is written
        self.model_dir.mkdir(parents=True, exist_ok=True)
        (self.model_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
        bar = self._progress_bar()
        start, start_step, running = time.perf_counter(), self.step, None
        evaluated_at = saved_at = None
        for epoch, index, batch in itertools.chain([first] if first is not None else [], batches):
            if cfg.train.num_steps is not None and self.step >= cfg.train.num_steps:
                break
            loss = self.train_step(batch)
            self.batch_in_epoch = index + 1
            running = loss if running is None else 0.98 * running + 0.02 * loss
            if self.step % cfg.train.log_step_count_steps == 0 or self.step == 1:
                self.history["train_loss"].append([self.step, loss])
                self._log({"train/loss": loss, "train/running_loss": running})
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{running:.4f}", epoch=epoch)
            if cfg.train.eval_every_steps and self.step % cfg.train.eval_every_steps == 0 and cfg.data.eval_input_path:
                metrics, evaluated_at = self.evaluate(), self.step
                self._record_eval(metrics)
                self._report(running, start, start_step, f"; eval auc {metrics.get('auc', math.nan):.4f}")
            if cfg.train.save_checkpoints_steps and self.step % cfg.train.save_checkpoints_steps == 0:
                self.save()
                saved_at = self.step
                self._report(running, start, start_step, "; checkpoint saved")
        if bar is not None:
            bar.close()
        seconds = time.perf_counter() - start
        if saved_at != self.step:
            self.save()
        final: dict[str, Any] = {}
        if cfg.data.eval_input_path:
            if evaluated_at == self.step:
                final = self.history["eval"][-1][1]
            else:
                final = self.evaluate()
                self._record_eval(final)
        final_report = {"step": self.step, "train_seconds": seconds,
                        "steps_per_second": (self.step - start_step) / seconds if seconds > 0 else math.nan,
                        "eval": final}
        self._write_outputs(final_report)
        return final_report

    def _progress_bar(self):
        """A tqdm bar on a terminal; elsewhere (logs, CI) :meth:`_report` prints plain lines."""
        if not self.progress or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        total = self.config.train.num_steps
        return tqdm(total=total, initial=self.step if total else 0, unit="step", dynamic_ncols=True, desc="train")

    def _report(self, running: float, start: float, start_step: int, extra: str = "") -> None:
        if self.progress and not sys.stderr.isatty():
            rate = (self.step - start_step) / max(time.perf_counter() - start, 1e-9)
            print(f"step {self.step}: running loss {running:.4f}, {rate:.1f} steps/s{extra}", file=sys.stderr, flush=True)

    # -- evaluation ------------------------------------------------------------------------

    @torch.no_grad()
    def predict(self, paths, with_labels: bool = True, max_steps: Optional[int] = None):
        """Eval-mode predictions over ``paths``: ``(probabilities, labels, groups)`` numpy
        arrays (labels/groups None without labels)."""
        self.task.eval()
        dataset = self._dataset(paths, self._eval_batch_size(), with_labels)
        probs, labels, groups = [], [], []
        for i, batch in enumerate(make_loader(dataset, self.config.data.num_workers)):
            if max_steps is not None and i >= max_steps:
                break
            probs.append(torch.sigmoid(self.task(batch)).cpu().numpy())
            labels.append(batch.labels.numpy())
            if batch.groups is not None:
                groups.append(batch.groups.numpy())
        self.task.train()
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0)  # noqa: E731
        return cat(probs), (cat(labels) if with_labels else None), (cat(groups) if groups else None)

    def evaluate(self, paths=None) -> dict[str, float]:
        paths = paths or self.config.data.eval_input_path
        if not paths:
            raise ValueError("no eval data: set data.eval_input_path")
        probs, labels, groups = self.predict(paths, max_steps=self.config.eval.max_steps)
        metrics: dict[str, float] = {"num_examples": float(probs.size)}
        for m in self.config.eval.metrics:
            if m == "auc":
                metrics["auc"] = auc(probs, labels)
            elif m == "log_loss":
                metrics["log_loss"] = log_loss(probs, labels)
            elif m == "grouped_auc" and groups is not None:
                metrics["grouped_auc"] = grouped_auc(probs, labels, groups)
        return metrics

    def _record_eval(self, metrics: dict[str, float]) -> None:
        self.history["eval"].append([self.step, metrics])
        self._log({f"eval/{k}": v for k, v in metrics.items() if k != "num_examples"})

    # -- outputs ---------------------------------------------------------------------------

    def _log(self, scalars: dict[str, float]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.model_dir / "tb"))
        for k, v in scalars.items():
            if not (isinstance(v, float) and math.isnan(v)):
                self._writer.add_scalar(k, v, self.step)

    def _write_outputs(self, final: dict[str, Any]) -> None:
        if self._writer is not None:
            self._writer.flush()
        (self.model_dir / "metrics.json").write_text(json.dumps({"final": final, "history": self.history}, indent=1))
        plot_curves(self.history, self.model_dir / "curves.png")


def plot_curves(history: dict[str, list], path: Path) -> None:
    """Training loss and eval metrics against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    if history["train_loss"]:
        steps, losses = zip(*history["train_loss"])
        ax1.plot(steps, losses, label="train loss")
    ax1.set_xlabel("step")
    ax1.set_title("training loss (BCE)")
    for key in ("auc", "grouped_auc"):
        pts = [(s, m[key]) for s, m in history["eval"] if key in m and not math.isnan(m[key])]
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=f"eval {key}")
    ax2.set_xlabel("step")
    ax2.set_title("eval")
    if ax2.lines:
        ax2.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
