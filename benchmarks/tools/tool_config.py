"""What a profiling tool runs: the config (``profile_train.py``, ``profile_data.py``), or one
table's training step (``profile_step.py``, ``step_sections.py``, ``step_ops_ab.py``)."""

import argparse
import dataclasses
import json
from typing import Optional

from dynarec.bench.common import Workload, cached_click_log, make_table
from dynarec.bench.e2e import HISTORY, e2e_config, e2e_spec, refuse_min_history_with_config
from dynarec.bench.steps import OPTIMIZERS
from dynarec.config import load_config
from dynarec.embedding import EmbeddingCollection


def profiled_config(
    config: Optional[str], batch: int, train_rows: int, workers: Optional[int] = None, min_history: int = HISTORY
):
    """``(raw config, batch size)`` a profiling tool runs: ``config``'s (its data paths as they
    are, its batch size), else the e2e benchmark's at ``batch`` over its click log of
    ``train_rows`` rows, histories ``min_history`` to ``HISTORY`` long (generated on first use);
    no eval input."""
    if config:
        refuse_min_history_with_config(min_history)
        raw = json.loads(load_config(config).model_dump_json())
        batch = raw["data"]["batch_size"]
    else:
        spec = e2e_spec(train_rows, 10_000, min_history)
        raw = e2e_config(spec, cached_click_log(spec), batch, 1, workers)
    raw["data"]["eval_input_path"] = None
    return raw, batch


def add_table_step_arguments(p: argparse.ArgumentParser, **defaults) -> None:
    """The options of one table's step (``--device --kind --rows --dim --bags --pooling-factor
    --steps``), with these tools' ``defaults``."""
    p.add_argument("--device", default=defaults.get("device", "cpu"))
    p.add_argument("--kind", choices=["fixed", "dynamic"], default="fixed")
    p.add_argument("--rows", type=int, default=defaults.get("rows", 1_000_000))
    p.add_argument("--dim", type=int, default=defaults.get("dim", 64))
    p.add_argument("--bags", type=int, default=65536)
    p.add_argument("--pooling-factor", type=int, default=16)
    p.add_argument("--steps", type=int, default=defaults.get("steps", 5))
    p.add_argument("--new-keys", type=float, default=0.0, help="the share of a step's ids never seen before")
    p.add_argument("--data-type", choices=["fp32", "bf16", "fp16"], default="fp32", help="the rows' storage type")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adagrad")


def table_step(a: argparse.Namespace):
    """``(workload, its batches, a collection of its one table "t" with feature "f")``
    from :func:`add_table_step_arguments`' options: 4 batches run cyclically, or with
    ``--new-keys`` a stream of 4 warm-up batches then one a step (and the prefetch's 2)."""
    w = Workload(num_embeddings=a.rows, dim=a.dim, bags=a.bags, pooling_factor=a.pooling_factor, num_batches=4)
    count = w.num_batches + a.steps + 2 if a.new_keys else None
    batches = w.batches(keys_over_int64=a.kind == "dynamic", device=a.device, new_keys=a.new_keys, count=count)
    table = dataclasses.replace(make_table(a.kind, "native", w), data_type=a.data_type)
    coll = EmbeddingCollection([table], OPTIMIZERS[a.optimizer], device=a.device)
    return w, batches, coll


def run_table_step(coll: EmbeddingCollection, batches: list, i: int) -> None:
    """Step ``i`` of :func:`table_step`'s collection, as the trainer runs one: the forward and
    backward of batch ``i``, then the input stage of the batch ``prefetch_depth`` on, once the
    backward is queued."""
    coll(batches[i % len(batches)])["f"].sum().backward()
    coll.prefetch(batches[(i + coll.prefetch_depth) % len(batches)])
