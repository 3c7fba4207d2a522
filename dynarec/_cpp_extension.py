"""How dynarec builds and caches its C++ extensions (the embedding kernels' and feature
generation's): ``torch.utils.cpp_extension.load`` (g++, ninja) into a build directory of each
extension's own per Python environment, torch version and source tree.

Torch's default (one directory per extension name) is shared by every checkout and virtual
environment of a user; their build files name different paths, so each would rebuild it over the
others' (a minute of g++), and a process starting meanwhile would wait for the build or load a
half-written one.

A build already in its directory and newer than every source is imported as it is, without
torch's build lock and ninja's up-to-date check (about 0.1 s a process, one process at a time):
DataLoader workers started from a fork server each load the feature-generation extension, and
eight of them would otherwise queue for most of a second before their first batch.
"""

from __future__ import annotations

import hashlib
import importlib.util
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
        import torch._appdirs  # what torch.utils.cpp_extension.get_default_build_root reads, without its imports

        root = os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions"))
        sources = [os.path.abspath(s) for s in self.sources]
        key = "|".join([sys.prefix, torch.__version__, *sources, *self.cflags, "|", *self.ldflags])
        return os.path.join(root, f"{self.name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")

    def build(self, verbose: bool = False) -> ModuleType:
        """Compiles (or loads the cached build of) the extension; raises if it cannot."""
        directory = self.build_directory()
        cached = self._up_to_date_build(directory)
        if cached is not None:
            return cached
        from torch.utils.cpp_extension import load  # imports setuptools: a tenth of a second

        os.makedirs(directory, exist_ok=True)
        return load(
            name=self.name,
            sources=list(self.sources),
            extra_cflags=list(self.cflags),
            extra_ldflags=list(self.ldflags),
            build_directory=directory,
            verbose=verbose,
        )

    def _up_to_date_build(self, directory: str) -> Optional[ModuleType]:
        """The module built in ``directory``, imported, where it is newer than every C++ file
        beside the sources (the flags and torch version are in the directory's name); else None
        (torch's ``load`` then checks and builds)."""
        path = os.path.join(directory, f"{self.name}.so")
        loaded = sys.modules.get(self.name)
        if loaded is not None and getattr(loaded, "__file__", None) == path:
            return loaded
        if loaded is not None or os.path.exists(os.path.join(directory, "lock")):
            return None  # another build of the name is loaded, or one is being built: torch's load decides
        try:
            built = os.path.getmtime(path)
            folders = {os.path.dirname(os.path.abspath(s)) for s in self.sources}
            inputs = [os.path.join(d, f) for d in folders for f in os.listdir(d) if f.endswith((".cpp", ".h", ".hpp"))]
            if any(os.path.getmtime(f) >= built for f in inputs):
                return None
            spec = importlib.util.spec_from_file_location(self.name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except (OSError, ImportError):  # none yet, or one being written: torch's load decides
            return None
        sys.modules[self.name] = module
        return module

    def load_or_none(self) -> Optional[ModuleType]:
        """The compiled module, or None where it cannot be built (the reason is logged; callers
        cache the answer, so it is logged once per process)."""
        try:
            return self.build()
        except Exception as e:
            _log.warning("%s are unavailable (%s); %s", self.what, e, self.fallback)
            return None
