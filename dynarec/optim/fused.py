"""The fused sparse update: the one entry point of every optimizer's update in backward.

Every native row store (fixed and dynamic tables, CPU and CUDA) calls :func:`fused_bag_update`
from its backward with the step's weighted bags and their output gradients. Where the optimizer
has kernel arguments (``OptimizerDef.kernel``), the ``dynarec::bag_update`` op aggregates each
unique row's gradient and updates it in one pass (C++ on CPUs, Triton on GPUs, plain torch
elsewhere); otherwise, and for a data-parallel table whose row gradients are reduced over ranks
first, the gradients are aggregated per unique row with torch ops and :func:`fused_row_update`
runs the optimizer's ``native_update`` (batched tensor ops, any device). Half-precision rows
are rounded in the kernels (Triton on CUDA, C++ on CPUs); the torch path
(:func:`torch_bag_update`) updates float32 copies of the touched rows and stores them back by the
same seeded stochastic rounding (:mod:`dynarec.optim.rounding`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

import dynarec.kernels.ops  # registers torch.ops.dynarec (a module: it imports dynarec.optim itself)
from dynarec.kernels.reference import aggregate, bag_gradients
from dynarec.optim.base import OptimizerSpec
from dynarec.optim.registry import definition
from dynarec.optim.rounding import RowKeys, rounding_base, rounding_noise, stochastic_round

__all__ = ["GradReducer", "RowScores", "bag_gradients", "fused_bag_update", "fused_row_update", "kernel_hyper"]

GradReducer = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class RowScores:
    """A side write of the fused update: ``scores[row] = value`` for every row it updates, once
    per unique row (a dynamic table's eviction score of the rows a step touched: ``step`` or
    ``timestamp``). ``scores``: ``[num_rows]`` int64 on the rows' device. Handed out by the array's
    owner (``BucketedHashIndex.scores_writer``), which sets ``live`` False to withdraw the write
    (its step was undone, or the index wrote the scores itself first)."""

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


def kernel_hyper(
    spec: OptimizerSpec, *, lr: float, step: int, half: bool, key_offset: int = 0, rounding_seed: int = 0
) -> list[float]:
    """The scalars :func:`fused_bag_update`'s kernels read for step ``step`` at rate ``lr``
    (``dynarec.kernels.gpu.update.HYPER``'s order; ``half``: rows stored in half precision,
    their rounding draws keyed by ``rounding_seed``, the step and ``key_offset`` plus the row; no
    row scores): what a step captured in a CUDA graph writes into its update's ``hyper`` buffer
    before each replay (``dynarec.train.step_graph``). ValueError for an optimizer the kernels
    do not run."""
    from dynarec.kernels.gpu.update import hyper_values  # (no Triton needed: plain arithmetic)

    kernel = definition(spec).kernel
    if kernel is None:
        raise ValueError(f"{spec!r} is not run by the bag_update kernels: it has no kernel scalars")
    base = rounding_base(rounding_seed, step) if half else 0
    return hyper_values(kernel(spec, step), lr, 0, key_offset, base)


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
    rounding_seed: int = 0,
    row_keys: RowKeys = RowKeys(),
    layout: Optional[torch.Tensor] = None,
    hyper: Optional[torch.Tensor] = None,
) -> None:
    """The update of one step of weighted-sum bags (``rows`` ``[n]``, CSR ``offsets``,
    ``per_sample_weights`` ``[n]`` or None) given their output gradient ``grad_out``
    ``[num_bags, D]``: each unique row once, with the sum of its occurrences' gradients.
    ``reducer`` (data-parallel tables) sums the aggregated gradients over ranks first;
    ``row_scores``: also sets the score of each row of ``rows`` (unless withdrawn). With
    ``spec.gradient_clipping``, ``grad_out`` is clamped elementwise to ``max_gradient`` first.
    ``weight`` float16 / bfloat16: the rows are stored back by stochastic rounding, its draws
    keyed by ``rounding_seed``, ``step`` and each row's key (``row_keys``; default the row
    index): by the Triton kernels on CUDA and the C++ kernel on the CPU (torch ops where there
    is neither, and for data-parallel tables). ``layout``: ``weight`` and the states are packed
    rows of several fixed float32 tables (:mod:`dynarec.kernels.packed`; the op's kernels only:
    no reducer, an optimizer with kernel arguments). ``hyper``: the step's scalars on the device,
    :func:`kernel_hyper`'s, which the kernels read in place of ``lr`` and ``step`` (an update
    captured in a CUDA graph with its step; the op's Triton kernels only)."""
    if row_scores is not None and not row_scores.live:
        row_scores = None
    if rows.numel() == 0 and reducer is None:
        return
    if spec.gradient_clipping:
        grad_out = grad_out.clamp(-spec.max_gradient, spec.max_gradient)
    kernel = definition(spec).kernel
    half = weight.dtype != torch.float32
    if layout is not None and (kernel is None or reducer is not None or half):
        raise ValueError(f"packed rows are updated by the bag_update kernels only; {spec!r} with them is not")
    if kernel is not None and reducer is None and (not half or dynarec.kernels.ops.takes_half_rows(weight.device)):
        a = kernel(spec, step)
        scores, value = (None, 0) if row_scores is None else (row_scores.scores, int(row_scores.value))
        keys = row_keys.keys() if half and row_keys.keys is not None else None
        base = rounding_base(rounding_seed, step) if half else 0
        torch.ops.dynarec.bag_update(
            weight, states.get("momentum1"), states.get("momentum2"), grad_out, rows, offsets, per_sample_weights,
            scores, value, int(a.code), int(a.weight_decay_mode), float(lr), a.eps, a.weight_decay, a.beta1, a.beta2,
            a.bias1, a.bias2, keys, row_keys.offset, base, layout, hyper,
        )  # fmt: skip
        return
    if hyper is not None:
        raise ValueError(f"{spec!r} on these rows is not updated by the bag_update kernels, which alone read hyper")
    torch_bag_update(
        spec, lr, step, weight, states, rows, offsets, per_sample_weights, grad_out, reducer, row_scores, rounding_seed,
        row_keys,
    )  # fmt: skip


@torch.no_grad()
def torch_bag_update(
    spec: OptimizerSpec,
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
    rounding_seed: int = 0,
    row_keys: RowKeys = RowKeys(),
) -> None:
    """:func:`fused_bag_update` in torch ops (its gradient already clamped): the kernels'
    reference, and the path of optimizers without kernels and of data-parallel tables."""
    unique_rows, agg = aggregate(grad_out, rows, offsets, per_sample_weights)
    if row_scores is not None:
        row_scores.scores.index_fill_(0, unique_rows, row_scores.value)
    if reducer is not None:
        unique_rows, agg = reducer(unique_rows, agg)
    if weight.dtype == torch.float32:
        fused_row_update(spec, lr=lr, step=step, weight=weight, states=states, rows=unique_rows, grad=agg)
    else:
        _rounded_row_update(spec, lr, step, weight, states, unique_rows, agg, rounding_seed, row_keys.of(unique_rows))


@torch.no_grad()
def _rounded_row_update(spec, lr, step, weight, states, rows, grad, rounding_seed, keys) -> None:
    """:func:`fused_row_update` of half-precision rows: on float32 copies of ``rows`` (and of
    their states), then stored back, the weights by stochastic rounding drawn by ``keys``."""
    if rows.numel() == 0:
        return
    compact = torch.arange(rows.numel(), device=rows.device)
    w = weight.index_select(0, rows).float()
    s = {name: t.index_select(0, rows) for name, t in states.items()}
    fused_row_update(spec, lr=lr, step=step, weight=w, states=s, rows=compact, grad=grad)
    for name, t in states.items():
        t.index_copy_(0, rows, s[name])
    noise = rounding_noise(rounding_seed, step, keys, weight.shape[1])
    weight.index_copy_(0, rows, stochastic_round(w, weight.dtype, noise))
