"""String ids to int64 keys: FarmHash Fingerprint64 (dynarec's default) or MurmurHash2
(libstdc++'s ``std::hash<std::string>``, TorchEasyRec's default: ``hash_function: murmur2``).

FarmHash Fingerprint64 is the hash TensorFlow's ``tf.strings.to_hash_bucket_fast`` uses, so keys
match what TensorFlow/EasyRec pipelines produced: ``to_hash_bucket_fast(s, n) == fingerprint64(s) %
n``. ``std::hash`` on 64-bit libstdc++ is ``_Hash_bytes(s, len, 0xc70f6907)``, a 64-bit MurmurHash2
variant: what TorchEasyRec's feature generation (pyfg) buckets ``hash_bucket_size`` features with
unless ``USE_FARM_HASH_TO_BUCKETIZE`` is set. Dynamic tables take ``hash(s) % 2**62``; fixed tables
``hash(s) % num_buckets``.

A string column is hashed in C++ by the feature-generation extension (``dynarec.features.native``)
where it is built; the ``*_reference`` functions (pyarrow + pyfarmhash, and a Python MurmurHash2)
are the fallback and the reference the tests hold it to.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Union

import farmhash
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dynarec.features import native

__all__ = [
    "DYNAMIC_KEY_BUCKETS",
    "HASH_FUNCTIONS",
    "HashFunction",
    "fingerprint64",
    "hash_buckets",
    "hash_buckets_reference",
    "murmur2_64",
    "to_hash_bucket_fast",
    "to_hash_bucket_fast_reference",
]

DYNAMIC_KEY_BUCKETS = 2**62

HashFunction = Literal["farmhash", "murmur2"]
HASH_FUNCTIONS: tuple[HashFunction, ...] = ("farmhash", "murmur2")

_MASK = (1 << 64) - 1
_MUL = 0xC6A4A7935BD1E995
_SEED = 0xC70F6907


def fingerprint64(s: str | bytes) -> int:
    """FarmHash Fingerprint64 of the UTF-8 bytes of ``s``, as an unsigned Python int."""
    return farmhash.fingerprint64(s)


def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)


def murmur2_64(s: str | bytes) -> int:
    """``std::hash<std::string>`` of the UTF-8 bytes of ``s`` on 64-bit libstdc++ (x86-64,
    aarch64), as an unsigned Python int: ``_Hash_bytes(s, len, 0xc70f6907)`` of
    libstdc++-v3/libsupc++/hash_bytes.cc, words and tail read little-endian."""
    b = s.encode() if isinstance(s, str) else bytes(s)
    n = len(b)
    aligned = n & ~7
    h = (_SEED ^ (n * _MUL)) & _MASK
    for i in range(0, aligned, 8):
        w = int.from_bytes(b[i : i + 8], "little")
        h ^= (_shift_mix((w * _MUL) & _MASK) * _MUL) & _MASK
        h = (h * _MUL) & _MASK
    if n & 7:
        h ^= int.from_bytes(b[aligned:], "little")
        h = (h * _MUL) & _MASK
    h = (_shift_mix(h) * _MUL) & _MASK
    return _shift_mix(h)


_HASH = {"farmhash": fingerprint64, "murmur2": murmur2_64}


def _as_strings(strings: Union[Iterable[str], pa.Array]) -> pa.Array:
    return strings if isinstance(strings, pa.Array) else pa.array(list(strings), pa.string())


def hash_buckets(
    strings: Union[Iterable[str], pa.Array], num_buckets: int, hash_function: HashFunction = "farmhash"
) -> np.ndarray:
    """``hash(s) % num_buckets`` of every string as an int64 array (``0 < num_buckets < 2**63``):
    in C++ where the extension is built (a string array without nulls), else
    :func:`hash_buckets_reference`; the values are the same."""
    strings = _as_strings(strings)
    hashed = native.hash_strings(strings, num_buckets, hash_function)
    return hashed if hashed is not None else hash_buckets_reference(strings, num_buckets, hash_function)


def hash_buckets_reference(
    strings: Union[Iterable[str], pa.Array], num_buckets: int, hash_function: HashFunction = "farmhash"
) -> np.ndarray:
    """:func:`hash_buckets` with pyarrow and Python: each distinct string is hashed once (a
    pyarrow string array is dictionary-encoded in C++, and only its dictionary goes through
    Python)."""
    encoded = pc.dictionary_encode(_as_strings(strings))
    uniq = encoded.dictionary.to_pylist()
    hash_ = _HASH[hash_function]
    hashes = np.fromiter((hash_(s) % num_buckets for s in uniq), dtype=np.int64, count=len(uniq))
    return hashes[encoded.indices.to_numpy(zero_copy_only=False)]


def to_hash_bucket_fast(strings: Union[Iterable[str], pa.Array], num_buckets: int) -> np.ndarray:
    """``tf.strings.to_hash_bucket_fast(strings, num_buckets)`` as an int64 array
    (``0 < num_buckets < 2**63``): :func:`hash_buckets` with FarmHash Fingerprint64."""
    return hash_buckets(strings, num_buckets, "farmhash")


def to_hash_bucket_fast_reference(strings: Union[Iterable[str], pa.Array], num_buckets: int) -> np.ndarray:
    """:func:`to_hash_bucket_fast` with pyarrow and pyfarmhash."""
    return hash_buckets_reference(strings, num_buckets, "farmhash")
