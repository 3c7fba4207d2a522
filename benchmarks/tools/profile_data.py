"""Where the data stage of ``dynarec train`` goes: the e2e benchmark's click log (or any config's
training files, ``--config``), one line each:

- decode: the files' columns read by pyarrow on one thread, rows/s;
- build: ``BatchBuilder.build`` on already-decoded slices of one batch each, one thread, rows/s;
- loader: batches from the training run's own loader (page-locked on ``--device cuda``, as the
  trainer has them) with each of ``--workers`` DataLoader workers, rows/s, once every worker has
  delivered its first batch (the pass's start: its first row group decodes at one core's pace).

Usage:

    python benchmarks/tools/profile_data.py --device cuda --workers 1 4 8 14
    python benchmarks/tools/profile_data.py --config dlrm.yaml --workers 0 2
"""

import argparse
import time

import pyarrow as pa
import torch
from tool_config import profiled_config  # beside this script

from dynarec.config import config_from_dict
from dynarec.data.batch import RowOrigin
from dynarec.data.reader import _record_batches, make_loader
from dynarec.distributed.context import single_process
from dynarec.train.input import TrainInput


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--train-rows", type=int, default=400_000)
    p.add_argument("--workers", type=int, nargs="+", default=[0])
    p.add_argument("--batches", type=int, default=60, help="batches timed per worker count")
    p.add_argument("--config", help="this config's training files (--batch ignored)")
    a = p.parse_args()
    raw, a.batch = profiled_config(a.config, a.batch, a.train_rows)
    if a.device.startswith("cuda"):
        torch.zeros(1, device=a.device)  # CUDA initialized, as in a training run (workers then fork-served)
    inputs = TrainInput(config_from_dict(raw), single_process(a.device), torch.device(a.device).type)
    if True:
        dataset = inputs.dataset(raw["data"]["train_input_path"], a.batch, training=True)
        columns = dataset.builder.columns()
        pa.set_cpu_count(1)
        start = time.perf_counter()
        tables = [pa.Table.from_batches([rb]) for f in dataset.files for rb in _record_batches(f, columns, None)]
        decode_s = time.perf_counter() - start
        rows = sum(t.num_rows for t in tables)
        print(f"decode, 1 thread: {rows / decode_s:,.0f} rows/s ({rows} rows of {len(dataset.files)} files)")
        slices = [t.slice(i, a.batch) for t in tables for i in range(0, t.num_rows - a.batch + 1, a.batch)]
        slices = slices[: a.batches]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        dataset.builder.build(slices[0], RowOrigin((("x", 0, a.batch),)))
        start = time.perf_counter()
        for s in slices:
            dataset.builder.build(s, RowOrigin((("x", 0, a.batch),)))
        build_s = time.perf_counter() - start
        print(f"build, 1 thread: {len(slices) * a.batch / build_s:,.0f} rows/s")
        torch.set_num_threads(threads)
        for workers in a.workers:
            loader = iter(make_loader(dataset, workers, inputs.pin))
            for _ in range(2 * workers + 1):  # every worker started and past its first batch
                next(loader)
            start = time.perf_counter()
            n = sum(1 for _, _ in zip(range(a.batches), loader))
            loader_s = time.perf_counter() - start
            rate = n * a.batch / loader_s
            print(f"loader, {workers} workers: {rate:,.0f} rows/s ({loader_s / n * 1e3:.2f} ms a batch)")
            del loader


if __name__ == "__main__":
    main()
