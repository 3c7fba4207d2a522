"""The config a profiling tool runs (``profile_train.py``, ``profile_data.py``)."""

import json
from typing import Optional

from dynarec.bench.common import cached_click_log
from dynarec.bench.e2e import e2e_config, e2e_spec
from dynarec.config import load_config


def profiled_config(config: Optional[str], batch: int, train_rows: int, workers: Optional[int] = None):
    """``(raw config, batch size)`` a profiling tool runs: ``config``'s (its data paths as they
    are, its batch size), else the e2e benchmark's at ``batch`` over its click log of
    ``train_rows`` rows (generated on first use); no eval input."""
    if config:
        raw = json.loads(load_config(config).model_dump_json())
        batch = raw["data"]["batch_size"]
    else:
        spec = e2e_spec(train_rows, 10_000)
        raw = e2e_config(spec, cached_click_log(spec), batch, 1, workers)
    raw["data"]["eval_input_path"] = None
    return raw, batch
