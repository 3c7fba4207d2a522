"""Where a find-or-insert's time goes: the hash-find benchmark's insert under the torch profiler,
ops sorted by device time, and the wall time of each part. ``--path planned``: find a batch of
new keys, take the distinct absent ones, plan their slots, commit; ``--path absent``: find, then
``insert_absent`` on the occurrences; ``--path fused``: ``find_or_insert`` (one call);
``--path graphed``: ``find_or_insert(graph=True)`` (its first round a replayed CUDA graph). Usage:

    python benchmarks/profile_insert.py --device cuda --slots 67108864 --load 0.5 --path absent
"""

import argparse
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dynarec.bench.common import filled_hash_index, synchronizer
from dynarec.embedding.step import Journal


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--slots", type=int, default=1 << 22)
    p.add_argument("--load", type=float, default=0.5)
    p.add_argument("--batch", type=int, default=1 << 20)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--rows-shown", type=int, default=25)
    p.add_argument("--path", choices=("planned", "absent", "fused", "graphed"), default="planned")
    p.add_argument("--timeline", action="store_true", help="also list the profiled run's ops and kernels in time order")
    a = p.parse_args()
    sync = synchronizer(a.device)
    gen = torch.Generator().manual_seed(0)
    index, _ = filled_hash_index(a.slots, a.load, a.device, gen)
    names = {"planned": ("find + unique", "plan", "commit"), "absent": ("find", "insert_absent")}.get(
        a.path, ("find_or_insert",)
    )
    parts: dict[str, list[float]] = {name: [] for name in names}
    host: dict[str, list[float]] = {name: [] for name in parts}  # until the call returned

    def insert_once(new: torch.Tensor) -> None:
        journal = Journal()
        sync()
        t = [time.perf_counter()]
        returned = []

        def part_done() -> None:
            returned.append(time.perf_counter())
            sync()
            t.append(time.perf_counter())

        if a.path in ("fused", "graphed"):
            index.find_or_insert(new, journal, graph=a.path == "graphed")
            part_done()
        elif a.path == "absent":
            slots = index.find(new)
            part_done()
            index.insert_absent(new, slots, journal)
            part_done()
        else:
            slots = index.find(new)
            fresh = torch.unique(new[slots < 0])
            part_done()
            plan = index.plan_insert(fresh, allow_evict=False, keys_ascending=True)
            part_done()
            index.commit(plan, torch.zeros_like(fresh), journal)
            part_done()
        for i, name in enumerate(parts):
            parts[name].append((t[i + 1] - t[i]) * 1e3)
            host[name].append((returned[i] - t[i]) * 1e3)
        journal.undo()

    def new_keys() -> torch.Tensor:
        return torch.randint(-(2**62), 2**62, (a.batch,), generator=gen).to(a.device)

    insert_once(new_keys())  # warm-up: compiles the kernels
    for v in (*parts.values(), *host.values()):
        v.clear()
    for _ in range(a.runs):
        insert_once(new_keys())
    print(f"== find-or-insert of {a.batch:,} new keys into {a.slots:,} slots at load {index.size / index.capacity:.3f}")
    for name, v in parts.items():
        print(
            f"{name:<14} median {sorted(v)[len(v) // 2]:.3f} ms  runs {' '.join(f'{x:.3f}' for x in v)}; "
            f"the call returned after {sorted(host[name])[len(v) // 2]:.3f} ms (median)"
        )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
    new = new_keys()
    with profile(activities=activities) as prof:
        insert_once(new)
    key = "self_cuda_time_total" if a.device.startswith("cuda") else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=a.rows_shown, max_name_column_width=60))
    if a.timeline:
        print_timeline(prof.events())


def print_timeline(events) -> None:
    """The host's top-level ops and the device's work, in start order (us from the first), with
    durations: where a call's time goes between launching, waiting and the device."""
    shown = [e for e in events if e.device_type == DeviceType.CUDA or e.cpu_parent is None]
    shown.sort(key=lambda e: e.time_range.start)
    t0 = shown[0].time_range.start
    for e in shown:
        where = "device" if e.device_type == DeviceType.CUDA else "host  "
        r = e.time_range
        print(f"{where} {r.start - t0:9.1f} us  {r.end - r.start:8.1f} us  {e.name[:70]}")


if __name__ == "__main__":
    main()
