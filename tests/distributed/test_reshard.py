"""dynarec.distributed.reshard: a checkpoint written at one world size, split for another."""

import dataclasses

import pytest
import torch

from dynarec.config import config_from_dict
from dynarec.distributed.collection import shard_init_capacity
from dynarec.distributed.reshard import plan_state, tables_for_rank
from dynarec.embedding.collection import EmbeddingCollection
from dynarec.embedding.dynamic import DynamicTable
from dynarec.embedding.jagged import JaggedBatch
from dynarec.planner import plan_from_config
from tests.pipeline_fixtures import config_dict


def _shard_table(plan, name: str) -> DynamicTable:
    """A fresh dynamic table as a rank of ``plan`` holds ``name`` (its capacity share)."""
    t = next(t for t in plan.tables if t.table.name == name)
    s, d = t.sharding, t.table.dynamic
    init = shard_init_capacity(d.init_capacity, s.world_size, d.bucket_size, s.capacity_per_rank)
    return DynamicTable(t.table, t.optimizer, torch.device("cpu"), capacity=(init, s.capacity_per_rank))


def _split_one(plan, rank: int, saved_plan: dict, dump: dict) -> dict:
    """Rank ``rank``'s share of the user table's ``dump`` in ``plan`` (its other tables left out)."""
    only = dataclasses.replace(plan, tables=tuple(t for t in plan.tables if t.table.name == "user_id"))
    return tables_for_rank(only, rank, saved_plan, [{"user_id": dump}])["user_id"]


@pytest.mark.parametrize("max_capacity, bucket_size", [(16, 16), (512, 8)])
def test_a_one_process_table_with_admission_counts_splits_into_shards(max_capacity, bucket_size):
    """A one-process checkpoint resumed by two: the split kept the whole table's counter slots
    beside each shard's share of its keys, so a shard whose counter is as large as the whole
    one's (max_capacity at most a bucket a rank) installed slots of other length than its keys
    (a RuntimeError traceback, a QA pass). Each shard re-places its share; every row, state and
    count arrives once."""
    c = config_dict()
    c["feature_configs"][0]["id_feature"]["dynamicemb"] = {
        "max_capacity": max_capacity, "init_capacity": 16, "bucket_size": bucket_size, "admission": {"threshold": 2},
    }  # fmt: skip
    config = config_from_dict(c)
    one, two = plan_from_config(config), plan_from_config(config, world_size=2)
    planned = next(t for t in one.tables if t.table.name == "user_id")
    coll = EmbeddingCollection([planned.table], planned.optimizer)
    keys = (torch.arange(3 * max_capacity) % (2 * max_capacity)) * 7919 + 1  # half seen twice, half once
    for step in keys.split(8):
        out = coll(JaggedBatch.from_lists({"user_id": [[k] for k in step.tolist()]}))
        out["user_id"].sum().backward()
    dump = coll.tables["user_id"].dump()
    assert dump["admission_keys"].numel() > 0
    counts = dict(zip(dump["admission_keys"].tolist(), dump["admission_counts"].tolist()))
    rows = set(dump["keys"].tolist())
    got_counts, got_rows = {}, set()
    for rank in range(2):
        shard = _split_one(two, rank, plan_state(one), dump)
        assert "admission_slots" not in shard and "slots" not in shard
        t = _shard_table(two, "user_id")
        report = t.load(shard)
        assert report["dropped"] == 0
        back = t.dump()
        got_rows |= set(back["keys"].tolist())
        got_counts.update(zip(back["admission_keys"].tolist(), back["admission_counts"].tolist()))
        assert report["admission_dropped"] == shard["admission_keys"].numel() - back["admission_keys"].numel()
    assert got_rows == rows
    assert {k: v for k, v in counts.items() if k in got_counts} == got_counts


def test_full_shards_load_into_one_process_to_be_read_with_every_key_and_are_refused_for_training():
    """Two ranks' shards, each full (as a table that evicts runs), merged into one process: one
    index of max_capacity's buckets cannot place them all (a bucket overflows before the table
    is full), so evaluate, export and predict of a 2-rank model failed. A table loaded to be
    read takes the buckets its keys need; one to be trained still says what it cannot hold."""
    from dynarec.planner.sharding import key_owner

    c = config_dict()
    c["feature_configs"][0]["id_feature"]["dynamicemb"] = {"max_capacity": 256, "score_strategy": "step"}
    config = config_from_dict(c)
    one, two = plan_from_config(config), plan_from_config(config, world_size=2)
    keys = torch.arange(1, 5001) * 7919
    shards = []
    for rank in range(2):
        t = _shard_table(two, "user_id")
        for mine in keys[key_owner(keys, 2) == rank].split(16):  # the table evicts to take them
            t.write_rows(mine, {"weight": mine.float().unsqueeze(1).expand(-1, t.dim).contiguous()})
        assert t.size == t.max_capacity  # full
        shards.append({"user_id": t.dump()})
    only = dataclasses.replace(one, tables=tuple(t for t in one.tables if t.table.name == "user_id"))
    merged = tables_for_rank(only, 0, plan_state(two), shards)["user_id"]
    n = merged["keys"].numel()
    planned = next(t for t in one.tables if t.table.name == "user_id")

    trained = DynamicTable(planned.table, planned.optimizer, torch.device("cpu"))
    report = trained.load(merged)
    assert report["dropped"] > 0 and report["loaded"] + report["dropped"] == n

    read = DynamicTable(planned.table, planned.optimizer, torch.device("cpu"))
    assert read.load(merged, to_read=True) == {"loaded": n, "dropped": 0, "admission_dropped": 0}
    assert read.size == n == 256 and read.max_capacity > 256  # (more buckets than max_capacity: its keys need them)
    rows = read.read_rows(merged["keys"])
    assert bool(rows["present"].all())
    torch.testing.assert_close(rows["weight"][:, 0], merged["keys"].float(), rtol=0, atol=0)
