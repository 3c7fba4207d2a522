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

import dataclasses
from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn

from dynarec.distributed.context import DistContext
from dynarec.distributed.routing import return_pooled, route
from dynarec.embedding.capacity import shard_init_capacity
from dynarec.embedding.collection import EmbeddingCollection, TableFreezing, check_stays, checked_slices
from dynarec.embedding.dynamic import DynamicTable
from dynarec.embedding.jagged import FeatureSlice, KeyedJaggedLike
from dynarec.embedding.memory import check_fits
from dynarec.embedding.pack import pack, unpack
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


class ShardedEmbeddingCollection(TableFreezing, nn.Module):
    """The tables of a plan spread over the ranks of ``ctx``.

    Replicated (``data_parallel``) tables form a local :class:`EmbeddingCollection` — the
    single-process pack, lookup and unpack, its table groups included — whose stores sum their
    row gradients over the ranks; every other table is routed, all of them together
    (:mod:`.routing`): a step's collectives do not grow with the number of tables."""

    def __init__(self, plan: Plan, ctx: DistContext):
        super().__init__()
        if plan.world_size != ctx.world_size:
            raise ValueError(f"the plan is for {plan.world_size} ranks, this run has {ctx.world_size}")
        self.plan, self.ctx, self.device = plan, ctx, ctx.device
        held = [tp for tp in plan.tables if tp.sharding.holds(ctx.rank)]
        # Before allocating anything: this rank's shards at their largest must fit its memory.
        check_fits([(tp.table, tp.optimizer) for tp in held], self.device, sizes=[tp.bytes_on(ctx.rank) for tp in held])
        self._features = [f.name for tp in plan.tables for f in tp.table.feature_configs]
        replicated = [tp for tp in plan.tables if not tp.sharding.routed]
        self.local: Optional[EmbeddingCollection] = None
        if replicated:
            self.local = EmbeddingCollection(
                [dataclasses.replace(tp.table, optimizer=tp.optimizer) for tp in replicated],
                device=self.device,
                memory_budget=2**63 - 1,  # checked above, with the shards
                row_reducers=lambda name, rows: _AllReduceRowGradients(self.ctx, rows, name),
            )
        self.routed = [tp for tp in plan.tables if tp.sharding.routed]
        self.shards: dict[str, EmbeddingTable] = {
            tp.table.name: self._make_shard(tp) for tp in self.routed if tp.sharding.holds(ctx.rank)
        }
        # Every table this rank holds, in the plan's order.
        local_tables = self.local.tables if self.local is not None else {}
        self.tables: dict[str, EmbeddingTable] = {
            tp.table.name: local_tables.get(tp.table.name) or self.shards[tp.table.name] for tp in held
        }

    def _make_shard(self, tp: TablePlan) -> EmbeddingTable:
        s, config, rank = tp.sharding, tp.table, self.ctx.rank
        if s.kind == "row_wise":
            return FixedTable(config, tp.optimizer, self.device, rows=s.rows_of(rank))
        if s.kind == "key_hash":
            assert config.dynamic is not None and s.capacity_per_rank is not None
            d = config.dynamic
            init = shard_init_capacity(d.init_capacity, s.world_size, d.bucket_size, s.capacity_per_rank)  # type: ignore[arg-type]
            return DynamicTable(config, tp.optimizer, self.device, capacity=(init, s.capacity_per_rank))
        return (FixedTable if config.dynamic is None else DynamicTable)(config, tp.optimizer, self.device)

    @property
    def feature_names(self) -> list[str]:
        return list(self._features)

    prefetch_depth = 1

    def _apply(self, fn, recurse: bool = True):
        check_stays(fn, self.device, [tp.table.name for tp in self.plan.tables])
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix: str, keep_vars: bool) -> None:
        self._refuse_partial_state("state_dict()")  # else every table is the local collection's
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix: str, *args, **kwargs) -> None:
        self._refuse_partial_state("load_state_dict()")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _refuse_partial_state(self, what: str) -> None:
        """A rank holds only its shards of the routed tables: their state is refused, not given in
        part (replicated tables alone travel in the local collection's state)."""
        if self.routed:
            raise RuntimeError(
                f"rank {self.ctx.rank}: {what} of a sharded embedding collection would cover only this rank's shards "
                f"of its routed table(s) {[tp.table.name for tp in self.routed]}; save and restore a sharded model "
                "with dynarec's checkpoints (Trainer.save / Trainer.restore: written by N ranks, restored on any)"
            )

    def prefetch(
        self, kjt: KeyedJaggedLike, ready: Optional[torch.cuda.Event] = None, units: Optional[Sequence[str]] = None
    ) -> None:
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
        local_begun = False
        if self.local is not None:
            try:
                out.update(self.local.lookup_slices(slices))  # aborts its own step if it fails
                local_begun = self.trains_tables
            except Exception as e:
                error = error or e
        begun: list[EmbeddingTable] = []
        for table in self.shards.values():
            try:
                if self.trains_tables:
                    table.begin_step()
                    begun.append(table)
            except Exception as e:
                error = error or e
        packed = [
            pack(
                [(f.name, tp.table.pooling_of(f), slices[f.name]) for f in tp.table.feature_configs],
                pad_sequences=False,
            )
            for tp in self.routed
        ]
        where = [tp.sharding.owner(bags.ids) for tp, (bags, _) in zip(self.routed, packed)]
        owned, routed = route([bags for bags, _ in packed], [w[0] for w in where], [w[1] for w in where], self.ctx)
        pooled = []
        for tp, bags in zip(self.routed, owned):
            shard = self.shards.get(tp.table.name)
            result: Optional[torch.Tensor] = None
            if shard is not None:
                try:
                    result = shard.lookup(bags, self.trains_tables)
                except Exception as e:
                    error = error or e
            if result is None:  # nothing held here (or the lookup failed): zeros that still carry the backward
                grad = self.trains_tables and torch.is_grad_enabled()
                result = torch.zeros(bags.num_bags, tp.table.dim, device=self.device, requires_grad=grad)
            pooled.append(result)
        results = return_pooled(pooled, [tp.table.dim for tp in self.routed], routed, self.ctx)
        for rows, (_, layout) in zip(results, packed):
            out.update(unpack(rows, layout))
        try:
            self.ctx.agree(error, "the embedding lookups of a step")
        except BaseException:
            for table in reversed(begun):  # the step never happened, on any rank
                table.abort_step()
            if local_begun and self.local is not None:
                self.local.abort_step()
            raise
        if self.trains_tables and not torch.is_grad_enabled():
            for table in begun:
                table.commit_pending()
        return out

    def _checked_slices(self, kjt: KeyedJaggedLike) -> dict[str, FeatureSlice]:
        tables = {f.name: tp.table for tp in self.plan.tables for f in tp.table.feature_configs}

        def validate(name: str, ids: torch.Tensor, id_range: Optional[tuple[int, int]]) -> None:
            table = tables[name]  # against the whole table, not this shard
            if table.num_embeddings is not None:
                check_id_range(table.name, name, ids, table.num_embeddings, id_range)

        slices = checked_slices(kjt, self._features, validate, widen=False)
        return {name: s.to(self.device, non_blocking=True) for name, s in slices.items()}  # (int64 there)

    def abort_step(self) -> None:
        """Undoes the last training forward on every table this rank holds (all ranks call it
        together, e.g. after agreeing that the loss was NaN)."""
        if self.frozen:  # its forwards began no step
            return
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
