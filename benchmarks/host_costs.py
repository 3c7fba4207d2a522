"""What a call costs the host on a CUDA machine: a small torch op, an allocation, an event, a
Triton launch (the find kernel on 1,024 keys), ``insert_free`` on 1,024 present keys (its three
kernels and allocations), a host read, a replay of its CUDA graph (``InsertFreeGraph``) and the
pieces of ``find_or_insert(graph=True)`` around it; then ``find_or_insert`` of 1M new keys into
64M slots at load 0.5, eager and graphed: when the call returned and when the device finished,
and where the graphed call's device time goes (medians of 30: :func:`insert_timeline`). Per-call
figures are host microseconds over 300 calls (the device keeps up with them). Usage:

    python benchmarks/host_costs.py
"""

import statistics
import time
from collections.abc import Callable
from typing import Optional

import torch

from dynarec.bench.common import filled_hash_index
from dynarec.embedding.hash_index import BucketedHashIndex
from dynarec.embedding.step import Journal
from dynarec.kernels import gpu


def host_us(fn: Callable[[], object], calls: int = 300) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return host * 1e6


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    index, keys = filled_hash_index(1 << 26, 0.5, dev, gen)
    few = keys[:1024].clone()
    small = torch.zeros(16, device=dev)
    counts = torch.zeros(3, dtype=torch.int32, device=dev)
    event = torch.cuda.Event()
    arrays = (index.keys, index.tags, index.num_buckets, 16)
    graph = gpu.InsertFreeGraph(*arrays, few.numel())
    out = graph.outputs.slots
    costs = {
        "torch add_ on 16 floats": lambda: small.add_(1),
        "torch.zeros(3)": lambda: torch.zeros(3, dtype=torch.int32, device=dev),
        "torch.empty(1M int64)": lambda: torch.empty(1 << 20, dtype=torch.int64, device=dev),
        "event record": lambda: event.record(),
        "stream wait_event": lambda: torch.cuda.current_stream().wait_event(event),
        "tolist of [3] (a host read)": lambda: counts.tolist(),
        "find kernel launch (1,024 keys)": lambda: gpu.find_two_choice(*arrays, few),
        "BucketedHashIndex.find (1,024 keys)": lambda: index.find(few),
        "insert_free (1,024 present keys)": lambda: gpu.insert_free(*arrays, few),
        "its CUDA graph: replay alone": lambda: graph.graph.replay(),
        "its CUDA graph: InsertFreeGraph.run": lambda: graph.run(few),
        "query copy_ into the graph's buffer": lambda: graph.query.copy_(few),
        "clone of the slots": lambda: out.clone(),
        "current_stream()": lambda: torch.cuda.current_stream(dev),
        "find_or_insert(graph=True) (1,024 present)": lambda: index.find_or_insert(few, graph=True),
    }
    print("== host us a call")
    for name, fn in costs.items():
        print(f"{name:<38} {host_us(fn):7.1f}")
    for graphed in (False, True):
        print(f"find_or_insert(graph={graphed}) of 1M new keys, medians of 30 calls: {insert_timeline(index, graphed)}")


class _TimedGraph:
    """A captured graph whose replays are timed by CUDA events around them."""

    def __init__(self, graph: torch.cuda.CUDAGraph):
        self.graph = graph
        self.before, self.after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def replay(self) -> None:
        self.before.record()
        self.graph.replay()
        self.after.record()


def insert_timeline(index: BucketedHashIndex, graphed: bool, calls: int = 30) -> str:
    """When ``find_or_insert`` of 1M new keys returned (host clock) and when the device finished it
    (CUDA events: the GPU's own clocks, caches warm from the calls before); graphed, also how long
    the device took to reach the replay (the host's work before it, the query's copy), the replay
    and what follows it (the outputs' copy, the host read and return). Each call is undone."""
    n = 1 << 20
    timed: Optional[_TimedGraph] = None
    rows: dict[str, list[float]] = {"returned": [], "device done": []}
    if graphed:
        rows |= {"to the replay": [], "replay": [], "after it": []}
    for call in range(calls + 3):  # the first loads the kernels (or captures the graph)
        new = torch.randint(-(2**62), 2**62, (n,), device=index.device)
        journal = Journal()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        began = time.perf_counter()
        start.record()
        index.find_or_insert(new, journal, graph=graphed)
        back = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        journal.undo()
        if graphed and timed is None:
            captured = index._graphs[n]
            timed = _TimedGraph(captured.graph)
            captured.graph = timed  # type: ignore[assignment]
        if call < 3:
            continue
        rows["returned"].append((back - began) * 1e6)
        rows["device done"].append(start.elapsed_time(end) * 1e3)
        if timed is not None:
            rows["to the replay"].append(start.elapsed_time(timed.before) * 1e3)
            rows["replay"].append(timed.before.elapsed_time(timed.after) * 1e3)
            rows["after it"].append(timed.after.elapsed_time(end) * 1e3)
    return ", ".join(f"{name} {statistics.median(v):.0f} us" for name, v in rows.items())


if __name__ == "__main__":
    main()
