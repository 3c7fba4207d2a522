"""The model zoo: the dense part of each model, over the embedding collection's outputs."""

from dynarec.models.registry import MODELS, build_model

__all__ = ["MODELS", "build_model"]
