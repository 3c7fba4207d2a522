"""Tensors packed into one buffer: how a batch travels from a DataLoader worker to the
training process, and is page-locked there.

A worker's batch holds a tensor per feature and per field (values, lengths, labels, dense
features: over twenty for a Criteo-shaped config). Sent as they are, each is a shared-memory
file to create, open and map, and then a separate page-locked copy, all in the loader's one
thread; packed, the batch is one file and one copy. Where the loader decodes through a
directory in shared memory (dynarec.data.shared_decode), the packed buffer travels as a file
there (``BatchFile``), read straight into page-locked memory.

A batch's ids and lengths travel in the narrowest integer type that holds them (``pack``'s
``stored``): a Criteo-shaped batch's lengths are all 0 or 1 and its ids below 2^31, so 8 of its
int64 bytes an id and a length become 4 and 1 (a batch of 65,536 rows: 31 MB to 12 MB to write,
read, pin and copy to the GPU). A page-locked batch keeps them narrow until its copy to the
device, which widens them there (``unpack``'s ``widen``).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Optional

import torch

__all__ = ["Slot", "narrowest_integer", "pack", "read_into", "unpack"]

# Byte offsets of packed tensors are multiples of this: every dtype's view of its slice is aligned.
_ALIGN = 64

# A packed tensor: its byte offset in the buffer, the dtype it is stored as there, its shape,
# and its own dtype (the stored one, or wider).
Slot = tuple[int, torch.dtype, tuple[int, ...], torch.dtype]

# Integer types a tensor may travel as, narrowest first, with the values each holds.
_NARROW = [(torch.uint8, 0, 255), (torch.int16, -(2**15), 2**15 - 1), (torch.int32, -(2**31), 2**31 - 1)]


def narrowest_integer(low: int, high: int) -> torch.dtype:
    """The narrowest of uint8, int16, int32 and int64 that holds every integer in ``[low, high]``
    (``high < low``: no values, uint8)."""
    if high < low:
        return torch.uint8
    return next((dtype for dtype, lo, hi in _NARROW if lo <= low and high <= hi), torch.int64)


def pack(
    tensors: Sequence[torch.Tensor], stored: Sequence[Optional[torch.dtype]] = ()
) -> tuple[torch.Tensor, list[Slot]]:
    """``(buffer uint8 [bytes], slots)``: every tensor (CPU, any dtype and shape) copied into one
    contiguous buffer, each at an aligned offset; :func:`unpack` gives them back. ``stored[i]``
    (where given and not None): the integer dtype tensor ``i`` (an integer tensor) is stored as,
    which the caller knows holds every one of its values (:func:`narrowest_integer`)."""
    slots: list[Slot] = []
    end = 0
    for i, t in enumerate(tensors):
        as_dtype = (stored[i] if i < len(stored) else None) or t.dtype
        if as_dtype != t.dtype and (t.dtype.is_floating_point or as_dtype.is_floating_point):
            raise ValueError(f"tensor {i} ({t.dtype}) cannot be stored as {as_dtype}: only integers travel narrower")
        slots.append((end, as_dtype, tuple(t.shape), t.dtype))
        end += -(-t.numel() * as_dtype.itemsize // _ALIGN) * _ALIGN
    buffer = torch.empty(end, dtype=torch.uint8)
    for t, slot in zip(tensors, slots):
        _view(buffer, slot).copy_(t)
    return buffer, slots


def unpack(buffer: torch.Tensor, slots: Sequence[Slot], widen: bool = True) -> list[torch.Tensor]:
    """The tensors of :func:`pack`, as views of ``buffer`` (wherever it now lives: shared or
    page-locked memory, a device). One stored narrower than its dtype comes back widened (a
    tensor of its own, where the buffer lives) where ``widen``, else as the view of its narrow
    storage: a page-locked batch on its way to a device is widened there, after its copy."""
    out = [_view(buffer, s) for s in slots]
    if widen:
        out = [t.to(s[3]) for t, s in zip(out, slots)]
    return out


def _view(buffer: torch.Tensor, slot: Slot) -> torch.Tensor:
    offset, dtype, shape, _ = slot
    numel = 1
    for n in shape:
        numel *= n
    return buffer[offset : offset + numel * dtype.itemsize].view(dtype).view(shape)


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
