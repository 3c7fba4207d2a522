"""The Triton fused update alone, by kernel (``scan``: a block as one tile summed by a segmented
scan; ``run``: a block's occurrences read one at a time) and block length: device time of ``bag_update``
(Adagrad) on Zipf(1.05) ids of a 10M-row table, median of 7 (CUDA events), and the bytes it must
move (docs/benchmarks.md's backward share: gradient reads, and per unique row its weight and
state read and written) over that time. Picks ``bag_update``'s default block. Usage:

    python benchmarks/tune_update.py            # on a CUDA machine with Triton
"""

import statistics
from typing import Optional

import torch

from dynarec.bench.common import Workload
from dynarec.kernels import gpu
from dynarec.optim import Adagrad
from dynarec.optim.registry import definition


class AdagradUpdate:
    """One step of ``w`` on the GPU (its Zipf ids and bag offsets), a zeroed table of
    ``w.num_embeddings`` rows with its Adagrad state, and :meth:`apply`, the fused update of a
    gradient of the step's bags. benchmarks/ncu_update.py profiles the same update."""

    def __init__(self, w: Workload):
        batch = w.batches(device="cpu")[0]
        self.rows = batch.values().cuda()
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(batch.lengths(), 0)]).cuda()
        self.weight = torch.zeros(w.num_embeddings, w.dim, device="cuda")
        self.states = {"momentum1": torch.zeros_like(self.weight)}
        self.spec = Adagrad(lr=0.01)

    def apply(self, step: int, grad_out: torch.Tensor, block: Optional[int] = None, kernel: Optional[str] = None):
        gpu.bag_update(
            definition(self.spec).kernel(self.spec, step),
            lr=self.spec.lr,
            weight=self.weight,
            states=self.states,
            rows=self.rows,
            offsets=self.offsets,
            per_sample_weights=None,
            grad_out=grad_out,
            block=block,
            kernel=kernel,
        )


def time_update(w: Workload, block: int, kernel: str, reps: int = 7) -> tuple[float, float]:
    """``(median ms, unique fraction)`` of one fused update of a step of ``w``."""
    update = AdagradUpdate(w)
    grad_out = torch.randn(w.bags, w.dim, device="cuda")
    times = []
    for i in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        update.apply(i + 1, grad_out, block=block, kernel=kernel)
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times), torch.unique(update.rows).numel() / update.rows.numel()


def main() -> None:
    print(f"{'D':>4} {'ids':>9} {'kernel':>7} {'block':>6} {'ms':>8} {'GB/s':>7}")
    for dim in (32, 64, 128):
        for bags in (65_536, 262_144):
            w = Workload(num_embeddings=10_000_000, dim=dim, bags=bags, pooling_factor=16, num_batches=1)
            for kernel, blocks in (("scan", (16, 32, 64)), ("run", (16, 32, 64, 128, 256))):
                for block in blocks:
                    ms, unique = time_update(w, block, kernel)
                    n = w.ids_per_step
                    nbytes = n * 4 * dim + n / w.pooling_factor * 4 * dim + unique * n * 16 * dim
                    print(f"{dim:>4} {n:>9,} {kernel:>7} {block:>6} {ms:>8.3f} {nbytes / ms / 1e6:>7.0f}", flush=True)


if __name__ == "__main__":
    main()
