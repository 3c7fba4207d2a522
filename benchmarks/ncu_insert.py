"""The insert's three kernels (contest, rank, write) on 1M new uniform keys into 64M slots at load
0.5 (``find_or_insert``, undone through its journal), ``--calls`` times, for Nsight Compute: the
kernels of the calls after the first are the ones to read (the first compiles).

    ncu --clock-control none -k regex:'_contest_kernel|_rank_kernel|_write_claims_kernel' -s 3 -c 3 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats python3 benchmarks/ncu_insert.py
"""

import argparse

import torch

from dynarec.bench.common import filled_hash_index
from dynarec.embedding.step import Journal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    slots = 1 << 26
    index, _ = filled_hash_index(slots, 0.5, "cuda", gen)
    new = torch.randint(-(2**62), 2**62, (1 << 20,), generator=gen).cuda()
    for _ in range(args.calls):
        journal = Journal()
        index.find_or_insert(new, journal)
        journal.undo()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
