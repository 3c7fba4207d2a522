"""End-to-end training throughput (``dynarec bench train-step``): the demo model trained by
dynarec — data pipeline included (Parquet reading and batch building) — against a plain-torch
baseline of the same model in the same run: ``nn.Embedding(sparse=True)`` tables,
``torch.optim.Adagrad``, the same dense tower, ids pre-hashed and batches tensorized up front.

Under torchrun (``torchrun --nproc-per-node N -m dynarec bench train-step``) every rank trains its
own per-GPU batch, the item table row-wise and the user table key-hashed, both sized per rank:
the weak-scaling figure (samples/s at N ranks over N times samples/s at 1).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from importlib import resources
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from torch import nn

__all__ = ["bench_train_step"]


def _config(data_dir: Path, batch: int, workers: int, world: int, users: int, items: int):
    from dynarec.config import config_from_dict

    raw = yaml.safe_load(resources.files("dynarec").joinpath("resources/demo.yaml").read_text())
    raw["data"].update(
        train_input_path=str(data_dir / "train"), eval_input_path=None, batch_size=batch, num_workers=workers
    )
    raw["train"].update(
        num_epochs=None, num_steps=10**9, save_checkpoints_steps=None, eval_every_steps=None, log_step_count_steps=10**9
    )
    raw["eval"] = {"metrics": ["auc"]}
    for f in raw["feature_configs"]:
        feat = next(iter(f.values()))
        if feat["feature_name"] == "user_id":
            feat["dynamicemb"].update(max_capacity=2 * users, init_capacity=2 * users)
        if feat.get("embedding_name") == "item":
            feat["num_buckets"] = items
            if world > 1:
                feat["sharding"] = "row_wise"
    return config_from_dict(raw)


class _PlainTorchModel(nn.Module):
    """The plain-PyTorch peer of a config's model: one ``nn.Embedding(sparse=True)`` per table (a
    dynamic table as ``key_rows`` rows, its keys hashed into them by :func:`_tensorize`), the
    config's dense tower.

    ``one_table``: every table's rows in one ``nn.Embedding`` instead, each table at its row
    offset (:attr:`offsets`), what a user writes who concatenates tables of one dim by hand;
    the features of one id a row are then looked up by one call (``inputs["stacked"]``)."""

    def __init__(self, config, key_rows: int, device: torch.device, one_table: bool = False):
        super().__init__()
        from dynarec.models.registry import build_model
        from dynarec.planner import plan_from_config

        self.tables = nn.ModuleDict()
        self.table_of: dict[str, str] = {}
        self.offsets: dict[str, int] = {}  # one_table: each feature's first row
        if one_table:
            self.offsets, num_rows, dim = one_table_rows(config, key_rows)
            self.table_of = dict.fromkeys(self.offsets, "all")
            self.tables["all"] = nn.Embedding(num_rows, dim, sparse=True, device=device)
        else:
            for t in plan_from_config(config).table_configs():
                rows = t.num_embeddings if t.num_embeddings is not None else key_rows
                self.tables[t.name] = nn.Embedding(rows, t.dim, sparse=True, device=device)
                for f in t.feature_configs:
                    self.table_of[f.name] = t.name
        self.dense = build_model(config).to(device)

    def forward(self, inputs: dict[str, Any]) -> torch.Tensor:
        emb: dict[str, torch.Tensor] = {}
        if "stacked" in inputs:
            names, ids = inputs["stacked"]
            rows = self.tables["all"](ids)  # [B, F, D]
            emb.update((name, rows[:, i]) for i, name in enumerate(names))
        for name, (ids, mask) in inputs["ids"].items():
            e = self.tables[self.table_of[name]](ids)
            emb[name] = e if mask is None else e * mask[..., None]
        return self.dense(emb, inputs["lengths"], inputs["dense"])


def one_table_rows(config, key_rows: int) -> tuple[dict[str, int], int, int]:
    """Every table of ``config`` in one table of rows (a dynamic table as ``key_rows`` rows):
    ``(each feature's first row, the rows in all, their dim)``; ValueError where the tables'
    dims differ."""
    from dynarec.planner import plan_from_config

    tables = plan_from_config(config).table_configs()
    dims = {t.dim for t in tables}
    if len(dims) != 1:
        raise ValueError(f"one table holds rows of one dim; the config's tables have dims {sorted(dims)}")
    offsets, start = {}, 0
    for t in tables:
        offsets.update(dict.fromkeys((f.name for f in t.feature_configs), start))
        start += t.num_embeddings if t.num_embeddings is not None else key_rows
    return offsets, start, dims.pop()


def _tensorize(
    batch,
    sequences: list[str],
    key_rows: dict[str, int],
    device: torch.device,
    offsets: Optional[dict[str, int]] = None,
) -> dict[str, Any]:
    """A dynarec Batch as the peer's tensors on ``device``: ids per feature (sequences padded,
    with a mask), the keys of each feature in ``key_rows`` hashed into that many rows. Every
    other feature must hold one id a row (ValueError naming it otherwise). ``offsets`` (a
    one-table peer's): each feature's ids shifted to its table's rows, and the features of one
    id a row stacked into one ``[B, F]`` tensor (``"stacked"``: their names and ids)."""
    keys, values, lengths = batch.sparse.keys(), batch.sparse.values(), batch.sparse.lengths()
    b = batch.num_rows
    per_key = lengths.view(len(keys), b)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(per_key.sum(1), 0)])
    ids: dict[str, Any] = {}
    stacked: list[tuple[str, torch.Tensor]] = []
    for k, name in enumerate(keys):
        v = values[starts[k] : starts[k + 1]]
        if name in key_rows:
            v = v % key_rows[name]
        if offsets is not None:
            v = v + offsets[name]
        if name in sequences:
            lens = per_key[k]
            width = max(int(lens.max()), 2)
            mask = torch.arange(width)[None, :] < lens[:, None]
            padded = torch.zeros(b, width, dtype=torch.int64)
            padded[mask] = v
            ids[name] = (padded.to(device), mask.to(device=device, dtype=torch.float32))
            continue
        if not bool((per_key[k] == 1).all()):
            raise ValueError(
                f"feature '{name}': the plain-torch peer looks up one id a row; some rows hold another count"
            )
        if offsets is not None:
            stacked.append((name, v))
        else:
            ids[name] = (v.to(device), None)
    out: dict[str, Any] = {
        "ids": ids,
        "lengths": {n: per_key[keys.index(n)].to(device) for n in sequences},
        "dense": {k: x.to(device) for k, x in batch.dense.items()},
        "labels": batch.labels[:, 0].to(device),
    }
    if stacked:
        out["stacked"] = ([n for n, _ in stacked], torch.stack([v for _, v in stacked], dim=1).to(device))
    return out


def bench_train_step(args) -> dict:
    """samples/s of the demo model's training step, dynarec vs plain torch (see module doc)."""
    from dynarec.bench.common import cached_click_log
    from dynarec.data.synthetic import SyntheticSpec
    from dynarec.distributed.context import init_distributed
    from dynarec.train.trainer import Trainer

    ctx = init_distributed(args.device, timeout_s=600)
    world, batch = ctx.world_size, args.batch
    device = ctx.device if ctx.distributed else torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    total_steps = args.warmup + args.runs * args.steps
    users, items = args.users * world, args.items * world
    spec = SyntheticSpec(
        train_rows=batch * world * (total_steps + 2),
        eval_rows=1000,
        num_users=users,
        num_items=items,
        train_files=max(4, world),
    )
    if ctx.is_main:  # the other ranks find it in place after the barrier
        cached_click_log(spec)
    ctx.barrier("the benchmark data")
    config = _config(cached_click_log(spec), batch, args.workers, world, users, items)
    model_dir = Path(tempfile.mkdtemp(prefix=f"dynarec-bench-train-rank{ctx.rank}-"))
    trainer = Trainer(config, model_dir, device=str(device), progress=False, ctx=ctx)
    # as Trainer.fit: the next batch is read, and its input stage started, while a backward runs
    ahead = trainer.read_ahead(trainer.input.batches(trainer.position))

    def run_dynarec(steps: int) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            item = ahead.next()
            assert item is not None, "the benchmark data holds a batch for every step"
            b, trainer.position, rows = item
            if trainer.train_step(b, rows) is not None and not ctx.distributed:
                ahead.read()
        sync()
        return time.perf_counter() - start

    baseline = None
    if not ctx.distributed:  # the plain-torch model of the same shape, batches tensorized up front
        torch.manual_seed(config.train.seed)
        model = _PlainTorchModel(config, key_rows=2 * users, device=device)
        sparse = torch.optim.Adagrad(model.tables.parameters(), lr=0.05, initial_accumulator_value=0.1)
        dense = torch.optim.Adam(model.dense.parameters(), lr=0.002)
        sequences = trainer.task.sequence_features
        source = trainer.input.batches(trainer.position)
        loaded = [
            _tensorize(next(source)[0], sequences, {"user_id": 2 * users}, device) for _ in range(min(total_steps, 32))
        ]

        def run_baseline(steps: int) -> float:
            sync()
            start = time.perf_counter()
            for i in range(steps):
                inputs = loaded[i % len(loaded)]
                loss = nn.functional.binary_cross_entropy_with_logits(model(inputs), inputs["labels"])
                sparse.zero_grad()
                dense.zero_grad()
                loss.backward()
                sparse.step()
                dense.step()
            sync()
            return time.perf_counter() - start

        baseline = run_baseline
    run_dynarec(args.warmup)
    if baseline is not None:
        baseline(args.warmup)
    ours, theirs = [], []
    for _ in range(args.runs):
        ours.append(batch * world * args.steps / run_dynarec(args.steps))
        if baseline is not None:
            theirs.append(batch * args.steps / baseline(args.steps))
    result: dict[str, Any] = {
        "world_size": world,
        "batch_per_rank": batch,
        "device": str(device),
        "workers": args.workers,
        "dynarec_samples_per_s_median": statistics.median(ours),
        "dynarec_runs": ours,
    }
    lines = [
        f"dynarec: {statistics.median(ours):,.0f} samples/s on {world} rank(s) x batch {batch} "
        f"(runs: {', '.join(f'{x:,.0f}' for x in ours)}; data pipeline on {args.workers} worker(s) per rank)"
    ]
    if theirs:
        result.update(
            baseline_samples_per_s_median=statistics.median(theirs),
            baseline_runs=theirs,
            dynarec_over_baseline=statistics.median(a / b for a, b in zip(ours, theirs)),
        )
        lines.append(
            f"plain torch (nn.Embedding(sparse) + Adagrad, batches up front): "
            f"{statistics.median(theirs):,.0f} samples/s; dynarec / it = {result['dynarec_over_baseline']:.2f}x"
        )
    shutil.rmtree(model_dir, ignore_errors=True)
    if ctx.distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
    return {"benchmark": "train-step", "results": result, "summary": lines if ctx.is_main else []}
