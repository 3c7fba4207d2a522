"""Plain, unfused reference of the optimizer contract.

Written for reading, not speed: one row at a time, straight from the formulas in
``docs/optimizers.md`` (FBGEMM's GPU meaning), each optimizer's ``reference_update`` from the
registry. Tests compare every backend against it; it shares no code with the fused updates.
"""

from __future__ import annotations

import torch

from dynarec.optim.base import OptimizerSpec
from dynarec.optim.registry import definition, initial_states

__all__ = ["initial_states", "reference_update"]


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
    update = definition(spec).reference_update
    for row in sorted(set(int(r) for r in touched.tolist())):
        update(
            spec,
            lr=lr,
            step=step,
            w=weight[row],
            states={k: v[row] for k, v in states.items()},
            g=dense_grad[row].clone(),
        )
