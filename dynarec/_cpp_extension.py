"""How dynarec builds and caches its C++ extensions (the embedding kernels' and feature
generation's): ``torch.utils.cpp_extension.load`` (g++, ninja) into a build directory of each
extension's own per Python environment, torch version and source tree.

Torch's default (one directory per extension name) is shared by every checkout and virtual
environment of a user; their build files name different paths, so each would rebuild it over the
others' (a minute of g++), and a process starting meanwhile would wait for the build or load a
half-written one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

__all__ = ["CppExtension"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CppExtension:
    """One extension: ``name`` (the Python module's name), ``sources`` (absolute paths of its
    .cpp files), ``what`` (how a log message names it, plural: "dynarec's CPU kernels"),
    ``fallback`` (what callers do without it), and compiler and linker flags beyond torch's."""

    name: str
    sources: Sequence[str]
    what: str
    fallback: str
    cflags: Sequence[str] = ("-O3",)
    ldflags: Sequence[str] = ()

    def build_directory(self) -> str:
        """Under torch's extensions root: one directory per Python environment, torch version,
        source tree (the sources' absolute paths) and compiler and linker flags (a flag changed
        builds apart, never over a build another checkout loads)."""
        import torch
        from torch.utils.cpp_extension import get_default_build_root

        sources = [os.path.abspath(s) for s in self.sources]
        key = "|".join([sys.prefix, torch.__version__, *sources, *self.cflags, "|", *self.ldflags])
        return os.path.join(get_default_build_root(), f"{self.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")

    def build(self, verbose: bool = False) -> ModuleType:
        """Compiles (or loads the cached build of) the extension; raises if it cannot."""
        from torch.utils.cpp_extension import load

        directory = self.build_directory()
        os.makedirs(directory, exist_ok=True)
        return load(
            name=self.name,
            sources=list(self.sources),
            extra_cflags=list(self.cflags),
            extra_ldflags=list(self.ldflags),
            build_directory=directory,
            verbose=verbose,
        )

    def load_or_none(self) -> Optional[ModuleType]:
        """The compiled module, or None where it cannot be built (the reason is logged; callers
        cache the answer, so it is logged once per process)."""
        try:
            return self.build()
        except Exception as e:
            _log.warning("%s are unavailable (%s); %s", self.what, e, self.fallback)
            return None
