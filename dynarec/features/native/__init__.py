"""The feature-generation C++ extension: FarmHash Fingerprint64 (or libstdc++'s ``std::hash``,
MurmurHash2: ``hash_function="murmur2"``) of string columns, the one-pass split-and-hash of
separator-joined string lists, and the one-pass split-and-parse of separator-joined int64 lists,
each reading an Arrow string column's buffers in place.

Built on first use like the embedding kernels' extension (``dynarec._cpp_extension``: one build
directory per Python environment, torch version and source tree); ``make setup`` builds it once.
Each function here returns None where the extension cannot be built (the reason is logged once)
or, inside :func:`python_path`, on purpose; callers then take the pyarrow + pyfarmhash path,
which gives the same values (tested bit for bit).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Literal, Optional

import numpy as np
import pyarrow as pa
import torch

from dynarec._cpp_extension import CppExtension

__all__ = [
    "available",
    "build",
    "build_directory",
    "edit_distance",
    "fingerprint64",
    "hash64",
    "hash_strings",
    "ops",
    "python_path",
    "split_hash",
    "split_parse_int64",
]

_EXTENSION = CppExtension(
    name="dynarec_fg_ops",
    sources=[os.path.join(os.path.dirname(__file__), "fg.cpp")],
    what="dynarec's feature-generation kernels",
    fallback="hashing and splitting with pyarrow and pyfarmhash",
)
_python_path = False

HashFunction = Literal["farmhash", "murmur2"]
_FUNCTIONS = {"farmhash": 0, "murmur2": 1}


@functools.cache
def _load() -> Optional[ModuleType]:
    return _EXTENSION.load_or_none()


def ops() -> Optional[ModuleType]:
    """The compiled module, or None where it cannot be built (the reason is logged once) and
    inside :func:`python_path`."""
    return None if _python_path else _load()


@contextlib.contextmanager
def python_path() -> Iterator[None]:
    """Within it, :func:`ops` is None: batch building and hashing take the pyarrow + pyfarmhash
    path (benchmarks time one path against the other in one process). Not thread-safe."""
    global _python_path
    before, _python_path = _python_path, True
    try:
        yield
    finally:
        _python_path = before


def build_directory() -> str:
    """Where the extension is built and cached (one directory per Python environment, torch
    version and source tree)."""
    return _EXTENSION.build_directory()


def build(verbose: bool = False) -> ModuleType:
    """Compiles (or loads the cached build of) the extension; raises if it cannot."""
    return _EXTENSION.build(verbose)


def available() -> bool:
    return ops() is not None


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _buffers(col: pa.Array) -> tuple[torch.Tensor, torch.Tensor]:
    """A string or large_string array's bytes (uint8) and its ``len(col) + 1`` offsets into them
    (int32 or int64: a slice's offsets start where the slice does), both read in place where
    its memory is writable (torch takes no read-only buffer), else copied (a file mapped
    read-only, as a loader's decoded chunks are)."""
    if not all(b is None or b.is_mutable for b in col.buffers()):
        col = pa.concat_arrays([col])  # (a copy, in fresh buffers)
    _, offsets_buffer, data_buffer = col.buffers()
    width = torch.int64 if pa.types.is_large_string(col.type) else torch.int32
    offsets = torch.frombuffer(offsets_buffer, dtype=width, count=len(col) + 1, offset=col.offset * width.itemsize)
    if data_buffer is None or data_buffer.size == 0:
        return torch.empty(0, dtype=torch.uint8), offsets
    return torch.frombuffer(data_buffer, dtype=torch.uint8), offsets


def _usable(col: pa.Array) -> Optional[ModuleType]:
    """The extension where it can read ``col``: a non-empty string array without nulls."""
    kernels = ops()
    if kernels is None or not _is_string(col.type) or col.null_count or len(col) == 0:
        return None
    return kernels


def fingerprint64(col: pa.Array) -> Optional[np.ndarray]:
    """FarmHash Fingerprint64 of every string's UTF-8 bytes: uint64 ``[len(col)]``. None where
    the extension is not used, or ``col`` is not a non-empty string array without nulls."""
    return hash64(col, "farmhash")


def hash64(col: pa.Array, hash_function: HashFunction = "farmhash") -> Optional[np.ndarray]:
    """The 64-bit hash of every string's UTF-8 bytes, uint64 ``[len(col)]``: FarmHash
    Fingerprint64, or ``std::hash<std::string>`` of 64-bit libstdc++ (``"murmur2"``). None where
    the extension is not used, or ``col`` is not a non-empty string array without nulls."""
    kernels = _usable(col)
    if kernels is None:
        return None
    return kernels.fingerprint64(*_buffers(col), _FUNCTIONS[hash_function]).numpy().view(np.uint64)


def hash_strings(col: pa.Array, num_buckets: int, hash_function: HashFunction = "farmhash") -> Optional[np.ndarray]:
    """``tf.strings.to_hash_bucket_fast(col, num_buckets)``: ``fingerprint64(s) % num_buckets``
    (``0 < num_buckets < 2**63``) of every string, int64 ``[len(col)]`` (with ``"murmur2"``:
    ``std::hash(s) % num_buckets``, TorchEasyRec's). None where the extension is not used, or
    ``col`` is not a non-empty string array without nulls."""
    kernels = _usable(col)
    if kernels is None:
        return None
    return kernels.hash_strings(*_buffers(col), num_buckets, _FUNCTIONS[hash_function]).numpy()


def split_hash(
    col: pa.Array,
    separator: str,
    num_buckets: int,
    hash_function: HashFunction = "farmhash",
    drop_empty: bool = False,
) -> Optional[tuple[np.ndarray, np.ndarray, int]]:
    """Every row of a separator-joined string column split and each token hashed as
    :func:`hash_strings` does, in one pass: ``(values int64 [tokens], lengths int64 [len(col)],
    first_bad_row)``. An empty field is an empty list; a row holding an empty token (a leading,
    doubled or trailing separator) is bad: ``first_bad_row`` is the first such row (the other two
    are then unspecified), else -1; with ``drop_empty`` empty tokens are dropped instead (no row
    is bad). Splitting takes the leftmost match and resumes after it, as
    pyarrow's ``split_pattern``. None where the extension is not used, or ``col`` is not a
    non-empty string array without nulls."""
    kernels = _usable(col)
    if kernels is None:
        return None
    values, lengths, bad = kernels.split_hash(
        *_buffers(col), separator, num_buckets, _FUNCTIONS[hash_function], drop_empty
    )
    return values.numpy(), lengths.numpy(), int(bad)


def split_parse_int64(
    col: pa.Array, separator: str, drop_empty: bool = False
) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """``(ids int64 [tokens], lengths int64 [len(col)])`` of a separator-joined decimal id column
    without nulls, split and parsed in one pass (an empty field is an empty list; with
    ``drop_empty``, so is an empty token). None where the extension is not used, ``col`` is not a
    non-empty string array, or a field needs pyarrow's path (whitespace, '+', an empty token, a
    non-digit, an int64 overflow: that path names it)."""
    kernels = _usable(col)
    if kernels is None:
        return None
    data, offsets = _buffers(col)
    ids, lengths, ok = kernels.split_parse_int64(data, offsets.to(torch.int64), separator, drop_empty)
    return (ids.numpy(), lengths.numpy()) if ok else None


def edit_distance(a: pa.Array, b: pa.Array, utf8: bool) -> Optional[np.ndarray]:
    """TorchEasyRec's EditDistance: the Levenshtein distance of ``a[i]`` and ``b[i]`` for every
    row, int64, over bytes (``utf8`` False: TorchEasyRec's ``latin``) or UTF-8 code points. None
    where the extension is not used, or a column is not a non-empty string array without nulls."""
    kernels = _usable(a)
    if kernels is None or _usable(b) is None or len(a) != len(b):
        return None
    return kernels.edit_distance(*_buffers(a), *_buffers(b), utf8).numpy()
