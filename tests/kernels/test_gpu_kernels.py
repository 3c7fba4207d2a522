"""The Triton kernels against the plain-torch code on a CUDA device (skipped elsewhere)."""

import pytest

from tests.kernels import gpu_checks
from tests.matrix import needs_cuda

pytestmark = [needs_cuda, pytest.mark.skipif(not gpu_checks.gpu.HAVE_TRITON, reason="Triton is not installed")]


@pytest.mark.parametrize("num_buckets, bucket_size", [(3, 4), (64, 16), (1 << 16, 16)])
def test_find(num_buckets, bucket_size):
    gpu_checks.check_find("cuda", num_buckets, bucket_size)


@pytest.mark.parametrize("dim", [5, 8, 128])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("max_len", [6, 60])
def test_pooled_forward(dim, weighted, max_len):
    gpu_checks.check_pooled("cuda", dim=dim, weighted=weighted, max_len=max_len)


@pytest.mark.parametrize("spec", gpu_checks.SPECS, ids=repr)
@pytest.mark.parametrize("dim", [5, 8, 128])
@pytest.mark.parametrize("weighted", [True, False])
def test_fused_update(spec, dim, weighted):
    gpu_checks.check_update("cuda", spec, dim=dim, weighted=weighted)


@pytest.mark.parametrize("spec", gpu_checks.SPECS, ids=repr)
@pytest.mark.parametrize("chunk", [1, 4, 32])
@pytest.mark.parametrize("weighted", [True, False])
def test_fused_update_of_hot_rows_in_chunks(spec, chunk, weighted):
    gpu_checks.check_update("cuda", spec, dim=128, weighted=weighted, max_len=60, chunk=chunk)


@pytest.mark.parametrize("spec", gpu_checks.SPECS, ids=repr)
@pytest.mark.parametrize("dim, tile_rows", [(128, 1), (128, 16), (5, 2), (64, 8)])
def test_fused_update_any_tile_height(spec, dim, tile_rows):
    """Rows per cold program is a tuning knob: every height gives the reference's result."""
    gpu_checks.check_update("cuda", spec, dim=dim, max_len=20, chunk=8, tile_rows=tile_rows)
