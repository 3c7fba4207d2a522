"""Exact Adagrad (FBGEMM EXACT_ADAGRAD), one accumulator entry per weight.

``h += g*g``; ``w -= lr * g / (sqrt(h) + eps)``. ``initial_accumulator_value`` is the value every
accumulator entry holds before its row's first update (TensorFlow's default is 0.1, torch.optim's
and FBGEMM's 0.0). No weight decay: FBGEMM's kernel has none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dynarec.optim.base import OptimizerSpec, StateSpec, check_non_negative, check_positive
from dynarec.optim.kernel import KernelArgs, KernelCode, native_update_of
from dynarec.optim.registry import FbgemmMapping, OptimizerDef, register

__all__ = ["Adagrad"]


@dataclass(frozen=True, repr=False)  # OptimizerSpec.__repr__
class Adagrad(OptimizerSpec):
    """Exact Adagrad, elementwise accumulator ``momentum1[D]``."""

    eps: float = 1e-8
    initial_accumulator_value: float = 0.0

    missing_key_hints: ClassVar[Mapping[str, str]] = {
        "weight_decay": "Adagrad has no weight decay in FBGEMM's kernel; RowWiseAdagrad has one",
        "weight_decay_mode": "Adagrad has no weight decay in FBGEMM's kernel; RowWiseAdagrad has one",
    }

    def _validate(self) -> None:
        check_positive(type(self).__name__, "eps", self.eps)
        check_non_negative(type(self).__name__, "initial_accumulator_value", self.initial_accumulator_value)

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (
            StateSpec(
                "momentum1", rowwise=False, initial_value=float(self.initial_accumulator_value), nonnegative=True
            ),
        )


@torch.no_grad()
def reference_update(spec: Adagrad, *, lr, step, w, states, g) -> None:
    h = states["momentum1"]
    h += g * g
    w -= lr * g / (torch.sqrt(h) + spec.eps)


def kernel_args(spec: Adagrad, step: int) -> KernelArgs:
    return KernelArgs(KernelCode.ADAGRAD, eps=spec.eps)


register(
    OptimizerDef(
        spec=Adagrad,
        yaml_key="adagrad_optimizer",
        native_update=native_update_of(kernel_args),
        reference_update=reference_update,
        fbgemm=lambda spec: FbgemmMapping("EXACT_ADAGRAD", {"eps": spec.eps}),
        kernel=kernel_args,
    )
)
