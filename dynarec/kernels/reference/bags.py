"""Weighted-sum bags in plain torch: the pooled lookup, and the fused backward + optimizer update.

Bags are CSR: ``rows`` ``[n]`` int64 row indices, ``offsets`` ``[num_bags + 1]`` int64, optional
``per_sample_weights`` ``[n]`` float32; bag ``b`` is ``sum_{i in b} psw[i] * weight[rows[i]]``.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.nn.functional as F

from dynarec.kernels.packed import table_views
from dynarec.optim.kernel import KernelArgs, KernelCode, WeightDecayCode, update_rows

__all__ = ["aggregate", "bag_gradients", "bag_update", "bags_of_ids", "pooled"]


def pooled(
    weight: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    layout: Optional[torch.Tensor] = None,
    width: int = 0,
) -> torch.Tensor:
    """``out[b] = sum_{i in bag b} psw[i] * weight[rows[i]]``: ``[num_bags, D]`` float32. With a
    ``layout`` (:mod:`dynarec.kernels.packed`), ``weight`` is packed rows, ``rows`` group rows,
    and the output ``[num_bags, width]``, zero past each bag's table's dim."""
    if layout is None:
        return F.embedding_bag(
            rows, weight, offsets, mode="sum", per_sample_weights=per_sample_weights, include_last_offset=True
        )
    out = torch.zeros(offsets.numel() - 1, width, dtype=torch.float32, device=weight.device)
    bag_of_id = bags_of_ids(offsets, rows.numel())
    for (start, end), table in zip(_row_ranges(layout), table_views(weight, layout)):
        mine = (rows >= start) & (rows < end)
        v = table.index_select(0, rows[mine] - start)
        if per_sample_weights is not None:
            v = v * per_sample_weights[mine][:, None]
        out[:, : table.shape[1]].index_add_(0, bag_of_id[mine], v)
    return out


def bags_of_ids(offsets: torch.Tensor, num_ids: int) -> torch.Tensor:
    """``[num_ids]`` int64: the bag of each id of CSR ``offsets``."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=num_ids)


def _row_ranges(layout: torch.Tensor) -> list[tuple[int, int]]:
    """Each table's group rows ``[start, end)``."""
    starts = layout[0].tolist()
    return list(itertools.pairwise(starts))


def bag_gradients(
    grad_out: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor], num_ids: int
) -> torch.Tensor:
    """Per-id gradient ``[n, D]`` of weighted-sum bags: ``psw[i] * grad_out[bag(i)]``."""
    g = grad_out.index_select(0, bags_of_ids(offsets, num_ids))
    if per_sample_weights is not None:
        g.mul_(per_sample_weights[:, None])
    return g


def aggregate(
    grad_out: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique rows [U] int64 ascending, their gradients [U, D])``: each row's gradient summed
    over its occurrences in the bags (``grad_out``: ``[num_bags, D]``)."""
    g = bag_gradients(grad_out.contiguous(), offsets, per_sample_weights, rows.numel())
    unique_rows, inverse = torch.unique(rows, return_inverse=True)
    return unique_rows, g.new_zeros(unique_rows.numel(), g.shape[1]).index_add_(0, inverse, g)


@torch.no_grad()
def bag_update(
    weight: torch.Tensor,
    momentum1: Optional[torch.Tensor],
    momentum2: Optional[torch.Tensor],
    grad_out: torch.Tensor,
    rows: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    scores: Optional[torch.Tensor],
    score: int,
    code: int,
    weight_decay_mode: int,
    lr: float,
    eps: float,
    weight_decay: float,
    beta1: float,
    beta2: float,
    bias1: float,
    bias2: float,
    row_keys: Optional[torch.Tensor] = None,
    key_offset: int = 0,
    rounding_base: int = 0,
    layout: Optional[torch.Tensor] = None,
    hyper: Optional[torch.Tensor] = None,
) -> None:
    """The fused backward + update of one step of bags: each unique row of ``rows`` once, with
    the sum of its occurrences' gradients (``grad_out`` ``[num_bags, D]``), by the optimizer of
    ``code`` (``dynarec.optim.kernel``; its scalars as ``KernelArgs`` has them), in place on
    ``weight`` ``[num_rows, D]`` and the optimizer's states (``[num_rows, D or 1]`` float32, None
    where it has none). ``scores`` (``[num_rows]`` int64): ``scores[row] = score`` for each row
    updated. Float32 rows only (``row_keys``, ``key_offset``, ``rounding_base``: the C++ and
    Triton kernels' half-precision rounding, not taken here; ``fused_bag_update`` rounds half
    rows in torch ops where neither kernel runs). With a ``layout``
    (:mod:`dynarec.kernels.packed`), ``weight`` and the states are packed rows, ``rows`` group
    rows and ``grad_out`` ``[num_bags, width]``; each table's rows are updated as its own.
    ``hyper`` (the scalars of a step captured in a CUDA graph, read on the device) is the Triton
    kernels' only: refused here."""
    if hyper is not None:
        raise ValueError("the reference dynarec::bag_update takes its scalars as float arguments, not hyper")
    if weight.dtype != torch.float32:
        raise ValueError(f"the reference dynarec::bag_update updates float32 rows, not {weight.dtype}")
    if rows.numel() == 0:
        return
    unique_rows, grad = aggregate(grad_out, rows, offsets, per_sample_weights)
    if scores is not None:
        scores.index_fill_(0, unique_rows, score)
    states = {name: t for name, t in (("momentum1", momentum1), ("momentum2", momentum2)) if t is not None}
    args = KernelArgs(
        KernelCode(code), eps, weight_decay, WeightDecayCode(weight_decay_mode), beta1, beta2, bias1, bias2
    )
    if layout is None:
        update_rows(args, lr=lr, weight=weight, states=states, rows=unique_rows, grad=grad)
        return
    tables = {name: table_views(t, layout) for name, t in (("weight", weight), *states.items())}
    for t, (start, end) in enumerate(_row_ranges(layout)):
        mine = (unique_rows >= start) & (unique_rows < end)
        w = tables["weight"][t]
        update_rows(
            args, lr=lr, weight=w, states={name: tables[name][t] for name in states},
            rows=unique_rows[mine] - start, grad=grad[mine, : w.shape[1]].contiguous(),
        )  # fmt: skip
