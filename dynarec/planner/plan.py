"""The plan: for every table, its kind, backend, rows, features and the one optimizer spec it
is trained with. The config's ``sparse_optimizer`` (and ``table_optimizers`` overrides) reach
every table, fixed or dynamic, only through this typed spec — there is no other channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dynarec.config.schema import Config, InitializerCfg, RawFeatureCfg, SequenceFeatureCfg
from dynarec.embedding.config import AdmissionConfig, FeatureConfig, TableConfig
from dynarec.embedding.initializers import Initializer
from dynarec.optim.base import OptimizerSpec

__all__ = ["Plan", "TablePlan", "plan_from_config"]


@dataclass(frozen=True)
class TablePlan:
    table: TableConfig
    optimizer: OptimizerSpec

    def row(self) -> dict[str, object]:
        t = self.table
        rows = t.num_embeddings if t.kind == "fixed" else f"{t.init_capacity}..{t.max_capacity}"
        feats = ", ".join(f"{f.name}({t.pooling_of(f)})" for f in t.features)  # type: ignore[union-attr]
        return {"table": t.name, "kind": t.kind, "backend": t.backend, "rows": rows, "dim": t.dim,
                "optimizer": repr(self.optimizer), "features": feats}


@dataclass(frozen=True)
class Plan:
    tables: tuple[TablePlan, ...]

    def table_configs(self) -> list[TableConfig]:
        return [t.table for t in self.tables]

    def describe(self) -> str:
        rows = [t.row() for t in self.tables]
        cols = list(rows[0]) if rows else []
        widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
        lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
        lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
        return "\n".join(lines)


def _initializer(cfg: Optional[InitializerCfg]) -> Optional[Initializer]:
    return None if cfg is None else Initializer(**cfg.model_dump())


def plan_from_config(config: Config) -> Plan:
    default = config.train.sparse_optimizer
    overrides = config.train.table_optimizers
    grouped: dict[str, list] = {}
    for f in config.features():
        if not isinstance(f, RawFeatureCfg):
            grouped.setdefault(f.table_name, []).append(f)
    tables = []
    for name, feats in grouped.items():
        first = feats[0]
        features = [FeatureConfig(f.feature_name, "none" if isinstance(f, SequenceFeatureCfg) else f.pooling)
                    for f in feats]
        backend = next((f.backend for f in feats if f.backend), config.train.sparse_backend)
        initializer = next((_initializer(f.initializer) for f in feats if f.initializer), None)
        kwargs: dict = {}
        if first.dynamicemb is None:
            kwargs["num_embeddings"] = first.num_buckets
        else:
            d = first.dynamicemb
            initializer = _initializer(d.initializer) or initializer
            admission = None
            if d.admission is not None:
                admission = AdmissionConfig(d.admission.threshold, d.admission.capacity,
                                            _initializer(d.admission.initializer))
            kwargs.update(kind="dynamic", max_capacity=d.max_capacity, init_capacity=d.init_capacity,
                          bucket_size=d.bucket_size, growth_load_factor=d.growth_load_factor,
                          score_strategy=d.score_strategy, check_mode=d.check_mode, admission=admission,
                          eval_initializer=_initializer(d.eval_initializer))
        spec = overrides.get(name, default)
        table = TableConfig(name=name, dim=first.embedding_dim, features=features, backend=backend,
                            optimizer=spec, initializer=initializer, **kwargs)
        tables.append(TablePlan(table, spec))
    return Plan(tuple(tables))
