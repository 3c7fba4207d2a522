"""End to end (``dynarec bench e2e``): what a user gets from ``dynarec train``.

The benchmark runs the command a user types, ``dynarec train --config C --model-dir M --device D``,
as a subprocess — the data stage (Parquet reading, FarmHash hashing, batch building), the first
epoch (a dynamic table meeting every key for the first time, growing) and the final checkpoint
and eval included — on a Taobao-like click log: string user, item and category ids, ``|``-joined
histories of 30 items and their categories (``--min-history L``: of L to 30, drawn uniformly for
each row, as the demo's data are), a price, a label (``make_click_log`` with ``string_ids=True``).
The model is the demo's (``resources/demo.yaml``: MultiTowerDIN, a dynamic user table, fixed
item and category tables each shared by the candidate and the history, here over hashed string
ids), trained with the demo's optimizers.

Beside it, in the same run and each run in a fresh process of its own (as a user's script runs,
and as each ``dynarec train`` is), the plain-PyTorch peer a user would write: ``nn.Embedding(sparse=True)``
tables (the user ids hashed into as many rows as the dynamic table's capacity), ``torch.optim.Adagrad``
with the same settings, the same dense tower under the same Adam, the same batches in the same
order for the same epochs. Its ids are hashed and tensorized once, up front, onto the device:
only its training loop is timed, so it pays no data stage at all. It keeps ``nn.Embedding``'s
default N(0, 1) initialization, and dynarec's tables are given the same (``initializer: {kind:
normal, std: 1}``): both sides train the same model. (dynarec's default, torchrec's
U(+-sqrt(1/rows)), learns this model more slowly: after one epoch of 50,000 rows its eval AUC is
0.624 against 0.738 with N(0, 1), docs/benchmarks.md.) Both are evaluated on the same held-out
rows.

dynarec's samples/s are given two ways: by the train command's own report (the rows trained over
its ``train_seconds``: the steps alone; a last batch short of ``--batch`` counts its own rows) and
by the command's wall time (process start to exit: imports, data checks, final checkpoint and eval
included). ``--runs N`` runs each side N times, interleaved (dynarec, peer, dynarec, ...): the
median run of each side is reported, with the median of the per-pair ratios. The data are
generated outside the timed part and cached in the temp directory, keyed by their parameters.

``--config PATH`` runs any config instead of the demo's (a dynarec YAML, or a TorchEasyRec
``pipeline.config``, imported as ``dynarec import-config`` does): its data are what ``dynarec
make-data --config`` writes for it (``--train-rows``, ``--eval-rows``), its batch, workers and
epochs set as above, every table initialized N(0, 1) as the peer's. ``--peer one-table`` gives
the peer every table's rows in one ``nn.Embedding`` at per-table row offsets, its features of
one id a row looked up by one call: what a user writes who concatenates tables of one dim by
hand (a DLRM's). ``--cache-batches`` sets ``data.cache_batches`` (the first epoch's batches
kept for the later ones).
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any, Optional

import torch
import yaml
from torch import nn

from dynarec.bench.common import cached_click_log, cached_config_data, same_dynarec, set_field
from dynarec.bench.train import _PlainTorchModel, _tensorize, one_table_rows
from dynarec.data.generate import GenerateSpec
from dynarec.data.synthetic import SyntheticSpec

__all__ = [
    "HISTORY",
    "bench_e2e",
    "e2e_config",
    "e2e_spec",
    "refuse_min_history_with_config",
    "run_settings",
    "user_config",
]


#: The click log's longest history (every history this long unless ``--min-history`` is given).
HISTORY = 30


def e2e_spec(train_rows: int, eval_rows: int, min_history: int = HISTORY) -> SyntheticSpec:
    """The click log at ``train_rows``: the demo's proportions (a user every 10 rows, an item every
    40, a category every 100 items, at least the demo's 50), every history ``min_history`` to
    :data:`HISTORY` long (default: all of them :data:`HISTORY`), string ids."""
    if not 1 <= min_history <= HISTORY:
        raise ValueError(f"--min-history must be within 1 and {HISTORY}, got {min_history}")
    items = max(train_rows // 40, 1000)
    return SyntheticSpec(
        train_rows=train_rows,
        eval_rows=eval_rows,
        num_users=max(train_rows // 10, 1000),
        num_items=items,
        num_cates=max(items // 100, 50),
        min_hist_len=min_history,
        max_hist_len=HISTORY,
        string_ids=True,
    )


def refuse_min_history_with_config(min_history: int) -> None:
    """ValueError where a shortest history is asked of a config's own data (``--config``): it
    shapes the e2e click log alone."""
    if min_history != HISTORY:
        raise ValueError("--min-history shapes the click log of the demo's model; --config's data are made for it")


def e2e_config(
    spec: SyntheticSpec,
    data_dir: Path,
    batch: int,
    epochs: int,
    workers: Optional[int],
    cache_batches: Optional[str] = None,
) -> dict[str, Any]:
    """The demo config over ``spec``'s string ids: the user table's capacity twice the users
    (a power of two), item and category ids hashed into twice as many rows as there are items and
    categories; the run's settings as :func:`run_settings`."""
    raw = yaml.safe_load(resources.files("dynarec").joinpath("resources/demo.yaml").read_text())
    for entry in raw["feature_configs"]:
        feature = next(iter(entry.values()))
        if feature["feature_name"] == "user_id":
            capacity = 1 << (2 * spec.num_users - 1).bit_length()
            feature["dynamicemb"].update(max_capacity=capacity, init_capacity=max(capacity // 8, 16))
        elif feature.get("embedding_name") in ("item", "cate"):
            ids = spec.num_items if feature["embedding_name"] == "item" else spec.num_cates
            del feature["num_buckets"]
            feature.update(value_type="string", hash_bucket_size=2 * ids)
    return run_settings(raw, data_dir, batch, epochs, workers, cache_batches)


def run_settings(
    raw: dict[str, Any],
    data_dir: Path,
    batch: int,
    epochs: int,
    workers: Optional[int],
    cache_batches: Optional[str] = None,
) -> dict[str, Any]:
    """``raw`` (a config's dict, changed in place and returned) set for a benchmark run: the data
    of ``data_dir`` (``train/``, ``eval/``), ``epochs`` epochs of ``batch``, no eval or
    checkpoint before the end, the whole eval data evaluated, every table initialized N(0, 1) as
    the peer's; ``data.num_workers`` only where ``workers`` is given (otherwise the trainer's own
    choice); ``data.cache_batches`` set to ``cache_batches`` (memory, disk) where given."""
    raw["data"].update(
        train_input_path=str(data_dir / "train"), eval_input_path=str(data_dir / "eval"), batch_size=batch
    )
    if workers is not None:
        raw["data"]["num_workers"] = workers
    if cache_batches:
        raw["data"]["cache_batches"] = cache_batches
    for entry in raw["feature_configs"]:  # the peer's nn.Embedding initialization: the same model
        feature = next(iter(entry.values()))
        if "embedding_dim" in feature:
            feature["initializer"] = {"kind": "normal", "mean": 0.0, "std": 1.0}
    raw["train"].update(
        num_epochs=epochs,
        num_steps=None,
        save_checkpoints_steps=None,
        save_checkpoints_epochs=None,
        eval_every_steps=None,
    )
    raw.setdefault("eval", {})["max_steps"] = None
    return raw


def user_config(path: Path) -> dict[str, Any]:
    """The config at ``path`` as a dict: a TorchEasyRec ``pipeline.config`` (``.config``) imported
    as ``dynarec import-config`` does, else dynarec YAML. Its data paths are placeholders until
    :func:`run_settings` sets them."""
    text = path.read_text()
    if path.suffix != ".config":
        return yaml.safe_load(text)
    from dynarec.config.tzrec.convert import convert_pipeline_config

    placeholder = str(path.with_suffix(".data"))
    return convert_pipeline_config(
        text, train_input_path=placeholder, eval_input_path=placeholder, config_dir=path.parent
    ).config


def _run_dynarec(workdir: Path, device: str) -> tuple[list[str], float, dict[str, Any]]:
    """Runs ``dynarec train`` in ``workdir`` on its ``config.yaml`` into ``model/``; returns the
    command as a user types it, its wall seconds and its report (``metrics.json``'s ``final``:
    steps, train_seconds, steps_per_second, eval)."""
    argv = ["train", "--config", "config.yaml", "--model-dir", "model", "--device", device]
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "dynarec", *argv], cwd=workdir, env=same_dynarec(), capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"dynarec {shlex.join(argv)} exited with status {done.returncode}:\n{done.stderr[-4000:]}")
    report = json.loads((workdir / "model" / "metrics.json").read_text())["final"]
    return ["dynarec", *argv], wall, report


def _check_peer(config) -> None:
    """ValueError where the peer cannot mirror ``config`` (its sparse optimizer is Adagrad's)."""
    from dynarec.optim import Adagrad

    if not isinstance(config.train.sparse_optimizer, Adagrad):
        raise ValueError(f"the peer mirrors Adagrad; the config's is {config.train.sparse_optimizer!r}")


class _Peer:
    """The plain-PyTorch peer (see the module doc): its batches hashed and tensorized onto
    ``device`` once, when it is made; each :meth:`train` builds a fresh model from the config's
    seed and trains it."""

    def __init__(self, config, device: torch.device, one_table: bool = False):
        from dynarec.config.schema import SequenceFeatureCfg
        from dynarec.data.batch import BatchBuilder
        from dynarec.data.reader import ArrowBatchDataset, WorkerFailure, resolve_files
        from dynarec.planner import plan_from_config

        _check_peer(config)
        self.config, self.device, self.one_table = config, device, one_table
        dynamic = {
            f.name: t.dynamic.max_capacity
            for t in plan_from_config(config).table_configs()
            if t.dynamic is not None
            for f in t.feature_configs
        }
        self.key_rows = max(dynamic.values(), default=0)
        sequences = [f.feature_name for f in config.features() if isinstance(f, SequenceFeatureCfg)]
        offsets = one_table_rows(config, self.key_rows)[0] if one_table else None

        def tensorized(path, batch_size: int) -> list[dict[str, Any]]:
            out = []
            for batch in ArrowBatchDataset(resolve_files(path), BatchBuilder(config), batch_size):
                assert not isinstance(batch, WorkerFailure), batch
                out.append(_tensorize(batch, sequences, dynamic, device, offsets))
            return out

        data = config.data
        self.train_batches = tensorized(data.train_input_path, data.batch_size)
        self.eval_batches = tensorized(data.eval_input_path, data.eval_batch_size or data.batch_size)

    def train(self, epochs: int) -> dict[str, Any]:
        """Trains a fresh model for ``epochs`` (only this loop is timed), evaluates it; returns
        its samples/s, training seconds and eval AUC."""
        from dynarec.metrics import auc

        config, spec = self.config, self.config.train.sparse_optimizer
        torch.manual_seed(config.train.seed)
        model = _PlainTorchModel(config, key_rows=self.key_rows, device=self.device, one_table=self.one_table)
        sparse = torch.optim.Adagrad(
            model.tables.parameters(),
            lr=spec.lr,
            eps=spec.eps,
            initial_accumulator_value=spec.initial_accumulator_value,
        )
        dense = config.train.dense_optimizer.build(model.dense.parameters())
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        with warnings.catch_warnings():  # torch's note on every sparse Adagrad step's unchecked sparse tensor
            warnings.filterwarnings("ignore", message="Sparse invariant checks")
            sync()
            start = time.perf_counter()
            for _ in range(epochs):
                for inputs in self.train_batches:
                    loss = nn.functional.binary_cross_entropy_with_logits(model(inputs), inputs["labels"])
                    sparse.zero_grad()
                    dense.zero_grad()
                    loss.backward()
                    sparse.step()
                    dense.step()
            sync()
            seconds = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            scores = torch.cat([torch.sigmoid(model(inputs)).cpu() for inputs in self.eval_batches])
        labels = torch.cat([inputs["labels"].cpu() for inputs in self.eval_batches])
        samples = sum(int(inputs["labels"].numel()) for inputs in self.train_batches) * epochs
        return {
            "samples_per_s": samples / seconds,
            "train_seconds": seconds,
            "eval_auc": auc(scores.numpy(), labels.numpy()),
        }


def _peer_process(raw: dict[str, Any], device: str, one_table: bool, epochs: int, results) -> None:
    """One peer run in a process of its own (spawned): its batches made, then its training loop
    timed, as a user's script runs; ``results`` gets its report (or the error)."""
    from dynarec.config import config_from_dict

    try:
        peer = _Peer(config_from_dict(raw), torch.device(device), one_table=one_table)
        results.put({**peer.train(epochs), "user_rows": peer.key_rows, "pid": os.getpid()})
    except BaseException as e:  # (the parent raises it: a child's traceback would be lost)
        results.put(RuntimeError(f"the plain-PyTorch peer failed: {type(e).__name__}: {e}"))


def _run_peer(raw: dict[str, Any], device: str, one_table: bool, epochs: int) -> dict[str, Any]:
    """A peer run in a fresh process, as each dynarec run is a fresh ``dynarec train``: both pay
    their process's first uses (CUDA's context, cuBLAS's kernel choices at the model's shapes)
    in their timed loop. Run in the bench's own process, the peer paid them in its first run
    only."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_peer_process, args=(raw, device, one_table, epochs, results))
    process.start()
    try:
        while True:
            try:
                out = results.get(timeout=1.0)
                break
            except queue.Empty:
                if not process.is_alive():
                    raise RuntimeError(
                        f"the plain-PyTorch peer's process ended (exit code {process.exitcode}) without a result"
                    ) from None
    finally:
        process.join()
    if isinstance(out, BaseException):
        raise out
    return out


def _median_run(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The run whose ``key`` is the median (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]


def bench_e2e(args) -> dict:
    """samples/s and eval AUC of ``dynarec train`` against the plain-PyTorch peer (module doc):
    ``--runs`` pairs of runs, interleaved (dynarec, peer, dynarec, ...), the peer's batches made
    once before the first; the median run of each side is reported, and the median of the
    per-pair ratios."""
    from dynarec.config import config_from_dict

    eval_rows = args.eval_rows if args.eval_rows is not None else max(args.train_rows // 10, 1000)
    min_history = getattr(args, "min_history", HISTORY)  # (the suite's older reports' arguments lack it)
    if args.config is None:
        spec = e2e_spec(args.train_rows, eval_rows, min_history)
        data_dir = cached_click_log(spec)
        raw = e2e_config(spec, data_dir, args.batch, args.epochs, args.workers, args.cache_batches)
        data: dict[str, Any] = {"spec": asdict(spec)}
        lengths = f"{HISTORY}" if min_history == HISTORY else f"{min_history} to {HISTORY}"
        rows_are = f"Taobao-like rows (string ids, histories of {lengths})"
    else:
        refuse_min_history_with_config(min_history)
        raw = user_config(Path(args.config))
        generated = GenerateSpec(train_rows=args.train_rows, eval_rows=eval_rows)
        data_dir = cached_config_data(raw, generated)
        raw = run_settings(raw, data_dir, args.batch, args.epochs, args.workers, args.cache_batches)
        data = {"config": str(args.config), "generate": asdict(generated)}
        rows_are = f"rows generated for {Path(args.config).name} (dynarec make-data --config)"
    for assignment in getattr(args, "set", None) or ():
        set_field(raw, assignment)
    meta = json.loads((data_dir / "meta.json").read_text())
    data["bayes_optimal_eval_auc"] = meta["bayes_optimal_eval_auc"]
    samples = args.train_rows * args.epochs
    ours_runs: list[dict[str, Any]] = []
    peer_runs: list[dict[str, Any]] = []
    config = config_from_dict(raw)
    _check_peer(config)  # (before any run)
    with tempfile.TemporaryDirectory(prefix="dynarec-bench-e2e-run-") as tmp:
        config_text = yaml.safe_dump(raw)
        for run in range(args.runs):
            workdir = Path(tmp) / f"run-{run}"  # each run a user's fresh directory: config.yaml, model/
            workdir.mkdir()
            (workdir / "config.yaml").write_text(config_text)
            command, wall, report = _run_dynarec(workdir, args.device)
            shutil.rmtree(workdir / "model")  # its checkpoint: a large config's tables, on the disk each run
            ours_runs.append(
                {
                    "samples_per_s_report": samples / report["train_seconds"],
                    "samples_per_s_wall": samples / wall,
                    "wall_seconds": wall,
                    "train_seconds": report["train_seconds"],
                    "steps": report["step"],
                    "eval_auc": report["eval"]["auc"],
                    "eval": report["eval"],
                    # each epoch's pace: the first builds its batches (and fills a batch cache)
                    "epoch_samples_per_s": [args.train_rows / e["seconds"] for e in report["epochs"]],
                }
            )
            peer_runs.append(_run_peer(raw, args.device, args.peer == "one-table", args.epochs))
    ours = {**_median_run(ours_runs, "samples_per_s_report"), "runs": ours_runs}
    theirs = {**_median_run(peer_runs, "samples_per_s"), "runs": peer_runs}
    pairs = list(zip(ours_runs, peer_runs))
    result: dict[str, Any] = {
        "device": args.device,
        "batch": args.batch,
        "epochs": args.epochs,
        "train_rows": args.train_rows,
        "eval_rows": eval_rows,
        "workers": "auto" if args.workers is None else args.workers,
        "cache_batches": config.data.batch_cache or False,
        "runs": args.runs,
        "data": data,
        "peer_tables": args.peer,
        "set": list(getattr(args, "set", None) or ()),
        "command": " ".join(command),
        "dynarec": ours,
        "peer": theirs,
        "dynarec_over_peer": statistics.median(a["samples_per_s_report"] / b["samples_per_s"] for a, b in pairs),
        "dynarec_wall_over_peer": statistics.median(a["samples_per_s_wall"] / b["samples_per_s"] for a, b in pairs),
    }
    workers = "automatic" if args.workers is None else str(args.workers)
    cached = f", the first epoch cached ({result['cache_batches']})" if result["cache_batches"] else ""
    each = lambda runs, key: ", ".join(f"{r[key]:,.0f}" for r in runs)
    peer_tables = (
        "one nn.Embedding(sparse=True) over every table"
        if args.peer == "one-table"
        else "nn.Embedding(sparse=True) a table"
    )
    lines = [
        f"dynarec train on {args.device}, batch {args.batch}, {args.epochs} epoch(s) of "
        f"{args.train_rows:,} {rows_are}, DataLoader workers {workers}"
        f"{cached}{'; ' + ', '.join(result['set']) if result['set'] else ''}; "
        f"eval on {eval_rows:,} held-out rows; {args.runs} run(s) a side, interleaved (medians)",
        f"dynarec:     {ours['samples_per_s_report']:>9,.0f} samples/s by its report (rows trained / train_seconds; "
        f"runs {each(ours_runs, 'samples_per_s_report')}), {ours['samples_per_s_wall']:,.0f} by the command's "
        f"wall time ({ours['wall_seconds']:.1f} s: start-up, data checks, final checkpoint and eval included); "
        f"eval AUC {ours['eval_auc']:.4f}",
        f"plain torch: {theirs['samples_per_s']:>9,.0f} samples/s (its training loop alone, runs "
        f"{each(peer_runs, 'samples_per_s')}, each in a fresh process; {peer_tables} + Adagrad, the dense model's "
        f"optimizer, ids hashed and tensorized up front on {args.device}); eval AUC {theirs['eval_auc']:.4f}",
        f"dynarec / plain torch: {result['dynarec_over_peer']:.2f}x by the report, "
        f"{result['dynarec_wall_over_peer']:.2f}x by wall time; Bayes-optimal eval AUC "
        f"{meta['bayes_optimal_eval_auc']:.4f}",
    ]
    if args.epochs > 1:
        filled = " and fills the cache" if cached else ""
        paces = "; ".join(" / ".join(f"{v:,.0f}" for v in r["epoch_samples_per_s"]) for r in ours_runs)
        lines.insert(
            2, f"dynarec by epoch (its report): {paces} samples/s (the first epoch builds its batches{filled})"
        )
    return {"benchmark": "e2e", "results": result, "summary": lines}
