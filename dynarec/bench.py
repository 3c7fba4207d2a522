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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from dynarec.embedding import DynamicTableOptions, EmbeddingCollection, JaggedBatch, TableConfig
from dynarec.embedding.config import Backend
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

    def batches(
        self, keys_over_int64: bool = False, scatter_rows: bool = False, device: str = "cpu"
    ) -> list[JaggedBatch]:
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


def _measure(
    makers: dict[str, Callable[[], EmbeddingCollection]],
    batches: dict[str, list[JaggedBatch]],
    steps: int,
    runs: int,
    warmup: int,
    device: str,
) -> dict[str, dict]:
    """Times several setups with their timed runs interleaved (a, b, a, b, ...), so that every
    setup sees the same machine state; reports each one's median and per-run rates."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    colls = {}
    for name, make in makers.items():
        colls[name] = make()
        _time_steps(colls[name], batches[name], warmup, sync)
    rates: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(runs):
        for name, coll in colls.items():
            ids_per_step = batches[name][0].values().numel()
            rates[name].append(ids_per_step * steps / _time_steps(coll, batches[name], steps, sync))
    out = {}
    for name in makers:
        unique = statistics.mean(torch.unique(b.values()).numel() / b.values().numel() for b in batches[name])
        out[name] = {
            "ids_per_s_median": statistics.median(rates[name]),
            "ids_per_s_runs": rates[name],
            "unique_fraction": unique,
            "coll": colls[name],
        }
    return out


def _ratio(results: dict, a: str, b: str) -> float:
    """Median over runs of a's rate / b's rate in the same (interleaved) run."""
    return statistics.median(x / y for x, y in zip(results[a]["ids_per_s_runs"], results[b]["ids_per_s_runs"]))


def _measure_torch_sparse(w: Workload, batches, steps: int, runs: int, warmup: int, device: str) -> dict:
    """Baseline: what a user writes without a fused library — nn.EmbeddingBag(sparse=True) and
    torch.optim.Adagrad (unfused, sparse gradients)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    bag = torch.nn.EmbeddingBag(w.num_embeddings, w.dim, mode="sum", sparse=True, device=device)
    opt = torch.optim.Adagrad(bag.parameters(), lr=0.01)

    def run(n):
        sync()
        start = time.perf_counter()
        for i in range(n):
            b = batches[i % len(batches)]
            opt.zero_grad()
            bag(b.values(), b.offsets()[:-1]).sum().backward()
            opt.step()
        sync()
        return time.perf_counter() - start

    run(warmup)
    ids_per_step = batches[0].values().numel()
    rates = [ids_per_step * steps / run(steps) for _ in range(runs)]
    return {"ids_per_s_median": statistics.median(rates), "ids_per_s_runs": rates, "unique_fraction": float("nan")}


def roofline_bytes_per_id(w: Workload, unique_fraction: float) -> float:
    """docs/benchmarks.md's byte count of a fused fp32 Adagrad step, per looked-up id: forward 4D per id
    + 4D per pooled output; backward 4D per output gradient + 8D per id + 16D per unique row."""
    d = w.dim
    per_output = (4 * d + 4 * d) / w.pooling_factor
    return 4 * d + 8 * d + per_output + 16 * d * unique_fraction


def _table(kind: str, backend: Backend, w: Workload, capacity: Optional[int] = None) -> TableConfig:
    if kind == "fixed":
        return TableConfig(name="t", dim=w.dim, num_embeddings=w.num_embeddings, features=["f"], backend=backend)
    cap = capacity or w.num_embeddings
    return TableConfig(
        name="t", dim=w.dim, dynamic=DynamicTableOptions(cap, init_capacity=cap), features=["f"], backend=backend
    )


def bench_fused_step(args) -> dict:
    """Native vs FBGEMM fixed-table fused Adagrad step, same workload, same run."""
    w = Workload(num_embeddings=args.rows, dim=args.dim, bags=args.bags, pooling_factor=args.pooling_factor)
    batches = w.batches(device=args.device)
    spec = Adagrad(lr=0.01)
    backends: list[Backend] = ["native", "fbgemm"] if fbgemm_available() and args.device == "cpu" else ["native"]

    def make(backend: Backend) -> Callable[[], EmbeddingCollection]:
        return lambda: EmbeddingCollection([_table("fixed", backend, w)], spec, device=args.device)

    results: dict[str, dict[str, Any]] = _measure(
        {b: make(b) for b in backends},
        {b: batches for b in backends},
        args.steps,
        args.runs,
        args.warmup,
        args.device,
    )
    for r in results.values():
        r.pop("coll")
    report: dict[str, Any] = {"benchmark": "fused-step", "workload": vars(w), "results": results}
    if args.device.startswith("cuda"):
        baseline = _measure_torch_sparse(w, batches, args.steps, args.runs, args.warmup, args.device)
        results["torch_sparse_adagrad"] = baseline
        r = results["native"]
        r["achieved_GBps"] = r["ids_per_s_median"] * roofline_bytes_per_id(w, r["unique_fraction"]) / 1e9
        r["fraction_of_4300GBps"] = r["achieved_GBps"] / 4300
        report["native_over_torch_sparse"] = r["ids_per_s_median"] / baseline["ids_per_s_median"]
    if "fbgemm" in results:
        report["native_over_fbgemm"] = _ratio(results, "native", "fbgemm")
    return report


def bench_dynamic_step(args) -> dict:
    """Dynamic vs fixed table step on the same backend, keys spread over the int64 range."""
    w = Workload(num_embeddings=args.rows, dim=args.dim, bags=args.bags, pooling_factor=args.pooling_factor)
    fixed_batches = w.batches(device=args.device)
    scattered_batches = w.batches(scatter_rows=True, device=args.device)
    dynamic_batches = w.batches(keys_over_int64=True, device=args.device)
    spec = Adagrad(lr=0.01)
    backends: list[Backend] = ["native", "fbgemm"] if fbgemm_available() and args.device == "cpu" else ["native"]
    results = {}
    for backend in backends:

        def make(kind, backend=backend):
            return lambda: EmbeddingCollection([_table(kind, backend, w)], spec, device=args.device)

        r = _measure(
            {"fixed": make("fixed"), "fixed_scattered": make("fixed"), "dynamic": make("dynamic")},
            {"fixed": fixed_batches, "fixed_scattered": scattered_batches, "dynamic": dynamic_batches},
            args.steps,
            args.runs,
            args.warmup,
            args.device,
        )
        table = r["dynamic"]["coll"].tables["t"]
        for v in r.values():
            v.pop("coll")
        state_bytes = 4 * (w.dim + w.dim)  # weight + Adagrad momentum1, fp32
        results[backend] = {
            **r,
            "dynamic_over_fixed": _ratio(r, "dynamic", "fixed"),
            "dynamic_over_fixed_scattered": _ratio(r, "dynamic", "fixed_scattered"),
            "dynamic_report": table.report(),
            "bytes_per_stored_row": table.nbytes / table.capacity,
            "weight_and_state_bytes_per_row": state_bytes,
        }
    return {"benchmark": "dynamic-step", "workload": vars(w), "results": results}


def bench_hash_find(args) -> dict:
    """Bucketed hash find: a table of ``--slots`` slots at load 0.5 and 0.9, queried with 1M
    present and 1M absent uniformly drawn int64 keys."""
    from dynarec.embedding.hash_index import BucketedHashIndex

    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    gen = torch.Generator(device="cpu").manual_seed(0)
    results = {}
    for load in (0.5, 0.9):
        index = BucketedHashIndex(args.slots // 16, 16, args.device)
        n = int(args.slots * load)
        keys = torch.randint(-(2**62), 2**62, (n,), generator=gen).to(args.device)
        keys = torch.unique(keys)
        for chunk in keys.split(1 << 22):
            plan = index.plan_insert(chunk, allow_evict=False)
            index.commit(plan, torch.zeros_like(chunk))
        present = keys[torch.randint(0, keys.numel(), (1 << 20,), generator=gen).to(args.device)]
        absent = torch.randint(-(2**62), 2**62, (1 << 20,), generator=gen).to(args.device)
        query = torch.cat([present, absent])
        index.find(query)
        rates = []
        for _ in range(args.runs):
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                index.find(query)
            sync()
            rates.append(query.numel() * args.steps / (time.perf_counter() - start))
        results[f"load_{load}"] = {
            "keys_per_s_median": statistics.median(rates),
            "runs": rates,
            "actual_load": index.size / index.capacity,
        }
    return {"benchmark": "hash-find", "slots": args.slots, "results": results}


BENCHMARKS = {"fused-step": bench_fused_step, "dynamic-step": bench_dynamic_step, "hash-find": bench_hash_find}


def _fmt(report: dict) -> str:
    lines = [
        f"== {report['benchmark']} ({platform.node()}, torch {torch.__version__}, {torch.get_num_threads()} threads)"
    ]

    def rate(r):
        runs = ", ".join(f"{x / 1e6:.2f}" for x in r["ids_per_s_runs"])
        return f"{r['ids_per_s_median'] / 1e6:.2f} M ids/s (runs: {runs}; unique fraction {r['unique_fraction']:.3f})"

    if report["benchmark"] == "hash-find":
        for load, r in report["results"].items():
            lines.append(f"{load}: {r['keys_per_s_median'] / 1e9:.3f} B keys/s (load {r['actual_load']:.3f})")
    elif report["benchmark"] == "fused-step":
        for name, r in report["results"].items():
            extra = (
                f"; {r['achieved_GBps']:.0f} GB/s = {100 * r['fraction_of_4300GBps']:.1f}% of 4.3 TB/s"
                if "achieved_GBps" in r
                else ""
            )
            lines.append(f"{name:>8}: {rate(r)}{extra}")
        if "native_over_torch_sparse" in report:
            lines.append(f"native / torch sparse Adagrad = {report['native_over_torch_sparse']:.2f}x")
        if "native_over_fbgemm" in report:
            lines.append(f"native / fbgemm = {report['native_over_fbgemm']:.2f}x")
    else:
        for backend, r in report["results"].items():
            lines.append(f"[{backend}] fixed:   {rate(r['fixed'])}")
            lines.append(f"[{backend}] fixed, hot rows scattered: {rate(r['fixed_scattered'])}")
            lines.append(f"[{backend}] dynamic: {rate(r['dynamic'])}")
            lines.append(
                f"[{backend}] dynamic / fixed = {r['dynamic_over_fixed']:.2f}x; dynamic / fixed-scattered = "
                f"{r['dynamic_over_fixed_scattered']:.2f}x; "
                f"{r['bytes_per_stored_row']:.1f} bytes per slot vs {r['weight_and_state_bytes_per_row']} "
                f"bytes of weight+state; table {r['dynamic_report']}"
            )
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
    parser.add_argument("--slots", type=int, default=1 << 22, help="hash-find: slots in the table")
    parser.add_argument("--json", help="also write the report to this JSON file")


def main(args) -> None:
    report = BENCHMARKS[args.name](args)
    print(_fmt(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
