"""Before/after a change: one ``dynarec bench`` command on two source trees, interleaved.

    python benchmarks/compare_revisions.py --before /tmp/before --after . --rounds 5 -- fused-step --runs 3

Each round runs the benchmark once in a fresh process per tree (before, after, before, ...), with
the tree's ``dynarec`` first on ``PYTHONPATH`` and this interpreter (so both see the same torch,
FBGEMM and machine state). Every rate in the reports (``*_per_s_median``) is compared: the table
prints each tree's median over rounds and the median of the per-round ratios after / before.
Make a ``before`` tree with ``git worktree add /tmp/before <rev>``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def _rates(node, path=()):
    """``{path: value}`` of every ``*_per_s_median`` leaf of a bench report."""
    out = {}
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, (int, float)) and k.endswith("_per_s_median"):
                out["/".join((*path, k.removesuffix("_per_s_median")))] = float(v)
            else:
                out.update(_rates(v, (*path, k)))
    return out


def run(tree: str, bench_args: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        code = "import sys; from dynarec.cli import main; sys.exit(main(sys.argv[1:]))"
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        subprocess.run(
            [sys.executable, "-c", code, "bench", *bench_args, "--json", report],
            env=env,
            check=True,
            cwd=tmp,
            stdout=subprocess.DEVNULL,
        )
        with open(report) as f:
            return _rates(json.load(f)["results"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    rounds: list[tuple[dict, dict]] = []
    for r in range(args.rounds):
        before, after = run(args.before, bench_args), run(args.after, bench_args)
        rounds.append((before, after))
        print(
            f"round {r + 1}: " + "; ".join(f"{k} {after[k] / before[k]:.3f}x" for k in before if k in after), flush=True
        )
    print(f"\n{' '.join(bench_args)}: {args.rounds} interleaved rounds (medians)")
    print(f"{'rate':<40} {'before':>12} {'after':>12} {'after/before':>13}")
    for k in rounds[0][0]:
        if k not in rounds[0][1]:
            continue
        b = statistics.median(x[0][k] for x in rounds)
        a = statistics.median(x[1][k] for x in rounds)
        ratio = statistics.median(x[1][k] / x[0][k] for x in rounds)
        print(f"{k:<40} {b / 1e6:>10.3f} M {a / 1e6:>10.3f} M {ratio:>12.3f}x")


if __name__ == "__main__":
    main()
