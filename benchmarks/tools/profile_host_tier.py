"""Where a host-tier step's time goes: the fused step of a table in host memory with a device
cache (``dynarec bench host-tier``'s cached side, on its stream of fresh Zipf draws, each
batch's rows made resident two steps ahead) under torch's profiler, its ops and kernels by
device time, and the step's wall time.

    python benchmarks/tools/profile_host_tier.py --rows 40000000 --dim 128 --cache-load-factor 0.05 [--ids wrapped]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from dynarec.bench.common import Workload, _time_steps, make_table
from dynarec.bench.steps import OPTIMIZERS
from dynarec.embedding import EmbeddingCollection


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=40_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--bags", type=int, default=50_000)
    p.add_argument("--pooling-factor", type=int, default=20)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--ids", default="bounded", choices=["bounded", "wrapped"], help="as dynarec bench host-tier's")
    p.add_argument("--kind", default="fixed", choices=["fixed", "dynamic"])
    p.add_argument("--cache-load-factor", type=float, default=0.05)
    p.add_argument("--optimizer", default="adagrad")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=16)
    args = p.parse_args()
    count = args.warmup + 2 * args.steps + 2  # warm-up, timed, profiled; the prefetch depth beyond
    w = Workload(
        args.rows, args.dim, args.bags, args.pooling_factor, args.zipf, count, zipf_bounded=args.ids == "bounded"
    )
    batches = w.batches(keys_over_int64=args.kind == "dynamic", device="cuda")
    table = make_table(args.kind, "native", w)  # --cache-load-factor 0: the table whole on the device
    if args.cache_load_factor:
        table = dataclasses.replace(table, cache_load_factor=args.cache_load_factor)
    start = time.perf_counter()
    coll = EmbeddingCollection([table], OPTIMIZERS[args.optimizer], device="cuda")
    print(f"built in {time.perf_counter() - start:.1f} s")
    sync = torch.cuda.synchronize
    _time_steps(coll, batches, args.warmup, sync)  # warm: the cache holds the hot rows
    host, total = _time_steps(coll, batches, args.steps, sync, args.warmup)
    print(f"{1e3 * total / args.steps:.2f} ms a step ({100 * host / total:.0f}% in the host's loop)")
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        _time_steps(coll, batches, args.steps, sync, args.warmup + args.steps)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
