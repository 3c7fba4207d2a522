"""Triton kernels whose size arguments vary from step to step compile once, on a CUDA device:
Triton specializes an int argument equal to 1 or divisible by 16 unless told not to, and a
compile in the middle of training costs about 0.3 s. Nothing here runs without CUDA (the
interpreter compiles nothing)."""

import pytest
import torch

from dynarec.kernels import gpu
from dynarec.kernels.gpu import hashing as gpu_hashing

pytestmark = [
    pytest.mark.skipif(not gpu.HAVE_TRITON, reason="Triton is not installed"),
    pytest.mark.skipif(gpu.INTERPRETED or not torch.cuda.is_available(), reason="no compiled kernels without CUDA"),
]


def test_key_counts_that_vary_from_step_to_step_compile_no_new_kernel():
    """The find, the draws and the insert planner's rounds compile once whatever the number of
    keys: Triton would compile a variant for 1 and for multiples of 16 (0.3 s each, in the middle
    of training)."""
    from dynarec.embedding.hash_index import BucketedHashIndex
    from dynarec.kernels.gpu import plan

    kernels = [gpu_hashing._find_kernel, gpu_hashing._candidate_buckets_kernel, gpu_hashing._uniform01_kernel,
               plan._choose_kernel, plan._claim_kernel, plan._mark_claimed_kernel]  # fmt: skip
    index = BucketedHashIndex(64, 16, "cuda")

    def run(n):
        keys = torch.unique(torch.randint(-(2**62), 2**62, (n,), device="cuda"))
        index.find(keys)
        gpu_hashing.candidate_buckets(keys, 64)
        gpu_hashing.uniform01(keys, 8, 3)
        index.plan_insert(keys, allow_evict=False)  # a plan writes nothing

    def compiled():
        return [len(k.device_caches[torch.cuda.current_device()][0]) for k in kernels]

    run(3)
    before = compiled()
    assert all(before)
    for n in (1, 16, 17, 32, 64, 100):
        run(n)
    assert compiled() == before
