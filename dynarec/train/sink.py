"""Where a training run reports: progress, TensorBoard, the loss/eval history, metrics.json and
curves.png. The trainer hands it numbers; it owns every file it writes under the model dir.

On a terminal a tqdm bar shows progress; elsewhere (logs, CI) plain lines do. A sink made with
``enabled=False`` (the non-zero ranks of a multi-process run) writes and prints nothing.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

from dynarec.files import atomic_path, atomic_write_text, json_text

__all__ = ["TrainingLog", "plot_curves"]


class TrainingLog:
    def __init__(self, model_dir: Path, progress: bool = True, enabled: bool = True):
        self.model_dir = Path(model_dir)
        self.progress = progress and enabled
        self.enabled = enabled
        self.history: dict[str, list] = {"train_loss": [], "eval": []}
        self._writer: Any = None  # a TensorBoard SummaryWriter, made when the run starts (or at a first scalar)
        self._bar: Any = None  # a tqdm bar, on a terminal
        self._start = time.perf_counter()
        self._start_step = 0
        self._epoch_start: tuple[float, int] = (self._start, 0)  # (when, step) the current epoch's steps began
        self.epochs: list[dict[str, Any]] = []  # each epoch ended in this run: its steps and their pace
        self.running_loss: Optional[float] = None

    # -- state carried in checkpoints --------------------------------------------------------

    def state(self) -> str:
        """The history and the running loss (a resumed run shows it until its first record,
        rather than nothing or its first step's loss)."""
        return json.dumps({**self.history, "running_loss": self.running_loss})

    def load_state(self, state: str, step: Optional[int] = None) -> None:
        """The history a checkpoint holds; with ``step`` (the checkpoint's, resumed to train on),
        also the evaluations this model dir's metrics.json reports at or before it that the
        checkpoint lacks: a run's final evaluation follows its last save, and a resumed run's
        metrics.json would otherwise drop each earlier run's."""
        history = json.loads(state)
        self.running_loss = history.pop("running_loss", None)  # (not kept before 2026-12-06)
        self.history = history
        if step is None or not self.enabled:
            return
        try:
            reported = json.loads((self.model_dir / "metrics.json").read_text())["history"]["eval"]
            kept: dict[int, dict[str, Any]] = {}
            for s, m in reported:
                if int(s) <= step and isinstance(m, dict):  # (metrics.json writes NaN as null)
                    kept[int(s)] = {k: math.nan if v is None else v for k, v in m.items()}
        except (OSError, ValueError, KeyError, TypeError):  # none, or not one of ours: the checkpoint's alone
            return
        for s, _ in self.history["eval"]:  # the checkpoint's own evaluations stand
            kept.pop(int(s), None)
        if kept:
            self.history["eval"] = sorted(self.history["eval"] + [[s, m] for s, m in kept.items()], key=lambda e: e[0])

    # -- a run -------------------------------------------------------------------------------

    def start(self, step: int, total_steps: Optional[int]) -> None:
        """The run's steps start now: its steps/s count from here. TensorBoard's writer is made
        first (its import, a few tenths of a second, is the run's start, not its first step's)."""
        self._open_writer()
        self._start, self._start_step = time.perf_counter(), step
        self._epoch_start, self.epochs = (self._start, step), []
        if self.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True, desc="train")

    def steps_per_second(self, step: int) -> float:
        seconds = time.perf_counter() - self._start
        return (step - self._start_step) / seconds if seconds > 0 else math.nan

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self._start

    def train_step(
        self, step: int, loss: Optional[float], epoch: int, record: bool, mean_loss: Optional[float] = None
    ) -> None:
        """After a training step; ``loss`` (this step's) and ``mean_loss`` (the mean over the
        steps since the last one recorded, this one included) are given, read from the device,
        only when ``record``. The running loss shown and logged is ``mean_loss`` (``loss``
        where it is not given)."""
        if loss is not None:
            self.running_loss = loss if mean_loss is None else mean_loss
        if record and loss is not None and self.running_loss is not None:
            self.history["train_loss"].append([step, loss])
            self.scalars(step, {"train/loss": loss, "train/running_loss": self.running_loss})
        if self._bar is not None:
            self._bar.update(1)
            if self.running_loss is not None:
                self._bar.set_postfix(loss=f"{self.running_loss:.4f}", epoch=epoch)

    def epoch_end(self, step: int, epoch: int) -> None:
        """Epoch ``epoch`` ended with step ``step`` (its last batch trained, or skipped): its
        steps of this run (all of them, but for a run resumed within it) and their pace enter
        :attr:`epochs`. Its time runs from the end of the epoch before, or from :meth:`start`
        (the run's first batch read, as ``steps_per_second``'s), to the end of its last step
        with the evaluation and checkpoint made there, so the epochs' seconds add up to the
        run's. An epoch whose input ended early (its files changed since a checkpoint's
        position) counts into the next. The first epoch's pace against the later ones' shows
        what building batches costs, and what a batch cache saves."""
        now = time.perf_counter()
        began, first = self._epoch_start
        seconds = now - began
        self.epochs.append(
            {
                "epoch": epoch,
                "steps": step - first,
                "seconds": seconds,
                "steps_per_second": (step - first) / seconds if seconds > 0 else math.nan,
            }
        )
        self._epoch_start = (now, step)

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        """Records an evaluation at ``step`` (one a step: a later one at the same step replaces it,
        as a run resumed at its end evaluates that step again)."""
        self.history["eval"] = [e for e in self.history["eval"] if e[0] != step] + [[step, metrics]]
        self.scalars(step, {f"eval/{k}": v for k, v in metrics.items() if k != "num_examples"})
        shown = [(k, v) for k, v in metrics.items() if k != "num_examples"]
        more = f" (+{len(shown) - 4} more)" if len(shown) > 4 else ""  # a multi-task model's: each task's
        self.line(step, "eval " + ", ".join(f"{k} {v:.4f}" for k, v in shown[:4]) + more)

    def line(self, step: int, text: str) -> None:
        """A plain progress line (not on a terminal, where the bar shows progress)."""
        if self.progress and self._bar is None:
            loss = f"running loss {self.running_loss:.4f}, " if self.running_loss is not None else ""
            print(f"step {step}: {loss}{self.steps_per_second(step):.1f} steps/s; {text}", file=sys.stderr, flush=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._open_writer()
        for k, v in values.items():
            if not (isinstance(v, float) and math.isnan(v)):
                self._writer.add_scalar(k, v, step)

    def _open_writer(self) -> None:
        if self.enabled and self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.model_dir / "tb"))

    def finish(self, final: dict[str, Any]) -> None:
        """Closes the bar, flushes TensorBoard, writes metrics.json and curves.png."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if not self.enabled:
            return
        if self._writer is not None:
            self._writer.flush()
        atomic_write_text(self.model_dir / "metrics.json", json_text({"final": final, "history": self.history}))
        with atomic_path(self.model_dir / "curves.png") as tmp:
            plot_curves(self.history, tmp)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def plot_curves(history: dict[str, list], path: Path) -> None:
    """Training loss and eval metrics against the step, as a PNG."""
    # matplotlib's object API, not pyplot: no global figure state, and pyplot's import (about
    # a second, paid by every training run) is skipped.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    if history["train_loss"]:
        steps, losses = zip(*history["train_loss"])
        ax1.plot(steps, losses, label="train loss")
    ax1.set_xlabel("step")
    ax1.set_title("training loss")
    for key in _plotted_metrics(history["eval"]):
        pts = [(s, m[key]) for s, m in history["eval"] if _finite(m.get(key))]
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=f"eval {key}")
    ax2.set_xlabel("step")
    ax2.set_title("eval")
    if ax2.lines:
        ax2.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90, format="png")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _plotted_metrics(evals: list) -> list[str]:
    """The evaluations' metrics the curves show, in order: the ones on [0, 1] a ranking or a
    retrieval reads as "higher is better" (AUCs, a multi-task model's ``auc_<task>``, recall,
    accuracy); where there are none (a regression), every metric but the example count."""
    names = list(dict.fromkeys(k for _, m in evals for k in m if k != "num_examples"))
    bounded = [k for k in names if "auc" in k or k.startswith(("recall", "accuracy"))]
    return bounded or names
