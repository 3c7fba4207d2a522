"""A dynamic table's find + fused update at 4.2M Zipf ids a step, two ways: the find per
occurrence then the update's own sort of the slots (``find_two_choice`` + ``bag_update``), and
each distinct key found once with the occurrences grouped for the update on the way
(``find_grouped`` + ``bag_update(groups=...)``). Device time of each part, medians of ``--reps``
(CUDA events), the two ways in turn; the dynamic-step benchmark's table (10M Zipf ranks spread
over int64, 12.5M slots, D = 128, Adagrad). Usage:

    python benchmarks/grouped_find.py            # on a CUDA machine with Triton
"""

import argparse
import statistics
from collections import defaultdict

import torch

from dynarec.bench.common import Workload, insert_keys
from dynarec.embedding.hash_index import BucketedHashIndex
from dynarec.kernels import gpu
from dynarec.optim import Adagrad
from dynarec.optim.registry import definition


def timed(times: list[float], fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, its device time (us) appended to ``times``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn(*args, **kwargs)
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) * 1000)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--bags", type=int, default=262_144)
    p.add_argument("--pooling-factor", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=9)
    a = p.parse_args()
    w = Workload(num_embeddings=a.rows, dim=a.dim, bags=a.bags, pooling_factor=a.pooling_factor, num_batches=2)
    batches = [b.values().cuda() for b in w.batches(keys_over_int64=True)]
    slots_total = 16 * -(-a.rows * 5 // (4 * 16))  # make_table's dynamic capacity
    index = BucketedHashIndex(slots_total // 16, 16, "cuda")
    insert_keys(index, torch.unique(torch.cat(batches)))
    query = batches[0]
    lengths = torch.full((a.bags,), a.pooling_factor, dtype=torch.int64, device="cuda")
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device="cuda"), torch.cumsum(lengths, 0)])
    spec = Adagrad(lr=0.01)
    weight = torch.zeros(index.capacity, a.dim, device="cuda")
    states = {"momentum1": torch.zeros_like(weight)}
    grad_out = torch.randn(a.bags, a.dim, device="cuda")
    nb, bs = index.num_buckets, index.bucket_size

    def update(step, slots, groups=None):
        gpu.bag_update(
            definition(spec).kernel(spec, step), lr=spec.lr, weight=weight, states=states, rows=slots,
            offsets=offsets, per_sample_weights=None, grad_out=grad_out, groups=groups,
        )  # fmt: skip

    t = defaultdict(list)
    for rep in range(a.reps + 2):
        slots = timed(t["find"], gpu.find_two_choice, index.keys, index.tags, nb, bs, query)
        narrow = timed(t["slots.to(int32)"], slots.to, torch.int32)
        timed(t["sort of int32 slots"], torch.sort, narrow, stable=True)
        timed(t["bag_update (sorts)"], update, rep + 1, slots)
        grouped_slots, order, rows, counts = timed(
            t["find_grouped"], gpu.find_grouped, index.keys, index.tags, nb, bs, query
        )
        minors = int(counts[1])
        timed(t["bag_update (grouped)"], update, rep + 1, slots, gpu.RowGroups(order, rows, minors))
        if rep == 0:
            assert torch.equal(grouped_slots, slots) and int(counts[0]) == 0
            print(f"{query.numel():,} ids, {torch.unique(query).numel():,} distinct keys; minor occurrences {minors}")
    for k, v in t.items():
        print(f"{k:28s} {statistics.median(v[2:]):8.1f} us  (runs {', '.join(f'{x:.0f}' for x in v[2:])})")
    med = {k: statistics.median(v[2:]) for k, v in t.items()}
    before, after = med["find"] + med["bag_update (sorts)"], med["find_grouped"] + med["bag_update (grouped)"]
    print(f"find + update: per occurrence {before:.1f} us, grouped {after:.1f} us ({before - after:+.1f} us)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for rep in range(3):
            update(rep + 1, slots, gpu.RowGroups(*gpu.find_grouped(index.keys, index.tags, nb, bs, query)[1:3], minors))
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
