"""The Triton fused update alone, by kernel (``scan``: a block as one tile summed by a segmented
scan; ``run``: a block's occurrences read one at a time) and block length: device time of ``bag_update``
(Adagrad) on Zipf(1.05) ids of a 10M-row table, median of 7 (CUDA events), and the bytes it must
move (docs/benchmarks.md's backward share: gradient reads, and per unique row its weight and
state read and written) over that time. Picks ``bag_update``'s default block. Usage:

    python benchmarks/tune_update.py            # on a CUDA machine with Triton
"""

import statistics

import torch

from dynarec.bench.common import Workload
from dynarec.kernels import gpu
from dynarec.optim import Adagrad
from dynarec.optim.registry import definition


def time_update(w: Workload, block: int, kernel: str, reps: int = 7) -> tuple[float, float]:
    """``(median ms, unique fraction)`` of one fused update of a step of ``w``."""
    dev = "cuda"
    batch = w.batches(device="cpu")[0]
    rows = batch.values().to(dev)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(batch.lengths(), 0)]).to(dev)
    weight = torch.zeros(w.num_embeddings, w.dim, device=dev)
    states = {"momentum1": torch.zeros_like(weight)}
    grad_out = torch.randn(w.bags, w.dim, device=dev)
    spec = Adagrad(lr=0.01)
    times = []
    for i in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gpu.bag_update(
            definition(spec).kernel(spec, i + 1),
            lr=spec.lr,
            weight=weight,
            states=states,
            rows=rows,
            offsets=offsets,
            per_sample_weights=None,
            grad_out=grad_out,
            block=block,
            kernel=kernel,
        )
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times), torch.unique(rows).numel() / rows.numel()


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
