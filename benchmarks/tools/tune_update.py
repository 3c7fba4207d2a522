"""The GPU fused update's block length: each choice of ``Tuning.block`` (occurrences a program
takes) timed on the same steps of one table (its rows, states and Zipf ids, ``bench row-dtype``'s
shape by default), the choices alternated round by round in one process, each on its own copy of
the table; then every copy compared with the first. A run of equal rows that crosses blocks is
summed block by block, so the block length changes how its terms are grouped: choices agree
within float32 rounding, not bit for bit (the tool prints the share of equal values and the
largest difference). Usage, on a GPU:

    python benchmarks/tools/tune_update.py --blocks 32 64 128 256

On a CPU it runs the Triton kernels under the interpreter (``TRITON_INTERPRET=1``), for checking
the tool on a small table, not for timing.
"""

import argparse
import dataclasses
import statistics
import time

import torch

from dynarec.bench.common import Workload
from dynarec.bench.steps import OPTIMIZERS
from dynarec.kernels import gpu
from dynarec.kernels.gpu import update as gpu_update
from dynarec.optim import definition


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--bags", type=int, default=65536)
    p.add_argument("--pooling-factor", type=int, default=64)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="rowwise_adagrad")
    p.add_argument("--data-type", choices=["fp32", "bf16", "fp16"], default="fp32", help="the rows' storage type")
    p.add_argument("--kernel", choices=["run", "scan"], default=None, help="default: the tuning's for --dim")
    p.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--steps", type=int, default=10, help="updates a choice runs a round")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    if any(b < 1 or b & (b - 1) for b in a.blocks):
        p.error(f"--blocks must be powers of two, got {a.blocks}")
    device = torch.device(a.device)
    if device.type != "cuda" and not gpu.INTERPRETED:
        p.error("the Triton kernels run on a GPU, or on a CPU under TRITON_INTERPRET=1")
    spec = OPTIMIZERS[a.optimizer]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.data_type]

    w = Workload(num_embeddings=a.rows, dim=a.dim, bags=a.bags, pooling_factor=a.pooling_factor, num_batches=4)
    batches = [b.to(device) for b in w.batches()]
    g = torch.Generator(device="cpu").manual_seed(0)
    grads = [torch.randn(a.bags, a.dim, generator=g).to(device) for _ in batches]
    weight = (torch.rand(a.rows, a.dim, generator=g) - 0.5).to(device, dtype)
    states = {s.name: torch.full((a.rows, s.width(a.dim)), s.initial_value, device=device) for s in spec.state_specs()}
    tables = {b: (weight.clone(), {k: v.clone() for k, v in states.items()}) for b in a.blocks}
    del weight, states
    base = gpu_update.TUNING
    done = dict.fromkeys(a.blocks, 0)
    times: dict[int, list[float]] = {b: [] for b in a.blocks}

    def run(block: int, steps: int) -> float:
        gpu_update.TUNING = dataclasses.replace(base, kernel=a.kernel, block=block)
        table_weight, table_states = tables[block]
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            i = done[block] % len(batches)
            done[block] += 1
            args = definition(spec).kernel(spec, done[block])
            gpu.bag_update(
                args, lr=spec.lr, weight=table_weight, states=table_states, rows=batches[i].values(),
                offsets=batches[i].offsets(), per_sample_weights=None, grad_out=grads[i], key_offset=1000,
            )  # fmt: skip
        sync()
        return (time.perf_counter() - start) / steps

    for b in a.blocks:  # compiles each choice's kernels, and captures its update from its second step
        run(b, 2)
    for _ in range(a.rounds):
        for b in a.blocks:
            times[b].append(run(b, a.steps))
    kernel = a.kernel or base.kernel_for(gpu_update.row_block(a.dim))
    print(f"== {kernel} kernel, {w.ids_per_step:,} ids a step, {a.optimizer}, {a.data_type} rows, {a.rounds} rounds")
    for b in a.blocks:
        ms = statistics.median(times[b]) * 1e3
        print(f"block {b:>5}: {ms:8.3f} ms an update ({w.ids_per_step / ms / 1e3:8.1f} M ids/s; rounds "
              f"{', '.join(f'{t * 1e3:.3f}' for t in times[b])})")  # fmt: skip
    first, (w0, s0) = a.blocks[0], tables[a.blocks[0]]
    for b in a.blocks[1:]:
        wb, sb = tables[b]
        for name, x, y in [("weights", wb, w0)] + [(k, sb[k], s0[k]) for k in s0]:
            x, y = x.float(), y.float()
            equal, largest, scale = (x == y).float().mean(), (x - y).abs().max(), y.abs().max()
            print(f"block {b} against block {first}, {name} after {done[b]} steps: {equal:.6f} equal, "
                  f"largest difference {largest:.3g} (of values up to {scale:.3g})")  # fmt: skip
    gpu_update.TUNING = base


if __name__ == "__main__":
    main()
