"""Plain, unfused reference of the optimizer contract.

Written for reading, not speed: one row at a time, straight from the formulas in
``docs/optimizers.md`` (FBGEMM's GPU meaning). Tests compare every backend against it; it shares
no code with :mod:`dynarec.optim.fused`.
"""

from __future__ import annotations

import math

import torch

from dynarec.optim.specs import Adagrad, Adam, OptimizerSpec, RowWiseAdagrad, SGD

__all__ = ["initial_states", "reference_update"]


def initial_states(spec: OptimizerSpec, num_rows: int, dim: int) -> dict[str, torch.Tensor]:
    """Fresh optimizer states of a table: ``{name: [num_rows, D or 1]}`` float32."""
    return {
        s.name: torch.full((num_rows, s.width(dim)), s.initial_value, dtype=torch.float32)
        for s in spec.state_specs()
    }


@torch.no_grad()
def reference_update(
    spec: OptimizerSpec,
    *,
    lr: float,
    step: int,
    weight: torch.Tensor,
    states: dict[str, torch.Tensor],
    touched: torch.Tensor,
    dense_grad: torch.Tensor,
) -> None:
    """Updates, in place, every row in ``touched`` (the ids looked up this step, duplicates
    allowed) using ``dense_grad[row]``, the row's full gradient of the loss."""
    for row in sorted(set(int(r) for r in touched.tolist())):
        g = dense_grad[row].clone()
        w = weight[row]
        if isinstance(spec, SGD):
            w -= lr * g
        elif isinstance(spec, Adagrad):
            h = states["momentum1"][row]
            h += g * g
            w -= lr * g / (torch.sqrt(h) + spec.eps)
        elif isinstance(spec, RowWiseAdagrad):
            wd, mode = spec.weight_decay, spec.weight_decay_mode
            g_used = g + wd * w if mode == "l2" else g
            h = states["momentum1"][row]
            h += (g_used * g_used).sum() / g.numel()
            multiplier = lr / (torch.sqrt(h) + spec.eps)
            if mode == "decoupled":
                w.copy_((1 - lr * wd) * w - multiplier * g)
            else:
                w -= multiplier * g_used
        elif isinstance(spec, Adam):
            m, v = states["momentum1"][row], states["momentum2"][row]
            m.copy_(spec.beta1 * m + (1 - spec.beta1) * g)
            v.copy_(spec.beta2 * v + (1 - spec.beta2) * g * g)
            m_hat = m / (1 - math.pow(spec.beta1, step))
            v_hat = v / (1 - math.pow(spec.beta2, step))
            w -= lr * (m_hat / (torch.sqrt(v_hat) + spec.eps) + spec.weight_decay * w)
        else:
            raise TypeError(type(spec).__name__)
