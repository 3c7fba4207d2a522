"""What a call costs the host on a CUDA machine: a small torch op, an allocation, an event, a
Triton launch (the find kernel on 1,024 keys), ``insert_free`` on 1,024 present keys (its three
kernels and allocations), a host read, a replay of its CUDA graph (``InsertFreeGraph``) and the
pieces of ``find_or_insert(graph=True)`` around it; then ``find_or_insert`` of 1M new keys into
64M slots at load 0.5, eager and graphed: when the call returned and when the device finished
(median of 10). Per-call figures are host microseconds over 300 calls (the device keeps up with
them). Usage:

    python benchmarks/host_costs.py
"""

import statistics
import time
from collections.abc import Callable

import torch

from dynarec.bench.common import filled_hash_index
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
    out = graph.outputs[0]
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
        returned, finished = [], []
        for run in range(11):
            new = torch.randint(-(2**62), 2**62, (1 << 20,), device=dev)
            journal = Journal()
            torch.cuda.synchronize()
            start = time.perf_counter()
            index.find_or_insert(new, journal, graph=graphed)
            back = time.perf_counter()
            torch.cuda.synchronize()
            if run:  # the first loads the kernels (or captures the graph)
                returned.append((back - start) * 1e6)
                finished.append((time.perf_counter() - start) * 1e6)
            journal.undo()
        print(
            f"find_or_insert(graph={graphed}) of 1M new keys: returned after {statistics.median(returned):.0f} us, "
            f"device done after {statistics.median(finished):.0f} us (medians of 10)"
        )


if __name__ == "__main__":
    main()
