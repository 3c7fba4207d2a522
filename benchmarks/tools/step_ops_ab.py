"""A fixed table's step and a dynamic table's step on the same ids, in one process, their
windows of steps alternated (fixed, dynamic, fixed, ...) so that a drifting machine moves both
alike: each op's own host time a step, averaged over the windows, under torch's profiler (CPU
only: on a GPU, ``profile_step.py`` gives each kernel's device time). The default shape is
``dynarec bench dynamic-step``'s (1M rows, dim 64, 4,096 bags of 20). Usage:

    python benchmarks/tools/step_ops_ab.py --device cpu --new-keys 0.05
    python benchmarks/tools/step_ops_ab.py --new-keys 0.05 --threads 1
"""

import argparse
from collections import defaultdict

import torch
from tool_config import add_table_step_arguments, run_table_step, table_step  # beside this script
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    p = argparse.ArgumentParser()
    add_table_step_arguments(p, rows=1_000_000, dim=64, steps=48)
    p.set_defaults(bags=4096, pooling_factor=20)
    p.add_argument("--window", type=int, default=8, help="steps of one kind between switches")
    p.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's)")
    a = p.parse_args()
    if a.device != "cpu":
        p.error(
            f"--device {a.device}: this tool times the ops on the host; on a GPU, profile_step.py times the kernels"
        )
    if a.threads:
        torch.set_num_threads(a.threads)
    kinds = {kind: table_step(argparse.Namespace(**{**vars(a), "kind": kind})) for kind in ("fixed", "dynamic")}
    warm = 4

    def step(kind: str, i: int) -> None:
        _, batches, coll = kinds[kind]
        run_table_step(coll, batches, i)

    for kind in kinds:
        for i in range(warm):
            step(kind, i)
    windows = max(1, a.steps // a.window)
    own: dict[str, dict[str, float]] = {kind: defaultdict(float) for kind in kinds}
    for w in range(windows):
        for kind in kinds:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(warm + w * a.window, warm + (w + 1) * a.window):
                    step(kind, i)
            for e in prof.key_averages():
                own[kind][e.key] += e.self_cpu_time_total / (windows * a.window) / 1000
    ids = kinds["fixed"][0].ids_per_step
    print(f"== {ids:,} ids a step, {windows} windows of {a.window} steps a kind, alternated; ms a step (own host time)")
    ops = sorted(set(own["fixed"]) | set(own["dynamic"]), key=lambda k: -max(own["fixed"][k], own["dynamic"][k]))
    print(f"{'op':48s} {'fixed':>8s} {'dynamic':>8s}")
    for op in ops[:20]:
        print(f"{op[:48]:48s} {own['fixed'][op]:8.3f} {own['dynamic'][op]:8.3f}")
    print(f"{'all ops':48s} {sum(own['fixed'].values()):8.3f} {sum(own['dynamic'].values()):8.3f}")


if __name__ == "__main__":
    main()
