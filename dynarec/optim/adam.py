"""Adam with bias correction (FBGEMM ADAM) and decoupled ``weight_decay``.

``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*g*g``;
``w -= lr * ((m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps) + wd*w)``, ``t`` the table's step counter.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from dynarec.optim.base import OptimizerSpec, StateSpec, check_finite, check_non_negative, check_positive
from dynarec.optim.kernel import KernelArgs, KernelCode, WeightDecayCode, native_update_of
from dynarec.optim.registry import OptimizerDef, register

__all__ = ["Adam"]


@dataclass(frozen=True, repr=False)  # OptimizerSpec.__repr__
class Adam(OptimizerSpec):
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0

    missing_key_hints: ClassVar[Mapping[str, str]] = {
        "weight_decay_mode": "Adam's weight_decay is always decoupled",
    }

    def _validate(self) -> None:
        cls = type(self).__name__
        check_positive(cls, "eps", self.eps)
        for name in ("beta1", "beta2"):
            value = check_finite(cls, name, getattr(self, name))
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{cls}.{name} must be in [0, 1), got {getattr(self, name)!r}")
        check_non_negative(cls, "weight_decay", self.weight_decay)

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (
            StateSpec("momentum1", rowwise=False, initial_value=0.0),
            StateSpec("momentum2", rowwise=False, initial_value=0.0, nonnegative=True),
        )


@torch.no_grad()
def reference_update(spec: Adam, *, lr, step, w, states, g) -> None:
    m, v = states["momentum1"], states["momentum2"]
    m.copy_(spec.beta1 * m + (1 - spec.beta1) * g)
    v.copy_(spec.beta2 * v + (1 - spec.beta2) * g * g)
    m_hat = m / (1 - math.pow(spec.beta1, step))
    v_hat = v / (1 - math.pow(spec.beta2, step))
    w -= lr * (m_hat / (torch.sqrt(v_hat) + spec.eps) + spec.weight_decay * w)


def kernel_args(spec: Adam, step: int) -> KernelArgs:
    return KernelArgs(
        KernelCode.ADAM,
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        weight_decay_mode=WeightDecayCode.DECOUPLED if spec.weight_decay > 0 else WeightDecayCode.NONE,
        beta1=spec.beta1,
        beta2=spec.beta2,
        bias1=1.0 - spec.beta1**step,
        bias2=1.0 - spec.beta2**step,
    )


register(
    OptimizerDef(
        spec=Adam,
        yaml_key="adam_optimizer",
        native_update=native_update_of(kernel_args),
        reference_update=reference_update,
        fbgemm="FBGEMM's CPU TBE refuses Adam",
        kernel=kernel_args,
    )
)
