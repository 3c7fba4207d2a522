"""The device a command runs on, checked before anything is built or written."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = [
    "HostMemoryError",
    "StorageSpan",
    "await_device_start",
    "byte_offset",
    "capture_graph",
    "capturing",
    "check_device",
    "page_lock",
    "start_device",
    "storage_spans",
    "synchronize",
    "table_tensor",
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


def table_tensor(
    shape: Sequence[int], fill: float | int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A table's array (rows, optimizer states, an index's keys) ``shape`` of ``dtype``, every
    element ``fill``. On the CPU its memory is advised to the kernel for transparent huge pages
    before it is first written (``madvise(MADV_HUGEPAGE)``, where the kernel offers them): a
    step reads and writes a table's rows at random, and with 4 KiB pages nearly every row
    costs a page walk (a table of 1M rows of 64 floats spans 64k pages, far past the TLB's
    reach). Advice only: where the kernel has none to give, the pages are small, nothing fails;
    memory the allocator reuses (glibc serves blocks under its mmap threshold, at most 32 MiB,
    from memory freed before) keeps the pages it was written on until the kernel merges them."""
    t = torch.empty(tuple(shape), dtype=dtype, device=device)
    if t.device.type == "cpu":
        _advise_huge_pages(t)
    return t.fill_(fill)


_MADV_HUGEPAGE = 14  # (linux/mman.h)


@functools.cache
def _huge_page_advice() -> Optional[tuple[Any, int]]:
    """libc's ``madvise`` and the transparent huge page's size in bytes, or None where the kernel
    offers no transparent huge pages (not Linux, or THP ``never``)."""
    if sys.platform != "linux":
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            size = int(f.read())
    except (OSError, ValueError):
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise, size


def _advise_huge_pages(t: torch.Tensor) -> None:
    """Advises huge pages for the whole huge pages inside ``t``'s memory (a CPU tensor not yet
    written: pages already touched stay small until the kernel merges them)."""
    advice = _huge_page_advice()
    nbytes = t.numel() * t.element_size()
    if advice is None or nbytes < 2 * (size := advice[1]):
        return
    start = -(-t.data_ptr() // size) * size
    end = (t.data_ptr() + nbytes) // size * size
    advice[0](start, end - start, _MADV_HUGEPAGE)  # (its result ignored: advice)


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
    await_device_start()  # (its kernels must not run inside the capture)
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


# The thread started by :func:`start_device` for each CUDA device index, until it is awaited.
_STARTING: dict[int, threading.Thread] = {}
_STARTING_LOCK = threading.Lock()


def start_device(device: torch.device) -> None:
    """Starts a CUDA ``device`` (nothing elsewhere) in a thread of its own: cuBLAS (the library
    loaded and the handles torch keeps for the threads that run a step's products, the autograd
    engine's among them), and the kernels of the ops a training step runs, each run once on a few
    values (:func:`_first_uses`). torch's CUDA kernels are loaded at their first launch in a
    process, some tens of milliseconds each (on an H100, ``masked_fill`` 57 ms, ``isfinite``
    36 ms, ``softmax`` 16 ms): run this way beside the trainer's set-up, they are not paid by the
    first step. The thread draws no random number and writes no tensor but its own. A capture
    (:func:`capture_graph`) waits for it first: its work must not run inside one. A failure here is
    left for the step to meet and name."""
    if device.type != "cuda":
        return
    # CUDA initialized here, not in the thread: a DataLoader made meanwhile must see it so, and
    # start its workers from the fork server (a fork beside a thread initializing CUDA is unsafe).
    torch.cuda.init()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STARTING_LOCK:
        if index in _STARTING:
            return

        def run() -> None:
            try:
                with torch.cuda.device(index):
                    _first_uses(torch.device("cuda", index))
                    torch.cuda.synchronize(index)
            except Exception:  # the step that needs the kernel meets it and names it
                pass

        # Not a daemon: the interpreter waits for it at exit (a daemon thread stopped inside a
        # torch op at shutdown can abort the process, turning a clean error exit into a crash).
        thread = threading.Thread(target=run, name=f"dynarec-start-cuda-{index}")
        _STARTING[index] = thread
        thread.start()


def await_device_start() -> None:
    """Waits for every :func:`start_device` thread. A thread is forgotten only once it has ended:
    a :func:`start_device` meanwhile starts none."""
    with _STARTING_LOCK:
        threads = dict(_STARTING)
    for thread in threads.values():
        thread.join()
    with _STARTING_LOCK:
        for i, thread in threads.items():
            if _STARTING.get(i) is thread:
                del _STARTING[i]


def _first_uses(device: torch.device) -> None:
    """The ops of a training step whose kernels the first step would load, on a few values of the
    dtypes a step gives them: the tables' (ids sorted, made unique, counted, filled, found by
    position; lengths repeated and summed), the dense model's common ones (products, ReLU,
    masked softmax, sigmoid cross-entropy, and their backward; a fused Adam step) and the loss's
    finiteness check."""
    n = 1 << 16  # ids: past the sizes a sort handles in one block
    ids = torch.arange(n, dtype=torch.int64, device=device) * 7919 % 4099
    lengths = ids[:64] % 8
    torch.sort(ids)
    torch.sort(ids, stable=True)
    torch.argsort(ids, stable=True)
    torch.unique(ids, return_inverse=True, return_counts=True)
    torch.nonzero(ids < 100)
    torch.cumsum(lengths, 0)
    torch.repeat_interleave(lengths)
    torch.zeros(4099, dtype=torch.int64, device=device).index_fill_(0, ids, 1).index_add_(0, ids, ids)
    torch.searchsorted(torch.sort(ids).values, ids[:64])
    x = (torch.arange(64 * 16, dtype=torch.float32, device=device).view(64, 16) / 1024).requires_grad_(True)
    mask = torch.arange(16, device=device)[None, :] < lengths[:, None]
    logits = x.masked_fill(~mask, torch.finfo(x.dtype).min)
    weights = torch.softmax(logits, dim=1) * mask.to(x.dtype)
    hidden = torch.relu(torch.nn.functional.linear(x, x[:16].detach()))
    pooled = torch.bmm(weights[:, None, :], hidden[:, :, None]).squeeze(-1).squeeze(-1)
    scores = torch.cat([pooled, torch.where(mask[:, 0], pooled, 0.0)])
    loss = torch.nn.functional.binary_cross_entropy_with_logits(scores, torch.ones_like(scores))
    loss.backward()
    bool(torch.isfinite(loss).all())
    # The dense optimizers' default, torch's fused Adam, called as its op: ``torch.optim`` would
    # import modules (torch._dynamo) in this thread while the trainer's imports them too.
    param, step = torch.zeros(8, device=device), torch.zeros((), device=device)
    torch._foreach_add_([step], 1)
    torch._fused_adam_(
        [param], [torch.ones_like(param)], [torch.zeros_like(param)], [torch.zeros_like(param)], [], [step],
        lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
    )  # fmt: skip


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
