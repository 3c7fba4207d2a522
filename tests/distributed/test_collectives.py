"""The collectives of a sharded step do not grow with the number of tables: every routed table's
ids travel in one exchange and their pooled rows in another (torchrec's grouped input and output
distribution), and replicated tables of one dim and optimizer reduce their row gradients in one
all-reduce. Two real gloo processes count the calls a training step makes."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dynarec import DynamicTableOptions, JaggedBatch, TableConfig
from dynarec.distributed.collection import ShardedEmbeddingCollection
from dynarec.distributed.context import DistContext
from dynarec.optim import Adagrad
from dynarec.planner import plan_tables

pytestmark = pytest.mark.slow

COLLECTIVES = ("all_to_all_single", "all_reduce", "all_gather_object", "all_gather", "broadcast", "barrier")


def tables(n: int) -> list[TableConfig]:
    """``n`` routed fixed tables (half table-wise, half row-wise), ``n`` replicated ones, a dynamic
    key-hash table."""
    out = [TableConfig(name="user", dim=8, dynamic=DynamicTableOptions(1024), features=["user"])]
    for i in range(n):
        sharding = "table_wise" if i % 2 else "row_wise"
        out.append(TableConfig(name=f"t{i}", dim=8, num_embeddings=100, features=[f"f{i}"], sharding=sharding))
        out.append(TableConfig(name=f"r{i}", dim=8, num_embeddings=10, features=[f"g{i}"], sharding="data_parallel"))
    return out


def _count_step(rank: int, world: int, init_file: str, n: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    ctx = DistContext(rank, world, rank, torch.device("cpu"), 60.0, group=dist.group.WORLD)
    ctx.sparse_group = dist.new_group(backend="gloo")
    coll = ShardedEmbeddingCollection(plan_tables(tables(n), world, optimizer=Adagrad(lr=0.1)), ctx)
    g = torch.Generator().manual_seed(rank)
    features = {"user": 1 << 40, **{f"f{i}": 100 for i in range(n)}, **{f"g{i}": 10 for i in range(n)}}
    kjt = JaggedBatch.from_lists(
        {k: [[int(torch.randint(0, m, (1,), generator=g))] for _ in range(4)] for k, m in features.items()}
    )
    calls = {name: 0 for name in COLLECTIVES}
    real = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return real[name](*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    out = coll(kjt)
    sum(v.sum() for v in out.values()).backward()
    for name in COLLECTIVES:
        setattr(dist, name, real[name])
    if rank == 0:
        queue.put(calls)
    dist.barrier()
    dist.destroy_process_group()


def count_step(n: int) -> dict[str, int]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_count_step, args=(r, 2, os.path.join(d, "init"), n, queue)) for r in range(2)]
        for p in procs:
            p.start()
        calls = queue.get(timeout=120)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    return calls


def test_a_steps_collectives_do_not_grow_with_the_number_of_tables():
    few, many = count_step(2), count_step(8)
    assert few == many, (few, many)
    # ids and counts forward, pooled rows forward and their gradients backward; the replicated
    # tables' one row-gradient all-reduce and the step's agreement.
    assert few["all_to_all_single"] == 4 and few["all_reduce"] == 2, few
