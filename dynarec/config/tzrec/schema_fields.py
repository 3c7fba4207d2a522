"""What dynarec's YAML schema (:mod:`dynarec.config.schema`) offers, asked at conversion time,
so that the importer maps a TorchEasyRec field onto a dynarec setting only where the schema has
it, and refuses it by path otherwise."""

from __future__ import annotations

import typing
from typing import Any, Optional

from pydantic import BaseModel

__all__ = ["field_values", "kind_fields", "model_fields_of"]


def _model_in(annotation: Any) -> Optional[type[BaseModel]]:
    """The pydantic model class inside ``Optional[...]`` / ``Annotated[...]`` / a union."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def model_fields_of(cls: type[BaseModel], *path: str) -> set[str]:
    """The fields of the model at ``path`` under ``cls`` (empty when there is none)."""
    model: Optional[type[BaseModel]] = cls
    for name in path:
        info = model.model_fields.get(name) if model is not None else None
        model = _model_in(info.annotation) if info is not None else None
    return set(model.model_fields) if model is not None else set()


def kind_fields(kind: str) -> set[str]:
    """The fields of dynarec's feature kind ``kind`` (``id_feature``, ...); empty when dynarec
    has no such kind."""
    from dynarec.config.schema import FeatureCfg

    return model_fields_of(FeatureCfg, kind)


def field_values(cls: type[BaseModel], name: str) -> set[Any]:
    """The values a ``Literal`` field of ``cls`` allows (empty when it is not one)."""
    info = cls.model_fields.get(name)
    if info is None:
        return set()
    out: set[Any] = set()
    stack = [info.annotation]
    while stack:
        a = stack.pop()
        if typing.get_origin(a) is typing.Literal:
            out.update(typing.get_args(a))
        else:
            stack.extend(typing.get_args(a))
    return out
