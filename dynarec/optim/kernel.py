"""The optimizer table of the fused update kernels: every optimizer they run, by code, and its
row update in torch.

The fused update exists three times, one case per :class:`KernelCode` in each: :func:`update_rows`
here (plain torch: the native update of every optimizer with a kernel, and the reference of the
``dynarec::bag_update`` op), the C++ extension's (``dynarec/kernels/cpu/ops.cpp``) and the Triton
kernels' (``dynarec/kernels/gpu/update.py``). This module is their one source of codes: the C++
extension is compiled with :func:`cpp_defines` (``-DDYNAREC_KERNEL_SGD=0`` ...), the Triton kernels
take the codes as ``tl.constexpr`` from these enums, and an optimizer reaches the three through its
registry entry's ``kernel`` (``(spec, step) -> KernelArgs``).

An optimizer with kernels therefore needs, besides its ``register(OptimizerDef(...))`` call: a
:class:`KernelCode` member, and that code's case in :func:`update_rows`, in ops.cpp's
``fused_bag_update`` and in the Triton ``_apply_update``. A code without a case fails loudly in
each (tests/kernels walks the registry through all three).

Imports torch alone: the kernels import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

__all__ = ["KernelArgs", "KernelCode", "WeightDecayCode", "cpp_defines", "native_update_of", "update_rows"]


class KernelCode(IntEnum):
    """Which optimizer the kernels' update runs (``KernelArgs.code``)."""

    SGD = 0
    ADAGRAD = 1
    ROWWISE_ADAGRAD = 2
    ADAM = 3


class WeightDecayCode(IntEnum):
    """How the kernels' update applies weight decay (``KernelArgs.weight_decay_mode``)."""

    NONE = 0
    L2 = 1
    DECOUPLED = 2


@dataclass(frozen=True)
class KernelArgs:
    """How the fused update runs an optimizer for one step: its ``code`` and scalars (float64,
    rounded to float32 by the kernels as torch rounds them). ``bias1`` / ``bias2``: Adam's
    ``1 - beta^t`` of this step."""

    code: KernelCode
    eps: float = 0.0
    weight_decay: float = 0.0
    weight_decay_mode: WeightDecayCode = WeightDecayCode.NONE
    beta1: float = 0.0
    beta2: float = 0.0
    bias1: float = 1.0
    bias2: float = 1.0


def cpp_defines() -> tuple[str, ...]:
    """The C++ extension's compiler flags naming every code: ``-DDYNAREC_KERNEL_<NAME>=<code>``
    and ``-DDYNAREC_WEIGHT_DECAY_<NAME>=<code>``."""
    return tuple(f"-DDYNAREC_KERNEL_{c.name}={int(c)}" for c in KernelCode) + tuple(
        f"-DDYNAREC_WEIGHT_DECAY_{m.name}={int(m)}" for m in WeightDecayCode
    )


@torch.no_grad()
def update_rows(
    args: KernelArgs,
    *,
    lr: float,
    weight: torch.Tensor,
    states: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
) -> None:
    """Applies the optimizer ``args`` names in place to ``weight[rows]`` and its states
    (``momentum1``, ``momentum2``: ``[num_rows, D or 1]`` float32); ``rows`` ``[U]`` unique int64,
    ``grad`` ``[U, D]`` float32 (each row's aggregated gradient). Batched tensor ops, any device."""
    code, mode = KernelCode(args.code), WeightDecayCode(args.weight_decay_mode)
    if code == KernelCode.SGD:
        weight.index_add_(0, rows, grad, alpha=-lr)
    elif code == KernelCode.ADAGRAD:
        w = weight.index_select(0, rows)
        h = states["momentum1"].index_select(0, rows).addcmul_(grad, grad)
        states["momentum1"].index_copy_(0, rows, h)
        w.addcdiv_(grad, h.sqrt_().add_(args.eps), value=-lr)
        weight.index_copy_(0, rows, w)
    elif code == KernelCode.ROWWISE_ADAGRAD:
        w = weight.index_select(0, rows)
        g = grad + args.weight_decay * w if mode == WeightDecayCode.L2 else grad
        h = states["momentum1"].index_select(0, rows).add_((g * g).mean(dim=1, keepdim=True))
        states["momentum1"].index_copy_(0, rows, h)
        multiplier = lr / (h.sqrt() + args.eps)
        if mode == WeightDecayCode.DECOUPLED:
            w.mul_(1.0 - lr * args.weight_decay)
        w.sub_(multiplier * g)
        weight.index_copy_(0, rows, w)
    elif code == KernelCode.ADAM:
        w = weight.index_select(0, rows)
        b1, b2 = args.beta1, args.beta2
        m = states["momentum1"].index_select(0, rows).mul_(b1).add_(grad, alpha=1.0 - b1)
        v = states["momentum2"].index_select(0, rows).mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
        states["momentum1"].index_copy_(0, rows, m)
        states["momentum2"].index_copy_(0, rows, v)
        update = (m / args.bias1) / ((v / args.bias2).sqrt() + args.eps)
        if mode == WeightDecayCode.DECOUPLED:
            update.add_(w, alpha=args.weight_decay)
        w.sub_(update, alpha=lr)
        weight.index_copy_(0, rows, w)
    else:  # a code added to KernelCode without its case here
        raise NotImplementedError(f"update_rows has no case for kernel code {code!r}")


def native_update_of(kernel: Callable[[Any, int], KernelArgs]) -> Callable[..., None]:
    """The native update (``OptimizerDef.native_update``) of an optimizer whose kernel arguments
    ``kernel(spec, step)`` gives: :func:`update_rows` of those arguments."""

    def native_update(spec, *, lr, step, weight, states, rows, grad) -> None:
        update_rows(kernel(spec, step), lr=lr, weight=weight, states=states, rows=rows, grad=grad)

    return native_update
