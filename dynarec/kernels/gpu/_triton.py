"""Whether Triton is importable, and whether its kernels are compiled or interpreted.

Triton compiles its kernels for CUDA devices. Under Triton's own interpreter switch
(``TRITON_INTERPRET=1`` in the environment when Triton is imported, read by ``triton.jit``) the
kernels are Python functions over numpy arrays instead, and run on CPU tensors: the kernels' test
lane uses that on machines without a GPU (``dynarec.kernels.ops`` then registers them for CPU
tensors too). :data:`INTERPRETED` is what ``triton.jit`` made of the kernels, decided once, when
this module is imported.
"""

from __future__ import annotations

try:
    import triton
    from triton import knobs

    HAVE_TRITON = True
    INTERPRETED = bool(knobs.runtime.interpret)
except ImportError:  # no Triton: the ops run the C++ extension (CPU) or their plain-torch twins
    HAVE_TRITON = False
    INTERPRETED = False

__all__ = ["HAVE_TRITON", "INTERPRETED", "row_block"]


def row_block(dim: int) -> int:
    """The width of a program's tile of one row of ``dim`` floats: a power of two (``tl.arange``
    needs one), at least 16."""
    return max(16, triton.next_power_of_2(dim))
