"""Tasks of a model: what each output learns (its label, loss, weight) and how it is scored.

A single-task model (every ranker) has one implicit task: ``data.label_field`` under binary
cross-entropy, scored by ``eval.metrics``. A multi-task model names its tasks in
``task_towers``, TorchEasyRec's shape::

    task_towers:
      - tower_name: ctr
        label_name: clk
        hidden_units: [64]          # the tower's MLP (TorchEasyRec's mlp {hidden_units})
        dropout_ratio: [0.1]        # after each layer (one ratio, or one per layer; default none)
        losses: [{binary_cross_entropy: {}}]
        metrics: [auc]
        weight: 1.0
      - tower_name: cvr
        label_name: buy
        task_space_indicator_label: clk   # rows with clk > 0 weigh in_task_space_weight
        out_task_space_weight: 0.0

Losses follow TorchEasyRec's formulas (``tzrec/models/rank_model.py``): binary cross-entropy
(label smoothing ``y (1 - s) + s / 2``), binary focal loss, softmax cross-entropy over
``num_class`` classes, and L2 (the output is the prediction itself).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from dynarec.config.base import Count, DropoutRatios, MLPDropouts, Strict, exactly_one

__all__ = [
    "LOSS_KEYS",
    "BinaryCrossEntropyCfg",
    "BinaryFocalLossCfg",
    "JRCLossCfg",
    "L2LossCfg",
    "LossCfg",
    "Metric",
    "SoftmaxCrossEntropyCfg",
    "TaskTowerCfg",
    "check_task_towers",
    "label_rules",
    "session_field",
]


class BinaryCrossEntropyCfg(Strict):
    label_smoothing: float = Field(0.0, ge=0, lt=1)


class BinaryFocalLossCfg(Strict):
    gamma: float = Field(2.0, ge=0)
    alpha: float = Field(0.5, gt=0, lt=1)


class SoftmaxCrossEntropyCfg(Strict):
    label_smoothing: float = Field(0.0, ge=0, lt=1)


class L2LossCfg(Strict):
    pass


class JRCLossCfg(Strict):
    """JRC (Sheng et al., 2022: calibration and ranking together) over a task of 2 classes:
    ``alpha`` times the cross-entropy plus ``1 - alpha`` times each row's softmax against the
    rows of its session (same ``session_name`` value) of the other class, within the batch."""

    session_name: str = Field(min_length=1)  # the column whose value is a row's session (a user id)
    alpha: float = Field(0.5, ge=0, le=1)


LOSS_KEYS = ("binary_cross_entropy", "binary_focal_loss", "softmax_cross_entropy", "l2_loss", "jrc_loss")


class LossCfg(Strict):
    """Exactly one loss: ``{binary_cross_entropy: {label_smoothing: 0.1}}``."""

    binary_cross_entropy: Optional[BinaryCrossEntropyCfg] = None
    binary_focal_loss: Optional[BinaryFocalLossCfg] = None
    softmax_cross_entropy: Optional[SoftmaxCrossEntropyCfg] = None
    l2_loss: Optional[L2LossCfg] = None
    jrc_loss: Optional[JRCLossCfg] = None

    @model_validator(mode="after")
    def _one(self):
        exactly_one(self, LOSS_KEYS)
        return self

    @property
    def kind(self) -> str:
        return next(k for k in LOSS_KEYS if getattr(self, k) is not None)

    @property
    def settings(self) -> Strict:
        return getattr(self, self.kind)


# Metrics of a task: AUC, grouped AUC (by eval.grouped_auc_field) and log loss of a binary task
# (of class 1 for two classes), accuracy of a classification task, MSE and MAE of a regression.
Metric = Literal["auc", "grouped_auc", "log_loss", "accuracy", "mean_squared_error", "mean_absolute_error"]

_METRICS_OF = {
    "binary": ("auc", "grouped_auc", "log_loss", "accuracy"),
    "multiclass": ("accuracy", "auc", "grouped_auc", "log_loss"),  # AUC and log loss need 2 classes
    "regression": ("mean_squared_error", "mean_absolute_error"),
}


class TaskTowerCfg(MLPDropouts):
    """One task of a multi-task model (module doc). DBMTL's towers may also read the outputs of
    earlier towers (``relation_tower_names``) through ``relation_hidden_units``."""

    tower_name: str = Field(min_length=1)
    label_name: str = Field(min_length=1)
    hidden_units: list[Count] = Field(default_factory=list)
    dropout_ratio: DropoutRatios = Field(default_factory=list)
    losses: list[LossCfg] = Field(default_factory=lambda: [LossCfg(binary_cross_entropy=BinaryCrossEntropyCfg())])
    metrics: Optional[list[Metric]] = None  # default: auc for a classification task, MSE for L2
    num_class: Count = 1
    weight: float = Field(1.0, ge=0)
    task_space_indicator_label: Optional[str] = None
    in_task_space_weight: float = Field(1.0, ge=0)
    out_task_space_weight: float = Field(1.0, ge=0)
    relation_tower_names: list[str] = Field(default_factory=list)
    relation_hidden_units: list[Count] = Field(default_factory=list)
    relation_dropout_ratio: DropoutRatios = Field(default_factory=list)
    # The label holds bitmasks (an action's bits, say): the task's label is whether any of these
    # bits is set, ``(label & task_bitmask) > 0`` (TorchEasyRec's FusionSubTaskConfig.task_bitmask).
    task_bitmask: Optional[Count] = None

    @model_validator(mode="after")
    def _consistent(self):
        if not self.losses:
            raise ValueError(f"task '{self.tower_name}': give at least one loss")
        kinds = {loss.kind for loss in self.losses}
        if len(kinds) != len(self.losses):
            listed = [loss.kind for loss in self.losses]
            raise ValueError(f"task '{self.tower_name}': a loss is listed twice ({listed})")
        if "l2_loss" in kinds and len(kinds) > 1:
            raise ValueError(
                f"task '{self.tower_name}': l2_loss trains a regression output, which {sorted(kinds - {'l2_loss'})} "
                "cannot share"
            )
        if "jrc_loss" in kinds:
            if self.num_class != 2 or not kinds <= {"jrc_loss", "softmax_cross_entropy"}:
                raise ValueError(
                    f"task '{self.tower_name}': jrc_loss needs num_class 2 (got {self.num_class}) and no loss but "
                    "softmax_cross_entropy beside it"
                )
        elif "softmax_cross_entropy" in kinds:
            if self.num_class < 2 or len(kinds) > 1:
                raise ValueError(
                    f"task '{self.tower_name}': softmax_cross_entropy needs num_class >= 2 (got {self.num_class}) "
                    "and no other loss"
                )
        elif self.num_class != 1:
            raise ValueError(f"task '{self.tower_name}': {sorted(kinds)} need(s) num_class 1, got {self.num_class}")
        allowed = _METRICS_OF[self.kind]
        for m in self.metrics or []:
            if m not in allowed:
                raise ValueError(
                    f"task '{self.tower_name}': metric '{m}' does not score a {self.kind} task; its metrics: "
                    f"{list(allowed)}"
                )
            if m in ("auc", "grouped_auc", "log_loss") and self.num_class > 2:
                raise ValueError(
                    f"task '{self.tower_name}': metric '{m}' needs 2 classes, the task has {self.num_class}"
                )
        if self.task_bitmask is not None and self.kind != "binary" and "jrc_loss" not in kinds:
            raise ValueError(f"task '{self.tower_name}': task_bitmask makes a binary label; the task is {self.kind}")
        if self.relation_tower_names and not self.relation_hidden_units:
            raise ValueError(f"task '{self.tower_name}': relation_tower_names need relation_hidden_units")
        return self

    @property
    def kind(self) -> Literal["binary", "multiclass", "regression"]:
        """``binary`` (one logit), ``multiclass`` (``num_class`` logits) or ``regression``."""
        if self.losses[0].kind == "l2_loss":
            return "regression"
        return "multiclass" if self.num_class > 1 else "binary"

    @property
    def default_metrics(self) -> list[str]:
        return {"binary": ["auc"], "multiclass": ["accuracy"], "regression": ["mean_squared_error"]}[self.kind]

    @property
    def eval_metrics(self) -> list[str]:
        return list(self.metrics) if self.metrics is not None else self.default_metrics


def check_task_towers(towers: list[TaskTowerCfg], where: str) -> None:
    """Tower names unique; a relation names an earlier tower. ValueError naming the tower."""
    if not towers:
        raise ValueError(f"{where}.task_towers: give at least one task tower")
    seen: list[str] = []
    for i, t in enumerate(towers):
        if t.tower_name in seen:
            raise ValueError(f"{where}.task_towers[{i}]: tower_name '{t.tower_name}' is used twice")
        for r in t.relation_tower_names:
            if r not in seen:
                raise ValueError(
                    f"{where}.task_towers[{i}] ({t.tower_name}): relation tower '{r}' is not an earlier tower "
                    f"(earlier: {seen})"
                )
        seen.append(t.tower_name)
    try:
        session_field(towers)
    except ValueError as e:
        raise ValueError(f"{where}.task_towers: {e}") from None


def session_field(towers: list[TaskTowerCfg]) -> Optional[str]:
    """The session column of the tasks' JRC losses (one for all); None without one."""
    names = {loss.jrc_loss.session_name for t in towers for loss in t.losses if loss.jrc_loss is not None}
    if len(names) > 1:
        raise ValueError(f"jrc_loss: one session_name for every task, got {sorted(names)}")
    return names.pop() if names else None


def label_rules(towers: list[TaskTowerCfg]) -> dict[str, tuple[int, str]]:
    """``{label: (classes, rule)}`` for each label a classification task reads: its values must
    be class indices below ``classes`` (0 or 1 for a binary task); ``rule`` says so in an error.
    A regression label or a task-space indicator may hold any finite number (not listed); a
    bitmask label (``task_bitmask``) any integer from 0 (``classes`` 0)."""
    rules: dict[str, tuple[int, str]] = {}
    masks = {t.label_name for t in towers if t.task_bitmask is not None}
    for t in towers:
        if t.kind == "regression" or t.label_name in masks:
            continue
        classes = 2 if t.kind == "binary" else t.num_class
        rule = (
            "labels must be 0 or 1" if classes == 2 else f"task '{t.tower_name}' needs a class index in [0, {classes})"
        )
        if t.label_name not in rules or classes < rules[t.label_name][0]:
            rules[t.label_name] = (classes, rule)
    for name in masks:
        rules[name] = (0, "a bitmask label (task_bitmask) must be an integer from 0")
    return rules
