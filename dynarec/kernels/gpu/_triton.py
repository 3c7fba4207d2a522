"""Where the Triton kernels run: whether Triton is importable, and on which devices."""

from __future__ import annotations

import torch

try:
    import triton

    HAVE_TRITON = True
except ImportError:  # no Triton: the C++ extension (CPU) or the plain-torch code runs
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "available", "row_block"]


def available(device: torch.device) -> bool:
    """Whether the Triton kernels run on tensors of ``device``: a CUDA device."""
    return HAVE_TRITON and device.type == "cuda"


def row_block(dim: int) -> int:
    """The width of a program's tile of one row of ``dim`` floats: a power of two (``tl.arange``
    needs one), at least 16."""
    return max(16, triton.next_power_of_2(dim))
