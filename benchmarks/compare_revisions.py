"""Revision against revision: one ``dynarec bench`` command on two git revisions, interleaved.

    python benchmarks/compare_revisions.py BEFORE [AFTER] [--rounds 5] -- fused-step --runs 3

``BEFORE`` and ``AFTER`` are anything ``git rev-parse`` takes (a sha, a branch, ``HEAD~3``);
without ``AFTER`` the second side is this checkout as it is, uncommitted changes included. Each
revision is checked out with ``git worktree add --detach`` into a temporary directory (removed,
and unregistered, at the end) and its C++ extensions are built there before anything is timed.
Each round runs the benchmark once in a fresh process per side, the order alternating from one
round to the next (before, after; after, before; ...), every process with its side's ``dynarec``
first on ``PYTHONPATH`` (checked: the process imports that tree's package) and this interpreter,
so both see the same torch, FBGEMM and machine state. Every rate in the reports (``*_per_s``
and ``*_per_s_median`` leaves) is compared: the table prints each side's median over the rounds
and the median of the per-round ratios after / before. ``--json`` also writes them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

CHECKOUT = Path(__file__).resolve().parents[1]


def _git(*argv: str, cwd: Path = CHECKOUT) -> str:
    return subprocess.run(["git", *argv], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def rates(node: Any, path: tuple[str, ...] = ()) -> dict[str, float]:
    """``{path: value}`` of every rate leaf (``*_per_s``, ``*_per_s_median``) of a bench report."""
    out: dict[str, float] = {}
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, (int, float)) and (k.endswith("_per_s") or k.endswith("_per_s_median")):
                out["/".join((*path, k.removesuffix("_median")))] = float(v)
            else:
                out.update(rates(v, (*path, k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.update(rates(v, (*path, str(i))))
    return out


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def prepare(tree: Path) -> None:
    """Checks that a process started for ``tree`` imports its ``dynarec``, and builds the tree's
    C++ extensions (a minute of g++ in a fresh tree) before anything is timed."""
    with tempfile.TemporaryDirectory() as cwd:  # not a checkout: nothing on sys.path but PYTHONPATH's
        found = subprocess.run(
            [sys.executable, "-c", "import dynarec; print(dynarec.__file__)"],
            env=_env(tree),
            cwd=cwd,
            capture_output=True,
            text=True,
        )
        if found.returncode != 0:
            raise SystemExit(f"{tree}'s dynarec does not import:\n{found.stderr[-2000:]}")
        where = found.stdout.strip()
        if not Path(where).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"a process for {tree} imports dynarec from {where}")
        build = "from dynarec.kernels import cpu; cpu.build()\nfrom dynarec.features import native; native.build()\n"
        done = subprocess.run([sys.executable, "-c", build], env=_env(tree), cwd=cwd, capture_output=True, text=True)
        if done.returncode != 0:
            reason = (done.stderr.strip().splitlines() or ["no message"])[-1]
            print(f"note: building {tree}'s C++ extensions ahead failed ({reason}); its runs build them or do without")


def run(tree: Path, bench_args: list[str]) -> dict[str, float]:
    """One ``dynarec bench`` process on ``tree``; the rates of its report."""
    with tempfile.TemporaryDirectory() as cwd:
        report = os.path.join(cwd, "report.json")
        subprocess.run(
            [sys.executable, "-m", "dynarec", "bench", *bench_args, "--json", report],
            env=_env(tree),
            cwd=cwd,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        with open(report) as f:
            return rates(json.load(f)["results"])


@contextlib.contextmanager
def worktree(revision: str, parent: Path) -> Iterator[Path]:
    """``revision`` checked out (detached) under ``parent``; removed and unregistered on exit."""
    sha = _git("rev-parse", "--verify", f"{revision}^{{commit}}")
    path = parent / sha[:12]
    _git("worktree", "add", "--detach", str(path), sha)
    try:
        yield path
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=CHECKOUT, check=False)
        subprocess.run(["git", "worktree", "prune"], cwd=CHECKOUT, check=False)


def compare(before: Path, after: Path, bench_args: list[str], rounds: int) -> list[tuple[dict, dict]]:
    """``rounds`` interleaved rounds, the order alternating; each round's ``(before, after)`` rates."""
    out = []
    for r in range(rounds):
        if r % 2 == 0:
            b = run(before, bench_args)
            a = run(after, bench_args)
        else:
            a = run(after, bench_args)
            b = run(before, bench_args)
        out.append((b, a))
        common = [k for k in b if k in a and b[k] > 0]
        print(f"round {r + 1}: " + "; ".join(f"{k} {a[k] / b[k]:.3f}x" for k in common), flush=True)
    return out


def summary(results: list[tuple[dict, dict]]) -> dict[str, dict[str, float]]:
    """Per rate: each side's median over the rounds and the median of the per-round ratios."""
    keys = [k for k in results[0][0] if all(k in b and k in a and b[k] > 0 for b, a in results)]
    return {
        k: {
            "before": statistics.median(b[k] for b, _ in results),
            "after": statistics.median(a[k] for _, a in results),
            "after_over_before": statistics.median(a[k] / b[k] for b, a in results),
        }
        for k in keys
    }


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    bench_args = argv[split + 1 :]
    p = argparse.ArgumentParser(
        usage="compare_revisions.py BEFORE [AFTER] [--rounds N] [--json FILE] -- BENCHMARK [OPTIONS]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("before", help="a git revision")
    p.add_argument("after", nargs="?", help="a git revision (default: this checkout as it is)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="also write the comparison to this file")
    args = p.parse_args(argv[:split])
    if not bench_args:
        p.error("give the benchmark after --, e.g. HEAD~1 -- fused-step --runs 3")
    with tempfile.TemporaryDirectory(prefix="dynarec-compare-") as tmp, contextlib.ExitStack() as stack:
        before = stack.enter_context(worktree(args.before, Path(tmp)))
        after = stack.enter_context(worktree(args.after, Path(tmp))) if args.after else CHECKOUT
        names = {
            "before": f"{args.before} ({_git('rev-parse', '--short', 'HEAD', cwd=before)})",
            "after": f"{args.after} ({_git('rev-parse', '--short', 'HEAD', cwd=after)})"
            if args.after
            else f"this checkout ({_git('rev-parse', '--short', 'HEAD')}"
            + (", uncommitted changes" if _git("status", "--porcelain", "--untracked-files=no") else "")
            + ")",
        }
        for tree in (before, after):
            prepare(tree)
        results = compare(before, after, bench_args, args.rounds)
    table = summary(results)
    print(f"\ndynarec bench {' '.join(bench_args)}: {args.rounds} interleaved rounds (medians)")
    print(f"before: {names['before']}; after: {names['after']}")
    print(f"{'rate':<48} {'before':>14} {'after':>14} {'after/before':>13}")
    for k, v in table.items():
        print(f"{k:<48} {v['before']:>14,.0f} {v['after']:>14,.0f} {v['after_over_before']:>12.3f}x")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"revisions": names, "command": bench_args, "rounds": results, "summary": table}, indent=1)
        )


if __name__ == "__main__":
    main()
