"""How the hash index hashes a key: its two candidate buckets and its tag, both from ``mix64``
(``dynarec.embedding.initializers``, the hash of the key-seeded initializer too).

A key has two candidate buckets, from the low and the high 32 bits of ``mix64(key)``, each modulo
the bucket count (they may coincide); sharding uses other hash bits. Its tag is the top byte of
``mix64(key)``, 1 where that byte is 0: 0 marks an empty slot. For up to 2^24 buckets (a power of
two) the tag bits are independent of the buckets.

Each function has twins in the device kernels (Triton: ``kernels.gpu.hashing``, C++:
``kernels.cpu``), used where they run; the ``*_reference`` functions are plain torch, on any
device, and the tests hold the twins to them.
"""

from __future__ import annotations

import torch

from dynarec.embedding.initializers import mix64
from dynarec.kernels import cpu as cpu_kernels
from dynarec.kernels import gpu as gpu_kernels
from dynarec.kernels.gpu import hashing as gpu_hashing

__all__ = ["EMPTY_TAG", "NO_SLOT", "candidate_buckets", "candidate_buckets_reference", "key_tags"]

NO_SLOT = gpu_hashing.NO_SLOT  # a key's slot where it has none (absent, or left out of a plan)
EMPTY_TAG = gpu_hashing.EMPTY_TAG  # the tag of an empty slot
_LOW32 = (1 << 32) - 1


def candidate_buckets(keys: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two candidate buckets of each key, ``[n]`` int64 each (the kernels of ``keys``'
    device where it has them)."""
    if gpu_kernels.available(keys.device):
        return gpu_hashing.candidate_buckets(keys, num_buckets)
    kernels = cpu_kernels.ops() if keys.device.type == "cpu" else None
    if kernels is not None:
        b1, b2 = kernels.candidate_buckets(keys.contiguous(), num_buckets)
        return b1, b2
    return candidate_buckets_reference(keys, num_buckets)


def candidate_buckets_reference(keys: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`candidate_buckets` (any device)."""
    h = mix64(keys)
    return (h & _LOW32) % num_buckets, ((h >> 32) & _LOW32) % num_buckets


def key_tags(keys: torch.Tensor) -> torch.Tensor:
    """The tag of each key, ``[n]`` uint8 (never :data:`EMPTY_TAG`)."""
    tag = (mix64(keys) >> 56) & 0xFF
    return torch.where(tag == EMPTY_TAG, 1, tag).to(torch.uint8)
