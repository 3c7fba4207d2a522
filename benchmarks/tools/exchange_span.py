"""What a host-memory tier's row exchange costs as a function of how widely its rows are spread
in host memory: ``dynarec::exchange_rows`` of ``--rows`` rows (ascending, as a cached store
orders them) out of and into a device cache, the rows drawn from the first ``span`` rows of a
host table, for several spans and row counts; and the host memory kinds (locked in place by
``cudaHostRegister``, allocated by ``cudaHostAlloc``, transparent huge pages madvised).

    python benchmarks/tools/exchange_span.py --table 40000000 --dim 128
"""

from __future__ import annotations

import argparse
import ctypes

import torch
from tune_exchange import timed  # beside this script

from dynarec.devices import page_lock
from dynarec.kernels.gpu import rows as gpu_rows


def exchange_gbps(cache: torch.Tensor, host: torch.Tensor, rows: int, span: int) -> tuple[float, float]:
    """(GB/s both directions together, ms) of one exchange of ``rows`` rows each way."""
    picked = torch.randperm(span, device="cuda")[: 2 * rows]
    slots = torch.randperm(cache.shape[0], device="cuda")[:rows]
    out_rows, in_rows = torch.sort(picked[:rows])[0], torch.sort(picked[rows:])[0]
    t = timed(lambda: gpu_rows.exchange_rows([cache], slots, [host], out_rows, in_rows))
    return 2 * rows * host.shape[1] * host.element_size() / t / 1e9, 1e3 * t


def madvised(rows: int, dim: int) -> torch.Tensor:
    """A host table whose 2 MiB-aligned pages are madvised for transparent huge pages."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    t = torch.empty(rows, dim)
    huge = 2 << 20
    start = -(-t.data_ptr() // huge) * huge
    end = (t.data_ptr() + t.numel() * t.element_size()) // huge * huge
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 14)
    return t.fill_(0.5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--table", type=int, default=40_000_000)
    p.add_argument("--cache", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=128)
    args = p.parse_args()
    cache = torch.zeros(args.cache, args.dim, device="cuda")
    host = page_lock(torch.full((args.table, args.dim), 0.5))
    for rows in (50_000, 149_000, 442_000):
        for span in (1_000_000, 4_000_000, args.table // 2, args.table):
            if 2 * rows <= span:
                gbps, ms = exchange_gbps(cache, host, rows, span)
                print(f"registered: {rows:>7,} rows each way over {span:>11,} rows: {gbps:5.1f} GB/s ({ms:.2f} ms)")
    del host
    half = args.table // 2  # (torch's pinned allocator rounds up to a power of two)
    for name, make in (
        ("cudaHostAlloc", lambda: torch.empty(half, args.dim, pin_memory=True).fill_(0.5)),
        ("madvised huge pages, registered", lambda: page_lock(madvised(half, args.dim))),
    ):
        host = make()
        gbps, ms = exchange_gbps(cache, host, 149_000, half)
        print(f"{name}: 149,000 rows each way over {half:,} rows: {gbps:5.1f} GB/s ({ms:.2f} ms)")
        del host


if __name__ == "__main__":
    main()
