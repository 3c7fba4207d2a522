"""Where a training step of ``dynarec train`` goes: the e2e benchmark's config and data
(``dynarec bench e2e``), or any config (``--config``, its data paths as they are), trained by
the Trainer for ``--steps`` steps under the torch profiler, after ``--warmup`` steps. Prints the
wall time a step, the device's busy time a step, and the ops by host (self CPU) time and by
device time. Usage:

    python benchmarks/tools/profile_train.py --device cuda --batch 4096 --steps 30
    python benchmarks/tools/profile_train.py --device cuda --config dlrm.yaml --steps 30
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dynarec.bench.common import cached_click_log
from dynarec.bench.e2e import e2e_config, e2e_spec
from dynarec.config import config_from_dict, load_config
from dynarec.train.trainer import Trainer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--train-rows", type=int, default=400_000)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--rows-shown", type=int, default=30)
    p.add_argument("--config", help="profile this config (its data paths as they are; --batch ignored)")
    a = p.parse_args()
    if a.config:
        raw = json.loads(load_config(a.config).model_dump_json())
        a.batch = raw["data"]["batch_size"]
    else:
        spec = e2e_spec(a.train_rows, 10_000)
        raw = e2e_config(spec, cached_click_log(spec), a.batch, 1, a.workers)
    raw["data"]["eval_input_path"] = None
    raw["train"].update(num_epochs=None, num_steps=a.warmup + a.steps, log_step_count_steps=10**9)
    with tempfile.TemporaryDirectory() as work:
        trainer = Trainer(config_from_dict(raw), Path(work) / "m", device=a.device, progress=False)
        sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
        batches = trainer.input.batches(trainer.position)
        for _ in range(a.warmup):
            batch, trainer.position, rows = next(batches)
            trainer.train_step(batch, rows)
        sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
        start = time.perf_counter()
        with profile(activities=activities) as prof:
            for _ in range(a.steps):
                batch, trainer.position, rows = next(batches)
                trainer.train_step(batch, rows)
            sync()
        wall = (time.perf_counter() - start) / a.steps
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / a.steps
    print(
        f"batch {a.batch} on {a.device}: {wall * 1e3:.2f} ms a step under the profiler "
        f"({a.batch / wall:,.0f} samples/s); device busy {device_us / 1e3:.2f} ms a step"
    )
    print(events.table(sort_by="self_cpu_time_total", row_limit=a.rows_shown))
    if a.device.startswith("cuda"):
        print(events.table(sort_by="self_device_time_total", row_limit=a.rows_shown))


if __name__ == "__main__":
    main()
