"""The data stage (``dynarec bench data-stage``): ``BatchBuilder.build`` over a Taobao-like
Parquet file — string user and item ids, '|'-joined histories of 30 string item and category ids,
one dense column, a label, the user id as the grouped-AUC field — on one thread, with the
feature-generation C++ extension against the pyarrow + pyfarmhash path in the same run.

The file is read once and cut into batches as the reader cuts it (``Table.slice``); only
``build`` is timed. Both paths' batches are compared: they must be equal.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import yaml

__all__ = ["bench_data_stage"]

HISTORY = 30
USERS, ITEMS, CATES = 1_018_011, 5_163_070, 9_439  # Taobao's ad-click log's id ranges
ITEM_BUCKETS, CATE_BUCKETS = 1_000_000, 10_000


def _config():
    """The demo's model over string ids: every sparse feature hashed (user into a dynamic table,
    items and categories into fixed tables of ITEM_BUCKETS and CATE_BUCKETS rows)."""
    from dynarec.config import config_from_dict

    raw = yaml.safe_load(resources.files("dynarec").joinpath("resources/demo.yaml").read_text())
    user = next(f["id_feature"] for f in raw["feature_configs"] if "id_feature" in f)  # string ids, dynamic
    item = {"embedding_dim": 16, "embedding_name": "item", "value_type": "string", "hash_bucket_size": ITEM_BUCKETS}
    cate = {"embedding_dim": 8, "embedding_name": "cate", "value_type": "string", "hash_bucket_size": CATE_BUCKETS}
    raw["feature_configs"] = [
        {"id_feature": user},
        {"id_feature": {"feature_name": "item_id", **item}},
        {"id_feature": {"feature_name": "cate_id", **cate}},
        {"sequence_feature": {"feature_name": "hist_item_id", "sequence_length": HISTORY, **item}},
        {"sequence_feature": {"feature_name": "hist_cate_id", "sequence_length": HISTORY, **cate}},
        {"raw_feature": {"feature_name": "price", "normalizer": {"log1p": True, "mean": 3.0, "std": 0.8}}},
    ]
    raw["model"]["feature_groups"][0]["feature_names"] = ["user_id"]
    return config_from_dict(raw)


def _decimal(ids: np.ndarray) -> pa.Array:
    return pc.cast(pa.array(ids), pa.string())


def write_taobao_like(path: Path, rows: int, seed: int = 0) -> None:
    """``rows`` rows: user_id, item_id, cate_id (decimal strings), hist_item_id and hist_cate_id
    ('|'-joined, HISTORY ids each), price (float64), clk (0/1). Items are Zipf-popular, so a
    history repeats ids as real ones do (what the pyarrow path's dictionary encoding exploits)."""
    rng = np.random.default_rng(seed)
    rank = (rng.zipf(1.1, rows * (HISTORY + 1)) - 1) % ITEMS
    items = rank * 2_654_435_761 % ITEMS + 1  # popular items are not the small ids (a bijection)
    item_cate = rng.integers(1, CATES + 1, ITEMS + 1)
    offsets = pa.array(np.arange(0, rows * HISTORY + 1, HISTORY, dtype=np.int32))

    def joined(ids: np.ndarray) -> pa.Array:
        return pc.binary_join(pa.ListArray.from_arrays(offsets, _decimal(ids)), "|")

    history = items[rows:]
    table = pa.table(
        {
            "user_id": _decimal(rng.integers(1, USERS + 1, rows)),
            "item_id": _decimal(items[:rows]),
            "cate_id": _decimal(item_cate[items[:rows]]),
            "hist_item_id": joined(history),
            "hist_cate_id": joined(item_cate[history]),
            "price": np.exp(rng.normal(3.0, 0.8, rows)),
            "clk": rng.integers(0, 2, rows),
        }
    )
    pq.write_table(table, path)


def bench_data_stage(args) -> dict:
    """rows/s of ``BatchBuilder.build``, native against pyarrow + pyfarmhash (see module doc)."""
    from dynarec.data.batch import BatchBuilder
    from dynarec.features import native

    batch, batches = args.data_batch, args.steps
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="dynarec-bench-data-") as tmp:
            path = Path(tmp) / "taobao_like.parquet"
            write_taobao_like(path, batch * batches)
            table = pq.read_table(path)
        builder = BatchBuilder(_config())
        pieces = [table.slice(i * batch, batch) for i in range(batches)]
        has_native = native.available()

        def run(python: bool) -> float:
            start = time.perf_counter()
            if python:
                with native.python_path():
                    for piece in pieces:
                        builder.build(piece, "taobao_like.parquet")
            else:
                for piece in pieces:
                    builder.build(piece, "taobao_like.parquet")
            return time.perf_counter() - start

        paths = {"native": False, "pyarrow": True} if has_native else {"pyarrow": True}
        for _ in range(args.warmup):
            for python in paths.values():
                run(python)
        rates: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.runs):
            for name, python in paths.items():
                rates[name].append(batch * batches / run(python))
        identical = None
        if has_native:
            fast = builder.build(pieces[0], "taobao_like.parquet")
            with native.python_path():
                slow = builder.build(pieces[0], "taobao_like.parquet")
            identical = (
                torch.equal(fast.sparse.values(), slow.sparse.values())
                and torch.equal(fast.sparse.lengths(), slow.sparse.lengths())
                and fast.groups is not None
                and slow.groups is not None
                and torch.equal(fast.groups, slow.groups)
                and all(torch.equal(fast.dense[k], slow.dense[k]) for k in fast.dense)
            )
    finally:
        torch.set_num_threads(threads)
    result: dict[str, Any] = {
        "rows_per_batch": batch,
        "batches_per_run": batches,
        "history": HISTORY,
        "threads": 1,
        "native_available": has_native,
        "identical_batches": identical,
    }
    for name, runs in rates.items():
        result[name] = {"rows_per_s_median": statistics.median(runs), "rows_per_s_runs": runs}
    lines = []
    for name, what in (("native", "C++ extension"), ("pyarrow", "pyarrow + pyfarmhash")):
        if name in rates:
            runs = rates[name]
            lines.append(
                f"{name} ({what}): {statistics.median(runs):,.0f} rows/s (runs: {', '.join(f'{x:,.0f}' for x in runs)})"
            )
    if has_native:
        result["native_over_pyarrow"] = statistics.median(a / b for a, b in zip(rates["native"], rates["pyarrow"]))
        lines.append(
            f"native / pyarrow = {result['native_over_pyarrow']:.2f}x in the same run; batches identical: {identical}"
        )
    else:
        lines.append("the feature-generation extension is not built: the pyarrow path alone")
    lines.insert(
        0,
        f"BatchBuilder.build, {batches} batches of {batch} rows, 1 thread: string user/item/category ids, "
        f"two '|'-joined histories of {HISTORY}, one dense column, a label, grouped-AUC user ids",
    )
    return {"benchmark": "data-stage", "results": result, "summary": lines}
