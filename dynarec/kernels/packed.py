"""Packed rows: the rows of several tables of different dims end to end in flat tensors, as FBGEMM's
TBE lays out a group of tables (per-table row and element offsets), shared by every twin of the
bag kernels that takes them (plain torch, Triton).

A packed group numbers its rows consecutively over its tables ("group rows": table ``t``'s row
``r`` is group row ``row_starts[t] + r``). Its weights are one flat tensor: table ``t``'s rows
``[rows_t, dims_t]`` start at element ``element_starts[t]``; an element-wise optimizer state is
laid out as the weights, a row-wise one (one float a row) by group row.

The layout travels to the kernels as one int64 tensor ``[3, T + 1]``: row starts, element starts
and dims of the ``T`` tables, each row closed by the totals (group rows, elements, 0). A bag's
rows all belong to one table; its pooled output is ``width`` (the widest dim) floats, zero past
its table's dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["packed_layout", "table_views"]


def packed_layout(shapes: Sequence[tuple[int, int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """The layout ``[3, T + 1]`` int64 of tables ``shapes`` (``(rows, dim)`` each, in order)."""
    row_starts, element_starts, dims = [0], [0], []
    for rows, dim in shapes:
        row_starts.append(row_starts[-1] + rows)
        element_starts.append(element_starts[-1] + rows * dim)
        dims.append(dim)
    return torch.tensor([row_starts, element_starts, [*dims, 0]], dtype=torch.int64, device=device)


def table_views(flat: torch.Tensor, layout: torch.Tensor) -> list[torch.Tensor]:
    """Each table's ``[rows, dim]`` view of a packed weight or element-wise state ``flat``, or its
    ``[rows, 1]`` view of a row-wise state (``flat`` one float a group row)."""
    row_starts, element_starts, dims = layout.tolist()
    by_row = flat.numel() == row_starts[-1] and flat.numel() != element_starts[-1]
    views = []
    for t, dim in enumerate(dims[:-1]):
        rows = row_starts[t + 1] - row_starts[t]
        if by_row:
            views.append(flat[row_starts[t] : row_starts[t + 1]].view(rows, 1))
        else:
            views.append(flat[element_starts[t] : element_starts[t + 1]].view(rows, dim))
    return views
