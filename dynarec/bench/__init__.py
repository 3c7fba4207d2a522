"""Benchmarks (``dynarec bench <name>``): each measures its baseline in the same run and reports
the figures beside it, with their ratio; the step benchmarks report medians of several timed
runs, interleaved with the baseline's. ``dynarec bench suite`` runs the headline set and records
it under ``benchmarks/results/``. Nothing here is a test: docs/benchmarks.md says what each one
measures and how."""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from typing import Any

import torch

from dynarec.cli import at_least
from dynarec.embedding.config import SCORE_STRATEGIES

__all__ = ["BENCHMARKS", "add_arguments", "main"]


def _e2e(args) -> dict:
    from dynarec.bench.e2e import bench_e2e

    return bench_e2e(args)


def _steps(name: str) -> Callable[[Any], dict]:
    def run(args) -> dict:
        from dynarec.bench import steps

        return getattr(steps, name)(args)

    return run


def _train_step(args) -> dict:
    from dynarec.bench.train import bench_train_step

    return bench_train_step(args)


def _data_stage(args) -> dict:
    from dynarec.bench.data import bench_data_stage

    return bench_data_stage(args)


def _suite(args) -> dict:
    from dynarec.bench.suite import run_suite

    return run_suite(args)


BENCHMARKS: dict[str, tuple[Callable[[Any], dict], str]] = {
    "e2e": (_e2e, "the `dynarec train` command on a Taobao-like log vs a plain-PyTorch peer: samples/s, eval AUC"),
    "fused-step": (_steps("bench_fused_step"), "a fixed table's fused step (CPU: vs FBGEMM TBE; GPU: vs the roofline)"),
    "dynamic-step": (_steps("bench_dynamic_step"), "a dynamic table's step vs a fixed table's on the same ids"),
    "row-dtype": (_steps("bench_row_dtype"), "a fixed table's step with fp32, bf16 and fp16 rows on the same ids"),
    "hash-find": (_steps("bench_hash_find"), "the hash index's find and find-or-insert"),
    "host-tier": (_steps("bench_host_tier"), "a table in host memory with a device cache vs the table whole on it"),
    "sweep": (_steps("bench_sweep"), "the fused step across workloads: worst and best ratios"),
    "train-step": (_train_step, "the demo model's step in process (torchrun: weak scaling) vs plain torch"),
    "data-stage": (_data_stage, "batch building: the C++ feature generation vs pyarrow + pyfarmhash"),
    "suite": (_suite, "the headline set, recorded as one dated results file under benchmarks/results/"),
}


# The benchmarks of one table's step, each taking the workload's shape (rows, dim, bags, ids a
# bag, optimizer); each benchmark takes the options it reads, and no other.
_WORKLOAD_BENCHMARKS = ("fused-step", "dynamic-step", "row-dtype", "host-tier")


def _workload_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=at_least(1), default=1_000_000)
    p.add_argument("--dim", type=at_least(1), default=64)
    p.add_argument("--bags", type=at_least(1), default=4096)
    p.add_argument("--pooling-factor", type=at_least(1), default=20)
    p.add_argument("--optimizer", default="adagrad", choices=["sgd", "adagrad", "rowwise_adagrad", "adam"])


def _timing_options(p: argparse.ArgumentParser, steps_help: str = "steps per timed run", warmup: bool = True) -> None:
    p.add_argument("--steps", type=at_least(1), default=10, help=steps_help)
    p.add_argument("--runs", type=at_least(1), default=5, help="timed runs; the median is reported")
    if warmup:
        p.add_argument("--warmup", type=at_least(0), default=3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One subcommand a benchmark, each with its own options (and defaults) plus ``--device``
    and ``--json``."""
    sub = parser.add_subparsers(dest="name", required=True, metavar="NAME")
    for name, (_, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--device", default="cpu")
        p.add_argument("--json", help="also write the report to this JSON file")
        if name in _WORKLOAD_BENCHMARKS:
            _workload_options(p)
        if name in (*_WORKLOAD_BENCHMARKS, "sweep"):
            _timing_options(p)
        if name == "hash-find":
            p.add_argument(
                "--slots",
                type=at_least(64),
                default=1 << 22,
                help="slots in the table, in buckets of 16 (at least 64: an insert run takes a 64th of them)",
            )
            _timing_options(p, warmup=False)  # (one untimed insert loads the kernels)
        if name == "dynamic-step":
            p.add_argument(
                "--score-strategy", default="step", choices=list(SCORE_STRATEGIES), help="the table's eviction score"
            )
            p.add_argument(
                "--new-keys",
                type=float,
                default=0.05,
                help="the share of a timed step's ids that are keys the table never saw (0: none; above 0 the "
                "warm-up and timed batches are built up front, pinned on a GPU: (warmup + runs x steps) batches)",
            )
            p.add_argument(
                "--tables",
                type=at_least(1),
                default=1,
                help="tables of each kind, sharing --rows and --bags (a feature each; a collection groups them)",
            )
        if name == "host-tier":
            p.add_argument("--cache-load-factor", type=float, default=0.05, help="the share of the rows cached")
            p.add_argument("--kind", default="dynamic", choices=["fixed", "dynamic"])
            p.add_argument("--zipf", type=float, default=1.05, help="the ids' Zipf exponent (higher: more skewed)")
            p.add_argument(
                "--ids",
                default="bounded",
                choices=["bounded", "wrapped"],
                help="bounded: Zipf over the table's rows; wrapped: the other step benchmarks' draw, numpy's unbounded "
                "Zipf modulo the rows (its tail past them lands nearly uniformly: 40%% of the ids at --zipf 1.05 and "
                "40M rows)",
            )
        if name == "sweep":
            p.add_argument(
                "--grid-rows",
                type=at_least(1),
                nargs="+",
                default=[100_000, 1_000_000, 10_000_000],
                help="CPU: table rows",
            )
            p.add_argument(
                "--grid-bags", type=at_least(1), nargs="+", default=[1024, 4096, 16384], help="CPU: bags a step"
            )
        if name == "train-step":
            _timing_options(p)
            p.add_argument("--batch", type=at_least(1), default=512, help="batch per rank")
            p.add_argument("--workers", type=at_least(0), default=0, help="DataLoader workers per rank")
            p.add_argument("--users", type=at_least(1), default=20_000, help="users per rank")
            p.add_argument("--items", type=at_least(1), default=5_000, help="items per rank")
        if name == "data-stage":
            _timing_options(p, "batches per timed run")
            p.add_argument("--data-batch", type=at_least(1), default=4096, help="rows per batch")
        if name == "e2e":
            p.add_argument("--batch", type=at_least(1), default=4096, help="data.batch_size")
            p.add_argument("--train-rows", type=at_least(1), default=1_000_000)
            p.add_argument(
                "--eval-rows", type=at_least(1), default=None, help="default: a tenth of --train-rows, 1,000 at least"
            )
            p.add_argument("--epochs", type=at_least(1), default=1)
            p.add_argument(
                "--min-history",
                type=at_least(1),
                default=30,  # dynarec.bench.e2e.HISTORY (a benchmark's module is imported when it runs)
                help="the click log's shortest history (each row's drawn from it to 30; the demo's data: 3)",
            )
            p.add_argument(
                "--runs", type=at_least(1), default=1, help="runs of each side, interleaved; medians reported"
            )
            p.add_argument(
                "--workers",
                type=at_least(0),
                default=None,
                help="data.num_workers (default: unset, the trainer's own choice)",
            )
            p.add_argument(
                "--config",
                default=None,
                help="this config (dynarec YAML, or a TorchEasyRec pipeline.config) on data `make-data --config` "
                "writes for it, instead of the demo on a Taobao-like log",
            )
            p.add_argument(
                "--peer",
                choices=["tables", "one-table"],
                default="tables",
                help="the peer's tables: an nn.Embedding each, or all rows in one (tables of one dim)",
            )
            p.add_argument(
                "--set",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="a field of the config both sides train, dotted, its value as YAML "
                "(e.g. train.whole_step_graphs_eager_lookups=false); repeatable",
            )
            p.add_argument(
                "--cache-batches",
                nargs="?",
                const="memory",
                choices=["memory", "disk"],
                help="data.cache_batches (memory, the default, or disk): later epochs reuse the first's batches",
            )
        if name == "suite":
            from dynarec.bench.suite import add_suite_arguments

            add_suite_arguments(p)


def main(args) -> int:
    """Runs ``args.name``, prints its summary and writes ``--json``; returns the exit status
    (the suite's is 1 when a case failed)."""
    report = BENCHMARKS[args.name][0](args)
    if report.get("summary"):
        print(
            f"== {report['benchmark']} ({platform.node()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, {args.device})"
        )
        print("\n".join(report["summary"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2, default=str)
    return int(report.get("status", 0))
