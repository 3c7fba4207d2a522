"""The CPU extension: C++ kernels for the hash index, the key-seeded initializer and the fused
bag update.

Built on first use with ``torch.utils.cpp_extension.load`` (g++, ninja) into a build directory
of its own per Python environment, torch version, source tree and compiler flags
(:func:`build_directory`, see ``dynarec._cpp_extension``); ``make setup`` builds it once. Each
kernel equals its plain-torch twin (tested): bit for bit, but for the fused update, whose sums
run in their own order. :func:`ops` returns None where the extension cannot be built (no
compiler), and the ops (``dynarec.kernels.ops``) then run their plain-torch twins.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Optional

from dynarec._cpp_extension import CppExtension
from dynarec.optim.kernel import cpp_defines

__all__ = ["available", "bag_update", "build", "build_directory", "ops"]

# -fopenmp: ATen's parallel_for runs on OpenMP threads only in code compiled with it.
# -fno-math-errno: the update's std::sqrt then vectorizes (sqrtps), where it would otherwise be a
# call that may set errno (never read here); the results are the same IEEE square roots.
# -ffp-contract=off: no multiply and add fused into one rounding (GCC's default contracts where
# the target has FMA), so each float op rounds as torch's twin does; no flag here reorders float
# arithmetic. The update's optimizer codes come from
# dynarec.optim.kernel, as -D flags.
_EXTENSION = CppExtension(
    name="dynarec_cpu_ops",
    sources=[os.path.join(os.path.dirname(__file__), "ops.cpp")],
    what="dynarec's CPU kernels",
    fallback="the dynarec ops run their plain-torch twins",
    cflags=("-O3", "-fno-math-errno", "-ffp-contract=off", "-fopenmp", *cpp_defines()),
    ldflags=("-fopenmp",),
)


@functools.cache
def ops() -> Optional[ModuleType]:
    """The compiled module, or None (the reason is logged once) where it cannot be built."""
    return _EXTENSION.load_or_none()


def build_directory() -> str:
    """Where the extension is built and cached (one directory per Python environment, torch
    version, source tree and compiler flags)."""
    return _EXTENSION.build_directory()


def build(verbose: bool = False) -> ModuleType:
    """Compiles (or loads the cached build of) the extension; raises if it cannot."""
    return _EXTENSION.build(verbose)


def available() -> bool:
    return ops() is not None


def bag_update(
    args,
    *,
    lr: float,
    weight,
    states,
    rows,
    offsets,
    per_sample_weights,
    grad_out,
    scores=None,
    score: int = 0,
    row_keys=None,
    key_offset: int = 0,
    rounding_base: int = 0,
) -> None:
    """The fused backward + update of weighted-sum bags (the ``dynarec::bag_update`` op) in C++;
    ``args``: the optimizer's ``KernelArgs``; ``scores`` (``[num_rows]`` int64, optional):
    ``scores[row] = score`` for each updated row. A ``weight`` of bfloat16 or float16 is updated
    in float32 and stored by stochastic rounding, each row's draws keyed by ``row_keys[row]``
    (or ``row + key_offset``) from ``rounding_base`` (:mod:`dynarec.optim.rounding`)."""
    kernels = ops()
    assert kernels is not None
    empty = weight.new_empty(0)
    negative = kernels.fused_bag_update(
        weight,
        states.get("momentum1", empty),
        states.get("momentum2", empty),
        grad_out.contiguous(),
        rows.contiguous(),
        offsets.contiguous(),
        per_sample_weights,
        int(args.code),
        int(args.weight_decay_mode),
        float(lr),
        args.eps,
        args.weight_decay,
        args.beta1,
        args.beta2,
        args.bias1,
        args.bias2,
        scores,
        int(score),
        None if row_keys is None else row_keys.contiguous(),
        int(key_offset),
        int(rounding_base),
    )
    if negative == -2:
        raise NotImplementedError(
            f"fused_bag_update: the C++ extension has no case for kernel code {int(args.code)} with weight decay "
            f"mode {int(args.weight_decay_mode)}"
        )
    if negative >= 0:
        raise ValueError(
            f"fused_bag_update: row {int(rows[negative])} at position {negative} is negative; nothing was written"
        )
