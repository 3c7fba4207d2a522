"""The CUDA ordering utilities: the input stage of a collection on a side stream, the current
stream without a new object a call, and a small tensor read on the host without a blocking copy.

A training step's lookup needs its ids on the device, packed into bags, and, for a dynamic
table, the hash find's answer read on the host (whether any key is new decides whether to
insert). On the main stream all three would queue behind the previous step's backward, and the
host read would wait for it: the GPU would then idle while the host launches the next step. On
the input stream the copy (pinned host memory -> device, on the copy engine), the packing and the
finds run beside the previous step's backward, and the host waits only for them.

Ordering, the whole contract:

- the input stream waits for nothing of the main stream when the batch comes from the host;
  a batch already on the device was made by some stream, so the input stream waits for it:
  for the event its maker recorded after making it, where the caller gives one, else for all
  the work queued so far on the main stream (which includes this step's backward: the checks
  and finds then run after it, not beside it); the batch's checks run on the input stream too,
  and it records its use of the batch's tensors (``record_stream``), which its maker may free;
- a hash index records an event after every write of its keys (``BucketedHashIndex``), and a
  find waits for it on whatever stream it runs: it never reads keys an insert is still writing;
  and it records an event after every find, on its stream, for which every later write of its
  keys waits: an insert never changes keys a find queued before it (a batch prefetched two
  steps ahead) is still reading;
- the main stream waits for the input stream's event before the lookup, and every tensor the
  input stage hands over is recorded on the main stream (``record_stream``), so the caching
  allocator does not give its memory to the input stream's next allocation while the main
  stream reads it.

A stage may run a step ahead (``EmbeddingCollection.prefetch``): the next batch's copy and finds
then run beside this step's backward, and the next forward reads their answer without waiting.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch

__all__ = ["HostReadback", "StagedInput", "batch_stream", "current_stream", "input_stage", "rows_stream"]

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # one per device and process
_ROWS_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_BATCH_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_CURRENT: dict[tuple[int, int], torch.cuda.Stream] = {}  # current_stream's wrappers, by device and stream id


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` for the per-call paths (finds, inserts, a step's
    input stage). That builds a new ``Stream`` object each call, host time the GPU may wait
    for; here the current stream's id is asked for (``torch._C._cuda_getCurrentStream``, what it
    calls once CUDA is initialized: the callers hold CUDA tensors) and the wrapper of each
    (device, stream id) is made once. A wrapper is only the id and the device: two wrappers of
    one id are the same stream. (Streams made and dropped by the thousand would each keep one
    small entry here.)"""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream_id, device_index, device_type = torch._C._cuda_getCurrentStream(index)
    stream = _CURRENT.get((device_index, stream_id))
    if stream is None:
        stream = torch.cuda.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type)
        _CURRENT[(device_index, stream_id)] = stream
    return stream


def _stream(
    streams: dict[torch.device, torch.cuda.Stream], device: torch.device, priority: int = 0
) -> torch.cuda.Stream:
    """``streams``' stream of ``device`` (a CUDA device; no index: the current one), made once."""
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if device not in streams:
        streams[device] = torch.cuda.Stream(device, priority=priority)
    return streams[device]


def _input_stream(device: torch.device) -> torch.cuda.Stream:
    return _stream(_STREAMS, device, priority=-1)  # high priority: its small kernels go ahead of the backward's blocks


def rows_stream(device: torch.device) -> torch.cuda.Stream:
    """``device``'s stream for rows moving between host memory and a device cache ahead of their
    lookup (one per device and process): the moves queue there one after another, while the
    input stream's next finds and the main stream's steps go on beside them."""
    return _stream(_ROWS_STREAMS, device)


def batch_stream(device: torch.device) -> torch.cuda.Stream:
    """``device``'s stream for whole batches copied to it to be kept there (a cached epoch's:
    ``dynarec.data.batch_cache``), one per device and process: their copies run on the copy
    engine beside the steps, and each batch carries the event its readers wait for."""
    return _stream(_BATCH_STREAMS, device)


class StagedInput:
    """What an input stage made: the tensors it hands over, and (CUDA) the event after its work.
    :meth:`take` before using them, on the stream that uses them."""

    def __init__(self, device: torch.device, stream: Optional[torch.cuda.Stream] = None):
        self.device = device
        self.stream = stream  # the input stream (CUDA), None where the stage runs in place
        self.ready: Optional[torch.cuda.Event] = None
        self._tensors: list[torch.Tensor] = []

    def reads(self, *tensors: Optional[torch.Tensor]) -> None:
        """Marks ``tensors``, made outside the stage (a batch already on the GPU, maybe by another
        stream), as used by the input stream (``record_stream``): their memory is not reused
        before the stage's work on them is done, whoever frees them. None and host tensors are
        skipped."""
        if self.stream is not None:
            for t in tensors:
                if t is not None and t.is_cuda:
                    t.record_stream(self.stream)

    def hand_over(self, *tensors: Optional[torch.Tensor]) -> None:
        """Adds ``tensors`` (made in the stage) to those :meth:`take` gives; None is skipped."""
        self._tensors += [t for t in tensors if t is not None and t.is_cuda]

    def take(self) -> None:
        """Makes the current stream wait for the stage's work and marks the handed-over tensors
        as used by it (``record_stream``: their memory is not reused before it is done)."""
        if self.ready is None:
            return
        stream = current_stream(self.device)
        stream.wait_event(self.ready)
        for t in self._tensors:
            t.record_stream(stream)


@contextmanager
def input_stage(
    device: torch.device, batch_on_host: bool, ready: Optional[torch.cuda.Event] = None
) -> Iterator[StagedInput]:
    """Runs the block on ``device``'s input stream (CUDA; elsewhere in place); the consumer then
    calls :meth:`StagedInput.take`, possibly a step later. ``batch_on_host``: the block reads no
    tensor the current stream is still making; else the input stream first waits for ``ready``
    (an event recorded after the batch was made), or without it for all the current stream's
    work queued so far."""
    if device.type != "cuda":
        yield StagedInput(device)
        return
    side = _input_stream(device)
    staged = StagedInput(device, side)
    if not batch_on_host:
        if ready is not None:
            side.wait_event(ready)
        else:
            side.wait_stream(current_stream(device))
    with torch.cuda.stream(side):
        yield staged
        staged.ready = torch.cuda.Event()
        staged.ready.record(side)


class HostReadback:
    """A small device tensor read on the host without a blocking copy: :meth:`queue` copies it
    into pinned memory behind the work queued so far and records an event; :meth:`read` waits
    for that event only. Work queued between the two runs while the host waits (or, read a step
    later, is not waited for at all). On a CPU device, the values themselves."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        cuda = device.type == "cuda"
        self._pinned = torch.empty(shape, dtype=dtype, pin_memory=True) if cuda else None
        self._done = torch.cuda.Event() if cuda else None
        self._values: Optional[torch.Tensor] = None

    def queue(self, values: torch.Tensor, stream: Optional[torch.cuda.Stream]) -> None:
        """Queues the copy of ``values`` (this shape and dtype, on this device) on the current
        stream, which ``stream`` must be (the caller has asked for it already: the event is
        recorded on it)."""
        if self._pinned is None or self._done is None:
            self._values = values
            return
        self._pinned.copy_(values, non_blocking=True)
        self._done.record(stream)
        self._values = self._pinned

    def read(self) -> torch.Tensor:
        """The values last queued, on the host (waits for their copy)."""
        if self._done is not None:
            self._done.synchronize()
        assert self._values is not None, "read() before queue()"
        return self._values
