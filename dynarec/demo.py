"""``dynarec demo``: the README's main job.

Generates the synthetic click log, trains MultiTowerDIN (``dynarec/resources/demo.yaml``),
evaluates it, exports it, scores the eval split from the export (checking that exported
predictions equal the training model's eval predictions), trains the no-attention baseline (the
same features, the DIN tower replaced by a mean over the history) on the same data, and prints
the demo's AUC, the baseline's, and the Bayes-optimal AUC of the eval split.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import time
from importlib import resources
from pathlib import Path

import numpy as np
import yaml

from dynarec.cli import at_least
from dynarec.files import foreign_files, json_text, relative_files

__all__ = ["main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--work-dir", default="demo_out", help="where data, model dirs and the export go")
    p.add_argument("--train-rows", type=at_least(1), default=400_000, help="rows of the generated training log")
    p.add_argument("--eval-rows", type=at_least(1), default=40_000, help="rows of the generated evaluation log")
    p.add_argument("--epochs", type=at_least(1), default=3, help="epochs of each model")
    p.add_argument("--no-baseline", action="store_true", help="skip the no-attention baseline")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or step lines")
    p.add_argument("--device", default="cpu", help="cpu, or cuda to train on a GPU")


def _baseline(config: dict) -> dict:
    cfg = json.loads(json.dumps(config))
    for tower in cfg["model"]["multi_tower_din"]["din_towers"]:
        tower["pooling"] = "mean"
    return cfg


def main(args) -> None:
    from dynarec.config import config_from_dict
    from dynarec.data.synthetic import SyntheticSpec, make_click_log
    from dynarec.serving import ExportedModel
    from dynarec.train.trainer import Trainer

    start = time.perf_counter()
    work = Path(args.work_dir)
    _clear_work_dir(work)
    (work / DEMO_MARKER).write_text(json_text({"written_by": "dynarec demo"}))  # (a run cut short: still ours)
    meta = make_click_log(work / "data", SyntheticSpec(train_rows=args.train_rows, eval_rows=args.eval_rows))
    bayes = meta["bayes_optimal_eval_auc"]
    print(f"[make-data] {meta['train_rows']} train / {meta['eval_rows']} eval rows; Bayes-optimal eval AUC {bayes:.4f}")

    raw = yaml.safe_load(resources.files("dynarec").joinpath("resources/demo.yaml").read_text())
    raw["train"]["num_epochs"] = args.epochs
    # The first epoch's batches kept for the others (the same training, bit for bit): on a CPU,
    # building a batch of these rows takes about a tenth of a step.
    raw["data"]["cache_batches"] = "memory"
    (work / "demo.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    config = config_from_dict(raw, source=str(work / "demo.yaml"), base_dir=work.resolve())  # (absolute in config.yaml)

    trainer = Trainer(config, work / "model", device=args.device, progress=not args.no_progress)
    print("[plan]\n" + trainer.task.plan.format())
    for name, table in trainer.task.embeddings.tables.items():
        m1 = table.read_rows(torch_arange_or_keys(table))["momentum1"] if table.spec.state_specs() else None
        if m1 is not None and m1.numel():
            print(f"[check] table '{name}' momentum1 before training: {float(m1.min()):.3g}..{float(m1.max()):.3g}")
    report = trainer.fit()
    ev = report["eval"]
    print(
        f"[train] {report['step']} steps in {report['train_seconds']:.1f}s "
        f"({report['steps_per_second']:.1f} steps/s); eval {json.dumps(ev)}"
    )

    outputs, labels, _ = trainer.predict(config.data.eval_input_path)
    probs_eval = outputs["probability"]
    export_dir = trainer.export(work / "export")
    served = ExportedModel(export_dir, device=args.device).predict_files(config.data.eval_input_path)["probability"]
    max_diff = float(np.max(np.abs(served - probs_eval))) if served.size else 0.0
    print(f"[export] {export_dir}: predictions of the export vs the training model's eval: max |diff| {max_diff:.2e}")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"probability": served, "clk": labels[:, 0].astype(np.int64)}), work / "predictions.parquet"
    )
    print(f"[predict] wrote {served.size} predictions to {work / 'predictions.parquet'}")

    baseline_auc = float("nan")
    if not args.no_baseline:
        base_cfg = config_from_dict(_baseline(raw), source="baseline", base_dir=work.resolve())
        base = Trainer(base_cfg, work / "baseline_model", device=args.device, progress=not args.no_progress)
        baseline_auc = base.fit()["eval"]["auc"]

    demo_auc = ev["auc"]
    fraction = (demo_auc - 0.5) / (bayes - 0.5)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print()
    print("==================== dynarec demo ====================")
    print(
        f"MultiTowerDIN eval AUC          {demo_auc:.4f}  (grouped AUC {ev.get('grouped_auc', float('nan')):.4f}, "
        f"log loss {ev.get('log_loss', float('nan')):.4f})"
    )
    print(f"no-attention baseline eval AUC  {baseline_auc:.4f}")
    print(f"Bayes-optimal eval AUC          {bayes:.4f}")
    print(f"fraction of the way 0.5 -> Bayes: {fraction:.3f}")
    print(f"export == eval predictions: max |diff| {max_diff:.2e}")
    print(f"wall time {time.perf_counter() - start:.0f}s, peak RSS {peak_mb:.0f} MB; outputs in {work}/")
    summary = {
        "demo_auc": demo_auc,
        "baseline_auc": baseline_auc,
        "bayes_optimal_auc": bayes,
        "fraction_of_bayes": fraction,
        "export_max_abs_diff": max_diff,
        "eval": ev,
        "wall_seconds": time.perf_counter() - start,
        "peak_rss_mb": peak_mb,
    }
    (work / "demo_summary.json").write_text(json_text(summary))
    (work / DEMO_MARKER).write_text(json_text({"written_by": "dynarec demo", "files": relative_files(work)}))


# What a demo directory holds at its top: a later demo replaces a directory holding nothing else.
DEMO_MARKER = "demo.json"
DEMO_ENTRIES = {
    DEMO_MARKER, "data", "demo.yaml", "model", "export", "predictions.parquet", "baseline_model", "demo_summary.json",
}  # fmt: skip


def _clear_work_dir(work: Path) -> None:
    """Makes ``work`` an empty directory: created, or emptied where it holds a demo's outputs
    alone (:data:`DEMO_ENTRIES`; below them, where the marker lists its files, those alone).
    FileExistsError naming what else it holds, before anything is deleted: ``--work-dir .`` or
    a directory of the user's own is never emptied."""
    if work.exists() and not work.is_dir():
        raise FileExistsError(f"--work-dir {work} exists and is not a directory")
    if work.is_dir():
        foreign = sorted(p.name for p in work.iterdir() if p.name not in DEMO_ENTRIES)
        if not foreign and (work / DEMO_MARKER).is_file():
            foreign = [f for f in foreign_files(work, DEMO_MARKER) if f != f"no {DEMO_MARKER}"]
        if foreign:
            raise FileExistsError(
                f"--work-dir {work} holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}, which the "
                "demo did not write; the demo replaces only a directory of its own outputs: choose a new or empty one"
            )
        for child in work.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    work.mkdir(parents=True, exist_ok=True)


def torch_arange_or_keys(table):
    """Ids to read every row of a table: 0..N-1 of a fixed table, the keys of a dynamic one."""
    import torch

    from dynarec.embedding.dynamic import DynamicTable

    if isinstance(table, DynamicTable):
        return table.index.entries()[1]
    return torch.arange(table.num_embeddings)
