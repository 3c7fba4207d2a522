"""String ids to int64 keys with FarmHash Fingerprint64.

The hash TensorFlow's ``tf.strings.to_hash_bucket_fast`` uses, so keys match what
TensorFlow/EasyRec pipelines produced: ``to_hash_bucket_fast(s, n) == fingerprint64(s) % n``.
Dynamic tables take ``fingerprint64(s) % 2**62`` (TensorFlow's value for ``n = 2**62``); fixed
tables take ``fingerprint64(s) % num_buckets``.

A string column is hashed in C++ by the feature-generation extension (``dynarec.features.native``)
where it is built; :func:`to_hash_bucket_fast_reference` (pyarrow + pyfarmhash) is the fallback
and the reference the tests hold it to.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Union

import farmhash
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dynarec.features import native

__all__ = ["DYNAMIC_KEY_BUCKETS", "fingerprint64", "to_hash_bucket_fast", "to_hash_bucket_fast_reference"]

DYNAMIC_KEY_BUCKETS = 2**62


def fingerprint64(s: str | bytes) -> int:
    """FarmHash Fingerprint64 of the UTF-8 bytes of ``s``, as an unsigned Python int."""
    return farmhash.fingerprint64(s)


def to_hash_bucket_fast(strings: Union[Iterable[str], pa.Array], num_buckets: int) -> np.ndarray:
    """``tf.strings.to_hash_bucket_fast(strings, num_buckets)`` as an int64 array
    (``0 < num_buckets < 2**63``): in C++ where the extension is built (a string array without
    nulls), else :func:`to_hash_bucket_fast_reference`; the values are the same."""
    if not isinstance(strings, pa.Array):
        strings = pa.array(list(strings), pa.string())
    hashed = native.hash_strings(strings, num_buckets)
    return hashed if hashed is not None else to_hash_bucket_fast_reference(strings, num_buckets)


def to_hash_bucket_fast_reference(strings: Union[Iterable[str], pa.Array], num_buckets: int) -> np.ndarray:
    """:func:`to_hash_bucket_fast` with pyarrow and pyfarmhash: each distinct string is hashed
    once (a pyarrow string array is dictionary-encoded in C++, and only its dictionary goes
    through Python)."""
    if not isinstance(strings, pa.Array):
        strings = pa.array(list(strings), pa.string())
    encoded = pc.dictionary_encode(strings)
    uniq = encoded.dictionary.to_pylist()
    hashes = np.fromiter((fingerprint64(s) % num_buckets for s in uniq), dtype=np.int64, count=len(uniq))
    return hashes[encoded.indices.to_numpy(zero_copy_only=False)]
