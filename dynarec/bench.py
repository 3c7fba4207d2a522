"""Benchmarks of the fused embedding step (``dynarec bench ...``).

Each benchmark measures its baseline in the same run and reports ratios; figures are medians of
several timed runs after a warm-up. Nothing here is a test: run it, read it, record it under
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from dynarec.embedding import EmbeddingCollection, JaggedBatch, TableConfig
from dynarec.embedding.fbgemm_store import fbgemm_available
from dynarec.embedding.initializers import mix64
from dynarec.optim import Adagrad

__all__ = ["main"]


@dataclass
class Workload:
    num_embeddings: int = 1_000_000
    dim: int = 64
    bags: int = 4096
    pooling_factor: int = 20
    zipf_a: float = 1.05
    num_batches: int = 8
    seed: int = 0

    def batches(self, keys_over_int64: bool = False, scatter_rows: bool = False,
                device: str = "cpu") -> list[JaggedBatch]:
        """``keys_over_int64``: ids hashed over the int64 range (dynamic tables);
        ``scatter_rows``: ids hashed over ``[0, num_embeddings)`` (a fixed table whose hot rows
        are spread like a dynamic table's slots, not packed at the low ids)."""
        rng = np.random.default_rng(self.seed)
        out = []
        n = self.bags * self.pooling_factor
        for _ in range(self.num_batches):
            ids = torch.from_numpy((rng.zipf(self.zipf_a, size=n) - 1) % self.num_embeddings).long()
            if keys_over_int64:
                ids = mix64(ids)  # a bijection: same duplicate structure, keys spread over int64
            elif scatter_rows:
                ids = (mix64(ids) & ((1 << 63) - 1)) % self.num_embeddings
            lengths = torch.full((self.bags,), self.pooling_factor, dtype=torch.int64)
            out.append(JaggedBatch(["f"], ids.to(device), lengths.to(device)))
        return out


def _time_steps(coll: EmbeddingCollection, batches: list[JaggedBatch], steps: int, sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    for i in range(steps):
        coll(batches[i % len(batches)])["f"].sum().backward()
    sync()
    return time.perf_counter() - start


def _measure(make: Callable[[], EmbeddingCollection], batches, steps: int, runs: int, warmup: int,
             device: str) -> dict[str, float]:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    coll = make()
    _time_steps(coll, batches, warmup, sync)
    ids_per_step = batches[0].values().numel()
    rates = [ids_per_step * steps / _time_steps(coll, batches, steps, sync) for _ in range(runs)]
    unique = statistics.mean(torch.unique(b.values()).numel() / b.values().numel() for b in batches)
    return {"ids_per_s_median": statistics.median(rates), "ids_per_s_runs": rates, "unique_fraction": unique,
            "coll": coll}  # type: ignore[dict-item]


def _table(kind: str, backend: str, w: Workload, capacity: Optional[int] = None) -> TableConfig:
    if kind == "fixed":
        return TableConfig(name="t", dim=w.dim, num_embeddings=w.num_embeddings, features=["f"], backend=backend)
    cap = capacity or w.num_embeddings
    return TableConfig(name="t", dim=w.dim, kind="dynamic", max_capacity=cap, init_capacity=cap,
                       features=["f"], backend=backend)


def bench_fused_step(args) -> dict:
    """Native vs FBGEMM fixed-table fused Adagrad step, same workload, same run."""
    w = Workload(num_embeddings=args.rows, dim=args.dim, bags=args.bags, pooling_factor=args.pooling_factor)
    batches = w.batches(device=args.device)
    spec = Adagrad(lr=0.01)
    results = {}
    backends = ["native"] + (["fbgemm"] if fbgemm_available() and args.device == "cpu" else [])
    for backend in backends:
        r = _measure(lambda: EmbeddingCollection([_table("fixed", backend, w)], spec, device=args.device),
                     batches, args.steps, args.runs, args.warmup, args.device)
        r.pop("coll")
        results[backend] = r
    report = {"benchmark": "fused-step", "workload": vars(w), "results": results}
    if "fbgemm" in results:
        report["native_over_fbgemm"] = results["native"]["ids_per_s_median"] / results["fbgemm"]["ids_per_s_median"]
    return report


def bench_dynamic_step(args) -> dict:
    """Dynamic vs fixed table step on the same backend, keys spread over the int64 range."""
    w = Workload(num_embeddings=args.rows, dim=args.dim, bags=args.bags, pooling_factor=args.pooling_factor)
    fixed_batches = w.batches(device=args.device)
    scattered_batches = w.batches(scatter_rows=True, device=args.device)
    dynamic_batches = w.batches(keys_over_int64=True, device=args.device)
    spec = Adagrad(lr=0.01)
    backends = ["native"] + (["fbgemm"] if fbgemm_available() and args.device == "cpu" else [])
    results = {}
    for backend in backends:
        fixed = _measure(lambda: EmbeddingCollection([_table("fixed", backend, w)], spec, device=args.device),
                         fixed_batches, args.steps, args.runs, args.warmup, args.device)
        dyn = _measure(lambda: EmbeddingCollection([_table("dynamic", backend, w)], spec, device=args.device),
                       dynamic_batches, args.steps, args.runs, args.warmup, args.device)
        scattered = _measure(lambda: EmbeddingCollection([_table("fixed", backend, w)], spec, device=args.device),
                             scattered_batches, args.steps, args.runs, args.warmup, args.device)
        table = dyn.pop("coll").tables["t"]
        fixed.pop("coll")
        scattered.pop("coll")
        state_bytes = 4 * (w.dim + w.dim)  # weight + Adagrad momentum1, fp32
        results[backend] = {
            "fixed": fixed,
            "dynamic": dyn,
            "fixed_scattered": scattered,
            "dynamic_over_fixed": dyn["ids_per_s_median"] / fixed["ids_per_s_median"],
            "dynamic_over_fixed_scattered": dyn["ids_per_s_median"] / scattered["ids_per_s_median"],
            "dynamic_report": table.report(),
            "bytes_per_stored_row": table.nbytes / table.capacity,
            "weight_and_state_bytes_per_row": state_bytes,
        }
    return {"benchmark": "dynamic-step", "workload": vars(w), "results": results}


BENCHMARKS = {"fused-step": bench_fused_step, "dynamic-step": bench_dynamic_step}


def _fmt(report: dict) -> str:
    lines = [f"== {report['benchmark']} ({platform.node()}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads)"]
    def rate(r):
        return f"{r['ids_per_s_median'] / 1e6:.2f} M ids/s (runs: {', '.join(f'{x / 1e6:.2f}' for x in r['ids_per_s_runs'])}; unique fraction {r['unique_fraction']:.3f})"
    if report["benchmark"] == "fused-step":
        for name, r in report["results"].items():
            lines.append(f"{name:>8}: {rate(r)}")
        if "native_over_fbgemm" in report:
            lines.append(f"native / fbgemm = {report['native_over_fbgemm']:.2f}x")
    else:
        for backend, r in report["results"].items():
            lines.append(f"[{backend}] fixed:   {rate(r['fixed'])}")
            lines.append(f"[{backend}] fixed, hot rows scattered: {rate(r['fixed_scattered'])}")
            lines.append(f"[{backend}] dynamic: {rate(r['dynamic'])}")
            lines.append(f"[{backend}] dynamic / fixed = {r['dynamic_over_fixed']:.2f}x; dynamic / fixed-scattered = "
                         f"{r['dynamic_over_fixed_scattered']:.2f}x; "
                         f"{r['bytes_per_stored_row']:.1f} bytes per slot vs {r['weight_and_state_bytes_per_row']} "
                         f"bytes of weight+state; table {r['dynamic_report']}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--bags", type=int, default=4096)
    parser.add_argument("--pooling-factor", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed run")
    parser.add_argument("--runs", type=int, default=5, help="timed runs; the median is reported")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write the report to this JSON file")


def main(args) -> None:
    report = BENCHMARKS[args.name](args)
    print(_fmt(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
