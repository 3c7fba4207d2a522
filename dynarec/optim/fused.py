"""The fused sparse update: the one implementation of every optimizer's row update.

Every native row store (fixed and dynamic tables, CPU and CUDA) calls :func:`fused_row_update`
from its backward with the unique touched rows and their aggregated gradients. It is written
with batched tensor ops only, so it runs unchanged on any device.
"""

from __future__ import annotations

import torch

from dynarec.optim.specs import Adagrad, Adam, OptimizerSpec, RowWiseAdagrad, SGD

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
    if isinstance(spec, SGD):
        weight.index_add_(0, rows, grad, alpha=-lr)
        return
    w = weight.index_select(0, rows)
    if isinstance(spec, Adagrad):
        h = states["momentum1"].index_select(0, rows).addcmul_(grad, grad)
        states["momentum1"].index_copy_(0, rows, h)
        w.addcdiv_(grad, h.sqrt_().add_(spec.eps), value=-lr)
    elif isinstance(spec, RowWiseAdagrad):
        wd, mode = spec.weight_decay, spec.weight_decay_mode
        g = grad + wd * w if (mode == "l2" and wd > 0) else grad
        h = states["momentum1"].index_select(0, rows).add_((g * g).mean(dim=1, keepdim=True))
        states["momentum1"].index_copy_(0, rows, h)
        multiplier = lr / (h.sqrt() + spec.eps)
        if mode == "decoupled" and wd > 0:
            w.mul_(1.0 - lr * wd)
        w.sub_(multiplier * g)
    elif isinstance(spec, Adam):
        b1, b2 = spec.beta1, spec.beta2
        m = states["momentum1"].index_select(0, rows).mul_(b1).add_(grad, alpha=1.0 - b1)
        v = states["momentum2"].index_select(0, rows).mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
        states["momentum1"].index_copy_(0, rows, m)
        states["momentum2"].index_copy_(0, rows, v)
        m_hat = m / (1.0 - b1**step)
        v_hat = v / (1.0 - b2**step)
        update = m_hat / (v_hat.sqrt() + spec.eps)
        if spec.weight_decay > 0:
            update.add_(w, alpha=spec.weight_decay)
        w.sub_(update, alpha=lr)
    else:  # pragma: no cover - every spec class is handled above
        raise TypeError(f"no fused update for {type(spec).__name__}")
    weight.index_copy_(0, rows, w)
