"""Where a training step of ``dynarec train`` goes: the e2e benchmark's config and data
(``dynarec bench e2e``), or any config (``--config``, its data paths as they are), trained by
the Trainer. Prints, one line each:

- the data stage alone: batches from the DataLoader (its workers as configured), rows/s;
- the steps alone, on batches built beforehand and held in memory, fed as ``fit`` feeds them
  (the next batch's input stage read ahead while the backward runs): steps/s and samples/s;
- the steps fed live by the DataLoader, as ``fit`` feeds them (``--live``);
- with ``--cprofile``: the host's Python functions over those steps (live ones with ``--live``;
  by own time and by cumulative time); with ``--torch-profile``: torch's op table (host and
  device time);
- with ``--timeline N`` instead: N steps fed live from the pass's first batch, as ``fit`` feeds
  them (worker start, the first step's compilation and epoch boundaries included), printed per
  ``--window`` steps: ms a step, the longest, the host's time in the step's calls and in the
  next batch's input stage, and how long the loop waited for its batches (``--held``: the same
  on ``--warmup + --steps`` batches held in memory, built after the workers delivered).

Usage:

    python benchmarks/tools/profile_train.py --device cuda --batch 4096 --steps 50 --cprofile
    python benchmarks/tools/profile_train.py --device cuda --config dlrm.yaml --steps 50
    python benchmarks/tools/profile_train.py --device cuda --set train.cuda_graphs=false
    python benchmarks/tools/profile_train.py --device cuda --config dlrm.yaml --timeline 300
"""

import argparse
import cProfile
import io
import itertools
import pstats
import tempfile
import threading
import time
from pathlib import Path

import torch
from tool_config import profiled_config  # beside this script
from torch.profiler import ProfilerActivity, profile

from dynarec.bench.common import set_field
from dynarec.config import config_from_dict
from dynarec.train.trainer import Trainer


def _steps(trainer: Trainer, batches, sync) -> float:
    """Seconds for the steps on ``batches`` (a list of batches, or the live ``(batch, position,
    rows)`` items of ``TrainInput.batches``), fed as ``Trainer.fit`` feeds them."""
    start = time.perf_counter()
    items = batches if not isinstance(batches, list) else iter([(b, trainer.position, b.num_rows) for b in batches])
    ahead = trainer.read_ahead(items)
    item = ahead.next()
    while item is not None:
        trainer.train_step(item[0], item[2])
        ahead.read()
        item = ahead.next()
    sync()
    return time.perf_counter() - start


def _timeline(trainer: Trainer, items, steps: int, window: int, sync) -> None:
    """``steps`` steps fed from ``items`` (``TrainInput.batches`` live from the pass's first
    batch, or batches held in memory), printed per ``window`` steps (see the module's
    docstring), with the host's time a step split into the step's own calls (``train_step``),
    the next batch's input stage (``ReadAhead.read`` less the wait) and the wait for batches."""
    waits: list[float] = []

    def timed(items):
        while True:
            start = time.perf_counter()
            item = next(items, None)
            waits.append(time.perf_counter() - start)
            if item is None:
                return
            yield item

    ahead = trainer.read_ahead(timed(items))
    item = ahead.next()
    ends = [time.perf_counter()]
    stepping: list[float] = []
    reading: list[float] = []
    for _ in range(steps):
        if item is None:
            break
        start = time.perf_counter()
        trainer.train_step(item[0], item[2])
        stepped = time.perf_counter()
        ahead.read()
        reading.append(time.perf_counter() - stepped)
        stepping.append(stepped - start)
        item = ahead.next()
        ends.append(time.perf_counter())
        if (len(ends) - 1) % window == 0 or item is None:
            sync()
            done = len(ends) - 1
            first = max(done - window, 0)
            times = [b - a for a, b in zip(ends[first:-1], ends[first + 1 :])]
            waited = waits[first + 1 : done + 1]
            read_s = sum(reading[first:done]) - sum(waited)
            where = f"epoch {item[1].epoch} row {item[1].row:,}" if item is not None else "end of the data"
            print(
                f"steps {first + 1:5d}-{done:5d}: {sum(times) / len(times) * 1e3:7.2f} ms a step "
                f"(longest {max(times) * 1e3:7.1f}; train_step {sum(stepping[first:done]) / len(times) * 1e3:.2f}, "
                f"input stage {read_s / len(times) * 1e3:.2f}); waited for batches "
                f"{sum(waited) / len(waited) * 1e3:6.2f} ms a step (longest {max(waited) * 1e3:6.1f}); next: {where}"
            )
    done, total = len(ends) - 1, ends[-1] - ends[0]
    print(f"{done} steps: {done * trainer.input.global_batch_size / total:,.0f} samples/s")


def _print_graphs(trainer: Trainer) -> None:
    """How the steps so far used CUDA graphs: the whole step's and the dense model's."""
    graphs = getattr(trainer, "step_graphs", None)  # (a tree before whole-step graphs has none)
    if graphs is not None:
        refused = f"; capture refused: {graphs.refused}" if graphs.refused else ""
        eager = [u.name for u in getattr(graphs, "eager_units", [])]
        around = f"; looked up eagerly around them: {', '.join(eager)}" if eager else ""
        print(f"whole-step graphs: {graphs.replays} steps replayed, {graphs.num_graphs} captured{around}{refused}")
    elif hasattr(trainer, "step_graph_refusal"):
        print(f"steps eager: {trainer.step_graph_refusal}")
    dense = getattr(trainer.task, "graphs", None)
    if dense is not None:
        print(f"dense model's graphs: {dense.replays} replays, {dense.num_graphs} captured")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--train-rows", type=int, default=400_000)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--min-history", type=int, default=30, help="the click log's shortest history (up to 30)")
    p.add_argument("--rows-shown", type=int, default=30)
    p.add_argument("--cprofile", action="store_true", help="the host's Python functions over the steps")
    p.add_argument("--torch-profile", action="store_true", help="torch's op table over the steps")
    p.add_argument("--live", action="store_true", help="also the steps fed by the DataLoader")
    p.add_argument("--threads", type=int, help="torch's intra-op threads in this process")
    p.add_argument("--no-pin", action="store_true", help="batches in pageable memory")
    p.add_argument("--config", help="profile this config (its data paths as they are; --batch ignored)")
    p.add_argument("--timeline", type=int, metavar="N", help="only: N steps fed live from the pass's start, per window")
    p.add_argument("--window", type=int, default=25, help="steps a --timeline line averages")
    p.add_argument("--held", action="store_true", help="--timeline on warmup + steps batches held in memory")
    p.add_argument("--drain", action="store_true", help="with --held: a thread drains the DataLoader meanwhile")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config field, dotted, its value as YAML (e.g. train.cuda_graphs=false); repeatable",
    )
    a = p.parse_args()
    raw, a.batch = profiled_config(a.config, a.batch, a.train_rows, a.workers, a.min_history)
    for item in a.set:
        set_field(raw, item)
    raw["train"].update(num_epochs=None, num_steps=10**9, log_step_count_steps=10**9)
    on_cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    with tempfile.TemporaryDirectory() as work:
        trainer = Trainer(config_from_dict(raw), Path(work) / "m", device=a.device, progress=False)
        trainer.input.pin = trainer.input.pin and not a.no_pin
        if a.threads:
            torch.set_num_threads(a.threads)
        if a.timeline and not a.held:
            _timeline(trainer, trainer.input.batches(trainer.position), a.timeline, a.window, sync)
            _print_graphs(trainer)
            return
        source = trainer.input.batches(trainer.position)
        next(source)  # the workers started
        start = time.perf_counter()
        batches = [next(source)[0] for _ in range(a.warmup + a.steps)]
        data_s = time.perf_counter() - start
        print(
            f"data stage ({trainer.input.num_workers} workers): {len(batches) * a.batch / data_s:,.0f} rows/s "
            f"({data_s / len(batches) * 1e3:.2f} ms a batch of {a.batch})"
        )
        if a.timeline:  # --held
            held = iter([(b, trainer.position, b.num_rows) for b in batches])
            stop = threading.Event()
            drain = threading.Thread(target=lambda: any(stop.is_set() for _ in source))
            if a.drain:  # the live loader's work, its batches dropped, beside the held steps
                drain.start()
            try:
                _timeline(trainer, held, a.timeline, a.window, sync)
                _print_graphs(trainer)
            finally:
                stop.set()
                if a.drain:
                    drain.join()
            return
        _steps(trainer, batches[: a.warmup], sync)
        steps_s = _steps(trainer, batches[a.warmup :], sync) / a.steps
        print(
            f"steps alone, batch {a.batch} on {a.device}: {steps_s * 1e3:.2f} ms a step "
            f"({a.batch / steps_s:,.0f} samples/s)"
        )
        _print_graphs(trainer)
        live = None
        if a.live:
            live = itertools.islice(source, a.steps)
            _steps(trainer, itertools.islice(source, a.warmup), sync)
            live_s = _steps(trainer, itertools.islice(source, a.steps), sync) / a.steps
            print(f"steps fed by the DataLoader: {live_s * 1e3:.2f} ms a step ({a.batch / live_s:,.0f} samples/s)")
        if a.cprofile:
            prof = cProfile.Profile()
            prof.enable()
            _steps(trainer, live if live is not None else batches[a.warmup :], sync)
            prof.disable()
            for order in ("tottime", "cumulative"):
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats(order).print_stats(a.rows_shown)
                print(f"--- cProfile over {a.steps} steps, by {order}\n{out.getvalue()}")
        if a.torch_profile:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
            with profile(activities=activities) as tprof:
                _steps(trainer, batches[a.warmup :], sync)
            events = tprof.key_averages()
            print(events.table(sort_by="self_cpu_time_total", row_limit=a.rows_shown))
            if on_cuda:
                print(events.table(sort_by="self_device_time_total", row_limit=a.rows_shown))


if __name__ == "__main__":
    main()
