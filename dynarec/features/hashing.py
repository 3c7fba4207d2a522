"""String ids to int64 keys with FarmHash Fingerprint64.

The hash TensorFlow's ``tf.strings.to_hash_bucket_fast`` uses, so keys match what
TensorFlow/EasyRec pipelines produced: ``to_hash_bucket_fast(s, n) == fingerprint64(s) % n``.
Dynamic tables take ``fingerprint64(s) % 2**62`` (TensorFlow's value for ``n = 2**62``); fixed
tables take ``fingerprint64(s) % num_buckets``.
"""

from __future__ import annotations

from collections.abc import Iterable

import farmhash
import numpy as np

__all__ = ["DYNAMIC_KEY_BUCKETS", "fingerprint64", "to_hash_bucket_fast"]

DYNAMIC_KEY_BUCKETS = 2**62


def fingerprint64(s: str | bytes) -> int:
    """FarmHash Fingerprint64 of the UTF-8 bytes of ``s``, as an unsigned Python int."""
    return farmhash.fingerprint64(s)


def to_hash_bucket_fast(strings: Iterable[str], num_buckets: int) -> np.ndarray:
    """``tf.strings.to_hash_bucket_fast(strings, num_buckets)`` as an int64 array.

    Each distinct string is hashed once.
    """
    strings = list(strings)
    uniq: dict[str, int] = {}
    out = np.empty(len(strings), dtype=np.int64)
    for i, s in enumerate(strings):
        v = uniq.get(s)
        if v is None:
            v = uniq[s] = fingerprint64(s) % num_buckets
        out[i] = v
    return out
