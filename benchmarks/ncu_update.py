"""One fused Adagrad update (and the pooled forward) of a 1M-id Zipf step at D = 128 on a 10M-row
table, for Nsight Compute: the kernels launched after two warm-up steps are the ones to read
(benchmarks/results/issue12-round3-h200.txt, r3: ``_update_block_kernel``, the scan kernel, then
the kernel at D = 128).

    ncu --clock-control none -k regex:'_update_run_kernel|_pooled_kernel' -s 4 -c 2 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats python3 benchmarks/ncu_update.py
"""

import torch
from tune_update import AdagradUpdate  # this folder: run as a script

from dynarec.bench.common import Workload
from dynarec.kernels import gpu


def main() -> None:
    w = Workload(num_embeddings=10_000_000, dim=128, bags=65_536, pooling_factor=16, num_batches=1)
    update = AdagradUpdate(w)
    for step in range(3):
        out = gpu.pooled_forward(update.weight, update.rows, update.offsets, None)
        update.apply(step + 1, torch.randn_like(out))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
