"""The fused sparse update: the one entry point of every optimizer's update in backward.

Every native row store (fixed and dynamic tables, CPU and CUDA) calls :func:`fused_bag_update`
from its backward with the step's weighted bags and their output gradients. Where the optimizer
fills the registry's kernel slot (``OptimizerDef.kernel``) and the device has its kernels
(``dynarec.kernels``: Triton on GPUs, the C++ extension on CPUs), one kernel aggregates each
unique row's gradient and updates it; otherwise the gradients are aggregated per unique row with
torch ops and :func:`fused_row_update` runs the optimizer's ``native_update`` (batched tensor
ops, any device), which is also the reference the kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from dynarec.optim.base import OptimizerSpec
from dynarec.optim.registry import definition

__all__ = ["GradReducer", "RowScores", "bag_gradients", "fused_bag_update", "fused_row_update"]

GradReducer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class RowScores:
    """A side write of the fused update: ``scores[row] = value`` for every row it updates, once
    per unique row (a dynamic table's eviction score of the rows a step touched: ``step`` or
    ``timestamp``). ``scores``: ``[num_rows]`` int64 on the rows' device. ``live`` False: the
    write was withdrawn (the table wrote the scores itself before the backward ran)."""

    scores: torch.Tensor
    value: int
    live: bool = True


@torch.no_grad()
def fused_row_update(
    spec: OptimizerSpec,
    *,
    lr: float,
    step: int,
    weight: torch.Tensor,
    states: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
) -> None:
    """Applies ``spec`` in place to ``weight[rows]`` and ``states[name][rows]``.

    Args:
        lr: the table's current learning rate.
        step: the table's step counter ``t`` (>= 1), used by Adam's bias correction.
        weight: ``[num_rows, D]`` float32.
        states: ``{name: [num_rows, D or 1]}`` float32, as ``spec.state_specs()`` lays out.
        rows: ``[U]`` int64, unique row indices.
        grad: ``[U, D]`` float32, the aggregated gradient of each row for this step.
    """
    if rows.numel() == 0:
        return
    definition(spec).native_update(spec, lr=lr, step=step, weight=weight, states=states, rows=rows, grad=grad)


def bag_gradients(
    grad_out: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor], num_ids: int
) -> torch.Tensor:
    """Per-id gradient ``[n, D]`` of weighted-sum bags: ``psw[i] * grad_out[bag(i)]``."""
    lengths = offsets[1:] - offsets[:-1]
    bag_of_id = torch.repeat_interleave(
        torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=num_ids
    )
    g = grad_out.index_select(0, bag_of_id)
    if per_sample_weights is not None:
        g.mul_(per_sample_weights[:, None])
    return g


@torch.no_grad()
def fused_bag_update(
    spec: OptimizerSpec,
    *,
    lr: float,
    step: int,
    weight: torch.Tensor,
    states: dict[str, torch.Tensor],
    rows: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: Optional[torch.Tensor],
    grad_out: torch.Tensor,
    reducer: Optional[GradReducer] = None,
    row_scores: Optional[RowScores] = None,
) -> None:
    """The update of one step of weighted-sum bags (``rows`` ``[n]``, CSR ``offsets``,
    ``per_sample_weights`` ``[n]`` or None) given their output gradient ``grad_out``
    ``[num_bags, D]``: each unique row once, with the sum of its occurrences' gradients.
    ``reducer`` (data-parallel tables) sums the aggregated gradients over ranks first;
    ``row_scores``: also sets the score of each row of ``rows`` (unless withdrawn)."""
    if row_scores is not None and not row_scores.live:
        row_scores = None
    if rows.numel() == 0 and reducer is None:
        return
    kernel = definition(spec).kernel
    if kernel is not None and reducer is None:
        from dynarec.kernels import bag_update_kernel  # the device kernels (imports torch only)

        run = bag_update_kernel(weight.device)
        if run is not None:
            run(
                kernel(spec, step),
                lr=lr,
                weight=weight,
                states=states,
                rows=rows,
                offsets=offsets,
                per_sample_weights=per_sample_weights,
                grad_out=grad_out,
                row_scores=row_scores,
            )
            return
    g = bag_gradients(grad_out.contiguous(), offsets, per_sample_weights, rows.numel())
    unique_rows, inverse = torch.unique(rows, return_inverse=True)
    if row_scores is not None:
        row_scores.scores.index_fill_(0, unique_rows, row_scores.value)
    agg = g.new_zeros(unique_rows.numel(), g.shape[1]).index_add_(0, inverse, g)
    if reducer is not None:
        unique_rows, agg = reducer(unique_rows, agg)
    fused_row_update(spec, lr=lr, step=step, weight=weight, states=states, rows=unique_rows, grad=agg)
