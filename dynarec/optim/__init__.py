"""Sparse optimizer specs, their registry, the fused row update and the plain reference.

Imports with torch alone. Importing this package registers SGD, Adagrad, RowWiseAdagrad and Adam.
"""

from dynarec.optim.adagrad import Adagrad
from dynarec.optim.adam import Adam
from dynarec.optim.base import OptimizerSpec, StateSpec
from dynarec.optim.fused import fused_row_update
from dynarec.optim.registry import (
    FbgemmMapping,
    OptimizerDef,
    definition,
    register,
    registered,
    spec_from_yaml,
    spec_to_yaml,
)
from dynarec.optim.rowwise_adagrad import RowWiseAdagrad
from dynarec.optim.sgd import SGD

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "FbgemmMapping",
    "OptimizerDef",
    "OptimizerSpec",
    "RowWiseAdagrad",
    "StateSpec",
    "definition",
    "fused_row_update",
    "register",
    "registered",
    "spec_from_yaml",
    "spec_to_yaml",
]
