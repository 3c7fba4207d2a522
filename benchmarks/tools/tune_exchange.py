"""The host tier's row exchange (``dynarec::exchange_rows``) on a GPU: GB/s over the link for
a step's worth of rows (``--rows`` moved out and in, spread over a ``--table``-row host table of
``--dim`` floats a row), for each launch shape, and each direction alone.

    python benchmarks/tools/tune_exchange.py --table 20000000 --rows 442000 --dim 128
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import time

import torch

from dynarec.devices import page_lock
from dynarec.kernels.gpu import rows as gpu_rows


def timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def huge_pages(t: torch.Tensor) -> None:
    """madvise(MADV_HUGEPAGE) over ``t``'s 2 MiB-aligned pages."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    huge = 2 << 20
    start = -(-t.data_ptr() // huge) * huge
    end = (t.data_ptr() + t.numel() * t.element_size()) // huge * huge
    if end > start:
        rc = libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 14)
        print("madvise:", rc, ctypes.get_errno())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--table", type=int, default=20_000_000)
    p.add_argument("--cache", type=int, default=2_000_000)
    p.add_argument("--rows", type=int, default=442_000)
    p.add_argument("--dim", type=int, default=128)
    args = p.parse_args()
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        print("transparent huge pages:", f.read().strip())
    cache = torch.zeros(args.cache, args.dim, device="cuda")
    picked = torch.randperm(args.table, device="cuda")[: 2 * args.rows]
    slots = torch.randperm(args.cache, device="cuda")[: args.rows]
    out_rows, in_rows = picked[: args.rows], picked[args.rows :]
    nbytes = args.rows * args.dim * 4
    print(f"{args.rows:,} rows of {args.dim * 4} B each way ({nbytes / 1e6:.0f} MB)")
    for how in ("zeros", "madvise"):
        start = time.perf_counter()
        if how == "zeros":
            host = torch.zeros(args.table, args.dim)
        elif how == "full":
            host = torch.full((args.table, args.dim), 0.5)
        else:
            host = torch.empty(args.table, args.dim)
            if how == "madvise":
                huge_pages(host)
            host.fill_(0)
        page_lock(host)
        made = time.perf_counter() - start
        both = timed(lambda host=host: gpu_rows.exchange_rows([cache], slots, [host], out_rows, in_rows))
        print(f"host rows {how}: made and locked in {made:.1f} s; both {2 * nbytes / both / 1e9:5.1f} GB/s")
        del host
    host = page_lock(torch.full((args.table, args.dim), 0.5))
    saved = gpu_rows.TUNING
    for tile in (1024, 4096, 16384):
        for warps in (4, 16):
            gpu_rows.TUNING = dataclasses.replace(saved, tile=tile, num_warps=warps)
            both = timed(lambda: gpu_rows.exchange_rows([cache], slots, [host], out_rows, in_rows))
            print(f"tile {tile:>5} warps {warps:>2}: both {2 * nbytes / both / 1e9:5.1f} GB/s ({1e3 * both:.2f} ms)")
    gpu_rows.TUNING = saved
    out_sorted, in_sorted = torch.sort(out_rows)[0], torch.sort(in_rows)[0]
    both = timed(lambda: gpu_rows.exchange_rows([cache], slots, [host], out_sorted, in_sorted))
    print(f"host rows in ascending order: both {2 * nbytes / both / 1e9:5.1f} GB/s ({1e3 * both:.2f} ms)")
    t_in = timed(lambda: gpu_rows.exchange_rows([cache], slots, [host], None, in_rows))
    t_out = timed(lambda: gpu_rows.exchange_rows([cache], slots, [host], out_rows, None))
    print(f"default: in alone {nbytes / t_in / 1e9:.1f} GB/s, out alone {nbytes / t_out / 1e9:.1f} GB/s")
    staged = torch.empty(args.rows, args.dim, pin_memory=True)
    t_h2d = timed(lambda: cache[: args.rows].copy_(staged, non_blocking=True))
    t_d2h = timed(lambda: staged.copy_(cache[: args.rows], non_blocking=True))
    print(f"copy engine, contiguous: in {nbytes / t_h2d / 1e9:.1f} GB/s, out {nbytes / t_d2h / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
