"""The host syncs of a dynamic table's training step on a GPU, and where they are.

Runs training steps of one dynamic table (Adagrad) whose batches bring ``--new`` new keys each
(the rest seen before), under ``torch.cuda.set_sync_debug_mode("warn")``; prints the syncs of a
step by the dynarec source line that caused them, and the step time (host loop and device
finished) of such steps against steps with no new key, in the same run. Usage:

    python benchmarks/host_syncs.py --ids 1048576 --new 4096
"""

import argparse
import collections
import statistics
import time
import traceback
import warnings

import torch

from dynarec import DynamicTableOptions, EmbeddingCollection, JaggedBatch, TableConfig
from dynarec.optim import Adagrad


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ids", type=int, default=1 << 20, help="ids a step")
    p.add_argument("--new", type=int, default=4096, help="new keys a step")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    device = "cuda"
    gen = torch.Generator().manual_seed(0)
    capacity = 1 << 24
    table = TableConfig(
        name="t", dim=a.dim, features=["f"], dynamic=DynamicTableOptions(capacity, init_capacity=capacity)
    )
    coll = EmbeddingCollection([table], Adagrad(lr=0.01), device=device)
    seen = torch.randint(-(2**62), 2**62, (a.ids * 2,), generator=gen)

    def batch(new: int) -> JaggedBatch:
        ids = seen[torch.randint(0, seen.numel(), (a.ids - new,), generator=gen)]
        ids = torch.cat([ids, torch.randint(-(2**62), 2**62, (new,), generator=gen)])
        return JaggedBatch(
            ["f"], ids[torch.randperm(ids.numel(), generator=gen)], torch.ones(a.ids // 16, dtype=torch.int64) * 16
        ).pin_memory()

    for chunk in seen.split(a.ids):  # every seen key gets a row
        coll(JaggedBatch(["f"], chunk, torch.ones(chunk.numel() // 16, dtype=torch.int64) * 16))["f"].sum().backward()
    warm = [batch(0) for _ in range(4)]
    fresh = [batch(a.new) for _ in range(a.steps)]

    def run(batches: list[JaggedBatch]) -> tuple[list[float], list[float]]:
        hosts, totals = [], []
        for b in batches:
            torch.cuda.synchronize()
            start = time.perf_counter()
            coll(b)["f"].sum().backward()
            hosts.append(time.perf_counter() - start)
            torch.cuda.synchronize()
            totals.append(time.perf_counter() - start)
        return hosts, totals

    run(warm + fresh[:2])  # compiles the kernels
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if "/dynarec/" in f.filename]
        frame = ours[-1] if ours else stack[-1]  # the innermost dynarec line, else the innermost line
        sites[
            f"{frame.filename.split('/')[-1]}:{frame.lineno} {frame.line}" + ("" if ours else " (outside dynarec)")
        ] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        coll(fresh[2])["f"].sum().backward()
        torch.cuda.set_sync_debug_mode(0)
    print(f"== host syncs of one training step with {a.new:,} new keys in {a.ids:,} ids: {sum(sites.values())}")
    for where, n in sites.most_common():
        print(f"{n:3d}  {where}")
    for name, batches in (("no new key", warm * (a.steps // 4)), (f"{a.new:,} new keys", fresh[3:])):
        hosts, totals = run(batches)
        print(
            f"{name:<16} step {statistics.median(totals) * 1e3:.3f} ms (median of {len(totals)}; the host loop "
            f"{statistics.median(hosts) * 1e3:.3f} ms)"
        )


if __name__ == "__main__":
    main()
