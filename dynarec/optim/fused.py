"""The fused sparse update: the one entry point of every optimizer's row update.

Every native row store (fixed and dynamic tables, CPU and CUDA) calls :func:`fused_row_update`
from its backward with the unique touched rows and their aggregated gradients. It runs the
optimizer's registered ``native_update`` (batched tensor ops, any device), or its GPU kernel
where one is registered and the rows live on a GPU.
"""

from __future__ import annotations

import torch

from dynarec.optim.base import OptimizerSpec
from dynarec.optim.registry import definition

__all__ = ["fused_row_update"]


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
    defn = definition(spec)
    update = defn.gpu_kernel if (defn.gpu_kernel is not None and weight.is_cuda) else defn.native_update
    update(spec, lr=lr, step=step, weight=weight, states=states, rows=rows, grad=grad)
