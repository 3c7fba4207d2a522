"""Exact row-wise Adagrad (FBGEMM EXACT_ROWWISE_ADAGRAD), one accumulator per row.

``g' = g + wd*w`` (mode l2) else ``g``; ``h += mean_d(g'*g')``; ``m = lr / (sqrt(h) + eps)``;
none: ``w -= m*g``; l2: ``w -= m*g'``; decoupled: ``w = (1 - lr*wd)*w - m*g``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from dynarec.optim.base import OptimizerSpec, StateSpec, check_non_negative, check_positive
from dynarec.optim.kernel import KernelArgs, KernelCode, WeightDecayCode, native_update_of
from dynarec.optim.registry import FbgemmMapping, OptimizerDef, register

__all__ = ["WEIGHT_DECAY_MODES", "RowWiseAdagrad", "WeightDecayMode"]

WeightDecayMode = Literal["none", "l2", "decoupled"]
WEIGHT_DECAY_MODES: tuple[str, ...] = get_args(WeightDecayMode)


@dataclass(frozen=True, repr=False)  # OptimizerSpec.__repr__
class RowWiseAdagrad(OptimizerSpec):
    """Exact row-wise Adagrad, ``momentum1[1]`` per row, optional weight decay."""

    eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    weight_decay: float = 0.0
    weight_decay_mode: WeightDecayMode = "none"

    def _validate(self) -> None:
        cls = type(self).__name__
        check_positive(cls, "eps", self.eps)
        check_non_negative(cls, "initial_accumulator_value", self.initial_accumulator_value)
        check_non_negative(cls, "weight_decay", self.weight_decay)
        if self.weight_decay_mode not in WEIGHT_DECAY_MODES:
            raise ValueError(
                f"{cls}.weight_decay_mode must be one of {WEIGHT_DECAY_MODES}, got {self.weight_decay_mode!r}"
            )
        if self.weight_decay > 0 and self.weight_decay_mode == "none":
            raise ValueError(
                f"{cls}.weight_decay={self.weight_decay} has no effect with weight_decay_mode='none'; "
                "choose weight_decay_mode 'l2' or 'decoupled'"
            )

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (
            StateSpec("momentum1", rowwise=True, initial_value=float(self.initial_accumulator_value), nonnegative=True),
        )


@torch.no_grad()
def reference_update(spec: RowWiseAdagrad, *, lr, step, w, states, g) -> None:
    wd, mode = spec.weight_decay, spec.weight_decay_mode
    g_used = g + wd * w if mode == "l2" else g
    h = states["momentum1"]
    h += (g_used * g_used).sum() / g.numel()
    multiplier = lr / (torch.sqrt(h) + spec.eps)
    if mode == "decoupled":
        w.copy_((1 - lr * wd) * w - multiplier * g)
    else:
        w -= multiplier * g_used


def kernel_args(spec: RowWiseAdagrad, step: int) -> KernelArgs:
    mode = WeightDecayCode[spec.weight_decay_mode.upper()] if spec.weight_decay > 0 else WeightDecayCode.NONE
    return KernelArgs(KernelCode.ROWWISE_ADAGRAD, eps=spec.eps, weight_decay=spec.weight_decay, weight_decay_mode=mode)


def fbgemm_mapping(spec: RowWiseAdagrad) -> FbgemmMapping:
    mode = {"none": "NONE", "l2": "L2", "decoupled": "DECOUPLE"}[spec.weight_decay_mode]
    return FbgemmMapping(
        "EXACT_ROWWISE_ADAGRAD",
        {"eps": spec.eps, "weight_decay": spec.weight_decay},
        weight_decay_mode=mode,
        # CPU TBE's single-feature fast path passes weight_decay=0 (docs/optimizers.md).
        needs_generic_path=spec.weight_decay > 0,
    )


register(
    OptimizerDef(
        spec=RowWiseAdagrad,
        yaml_key="rowwise_adagrad_optimizer",
        native_update=native_update_of(kernel_args),
        reference_update=reference_update,
        fbgemm=fbgemm_mapping,
        kernel=kernel_args,
    )
)
