"""One fused Adagrad update (and the pooled forward) of a 1M-id Zipf step at D = 128 on a 10M-row
table, for Nsight Compute: the kernels launched after two warm-up steps are the ones to read.

    ncu --clock-control none -k regex:'_update_block_kernel|_pooled_kernel' -s 4 -c 2 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats python3 benchmarks/ncu_update.py
"""

import torch

from dynarec.bench.common import Workload
from dynarec.kernels import gpu
from dynarec.optim import Adagrad
from dynarec.optim.registry import definition


def main() -> None:
    w = Workload(num_embeddings=10_000_000, dim=128, bags=65_536, pooling_factor=16, num_batches=1)
    batch = w.batches(device="cpu")[0]
    rows = batch.values().cuda()
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(batch.lengths(), 0)]).cuda()
    weight = torch.zeros(w.num_embeddings, w.dim, device="cuda")
    states = {"momentum1": torch.zeros_like(weight)}
    spec = Adagrad(lr=0.01)
    for step in range(3):
        out = gpu.pooled_forward(weight, rows, offsets, None)
        grad = torch.randn_like(out)
        gpu.bag_update(
            definition(spec).kernel(spec, step + 1),
            lr=spec.lr,
            weight=weight,
            states=states,
            rows=rows,
            offsets=offsets,
            per_sample_weights=None,
            grad_out=grad,
        )
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
