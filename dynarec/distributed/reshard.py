"""Tables across world sizes: a checkpoint written by N ranks loads into M ranks.

A sharded checkpoint holds one table file per rank (each rank's shards) and the plan it was
written with. To load under another plan, each table is first merged back into one logical dump
(rows of a row-wise table concatenated by their bounds; the keys of a key-hash table, with their
weights, optimizer states, scores and admission counts, gathered from every shard), then split
for the new plan: a row range, or the keys whose new owner is this rank (re-inserted into the
shard's own buckets). Under the very plan it was written with, each rank takes its own shard
as it was — every key in its own slot, so a resumed run evicts exactly as the original would.
"""

from __future__ import annotations

from typing import Any

import torch

from dynarec.planner.plan import Plan
from dynarec.planner.sharding import TableSharding, key_owner

__all__ = ["plan_state", "tables_for_rank"]

Dump = dict[str, torch.Tensor]

# Dump fields that name rows of the dump (cut by key or row); the rest (step, layout) are shared.
_PER_ROW = ("keys", "scores", "slots")
_ADMISSION = ("admission_keys", "admission_counts", "admission_slots")


def plan_state(plan: Plan) -> dict[str, Any]:
    """The plan's shardings in a checkpoint-friendly form (plain types)."""
    return {
        "world_size": plan.world_size,
        "tables": {
            t.table.name: {
                "kind": t.sharding.kind,
                "world_size": t.sharding.world_size,
                "ranks": list(t.sharding.ranks),
                "row_bounds": list(t.sharding.row_bounds) if t.sharding.row_bounds else None,
                "capacity_per_rank": t.sharding.capacity_per_rank,
                "optimizer": type(t.optimizer).__name__,
            }
            for t in plan.tables
        },
    }


def _sharding(d: dict[str, Any]) -> TableSharding:
    bounds = d.get("row_bounds")
    return TableSharding(
        d["kind"], d["world_size"], tuple(d["ranks"]), tuple(bounds) if bounds else None, d.get("capacity_per_rank")
    )


def tables_for_rank(plan: Plan, rank: int, saved: dict[str, Any], shards: list[dict[str, Dump]]) -> dict[str, Dump]:
    """The dump of every table ``rank`` holds under ``plan``, from a checkpoint written under
    ``saved`` (:func:`plan_state`) whose rank ``r`` wrote ``shards[r]``."""
    out: dict[str, Dump] = {}
    for t in plan.tables:
        name, new = t.table.name, t.sharding
        if not new.holds(rank):
            continue
        old = _sharding(saved["tables"][name]) if name in saved.get("tables", {}) else None
        if old is None:
            raise ValueError(f"the checkpoint has no table '{name}'")
        if old == new and name in shards[rank]:
            out[name] = shards[rank][name]  # the same shard: as it was written, slots and all
            continue
        merged = _merge(name, old, shards)
        out[name] = _split(merged, new, rank, dynamic=t.table.dynamic is not None)
    return out


def _merge(name: str, old: TableSharding, shards: list[dict[str, Dump]]) -> Dump:
    # The whole table is on its first rank (data-parallel replicas are identical: one is written).
    holders = old.ranks[:1] if old.kind in ("data_parallel", "table_wise") else old.ranks
    missing = [r for r in holders if r >= len(shards) or name not in shards[r]]
    if missing:
        raise ValueError(f"table '{name}': the checkpoint lacks the shards of ranks {missing}")
    parts = [shards[r][name] for r in holders]
    if len(parts) == 1:
        return parts[0]
    merged: Dump = {"step": parts[0]["step"]}
    for field in parts[0]:
        if field in ("step", "layout", "slots", "admission_slots"):
            continue  # slots and layouts belong to one shard's buckets: the merged table re-inserts
        merged[field] = torch.cat([p[field] for p in parts])
    if "keys" in merged:  # dynamic: keys ascending, like a dump
        order = torch.argsort(merged["keys"])
        for field in list(merged):
            if field not in ("step", *_ADMISSION) and merged[field].dim() and merged[field].shape[0] == order.numel():
                merged[field] = merged[field][order]
    return merged


def _split(merged: Dump, new: TableSharding, rank: int, dynamic: bool) -> Dump:
    if new.kind in ("data_parallel", "table_wise"):
        return merged
    if new.kind == "row_wise":
        start, end = new.rows_of(rank)
        return {k: (v if k == "step" else v[start:end]) for k, v in merged.items()}
    assert dynamic
    mine = key_owner(merged["keys"], new.world_size) == rank
    n = merged["keys"].numel()
    part: Dump = {}
    for k, v in merged.items():
        if k in ("layout", "slots", *_ADMISSION):  # (a table merged from one shard keeps its own slots)
            continue  # slots and layouts are the merged table's: the shard re-inserts its keys
        part[k] = v[mine] if (v.dim() and v.shape[0] == n and k != "step") else v
    if "admission_keys" in merged:
        theirs = key_owner(merged["admission_keys"], new.world_size) == rank
        part["admission_keys"] = merged["admission_keys"][theirs]
        part["admission_counts"] = merged["admission_counts"][theirs]
    return part
