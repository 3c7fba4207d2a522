"""The hash index's find and place kernels alone, by keys a program and warps: device time (CUDA
events, median of 9) of a find of 4.2M Zipf(1.05) keys (the dynamic step's query at 4.2M ids: hot keys repeat)
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
from typing import Optional

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


def device_ms(fn: Callable[[], object], reps: int = 9, after: Optional[Callable[[object], object]] = None) -> float:
    """Median device time (ms) of ``fn`` over ``reps`` runs after two untimed ones (CUDA events);
    ``after(fn's result)``, untimed, follows each run (an undo)."""
    times = []
    for i in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        if after is not None:
            after(result)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def empty_slots(index: BucketedHashIndex, slots: torch.Tensor) -> None:
    """Key and tag 0 at ``slots`` (filled here by a kernel called directly, so ``index.size`` never
    counted them, and scores 0: never written)."""
    index.keys.index_fill_(0, slots, 0)
    index.tags.index_fill_(0, slots, 0)


def tune_find_and_place(index: BucketedHashIndex, keys: torch.Tensor, uniform: torch.Tensor, new: torch.Tensor) -> None:
    """The find (Zipf, uniform, and Zipf in dynamic-step's table) and the place kernel by CONFIGS;
    the index is left as it was (the placed keys removed again)."""
    rank = np.random.default_rng(0).zipf(1.05, 1 << 22) % keys.numel()
    zipf = keys[torch.from_numpy(rank).cuda()]
    plan = index.plan_insert(new, allow_evict=False, keys_ascending=True)
    arrays = (index.keys, index.scores, index.tags)  # placing into the same slots again each time
    step = BucketedHashIndex(12_500_000 // 16, 16, "cuda")  # dynamic-step's table at 4.2M ids
    step_keys = keys[:7_622_624]
    insert_keys(step, step_keys)
    step_zipf = step_keys[torch.from_numpy(rank % step_keys.numel()).cuda()]
    for block, warps in CONFIGS:
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
    empty_slots(index, plan.slots[plan.slots >= 0])  # the placed keys out again: the insert section inserts them


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--insert-only", action="store_true", help="only the insert's kernels")
    parser.add_argument("--reps", type=int, default=9, help="timed runs of each insert configuration")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    index, keys = filled_hash_index(1 << 26, 0.5, "cuda", gen)
    uniform = torch.cat([keys[: 1 << 20], torch.randint(-(2**62), 2**62, (1 << 20,), generator=gen).cuda()])
    new = torch.randint(-(2**62), 2**62, (1 << 20,), generator=gen).cuda()
    new = new[index.find(new) < 0].unique()
    print(f"== {index.size:,} keys in {index.capacity:,} slots; {new.numel():,} keys placed")
    if not args.insert_only:
        tune_find_and_place(index, keys, uniform, new)

    def undo(result) -> None:  # empties the slots the insert filled (its first claiming occurrences')
        empty_slots(index, result.slots[result.status == 1])

    print(f"== insert_free of {new.numel():,} new keys (contest, rank, write kernels)")
    for block, warps in INSERT_CONFIGS:
        insert = functools.partial(
            gpu.insert_free, index.keys, index.tags, index.num_buckets, 16, new, block=block, num_warps=warps
        )
        t = device_ms(insert, args.reps, after=undo)
        print(f"block {block:>4} warps {warps}: {t * 1e3:6.1f} us ({new.numel() / t / 1e6:5.2f} B keys/s)")


if __name__ == "__main__":
    main()
