"""Where a group row lies in packed rows (:mod:`dynarec.kernels.packed`), in Triton: its table,
and the table's row start, element start and dim."""

from __future__ import annotations

from dynarec.kernels.gpu._triton import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = ["table_of", "table_place"]

if HAVE_TRITON:

    @triton.jit
    def table_of(row, layout_ptr, T):
        """The table of each group row of ``row`` (int64, any shape): the number of tables after
        the first whose rows start at or before it (``T`` tables: a group has few)."""
        t = row * 0
        k = 1
        while k < T:  # a while loop: Triton's interpreter runs it too
            t += (row >= tl.load(layout_ptr + k)).to(tl.int64)
            k += 1
        return t

    @triton.jit
    def table_place(t, layout_ptr, T):
        """``(row start, element start, dim)`` of tables ``t`` (int64, any shape)."""
        return tl.load(layout_ptr + t), tl.load(layout_ptr + (T + 1) + t), tl.load(layout_ptr + 2 * (T + 1) + t)
