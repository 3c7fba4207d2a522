"""Exact SGD (FBGEMM EXACT_SGD): ``w -= lr * g``. No state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynarec.optim.base import OptimizerSpec
from dynarec.optim.registry import FbgemmMapping, KernelArgs, OptimizerDef, register

__all__ = ["SGD"]


@dataclass(frozen=True)
class SGD(OptimizerSpec):
    """Exact SGD: ``w -= lr * g``. No state."""


@torch.no_grad()
def native_update(spec: SGD, *, lr, step, weight, states, rows, grad) -> None:
    weight.index_add_(0, rows, grad, alpha=-lr)


@torch.no_grad()
def reference_update(spec: SGD, *, lr, step, w, states, g) -> None:
    w -= lr * g


register(
    OptimizerDef(
        spec=SGD,
        yaml_key="sgd_optimizer",
        native_update=native_update,
        reference_update=reference_update,
        fbgemm=lambda spec: FbgemmMapping("EXACT_SGD"),
        kernel=lambda spec, step: KernelArgs(0),
    )
)
