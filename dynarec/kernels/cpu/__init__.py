"""The CPU extension: C++ kernels for the hash index, the key-seeded initializer, the fused bag
update and the one-pass parse of separator-joined id lists (batch building).

Built on first use with ``torch.utils.cpp_extension.load`` (g++, ninja) into a build directory
of its own per Python environment, torch version and source tree (:func:`build_directory`);
``make setup`` builds it once. Each kernel equals its plain-torch twin bit for bit (tested);
:func:`ops` returns None where the extension cannot be built (no compiler), and callers then
run the plain-torch code.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from types import ModuleType
from typing import Optional

__all__ = ["available", "bag_update", "build", "build_directory", "ops"]

_SOURCES = [os.path.join(os.path.dirname(__file__), "ops.cpp")]
_log = logging.getLogger(__name__)


@functools.cache
def ops() -> Optional[ModuleType]:
    """The compiled module, or None (the reason is logged once) where it cannot be built."""
    try:
        return build()
    except Exception as e:
        _log.warning("dynarec's CPU kernels are unavailable (%s); using the plain-torch path", e)
        return None


def build_directory() -> str:
    """Where the extension is built and cached: under torch's extensions root, one directory per
    Python environment, torch version and source tree. Torch's default (one directory per
    extension name) is shared by every checkout and virtual environment of a user; their build
    files name different paths, so each would rebuild it over the others' (a minute of g++),
    and a process starting meanwhile would wait for the build or load a half-written one."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    key = "|".join([sys.prefix, torch.__version__, os.path.abspath(_SOURCES[0])])
    return os.path.join(get_default_build_root(), f"dynarec_cpu_ops-{hashlib.sha256(key.encode()).hexdigest()[:16]}")


def build(verbose: bool = False) -> ModuleType:
    """Compiles (or loads the cached build of) the extension; raises if it cannot."""
    from torch.utils.cpp_extension import load

    directory = build_directory()
    os.makedirs(directory, exist_ok=True)
    # -fopenmp: ATen's parallel_for runs on OpenMP threads only in code compiled with it.
    return load(
        name="dynarec_cpu_ops",
        sources=_SOURCES,
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=directory,
        verbose=verbose,
    )


def available() -> bool:
    return ops() is not None


def bag_update(
    args, *, lr: float, weight, states, rows, offsets, per_sample_weights, grad_out, row_scores=None
) -> None:
    """The fused backward + update of weighted-sum bags (see ``fused_bag_update``) in C++;
    ``args``: the optimizer's ``KernelArgs``; ``row_scores``: a ``RowScores`` or None."""
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
        args.code,
        args.weight_decay_mode,
        float(lr),
        args.eps,
        args.weight_decay,
        args.beta1,
        args.beta2,
        args.bias1,
        args.bias2,
        None if row_scores is None else row_scores.scores,
        0 if row_scores is None else int(row_scores.value),
    )
    if negative >= 0:
        raise ValueError(
            f"fused_bag_update: row {int(rows[negative])} at position {negative} is negative; nothing was written"
        )
