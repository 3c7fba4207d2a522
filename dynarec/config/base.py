"""What every config section is built from: the strict pydantic base (unknown keys and non-finite
numbers are errors), a positive count that YAML's ``true`` does not pass for, and core
dataclasses (dynarec.embedding's) as YAML fields."""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator

from dynarec.embedding.config import DynamicTableOptions
from dynarec.embedding.initializers import Initializer

__all__ = [
    "Activation",
    "Count",
    "DropoutRatios",
    "DynamicEmbField",
    "InitializerField",
    "MLPDropouts",
    "Strict",
    "core_type",
    "exactly_one",
]


class Strict(BaseModel):
    # Unknown keys, and NaN or infinite numbers, are errors wherever they appear.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def exactly_one(model: BaseModel, keys) -> str:
    """The one of ``keys`` that ``model`` sets; ValueError naming them otherwise."""
    given = [k for k in keys if getattr(model, k) is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of {list(keys)} (got {given or 'none'})")
    return given[0]


# A positive integer that YAML's ``true`` does not pass for.
Count = Annotated[StrictInt, Field(gt=0)]

# Dropout after an MLP's layers (TorchEasyRec's dropout_ratio): no ratio (none), one for every
# layer, or one per layer.
# An MLP's activation: ReLU; Dice (DIN's data-adaptive activation: a batch-normalized gate
# between x and alpha * x, alpha learned per unit; in eval it uses the running statistics); PReLU
# (one learned slope a layer, TorchEasyRec's nn.PReLU); none: linear layers (TorchEasyRec's "").
Activation = Literal["relu", "dice", "prelu", "none"]

DropoutRatios = list[Annotated[float, Field(ge=0, lt=1)]]


class MLPDropouts(Strict):
    """A config of MLPs with dropout: each ``<prefix>dropout_ratio`` field gives one ratio, or one
    per layer of its ``<prefix>hidden_units`` (a ValueError naming both otherwise)."""

    @model_validator(mode="after")
    def _dropout_per_layer(self):
        for ratios_field in type(self).model_fields:
            if not ratios_field.endswith("dropout_ratio"):
                continue
            units_field = ratios_field.removesuffix("dropout_ratio") + "hidden_units"
            ratios, units = getattr(self, ratios_field), getattr(self, units_field)
            if len(ratios) > 1 and len(ratios) != len(units):
                raise ValueError(
                    f"{ratios_field}: {len(ratios)} ratios for the {len(units)} layers of {units_field}; "
                    "give one, or one per layer"
                )
        return self


def _refuse_bool_numbers(cls: type, data: Any) -> Any:
    """Before pydantic validates a mapping into the dataclass ``cls`` (lax mode, which would read
    ``true`` as 1), refuses a bool given for a numeric field, in ``cls`` and its nested
    dataclasses."""
    if not isinstance(data, dict):
        return data
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        hint = hints.get(key)
        args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if isinstance(value, bool) and any(a in (int, float) for a in args):
            raise ValueError(f"{key} must be a number, got {value!r}")
        for a in args:
            if dataclasses.is_dataclass(a):
                _refuse_bool_numbers(a, value)  # type: ignore[arg-type]
    return data


def _not_a_boolean(v: Any) -> Any:
    if isinstance(v, bool):  # (lax mode reads true as 1)
        raise ValueError("a number, not a boolean")
    return v


#: A number field's validator that refuses a boolean (``Annotated[float, NotBoolean]``).
NotBoolean = BeforeValidator(_not_a_boolean)


def core_type(cls: type) -> Any:
    """A core dataclass (dynarec.embedding) as a YAML field: validated straight into ``cls``."""
    return Annotated[cls, BeforeValidator(lambda data: _refuse_bool_numbers(cls, data))]


if TYPE_CHECKING:
    DynamicEmbField = DynamicTableOptions
    InitializerField = Initializer
else:
    DynamicEmbField = core_type(DynamicTableOptions)
    InitializerField = core_type(Initializer)
