"""The plan: for every table, its kind, backend, rows, features, the one optimizer spec it is
trained with, and — for a run of several processes — how it is sharded, what each rank holds and
what crosses the network per step.

The config's ``sparse_optimizer`` (and ``table_optimizers`` overrides) reach every table, fixed or
dynamic, only through this typed spec — there is no other channel. The planner groups features
into tables and passes the config's objects through: a table's ``DynamicTableOptions`` and
``Initializer`` are the very objects the YAML validated into, so no setting is lost on the way.

Sharding decisions (``world_size > 1``), unless a table forces its own (``sharding:``):
dynamic tables are ``key_hash``; fixed tables whose whole gradient is small enough to all-reduce
every step (``DATA_PARALLEL_MAX_BYTES``) are ``data_parallel`` (native backend); fixed tables that
fit a quarter of a rank's budgets (on the device, and in host memory for a table kept there) are
``table_wise``, placed on the least loaded rank; larger ones are ``row_wise``. A plan whose rank
exceeds a budget is an error naming the table and numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from dynarec.config.schema import Config
from dynarec.embedding.capacity import shard_init_capacity
from dynarec.embedding.config import FeatureConfig, ShardingType, TableConfig
from dynarec.embedding.memory import TableBytes, format_bytes, table_bytes
from dynarec.optim.base import OptimizerSpec
from dynarec.optim.sgd import SGD
from dynarec.planner.sharding import TableSharding

__all__ = ["DATA_PARALLEL_MAX_BYTES", "Plan", "PlanError", "TablePlan", "plan_from_config", "plan_tables"]

# A fixed table is replicated (data_parallel) when its weights are at most this many bytes: its
# dense gradient is all-reduced every step.
DATA_PARALLEL_MAX_BYTES = 1 << 20

# Bytes per routed id in each direction of a lookup: the id (8), its bag (8), its weight (4).
_ROUTED_ID_BYTES = 20


class PlanError(ValueError):
    """A plan that cannot run (a rank over its memory budget, an impossible forced sharding)."""


@dataclass(frozen=True)
class TablePlan:
    table: TableConfig
    optimizer: OptimizerSpec
    sharding: TableSharding
    # Ids per sample of each feature (as table.feature_configs): 1 for an id feature, the
    # sequence length for a sequence; used for the exchange estimate.
    ids_per_sample: tuple[int, ...] = ()

    def bytes_on(self, rank: int) -> int:
        """Bytes this table takes on ``rank``'s device at its largest (weights, optimizer states,
        index; a table cached from host memory: its cache)."""
        return self._bytes(rank).total

    def host_bytes_on(self, rank: int) -> int:
        """Bytes of this table's rows in ``rank``'s host memory (``cache_load_factor``), else 0."""
        return self._bytes(rank).host

    def peak_bytes_on(self, rank: int, host: bool = False) -> int:
        """:meth:`bytes_on` (``host``: :meth:`host_bytes_on`) with a dynamic table's last growth:
        the allocation it grows from is held until the step commits."""
        b = self._bytes(rank)
        return b.host_peak if host else b.peak

    def _bytes(self, rank: int) -> TableBytes:
        s, t = self.sharding, self.table
        if not s.holds(rank):
            return TableBytes(0, 0, 0, 0)
        if s.kind == "row_wise":
            start, end = s.rows_of(rank)
            return table_bytes(t, self.optimizer, rows=end - start)
        if s.kind == "key_hash":
            assert t.dynamic is not None and s.capacity_per_rank is not None
            d, per_rank = t.dynamic, s.capacity_per_rank
            init = shard_init_capacity(d.init_capacity, s.world_size, d.bucket_size, per_rank)  # type: ignore[arg-type]
            return table_bytes(t, self.optimizer, rows=per_rank, world_size=s.world_size, init_rows=init)
        return table_bytes(t, self.optimizer)

    def exchange_bytes(self, batch_size: int) -> int:
        """Estimated bytes a rank sends per training step for this table (forward and backward):
        routed ids out and pooled rows back (a (W-1)/W share leaves the rank), or a data-parallel
        table's gradient all-reduce (a ring moves 2 (W-1)/W of it)."""
        w = self.sharding.world_size
        if w == 1:
            return 0
        leave = (w - 1) / w
        if self.sharding.kind == "data_parallel":
            return int(2 * leave * table_bytes(self.table, self.optimizer).weights)
        features = self.table.feature_configs
        per_sample = self.ids_per_sample or (1,) * len(features)
        ids = batch_size * sum(per_sample)
        bags = batch_size * sum(1 if self.table.pooling_of(f) != "none" else n for f, n in zip(features, per_sample))
        return int(leave * (ids * _ROUTED_ID_BYTES + 2 * bags * self.table.dim * 4))

    def row(self, batch_size: int = 0, host: bool = False) -> dict[str, object]:
        """The table's line of the plan (``host``: with its bytes in host memory)."""
        t, s = self.table, self.sharding
        rows = t.num_embeddings if t.dynamic is None else f"{t.dynamic.init_capacity}..{t.dynamic.max_capacity}"
        feats = ", ".join(f"{f.name}({t.pooling_of(f)})" for f in t.feature_configs)
        row: dict[str, object] = {
            "table": t.name,
            "kind": t.kind,
            "backend": t.backend,
            "rows": rows,
            "dim": t.dim,
            "dtype": t.data_type,  # the rows' (optimizer states are float32 whatever it is)
            "optimizer": repr(self.optimizer),
            "features": feats,
        }
        if s.world_size > 1:
            row["sharding"] = s.kind
            row["ranks"] = s.describe_ranks()
        row["bytes/rank"] = format_bytes(max(self.bytes_on(r) for r in range(s.world_size)))
        if host:
            row["host bytes/rank"] = format_bytes(max(self.host_bytes_on(r) for r in range(s.world_size)))
        if s.world_size > 1:
            row["exchange/step/rank"] = format_bytes(self.exchange_bytes(batch_size))
        return row


@dataclass(frozen=True)
class Plan:
    tables: tuple[TablePlan, ...]
    world_size: int = 1
    batch_size: int = 0  # per rank

    def table_configs(self) -> list[TableConfig]:
        return [t.table for t in self.tables]

    def table(self, name: str) -> TablePlan:
        return next(t for t in self.tables if t.table.name == name)

    def bytes_on(self, rank: int) -> int:
        return sum(t.bytes_on(rank) for t in self.tables)

    def host_bytes_on(self, rank: int) -> int:
        """Bytes of rows the tables keep in ``rank``'s host memory (``cache_load_factor``)."""
        return sum(t.host_bytes_on(rank) for t in self.tables)

    def peak_bytes_on(self, rank: int, host: bool = False) -> int:
        """The tables' :meth:`TablePlan.peak_bytes_on` on ``rank``: what the budgets are checked against."""
        return sum(t.peak_bytes_on(rank, host) for t in self.tables)

    def describe(self) -> list[dict[str, object]]:
        """One dict per table: table, kind, backend, rows, dim, the rows' dtype, optimizer (every
        parameter), features; bytes per rank on the device (and in host memory, where a table keeps its rows
        there); with several ranks its sharding, ranks and exchange per step."""
        host = any(t.table.cache_load_factor is not None for t in self.tables)
        return [t.row(self.batch_size, host) for t in self.tables]

    def format(self) -> str:
        """The plan as a text table, one line per table, and the per-rank totals."""
        rows = self.describe()
        if not rows:
            return "no embedding tables: the model reads dense features only"
        cols = list(rows[0])
        widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
        lines = ["  ".join(c.ljust(widths[c]) for c in cols)]
        lines += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
        if self.world_size > 1:
            worst = max(range(self.world_size), key=self.bytes_on)
            exchange = sum(t.exchange_bytes(self.batch_size) for t in self.tables)
            host = max(range(self.world_size), key=self.host_bytes_on)
            in_host = self.host_bytes_on(host)
            lines.append(
                f"{self.world_size} ranks: at most {format_bytes(self.bytes_on(worst))} of tables on a rank's device "
                f"(rank {worst})"
                + (f" and {format_bytes(in_host)} in its host memory (rank {host})" if in_host else "")
                + f"; about {format_bytes(exchange)} exchanged per step per rank at batch {self.batch_size} per rank"
            )
        else:
            in_host = self.host_bytes_on(0)
            lines.append(
                f"1 rank: {format_bytes(self.bytes_on(0))} of tables on its device"
                + (f" and {format_bytes(in_host)} in its host memory" if in_host else "")
            )
        ranks = range(self.world_size)
        device_peak = max(self.peak_bytes_on(r) for r in ranks)
        host_peak = max(self.peak_bytes_on(r, host=True) for r in ranks)
        if device_peak > max(map(self.bytes_on, ranks)) or host_peak > max(map(self.host_bytes_on, ranks)):
            lines.append(
                f"growing (init_capacity below max_capacity), a dynamic table holds the allocation it grows from "
                f"until the step commits: at most {format_bytes(device_peak)} on a rank's device"
                + (f" and {format_bytes(host_peak)} in its host memory" if host_peak else "")
                + " at a last growth (what the memory budgets are checked against)"
            )
        return "\n".join(lines)


def _tables_of(config: Config) -> list[tuple[TableConfig, OptimizerSpec, tuple[int, ...]]]:
    """``(table, optimizer, ids per sample)`` of every table; features sharing an
    ``embedding_name`` share a table (the config has checked that they agree). A table of
    ``trainable: false`` features trains with SGD at learning rate 0: its rows stay as they were
    initialized or loaded (a dynamic one still creates rows for new keys)."""
    grouped: dict[str, list] = {}
    for f in config.features():
        if f.embedded:
            grouped.setdefault(f.table_name, []).append(f)
    out = []
    for name, feats in grouped.items():
        first = feats[0]
        features = [FeatureConfig(f.feature_name, "none" if f.is_sequence else f.pooling) for f in feats]
        spec = config.train.table_optimizers.get(name, config.train.sparse_optimizer)
        if not first.trainable:
            spec = SGD(lr=0.0)
        table = TableConfig(
            name=name,
            dim=first.embedding_dim,
            num_embeddings=first.table_rows,
            dynamic=first.dynamic_table,
            features=features,
            backend=first.backend or config.train.sparse_backend,
            optimizer=spec,
            initializer=first.initializer,
            sharding=first.sharding,
            data_type=first.data_type,
            cache_load_factor=first.cache_load_factor,
        )
        ids = tuple(_ids_per_sample(f) for f in feats)
        out.append((table, spec, ids))
    return out


def _ids_per_sample(f) -> int:
    """A guess of the ids a row of feature ``f`` sends its table (for the plan's traffic
    figures): a sequence's length, ``value_dim`` ids of bucketized numbers, 8 for a
    multi-valued id feature, else 1."""
    if f.is_sequence:
        return int(f.sequence_length)
    if getattr(f, "separator", None) and f.KIND == "id_feature":
        return 8
    return max(int(getattr(f, "value_dim", 1) or 1), 1)


def plan_from_config(
    config: Config, world_size: int = 1, memory_budget: Optional[int] = None, check_budgets: bool = True
) -> Plan:
    """The plan of a config's tables (features sharing an ``embedding_name`` share a table):
    :func:`plan_tables` with the config's optimizers, batch size and memory budgets (default
    ``train.memory_budget_per_rank``; in host memory ``train.host_memory_budget_per_rank``);
    ``check_budgets`` False: neither budget is checked (``dynarec verify``, whose tables are
    small twins of these)."""
    budget = memory_budget if memory_budget is not None else config.train.memory_budget_per_rank
    host = config.train.host_memory_budget_per_rank
    if not check_budgets:
        budget = host = None
    tables = _tables_of(config)
    return plan_tables(
        [t for t, _, _ in tables],
        world_size,
        None if budget is None else int(budget),
        batch_size=config.data.batch_size,
        ids_per_sample=[ids for _, _, ids in tables],
        host_memory_budget=None if host is None else int(host),
    )


def plan_tables(
    tables: Sequence[TableConfig],
    world_size: int = 1,
    memory_budget: Optional[int] = None,
    optimizer: Optional[OptimizerSpec] = None,
    batch_size: int = 0,
    ids_per_sample: Optional[Sequence[tuple[int, ...]]] = None,
    host_memory_budget: Optional[int] = None,
) -> Plan:
    """One :class:`TablePlan` per table, sharded over ``world_size`` ranks; each table trained by
    its own ``TableConfig.optimizer``, else ``optimizer``.

    ``memory_budget``: bytes per rank on its device, ``host_memory_budget``: bytes of rows per
    rank in host memory (None: unchecked here — the tables check the device's and the host's
    memory when they are built); ``batch_size`` (per rank) and ``ids_per_sample`` (per table,
    per feature; default 1) size the plan's exchange estimate."""
    load = [0] * world_size
    plans = []
    for i, table in enumerate(tables):
        spec = table.optimizer or optimizer
        if spec is None:
            raise PlanError(f"table '{table.name}' has no optimizer: give the planner one or the table its own")
        ids = ids_per_sample[i] if ids_per_sample is not None else (1,) * len(table.feature_configs)
        sharding = _decide(table, spec, world_size, memory_budget, load, host_memory_budget)
        plan = TablePlan(table, spec, sharding, ids)
        for r in range(world_size):
            load[r] += plan.bytes_on(r)
        plans.append(plan)
    result = Plan(tuple(plans), world_size, batch_size)
    if memory_budget is not None:
        _check_budget(result, memory_budget, "device")
    if host_memory_budget is not None:
        _check_budget(result, host_memory_budget, "host")
    return result


def _decide(
    table: TableConfig,
    spec: OptimizerSpec,
    world: int,
    budget: Optional[int],
    load: list[int],
    host_budget: Optional[int] = None,
):
    """The sharding of one table (see the module docstring); a fixed table of more than a quarter
    of either budget (``budget`` on the device, ``host_budget`` in host memory) is split by rows."""
    kind: ShardingType
    full = table_bytes(table, spec)
    if table.sharding is not None:
        kind = table.sharding
        if kind == "data_parallel" and table.dynamic is not None:
            raise PlanError(
                f"table '{table.name}': a dynamic table cannot be data_parallel (each replica would insert its own "
                "rank's keys, and their rows would differ); use key_hash"
            )
        if kind == "data_parallel" and table.backend != "native":
            raise PlanError(
                f"table '{table.name}': data_parallel sharding needs backend 'native' (its row "
                "gradients are all-reduced before the fused update); use table_wise or row_wise"
            )
        if kind == "data_parallel" and table.cache_load_factor is not None:
            raise PlanError(
                f"table '{table.name}': a data_parallel table keeps every row on each device; with "
                "cache_load_factor use table_wise or row_wise"
            )
    elif world == 1:
        kind = "table_wise"
    elif table.dynamic is not None:
        kind = "key_hash"
    elif full.weights <= DATA_PARALLEL_MAX_BYTES and table.backend == "native" and table.cache_load_factor is None:
        kind = "data_parallel"
    elif (budget is not None and full.total > budget // 4) or (
        host_budget is not None and full.host > host_budget // 4
    ):
        kind = "row_wise"
    else:
        kind = "table_wise"
    if kind == "data_parallel":
        return TableSharding(kind, world, tuple(range(world)))
    if kind == "table_wise":
        owner = min(range(world), key=lambda r: (load[r], r))
        return TableSharding(kind, world, (owner,))
    if kind == "row_wise":
        return TableSharding.row_wise(table.num_embeddings, world)  # type: ignore[arg-type]
    assert table.dynamic is not None
    bs = table.dynamic.bucket_size
    per_rank = max(bs, -(-table.dynamic.max_capacity // world // bs) * bs)
    return TableSharding(kind, world, tuple(range(world)), capacity_per_rank=per_rank)


def _check_budget(plan: Plan, budget: int, where: str) -> None:
    """PlanError naming the tables and their bytes where a rank's tables take more than ``budget``
    on its device (``where`` "device") or in its host memory ("host")."""
    host = where == "host"
    for rank in range(plan.world_size):
        used = plan.peak_bytes_on(rank, host)  # (a growing table's last growth included)
        if used > budget:
            parts = sorted(((t.peak_bytes_on(rank, host), t) for t in plan.tables), key=lambda x: -x[0])
            detail = "; ".join(f"table '{t.table.name}' ({t.sharding.kind}) {format_bytes(b)}" for b, t in parts if b)
            field, place, knob = (
                ("host_memory_budget_per_rank", "in the host memory of", "max_capacity / num_buckets / embedding_dim")
                if host
                else ("memory_budget_per_rank", "on", "max_capacity / num_buckets / embedding_dim, cache_load_factor")
            )
            raise PlanError(
                f"the plan puts {format_bytes(used)} of tables {place} rank {rank} of {plan.world_size} (a growing "
                f"table's last growth included), over "
                f"train.{field} {format_bytes(budget)}: {detail}; lower {knob}, force another sharding, or use "
                "more ranks"
            )
