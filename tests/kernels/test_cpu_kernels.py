"""The CPU extension equals the plain-torch code it replaces, bit for bit."""

import pytest
import torch

from dynarec.embedding.hash_index import BucketedHashIndex
from dynarec.embedding.initializers import Initializer
from dynarec.embedding.key_hash import candidate_buckets
from dynarec.kernels import cpu, reference
from dynarec.optim.fused import bag_gradients, fused_row_update
from dynarec.optim.kernel import KernelArgs
from dynarec.optim.registry import definition
from tests.kernels import gpu_checks
from tests.matrix import needs_cpu_kernels

pytestmark = needs_cpu_kernels

EXTREMES = torch.tensor([-(2**63), -1, 0, 1, 2**63 - 1, 2**40, -(2**40)])


def random_keys(n, seed):
    return torch.cat(
        [EXTREMES, torch.randint(-(2**63), 2**63 - 1, (n,), generator=torch.Generator().manual_seed(seed))]
    )


@pytest.mark.parametrize("num_buckets", [1, 3, 1 << 20, (1 << 33) + 5])
def test_candidate_buckets(num_buckets):
    keys = random_keys(10_000, num_buckets)
    for a, b in zip(candidate_buckets(keys, num_buckets), reference.candidate_buckets(keys, num_buckets)):
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
    assert torch.equal(found, gpu_checks.find_reference(index, query))
    assert int((found >= 0).sum()) > 0 and int((found < 0).sum()) > 0
    for q in (query, keys[:50]):  # some absent, none absent
        slots, absent = index.find_flagged(q)
        assert torch.equal(slots, gpu_checks.find_reference(index, q))
        assert absent.shape == () and absent.dtype == torch.int32 and bool(absent) == bool((slots < 0).any())


@pytest.mark.parametrize("seed", [0, 1])
def test_a_partitioned_index_finds_and_plans_each_partition_as_an_index_alone(seed):
    gpu_checks.check_partitioned("cpu", seed=seed)


@pytest.mark.parametrize("dim", [1, 7, 64])
def test_uniform01_and_every_initializer(dim):
    keys = random_keys(3000, dim)
    got = torch.ops.dynarec.uniform01(keys, dim, 12345, 1)
    assert torch.equal(got, reference.uniform01(keys, dim, 12345, 1))
    assert cpu.available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("dim", [1, 7, 64, 67])  # (67: whole vectors of 8 and a tail)
def test_uniform_rows_equal_the_initializers_values_rounded_to_the_row_dtype(dtype, dim):
    """The uniform initializer written in place: the values of its plain-torch draw (float64 ops,
    float32, then the rows' dtype to nearest), rows of a record layout too (a row stride past the
    dim); rows not given stay as they were."""
    keys = random_keys(2000, dim)
    rows = torch.randperm(3 * keys.numel(), generator=torch.Generator().manual_seed(dim))[: keys.numel()]
    records = torch.randn(3 * keys.numel(), dim + 3).to(dtype)
    out, before = records[:, 1 : dim + 1], records.clone()
    torch.ops.dynarec.uniform_rows(out, rows, keys, 99, 0, 0.05)
    want = Initializer("uniform", bound=0.05).values(keys, dim, 99, 0.0).to(dtype)
    assert torch.equal(out[rows], want)
    untouched = torch.ones(records.shape[0], dtype=torch.bool).index_fill_(0, rows, False)
    assert torch.equal(records[untouched], before[untouched])
    assert torch.equal(records[:, 0], before[:, 0]) and torch.equal(records[:, dim + 1 :], before[:, dim + 1 :])


def test_uniform_rows_and_fill_rows_refuse_a_row_out_of_range_and_write_nothing():
    out = torch.zeros(4, 3)
    with pytest.raises(IndexError, match=r"uniform_rows: row 4 at position 1 is outside \[0, 4\)"):
        torch.ops.dynarec.uniform_rows(out, torch.tensor([0, 4]), torch.tensor([1, 2]), 0, 0, 1.0)
    with pytest.raises(IndexError, match=r"fill_rows: row -1 at position 0 is outside \[0, 4\)"):
        torch.ops.dynarec.fill_rows(out, torch.tensor([-1, 2]), 1.0)
    assert not out.any()


def test_fill_rows_equals_index_fill():
    g = torch.Generator().manual_seed(5)
    t = torch.randn(1000, 9, generator=g)
    rows = torch.randint(0, 1000, (3000,), generator=g)  # duplicates
    want = t.clone().index_fill_(0, rows, 0.1)
    torch.ops.dynarec.fill_rows(t, rows, 0.1)
    assert torch.equal(t, want)


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


@pytest.mark.parametrize("spec", gpu_checks.kernel_specs(), ids=repr)
def test_every_registered_optimizer_with_kernels_runs_in_the_cpp_update_as_its_reference(spec):
    gpu_checks.check_registered_kernel("cpu", spec, cpu.bag_update)


@pytest.mark.parametrize("keyed", [True, False], ids=["dynamic", "fixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("spec", gpu_checks.kernel_specs(), ids=repr)
def test_half_precision_rows_are_updated_and_rounded_as_the_torch_path_rounds_them(spec, dtype, keyed):
    """The C++ update of bf16 / fp16 rows: the torch path's fp32 update stored by the same keyed
    stochastic rounding (bit for bit where the float32 arithmetic is, SGD)."""
    gpu_checks.check_half_update("cpu", spec, dtype, keyed, update=cpu.bag_update, max_len=60)


@pytest.mark.parametrize("dim", [8, 4, 72, 136])  # vectors of 8 (64 columns a pass), or the plain loop (4)
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_pooled_reads_half_precision_rows_in_float32(dtype, weighted, dim):
    """The C++ pooled lookup of bf16 / fp16 rows is the float32 sum of their values, each bag's
    ids in order, a multiply then an add (bit for bit), and equals ``F.embedding_bag`` over them
    (empty bags and repeated rows included)."""
    rows, offsets, psw = gpu_checks.random_bags("cpu", bags=40, dim=dim, max_len=6)
    offsets[5] = offsets[4]  # an empty bag
    rows, offsets = rows.contiguous(), offsets.contiguous()
    weight = torch.randn(50, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    psw = psw if weighted else None
    got = torch.ops.dynarec.pooled(weight, rows, offsets, psw)
    assert got.dtype == torch.float32
    for b in range(offsets.numel() - 1):
        want = torch.zeros(dim)
        for i in range(int(offsets[b]), int(offsets[b + 1])):
            want = want + (1.0 if psw is None else psw[i]) * weight[rows[i]].float()
        assert torch.equal(got[b], want), b
    bags = torch.nn.functional.embedding_bag(
        rows, weight.float(), offsets, mode="sum", per_sample_weights=psw, include_last_offset=True
    )
    torch.testing.assert_close(got, bags, rtol=1e-6, atol=1e-6)


def test_half_precision_rounding_of_special_values_matches_the_torch_rounding():
    """Zeros, subnormals, the largest finite values and beyond (saturated), infinities and NaN:
    one SGD step of lr 0 stores each value as ``stochastic_round`` does."""
    from dynarec.optim import SGD
    from dynarec.optim.rounding import rounding_base, rounding_noise, stochastic_round

    for dtype in (torch.bfloat16, torch.float16):
        info = torch.finfo(dtype)
        values = torch.tensor(
            [0.0, -0.0, info.tiny / 4, -info.tiny / 3, info.max, -info.max, float("inf"), float("-inf"), 1.0, -1.5]
        )
        weight = values.to(dtype)[None, :].repeat(2, 1)
        args = definition(SGD(lr=0.0)).kernel(SGD(lr=0.0), 1)
        grad = torch.zeros(1, values.numel())
        rows, offsets = torch.tensor([1]), torch.tensor([0, 1])
        cpu.bag_update(args, lr=0.0, weight=weight, states={}, rows=rows, offsets=offsets, per_sample_weights=None,
                       grad_out=grad, key_offset=5, rounding_base=rounding_base(3, 1))  # fmt: skip
        noise = rounding_noise(3, 1, torch.tensor([6]), values.numel())
        want = stochastic_round(values.to(dtype).float()[None, :], dtype, noise)
        assert torch.equal(weight[1].view(torch.int16), want[0].view(torch.int16)), dtype
        assert torch.equal(weight[0], values.to(dtype))  # an untouched row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_rounding_of_any_float32_matches_the_torch_rounding(dtype):
    """Every float32 a row's update may leave, stored as ``stochastic_round`` stores it, bit for
    bit: random bit patterns over every exponent (normal and subnormal in float32 and in the
    storage type), both neighbours of the storage type's largest finite value and of its
    smallest normal, values past its range (saturated), infinities and NaN. An SGD step of lr 1
    from zero rows with gradient -x leaves exactly x to round."""
    from dynarec.optim import SGD
    from dynarec.optim.rounding import rounding_base, rounding_noise, stochastic_round

    gen = torch.Generator().manual_seed(11)
    info = torch.finfo(dtype)
    edges = torch.tensor([info.max, info.tiny, info.tiny * 2**-5, 65504.0, 65519.0, 65520.0, 3.4e38])
    edges = torch.cat([edges, torch.nextafter(edges, torch.zeros(())), torch.nextafter(edges, torch.ones(()) * 4e38)])
    # every float32 exponent around fp16's normal range (112-113, 142-143) and bf16's top (254),
    # with mantissas empty, full, full in the bits a half keeps, and a few random ones
    exponents = torch.tensor([1, 111, 112, 113, 114, 141, 142, 143, 144, 253, 254], dtype=torch.int32)
    mantissas = torch.tensor([0, 0x7FFFFF, 0x7FE000, 0x7FFF0000 >> 8, 0x1FFF, 1], dtype=torch.int32)
    mantissas = torch.cat([mantissas, torch.randint(0, 1 << 23, (8,), generator=gen, dtype=torch.int32)])
    patterns = (exponents[:, None] << 23 | mantissas[None, :]).flatten()
    edges = torch.cat([edges, patterns.view(torch.float32)])
    bits = torch.randint(-(2**31), 2**31, (60_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    small = (torch.rand(20_000, generator=gen) - 0.5) * 2.0 ** torch.randint(-30, 17, (20_000,), generator=gen).float()
    x = torch.cat(
        [
            edges,
            -edges,
            bits.view(torch.float32),
            small,
            torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")]),
        ]
    )
    weight = torch.zeros(2, x.numel(), dtype=dtype)
    spec = SGD(lr=1.0)
    cpu.bag_update(definition(spec).kernel(spec, 1), lr=1.0, weight=weight, states={}, rows=torch.tensor([1]),
                   offsets=torch.tensor([0, 1]), per_sample_weights=None, grad_out=-x[None, :], key_offset=5,
                   rounding_base=rounding_base(3, 1))  # fmt: skip
    noise = rounding_noise(3, 1, torch.tensor([6]), x.numel())
    want = stochastic_round((0.0 - (-x))[None, :], dtype, noise)[0]  # (-0.0 leaves +0.0)
    got = weight[1]
    nan = torch.isnan(x)
    assert torch.isnan(got[nan].float()).all()
    mismatch = torch.nonzero(got[~nan].view(torch.int16) != want[~nan].view(torch.int16)).squeeze(1)
    assert mismatch.numel() == 0, x[~nan][mismatch[:5]].tolist()


def test_the_cpp_update_refuses_a_code_it_has_no_case_for_and_writes_nothing():
    weight, rows, offsets = torch.ones(4, 2), torch.tensor([0, 1]), torch.tensor([0, 2])
    for args in (KernelArgs(code=99), KernelArgs(code=0, weight_decay_mode=7)):  # type: ignore[arg-type]
        with pytest.raises(NotImplementedError, match="the C\\+\\+ extension has no case for kernel code"):
            cpu.bag_update(args, lr=0.1, weight=weight, states={}, rows=rows, offsets=offsets,
                           per_sample_weights=None, grad_out=torch.ones(1, 2))  # fmt: skip
    assert torch.equal(weight, torch.ones(4, 2))


@pytest.mark.parametrize("high", [1, 2, 2**11, 2**11 + 1, 2**22 + 5, 2**40, 2**62])
@pytest.mark.parametrize("n", [0, 1, 5000, 100_003])  # (100,003: runs of ids sorted by 3 threads)
def test_stable_sort_rows_equals_torch_stable_sort(high, n):
    g = torch.Generator().manual_seed(n + high % 1000)
    distinct = torch.randint(0, high, (max(1, n // 3),), generator=g)
    rows = distinct[torch.randint(0, distinct.numel(), (n,), generator=g)]  # each row ~3 times
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # (whatever the machine's cores)
    try:
        got_sorted, got_order = cpu.ops().stable_sort_rows(rows)
    finally:
        torch.set_num_threads(threads)
    want_sorted, want_order = torch.sort(rows, stable=True)
    assert torch.equal(got_sorted, want_sorted) and torch.equal(got_order, want_order)


def test_fused_bag_update_refuses_a_negative_row_and_writes_nothing():
    spec = gpu_checks.SPECS[1]
    weight = torch.ones(4, 2)
    states = {"momentum1": torch.zeros(4, 2)}
    with pytest.raises(ValueError, match="row -3 at position 1 is negative; nothing was written"):
        cpu.bag_update(definition(spec).kernel(spec, 1), lr=0.1, weight=weight, states=states,
                       rows=torch.tensor([0, -3]), offsets=torch.tensor([0, 2]), per_sample_weights=None,
                       grad_out=torch.ones(1, 2))  # fmt: skip
    assert torch.equal(weight, torch.ones(4, 2)) and torch.equal(states["momentum1"], torch.zeros(4, 2))
    assert cpu.ops().stable_sort_rows(torch.tensor([2, -1])) == []


@pytest.mark.parametrize("num_rows", [1, 70_000, 3_000_000])
def test_fused_bag_update_over_any_row_range(num_rows):
    """Rows over 1 to 22 bits (one to two radix passes): torch aggregation + the native update
    (check_update's tolerance: the kernel rounds the optimizer's formula in its own order)."""
    spec = gpu_checks.SPECS[1]
    g = torch.Generator().manual_seed(num_rows)
    distinct = torch.randint(0, num_rows, (300,), generator=g)
    rows = distinct[torch.randint(0, 300, (2000,), generator=g)]
    offsets = torch.arange(0, 2001, 4)
    grad_out = torch.randn(500, 3, generator=g)
    weight = torch.randn(num_rows, 3, generator=g)
    states = {s.name: torch.full((num_rows, s.width(3)), s.initial_value) for s in spec.state_specs()}
    w_ref, states_ref = weight.clone(), {k: v.clone() for k, v in states.items()}
    w_before = weight.clone()
    args = definition(spec).kernel(spec, 1)
    cpu.bag_update(args, lr=spec.lr, weight=weight, states=states, rows=rows, offsets=offsets,
                   per_sample_weights=None, grad_out=grad_out)  # fmt: skip
    per_id = bag_gradients(grad_out, offsets, None, rows.numel())
    unique, inverse = torch.unique(rows, return_inverse=True)
    agg = per_id.new_zeros(unique.numel(), 3).index_add_(0, inverse, per_id)
    fused_row_update(spec, lr=spec.lr, step=1, weight=w_ref, states=states_ref, rows=unique, grad=agg)
    assert not torch.equal(weight, w_before)  # the update ran
    torch.testing.assert_close(weight, w_ref, rtol=1e-5, atol=1e-6)
    for k in states:
        torch.testing.assert_close(states[k], states_ref[k], rtol=1e-5, atol=1e-6)


def test_fill_at_equals_scatter_and_refuses_a_slot_out_of_range():
    g = torch.Generator().manual_seed(3)
    t = torch.randint(0, 100, (1000,), generator=g)
    slots = torch.randint(0, 1000, (5000,), generator=g)  # duplicates
    want = t.clone().scatter_(0, slots, 2**40)
    assert cpu.ops().fill_at(t, slots, 2**40) == -1
    assert torch.equal(t, want)
    index = BucketedHashIndex(4, 4, "cpu")
    with pytest.raises(IndexError, match=r"fill_at: index 16 at position 1 is outside \[0, 16\)"):
        index.touch(torch.tensor([3, 16]), 7)
    assert not index.scores.any()  # refused whole: nothing written


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_fill_slots_equals_its_twin_and_refuses_a_slot_out_of_range(dtype):
    g = torch.Generator().manual_seed(4)
    t = torch.randint(-1, 100, (1001,), generator=g).to(dtype)  # 1,000 slots and the spare
    slots = torch.randint(-1, 900, (50_000,), generator=g)  # duplicates and -1s
    want = t.clone()
    reference.fill_slots(want, slots, 77, 100)
    assert cpu.ops().fill_slots(t, slots, 77, 100) == -1
    assert torch.equal(t, want) and int(t[-1]) == 77  # the -1s wrote the spare
    before = t.clone()
    with pytest.raises(IndexError, match=r"fill_slots: slot 901 at position 1 \(\+ 100\) is outside \[0, 1000\)"):
        torch.ops.dynarec.fill_slots(t, torch.tensor([3, 901]), 5, 100)
    assert torch.equal(t, before)  # refused whole: nothing written


@pytest.mark.parametrize("n, absent_share", [(100_000, 0.05), (5_000, 1.0), (3_000, 0.0)])
def test_absent_keys_equals_its_twin(n, absent_share):
    g = torch.Generator().manual_seed(5)
    keys = torch.cat([EXTREMES, torch.randint(-(2**63), 2**63 - 1, (n,), generator=g)])
    keys = keys[torch.randint(0, keys.numel(), (n,), generator=g)]  # repeated keys, the extremes among them
    slots = torch.randint(0, 1 << 20, (n,), generator=g)
    slots[torch.rand(n, generator=g) < absent_share] = -1
    got, want = cpu.ops().absent_keys(keys, slots), reference.absent_keys(keys, slots)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if absent_share:
        assert got[1].numel() < got[0].numel()  # keys repeat among the absent


def test_follow_moves_equals_its_twin():
    g = torch.Generator().manual_seed(6)
    capacity = 1 << 20
    moved_from = torch.randperm(capacity - 2, generator=g)[:3_000] + 1  # distinct sources
    moved_from[:2] = torch.tensor([0, capacity - 1])  # the bitmap's two ends
    moved_to = torch.randint(0, capacity, (3_000,), generator=g)
    slots = torch.cat(
        [
            moved_from[torch.randint(0, 3_000, (20_000,), generator=g)],
            torch.randint(-1, capacity, (80_000,), generator=g),
        ]
    )
    slots = slots[torch.randperm(slots.numel(), generator=g)]
    got = cpu.ops().follow_moves(slots, moved_from, moved_to)
    assert torch.equal(got, reference.follow_moves(slots, moved_from, moved_to))
    assert int((got != slots).sum()) >= 19_000  # the moved sources followed (a few moved onto themselves)


def test_place_keys_refuses_a_slot_out_of_range():
    index = BucketedHashIndex(4, 4, "cpu")
    new = torch.tensor([5, 9])
    with pytest.raises(IndexError, match=r"place_keys: slot 16 at position 1 is outside \[0, 16\)"):
        torch.ops.dynarec.place_keys(index.keys, index.scores, index.tags, torch.tensor([3, 16]), new, new)
    assert not index.keys.any() and not index.tags.any()  # refused whole: nothing written
    # scores of another integer dtype are taken as the twin takes them
    torch.ops.dynarec.place_keys(index.keys, index.scores, index.tags, torch.tensor([3, 7]), new, new.int())
    assert index.keys[[3, 7]].tolist() == [5, 9] and index.scores[[3, 7]].tolist() == [5, 9]


def test_the_extension_is_built_in_a_directory_of_this_environment_and_source_tree(monkeypatch):
    """Two virtual environments (or checkouts) never share a build directory: each would rebuild
    the other's files (their build files name different paths)."""
    here = cpu.build_directory()
    assert cpu.ops().__file__.startswith(here + "/")
    assert cpu.build_directory() == here
    monkeypatch.setattr("sys.prefix", "/elsewhere/.venv")
    assert cpu.build_directory() != here


def test_the_build_directory_follows_the_compiler_flags():
    """The kernel codes are -D flags: other codes are another build, never the cached one."""
    import dataclasses

    extension = cpu._EXTENSION
    assert any(f.startswith("-DDYNAREC_KERNEL_ADAM=") for f in extension.cflags)
    other = dataclasses.replace(extension, cflags=(*extension.cflags, "-DDYNAREC_KERNEL_LAMB=4"))
    assert other.build_directory() != extension.build_directory()
