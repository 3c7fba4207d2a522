"""Tensors packed into one buffer: how a batch travels from a DataLoader worker to the
training process, and is page-locked there.

A worker's batch holds a tensor per feature and per field (values, lengths, labels, dense
features: over twenty for a Criteo-shaped config). Sent as they are, each is a shared-memory
file to create, open and map, and then a separate page-locked copy, all in the loader's one
thread; packed, the batch is one file and one copy. Where the loader decodes through a
directory in shared memory (dynarec.data.shared_decode), the packed buffer travels as a file
there (``BatchFile``), read straight into page-locked memory.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import torch

__all__ = ["Slot", "pack", "read_into", "unpack"]

# Byte offsets of packed tensors are multiples of this: every dtype's view of its slice is aligned.
_ALIGN = 64

# A packed tensor: its byte offset in the buffer, dtype and shape.
Slot = tuple[int, torch.dtype, tuple[int, ...]]


def pack(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[Slot]]:
    """``(buffer uint8 [bytes], slots)``: every tensor (CPU, any dtype and shape) copied into one
    contiguous buffer, each at an aligned offset; :func:`unpack` gives them back as views."""
    slots: list[Slot] = []
    end = 0
    for t in tensors:
        slots.append((end, t.dtype, tuple(t.shape)))
        end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    buffer = torch.empty(end, dtype=torch.uint8)
    for t, slot in zip(tensors, slots):
        _view(buffer, slot).copy_(t)
    return buffer, slots


def unpack(buffer: torch.Tensor, slots: Sequence[Slot]) -> list[torch.Tensor]:
    """The tensors of :func:`pack`, as views of ``buffer`` (wherever it now lives: shared or
    page-locked memory)."""
    return [_view(buffer, s) for s in slots]


def _view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    offset, dtype, shape = slot
    numel = 1
    for n in shape:
        numel *= n
    width = torch.empty((), dtype=dtype).element_size()
    return buffer[offset : offset + numel * width].view(dtype).view(shape)


def read_into(file: io.RawIOBase, buffer: torch.Tensor) -> None:
    """Fills ``buffer`` (a contiguous CPU uint8 tensor, page-locked or not) from ``file`` (open
    for unbuffered reading at its start), which must hold exactly its bytes (OSError otherwise).
    The interpreter is free while the bytes are copied."""
    view = buffer.numpy().data
    filled = 0
    while filled < len(view):
        n = file.readinto(view[filled:])
        if not n:
            raise OSError(f"it holds {filled} bytes, {len(view)} expected")
        filled += n
    if file.read(1):
        raise OSError(f"it holds more than the {len(view)} bytes expected")
