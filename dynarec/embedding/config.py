"""Typed table and feature configs."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from dynarec.embedding.initializers import Initializer
from dynarec.optim.base import OptimizerSpec

__all__ = [
    "POOLINGS",
    "BACKENDS",
    "SCORE_STRATEGIES",
    "CHECK_MODES",
    "FeatureConfig",
    "AdmissionConfig",
    "TableConfig",
]

POOLINGS = ("sum", "mean", "none")  # "none": a sequence feature, one embedding per id
BACKENDS = ("native", "fbgemm")
KINDS = ("fixed", "dynamic")
SCORE_STRATEGIES = ("step", "timestamp", "lfu", "none")
CHECK_MODES = ("error", "warn", "ignore")


@dataclass(frozen=True)
class FeatureConfig:
    """A feature served by a table. ``pooling`` None takes the table's default pooling."""

    name: str
    pooling: Optional[str] = None

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ValueError(f"feature '{self.name}': pooling must be one of {POOLINGS}, got {self.pooling!r}")


@dataclass(frozen=True)
class AdmissionConfig:
    """A key gets a row only once it was seen ``threshold`` times in training batches.

    Counts live in a bounded counter table of ``capacity`` keys (default: the table's
    ``max_capacity``) that evicts its lowest counts when a bucket is full. Until admitted a key
    reads ``initializer`` (default: the table's eval initializer) and gets no update.
    """

    threshold: int
    capacity: Optional[int] = None
    initializer: Optional[Initializer] = None

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) or self.threshold < 1:
            raise ValueError(f"admission threshold must be an integer >= 1, got {self.threshold!r}")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"admission capacity must be >= 1, got {self.capacity!r}")


@dataclass
class TableConfig:
    """One embedding table.

    Args:
        name: table name, unique in a collection.
        dim: embedding dim D.
        kind: ``"fixed"`` (``num_embeddings`` rows, ids in ``[0, num_embeddings)``) or
            ``"dynamic"`` (any int64 key; rows created on demand, up to ``max_capacity``).
        features: the features the table serves, names or :class:`FeatureConfig` (to give a
            feature its own pooling, e.g. a sequence feature sharing the candidate's table).
        pooling: default pooling of the table's features: ``sum``, ``mean`` or ``none``.
        backend: ``native`` (plain torch, CPU and CUDA) or ``fbgemm`` (FBGEMM TBE, CPU build).
        optimizer: per-table override of the collection's optimizer.
        initializer: initial weights (key-seeded); default uniform +-sqrt(1/rows), rows being
            ``num_embeddings`` or ``max_capacity``.
        seed: initializer seed; default derived from the table name.
        init_capacity, max_capacity, bucket_size, growth_load_factor: dynamic-table capacity.
        score_strategy: dynamic tables' eviction score: ``step`` (last training step that
            touched the row), ``timestamp`` (wall clock, microseconds), ``lfu`` (touch count),
            ``none`` (no eviction).
        check_mode: what happens to a key that cannot get a row: ``error``, ``warn`` or
            ``ignore`` (the key reads the eval initializer and gets no update). Default
            ``error`` for score ``none``, ``warn`` otherwise.
        admission: optional :class:`AdmissionConfig`.
        eval_initializer: what a key with no row reads (default constant 0).
    """

    name: str
    dim: int
    kind: str = "fixed"
    num_embeddings: Optional[int] = None
    features: Sequence[Union[str, FeatureConfig]] = field(default_factory=list)
    pooling: str = "sum"
    backend: str = "native"
    optimizer: Optional[OptimizerSpec] = None
    initializer: Optional[Initializer] = None
    seed: Optional[int] = None
    init_capacity: Optional[int] = None
    max_capacity: Optional[int] = None
    bucket_size: int = 16
    growth_load_factor: float = 0.75
    score_strategy: str = "step"
    check_mode: Optional[str] = None
    admission: Optional[AdmissionConfig] = None
    eval_initializer: Optional[Initializer] = None

    def __post_init__(self) -> None:
        where = f"table '{self.name}'"
        if not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"{where}: dim must be a positive integer, got {self.dim!r}")
        if self.kind not in KINDS:
            raise ValueError(f"{where}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"{where}: pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"{where}: backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.optimizer is not None and not isinstance(self.optimizer, OptimizerSpec):
            raise ValueError(f"{where}: optimizer must be an OptimizerSpec, got {self.optimizer!r}")
        self.features = [f if isinstance(f, FeatureConfig) else FeatureConfig(f) for f in self.features]
        if not self.features:
            raise ValueError(f"{where}: features must name at least one feature")
        names = [f.name for f in self.features]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: a feature is listed twice in {names}")
        if self.seed is None:
            self.seed = zlib.crc32(self.name.encode())
        dynamic_fields = ("init_capacity", "max_capacity", "admission")
        if self.kind == "fixed":
            if not isinstance(self.num_embeddings, int) or self.num_embeddings < 1:
                raise ValueError(f"{where}: a fixed table needs num_embeddings >= 1, got {self.num_embeddings!r}")
            for f in dynamic_fields:
                if getattr(self, f) is not None:
                    raise ValueError(f"{where}: '{f}' applies to dynamic tables only")
            return
        if self.num_embeddings is not None:
            raise ValueError(f"{where}: a dynamic table takes max_capacity, not num_embeddings")
        if not isinstance(self.bucket_size, int) or not 1 <= self.bucket_size <= 1024:
            raise ValueError(f"{where}: bucket_size must be an integer in [1, 1024], got {self.bucket_size!r}")
        if not isinstance(self.max_capacity, int) or self.max_capacity < self.bucket_size:
            raise ValueError(
                f"{where}: a dynamic table needs max_capacity >= bucket_size ({self.bucket_size}), "
                f"got {self.max_capacity!r}"
            )
        if self.init_capacity is None:
            self.init_capacity = self.max_capacity
        if not isinstance(self.init_capacity, int) or not self.bucket_size <= self.init_capacity <= self.max_capacity:
            raise ValueError(
                f"{where}: init_capacity must be in [bucket_size, max_capacity], got {self.init_capacity!r}"
            )
        if not 0.0 < self.growth_load_factor <= 1.0 or math.isnan(self.growth_load_factor):
            raise ValueError(f"{where}: growth_load_factor must be in (0, 1], got {self.growth_load_factor!r}")
        if self.score_strategy not in SCORE_STRATEGIES:
            raise ValueError(f"{where}: score_strategy must be one of {SCORE_STRATEGIES}, got {self.score_strategy!r}")
        if self.check_mode is None:
            self.check_mode = "error" if self.score_strategy == "none" else "warn"
        if self.check_mode not in CHECK_MODES:
            raise ValueError(f"{where}: check_mode must be one of {CHECK_MODES}, got {self.check_mode!r}")

    @property
    def num_rows_bound(self) -> int:
        """Rows the default initializer bound is computed from."""
        return self.num_embeddings if self.kind == "fixed" else self.max_capacity  # type: ignore[return-value]

    @property
    def default_bound(self) -> float:
        return math.sqrt(1.0 / self.num_rows_bound)

    def pooling_of(self, feature: FeatureConfig) -> str:
        return feature.pooling or self.pooling
