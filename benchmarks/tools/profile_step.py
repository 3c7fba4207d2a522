"""Where a fused step's time goes: the torch profiler over a few steps of one table (fixed or
dynamic), kernels sorted by device time. Usage:

    python benchmarks/tools/profile_step.py --device cuda --kind dynamic --rows 10000000 --dim 128

``--host`` profiles the host side instead (cProfile: Python and launch overhead per step). On a
GPU it also prints, per kernel, how much of its time ran beside a kernel of another stream (a
dynamic table's finds run on the input stream, beside the backward).
"""

import argparse
import cProfile
import json
import pstats
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from tool_config import add_table_step_arguments, run_table_step, table_step  # beside this script
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    p = argparse.ArgumentParser()
    add_table_step_arguments(p)
    p.add_argument("--rows-shown", type=int, default=25)
    p.add_argument("--host", action="store_true", help="cProfile the host side")
    a = p.parse_args()
    w, batches, coll = table_step(a)

    def step(i: int) -> None:
        run_table_step(coll, batches, i)

    warm = w.num_batches
    for i in range(warm):  # warm-up: compiles the kernels, inserts every key of the Zipf draws
        step(i)
    timed = range(warm, warm + a.steps)  # (with --new-keys: batches no step ran before)
    if a.host:
        host = cProfile.Profile()
        host.enable()
        for i in timed:
            step(i)
        host.disable()
        print(f"== host side of {a.steps} steps, {a.kind} table, {w.ids_per_step:,} ids a step")
        pstats.Stats(host).sort_stats("tottime").print_stats(a.rows_shown)
        return
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for i in timed:
            step(i)
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if a.device.startswith("cuda") else "self_cpu_time_total"
    print(f"== {a.kind} table, {w.ids_per_step:,} ids a step, {a.steps} steps")
    print(prof.key_averages().table(sort_by=key, row_limit=a.rows_shown, max_name_column_width=60))
    if a.device.startswith("cuda"):
        print_overlap(prof, a.steps)


def print_overlap(prof, steps: int) -> None:
    """Per kernel (by device time): microseconds a step, and how many of them ran beside a kernel
    of another stream (from the profiler's trace: each kernel's stream, start and duration)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)  # replaces the file: read it again by its name
        trace = json.loads(Path(f.name).read_text())
    kernels = [
        (e["ts"], e["ts"] + e["dur"], e["args"].get("stream"), e["name"])
        for e in trace["traceEvents"]
        if e.get("cat") == "kernel"
    ]
    total: dict[str, float] = defaultdict(float)
    beside: dict[str, float] = defaultdict(float)
    for start, end, stream, name in kernels:
        total[name] += end - start
        spans = sorted(
            (max(s, start), min(e, end)) for s, e, st, _ in kernels if st != stream and s < end and e > start
        )
        covered, reach = 0.0, start
        for s, e in spans:  # the union of the other streams' kernels within this one's span
            if e > reach:
                covered += e - max(s, reach)
                reach = e
        beside[name] += covered
    print("== per kernel: us a step, of which beside another stream's kernel")
    for name in sorted(total, key=total.get, reverse=True)[:12]:  # type: ignore[arg-type]
        print(f"{total[name] / steps:9.1f} {beside[name] / steps:9.1f}  {name[:80]}")


if __name__ == "__main__":
    main()
