"""ShardedEmbeddingCollection: the sharded twin of :class:`EmbeddingCollection`.

The same forward contract (a KJT-shaped batch in, ``{feature: [B, D] or [B, L, D]}`` out, the
fused optimizer in backward), with the tables spread over the ranks as the plan says. The
unsharded collection is untouched; sharding wraps its three stages (torchrec's
input_dist -> lookup -> output_dist):

    pack (this rank's batch) -> route ids to owners -> owner's lookup -> pooled rows back -> unpack

A ``data_parallel`` table is looked up locally on every rank; its row gradients are summed over
the ranks inside backward, before the fused update, so its replicas stay bit-identical. Every
other table is routed (:mod:`.routing`).

Every rank takes part in every collective of a forward even when its own part failed (bad ids,
a full table with ``check_mode: error``): it sends nothing, and at the end all ranks agree on the
step's outcome. If any rank failed, every rank undoes the step on its tables and raises
StepFailedError naming the failing rank and its message.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from dynarec.distributed.context import DistContext
from dynarec.distributed.routing import return_pooled, route_bags
from dynarec.embedding.collection import checked_slices
from dynarec.embedding.config import FeatureConfig
from dynarec.embedding.dynamic import DynamicTable
from dynarec.embedding.jagged import FeatureSlice, KeyedJaggedLike
from dynarec.embedding.memory import check_fits
from dynarec.embedding.pack import Bags, pack, unpack
from dynarec.embedding.table import EmbeddingTable, FixedTable, check_id_range
from dynarec.planner.plan import Plan, TablePlan

__all__ = ["ShardedEmbeddingCollection"]


class _AllReduceRowGradients:
    """A data-parallel table's gradient reducer: the sum over ranks of each row's gradient,
    for every row any rank touched (all replicas then apply the same update)."""

    def __init__(self, ctx: DistContext, num_rows: int, table: str):
        self.ctx, self.num_rows, self.table = ctx, num_rows, table

    def __call__(self, rows: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dense = grads.new_zeros(self.num_rows, grads.shape[1] + 1)
        dense[:, :-1].index_add_(0, rows, grads)
        dense[rows, -1] = 1.0  # touched here
        self.ctx.all_reduce_sum(dense, f"the row gradients of data-parallel table '{self.table}'", sparse=True)
        touched = torch.nonzero(dense[:, -1] > 0).flatten()
        return touched, dense[touched, :-1]


class ShardedEmbeddingCollection(nn.Module):
    def __init__(self, plan: Plan, ctx: DistContext):
        super().__init__()
        if plan.world_size != ctx.world_size:
            raise ValueError(f"the plan is for {plan.world_size} ranks, this run has {ctx.world_size}")
        self.plan, self.ctx, self.device = plan, ctx, ctx.device
        self.tables: dict[str, EmbeddingTable] = {}  # the shards this rank holds
        self._features: dict[str, tuple[TablePlan, FeatureConfig]] = {}
        held = [tp for tp in plan.tables if tp.sharding.holds(ctx.rank)]
        # Before allocating anything: this rank's shards at their largest must fit its memory.
        check_fits([(tp.table, tp.optimizer) for tp in held], self.device, sizes=[tp.bytes_on(ctx.rank) for tp in held])
        for tp in plan.tables:
            for feature in tp.table.feature_configs:
                self._features[feature.name] = (tp, feature)
        for tp in held:
            self.tables[tp.table.name] = self._make_shard(tp)

    def _make_shard(self, tp: TablePlan) -> EmbeddingTable:
        s, config, rank = tp.sharding, tp.table, self.ctx.rank
        if s.kind == "row_wise":
            return FixedTable(config, tp.optimizer, self.device, rows=s.rows_of(rank))
        if s.kind == "key_hash":
            assert config.dynamic is not None and s.capacity_per_rank is not None
            bs = config.dynamic.bucket_size
            init = max(bs, -(-config.dynamic.init_capacity // s.world_size // bs) * bs)  # type: ignore[operator]
            return DynamicTable(
                config, tp.optimizer, self.device, capacity=(min(init, s.capacity_per_rank), s.capacity_per_rank)
            )
        table: EmbeddingTable = (FixedTable if config.dynamic is None else DynamicTable)(
            config, tp.optimizer, self.device
        )
        if s.kind == "data_parallel":
            table.store.grad_reducer = _AllReduceRowGradients(self.ctx, config.num_embeddings, config.name)  # type: ignore[arg-type]
        return table

    @property
    def feature_names(self) -> list[str]:
        return list(self._features)

    prefetch_depth = 1

    def prefetch(self, kjt: KeyedJaggedLike, ready: Optional[torch.cuda.Event] = None) -> None:
        """Nothing: a sharded lookup's input stage is collective (every rank's ids go to their
        owners), so it runs inside its own step, in step order on every rank."""

    def forward(self, kjt: Optional[KeyedJaggedLike], error: Optional[BaseException] = None) -> dict[str, torch.Tensor]:
        """Looks up every feature of ``kjt`` (see :class:`EmbeddingCollection`). ``error``: this
        rank has no valid batch (its reading failed): it still takes part in every collective,
        and the step fails on every rank naming it."""
        slices: dict[str, FeatureSlice] = {}
        try:
            if error is None:
                assert kjt is not None
                slices = self._checked_slices(kjt)
        except Exception as e:
            error = e
        if error is not None:  # take part with nothing
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            slices = {n: FeatureSlice(n, empty, empty, None, 0, 0) for n in self._features}
        out: dict[str, torch.Tensor] = {}
        begun: list[EmbeddingTable] = []
        for tp in self.plan.tables:
            table = self.tables.get(tp.table.name)
            try:
                if self.training and table is not None:
                    table.begin_step()
                    begun.append(table)
            except Exception as e:
                error = error or e
            bags, layout = pack([(f.name, tp.table.pooling_of(f), slices[f.name]) for f in tp.table.feature_configs])
            if tp.sharding.routed:
                pooled, error = self._routed_lookup(tp, table, bags, error)
            else:
                assert table is not None
                try:
                    pooled = table.lookup(bags, self.training)
                except Exception as e:
                    error = error or e
                    pooled = torch.zeros(bags.num_bags, tp.table.dim, device=self.device)
            out.update(unpack(pooled, layout))
        try:
            self.ctx.agree(error, "the embedding lookups of a step")
        except BaseException:
            for table in reversed(begun):  # the step never happened, on any rank
                table.abort_step()
            raise
        if self.training and not torch.is_grad_enabled():
            for table in begun:
                table.commit_pending()
        return out

    def _routed_lookup(
        self, tp: TablePlan, table: Optional[EmbeddingTable], bags: Bags, error: Optional[BaseException]
    ) -> tuple[torch.Tensor, Optional[BaseException]]:
        name, dim = tp.table.name, tp.table.dim
        owner, local = tp.sharding.owner(bags.ids)
        owned, routed = route_bags(bags, owner, local, self.ctx, name)
        pooled: Optional[torch.Tensor] = None
        if table is not None:
            try:
                pooled = table.lookup(owned, self.training)
            except Exception as e:
                error = error or e
        if pooled is None:  # nothing held here (or the lookup failed): zeros that still carry the backward
            pooled = torch.zeros(
                owned.num_bags, dim, device=self.device, requires_grad=self.training and torch.is_grad_enabled()
            )
        return return_pooled(pooled, routed, self.ctx, name, dim), error

    def _checked_slices(self, kjt: KeyedJaggedLike) -> dict[str, FeatureSlice]:
        def validate(name: str, ids: torch.Tensor) -> None:  # against the whole table, not this shard
            table = self._features[name][0].table
            if table.num_embeddings is not None:
                check_id_range(table.name, name, ids, table.num_embeddings)

        slices = checked_slices(kjt, list(self._features), validate)
        return {name: s.to(self.device, non_blocking=True) for name, s in slices.items()}

    def abort_step(self) -> None:
        """Undoes the last training forward on every table this rank holds (all ranks call it
        together, e.g. after agreeing that the loss was NaN)."""
        for table in reversed(list(self.tables.values())):
            table.abort_step()

    def set_learning_rate(self, lr: float, table: Optional[str] = None) -> None:
        for name, t in self.tables.items():
            if table is None or name == table:
                t.set_learning_rate(lr)

    def describe(self) -> list[dict[str, object]]:
        return [
            {**t.describe(), "sharding": self.plan.table(n).sharding.kind, "rank": self.ctx.rank}
            for n, t in self.tables.items()
        ]
