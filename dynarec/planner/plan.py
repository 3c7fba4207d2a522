"""The plan: for every table, its kind, backend, rows, features and the one optimizer spec it
is trained with. The config's ``sparse_optimizer`` (and ``table_optimizers`` overrides) reach
every table, fixed or dynamic, only through this typed spec — there is no other channel.

The planner groups features into tables and passes the config's objects through: a table's
``DynamicTableOptions`` and ``Initializer`` are the very objects the YAML validated into, so a
setting cannot be lost between the config and the table.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynarec.config.schema import Config, RawFeatureCfg, SequenceFeatureCfg
from dynarec.embedding.config import FeatureConfig, TableConfig
from dynarec.optim.base import OptimizerSpec

__all__ = ["Plan", "TablePlan", "plan_from_config"]


@dataclass(frozen=True)
class TablePlan:
    table: TableConfig
    optimizer: OptimizerSpec

    def row(self) -> dict[str, object]:
        t = self.table
        rows = t.num_embeddings if t.dynamic is None else f"{t.dynamic.init_capacity}..{t.dynamic.max_capacity}"
        feats = ", ".join(f"{f.name}({t.pooling_of(f)})" for f in t.feature_configs)
        return {
            "table": t.name,
            "kind": t.kind,
            "backend": t.backend,
            "rows": rows,
            "dim": t.dim,
            "optimizer": repr(self.optimizer),
            "features": feats,
        }


@dataclass(frozen=True)
class Plan:
    tables: tuple[TablePlan, ...]

    def table_configs(self) -> list[TableConfig]:
        return [t.table for t in self.tables]

    def describe(self) -> list[dict[str, object]]:
        """One dict per table: table, kind, backend, rows, dim, optimizer (every parameter), features."""
        return [t.row() for t in self.tables]

    def format(self) -> str:
        """The plan as a text table, one line per table."""
        rows = self.describe()
        cols = list(rows[0]) if rows else []
        widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
        lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
        lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
        return "\n".join(lines)


def plan_from_config(config: Config) -> Plan:
    """One :class:`TablePlan` per table (features sharing an ``embedding_name`` share a table;
    the config has checked that they agree on every table setting)."""
    grouped: dict[str, list] = {}
    for f in config.features():
        if not isinstance(f, RawFeatureCfg):
            grouped.setdefault(f.table_name, []).append(f)
    tables = []
    for name, feats in grouped.items():
        first = feats[0]
        features = [
            FeatureConfig(f.feature_name, "none" if isinstance(f, SequenceFeatureCfg) else f.pooling) for f in feats
        ]
        spec = config.train.table_optimizers.get(name, config.train.sparse_optimizer)
        table = TableConfig(
            name=name,
            dim=first.embedding_dim,
            num_embeddings=first.num_buckets,
            dynamic=first.dynamicemb,
            features=features,
            backend=first.backend or config.train.sparse_backend,
            optimizer=spec,
            initializer=first.initializer,
        )
        tables.append(TablePlan(table, spec))
    return Plan(tuple(tables))
