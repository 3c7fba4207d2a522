"""Host time of a fused step's sections (no device sync inside the timed loop): forward, loss,
backward (of which the update's host work: ``bag_update``), prefetch (the next batch's input
stage). A measuring tool: it wraps two of dynarec's kernel entry points in timers for its run.

    python benchmarks/tools/step_sections.py --device cuda --rows 10000000 --dim 128
"""

import argparse
import time
from collections import defaultdict

import torch
from tool_config import add_table_step_arguments, table_step  # beside this script

from dynarec.kernels.gpu import lookup, update

TOTALS: dict[str, float] = defaultdict(float)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - t

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser()
    add_table_step_arguments(p, device="cuda", rows=10_000_000, dim=128, steps=50)
    a = p.parse_args()
    if a.new_keys:
        p.error("--new-keys: this tool cycles 4 batches; profile_step.py runs a stream of new keys")
    _, batches, coll = table_step(a)
    update.bag_update = timed("  bag_update (python + launches)", update.bag_update)
    lookup.pooled_forward = timed("  pooled_forward (python + launch)", lookup.pooled_forward)
    sections = ["forward", "loss", "backward", "prefetch"]
    for _ in range(2):  # the first pass warms up
        TOTALS.clear()
        for i in range(a.steps):
            b, nxt = batches[i % 4], batches[(i + coll.prefetch_depth) % 4]
            t0 = time.perf_counter()
            out = coll(b)
            t1 = time.perf_counter()
            loss = out["f"].sum()
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            coll.prefetch(nxt)
            t4 = time.perf_counter()
            for name, d in zip(sections, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                TOTALS[name] += d
            if i % 10 == 9 and a.device.startswith("cuda"):
                torch.cuda.synchronize()
    total = sum(TOTALS[s] for s in sections)
    print(f"{a.kind}: host {1e6 * total / a.steps:.0f} us a step")
    for name, t in TOTALS.items():
        print(f"  {name:<40} {1e6 * t / a.steps:8.1f} us")


if __name__ == "__main__":
    main()
