"""A model's tasks at run time: its logits split per task, each task's loss, predictions and
metrics (the configs are :mod:`dynarec.config.tasks`).

A model returns logits ``[B]`` (one binary task) or ``[B, K]`` with ``K`` the sum of its tasks'
``num_class``, in task order. Labels reach the loss as ``[B, L]`` float32, one column per
``Config.label_fields()`` entry.

The loss of a step is ``sum_t weight_t * sum_i w_ti * l_ti / W_t`` over the global batch:
``l_ti`` is row ``i``'s loss of task ``t`` (the sum of the task's losses), ``w_ti`` its
task-space weight (1 without an indicator label) and ``W_t = sum_i w_ti`` over every rank's rows
(TorchEasyRec divides the weights by their mean: the same, and 0 when they are all 0). Without
an indicator ``W_t`` is the global row count: each rank's loss is its share of the global mean,
the rule every gradient here follows.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, TypeVar, Union

import numpy as np
import torch
from torch.nn import functional as F

from dynarec.config.schema import RETRIEVAL_KEYS, Config
from dynarec.config.sid import SID_KEYS
from dynarec.config.tasks import TaskTowerCfg
from dynarec.metrics import accuracy, auc, grouped_auc, log_loss, mean_absolute_error, mean_squared_error
from dynarec.models.features import feature_input
from dynarec.models.retrieval import Retrieval
from dynarec.models.semantic_ids import SemanticIds

__all__ = ["Tasks", "Teaching", "check_predictions", "no_logits", "task_loss", "tasks_of"]

Labels = TypeVar("Labels", torch.Tensor, np.ndarray)


@dataclass
class Teaching:
    """What a teacher net's training forward leaves for the step's loss (RocketLaunching's
    ``model.teaching``): the booster's logits ``[B]`` (trained by the task's own losses) and the
    distillation's row terms ``[B]`` and batch term (a scalar)."""

    booster_logits: torch.Tensor
    rows: torch.Tensor
    batch: torch.Tensor


def _segment_logsumexp(values: torch.Tensor, member: torch.Tensor, segment: torch.Tensor, count: int) -> torch.Tensor:
    """``[count]``: the log-sum-exp of ``values`` over the rows of each segment where ``member``
    holds; ``-inf`` for a segment without such rows (its gradient 0, not NaN)."""
    v = values.masked_fill(~member, float("-inf"))
    top = values.new_full((count,), float("-inf")).scatter_reduce(0, segment, v, "amax")
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()
    sums = values.new_zeros(count).scatter_add(0, segment, torch.exp(v - top[segment]))
    return torch.where(sums > 0, torch.log(sums.clamp_min(torch.finfo(sums.dtype).tiny)) + top, top - float("inf"))


def jrc_rows(logits: torch.Tensor, label: torch.Tensor, sessions: torch.Tensor, alpha: float) -> torch.Tensor:
    """Row losses ``[B]`` of JRC (TorchEasyRec's ``JRCLoss``, Sheng et al. 2022): ``alpha`` times
    the cross-entropy of ``logits [B, 2]`` plus ``1 - alpha`` times the row's softmax against the
    rows of its session of the other class, on the row's own class's logit: a positive ``i``'s
    ``-log(e^{z1_i} / (e^{z1_i} + sum_{negatives j of i's session} e^{z1_j}))``, a negative's the
    same on ``z0`` against the positives. Their mean over the batch is TorchEasyRec's loss."""
    y = label.long()
    ce = F.cross_entropy(logits, y, reduction="none")
    unique, segment = torch.unique(sessions, return_inverse=True)
    count = unique.numel()
    positive = y == 1
    own = torch.where(positive, logits[:, 1], logits[:, 0])
    # A positive competes on z1 with its session's negatives; a negative on z0 with its positives.
    against_positives = _segment_logsumexp(logits[:, 1], ~positive, segment, count)
    against_negatives = _segment_logsumexp(logits[:, 0], positive, segment, count)
    others = torch.where(positive, against_positives[segment], against_negatives[segment])
    session = F.softplus(others - own)  # log(e^own + e^others) - own; 0 with no competitor
    return alpha * ce + (1 - alpha) * session


def task_loss(
    tower: TaskTowerCfg, logits: torch.Tensor, label: torch.Tensor, sessions: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Row losses ``[B]`` of ``tower``, summed over its losses (TorchEasyRec's formulas).

    ``logits``: ``[B]`` (binary / regression) or ``[B, num_class]``; ``label``: ``[B]`` float32
    (a class index for softmax cross-entropy); ``sessions``: ``[B]`` int64 session ids (JRC)."""
    total: Optional[torch.Tensor] = None
    for loss in tower.losses:
        s: Any = loss.settings
        if loss.kind == "jrc_loss":
            if sessions is None:
                raise ValueError(f"task '{tower.tower_name}': jrc_loss needs the batch's session ids")
            rows = jrc_rows(logits, label, sessions, s.alpha)
        elif loss.kind == "binary_cross_entropy":
            target = label * (1.0 - s.label_smoothing) + 0.5 * s.label_smoothing if s.label_smoothing else label
            rows = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        elif loss.kind == "binary_focal_loss":
            p = torch.sigmoid(logits)
            weight = s.alpha * label * (1 - p) ** s.gamma + (1 - s.alpha) * (1 - label) * p**s.gamma
            rows = F.binary_cross_entropy_with_logits(logits, label, weight=weight.detach(), reduction="none")
        elif loss.kind == "softmax_cross_entropy":
            rows = F.cross_entropy(logits, label.long(), label_smoothing=s.label_smoothing, reduction="none")
        else:  # l2_loss
            rows = (logits - label) ** 2
        total = rows if total is None else total + rows  # (no zeros to add to: two ops fewer a step)
    return torch.zeros_like(label) if total is None else total


def _columns(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as ``[B, outputs]`` (``[B]``: one output a row; no rows is no error)."""
    return logits[:, None] if logits.dim() == 1 else logits.flatten(1)


class Tasks:
    """The tasks of ``config`` (``Config.tasks()``); names outputs and metrics (a single-task
    model's carry no suffix: ``probability``, ``auc``; a multi-task model's end in ``_<tower>``:
    ``probs_ctr``, ``auc_ctr``; a regression task's output is ``y_<tower>``)."""

    def __init__(self, config: Config):
        self.towers = config.tasks()
        self.multi = bool(config.model.task_towers)
        self.labels = config.label_fields()
        self.widths = [t.num_class for t in self.towers]
        self.width = sum(self.widths)
        self._label = [self.labels.index(t.label_name) for t in self.towers]
        self._indicator = [
            None if t.task_space_indicator_label is None else self.labels.index(t.task_space_indicator_label)
            for t in self.towers
        ]
        # PEPNet's domains: several towers a task, a row's loss and metrics reading its domain's
        pepnet = config.model.pepnet
        self.domains = pepnet.domains if pepnet is not None else 1
        self.domain_label = pepnet.domain_label if self.domains > 1 and pepnet is not None else None
        self._domain = self.labels.index(self.domain_label) if self.domain_label is not None else None

    def choose(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``[B, width]``: each row's own domain's towers out of the model's ``[B, width * domains]``
        (each task's ``domains`` towers side by side); the logits as they are with one domain."""
        if self._domain is None:
            return logits
        rows = logits.shape[0]
        cols = logits.reshape(rows, -1)
        if cols.shape[1] != self.width * self.domains:
            raise ValueError(
                f"the model gave {cols.shape[1]} outputs a row, its tasks need {self.width * self.domains}"
            )
        domain = labels[:, self._domain]
        bad = (domain < 0) | (domain >= self.domains) | (domain != domain.round())
        if bool(bad.any()):
            value = float(domain[bad][0])
            raise ValueError(
                f"label '{self.domain_label}' (model.pepnet.domain_label) is {value:g} in a row: a domain is an "
                f"integer in [0, {self.domains}) (task_domain_num)"
            )
        heads = torch.stack(self._by_domain(cols), dim=1)  # [B, domains, width]
        return heads.gather(1, domain.long()[:, None, None].expand(-1, 1, self.width)).squeeze(1)

    def split(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """Each task's logits: ``[B]`` for one output, ``[B, num_class]`` otherwise."""
        cols = _columns(logits)
        if cols.shape[1] != self.width:
            raise ValueError(f"the model gave {cols.shape[1]} outputs a row, its tasks need {self.width}")
        parts = torch.split(cols, self.widths, dim=1)
        return [p.squeeze(1) if w == 1 else p for p, w in zip(parts, self.widths)]

    def label(self, k: int, labels: Labels) -> Labels:
        """Task ``k``'s label column of ``labels [N, L]`` (torch or numpy): with a
        ``task_bitmask``, whether any of its bits is set in the column's bitmask (0. or 1.)."""
        y = labels[:, self._label[k]]
        mask = self.towers[k].task_bitmask
        if mask is None:
            return y
        if isinstance(y, torch.Tensor):
            return ((y.long() & mask) > 0).to(y.dtype)
        return ((y.astype(np.int64) & mask) > 0).astype(y.dtype)

    def sample_weights(self, labels: torch.Tensor) -> list[Optional[torch.Tensor]]:
        """Each task's row weights ``[B]`` from its task-space indicator (None without one)."""
        out: list[Optional[torch.Tensor]] = []
        for t, i in zip(self.towers, self._indicator):
            if i is None:
                out.append(None)
                continue
            inside = (labels[:, i] > 0).to(labels.dtype)
            out.append(t.in_task_space_weight * inside + t.out_task_space_weight * (1 - inside))
        return out

    def loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        global_rows: Union[int, torch.Tensor],
        global_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        sessions: Optional[torch.Tensor] = None,
        teaching: Optional[Teaching] = None,
        hard_negative_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """This rank's share of the step's loss (module doc). ``labels``: ``[B, L]``;
        ``global_sum`` sums a tensor over the ranks (None: one process); ``sessions`` ``[B]``:
        the JRC losses' session ids (a session's rows compete within this rank's batch);
        ``teaching``: a teacher net's part (RocketLaunching): its logits under the same tasks'
        losses, its row terms as the rows' share, its batch term as it is. ``hard_negative_rows``:
        a retrieval task's (a ranking batch has none)."""
        assert hard_negative_rows is None, "a ranking batch has no hard negatives"
        loss = self._loss(logits, labels, global_rows, global_sum, sessions)
        if teaching is not None:
            loss = loss + self._loss(teaching.booster_logits, labels, global_rows, global_sum, sessions)
            loss = loss + teaching.rows.sum() / global_rows + teaching.batch
        return loss

    def _loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        global_rows: Union[int, torch.Tensor],
        global_sum: Optional[Callable[[torch.Tensor], torch.Tensor]],
        sessions: Optional[torch.Tensor],
    ) -> torch.Tensor:
        logits = self.choose(logits, labels)
        weights = self.sample_weights(labels)
        if any(w is not None for w in weights):
            local = torch.stack([w.sum() if w is not None else logits.new_tensor(0.0) for w in weights])
            totals = global_sum(local) if global_sum is not None else local
        loss: Optional[torch.Tensor] = None
        for k, (t, z, w) in enumerate(zip(self.towers, self.split(logits), weights)):
            rows = task_loss(t, z.float(), self.label(k, labels), sessions)
            # (a task weight of 1 multiplies nothing: an op fewer a step, forward and back)
            if w is None:
                part = rows.sum()
                part = (part if t.weight == 1.0 else t.weight * part) / global_rows
            else:  # weights divided by their (global) mean, TorchEasyRec's div_no_nan
                total = totals[k]
                part = (w * rows).sum() / total.clamp_min(torch.finfo(total.dtype).tiny)
                part = torch.where(total > 0, part, torch.zeros_like(part))
                part = part if t.weight == 1.0 else t.weight * part
            loss = part if loss is None else loss + part
        return logits.new_zeros(()) if loss is None else loss

    # -- predictions ---------------------------------------------------------------------------

    def output_names(self) -> list[str]:
        """The prediction columns, in task order (PEPNet's domains: each task's per domain,
        ``probs_<task>_<domain>``)."""
        return [name for t in self.towers for name in self._domain_names(t)]

    def _domain_names(self, t: TaskTowerCfg) -> list[str]:
        name = self._output_name(t)
        return [name] if self._domain is None else [f"{name}_{d}" for d in range(self.domains)]

    @property
    def logits_width(self) -> int:
        """The numbers a row of the model's output holds: every task's classes, for each domain."""
        return self.width * self.domains

    def served_names(self) -> list[str]:
        """What an export serves: :meth:`output_names`."""
        return self.output_names()

    def served(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """What an export serves for each row: :meth:`predictions`."""
        return self.predictions(logits)

    def _output_name(self, t: TaskTowerCfg) -> str:
        if not self.multi:
            return "probability"
        return f"{'y' if t.kind == 'regression' else 'probs'}_{t.tower_name}"

    def predictions(
        self, logits: torch.Tensor, rows: Optional[int] = None, hard_negative_rows: Optional[torch.Tensor] = None
    ) -> dict[str, torch.Tensor]:
        """Output name -> ``[B]`` probability (binary), ``[B, C]`` class probabilities
        (multiclass) or ``[B]`` prediction (regression), float32 (``rows``, ``hard_negative_rows``:
        what a retrieval task needs of the batch; here the rows are the logits')."""
        out = {}
        logits = logits.float()
        heads = [logits] if self._domain is None else self._by_domain(logits)
        for d, head in enumerate(heads):
            for t, z in zip(self.towers, self.split(head)):
                name = self._domain_names(t)[d]
                if t.kind == "binary":
                    out[name] = torch.sigmoid(z)
                elif t.kind == "multiclass":
                    out[name] = torch.softmax(z, dim=1)
                else:
                    out[name] = z
        return {name: out[name] for name in self.output_names()}

    def _by_domain(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """The model's ``[B, width * domains]`` as one ``[B, width]`` per domain."""
        cols = _columns(logits)
        blocks = torch.split(cols, [w * self.domains for w in self.widths], dim=1)
        return [
            torch.cat([b.reshape(b.shape[0], self.domains, w)[:, d] for b, w in zip(blocks, self.widths)], dim=1)
            for d in range(self.domains)
        ]

    # -- metrics --------------------------------------------------------------------------------

    def metrics(
        self, predictions: dict[str, np.ndarray], labels: np.ndarray, groups: Optional[np.ndarray]
    ) -> dict[str, float]:
        """Every task's metrics over ``predictions`` (as :meth:`predictions`, over all rows) and
        ``labels`` ``[N, L]``; grouped AUC only where ``groups`` is given. A multi-task model's
        names end in ``_<tower>``."""
        out: dict[str, float] = {}
        for k, t in enumerate(self.towers):
            pred, y = self._own_domain(t, predictions, labels), self.label(k, labels)
            for m in t.eval_metrics:
                value = _metric(m, t, pred, y, groups)
                if value is not None:
                    out[m if not self.multi else f"{m}_{t.tower_name}"] = value
                    if m in ("auc", "grouped_auc") and math.isnan(value):
                        warnings.warn(_undefined_auc(m, t, y), stacklevel=2)
        return out

    def _own_domain(self, t: TaskTowerCfg, predictions: dict[str, np.ndarray], labels: np.ndarray) -> np.ndarray:
        """Task ``t``'s predictions, each row's of its own domain (PEPNet's domains)."""
        names = self._domain_names(t)
        if self._domain is None:
            return predictions[names[0]]
        stacked = np.stack([predictions[n] for n in names], axis=1)  # [N, domains(, C)]
        return stacked[np.arange(len(stacked)), labels[:, self._domain].astype(np.int64)]


def _undefined_auc(name: str, t: TaskTowerCfg, y: np.ndarray) -> str:
    """Why ``name`` of task ``t`` over the labels ``y`` is NaN: the rows (for grouped AUC: every
    group's) hold one class only."""
    labels = np.asarray(y).astype(bool)
    positives = int(labels.sum())
    if name == "auc":
        why = f"its {len(labels):,} labels are all {1 if positives else 0}"
    else:
        why = f"no group holds both labels ({positives:,} positive of {len(labels):,} rows)"
    return f"eval: {name} of task '{t.tower_name}' (label '{t.label_name}') is undefined (NaN): {why}"


def _metric(
    name: str, t: TaskTowerCfg, pred: np.ndarray, y: np.ndarray, groups: Optional[np.ndarray]
) -> Optional[float]:
    if name == "mean_squared_error":
        return mean_squared_error(pred, y)
    if name == "mean_absolute_error":
        return mean_absolute_error(pred, y)
    if name == "accuracy":
        if t.kind == "binary":
            return accuracy(np.stack([1 - pred, pred], axis=1), y)
        return accuracy(pred, y)
    positive = pred[:, 1] if pred.ndim == 2 else pred  # two classes: class 1's probability
    if name == "auc":
        return auc(positive, y)
    if name == "log_loss":
        return log_loss(positive, y)
    if name == "grouped_auc":
        return grouped_auc(positive, y, groups) if groups is not None else None
    raise ValueError(f"unknown metric '{name}'")


def check_predictions(predictions: dict[str, np.ndarray], check: Callable[[np.ndarray, str], None]) -> None:
    """``check(scores [N], what)`` (the dataset's ``check_scores``: an error naming the file and
    row of the first score that is not finite) over each output; a row of class probabilities
    ``[N, C]`` counts as one score (its sum)."""
    for name, x in predictions.items():
        check(x if x.ndim == 1 else x.sum(axis=1), f"prediction '{name}'")


def tasks_of(config: Config, world_size: int = 1) -> Union[Tasks, Retrieval, SemanticIds]:
    """The run-time task of ``config``'s model: :class:`Tasks` of a ranking model, the
    :class:`~dynarec.models.retrieval.Retrieval` task of a retrieval model (trained by
    ``world_size`` processes), or the :class:`~dynarec.models.semantic_ids.SemanticIds` task of a
    semantic-ID model."""
    if config.model.name in RETRIEVAL_KEYS:
        return Retrieval(config, world_size)
    if config.model.name in SID_KEYS:
        group = config.model.group(config.model.sid_input)
        return SemanticIds(config, sum(feature_input(config, n).width for n in group.feature_names))
    return Tasks(config)


def no_logits(tasks: Union[Tasks, Retrieval, SemanticIds]) -> torch.Tensor:
    """A model output of no rows for ``tasks`` (``[0, logits_width]`` float32, on the CPU): its
    predictions are each output's no rows, in the output's own shape and type."""
    return torch.zeros(0, tasks.logits_width)
