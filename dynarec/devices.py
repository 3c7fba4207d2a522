"""The device a command runs on, checked before anything is built or written."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = [
    "HostMemoryError",
    "StorageSpan",
    "byte_offset",
    "capture_graph",
    "capturing",
    "check_device",
    "page_lock",
    "start_cublas",
    "storage_spans",
    "synchronize",
    "to_device",
]

_INSTALL = "see README.md, 'On a GPU', to install torch's CUDA build (make setup DEVICE=cuda)"


def check_device(name: str, where: Optional[str] = None) -> torch.device:
    """``torch.device(name)``; ValueError saying how to get it where this torch cannot use it
    (a CPU-only build, no visible GPU, a GPU index past the last one), led by ``where`` (default
    the CLI's ``--device {name}``)."""
    where = where or f"--device {name}"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"{where}: not a device ({e}); use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"{where}: dynarec runs on cpu, cuda or cuda:N, not {device.type}")
    if not torch.backends.cuda.is_built():
        raise ValueError(f"{where}: this torch build ({torch.__version__}) has no CUDA support; {_INSTALL}")
    if not torch.cuda.is_available():
        raise ValueError(f"{where}: torch {torch.__version__} sees no CUDA device on this machine")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"{where}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def page_lock(t: torch.Tensor) -> torch.Tensor:
    """Locks the memory of ``t`` (a contiguous CPU tensor) in place for CUDA devices and returns
    it: a GPU then reads and writes it over its link at the address the host uses (unified
    virtual addressing), as a kernel's argument; unlocked when ``t`` is freed — this tensor
    object, whatever views of it live on: hold it as long as the device may reach the memory. Unlike
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


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


@contextlib.contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph, pool: Any = None) -> Iterator[None]:
    """Captures into ``graph`` what the block launches on the current device, with
    :func:`capturing`'s pause of the garbage collector; ``pool``: a
    ``torch.cuda.graph_pool_handle()`` whose memory the graph's temporaries share (default:
    its own). The capture runs on one side stream per device, as ``torch.cuda.graph``'s: a
    backward captured after its forward runs on the forward's stream. The side stream waits
    for the current one, which waits for the capture after the block (it runs nothing). A
    failed block leaves the stream it found current.

    Unlike ``torch.cuda.graph`` it neither synchronizes the device nor empties torch's cache of
    device memory: a training step's first captures gave back the blocks that the steps after
    them allocate again."""
    index = torch.cuda.current_device()
    side = _CAPTURE_STREAMS.get(index)
    if side is None:
        side = _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
    main = torch.cuda.current_stream(index)
    side.wait_stream(main)
    with torch.cuda.stream(side), capturing():
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()
    main.wait_stream(side)


def start_cublas(device: torch.device) -> Optional[threading.Thread]:
    """Starts cuBLAS on ``device`` (a CUDA device; None elsewhere) in a thread of its own, which
    it returns, started: a small matrix product and its backward, which load the library and make
    the handles torch keeps for the threads that run a step's products (the autograd engine's
    among them). Started before the first batch is awaited, it overlaps the wait: on an H100,
    dlrm_criteo's first step went from 259.8 to 200.5 ms. Join the thread before a CUDA graph is
    captured: its work must not run inside a capture. A failure here is left for the step to
    meet and name."""
    if device.type != "cuda":
        return None

    def run() -> None:
        try:
            with torch.cuda.device(device):
                a = torch.ones(16, 16, device=device, requires_grad=True)
                torch.nn.functional.linear(a, a).sum().backward()
                torch.cuda.synchronize(device)
        except Exception:  # the step that needs cuBLAS meets it and names it
            pass

    thread = threading.Thread(target=run, name="dynarec-start-cublas", daemon=True)
    thread.start()
    return thread


class HostMemoryError(RuntimeError):
    """Host memory a GPU should reach could not be locked for it."""


def synchronize(device: torch.device) -> None:
    """Waits for every stream of ``device`` (a CUDA device; nothing elsewhere): before the host
    reads or frees memory that the device's queued kernels may still read or write."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_ALIGN = 16  # bytes: a span starts at a multiple of every dtype's size


@dataclass(frozen=True)
class StorageSpan:
    """Tensors of one storage, seen as the bytes ``[start, end)`` of it that they lie in:
    ``members`` (their positions in the list they came from) at ``offsets`` (bytes from
    ``start``), so that one copy of those bytes moves them all."""

    members: tuple[int, ...]
    start: int
    end: int
    offsets: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def source(self, storage: torch.UntypedStorage, start: Optional[int] = None) -> torch.Tensor:
        """The span's bytes of ``storage`` (from ``start``, default its own) as a uint8 tensor."""
        first = self.start if start is None else start
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, first, (self.nbytes,), (1,))

    def views(self, buffer: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The members as views of ``buffer`` (the span's bytes, a contiguous uint8 tensor): each
        with the dtype, shape and strides of its tensor of ``like`` (indexed as ``members``)."""
        storage, base = buffer.untyped_storage(), buffer.storage_offset()
        out = []
        for i, offset in zip(self.members, self.offsets):
            t = like[i]
            view = torch.empty(0, dtype=t.dtype, device=buffer.device)
            out.append(view.set_(storage, (base + offset) // t.element_size(), t.shape, t.stride()))
        return out


def storage_spans(tensors: Sequence[torch.Tensor], with_grad: bool = False) -> list[StorageSpan]:
    """Runs of ``tensors`` that lie near each other in one storage, two or more a run (empty
    tensors left out, and tensors needing a gradient unless ``with_grad``): in storage order, a
    run takes the next tensor while the gap before it is no larger than the bytes the run holds,
    so a run's span is at most twice its tensors' bytes. What a batch packed into one buffer, or
    the features' pooled outputs of one lookup, can move as one copy."""
    by_storage: dict[tuple[int, torch.device], list[tuple[int, int, int]]] = {}
    for i, t in enumerate(tensors):
        if t.numel() and (with_grad or not t.requires_grad):
            start = byte_offset(t)
            key = (t.untyped_storage().data_ptr(), t.device)
            by_storage.setdefault(key, []).append((start, start + _extent(t), i))
    spans = []
    for placed in by_storage.values():
        placed.sort()
        run: list[tuple[int, int, int]] = []
        run_end = run_bytes = 0
        for start, end, i in [*placed, (-1, -1, -1)]:  # a sentinel ends the last run
            if run and start >= 0 and start - run_end <= run_bytes:
                run.append((start, end, i))
                run_end, run_bytes = max(run_end, end), run_bytes + end - start
                continue
            if len(run) > 1:
                first = run[0][0] // _ALIGN * _ALIGN
                members = tuple(i for _, _, i in run)
                spans.append(StorageSpan(members, first, run_end, tuple(s - first for s, _, _ in run)))
            run, run_end, run_bytes = [(start, end, i)], end, end - start
    return spans


def byte_offset(t: torch.Tensor) -> int:
    """Where ``t`` starts in its storage, in bytes."""
    return int(t.storage_offset()) * t.element_size()


def _extent(t: torch.Tensor) -> int:
    """The bytes from a non-empty tensor's first element to the end of its last."""
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def to_device(tensors: Sequence[torch.Tensor], device: torch.device, non_blocking: bool = True) -> list[torch.Tensor]:
    """``[t.to(device) for t in tensors]``, in one copy for tensors that share a storage
    (:func:`storage_spans`: a batch a DataLoader worker packed into one page-locked buffer): the
    bytes they span copied at once, each tensor then a view of the copy where it lay."""
    out = list(tensors)
    moving = [i for i, t in enumerate(tensors) if t.device != device]
    like = [tensors[i] for i in moving]
    for span in storage_spans(like):
        copy = span.source(like[span.members[0]].untyped_storage()).to(device, non_blocking=non_blocking)
        for member, view in zip(span.members, span.views(copy, like)):
            out[moving[member]] = view
    for i in moving:
        if out[i] is tensors[i]:
            out[i] = tensors[i].to(device, non_blocking=non_blocking)
    return out
