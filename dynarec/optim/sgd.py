"""Exact SGD (FBGEMM EXACT_SGD): ``w -= lr * g``. No state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynarec.optim.base import OptimizerSpec
from dynarec.optim.kernel import KernelArgs, KernelCode, native_update_of
from dynarec.optim.registry import FbgemmMapping, OptimizerDef, register

__all__ = ["SGD"]


@dataclass(frozen=True, repr=False)  # OptimizerSpec.__repr__
class SGD(OptimizerSpec):
    """Exact SGD: ``w -= lr * g``. No state."""


@torch.no_grad()
def reference_update(spec: SGD, *, lr, step, w, states, g) -> None:
    w -= lr * g


def kernel_args(spec: SGD, step: int) -> KernelArgs:
    return KernelArgs(KernelCode.SGD)


register(
    OptimizerDef(
        spec=SGD,
        yaml_key="sgd_optimizer",
        native_update=native_update_of(kernel_args),
        reference_update=reference_update,
        fbgemm=lambda spec: FbgemmMapping("EXACT_SGD"),
        kernel=kernel_args,
    )
)
