"""The base of every sparse-optimizer spec: typed, immutable, validated on construction.

A spec is the only way optimizer settings travel in dynarec: the planner gives every table one
spec object, and every backend (native, fbgemm, the GPU kernels), table kind (fixed, dynamic),
device and shard reads the same fields. A setting a spec does not have is an error, never a
silent no-op. Each concrete spec lives in its own module beside its update code and registers
itself (:mod:`dynarec.optim.registry`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["OptimizerSpec", "StateSpec", "check_finite", "check_non_negative", "check_positive"]

# Settings users bring from other libraries that dynarec deliberately does not offer, with the
# reason given in the error message.
NOT_OFFERED = {
    "max_norm": "max-norm clipping is not offered",
    "counter_based_regularization": "COUNTER weight decay is not offered",
    "cowclip_regularization": "COWCLIP is not offered",
    "momentum": "momentum SGD is not offered",
}


@dataclass(frozen=True)
class StateSpec:
    """One optimizer state tensor of a table: ``[num_rows, width]`` float32.

    ``rowwise`` states have width 1; the others have the table's embedding dim. A
    ``nonnegative`` state is a sum of squares (Adagrad's accumulator, Adam's second moment): the
    update takes its square root.
    """

    name: str
    rowwise: bool
    initial_value: float
    nonnegative: bool = False

    def width(self, dim: int) -> int:
        return 1 if self.rowwise else dim


def check_finite(cls_name: str, field: str, value: Any) -> float:
    """``value`` as a float; ValueError naming ``cls_name.field`` unless a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{cls_name}.{field} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{cls_name}.{field} must be finite, got {value!r}")
    return value


def check_positive(cls_name: str, field: str, value: Any) -> None:
    if check_finite(cls_name, field, value) <= 0:
        raise ValueError(f"{cls_name}.{field} must be > 0, got {value!r}")


def check_non_negative(cls_name: str, field: str, value: Any) -> None:
    if check_finite(cls_name, field, value) < 0:
        raise ValueError(f"{cls_name}.{field} must be >= 0, got {value!r}")


@dataclass(frozen=True, repr=False)
class OptimizerSpec:
    """Base of the sparse optimizer specs. ``lr`` is the initial learning rate; a schedule may
    change a table's current learning rate at run time (``set_learning_rate``).

    ``gradient_clipping`` (FBGEMM TBE's setting, keyword-only on every optimizer): each element
    of a bag's output gradient is clamped to ``[-max_gradient, max_gradient]`` before the bag's
    rows aggregate it (per sequence element for unpooled features) -- FBGEMM's meaning on CPU
    and GPU alike; ``max_gradient`` is ignored while ``gradient_clipping`` is False."""

    lr: float = 0.01
    gradient_clipping: bool = field(default=False, kw_only=True)
    max_gradient: float = field(default=1.0, kw_only=True)

    # Hints for keys a spec does not have, keyed by the key (see ``from_dict``).
    missing_key_hints: ClassVar[Mapping[str, str]] = {}

    def __post_init__(self) -> None:
        name = type(self).__name__
        check_non_negative(name, "lr", self.lr)
        if not isinstance(self.gradient_clipping, bool):
            raise ValueError(f"{name}.gradient_clipping must be true or false, got {self.gradient_clipping!r}")
        check_positive(name, "max_gradient", self.max_gradient)
        self._validate()

    def _validate(self) -> None:  # overridden by specs with more fields
        pass

    def state_specs(self) -> tuple[StateSpec, ...]:
        """The optimizer state tensors every row of a table carries, in a fixed order."""
        return ()

    def __repr__(self) -> str:
        """Every field, but the clipping pair only where clipping is on (it does nothing else)."""
        hidden = () if self.gradient_clipping else ("gradient_clipping", "max_gradient")
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.name not in hidden]
        return f"{type(self).__name__}({', '.join(shown)})"

    def replace(self, **changes: Any) -> OptimizerSpec:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], where: str = "") -> OptimizerSpec:
        """Builds the spec from a mapping of its fields.

        Unknown keys are an error naming the key (and ``where``, the place the mapping came
        from, e.g. a config path); so is a key that another optimizer has, such as
        ``initial_accumulator_value`` given to SGD or Adam.
        """
        label = where or cls.__name__
        if not isinstance(mapping, Mapping):
            raise ValueError(f"{label}: expected a mapping of optimizer fields, got {mapping!r}")
        allowed = [f.name for f in dataclasses.fields(cls)]
        for key in mapping:
            if key in allowed:
                continue
            if key in NOT_OFFERED:
                raise ValueError(f"{label}: '{key}' is not supported: {NOT_OFFERED[key]}")
            hint = ""
            if key == "initial_accumulator_value":
                hint = f" ({cls.__name__} has no accumulator to initialize)"
            elif key in cls.missing_key_hints:
                hint = f" ({cls.missing_key_hints[key]})"
            raise ValueError(
                f"{label}: unknown key '{key}' for {cls.__name__}{hint}; allowed keys: {', '.join(allowed)}"
            )
        try:
            return cls(**dict(mapping))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{label}: {e}") from None
