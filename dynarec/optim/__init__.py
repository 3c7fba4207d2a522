"""Sparse optimizer specs, their state layout, the fused row update and the plain reference.

Imports with torch alone.
"""

from dynarec.optim.fused import fused_row_update
from dynarec.optim.specs import (
    OPTIMIZERS,
    SGD,
    Adagrad,
    Adam,
    OptimizerSpec,
    RowWiseAdagrad,
    StateSpec,
    optimizer_from_dict,
)

__all__ = [
    "OPTIMIZERS",
    "SGD",
    "Adagrad",
    "Adam",
    "OptimizerSpec",
    "RowWiseAdagrad",
    "StateSpec",
    "fused_row_update",
    "optimizer_from_dict",
]
