"""How the hash index hashes a key: its two candidate buckets and its tag, both from ``mix64``
(the hash of the key-seeded initializer too).

A key has two candidate buckets, from the low and the high 32 bits of ``mix64(key)``, each modulo
the bucket count (they may coincide); sharding uses other hash bits. Its tag is the top byte of
``mix64(key)``, 1 where that byte is 0: 0 marks an empty slot. For up to 2^24 buckets (a power of
two) the tag bits are independent of the buckets.

:func:`candidate_buckets` is the ``dynarec::candidate_buckets`` op (C++ on CPUs, Triton on GPUs);
``dynarec.kernels.reference`` holds the plain-torch twins the tests hold the kernels to.
"""

from __future__ import annotations

import torch

import dynarec.kernels.ops  # noqa: F401  (registers torch.ops.dynarec)
from dynarec.kernels.layout import EMPTY_TAG, NO_SLOT
from dynarec.kernels.reference import key_tags

__all__ = ["EMPTY_TAG", "NO_SLOT", "candidate_buckets", "key_tags"]


def candidate_buckets(keys: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two candidate buckets of each key, ``[n]`` int64 each."""
    b1, b2 = torch.ops.dynarec.candidate_buckets(keys, num_buckets)
    return b1, b2
