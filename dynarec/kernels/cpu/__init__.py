"""The CPU extension: C++ kernels for the hash index and the key-seeded initializer.

Built on first use with ``torch.utils.cpp_extension.load`` (g++, ninja) and cached by torch
under its extensions directory, keyed by the source's hash; ``make setup`` builds it once. Each
kernel equals its plain-torch twin bit for bit (tested); :func:`ops` returns None where the
extension cannot be built (no compiler), and callers then run the plain-torch code.
"""

from __future__ import annotations

import functools
import logging
import os
from types import ModuleType
from typing import Optional

__all__ = ["available", "build", "ops"]

_SOURCES = [os.path.join(os.path.dirname(__file__), "hash_ops.cpp")]
_log = logging.getLogger(__name__)


@functools.cache
def ops() -> Optional[ModuleType]:
    """The compiled module, or None (the reason is logged once) where it cannot be built."""
    try:
        return build()
    except Exception as e:
        _log.warning("dynarec's CPU kernels are unavailable (%s); using the plain-torch path", e)
        return None


def build(verbose: bool = False) -> ModuleType:
    """Compiles (or loads the cached build of) the extension; raises if it cannot."""
    from torch.utils.cpp_extension import load

    # -fopenmp: ATen's parallel_for runs on OpenMP threads only in code compiled with it.
    return load(
        name="dynarec_cpu_ops",
        sources=_SOURCES,
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        verbose=verbose,
    )


def available() -> bool:
    return ops() is not None
