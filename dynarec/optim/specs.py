"""Typed, immutable sparse-optimizer specs.

A spec is the only way optimizer settings travel in dynarec: the planner gives every table
one spec object, and every backend (native, fbgemm), table kind (fixed, dynamic) and device
reads the same fields. A setting a spec does not have is an error, never a silent no-op.

The update formulas are FBGEMM TBE's (EXACT_SGD, EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD, ADAM);
see ``docs/optimizers.md`` and ``dynarec.optim.reference``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

__all__ = [
    "OptimizerSpec",
    "SGD",
    "Adagrad",
    "RowWiseAdagrad",
    "Adam",
    "StateSpec",
    "OPTIMIZERS",
    "optimizer_from_dict",
]

# Settings users bring from other libraries that dynarec deliberately does not offer, with the
# reason given in the error message.
_NOT_OFFERED = {
    "gradient_clipping": "gradient clipping is not offered (FBGEMM's CPU build clamps per bag, "
    "before aggregation, which differs from its GPU meaning)",
    "max_gradient": "gradient clipping is not offered",
    "max_norm": "max-norm clipping is not offered",
    "counter_based_regularization": "COUNTER weight decay is not offered",
    "cowclip_regularization": "COWCLIP is not offered",
    "momentum": "momentum SGD is not offered",
}


@dataclass(frozen=True)
class StateSpec:
    """One optimizer state tensor of a table: ``[num_rows, width]`` float32.

    ``rowwise`` states have width 1; the others have the table's embedding dim.
    """

    name: str
    rowwise: bool
    initial_value: float

    def width(self, dim: int) -> int:
        return 1 if self.rowwise else dim


def _check_finite(cls_name: str, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{cls_name}.{field} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{cls_name}.{field} must be finite, got {value!r}")
    return value


@dataclass(frozen=True)
class OptimizerSpec:
    """Base of the sparse optimizer specs. ``lr`` is the initial learning rate; a schedule may
    change a table's current learning rate at run time (``set_learning_rate``)."""

    lr: float = 0.01

    name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        cls = type(self).__name__
        lr = _check_finite(cls, "lr", self.lr)
        if lr < 0:
            raise ValueError(f"{cls}.lr must be >= 0, got {self.lr!r}")
        self._validate()

    def _validate(self) -> None:  # overridden by specs with more fields
        pass

    def state_specs(self) -> tuple[StateSpec, ...]:
        """The optimizer state tensors every row of a table carries, in a fixed order."""
        return ()

    def replace(self, **changes: Any) -> "OptimizerSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], where: str = "") -> "OptimizerSpec":
        """Builds the spec from a mapping of its fields.

        Unknown keys are an error naming the key (and ``where``, the place the mapping came
        from, e.g. a config path); so is a key that another optimizer has, such as
        ``initial_accumulator_value`` given to SGD or Adam.
        """
        label = where or cls.name
        if not isinstance(mapping, Mapping):
            raise ValueError(f"{label}: expected a mapping of optimizer fields, got {mapping!r}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        for key in mapping:
            if key in allowed:
                continue
            if key in _NOT_OFFERED:
                raise ValueError(f"{label}: '{key}' is not supported: {_NOT_OFFERED[key]}")
            hint = ""
            if key == "initial_accumulator_value":
                hint = f" ({cls.__name__} has no accumulator to initialize)"
            elif key in ("weight_decay", "weight_decay_mode"):
                hint = f" ({cls.__name__} has no weight decay in FBGEMM's kernel)"
            raise ValueError(
                f"{label}: unknown key '{key}' for {cls.__name__}{hint}; "
                f"allowed keys: {', '.join(allowed)}"
            )
        try:
            return cls(**dict(mapping))
        except ValueError as e:
            raise ValueError(f"{label}: {e}") from None


def _check_eps(cls: str, eps: float) -> None:
    if _check_finite(cls, "eps", eps) <= 0:
        raise ValueError(f"{cls}.eps must be > 0, got {eps!r}")


def _check_iav(cls: str, value: float) -> None:
    if _check_finite(cls, "initial_accumulator_value", value) < 0:
        raise ValueError(f"{cls}.initial_accumulator_value must be >= 0, got {value!r}")


def _check_weight_decay(cls: str, value: float) -> None:
    if _check_finite(cls, "weight_decay", value) < 0:
        raise ValueError(f"{cls}.weight_decay must be >= 0, got {value!r}")


@dataclass(frozen=True)
class SGD(OptimizerSpec):
    """Exact SGD: ``w -= lr * g``. No state."""

    name: ClassVar[str] = "sgd"


@dataclass(frozen=True)
class Adagrad(OptimizerSpec):
    """Exact Adagrad (FBGEMM EXACT_ADAGRAD), elementwise accumulator ``momentum1[D]``.

    ``h += g*g``; ``w -= lr * g / (sqrt(h) + eps)``. ``initial_accumulator_value`` is the
    value every accumulator entry holds before its row's first update (TensorFlow's default is
    0.1, torch.optim's and FBGEMM's 0.0). No weight decay (FBGEMM's kernel has none).
    """

    eps: float = 1e-8
    initial_accumulator_value: float = 0.0

    name: ClassVar[str] = "adagrad"

    def _validate(self) -> None:
        _check_eps(type(self).__name__, self.eps)
        _check_iav(type(self).__name__, self.initial_accumulator_value)

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (StateSpec("momentum1", rowwise=False, initial_value=float(self.initial_accumulator_value)),)


WEIGHT_DECAY_MODES = ("none", "l2", "decoupled")


@dataclass(frozen=True)
class RowWiseAdagrad(OptimizerSpec):
    """Exact row-wise Adagrad (FBGEMM EXACT_ROWWISE_ADAGRAD), one accumulator per row.

    ``g' = g + wd*w`` (mode l2) else ``g``; ``h += mean_d(g'*g')``; ``m = lr / (sqrt(h) + eps)``;
    none: ``w -= m*g``; l2: ``w -= m*g'``; decoupled: ``w = (1 - lr*wd)*w - m*g``.
    """

    eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    weight_decay: float = 0.0
    weight_decay_mode: str = "none"

    name: ClassVar[str] = "rowwise_adagrad"

    def _validate(self) -> None:
        cls = type(self).__name__
        _check_eps(cls, self.eps)
        _check_iav(cls, self.initial_accumulator_value)
        _check_weight_decay(cls, self.weight_decay)
        if self.weight_decay_mode not in WEIGHT_DECAY_MODES:
            raise ValueError(
                f"{cls}.weight_decay_mode must be one of {WEIGHT_DECAY_MODES}, "
                f"got {self.weight_decay_mode!r}"
            )
        if self.weight_decay > 0 and self.weight_decay_mode == "none":
            raise ValueError(
                f"{cls}.weight_decay={self.weight_decay} has no effect with "
                "weight_decay_mode='none'; choose weight_decay_mode 'l2' or 'decoupled'"
            )

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (StateSpec("momentum1", rowwise=True, initial_value=float(self.initial_accumulator_value)),)


@dataclass(frozen=True)
class Adam(OptimizerSpec):
    """Adam with bias correction (FBGEMM ADAM) and decoupled ``weight_decay``.

    ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*g*g``;
    ``w -= lr * ((m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps) + wd*w)``, ``t`` the table's step.
    """

    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0

    name: ClassVar[str] = "adam"

    def _validate(self) -> None:
        cls = type(self).__name__
        _check_eps(cls, self.eps)
        for field in ("beta1", "beta2"):
            value = _check_finite(cls, field, getattr(self, field))
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{cls}.{field} must be in [0, 1), got {getattr(self, field)!r}")
        _check_weight_decay(cls, self.weight_decay)

    def state_specs(self) -> tuple[StateSpec, ...]:
        return (
            StateSpec("momentum1", rowwise=False, initial_value=0.0),
            StateSpec("momentum2", rowwise=False, initial_value=0.0),
        )


OPTIMIZERS: dict[str, type[OptimizerSpec]] = {
    cls.name: cls for cls in (SGD, Adagrad, RowWiseAdagrad, Adam)
}


def optimizer_from_dict(mapping: Mapping[str, Any], where: str = "optimizer") -> OptimizerSpec:
    """Builds a spec from ``{"type": "adagrad", "lr": ...}``; ``type`` names one of
    :data:`OPTIMIZERS`."""
    if not isinstance(mapping, Mapping) or "type" not in mapping:
        raise ValueError(f"{where}: expected a mapping with a 'type' key, one of {sorted(OPTIMIZERS)}")
    fields = dict(mapping)
    kind = fields.pop("type")
    if kind not in OPTIMIZERS:
        raise ValueError(f"{where}.type: unknown optimizer {kind!r}; expected one of {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[kind].from_dict(fields, where=where)
