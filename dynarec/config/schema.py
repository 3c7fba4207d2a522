"""The YAML config, validated with pydantic: unknown keys are errors, and every error names the
field path (e.g. ``train.sparse_optimizer.adagrad_optimizer``).

Vocabulary follows EasyRec / TorchEasyRec where it exists: ``feature_configs`` with
``id_feature`` / ``sequence_feature`` / ``raw_feature``, ``embedding_name`` to share a table,
``num_buckets`` for a fixed table or a ``dynamicemb`` block for a dynamic one, and
``sparse_optimizer`` with ``adagrad_optimizer`` etc.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import typing
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    StrictInt,
    model_validator,
)

from dynarec.embedding.config import Backend, DynamicTableOptions, ShardingType
from dynarec.embedding.initializers import Initializer
from dynarec.features.expression import Expression
from dynarec.optim.base import OptimizerSpec
from dynarec.optim.dense import DenseOptimizerSpec, dense_spec_from_yaml, dense_spec_to_yaml
from dynarec.optim.registry import spec_from_yaml, spec_to_yaml

__all__ = [
    "TABLE_SETTINGS",
    "Config",
    "DenseOptimizer",
    "FeatureCfg",
    "IdFeatureCfg",
    "ModelCfg",
    "RawFeatureCfg",
    "SequenceFeatureCfg",
    "SparseOptimizer",
]


class Strict(BaseModel):
    # Unknown keys, and NaN or infinite numbers, are errors wherever they appear.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _exactly_one(model: BaseModel, keys) -> str:
    """The one of ``keys`` that ``model`` sets; ValueError naming them otherwise."""
    given = [k for k in keys if getattr(model, k) is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of {list(keys)} (got {given or 'none'})")
    return given[0]


# A positive integer that YAML's ``true`` does not pass for.
Count = Annotated[StrictInt, Field(gt=0)]


def _refuse_bool_numbers(cls: type, data: Any) -> Any:
    """Before pydantic validates a mapping into the dataclass ``cls`` (lax mode, which would read
    ``true`` as 1), refuses a bool given for a numeric field, in ``cls`` and its nested
    dataclasses."""
    if not isinstance(data, dict):
        return data
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        hint = hints.get(key)
        args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if isinstance(value, bool) and any(a in (int, float) for a in args):
            raise ValueError(f"{key} must be a number, got {value!r}")
        for a in args:
            if dataclasses.is_dataclass(a):
                _refuse_bool_numbers(a, value)  # type: ignore[arg-type]
    return data


def core_type(cls: type) -> Any:
    """A core dataclass (dynarec.embedding) as a YAML field: validated straight into ``cls``."""
    return Annotated[cls, BeforeValidator(lambda data: _refuse_bool_numbers(cls, data))]


if TYPE_CHECKING:
    DynamicEmbField = DynamicTableOptions
    InitializerField = Initializer
else:
    DynamicEmbField = core_type(DynamicTableOptions)
    InitializerField = core_type(Initializer)


ValueType = Literal["int", "string"]


_SIDES = ("user", "item", "context")


def _expression_column(expression: str) -> str:
    """TorchEasyRec's ``"side:column"`` (side user, item or context) -> the column."""
    side, sep, column = expression.partition(":")
    if not sep or side not in _SIDES or not column:
        raise ValueError(
            f"expression must be 'side:column' with side one of {list(_SIDES)} (a column of the input), got "
            f"{expression!r}"
        )
    return column


class _FeatureColumn(Strict):
    """A feature and the data column it reads: ``input_name`` (default ``feature_name``), or
    TorchEasyRec's ``expression: "side:column"`` (e.g. ``"user:user_id"``)."""

    feature_name: str
    input_name: Optional[str] = None
    expression: Optional[str] = None

    @model_validator(mode="after")
    def _one_column(self):
        if self.expression is not None:
            if self.input_name is not None:
                raise ValueError("give input_name or expression, not both")
            _expression_column(self.expression)
        return self

    @property
    def column(self) -> str:
        if self.expression is not None:
            return _expression_column(self.expression)
        return self.input_name or self.feature_name


class _EmbeddedFeature(_FeatureColumn):
    embedding_dim: Count
    embedding_name: Optional[str] = None  # the table; features with the same name share it
    num_buckets: Optional[Count] = None  # a fixed table of this many rows, ids used as they are ...
    hash_bucket_size: Optional[Count] = None  # ... or of this many rows, values hashed into it ...
    dynamicemb: Optional[DynamicEmbField] = None  # ... or a dynamic table (the core's own type)
    initializer: Optional[InitializerField] = None
    backend: Optional[Backend] = None  # default: train.sparse_backend
    sharding: Optional[ShardingType] = None  # default: the planner decides (multi-process runs)
    # "int": values are integer ids (integer columns, or string tokens that must be decimal
    # integers); "string": values are strings hashed with FarmHash Fingerprint64. A
    # hash_bucket_size feature always hashes (the string form of integers too).
    value_type: ValueType = "int"

    TABLE_KINDS: ClassVar[tuple[str, ...]] = ("num_buckets", "hash_bucket_size", "dynamicemb")

    @model_validator(mode="after")
    def _one_kind(self):
        given = [k for k in self.TABLE_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of {list(self.TABLE_KINDS)} (num_buckets: a fixed table, ids as they are; "
                "hash_bucket_size: a fixed table, values hashed into it; dynamicemb: a dynamic table"
                f"{'; boundaries: numbers bucketized into a fixed table' if 'boundaries' in self.TABLE_KINDS else ''}"
                f"), got {given or 'none'}"
            )
        return self

    @property
    def table_name(self) -> str:
        return self.embedding_name or self.feature_name

    @property
    def table_rows(self) -> Optional[int]:
        """Rows of the feature's fixed table (None for a dynamic one)."""
        return self.num_buckets or self.hash_bucket_size

    @property
    def hashed(self) -> bool:
        """Whether values are hashed (FarmHash Fingerprint64 of their string form)."""
        return self.hash_bucket_size is not None or self.value_type == "string"


# The settings of a feature that belong to its table: every feature of one table must give the
# same values (else the config is refused, naming both features).
TABLE_SETTINGS = (
    "embedding_dim",
    "num_buckets",
    "hash_bucket_size",
    "boundaries",
    "dynamicemb",
    "initializer",
    "backend",
    "value_type",
    "sharding",
)


class IdFeatureCfg(_EmbeddedFeature):
    """One id (or several, with ``separator``) per sample, pooled. With ``boundaries`` the
    column holds numbers, bucketized into ``len(boundaries) + 1`` rows: bucket ``i`` holds
    ``boundaries[i-1] <= x < boundaries[i]`` (TorchEasyRec's raw_feature with boundaries)."""

    pooling: Literal["sum", "mean"] = "sum"
    separator: Optional[str] = None
    boundaries: Optional[list[float]] = Field(None, min_length=1)

    TABLE_KINDS: ClassVar[tuple[str, ...]] = ("num_buckets", "hash_bucket_size", "dynamicemb", "boundaries")

    @model_validator(mode="after")
    def _sorted_boundaries(self):
        b = self.boundaries
        if b is not None and any(b[i] >= b[i + 1] for i in range(len(b) - 1)):
            raise ValueError(f"boundaries must be strictly increasing, got {b}")
        if b is not None and self.separator is not None:
            raise ValueError("boundaries bucketize one number per sample; remove separator")
        return self

    @property
    def table_rows(self) -> Optional[int]:
        return len(self.boundaries) + 1 if self.boundaries is not None else super().table_rows


class SequenceFeatureCfg(_EmbeddedFeature):
    """A behaviour history: the last ``sequence_length`` ids, one embedding each."""

    sequence_length: Count
    separator: str = "|"
    boundaries: ClassVar[None] = None


class NormalizerCfg(Strict):
    """``x -> expression(x)`` (e.g. ``"log(x+3)"``, :mod:`dynarec.features.expression`) or
    ``log1p(x)`` (when ``log1p``), then ``(x - mean) / std``."""

    expression: Optional[str] = None
    log1p: bool = False
    mean: float = 0.0
    std: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _valid_expression(self):
        if self.expression is not None:
            if self.log1p:
                raise ValueError("give expression or log1p, not both")
            Expression(self.expression)
        return self


class RawFeatureCfg(_FeatureColumn):
    """A dense float feature."""

    normalizer: Optional[NormalizerCfg] = None


class FeatureCfg(Strict):
    id_feature: Optional[IdFeatureCfg] = None
    sequence_feature: Optional[SequenceFeatureCfg] = None
    raw_feature: Optional[RawFeatureCfg] = None

    @model_validator(mode="after")
    def _one_kind(self):
        _exactly_one(self, ("id_feature", "sequence_feature", "raw_feature"))
        return self

    @property
    def feature(self) -> Union[IdFeatureCfg, SequenceFeatureCfg, RawFeatureCfg]:
        return self.id_feature or self.sequence_feature or self.raw_feature  # type: ignore[return-value]


# A sparse optimizer block, ``{adagrad_optimizer: {lr: 0.05, ...}}``: exactly one of the registered
# optimizers' YAML keys (dynarec.optim.registry), validated straight into its spec.
SparseOptimizer = Annotated[
    OptimizerSpec,
    PlainValidator(lambda block: spec_from_yaml(block, where="")),
    PlainSerializer(spec_to_yaml, return_type=dict),
]

# A dense optimizer block, ``{adam_optimizer: {lr: 0.002}}`` (dynarec.optim.dense).
DenseOptimizer = Annotated[
    DenseOptimizerSpec,
    PlainValidator(lambda block: dense_spec_from_yaml(block, where="")),
    PlainSerializer(dense_spec_to_yaml, return_type=dict),
]


class LRScheduleCfg(Strict):
    """The learning rate as a function of the training step ``k`` (0 for the first step), given
    the optimizer's ``lr`` (``base``); TorchEasyRec's schedules, stepped every step.

    ``constant``: ``base``. ``warmup``: ``base * min(1, (k + 1) / warmup_steps)``, then
    ``exponential_decay``'s factor when ``decay_steps`` is given. ``exponential_decay``: for
    ``k < warmup_steps`` linear from ``warmup_learning_rate`` to ``base``; then
    ``max(base * decay_rate ** p, min_learning_rate)`` with ``p = (k - warmup_steps) /
    decay_steps``, floored when ``staircase``. ``manual_step``: ``learning_rates[j]`` once ``k``
    passes ``schedule_steps[j]`` (``k > schedule_steps[j]``); before the first, ``base`` (or,
    with ``warmup``, linear from ``base`` to ``learning_rates[0]``).
    """

    kind: Literal["constant", "exponential_decay", "warmup", "manual_step"] = "constant"
    decay_steps: Optional[Count] = None
    decay_rate: float = Field(1.0, gt=0)
    staircase: bool = False
    min_learning_rate: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    warmup_learning_rate: float = Field(0.0, ge=0)
    schedule_steps: list[Count] = []
    learning_rates: list[Annotated[float, Field(ge=0)]] = []
    warmup: bool = False

    @model_validator(mode="after")
    def _needs(self):
        if self.kind == "exponential_decay" and self.decay_steps is None:
            raise ValueError("exponential_decay needs decay_steps")
        if self.kind == "warmup" and self.warmup_steps == 0:
            raise ValueError("warmup needs warmup_steps > 0")
        if self.kind == "manual_step":
            if not self.schedule_steps or len(self.schedule_steps) != len(self.learning_rates):
                raise ValueError("manual_step needs schedule_steps and learning_rates of one length (at least 1)")
            if any(a >= b for a, b in zip(self.schedule_steps, self.schedule_steps[1:])):
                raise ValueError(f"manual_step: schedule_steps must increase, got {self.schedule_steps}")
        elif self.schedule_steps or self.learning_rates or self.warmup:
            raise ValueError("schedule_steps, learning_rates and warmup belong to kind manual_step")
        return self

    def learning_rate(self, step: int, base: float) -> float:
        """The learning rate of step ``step`` (0-based) for an optimizer of ``lr`` ``base``."""
        k = step
        if self.kind == "constant":
            return base
        if self.kind == "warmup":
            f = min(1.0, (k + 1) / self.warmup_steps)
            if self.decay_steps:
                f *= self.decay_rate ** (max(k - self.warmup_steps, 0) / self.decay_steps)
            return base * f
        if self.kind == "exponential_decay":
            assert self.decay_steps is not None
            if k < self.warmup_steps:
                return self.warmup_learning_rate + (base - self.warmup_learning_rate) * k / self.warmup_steps
            p = (k - self.warmup_steps) / self.decay_steps
            if self.staircase:
                p = math.floor(p)
            return max(base * self.decay_rate**p, self.min_learning_rate)
        j = bisect.bisect_left(self.schedule_steps, k)
        if j > 0:
            return self.learning_rates[j - 1]
        if self.warmup:
            return base + (self.learning_rates[0] - base) * k / self.schedule_steps[0]
        return base


class FeatureGroupCfg(Strict):
    group_name: str
    feature_names: list[str] = Field(min_length=1)
    group_type: Literal["deep", "sequence", "wide"] = "deep"


# An MLP's activation: ReLU, or Dice (DIN's data-adaptive activation: a batch-normalized gate
# between x and alpha * x, alpha learned per unit; in eval it uses the running statistics).
Activation = Literal["relu", "dice"]


class TowerCfg(Strict):
    input: str
    hidden_units: list[Count] = Field(min_length=1)
    activation: Activation = "relu"


class DinTowerCfg(Strict):
    input: str
    attn_hidden_units: list[Count] = [64, 32]
    pooling: Literal["attention", "mean"] = "attention"  # "mean": the no-attention baseline
    activation: Activation = "relu"  # of the attention MLP


class MultiTowerDINCfg(Strict):
    towers: list[TowerCfg] = []
    din_towers: list[DinTowerCfg] = []
    final_hidden_units: list[Count] = [64]
    final_activation: Activation = "relu"


class DINCfg(Strict):
    din_tower: DinTowerCfg
    deep_hidden_units: list[Count] = [128, 64]


class DeepFMCfg(Strict):
    """First order over the ``wide`` groups (every group when there is none), FM over
    ``fm_group``'s id features (default: every other group's), an MLP over the groups that are
    neither wide nor ``fm_group``; ``final_hidden_units``: an MLP over [first order, FM, deep]."""

    deep_hidden_units: list[Count] = [128, 64]
    final_hidden_units: list[Count] = []
    fm_group: Optional[str] = None


class WideAndDeepCfg(Strict):
    deep_hidden_units: list[Count] = [128, 64]
    final_hidden_units: list[Count] = []  # an MLP over [wide logit, deep MLP] before the output


class DLRMCfg(Strict):
    bottom_hidden_units: list[Count] = [64]
    top_hidden_units: list[Count] = [64, 32]
    arch_with_sparse: bool = False  # the top MLP also reads the embeddings themselves


MODEL_KEYS = ("multi_tower_din", "din", "deepfm", "wide_and_deep", "dlrm")


class ModelCfg(Strict):
    feature_groups: list[FeatureGroupCfg] = Field(min_length=1)
    multi_tower_din: Optional[MultiTowerDINCfg] = None
    din: Optional[DINCfg] = None
    deepfm: Optional[DeepFMCfg] = None
    wide_and_deep: Optional[WideAndDeepCfg] = None
    dlrm: Optional[DLRMCfg] = None

    @model_validator(mode="after")
    def _one_model(self):
        name = _exactly_one(self, MODEL_KEYS)
        names = [g.group_name for g in self.feature_groups]
        if len(set(names)) != len(names):
            raise ValueError(f"feature_groups: duplicate group_name in {names}")
        for i, g in enumerate(self.feature_groups):
            twice = sorted({n for n in g.feature_names if g.feature_names.count(n) > 1})
            if twice:
                raise ValueError(f"feature_groups[{i}] ({g.group_name}): feature(s) {twice} listed twice")
        kinds = {g.group_name: g.group_type for g in self.feature_groups}
        for where, group, wanted in self._tower_inputs(name):
            if group not in kinds:
                raise ValueError(f"{where}: input '{group}' names no feature group; groups: {sorted(kinds)}")
            if (kinds[group] == "sequence") != (wanted == "sequence"):
                raise ValueError(
                    f"{where}: input '{group}' is a '{kinds[group]}' group; this tower needs a "
                    f"{'sequence' if wanted == 'sequence' else 'deep'} group"
                )
        return self

    def _tower_inputs(self, name: str) -> list[tuple[str, str, str]]:
        """``(config path, group name, 'deep' | 'sequence')`` of every tower input of the model."""
        if name == "multi_tower_din":
            cfg = self.multi_tower_din
            assert cfg is not None
            if not cfg.towers and not cfg.din_towers:
                raise ValueError("multi_tower_din: give at least one of towers or din_towers")
            return [(f"multi_tower_din.towers[{i}]", t.input, "deep") for i, t in enumerate(cfg.towers)] + [
                (f"multi_tower_din.din_towers[{i}]", t.input, "sequence") for i, t in enumerate(cfg.din_towers)
            ]
        if name == "din":
            assert self.din is not None
            return [("din.din_tower", self.din.din_tower.input, "sequence")]
        if name == "deepfm" and self.deepfm is not None and self.deepfm.fm_group is not None:
            return [("deepfm.fm_group", self.deepfm.fm_group, "deep")]
        return []

    @property
    def name(self) -> str:
        return next(k for k in MODEL_KEYS if getattr(self, k) is not None)

    def group(self, name: str) -> FeatureGroupCfg:
        for g in self.feature_groups:
            if g.group_name == name:
                return g
        raise KeyError(name)


class DataCfg(Strict):
    train_input_path: Union[str, list[str]]
    eval_input_path: Union[str, list[str], None] = None
    label_field: str = "label"
    batch_size: Count = 1024
    eval_batch_size: Optional[Count] = None
    # DataLoader workers building batches; None: automatic (0 on a CPU device, where they would
    # compete with the step for the cores; on a GPU as many as the host spares, up to 8).
    num_workers: Optional[int] = Field(None, ge=0)
    # Keep the first whole epoch's built batches in memory: later epochs train on them instead
    # of reading and building the files again (the same batches; memory: every batch's tensors).
    cache_batches: bool = False
    input_type: Optional[Literal["parquet", "csv"]] = None  # default: from the file extension


class GradientClippingCfg(Strict):
    max_norm: float = Field(1.0, gt=0)
    norm_type: float = Field(2.0, gt=0)


class TrainCfg(Strict):
    sparse_optimizer: SparseOptimizer
    table_optimizers: dict[str, SparseOptimizer] = {}  # per-table overrides, by table name
    dense_optimizer: DenseOptimizer = Field(default_factory=lambda: dense_spec_from_yaml({"adam_optimizer": {}}, ""))
    sparse_lr_schedule: LRScheduleCfg = LRScheduleCfg()
    dense_lr_schedule: LRScheduleCfg = LRScheduleCfg()
    sparse_backend: Backend = "native"
    num_epochs: Optional[Count] = None  # passes over the training data (default 1) ...
    num_steps: Optional[Count] = None  # ... or exactly this many steps, cycling the data as needed
    save_checkpoints_steps: Optional[Count] = None
    save_checkpoints_epochs: Optional[Count] = None  # also a checkpoint after every this many epochs
    keep_checkpoints: Count = 3
    # The dense model's forward in bfloat16 (torch.autocast; the tables and the loss stay float32).
    # No loss scaling is needed for bfloat16, and none could be: the tables' fused update runs
    # inside backward, where a scaled loss would scale their gradients.
    mixed_precision: Optional[Literal["bf16"]] = None
    # The dense parameters' gradient norm clipped to max_norm before the dense optimizer's step
    # (torch.nn.utils.clip_grad_norm_); the tables' fused updates take their gradients as they are.
    gradient_clipping: Optional[GradientClippingCfg] = None
    # The dense optimizer steps every this many steps on the sum of their gradients, each step's
    # loss divided by it; the tables' fused updates run every step (TorchEasyRec's rule).
    gradient_accumulation_steps: Count = 1
    log_step_count_steps: Count = 50
    eval_every_steps: Optional[Count] = None
    seed: int = 0
    # A step whose loss is NaN or infinite writes nothing: 'error' stops training naming the step;
    # 'skip_batch' skips the batch (it does not count as a step) and reports how many were skipped.
    nan_policy: Literal["error", "skip_batch"] = "error"
    # Bytes a rank's tables may take at their largest ("80GiB", or an integer); default: the memory
    # available on the rank's device. A plan that does not fit is an error naming the table.
    memory_budget_per_rank: Optional[ByteSize] = None
    # Seconds a rank waits in a collective of a multi-process run before it gives up, naming what
    # it waited for.
    collective_timeout_seconds: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _steps_or_epochs(self):
        if self.num_epochs is not None and self.num_steps is not None:
            raise ValueError("give one of num_epochs or num_steps, not both")
        return self

    @property
    def epochs(self) -> int:
        return self.num_epochs or 1


class EvalCfg(Strict):
    metrics: list[Literal["auc", "grouped_auc", "log_loss"]] = ["auc", "grouped_auc", "log_loss"]
    grouped_auc_field: Optional[str] = None  # the column to group by; default the first id feature's
    max_steps: Optional[Count] = None


class ExportCfg(Strict):
    pass


class Config(Strict):
    feature_configs: list[FeatureCfg] = Field(min_length=1)
    model: ModelCfg
    data: DataCfg
    train: TrainCfg
    eval: EvalCfg = EvalCfg()
    export: ExportCfg = ExportCfg()

    @model_validator(mode="after")
    def _cross_references(self):
        names = [f.feature.feature_name for f in self.feature_configs]
        seen: set[str] = set()
        for i, n in enumerate(names):
            if n in seen:
                raise ValueError(f"feature_configs[{i}]: feature_name '{n}' is defined twice")
            seen.add(n)
        tables: dict[str, _EmbeddedFeature] = {}
        for i, f in enumerate(self.feature_configs):
            feat = f.feature
            if isinstance(feat, RawFeatureCfg):
                continue
            other = tables.setdefault(feat.table_name, feat)
            if other is not feat:
                for attr in TABLE_SETTINGS:
                    if getattr(other, attr) != getattr(feat, attr):
                        raise ValueError(
                            f"feature_configs[{i}] ({feat.feature_name}): shares table "
                            f"'{feat.table_name}' with '{other.feature_name}' but its {attr} differs "
                            f"({other.feature_name}: {getattr(other, attr)!r}, "
                            f"{feat.feature_name}: {getattr(feat, attr)!r}); give both features the same {attr}"
                        )
        for gi, g in enumerate(self.model.feature_groups):
            for fi, n in enumerate(g.feature_names):
                if n not in seen:
                    raise ValueError(f"model.feature_groups[{gi}].feature_names[{fi}]: unknown feature '{n}'")
            if g.group_type == "sequence":
                seqs = {
                    n: self.feature(n).sequence_length
                    for n in g.feature_names
                    if isinstance(self.feature(n), SequenceFeatureCfg)
                }
                if len(set(seqs.values())) > 1:
                    raise ValueError(
                        f"model.feature_groups[{gi}] ({g.group_name}): its sequence features are "
                        f"concatenated position by position and need one sequence_length, got {seqs}"
                    )
        for name in self.train.table_optimizers:
            if name not in tables:
                raise ValueError(f"train.table_optimizers: unknown table '{name}'; tables: {sorted(tables)}")
        return self

    def features(self) -> list[Union[IdFeatureCfg, SequenceFeatureCfg, RawFeatureCfg]]:
        return [f.feature for f in self.feature_configs]

    def feature(self, name: str):
        for f in self.features():
            if f.feature_name == name:
                return f
        raise KeyError(name)
