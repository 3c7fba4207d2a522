"""A dynamic (or fixed) table's steps once the warm-up has filled it: the time a step, with the
allocator's counters, or (``--syncs``) every host sync of the timed steps, by where dynarec called
it (``torch.cuda.set_sync_debug_mode``). CUDA only. Usage:

    python benchmarks/tools/step_syncs.py --kind dynamic --rows 2000000 --dim 128 --bags 262144 \
        --new-keys 0.05 --steps 30 --warm 10 [--syncs]

With ``--new-keys`` the batches are a stream of ``4 + steps + 2`` batches: the first ``--warm``
steps fill the table, the rest are timed (the last 2 are only prefetched); without, ``--steps``
steps after the warm-up, over 4 batches.
"""

import argparse
import time
import traceback
import warnings
from collections import Counter

import torch
from tool_config import add_table_step_arguments, table_step  # beside this script


def main() -> None:
    p = argparse.ArgumentParser()
    add_table_step_arguments(p, device="cuda")
    p.add_argument("--warm", type=int, default=10, help="untimed steps first (they fill the table)")
    p.add_argument("--syncs", action="store_true", help="list the timed steps' host syncs instead")
    a = p.parse_args()
    w, batches, coll = table_step(a)
    n = len(batches)
    # a stream (--new-keys): each batch once, the last ones only prefetched; else 4 batches cyclically
    timed = range(a.warm, n - coll.prefetch_depth) if a.new_keys else range(a.warm, a.warm + a.steps)

    def step(i: int) -> None:  # as the trainer runs one
        coll(batches[i % n])["f"].sum().backward()
        coll.prefetch(batches[(i + coll.prefetch_depth) % n])

    warnings.simplefilter("ignore")  # a full table's dropped keys warn
    for i in range(a.warm):
        step(i)
    torch.cuda.synchronize()
    if a.syncs:
        seen: Counter = Counter()

        def where(*_args, **_kwargs) -> None:
            frames = [f for f in traceback.extract_stack()[:-2] if "dynarec" in f.filename]
            seen[" <- ".join(f"{f.filename.split('dynarec/')[-1]}:{f.lineno}" for f in reversed(frames[-3:]))] += 1

        warnings.showwarning = where
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        for i in timed:
            step(i)
        torch.cuda.set_sync_debug_mode(0)
        print(f"== {sum(seen.values())} syncs in {len(timed)} steps")
        for site, count in seen.most_common(20):
            print(f"{count:5d}  {site}")
        return
    before = torch.cuda.memory_stats()
    start = time.perf_counter()
    for i in timed:
        step(i)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    after = torch.cuda.memory_stats()
    per_step = total / len(timed)
    rate = w.ids_per_step / per_step / 1e6
    print(f"{a.kind}: {1e3 * per_step:.2f} ms a step ({rate:.0f} M ids/s), host loop {host / total:.0%}")
    for k in ("num_device_alloc", "num_device_free", "num_alloc_retries"):
        print(f"  {k}: {after.get(k, 0) - before.get(k, 0)}")


if __name__ == "__main__":
    main()
