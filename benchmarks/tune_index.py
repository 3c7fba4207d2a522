"""The hash index's find and place kernels alone, by keys a program and warps: device time (CUDA events, median
of 9) of a find of 4.2M Zipf(1.05) keys (the dynamic step's query at 4.2M ids: hot keys repeat)
and of 2M uniform keys (half absent) in 64M slots at load 0.5; of the same Zipf keys in a table
shaped as dynamic-step's (12.5M slots, 7.6M keys); and of placing 1M new keys (with the
journal's read-back). Then the insert's three kernels (``insert_free``, the first kernel finding)
on 1M new uniform keys into the 64M slots, by occurrences a program and warps (each run undone).
Usage, on a CUDA machine with Triton:

    python benchmarks/tune_index.py [--insert-only] [--reps N]

Event timings of the insert vary run to run (the same configuration 229-365 us on an H200); for
stable per-kernel durations run its insert section under Nsight Compute, which locks the clocks
(a kernel's grid and block in ncu's report give its configuration):

    ncu -k regex:'_contest_kernel|_rank_kernel|_write_claims_kernel' --section SpeedOfLight \\
        --section Occupancy --section LaunchStats python benchmarks/tune_index.py --insert-only --reps 1
"""

import argparse
import functools
import statistics
from collections.abc import Callable

import numpy as np
import torch

from dynarec.bench.common import filled_hash_index, insert_keys
from dynarec.embedding.hash_index import BucketedHashIndex
from dynarec.kernels import gpu

# The fastest three of (64, 2), (128, 2), (128, 4), (256, 4), (256, 8), (512, 4), (512, 8), (1024, 8) in
# two runs (benchmarks/results/issue12-round5-h200.txt, issue12-round8-h200.txt)
CONFIGS = [(64, 2), (128, 4), (256, 8)]
INSERT_CONFIGS = [
    (32, 1), (32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 2), (128, 4), (128, 8), (256, 4), (256, 8)
]  # fmt: skip


def device_ms(fn: Callable[[], object], reps: int = 9) -> float:
    times = []
    for i in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--insert-only", action="store_true", help="only the insert's kernels")
    parser.add_argument("--reps", type=int, default=9, help="timed runs of each insert configuration")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    slots = 1 << 26
    index, keys = filled_hash_index(slots, 0.5, "cuda", gen)
    rank = np.random.default_rng(0).zipf(1.05, 1 << 22) % keys.numel()
    zipf = keys[torch.from_numpy(rank).cuda()]
    uniform = torch.cat([keys[: 1 << 20], torch.randint(-(2**62), 2**62, (1 << 20,), generator=gen).cuda()])
    new = torch.randint(-(2**62), 2**62, (1 << 20,), generator=gen).cuda()
    new = new[index.find(new) < 0].unique()
    plan = index.plan_insert(new, allow_evict=False, keys_ascending=True)
    arrays = (index.keys, index.scores, index.tags)  # placing into the same slots again each time
    step = BucketedHashIndex(12_500_000 // 16, 16, "cuda")  # dynamic-step's table at 4.2M ids
    step_keys = keys[:7_622_624]
    insert_keys(step, step_keys)
    step_zipf = step_keys[torch.from_numpy(rank % step_keys.numel()).cuda()]
    print(f"== {index.size:,} keys in {index.capacity:,} slots; {new.numel():,} keys placed")
    for block, warps in [] if args.insert_only else CONFIGS:
        find = functools.partial(gpu.find_two_choice, block=block, num_warps=warps)
        place = functools.partial(gpu.place_keys, *arrays, plan.slots, new, torch.zeros_like(new))
        f = [
            device_ms(functools.partial(find, t.keys, t.tags, t.num_buckets, 16, q))
            for t, q in ((index, zipf), (index, uniform), (step, step_zipf))
        ]
        p = device_ms(functools.partial(place, block, warps))
        print(
            f"block {block:>4} warps {warps}: find zipf {f[0] * 1e3:7.1f} us "
            f"({zipf.numel() / f[0] / 1e6:5.1f} B keys/s), uniform {f[1] * 1e3:6.1f} us "
            f"({uniform.numel() / f[1] / 1e6:5.1f} B keys/s), dynamic-step's zipf {f[2] * 1e3:6.1f} us "
            f"({step_zipf.numel() / f[2] / 1e6:5.1f} B keys/s); place {p * 1e3:6.1f} us"
        )

    print(f"== insert_free of {new.numel():,} new keys (contest, rank, write kernels)")
    for block, warps in INSERT_CONFIGS:
        times = []
        for i in range(args.reps + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            got, status = gpu.insert_free(
                index.keys, index.tags, index.num_buckets, 16, new, block=block, num_warps=warps
            )[:2]
            end.record()
            placed = got[status == 1]
            index.keys.index_fill_(0, placed, 0)
            index.tags.index_fill_(0, placed, 0)
            torch.cuda.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end))
        t = statistics.median(times)
        print(f"block {block:>4} warps {warps}: {t * 1e3:6.1f} us ({new.numel() / t / 1e6:5.2f} B keys/s)")


if __name__ == "__main__":
    main()
