"""Benchmarks (``dynarec bench <name>``): each measures its baseline in the same run, interleaved,
and reports medians of several timed runs and their ratios. Nothing here is a test: run it, read
it, record it under ``benchmarks/results/`` (docs/benchmarks.md says what each one measures)."""

from __future__ import annotations

import argparse
import json
import platform

import torch

from dynarec.bench.data import bench_data_stage
from dynarec.bench.steps import bench_dynamic_step, bench_fused_step, bench_hash_find, bench_sweep
from dynarec.bench.train import bench_train_step
from dynarec.embedding.config import SCORE_STRATEGIES

__all__ = ["BENCHMARKS", "add_arguments", "main"]

BENCHMARKS = {
    "fused-step": bench_fused_step,
    "dynamic-step": bench_dynamic_step,
    "hash-find": bench_hash_find,
    "sweep": bench_sweep,
    "train-step": bench_train_step,
    "data-stage": bench_data_stage,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--bags", type=int, default=4096)
    parser.add_argument("--pooling-factor", type=int, default=20)
    parser.add_argument("--optimizer", default="adagrad", choices=["sgd", "adagrad", "rowwise_adagrad", "adam"])
    parser.add_argument("--steps", type=int, default=10, help="steps per timed run (data-stage: batches)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs; the median is reported")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--slots", type=int, default=1 << 22, help="hash-find: slots in the table")
    parser.add_argument(
        "--score-strategy",
        default="step",
        choices=list(SCORE_STRATEGIES),
        help="dynamic-step: the dynamic table's eviction score",
    )
    parser.add_argument("--batch", type=int, default=512, help="train-step: batch per rank")
    parser.add_argument("--workers", type=int, default=0, help="train-step: DataLoader workers per rank")
    parser.add_argument("--users", type=int, default=20_000, help="train-step: users per rank")
    parser.add_argument("--items", type=int, default=5_000, help="train-step: items per rank")
    parser.add_argument("--data-batch", type=int, default=4096, help="data-stage: rows per batch")
    parser.add_argument("--json", help="also write the report to this JSON file")


def main(args) -> None:
    report = BENCHMARKS[args.name](args)
    if report.get("summary"):
        print(
            f"== {report['benchmark']} ({platform.node()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, {args.device})"
        )
        print("\n".join(report["summary"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2, default=str)
