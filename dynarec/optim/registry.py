"""The optimizer registry: one entry per sparse optimizer, keyed by its spec class.

An entry owns everything dynarec knows about one optimizer, in one place (the way FBGEMM
generates every kernel of an optimizer from one template):

- ``spec``: the spec class (its fields, validation and state layout, ``state_specs()``);
- ``yaml_key``: its block name in a config (``adagrad_optimizer``); the YAML schema's keys and
  their allowed fields derive from the registry;
- ``native_update``: the fused update every native row store runs (CPU and CUDA) where the
  kernels do not;
- ``reference_update``: the plain per-row reference the tests hold every backend to;
- ``fbgemm``: how FBGEMM's TBE is configured for it, or the reason the fbgemm backend refuses it;
- ``kernel``: how the fused update kernels (``torch.ops.dynarec.bag_update``: C++ on CPUs, Triton
  on GPUs) run this optimizer for a step (:class:`~dynarec.optim.kernel.KernelArgs`: its
  :class:`~dynarec.optim.kernel.KernelCode` and scalars); None: the native update runs on every
  device.

Adding an optimizer without kernels is one ``register(OptimizerDef(...))`` call; nothing else in
dynarec switches on the spec's type. One with kernels also needs its code's case in each twin of
the update (:mod:`dynarec.optim.kernel` says where); its ``native_update`` is then
``native_update_of(kernel)``, that code's torch case.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from dynarec.optim.base import OptimizerSpec
from dynarec.optim.kernel import KernelArgs

__all__ = [
    "FbgemmMapping",
    "KernelArgs",
    "NativeUpdate",
    "OptimizerDef",
    "ReferenceUpdate",
    "definition",
    "register",
    "registered",
    "spec_from_yaml",
    "spec_to_yaml",
    "unregister",
]

NativeUpdate = Callable[..., None]
"""``(spec, *, lr, step, weight, states, rows, grad) -> None``: applies the optimizer in place to
``weight[rows]`` and ``states[name][rows]``; ``rows`` ``[U]`` unique int64, ``grad`` ``[U, D]``
float32 (each row's aggregated gradient), ``step`` the table's step counter ``t >= 1``."""

ReferenceUpdate = Callable[..., None]
"""``(spec, *, lr, step, w, states, g) -> None``: updates one row in place: ``w`` ``[D]``,
``states`` ``{name: [D] or [1]}`` views of that row, ``g`` ``[D]`` its gradient."""


@dataclass(frozen=True)
class FbgemmMapping:
    """How FBGEMM's TBE runs an optimizer spec.

    ``optimizer``: the ``EmbOptimType`` member name; ``kwargs``: TBE constructor arguments
    (``eps``, ``weight_decay``, ...); ``weight_decay_mode``: the ``WeightDecayMode`` member name,
    if any; ``needs_generic_path``: the CPU kernel's single-feature fast path drops a setting of
    this spec, so the store must take TBE's generic path (see ``embedding/fbgemm_store.py``).
    """

    optimizer: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    weight_decay_mode: Optional[str] = None
    needs_generic_path: bool = False


@dataclass(frozen=True)
class OptimizerDef:
    spec: type[OptimizerSpec]
    yaml_key: str
    native_update: NativeUpdate
    reference_update: ReferenceUpdate
    # A mapping for a spec, or the reason (one sentence) the fbgemm backend refuses the optimizer.
    fbgemm: Union[Callable[[Any], FbgemmMapping], str]
    kernel: Optional[Callable[[Any, int], KernelArgs]] = None  # (spec, step) -> KernelArgs

    @property
    def name(self) -> str:
        return self.spec.__name__


_REGISTRY: dict[type[OptimizerSpec], OptimizerDef] = {}


def register(defn: OptimizerDef) -> OptimizerDef:
    """Adds an optimizer; its spec class and YAML key must be new."""
    if not (isinstance(defn.spec, type) and issubclass(defn.spec, OptimizerSpec)):
        raise TypeError(f"OptimizerDef.spec must be an OptimizerSpec subclass, got {defn.spec!r}")
    if defn.spec in _REGISTRY:
        raise ValueError(f"optimizer {defn.name} is registered already")
    if not defn.yaml_key.endswith("_optimizer"):
        raise ValueError(f"{defn.name}: yaml_key must end with '_optimizer', got {defn.yaml_key!r}")
    if any(d.yaml_key == defn.yaml_key for d in _REGISTRY.values()):
        raise ValueError(f"{defn.name}: yaml_key {defn.yaml_key!r} is taken")
    _REGISTRY[defn.spec] = defn
    return defn


def unregister(spec_cls: type[OptimizerSpec]) -> None:
    """Removes an optimizer (for tests that register a throwaway one)."""
    _REGISTRY.pop(spec_cls, None)


def definition(spec: Union[OptimizerSpec, type[OptimizerSpec]]) -> OptimizerDef:
    """The registry entry of a spec (or spec class); TypeError for an unregistered one."""
    cls = spec if isinstance(spec, type) else type(spec)
    try:
        return _REGISTRY[cls]
    except KeyError:
        raise TypeError(
            f"{cls.__name__} is not a registered optimizer; registered: {[d.name for d in _REGISTRY.values()]}"
        ) from None


def registered() -> list[OptimizerDef]:
    """Every registered optimizer, in registration order."""
    return list(_REGISTRY.values())


def spec_from_yaml(block: Any, where: str) -> OptimizerSpec:
    """``{"adagrad_optimizer": {"lr": 0.05, ...}}`` -> ``Adagrad(lr=0.05, ...)``.

    Exactly one registered ``*_optimizer`` key; its fields are the spec's. Errors name ``where``
    (a config path) and the offending key."""
    keys = [d.yaml_key for d in _REGISTRY.values()]
    if isinstance(block, OptimizerSpec):
        definition(block)
        return block
    if not isinstance(block, Mapping) or len(block) != 1:
        given = list(block) if isinstance(block, Mapping) else block
        raise ValueError(f"{where + ': ' if where else ''}give exactly one of {keys} (got {given!r})")
    ((key, fields),) = block.items()
    defn = next((d for d in _REGISTRY.values() if d.yaml_key == key), None)
    if defn is None:
        raise ValueError(f"{where + ': ' if where else ''}unknown optimizer '{key}'; expected one of {keys}")
    return defn.spec.from_dict(fields if fields is not None else {}, where=f"{where}.{key}" if where else key)


def spec_to_yaml(spec: OptimizerSpec) -> dict[str, dict[str, Any]]:
    """The inverse of :func:`spec_from_yaml`."""
    return {definition(spec).yaml_key: spec.to_dict()}


def initial_states(
    spec: OptimizerSpec, num_rows: int, dim: int, device: Union[torch.device, str] = "cpu"
) -> dict[str, torch.Tensor]:
    """Fresh optimizer states of a table: ``{name: [num_rows, D or 1]}`` float32."""
    return {
        s.name: torch.full((num_rows, s.width(dim)), s.initial_value, dtype=torch.float32, device=device)
        for s in spec.state_specs()
    }
