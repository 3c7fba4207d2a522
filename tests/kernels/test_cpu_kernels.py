"""The CPU extension equals the plain-torch code it replaces, bit for bit."""

import pytest
import torch

from dynarec.embedding.hash_index import BucketedHashIndex, candidate_buckets, candidate_buckets_reference
from dynarec.embedding.initializers import Initializer, _uniform01, uniform01_reference
from dynarec.kernels import cpu
from tests.kernels import gpu_checks
from tests.matrix import needs_cpu_kernels

pytestmark = needs_cpu_kernels

EXTREMES = torch.tensor([-(2**63), -1, 0, 1, 2**63 - 1, 2**40, -(2**40)])


def random_keys(n, seed):
    return torch.cat(
        [EXTREMES, torch.randint(-(2**63), 2**63 - 1, (n,), generator=torch.Generator().manual_seed(seed))]
    )


@pytest.mark.parametrize("num_buckets", [1, 3, 1 << 20])
def test_candidate_buckets(num_buckets):
    keys = random_keys(10_000, num_buckets)
    for a, b in zip(candidate_buckets(keys, num_buckets), candidate_buckets_reference(keys, num_buckets)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("num_buckets, bucket_size", [(1, 4), (64, 16), (4096, 8)])
def test_find(num_buckets, bucket_size):
    index = BucketedHashIndex(num_buckets, bucket_size)
    keys = torch.unique(random_keys(int(0.8 * index.capacity), 7))
    plan = index.plan_insert(keys, allow_evict=False)
    index.commit(plan, torch.zeros_like(keys))
    index.remove(plan.slots[plan.slots >= 0][::3])  # freed slots keep their stale keys
    query = torch.cat([keys, random_keys(1000, 8), keys[:50]])
    found = index.find(query)
    assert torch.equal(found, index.find_reference(query))
    assert int((found >= 0).sum()) > 0 and int((found < 0).sum()) > 0


@pytest.mark.parametrize("dim", [1, 7, 64])
def test_uniform01_and_every_initializer(dim):
    keys = random_keys(3000, dim)
    assert torch.equal(_uniform01(keys, dim, 12345, 1), uniform01_reference(keys, dim, 12345, 1))
    assert cpu.available()


def test_initializers_equal_their_reference(monkeypatch):
    keys = random_keys(2000, 3)
    fast = {kind: Initializer(kind).values(keys, 16, 99, 0.05) for kind in ("uniform", "normal", "truncated_normal")}
    monkeypatch.setattr(cpu, "ops", lambda: None)  # the plain-torch path
    for kind, values in fast.items():
        assert torch.equal(values, Initializer(kind).values(keys, 16, 99, 0.05)), kind


@pytest.mark.parametrize("spec", gpu_checks.SPECS, ids=repr)
@pytest.mark.parametrize("weighted", [True, False])
def test_fused_bag_update_equals_torch_aggregation_and_native_update(spec, weighted):
    gpu_checks.check_update("cpu", spec, weighted=weighted, update=cpu.bag_update)
    gpu_checks.check_update("cpu", spec, dim=5, weighted=weighted, update=cpu.bag_update)
