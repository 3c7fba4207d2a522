"""The device a command runs on, checked before anything is built or written."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import torch

__all__ = ["HostMemoryError", "capturing", "check_device", "page_lock", "synchronize"]

_INSTALL = "see README.md, 'On a GPU', to install torch's CUDA build (make setup DEVICE=cuda)"


def check_device(name: str) -> torch.device:
    """``torch.device(name)``; ValueError saying how to get it where this torch cannot use it
    (a CPU-only build, no visible GPU, a GPU index past the last one)."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name}: not a device ({e}); use cpu, cuda or cuda:N") from None
    if device.type != "cuda":
        return device
    if not torch.backends.cuda.is_built():
        raise ValueError(f"--device {name}: this torch build ({torch.__version__}) has no CUDA support; {_INSTALL}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch {torch.__version__} sees no CUDA device on this machine")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def page_lock(t: torch.Tensor) -> torch.Tensor:
    """Locks the memory of ``t`` (a contiguous CPU tensor) in place for CUDA devices and returns
    it: a GPU then reads and writes it over its link at the address the host uses (unified
    virtual addressing), as a kernel's argument; unlocked when ``t`` is freed. Unlike
    ``pin_memory()`` it neither copies nor rounds the allocation up to a power of two (torch's
    pinned allocator does: 32 GB locked for a 20.5 GB table's rows)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"page_lock takes a contiguous CPU tensor, got {t.device} {tuple(t.shape)}")
    if t.numel():
        cudart = torch.cuda.cudart()
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        code = int(cudart.cudaHostRegister(ptr, nbytes, 0))
        if code != 0:
            raise HostMemoryError(
                f"{nbytes / 1e9:.2f} GB of host memory could not be locked for the GPU (cudaHostRegister: CUDA error "
                f"{code}); the host's free memory or its locked-memory limit is too small for the rows kept there"
            )
        weakref.finalize(t, cudart.cudaHostUnregister, ptr)
    return t


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Around a CUDA graph capture: Python's cyclic garbage collector paused (as it was after).
    A collection inside a capture could free a :func:`page_lock`-ed tensor held in a reference
    cycle; its ``cudaHostUnregister`` is not allowed while this thread captures: it would spoil
    the capture and, failing, leave the freed memory registered, so that locking the next
    tensor given that memory fails (CUDA error 712)."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


class HostMemoryError(RuntimeError):
    """Host memory a GPU should reach could not be locked for it."""


def synchronize(device: torch.device) -> None:
    """Waits for every stream of ``device`` (a CUDA device; nothing elsewhere): before the host
    reads or frees memory that the device's queued kernels may still read or write."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
