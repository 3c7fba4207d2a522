"""The Triton kernels against the plain-torch code on a CUDA device (skipped elsewhere): the find
and candidate buckets, the insert planner's three steps (as ``plan_insert``, against the
plain-torch planner), the commit, the pooled lookup and the fused update of every optimizer."""

import pytest

from dynarec.kernels import gpu
from dynarec.kernels.gpu import _triton
from dynarec.kernels.gpu import update as gpu_update
from tests.kernels import gpu_checks
from tests.matrix import needs_cuda

pytestmark = [needs_cuda, pytest.mark.skipif(not gpu.HAVE_TRITON, reason="Triton is not installed")]


@pytest.mark.parametrize("num_buckets, bucket_size", [(1, 4), (3, 4), (5, 12), (64, 16), (1 << 16, 16)])
def test_find(num_buckets, bucket_size):
    gpu_checks.check_find("cuda", num_buckets, bucket_size)


@pytest.mark.parametrize("num_buckets", [1, 7, 1 << 20, (1 << 32) - 5])
def test_candidate_buckets(num_buckets):
    gpu_checks.check_candidate_buckets("cuda", num_buckets)


@pytest.mark.parametrize(
    "num_buckets, bucket_size, load",
    [(1, 4, 0.5), (4, 4, 0.0), (64, 16, 0.6), (64, 16, 0.95), (32, 64, 0.8), (16, 12, 0.7), (1 << 14, 16, 0.9)],
)
def test_claim_free_slots(num_buckets, bucket_size, load):
    gpu_checks.check_claim_free_slots("cuda", num_buckets, bucket_size, load)


@pytest.mark.parametrize(
    "num_buckets, bucket_size, load",
    [
        (1, 4, 0.75),
        (8, 4, 0.9),
        (256, 4, 0.5),
        (64, 8, 0.6),
        (8, 64, 0.5),
        (64, 32, 0.5),
        (64, 16, 0.6),
        (64, 16, 0.97),
        (16, 12, 1.0),
        (8, 64, 0.9),
    ],
)
def test_plan_insert(num_buckets, bucket_size, load):
    """The Triton planner (``plan_insert`` on a CUDA index) gives the plain-torch plan."""
    gpu_checks.check_plan("cuda", num_buckets, bucket_size, load)


def test_plan_of_a_few_keys():
    gpu_checks.check_plan_of_a_few_keys("cuda")


@pytest.mark.parametrize("dim", [5, 8, 128])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("max_len", [6, 60])
def test_pooled_forward(dim, weighted, max_len):
    gpu_checks.check_pooled("cuda", dim=dim, weighted=weighted, max_len=max_len)


@pytest.mark.parametrize("seed", [0, 1])
def test_place_keys(seed):
    gpu_checks.check_place_keys("cuda", seed)


KERNELS = ["run", "scan"]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("spec", gpu_checks.SPECS, ids=repr)
@pytest.mark.parametrize("dim", [5, 8, 128])
@pytest.mark.parametrize("weighted", [True, False])
def test_fused_update(spec, dim, weighted, kernel):
    gpu_checks.check_update("cuda", spec, dim=dim, weighted=weighted, kernel=kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("spec", gpu_checks.SPECS, ids=repr)
@pytest.mark.parametrize("block", [1, 4, 32])
@pytest.mark.parametrize("weighted", [True, False])
def test_fused_update_of_rows_across_blocks(spec, block, weighted, kernel):
    """Rows of ~100 occurrences: most runs cross blocks (the partial-sum path)."""
    gpu_checks.check_update("cuda", spec, dim=128, weighted=weighted, max_len=60, block=block, kernel=kernel)


@pytest.mark.parametrize(
    "kernel, dim, block",
    [
        *[("run", 128, 2), ("run", 128, 256), ("run", 5, 128), ("run", 64, 16)],
        # the scan kernel holds a block as one tile: [256, 128] floats do not fit its shared memory
        *[("scan", 128, 2), ("scan", 128, 64), ("scan", 5, 128), ("scan", 64, 16)],
    ],
)
@pytest.mark.parametrize("spec", gpu_checks.SPECS, ids=repr)
def test_fused_update_any_block_length(spec, dim, block, kernel):
    """The kernel and its block length are tuning knobs: every choice gives the reference's result."""
    gpu_checks.check_update("cuda", spec, dim=dim, max_len=20, block=block, kernel=kernel)


def test_the_update_tuning_follows_the_row_width():
    tuning = gpu_update.Tuning()
    assert [tuning.kernel_for(_triton.row_block(d)) for d in (8, 32, 33, 64, 128)] == [
        "scan",
        "scan",
        "run",
        "run",
        "run",
    ]
    assert [tuning.block_for(k, _triton.row_block(d)) for k, d in [("run", 8), ("scan", 8), ("scan", 128)]] == [
        128,
        64,
        32,
    ]
