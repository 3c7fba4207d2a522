"""Where the Triton kernels run: whether Triton is importable, and on which devices.

Triton compiles its kernels for CUDA devices. Under Triton's own interpreter switch
(``TRITON_INTERPRET=1`` in the environment when Triton is imported, read by ``triton.jit``) the
kernels are Python functions over numpy arrays instead, and run on CPU tensors: the kernels' test
lane uses that on machines without a GPU. :data:`INTERPRETED` is what ``triton.jit`` made of the
kernels, decided once, when this module is imported.
"""

from __future__ import annotations

import torch

try:
    import triton
    from triton import knobs

    HAVE_TRITON = True
    INTERPRETED = bool(knobs.runtime.interpret)
except ImportError:  # no Triton: the C++ extension (CPU) or the plain-torch code runs
    HAVE_TRITON = False
    INTERPRETED = False

__all__ = ["HAVE_TRITON", "INTERPRETED", "available", "row_block"]


def available(device: torch.device) -> bool:
    """Whether the Triton kernels run on tensors of ``device``: a CUDA device, or the CPU under
    Triton's interpreter."""
    return HAVE_TRITON and (device.type == "cuda" or (INTERPRETED and device.type == "cpu"))


def row_block(dim: int) -> int:
    """The width of a program's tile of one row of ``dim`` floats: a power of two (``tl.arange``
    needs one), at least 16."""
    return max(16, triton.next_power_of_2(dim))
