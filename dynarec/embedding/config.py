"""Typed table and feature configs: the one definition of every table setting.

These dataclasses are the vocabulary of the whole project. The YAML layer validates its
``dynamicemb``, ``initializer`` and ``admission`` blocks straight into them (pydantic validates
stdlib dataclasses; ``__pydantic_config__`` forbids unknown keys), and the planner passes the
objects through to :class:`TableConfig` — no field is ever copied by hand, so none can be
dropped on the way.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional, Union, get_args

from dynarec.embedding.initializers import Initializer
from dynarec.optim.base import OptimizerSpec

__all__ = [
    "BACKENDS",
    "CHECK_MODES",
    "POOLINGS",
    "ROW_DTYPE_NAMES",
    "SCORE_STRATEGIES",
    "SHARDING_TYPES",
    "AdmissionConfig",
    "Backend",
    "CheckMode",
    "DynamicTableOptions",
    "FeatureConfig",
    "Pooling",
    "RowDtype",
    "ScoreStrategy",
    "ShardingType",
    "TableConfig",
    "cache_rows_of",
    "check_count",
    "check_fbgemm_dim",
]

Pooling = Literal["sum", "mean", "none"]  # "none": a sequence feature, one embedding per id
Backend = Literal["native", "fbgemm"]
RowDtype = Literal["fp32", "fp16", "bf16"]  # a table's weight storage (its optimizer states stay fp32)
ScoreStrategy = Literal["step", "timestamp", "lfu", "none"]
CheckMode = Literal["error", "warn", "ignore"]
# How a multi-process run spreads a table over its ranks (dynarec.planner.sharding).
ShardingType = Literal["data_parallel", "table_wise", "row_wise", "key_hash"]

POOLINGS: tuple[str, ...] = get_args(Pooling)
BACKENDS: tuple[str, ...] = get_args(Backend)
ROW_DTYPE_NAMES: tuple[str, ...] = get_args(RowDtype)
SCORE_STRATEGIES: tuple[str, ...] = get_args(ScoreStrategy)
CHECK_MODES: tuple[str, ...] = get_args(CheckMode)
SHARDING_TYPES: tuple[str, ...] = get_args(ShardingType)

_FORBID = {"extra": "forbid"}  # pydantic's config for these dataclasses: unknown keys are errors


def check_fbgemm_dim(where: str, dim: int) -> None:
    """ValueError naming ``where`` for a dim FBGEMM's TBE cannot hold (not a multiple of 4)."""
    if dim % 4:
        raise ValueError(
            f"{where}: backend 'fbgemm' needs an embedding dim that is a multiple of 4 (FBGEMM's TBE), got {dim}; "
            "use backend='native' or another dim"
        )


def check_count(where: str, name: str, value: object, minimum: int = 1, maximum: Optional[int] = None) -> None:
    """ValueError naming ``where`` and ``name`` unless ``value`` is an int (not a bool) in
    ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{where}: {name} must be {bound}, got {value!r}")


@dataclass(frozen=True)
class FeatureConfig:
    """A feature served by a table. ``pooling`` None takes the table's default pooling."""

    name: str
    pooling: Optional[Pooling] = None

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ValueError(f"feature '{self.name}': pooling must be one of {POOLINGS}, got {self.pooling!r}")


@dataclass(frozen=True)
class AdmissionConfig:
    """A key gets a row only once it was seen ``threshold`` times in training batches.

    Counts live in a bounded counter of ``capacity`` keys (default: the table's ``max_capacity``)
    that evicts its lowest counts when full. Until admitted a key reads ``initializer``
    (default: the table's eval initializer) and gets no update.
    """

    threshold: int
    capacity: Optional[int] = None
    initializer: Optional[Initializer] = None

    __pydantic_config__: ClassVar[dict] = _FORBID

    def __post_init__(self) -> None:
        check_count("admission", "threshold", self.threshold)
        if self.capacity is not None:
            check_count("admission", "capacity", self.capacity)


@dataclass(frozen=True)
class DynamicTableOptions:
    """A dynamic table's capacity and row lifecycle (the YAML ``dynamicemb`` block).

    Args:
        max_capacity: the most rows the table ever holds (a promise: below 90% of it, keys are
            not evicted; see docs/dynamic_tables.md). Sharded over ``N`` ranks, each shard holds
            ``max_capacity / N`` rounded up to whole buckets, so together up to ``N - 1``
            buckets more.
        init_capacity: rows allocated at the start (default ``max_capacity``); the table grows by
            doubling up to ``max_capacity``.
        bucket_size: slots per hash bucket.
        growth_load_factor: grow when an insert would pass this load.
        score_strategy: the eviction score: ``step`` (last training step that touched the row),
            ``timestamp`` (wall clock, microseconds), ``lfu`` (touch count), ``none`` (no
            eviction).
        check_mode: what happens to a key that cannot get a row: ``error``, ``warn`` or
            ``ignore`` (it reads the eval initializer and gets no update). Default ``error`` for
            score ``none``, ``warn`` otherwise.
        admission: optional :class:`AdmissionConfig`.
        eval_initializer: what a key without a row reads (default constant 0).
    """

    max_capacity: int
    init_capacity: Optional[int] = None
    bucket_size: int = 16
    growth_load_factor: float = 0.75
    score_strategy: ScoreStrategy = "step"
    check_mode: Optional[CheckMode] = None
    admission: Optional[AdmissionConfig] = None
    eval_initializer: Optional[Initializer] = None

    __pydantic_config__: ClassVar[dict] = _FORBID

    def __post_init__(self) -> None:
        where = "dynamic table"
        check_count(where, "bucket_size", self.bucket_size, 1, 1024)
        check_count(where, "max_capacity", self.max_capacity, self.bucket_size)
        if self.init_capacity is None:
            object.__setattr__(self, "init_capacity", self.max_capacity)
        check_count(where, "init_capacity", self.init_capacity, self.bucket_size, self.max_capacity)
        g = self.growth_load_factor
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 < g <= 1.0 or math.isnan(g):
            raise ValueError(f"{where}: growth_load_factor must be in (0, 1], got {g!r}")
        if self.score_strategy not in SCORE_STRATEGIES:
            raise ValueError(f"{where}: score_strategy must be one of {SCORE_STRATEGIES}, got {self.score_strategy!r}")
        if self.check_mode is None:
            object.__setattr__(self, "check_mode", "error" if self.score_strategy == "none" else "warn")
        if self.check_mode not in CHECK_MODES:
            raise ValueError(f"{where}: check_mode must be one of {CHECK_MODES}, got {self.check_mode!r}")


def cache_rows_of(num_rows: int, cache_load_factor: float) -> int:
    """Slots of a cache holding ``cache_load_factor`` of ``num_rows`` rows: the share rounded up
    (at least one row, at most all)."""
    return max(1, min(num_rows, math.ceil(num_rows * cache_load_factor - 1e-9)))


@dataclass(frozen=True)
class TableConfig:
    """One embedding table: fixed (``num_embeddings`` rows, ids ``[0, num_embeddings)``) or
    dynamic (``dynamic`` options: any int64 key, rows created on demand).

    Args:
        name: table name, unique in a collection.
        dim: embedding dim D.
        num_embeddings: rows of a fixed table.
        dynamic: the options of a dynamic table (give exactly one of these two).
        features: the features the table serves, names or :class:`FeatureConfig` (to give a
            feature its own pooling, e.g. a sequence feature sharing the candidate's table).
        pooling: default pooling of the table's features: ``sum``, ``mean`` or ``none``.
        backend: ``native`` (plain torch, CPU and CUDA) or ``fbgemm`` (FBGEMM TBE, CPU build).
        optimizer: per-table override of the collection's optimizer.
        initializer: initial weights (key-seeded); default uniform +-sqrt(1/rows), rows being
            ``num_embeddings`` or ``max_capacity``.
        seed: initializer seed; default derived from the table name.
        sharding: forces how a multi-process run shards the table (default: the planner decides).
        data_type: the weights' storage, ``fp32``, or ``fp16`` / ``bf16`` (half the bytes; the
            update runs in fp32 and stores each weight by seeded stochastic rounding,
            :mod:`dynarec.optim.rounding`; optimizer states stay fp32; native backend only).
        cache_load_factor: a table whose rows live in host memory, this share of its rows (a
            dynamic table's: of ``max_capacity``) cached on the device
            (:mod:`dynarec.embedding.cached_store`; torchrec's name for FBGEMM's managed caching,
            dynamicemb's for its caching mode); None: every row on the device. Native backend.
    """

    name: str
    dim: int
    num_embeddings: Optional[int] = None
    dynamic: Optional[DynamicTableOptions] = None
    features: Sequence[Union[str, FeatureConfig]] = field(default_factory=tuple)
    pooling: Pooling = "sum"
    backend: Backend = "native"
    optimizer: Optional[OptimizerSpec] = None
    initializer: Optional[Initializer] = None
    seed: Optional[int] = None
    sharding: Optional[ShardingType] = None
    data_type: RowDtype = "fp32"
    cache_load_factor: Optional[float] = None

    def __post_init__(self) -> None:
        where = f"table '{self.name}'"
        if self.cache_load_factor is not None:
            f = self.cache_load_factor
            if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
                raise ValueError(f"{where}: cache_load_factor must be a share of the rows in (0, 1], got {f!r}")
            if self.backend != "native":
                raise ValueError(f"{where}: cache_load_factor caches rows of backend 'native', not '{self.backend}'")
        if self.data_type not in ROW_DTYPE_NAMES:
            raise ValueError(f"{where}: data_type must be one of {ROW_DTYPE_NAMES}, got {self.data_type!r}")
        if self.data_type != "fp32" and self.backend != "native":
            raise ValueError(
                f"{where}: data_type {self.data_type} rows are trained by backend='native' (the fbgemm backend "
                "keeps fp32 rows)"
            )
        if self.sharding is not None and self.sharding not in SHARDING_TYPES:
            raise ValueError(f"{where}: sharding must be one of {SHARDING_TYPES}, got {self.sharding!r}")
        check_count(where, "dim", self.dim)
        if self.backend == "fbgemm":
            check_fbgemm_dim(where, self.dim)
        if self.pooling not in POOLINGS:
            raise ValueError(f"{where}: pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"{where}: backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.optimizer is not None and not isinstance(self.optimizer, OptimizerSpec):
            raise ValueError(f"{where}: optimizer must be an OptimizerSpec, got {self.optimizer!r}")
        if isinstance(self.features, str):  # a string is a sequence of one-letter features
            raise ValueError(f"{where}: features must be a list of feature names, got the string {self.features!r}")
        features = tuple(f if isinstance(f, FeatureConfig) else FeatureConfig(f) for f in self.features)
        object.__setattr__(self, "features", features)
        if not features:
            raise ValueError(f"{where}: features must name at least one feature")
        names = [f.name for f in features]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: a feature is listed twice in {names}")
        if self.seed is None:
            object.__setattr__(self, "seed", zlib.crc32(self.name.encode()))
        if (self.num_embeddings is None) == (self.dynamic is None):
            raise ValueError(
                f"{where}: give exactly one of num_embeddings (a fixed table) or dynamic "
                f"(DynamicTableOptions, a dynamic table)"
            )
        if self.num_embeddings is not None:
            check_count(where, "num_embeddings", self.num_embeddings)
            if self.sharding == "key_hash":
                raise ValueError(f"{where}: key_hash sharding is for dynamic tables; a fixed table takes row_wise")
        elif not isinstance(self.dynamic, DynamicTableOptions):
            raise ValueError(f"{where}: dynamic must be a DynamicTableOptions, got {self.dynamic!r}")
        elif self.sharding in ("row_wise", "data_parallel"):
            raise ValueError(
                f"{where}: {self.sharding} sharding is for fixed tables; a dynamic table takes key_hash or table_wise"
            )

    @property
    def feature_configs(self) -> tuple[FeatureConfig, ...]:
        """``features``, every one a :class:`FeatureConfig` (names are normalized on construction)."""
        return self.features  # type: ignore[return-value]

    @property
    def kind(self) -> Literal["fixed", "dynamic"]:
        return "fixed" if self.dynamic is None else "dynamic"

    @property
    def num_rows_bound(self) -> int:
        """Rows the default initializer bound is computed from: ``num_embeddings`` or
        ``max_capacity`` (of the whole table, whatever its sharding)."""
        return self.num_embeddings if self.dynamic is None else self.dynamic.max_capacity  # type: ignore[return-value]

    @property
    def default_bound(self) -> float:
        return math.sqrt(1.0 / self.num_rows_bound)

    def pooling_of(self, feature: FeatureConfig) -> Pooling:
        return feature.pooling or self.pooling
