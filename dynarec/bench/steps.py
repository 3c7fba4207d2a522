"""Embedding-step benchmarks: the fused step of a fixed table, dynamic vs fixed, the hash index,
and sweeps over the workload (``dynarec bench fused-step | dynamic-step | hash-find | sweep``)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

from dynarec.bench.common import (
    HBM_ROOFLINE_GBPS,
    Workload,
    _time_steps,
    copy_bandwidth,
    filled_hash_index,
    make_table,
    make_tables,
    measure,
    ratio,
    roofline_bytes_per_id,
    synchronizer,
)
from dynarec.embedding import EmbeddingCollection
from dynarec.embedding.config import Backend, ScoreStrategy
from dynarec.embedding.fbgemm_store import fbgemm_available
from dynarec.embedding.step import Journal
from dynarec.optim import SGD, Adagrad, Adam, OptimizerSpec, RowWiseAdagrad

__all__ = [
    "bench_dynamic_step",
    "bench_fused_step",
    "bench_hash_find",
    "bench_host_tier",
    "bench_row_dtype",
    "bench_sweep",
]

OPTIMIZERS: dict[str, OptimizerSpec] = {
    "sgd": SGD(lr=0.01),
    "adagrad": Adagrad(lr=0.01),
    "rowwise_adagrad": RowWiseAdagrad(lr=0.01),
    "adam": Adam(lr=0.01),
}


def _backends(device: str, spec: OptimizerSpec) -> list[Backend]:
    fbgemm = fbgemm_available() and device == "cpu" and not isinstance(spec, Adam)
    return ["native", "fbgemm"] if fbgemm else ["native"]


def _state_floats(spec: OptimizerSpec, dim: int) -> int:
    return sum(s.width(dim) for s in spec.state_specs())


def _torch_sparse_baseline(w: Workload, batches, steps: int, runs: int, warmup: int, device: str) -> list[float]:
    """What a user writes without a fused library: nn.EmbeddingBag(sparse=True) and
    torch.optim.Adagrad (unfused, sparse gradients), its inputs already on the device. Rates in
    ids/s."""
    sync = synchronizer(device)
    batches = [b.to(device) for b in batches]
    bag = torch.nn.EmbeddingBag(w.num_embeddings, w.dim, mode="sum", sparse=True, device=device)
    opt = torch.optim.Adagrad(bag.parameters(), lr=0.01)

    def run(n: int) -> float:
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
    return [w.ids_per_step * steps / run(steps) for _ in range(runs)]


def _fused_step(
    w: Workload,
    spec: OptimizerSpec,
    device: str,
    steps: int,
    runs: int,
    warmup: int,
    baseline: bool,
    copy_gbps: float = 0.0,
) -> dict[str, Any]:
    batches = w.batches(device=device)
    backends = _backends(device, spec)

    def make(backend: Backend):
        return lambda: EmbeddingCollection([make_table("fixed", backend, w)], spec, device=device)

    results = measure({b: make(b) for b in backends}, {b: batches for b in backends}, steps, runs, warmup, device)
    unique = w.unique_fraction(batches)
    report: dict[str, Any] = {"workload": vars(w), "optimizer": repr(spec), "unique_fraction": unique}
    for name, r in results.items():
        r.pop("coll")
        report[name] = r
    if device.startswith("cuda"):
        r = results["native"]
        gbps = r["ids_per_s_median"] * roofline_bytes_per_id(w, unique, _state_floats(spec, w.dim)) / 1e9
        report.update(
            GBps=gbps,
            fraction_of_roofline=gbps / HBM_ROOFLINE_GBPS,
            fraction_of_copy=gbps / copy_gbps if copy_gbps else float("nan"),
        )
        if baseline:
            rates = _torch_sparse_baseline(w, batches, steps, runs, warmup, device)
            report["torch_sparse_adagrad"] = {"ids_per_s_median": statistics.median(rates), "ids_per_s_runs": rates}
            report["native_over_torch_sparse"] = r["ids_per_s_median"] / statistics.median(rates)
    if "fbgemm" in results:
        report["native_over_fbgemm"] = ratio(results, "native", "fbgemm")
    return report


def _rate(r: dict, device: str = "cpu") -> str:
    """Median and runs; on a GPU also the host loop's share of the time (near 100%: host-bound)."""
    runs = ", ".join(f"{x / 1e6:.2f}" for x in r["ids_per_s_runs"])
    host = f"; host loop {100 * r['host_share']:.0f}% of the time" if "host_share" in r and device != "cpu" else ""
    return f"{r['ids_per_s_median'] / 1e6:.2f} M ids/s (runs {runs}{host})"


def bench_fused_step(args) -> dict:
    """A fixed table's fused step: native vs FBGEMM on CPU; on a GPU, bytes/s against the HBM
    roofline and a measured copy, and against nn.EmbeddingBag(sparse) + torch.optim.Adagrad."""
    w = Workload(num_embeddings=args.rows, dim=args.dim, bags=args.bags, pooling_factor=args.pooling_factor)
    spec = OPTIMIZERS[args.optimizer]
    copy = copy_bandwidth(args.device) if args.device.startswith("cuda") else 0.0
    r = _fused_step(
        w, spec, args.device, args.steps, args.runs, args.warmup, baseline=isinstance(spec, Adagrad), copy_gbps=copy
    )
    lines = [f"{b:>8}: {_rate(r[b], args.device)}" for b in ("native", "fbgemm") if b in r]
    if "GBps" in r:
        lines.append(
            f"native: {r['GBps']:.0f} GB/s = {100 * r['fraction_of_roofline']:.1f}% of the "
            f"{HBM_ROOFLINE_GBPS:.0f} GB/s roofline, {100 * r['fraction_of_copy']:.1f}% of a measured "
            f"copy ({copy:.0f} GB/s); unique fraction {r['unique_fraction']:.3f}"
        )
    if "native_over_torch_sparse" in r:
        lines.append(
            f"torch sparse Adagrad: {_rate(r['torch_sparse_adagrad'])}; native / it = "
            f"{r['native_over_torch_sparse']:.2f}x"
        )
    if "native_over_fbgemm" in r:
        lines.append(f"native / fbgemm = {r['native_over_fbgemm']:.2f}x")
    elif args.device == "cpu":  # say why there is no ratio
        why = "FBGEMM's CPU TBE has no Adam" if isinstance(spec, Adam) else "FBGEMM's CPU build is not installed"
        lines.append(f"no baseline in this run: {why}")
    return {"benchmark": "fused-step", "copy_GBps": copy, "results": r, "summary": lines}


def _dynamic_step(
    w: Workload,
    spec: OptimizerSpec,
    device: str,
    steps: int,
    runs: int,
    warmup: int,
    scattered: bool = True,
    score_strategy: ScoreStrategy = "step",
    new_keys: float = 0.0,
) -> dict:
    """Dynamic vs fixed on each backend; ``scattered`` adds a fixed table fed ids scattered over
    its rows (the dynamic table's access pattern) — a third table in memory. ``new_keys`` > 0:
    that share of every timed step's ids are keys the dynamic table never saw (inserted, and
    evicting once it is full), the fixed tables' ids there rows drawn uniformly; the batches are
    then a stream, each used once after a warm-up that has seen every Zipf draw."""
    stream = max(warmup, w.num_batches) if new_keys else 0
    count = stream + runs * steps + 2 if new_keys else None  # (2: the prefetch depth at most)

    def batches_of(**kind):
        return w.batches(device=device, new_keys=new_keys, count=count, **kind)

    batches = {"fixed": batches_of(), "dynamic": batches_of(keys_over_int64=True)}
    if scattered:
        batches["fixed_scattered"] = batches_of(scatter_rows=True)
    out = {}
    for backend in _backends(device, spec):

        def make(kind, backend=backend):
            return lambda: EmbeddingCollection(make_tables(kind, backend, w, score_strategy), spec, device=device)

        makers = {name: make(name.split("_")[0]) for name in batches}
        r = measure(makers, batches, steps, runs, warmup, device, stream=stream)
        table = next(iter(r["dynamic"]["coll"].tables.values()))  # (the first of several)
        groups = [list(g) for g in r["dynamic"]["coll"].lookup_groups]
        for v in r.values():
            v.pop("coll")
        out[backend] = {
            **r,
            "dynamic_over_fixed": ratio(r, "dynamic", "fixed"),
            "dynamic_report": table.report(),
            "dynamic_lookup_groups": groups,
            "bytes_per_slot": table.nbytes / table.capacity,
        }
        if scattered:
            out[backend]["dynamic_over_fixed_scattered"] = ratio(r, "dynamic", "fixed_scattered")
        del table, r
    return out


def bench_dynamic_step(args) -> dict:
    """Dynamic vs fixed table step on the same backend, keys spread over the int64 range, after a
    warm-up that has seen every Zipf draw: ``--new-keys`` of each timed step's ids are keys the
    table never saw (issue 27's 5% by default; 0: the timed steps meet no new key). ``--tables``:
    that many tables of each kind share ``--rows`` and ``--bags`` (a feature each), as a
    collection groups them (fixed tables always; dynamic ones that never grow, as here)."""
    if args.tables < 1 or args.bags % args.tables:
        raise ValueError(f"--tables must be at least 1 and divide --bags ({args.bags}), got {args.tables}")
    w = Workload(
        num_embeddings=args.rows // args.tables,
        dim=args.dim,
        bags=args.bags,
        pooling_factor=args.pooling_factor,
        tables=args.tables,
    )
    spec = OPTIMIZERS[args.optimizer]
    if not 0 <= args.new_keys < 1:
        raise ValueError(f"--new-keys is a share of a step's ids in [0, 1), got {args.new_keys}")
    results = _dynamic_step(
        w,
        spec,
        args.device,
        args.steps,
        args.runs,
        args.warmup,
        score_strategy=args.score_strategy,
        new_keys=args.new_keys,
    )
    lines = []
    for backend, r in results.items():
        lines += [f"[{backend}] {k:<16} {_rate(r[k], args.device)}" for k in ("fixed", "fixed_scattered", "dynamic")]
        lines.append(
            f"[{backend}] dynamic / fixed = {r['dynamic_over_fixed']:.2f}x; dynamic / fixed-scattered = "
            f"{r['dynamic_over_fixed_scattered']:.2f}x; {r['bytes_per_slot']:.1f} bytes per slot; "
            f"{r['dynamic_report']['size']:,} keys at load {r['dynamic_report']['load_factor']:.2f} "
            f"({r['dynamic_report']['dropped_keys']} insert(s) dropped, warm-up included); "
            f"score_strategy {args.score_strategy}; {args.new_keys:.0%} of a timed step's ids new keys"
            + (f"; {args.tables} tables of each kind, the first one's figures" if args.tables > 1 else "")
        )
    workload = {**vars(w), "new_keys": args.new_keys}
    return {"benchmark": "dynamic-step", "workload": workload, "results": results, "summary": lines}


def bench_row_dtype(args) -> dict:
    """A fixed native table's fused step with its rows in fp32, bf16 and fp16 (states fp32), on
    the same ids, timed interleaved: each half-precision step against the fp32 one."""
    w = Workload(num_embeddings=args.rows, dim=args.dim, bags=args.bags, pooling_factor=args.pooling_factor)
    spec = OPTIMIZERS[args.optimizer]
    batches = w.batches(device=args.device)
    kinds = ("fp32", "bf16", "fp16")

    def make(data_type):
        table = dataclasses.replace(make_table("fixed", "native", w), data_type=data_type)
        return lambda: EmbeddingCollection([table], spec, device=args.device)

    r = measure(
        {k: make(k) for k in kinds}, {k: batches for k in kinds}, args.steps, args.runs, args.warmup, args.device
    )
    for v in r.values():
        v.pop("coll")
    ratios = {f"{k}_over_fp32": ratio(r, k, "fp32") for k in kinds[1:]}
    # A touched row's update reads and writes its weights (in the rows' type) and its states
    # (float32 whatever the rows'): the most a half row can gain where bytes bound the step.
    state_bytes = 4 * sum(s.width(args.dim) for s in spec.state_specs())
    row_bytes = {"fp32": 4 * args.dim + state_bytes, "half": 2 * args.dim + state_bytes}
    bound = row_bytes["fp32"] / row_bytes["half"]
    lines = [f"{k:>5} rows: {_rate(r[k], args.device)}" for k in kinds]
    lines.append(", ".join(f"{k} / fp32 = {v:.2f}x" for k, v in zip(kinds[1:], ratios.values())))
    lines.append(
        f"bytes a touched row's update reads and writes once: fp32 {row_bytes['fp32']}, half {row_bytes['half']} "
        f"(states fp32): a half row's step is at most {bound:.2f}x the fp32 one where bytes bound it"
    )
    return {
        "benchmark": "row-dtype",
        "workload": vars(w),
        "optimizer": repr(spec),
        "results": {**r, **ratios, "row_bytes": row_bytes, "half_over_fp32_byte_bound": bound},
        "summary": lines,
    }


def bench_host_tier(args) -> dict:
    """A table whose rows live in host memory, ``--cache-load-factor`` of them cached on the
    device (issue 31's host tier), against the same table kept whole on the device: the fused
    step on the same Zipf ids, timed interleaved, the trainer's way (each batch's input stage,
    where the cached table makes its rows resident, ``prefetch_depth`` steps ahead). The batches
    are a stream, each step's ids a fresh draw (a cycle of a few draws would find a cache either
    holding them all or thrashing on them); ``--ids`` picks Zipf over the table's rows or the
    other step benchmarks' wrapped draw. Beside the ratio: the rows a step of the stream loads
    into the cache and writes back (the host<->device traffic) and their bytes."""
    floor = 1.0 if args.ids == "wrapped" else 0.0  # (numpy's unbounded draw needs an exponent above 1)
    if not args.zipf > floor:
        raise ValueError(f"--zipf must be above {floor:g} with --ids {args.ids}, got {args.zipf}")
    warm = max(args.warmup, 1)
    depth = 2  # the collection's prefetch depth at most
    count = warm + (args.runs + 1) * args.steps + depth  # (one run more: the traffic's count)
    w = Workload(
        num_embeddings=args.rows,
        dim=args.dim,
        bags=args.bags,
        pooling_factor=args.pooling_factor,
        zipf_a=args.zipf,
        num_batches=count,
        zipf_bounded=args.ids == "bounded",
    )
    spec = OPTIMIZERS[args.optimizer]
    batches = w.batches(keys_over_int64=args.kind == "dynamic", device=args.device)
    whole = make_table(args.kind, "native", w)
    cached = dataclasses.replace(whole, cache_load_factor=args.cache_load_factor)

    def make(table):
        return lambda: EmbeddingCollection([table], spec, device=args.device)

    makers = {"whole": make(whole), "cached": make(cached)}
    r = measure(makers, {k: batches for k in makers}, args.steps, args.runs, warm, args.device, stream=warm)
    store = r["cached"]["coll"].tables["t"].store
    for key in store.counters:  # a steady step's traffic: counted over the stream's next steps
        store.counters[key] = 0
    first = warm + args.runs * args.steps
    _time_steps(r["cached"]["coll"], batches, args.steps, synchronizer(args.device), first)
    per_step = {k: v / args.steps for k, v in store.counters.items()}
    row_bytes = 4 * (w.dim + _state_floats(spec, w.dim))
    traffic = (per_step["loaded"] + per_step["written_back"]) * row_bytes
    cache_rows = store.cache_rows
    unique = w.unique_fraction(batches[first : first + args.steps]) * w.ids_per_step
    for v in r.values():
        v.pop("coll")
    cached_over_whole = ratio(r, "cached", "whole")
    link_gbps = traffic * r["cached"]["ids_per_s_median"] / w.ids_per_step / 1e9  # the step's rows over its time
    lines = [
        f"whole on {args.device}: {_rate(r['whole'], args.device)}",
        f"cached ({args.cache_load_factor:g} of the rows: {cache_rows:,} slots): {_rate(r['cached'], args.device)}",
        f"cached / whole = {cached_over_whole:.2f}x; a steady step loads {per_step['loaded']:,.0f} rows and writes "
        f"back {per_step['written_back']:,.0f} ({traffic / 1e6:,.1f} MB of rows and states; {unique:,.0f} distinct "
        f"rows a step), {link_gbps:.1f} GB/s of them over the cached step's time",
    ]
    return {
        "benchmark": "host-tier",
        "workload": vars(w),
        "kind": args.kind,
        "optimizer": repr(spec),
        "cache_load_factor": args.cache_load_factor,
        "cache_rows": cache_rows,
        "results": {**r, "cached_over_whole": cached_over_whole},
        "steady_step": {**per_step, "bytes": traffic, "distinct_rows": unique, "link_GBps": link_gbps},
        "summary": lines,
    }


def bench_hash_find(args) -> dict:
    """The hash index of ``--slots`` slots at load 0.5 and 0.9: ``find`` of 1M present and 1M
    absent uniformly drawn int64 keys; and the training path's insert of a batch of new keys (1M
    or 1/64 of the slots, whichever is smaller), as ``DynamicTable`` runs it: ``find``, the
    absent occurrences' distinct keys (``unique``), ``plan_insert`` and ``commit``, and the new
    slots written back to every occurrence. One untimed insert first loads the kernels. Every
    insert run starts from the same load: it is undone through the step journal after its clock
    stops."""
    sync = synchronizer(args.device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    device_gen = torch.Generator(device=args.device).manual_seed(1)
    results: dict[str, Any] = {}
    lines = []
    for load in (0.5, 0.9):
        index, keys = filled_hash_index(args.slots, load, args.device, gen)
        present = keys[torch.randint(0, keys.numel(), (1 << 20,), generator=gen).to(args.device)]
        query = torch.cat([present, torch.randint(-(2**62), 2**62, (1 << 20,), generator=gen).to(args.device)])
        index.find(query)
        find_rates: list[float] = []
        for _ in range(args.runs):
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                index.find(query)
            sync()
            find_rates.append(query.numel() * args.steps / (time.perf_counter() - start))
        batch = min(1 << 20, args.slots // 64)
        insert_rates: list[float] = []
        for run in range(args.runs + 1):  # the first (not timed) loads the kernels
            # drawn on the device: a draw on the host would leave the GPU idle before each timed
            # call, and its clocks low when the call starts
            new = torch.randint(-(2**62), 2**62, (batch,), generator=device_gen, device=args.device)
            journal = Journal()
            sync()
            start = time.perf_counter()
            slots = index.find(new)
            absent = torch.nonzero(slots < 0).squeeze(1)
            fresh, inverse = torch.unique(new[absent], return_inverse=True)
            plan = index.plan_insert(fresh, allow_evict=False, keys_ascending=True)
            index.commit(plan, torch.zeros_like(fresh), journal)
            slots.index_copy_(0, absent, plan.slots[inverse])
            sync()
            if run:
                insert_rates.append(new.numel() / (time.perf_counter() - start))
            journal.undo()
        results[f"load_{load}"] = {
            "find_keys_per_s_median": statistics.median(find_rates),
            "find_runs": find_rates,
            "insert_keys_per_s_median": statistics.median(insert_rates),
            "insert_runs": insert_rates,
            "insert_batch": batch,
            "actual_load": index.size / index.capacity,
        }
        r = results[f"load_{load}"]
        lines.append(
            f"load {r['actual_load']:.3f}: find {r['find_keys_per_s_median'] / 1e6:,.0f} M keys/s; "
            f"insert of {batch:,} new keys (find + unique + plan + commit) "
            f"{r['insert_keys_per_s_median'] / 1e6:,.1f} M keys/s"
        )
    return {"benchmark": "hash-find", "slots": args.slots, "results": results, "summary": lines}


def bench_sweep(args) -> dict:
    """The fused step across the workload, worst and best case.

    CPU: ``--grid-bags`` (1k/4k/16k) x ``--grid-rows`` (100k/1M/10M), dim 64, 20 ids a bag,
    Adagrad: native / FBGEMM on a fixed table, and dynamic / fixed on each row store. GPU: every
    optimizer at D=128 and 1M ids a step; Adagrad at D = 32, 64, 128 and 64K to 4M ids (16 ids a
    bag), bytes/s against the roofline and a measured copy; dynamic / fixed at D=128. Every row
    carries the rates (ids/s, medians) its ratios come from."""
    rows: list[dict[str, Any]] = []
    lines = []
    if args.device.startswith("cuda"):
        copy = copy_bandwidth(args.device)
        lines.append(f"measured device-to-device copy: {copy:.0f} GB/s")
        configs = [(name, 128, 65536) for name in OPTIMIZERS] + [
            ("adagrad", d, bags) for d in (32, 64, 128) for bags in (4096, 262144) if (d, bags) != (128, 65536)
        ]
        for name, dim, bags in configs:
            w = Workload(num_embeddings=10_000_000, dim=dim, bags=bags, pooling_factor=16, num_batches=4)
            r = _fused_step(
                w, OPTIMIZERS[name], args.device, args.steps, args.runs, args.warmup, baseline=False, copy_gbps=copy
            )
            rows.append(
                {
                    "optimizer": name,
                    "dim": dim,
                    "ids": w.ids_per_step,
                    "copy_GBps": copy,
                    **{k: v for k, v in r.items() if k != "workload"},
                }
            )
            lines.append(
                f"{name:<16} D={dim:<4} {w.ids_per_step / 1e6:5.2f}M ids: "
                f"{r['native']['ids_per_s_median'] / 1e6:8.1f} M ids/s, {r['GBps']:6.0f} GB/s = "
                f"{100 * r['fraction_of_roofline']:4.1f}% of roofline ({100 * r['fraction_of_copy']:.1f}% of copy)"
            )
        w = Workload(num_embeddings=10_000_000, dim=128, bags=65536, pooling_factor=16, num_batches=4)
        d = _dynamic_step(w, OPTIMIZERS["adagrad"], args.device, args.steps, args.runs, args.warmup, scattered=False)[
            "native"
        ]
        rows.append(
            {
                "dynamic_over_fixed": d["dynamic_over_fixed"],
                "dynamic_ids_per_s": d["dynamic"]["ids_per_s_median"],
                "fixed_ids_per_s": d["fixed"]["ids_per_s_median"],
                "dim": 128,
                "ids": w.ids_per_step,
            }
        )
        lines.append(
            f"dynamic / fixed, D=128, 1M ids: {d['dynamic_over_fixed']:.2f}x "
            f"(dynamic {d['dynamic']['ids_per_s_median'] / 1e6:.1f} vs fixed "
            f"{d['fixed']['ids_per_s_median'] / 1e6:.1f} M ids/s)"
        )
    else:
        for bags in args.grid_bags:
            for num_rows in args.grid_rows:
                w = Workload(num_embeddings=num_rows, dim=64, bags=bags, pooling_factor=20, num_batches=4)
                f = _fused_step(w, OPTIMIZERS["adagrad"], args.device, args.steps, args.runs, args.warmup, False)
                d = _dynamic_step(
                    w, OPTIMIZERS["adagrad"], args.device, args.steps, args.runs, args.warmup, scattered=False
                )
                row: dict[str, Any] = {"bags": bags, "rows": num_rows}
                for backend in ("native", "fbgemm"):
                    if backend in f:
                        row[f"{backend}_ids_per_s"] = f[backend]["ids_per_s_median"]
                row["native_over_fbgemm"] = f.get("native_over_fbgemm")
                for b in d:
                    row[f"dynamic_over_fixed_{b}"] = d[b]["dynamic_over_fixed"]
                    row[f"dynamic_{b}_ids_per_s"] = d[b]["dynamic"]["ids_per_s_median"]
                    row[f"fixed_{b}_ids_per_s"] = d[b]["fixed"]["ids_per_s_median"]
                rows.append(row)
                ratios = [f"dynamic/fixed [{b}] {d[b]['dynamic_over_fixed']:.2f}x" for b in d]
                if row["native_over_fbgemm"] is not None:
                    ratios.insert(0, f"native/FBGEMM {row['native_over_fbgemm']:.2f}x")
                lines.append(f"bags {bags:>5} rows {num_rows:>10,}: " + "; ".join(ratios))
        for key in [k for k in rows[0] if "_over_" in k]:
            values = [r[key] for r in rows if r.get(key) is not None]
            if values:
                lines.append(f"{key}: worst {min(values):.2f}x, best {max(values):.2f}x")
    return {"benchmark": "sweep", "device": args.device, "results": rows, "summary": lines}
