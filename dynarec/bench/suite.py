"""``dynarec bench suite``: the headline benchmarks, each with its same-run baseline, recorded as
one dated results file.

Every case runs as its own ``dynarec bench`` process (the command recorded is the one to type to
repeat it). The suite writes ``<results-dir>/<YYYY-MM-DD>-<short sha>-<device>.json`` — the git
revision and whether the tree was dirty, the machine, the versions of Python, torch, Triton and
CUDA, every case's command, full report and figures (each with its baseline and their ratio) —
a short ``.md`` rendering beside it, and appends one row to ``<results-dir>/README.md``'s history
table. A case that fails is recorded with its error; the others still run, and the suite exits
with status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from dynarec.bench.common import same_dynarec

__all__ = ["CASES", "Case", "Figure", "add_suite_arguments", "environment", "figures_of", "run_suite"]

CHECKOUT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    """One benchmark of the suite: its name and arguments (``--json`` is added by the suite)."""

    benchmark: str
    args: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        return ["bench", self.benchmark, *self.args]


_GPU_SHAPE = ("--rows", "10000000", "--dim", "128", "--pooling-factor", "16")
# 26 dynamic tables in one group against 26 fixed ones (a Criteo-shaped model's sparse side):
# one id a bag, so the host's work a step, not the rows', bounds it.
_GROUP_SHAPE = ("--tables", "26", "--dim", "16", "--pooling-factor", "1")

CASES: dict[str, tuple[Case, ...]] = {
    # A few minutes on a 2-core machine.
    "cpu": (
        Case("e2e", ("--device", "cpu", "--batch", "512", "--train-rows", "30000", "--runs", "3")),
        Case("fused-step", ("--device", "cpu")),
        Case("dynamic-step", ("--device", "cpu")),
        Case(
            "dynamic-step", ("--device", "cpu", *_GROUP_SHAPE, "--rows", "2600000", "--bags", "1664", "--steps", "50")
        ),
        Case("sweep", ("--device", "cpu", "--grid-rows", "100000", "1000000", "--steps", "5", "--runs", "3")),
        Case("data-stage", ()),
        Case("hash-find", ("--device", "cpu")),
    ),
    # The design's quoting points: 1M ids a step at D=128 (the host bounds it), 4.2M (the GPU
    # does), a 64M-slot index, the trainer at batch 4096 with its automatic DataLoader workers.
    "cuda": (
        Case("e2e", ("--device", "cuda", "--batch", "4096", "--train-rows", "2000000")),
        # histories of 3 to 30, as the demo's data: batches of varying id counts (no whole-step replay)
        Case("e2e", ("--device", "cuda", "--batch", "4096", "--train-rows", "2000000", "--min-history", "3")),
        Case("fused-step", ("--device", "cuda", *_GPU_SHAPE, "--bags", "65536", "--steps", "30", "--runs", "7")),
        Case("dynamic-step", ("--device", "cuda", *_GPU_SHAPE, "--bags", "262144", "--steps", "10", "--runs", "7")),
        Case(
            "dynamic-step", ("--device", "cuda", *_GROUP_SHAPE, "--rows", "1000000", "--bags", "8320", "--steps", "20")
        ),
        Case("sweep", ("--device", "cuda")),
        Case("data-stage", ()),
        Case("hash-find", ("--device", "cuda", "--slots", str(1 << 26))),
    ),
}

_TINY_STEP = ("--rows", "2000", "--dim", "8", "--bags", "64", "--pooling-factor", "4")
_TINY_TIMING = ("--steps", "1", "--runs", "2", "--warmup", "1")


def _smoke_cases(device: str) -> tuple[Case, ...]:
    """Every case at a tiny size: proves the suite runs; its figures mean nothing."""
    return (
        Case("e2e", ("--device", device, "--batch", "256", "--train-rows", "3000", "--epochs", "2")),
        Case("fused-step", ("--device", device, *_TINY_STEP, *_TINY_TIMING)),
        Case("dynamic-step", ("--device", device, *_TINY_STEP, *_TINY_TIMING)),
        Case("sweep", ("--device", device, "--grid-rows", "2000", "--grid-bags", "64", *_TINY_TIMING)),
        Case("data-stage", ("--data-batch", "64", *_TINY_TIMING)),
        Case("hash-find", ("--device", device, "--slots", str(1 << 14), "--steps", "1", "--runs", "2")),
    )


@dataclass(frozen=True)
class Figure:
    """One measured figure beside its baseline: ``ratio`` is value / baseline_value (for the step
    benchmarks, the median of the per-run ratios of the interleaved runs)."""

    case: str
    what: str
    value: float
    unit: str
    baseline: Optional[str] = None
    baseline_value: Optional[float] = None
    ratio: Optional[float] = None
    headline: Optional[str] = None
    """A short name where the figure is one of the run's headline figures (the history table's)."""


def add_suite_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--smoke", action="store_true", help="every case at a tiny size (checks the suite runs; figures mean nothing)"
    )
    p.add_argument("--cases", nargs="+", metavar="NAME", help="run only these cases of the suite")
    p.add_argument("--results-dir", help="where the results file goes (default: this checkout's benchmarks/results)")


def _command(argv: list[str], cwd: Path) -> Optional[str]:
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _version(*distributions: str) -> Optional[str]:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def environment(device: str) -> dict[str, Any]:
    """What a result depends on: the revision (sha, whether tracked files differ from it), the
    machine (host, CPUs, load average, GPUs with their driver and clocks where ``nvidia-smi``
    answers) and the versions of Python and of the packages that run the code."""
    sha = _command(["git", "rev-parse", "HEAD"], CHECKOUT)
    status = _command(["git", "status", "--porcelain", "--untracked-files=no"], CHECKOUT) if sha else None
    gpus: list[dict[str, Any]] = []
    if torch.cuda.is_available():
        gpus = [{"name": torch.cuda.get_device_name(i)} for i in range(torch.cuda.device_count())]
        if shutil.which("nvidia-smi"):
            fields = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit"
            smi = _command(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], CHECKOUT)
            for gpu, line in zip(gpus, (smi or "").splitlines()):
                gpu.update(zip(fields.split(","), (x.strip() for x in line.split(","))))
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "date": now.strftime("%Y-%m-%d"),
        "time_utc": now.isoformat(timespec="seconds"),
        "device": device,
        "revision": {"sha": sha, "short": sha[:7] if sha else None, "dirty": None if status is None else status != ""},
        "machine": {
            "hostname": socket.gethostname(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),  # other processes on a shared host move every figure
            "platform": platform.platform(),
            "gpus": gpus,
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": _version("triton", "pytorch-triton"),
            "cuda": torch.version.cuda,
            "numpy": _version("numpy"),
            "pyarrow": _version("pyarrow"),
            "fbgemm_gpu": _version("fbgemm-gpu-cpu", "fbgemm-gpu"),
        },
    }


# -- figures ---------------------------------------------------------------------------------


def _median(node: dict[str, Any]) -> float:
    return float(node["ids_per_s_median"])


def _e2e(r: dict[str, Any]) -> Iterator[Figure]:
    peer = "plain PyTorch peer"
    ours, theirs = r["dynarec"], r["peer"]
    yield Figure(
        "e2e",
        "samples/s by the train report (rows trained / train_seconds)",
        ours["samples_per_s_report"],
        "samples/s",
        peer,
        theirs["samples_per_s"],
        r["dynarec_over_peer"],
        "e2e samples/s",
    )
    yield Figure(
        "e2e",
        "samples/s by the command's wall time",
        ours["samples_per_s_wall"],
        "samples/s",
        peer,
        theirs["samples_per_s"],
        r["dynarec_wall_over_peer"],
    )
    yield Figure(
        "e2e",
        "eval AUC",
        ours["eval_auc"],
        "AUC",
        peer,
        theirs["eval_auc"],
        ours["eval_auc"] / theirs["eval_auc"],
        "e2e AUC",
    )


def _fused_step(r: dict[str, Any]) -> Iterator[Figure]:
    what = "fixed table fused step, native"
    if "fbgemm" in r:
        yield Figure(
            "fused-step",
            what,
            _median(r["native"]),
            "ids/s",
            "FBGEMM TBE",
            _median(r["fbgemm"]),
            r["native_over_fbgemm"],
            "fused-step vs FBGEMM",
        )
    if "torch_sparse_adagrad" in r:
        yield Figure(
            "fused-step",
            what,
            _median(r["native"]),
            "ids/s",
            "nn.EmbeddingBag(sparse=True) + torch.optim.Adagrad",
            _median(r["torch_sparse_adagrad"]),
            r["native_over_torch_sparse"],
            None if "fbgemm" in r else "fused-step vs torch sparse",
        )
    if "GBps" in r:
        from dynarec.bench.common import HBM_ROOFLINE_GBPS

        yield Figure(
            "fused-step",
            f"{what}, bytes moved",
            r["GBps"],
            "GB/s",
            "HBM roofline",
            HBM_ROOFLINE_GBPS,
            r["fraction_of_roofline"],
            "fused-step of roofline",
        )
    if "fbgemm" not in r and "torch_sparse_adagrad" not in r:
        yield Figure("fused-step", what, _median(r["native"]), "ids/s")


def _dynamic_step(r: dict[str, Any]) -> Iterator[Figure]:
    for backend, v in r.items():
        what = f"dynamic table step [{backend}]"
        dynamic = _median(v["dynamic"])
        yield Figure(
            "dynamic-step",
            what,
            dynamic,
            "ids/s",
            "fixed table, same ids",
            _median(v["fixed"]),
            v["dynamic_over_fixed"],
            "dynamic / fixed" if backend == "native" else None,
        )
        if "fixed_scattered" in v:
            yield Figure(
                "dynamic-step",
                what,
                dynamic,
                "ids/s",
                "fixed table, ids scattered over its rows",
                _median(v["fixed_scattered"]),
                v["dynamic_over_fixed_scattered"],
            )


def _sweep(rows: list[dict[str, Any]]) -> Iterator[Figure]:
    if any("optimizer" in row for row in rows):  # the GPU sweep
        for row in rows:
            if "optimizer" in row:
                yield Figure(
                    "sweep",
                    f"{row['optimizer']} D={row['dim']}, {row['ids']:,} ids a step, bytes moved",
                    row["GBps"],
                    "GB/s",
                    "device-to-device copy",
                    row["copy_GBps"],
                    row["fraction_of_copy"],
                )
            else:
                yield Figure(
                    "sweep",
                    f"dynamic table step, D={row['dim']}, {row['ids']:,} ids a step",
                    row["dynamic_ids_per_s"],
                    "ids/s",
                    "fixed table, same ids",
                    row["fixed_ids_per_s"],
                    row["dynamic_over_fixed"],
                )
        return
    pairs = {"native_over_fbgemm": ("native", "fbgemm", "fixed table, native", "FBGEMM TBE", "native / FBGEMM")}
    for key in rows[0]:
        if key.startswith("dynamic_over_fixed_"):
            b = key.removeprefix("dynamic_over_fixed_")
            pairs[key] = (
                f"dynamic_{b}",
                f"fixed_{b}",
                f"dynamic table [{b}]",
                f"fixed table [{b}], same ids",
                f"dynamic / fixed [{b}]",
            )
    for key, (ours, theirs, what, baseline, short) in pairs.items():
        measured = [row for row in rows if row.get(key) is not None]
        if not measured:
            continue
        worst, best = min(measured, key=lambda row: row[key]), max(measured, key=lambda row: row[key])
        for label, row in (("worst", worst), ("best", best)):
            yield Figure(
                "sweep",
                f"{what}, {label} case (bags {row['bags']:,}, rows {row['rows']:,})",
                row[f"{ours}_ids_per_s"],
                "ids/s",
                baseline,
                row[f"{theirs}_ids_per_s"],
                row[key],
                f"sweep worst {short}" if label == "worst" else None,
            )


def _data_stage(r: dict[str, Any]) -> Iterator[Figure]:
    what = "BatchBuilder.build, C++ feature generation"
    if "native" in r:
        yield Figure(
            "data-stage",
            what,
            r["native"]["rows_per_s_median"],
            "rows/s",
            "pyarrow + pyfarmhash",
            r["pyarrow"]["rows_per_s_median"],
            r["native_over_pyarrow"],
            "data-stage vs pyarrow",
        )
    else:
        yield Figure(
            "data-stage", "BatchBuilder.build, pyarrow + pyfarmhash", r["pyarrow"]["rows_per_s_median"], "rows/s"
        )


def _train_step(r: dict[str, Any]) -> Iterator[Figure]:
    yield Figure(
        "train-step",
        "demo model step, data pipeline included",
        r["dynarec_samples_per_s_median"],
        "samples/s",
        "plain PyTorch, batches up front" if "baseline_samples_per_s_median" in r else None,
        r.get("baseline_samples_per_s_median"),
        r.get("dynarec_over_baseline"),
        "train-step",
    )


def _rates(case: str, node: Any, path: tuple[str, ...] = ()) -> Iterator[Figure]:
    """Every ``*_per_s_median`` leaf of a report, without a baseline: the figures of a report
    whose shape the suite does not know."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k.endswith("_per_s_median") and isinstance(v, (int, float)):
                unit = k.removesuffix("_median").split("_per_s")[0].rsplit("_", 1)[-1] + "/s"
                yield Figure(case, " ".join((*path, k.removesuffix("_per_s_median"))), float(v), unit)
            else:
                yield from _rates(case, v, (*path, k))


def _hash_find(r: dict[str, Any]) -> Iterator[Figure]:
    """Its figures have no same-run baseline: the roofline-style quoting point (docs/benchmarks.md)."""
    for i, (load, v) in enumerate(r.items()):
        yield Figure(
            "hash-find",
            f"find, {load}",
            v["find_keys_per_s_median"],
            "keys/s",
            headline=f"find {load}" if i == 0 else None,
        )
        yield Figure(
            "hash-find",
            f"insert of {v['insert_batch']:,} new keys (find + unique + plan_insert + commit), {load}",
            v["insert_keys_per_s_median"],
            "keys/s",
            headline=f"insert {load}" if i == 0 else None,
        )


_FIGURES: dict[str, Callable[[Any], Iterator[Figure]]] = {
    "e2e": _e2e,
    "fused-step": _fused_step,
    "dynamic-step": _dynamic_step,
    "sweep": _sweep,
    "data-stage": _data_stage,
    "hash-find": _hash_find,
    "train-step": _train_step,
}


def figures_of(benchmark: str, report: dict[str, Any]) -> list[Figure]:
    """The figures of one benchmark's report: each with its baseline and ratio where the
    benchmark measured one; a report the suite cannot read gives its rates alone."""
    extract = _FIGURES.get(benchmark)
    if extract is not None:
        try:
            figures = list(extract(report["results"]))
        except (KeyError, TypeError, ZeroDivisionError):
            return list(_rates(benchmark, report.get("results", report)))
        tables = (report.get("workload") or {}).get("tables", 1)
        if benchmark == "dynamic-step" and tables > 1:  # the group case: named apart from one table's
            figures = [
                dataclasses.replace(
                    f,
                    what=f"{f.what}, {tables} tables in one group",
                    baseline=f"{tables} fixed tables in one group, same ids",
                    headline=f"{tables}-table group / fixed" if f.headline else None,
                )
                for f in figures
                if f.baseline == "fixed table, same ids"
            ]
        spec = ((report["results"].get("data") or {}).get("spec") or {}) if benchmark == "e2e" else {}
        if spec.get("min_hist_len", 0) < spec.get("max_hist_len", 0):  # the varying-history case
            lengths = f"histories of {spec['min_hist_len']} to {spec['max_hist_len']}"
            figures = [
                dataclasses.replace(
                    f, what=f"{f.what}, {lengths}", headline=f"{f.headline}, {lengths}" if f.headline else None
                )
                for f in figures
            ]
        return figures
    return list(_rates(benchmark, report.get("results", report)))


# -- the run ---------------------------------------------------------------------------------


def _run_case(case: Case) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dynarec-suite-") as tmp:
        out = Path(tmp) / "report.json"
        argv = case.argv()
        print(f"$ dynarec {shlex.join(argv)}", flush=True)
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "dynarec", *argv, "--json", str(out)],
            env=same_dynarec(),
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - start
        record: dict[str, Any] = {
            "case": case.benchmark,
            "command": f"dynarec {shlex.join(argv)}",
            "seconds": seconds,
            "returncode": done.returncode,
        }
        print(done.stdout, end="", flush=True)
        if done.returncode != 0 or not out.is_file():
            record["error"] = (done.stderr.strip() or done.stdout.strip())[-3000:]
            print(f"FAILED (status {done.returncode}):\n{record['error']}", flush=True)
            return record
        report = json.loads(out.read_text())
    record["figures"] = [asdict(f) for f in figures_of(case.benchmark, report)]
    record["report"] = report
    return record


def _fmt(value: Optional[float], unit: str = "") -> str:
    if value is None:
        return ""
    if unit.endswith("/s") and unit != "GB/s":
        for scale, prefix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= scale:
                return f"{value / scale:,.3g} {prefix} {unit}"
        return f"{value:,.0f} {unit}"
    if unit == "AUC":
        return f"{value:.4f}"
    return f"{value:,.4g} {unit}".strip()


def _headline(record: dict[str, Any]) -> list[str]:
    """The short form of a run's headline figures (the history table's cell)."""
    out = []
    for case in record["cases"]:
        for f in case.get("figures", []):
            if f["headline"]:
                ratio = f" ({f['ratio']:.2f}x)" if f["ratio"] is not None else ""
                vs = f" vs {_fmt(f['baseline_value'], f['unit'])}" if f["baseline_value"] is not None else ""
                out.append(f"{f['headline']}: {_fmt(f['value'], f['unit'])}{vs}{ratio}")
        if "error" in case:
            out.append(f"{case['case']}: FAILED")
    return out


def render_markdown(record: dict[str, Any]) -> str:
    """The results file as a short page: where and what was run, then one table of figures."""
    rev, machine, versions = record["revision"], record["machine"], record["versions"]
    gpus = ", ".join(g["name"] for g in machine["gpus"]) or "none"
    lines = [
        f"# dynarec bench suite --device {record['device']}: {record['date']}, {rev['short'] or 'unknown revision'}"
        + (" (dirty tree)" if rev["dirty"] else ""),
        "",
        f"- revision: `{rev['sha']}`{' with uncommitted changes' if rev['dirty'] else ''}",
        f"- machine: {machine['hostname']}, {machine['cpu_count']} CPUs ({machine['torch_threads']} torch threads), "
        f"GPUs: {gpus}; load average {machine['load_average'][0]:.2f} before, "
        f"{machine['load_average_after'][0]:.2f} after",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v),
        f"- the suite took {record['seconds']:.0f} s",
        "",
        "| case | figure | dynarec | same-run baseline | its figure | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for case in record["cases"]:
        if "error" in case:
            lines.append(f"| {case['case']} | FAILED: see the JSON | | | | |")
        for f in case.get("figures", []):
            ratio = f"{f['ratio']:.2f}x" if f["ratio"] is not None else ""
            lines.append(
                f"| {f['case']} | {f['what']} | {_fmt(f['value'], f['unit'])} | {f['baseline'] or ''} | "
                f"{_fmt(f['baseline_value'], f['unit'])} | {ratio} |"
            )
    lines += ["", "Commands:", ""]
    lines += [f"- `{case['command']}` ({case['seconds']:.0f} s)" for case in record["cases"]]
    return "\n".join(lines) + "\n"


HISTORY_HEADER = """# Recorded benchmark runs

One row per `dynarec bench suite` run (the suite appends it); each file holds the revision, the
machine, the versions, the exact commands and every figure with its same-run baseline.
docs/benchmarks.md says what each benchmark measures.

| date | revision | device | headline figures (dynarec vs its same-run baseline) | file |
|---|---|---|---|---|
"""


def _append_history(results_dir: Path, record: dict[str, Any], name: str) -> None:
    readme = results_dir / "README.md"
    text = readme.read_text() if readme.is_file() else HISTORY_HEADER
    rev = record["revision"]
    revision = f"{rev['short'] or 'unknown'}{' (dirty)' if rev['dirty'] else ''}"
    device = record["device"] + (" smoke" if record["smoke"] else "")
    cell = "<br>".join(_headline(record)).replace("|", "\\|")
    row = f"| {record['date']} | {revision} | {device} | {cell} | [{name}.md]({name}.md) |\n"
    readme.write_text(text + ("" if text.endswith("\n") else "\n") + row)


def run_suite(args) -> dict:
    """Runs the suite of ``args.device`` (see the module doc); returns its record as a report."""
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    cases = _smoke_cases(args.device) if args.smoke else CASES[device]
    if args.cases:
        unknown = sorted(set(args.cases) - {c.benchmark for c in cases})
        if unknown:
            raise ValueError(f"unknown suite case(s) {unknown}; the suite has {[c.benchmark for c in cases]}")
        cases = tuple(c for c in cases if c.benchmark in args.cases)
    results_dir = Path(args.results_dir) if args.results_dir else CHECKOUT / "benchmarks" / "results"
    if not args.results_dir and not results_dir.parent.is_dir():
        raise ValueError(f"{CHECKOUT} is not a dynarec checkout (no benchmarks/); give --results-dir")
    record: dict[str, Any] = {**environment(device), "smoke": args.smoke, "cases": []}
    start = time.perf_counter()
    for case in cases:
        record["cases"].append(_run_case(case))
    record["seconds"] = time.perf_counter() - start
    record["machine"]["load_average_after"] = os.getloadavg()
    stem = f"{record['date']}-{record['revision']['short'] or 'nogit'}-{device}" + ("-smoke" if args.smoke else "")
    results_dir.mkdir(parents=True, exist_ok=True)
    name, n = stem, 1
    while (results_dir / f"{name}.json").exists():  # a second run of the day: never over the first's file
        n += 1
        name = f"{stem}-{n}"
    (results_dir / f"{name}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    (results_dir / f"{name}.md").write_text(render_markdown(record))
    _append_history(results_dir, record, name)
    failed = [c["case"] for c in record["cases"] if "error" in c]
    lines = [f"wrote {results_dir / name}.json and .md ({record['seconds']:.0f} s); headline figures:"]
    lines += [f"  {h}" for h in _headline(record)]
    if failed:
        lines.append(f"failed: {', '.join(failed)}")
    return {
        "benchmark": "suite",
        "results": record,
        "results_file": str(results_dir / f"{name}.json"),
        "summary": lines,
        "status": 1 if failed else 0,
    }
