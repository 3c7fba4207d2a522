"""The Triton kernels against the plain-torch code, in one of two lanes:

- on a CUDA device, at the sizes the kernels are tuned for (skipped where there is none);
- on CPU tensors under Triton's interpreter, at small sizes, when this process imported Triton
  with ``TRITON_INTERPRET=1`` (Triton's own switch): ``test_triton_interpreter.py`` runs this
  file so, in a process of its own, wherever Triton is installed.

Each lane runs every kernel: the find and candidate buckets, the insert planner's three steps
(as ``plan_insert``, against the plain-torch planner), the commit, the pooled lookup and the
fused update of every optimizer with both block kernels and runs crossing blocks.
"""

import pytest
import torch

from dynarec.kernels import gpu
from dynarec.kernels.gpu import _triton
from dynarec.kernels.gpu import update as gpu_update
from dynarec.optim import Adam, definition
from tests.kernels import gpu_checks

INTERPRETED = gpu.INTERPRETED
DEVICE = "cpu" if INTERPRETED else "cuda"

pytestmark = [
    pytest.mark.skipif(not gpu.HAVE_TRITON, reason="Triton is not installed"),
    pytest.mark.skipif(
        not (INTERPRETED or torch.cuda.is_available()),
        reason="no CUDA device (test_triton_interpreter.py runs these on CPU tensors under Triton's interpreter)",
    ),
]


def lane(cuda, interpreted):
    """The parameters of this process's lane."""
    return interpreted if INTERPRETED else cuda


@pytest.mark.parametrize(
    "num_buckets, bucket_size",
    lane([(1, 4), (3, 4), (5, 12), (64, 16), (1 << 16, 16)], [(1, 4), (3, 4), (5, 12), (64, 16)]),
)
def test_find(num_buckets, bucket_size):
    gpu_checks.check_find(DEVICE, num_buckets, bucket_size)


@pytest.mark.parametrize("num_buckets", [1, 7, 1 << 20, (1 << 32) - 5])
def test_candidate_buckets(num_buckets):
    gpu_checks.check_candidate_buckets(DEVICE, num_buckets)


@pytest.mark.parametrize("dim", [1, 16, 33, 128, 200, 1500])
def test_uniform01(dim):
    gpu_checks.check_uniform01(DEVICE, dim)


@pytest.mark.parametrize("dim, dtype", [(1, "float32"), (33, "float32"), (128, "bfloat16"), (600, "float16")])
def test_uniform_rows(dim, dtype):
    gpu_checks.check_uniform_rows(DEVICE, dim, getattr(torch, dtype))


@pytest.mark.parametrize(
    "num_buckets, bucket_size, load",
    lane(
        [(1, 4, 0.5), (4, 4, 0.0), (64, 16, 0.6), (64, 16, 0.95), (32, 64, 0.8), (16, 12, 0.7), (1 << 14, 16, 0.9)],
        [(1, 4, 0.5), (4, 4, 0.0), (16, 16, 0.6), (16, 16, 0.95), (8, 64, 0.8), (8, 12, 0.7)],
    ),
)
def test_claim_free_slots(num_buckets, bucket_size, load):
    gpu_checks.check_claim_free_slots(DEVICE, num_buckets, bucket_size, load)


@pytest.mark.parametrize(
    "num_buckets, bucket_size, load",
    lane(
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
        # 64-lane buckets take minutes here: their steps 2-3 run in the CUDA lane and the C++ test
        [(1, 4, 0.75), (8, 4, 0.9), (2, 8, 0.97), (2, 12, 1.0)],
    ),
)
def test_plan_insert(num_buckets, bucket_size, load):
    """The Triton planner (``plan_insert`` on the kernels' device) gives the plain-torch plan."""
    gpu_checks.check_plan(DEVICE, num_buckets, bucket_size, load, batches=lane(4, 1))


def test_plan_of_a_full_index():
    gpu_checks.check_plan_of_a_full_index(DEVICE)


def test_plan_of_a_few_keys():
    gpu_checks.check_plan_of_a_few_keys(DEVICE, num_buckets=lane(512, 8))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_partitioned_index_finds_and_plans_each_partition_as_an_index_alone(seed):
    gpu_checks.check_partitioned(DEVICE, seed=seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_place_keys(seed):
    gpu_checks.check_place_keys(DEVICE, seed)


@pytest.mark.parametrize("dim", lane([5, 8, 128], [5, 128]))
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("max_len", [6, 60])
def test_pooled_forward(dim, weighted, max_len):
    gpu_checks.check_pooled(DEVICE, dim=dim, weighted=weighted, max_len=max_len, bags=lane(40, 12))


KERNELS = ["run", "scan"]


@pytest.mark.parametrize("spec", gpu_checks.kernel_specs(), ids=repr)
def test_every_registered_optimizer_with_kernels_runs_in_the_triton_update_as_its_reference(spec):
    gpu_checks.check_registered_kernel(DEVICE, spec, gpu.bag_update)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("keyed", [True, False], ids=["dynamic", "fixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("spec", gpu_checks.kernel_specs(), ids=repr)
def test_half_precision_rows_are_updated_and_rounded_as_the_torch_path_rounds_them(spec, dtype, keyed, kernel):
    gpu_checks.check_half_update(DEVICE, spec, dtype, keyed, kernel=kernel)


STATIC_DTYPES = {"fp32": (torch.float32, False), "bf16": (torch.bfloat16, True), "fp16": (torch.float16, False)}


@pytest.mark.parametrize("capture", lane([True, False], [False]), ids=lambda c: "graph" if c else "launched")
@pytest.mark.parametrize("dtype_name", lane(list(STATIC_DTYPES), ["fp32", "bf16"]))
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("spec", gpu_checks.kernel_specs(), ids=repr)
def test_a_static_update_gives_the_update_of_each_step_bit_for_bit(spec, kernel, dtype_name, capture):
    dtype, keyed = STATIC_DTYPES[dtype_name]
    gpu_checks.check_static_update(DEVICE, spec, dtype, keyed, capture=capture, kernel=kernel, steps=lane(4, 3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_pooled_forward_reads_half_precision_rows_in_float32(dtype):
    rows, offsets, psw = gpu_checks.random_bags(DEVICE, bags=12, dim=8)
    weight = torch.randn(50, 8, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    got = gpu.pooled_forward(weight, rows, offsets, psw)
    ref = torch.nn.functional.embedding_bag(
        rows, weight.float(), offsets, mode="sum", per_sample_weights=psw, include_last_offset=True
    )
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_the_triton_update_has_no_case_for_an_unknown_code():
    """A code without its case in ``_apply_update`` stops the kernel's compilation (under the
    interpreter: its run) with the static assertion's message, somewhere in the error's causes."""
    from dynarec.optim.kernel import KernelArgs

    weight = torch.ones(4, 2, device=DEVICE)
    with pytest.raises(Exception) as caught:
        gpu.bag_update(KernelArgs(code=99), lr=0.1, weight=weight, states={}, rows=torch.tensor([0, 1], device=DEVICE),
                       offsets=torch.tensor([0, 2], device=DEVICE), per_sample_weights=None,
                       grad_out=torch.ones(1, 2, device=DEVICE))  # type: ignore[arg-type]  # fmt: skip
    messages, error = [], caught.value
    while error is not None:
        messages.append(str(error))
        error = error.__cause__ or error.__context__
    assert any("no case for this kernel code" in m for m in messages), messages


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


if not INTERPRETED:

    @pytest.mark.parametrize("kernel", KERNELS)
    def test_bag_update_replays_a_captured_update_once_a_shape_recurs(kernel):
        """The same steps with :data:`CAPTURE` on and off: the same rows bit for bit, and the steps
        of one table, bags and stream captured once per capacity they fall in, on its second step,
        whatever their id counts within it."""
        spec = Adam(lr=0.01)
        steps = [gpu_checks.random_bags(DEVICE, num_rows=200, bags=64, max_len=8, seed=step) for step in range(1, 9)]
        capacities = [gpu_update.capacity_for(rows.numel()) for rows, _, _ in steps]
        recurring = {c for c in capacities if capacities.count(c) > 1}
        assert recurring and len({rows.numel() for rows, _, _ in steps}) > len(set(capacities))
        results = []
        for enabled in (True, False):
            gpu_update._CAPTURED.clear()
            before = gpu_update._CAPTURED.captures
            with gpu_checks.tuned(gpu_update, "CAPTURE", enabled=enabled), gpu_checks.tuned(gpu_update, kernel=kernel):
                weight = torch.randn(200, 64, generator=torch.Generator().manual_seed(0)).to(DEVICE)
                states = {s.name: torch.zeros(200, s.width(64), device=DEVICE) for s in spec.state_specs()}
                for step, (rows, offsets, psw) in enumerate(steps, 1):
                    grad_out = torch.randn(64, 64, generator=torch.Generator().manual_seed(step)).to(DEVICE)
                    gpu.bag_update(definition(spec).kernel(spec, step), lr=spec.lr, weight=weight, states=states,
                                   rows=rows, offsets=offsets, per_sample_weights=psw, grad_out=grad_out)  # fmt: skip
            results.append((weight, states, gpu_update._CAPTURED.captures - before))
        (w_graph, s_graph, captured), (w_plain, s_plain, not_captured) = results
        assert captured == len(recurring) and not_captured == 0
        assert torch.equal(w_graph, w_plain)
        for k in s_plain:
            assert torch.equal(s_graph[k], s_plain[k])

    @pytest.mark.parametrize("kernel", KERNELS)
    @pytest.mark.parametrize("spec", gpu_checks.SPECS, ids=repr)
    @pytest.mark.parametrize("dim", [5, 8, 128])
    @pytest.mark.parametrize("weighted", [True, False])
    def test_fused_update(spec, dim, weighted, kernel):
        gpu_checks.check_update(DEVICE, spec, dim=dim, weighted=weighted, kernel=kernel)

    @pytest.mark.parametrize("kernel", KERNELS)
    @pytest.mark.parametrize("spec", gpu_checks.SPECS, ids=repr)
    @pytest.mark.parametrize("block", [1, 4, 32])
    @pytest.mark.parametrize("weighted", [True, False])
    def test_fused_update_of_rows_across_blocks(spec, block, weighted, kernel):
        """Rows of ~100 occurrences: most runs cross blocks (the partial-sum path)."""
        gpu_checks.check_update(DEVICE, spec, dim=128, weighted=weighted, max_len=60, block=block, kernel=kernel)

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
        gpu_checks.check_update(DEVICE, spec, dim=dim, max_len=20, block=block, kernel=kernel)

else:
    # The interpreter runs a scan of an [L, D] tile element by element: small tiles, few bags.
    SMALL = dict(bags=12, steps=2)
    HOT = dict(bags=6, steps=2, max_len=60)  # rows of ~20 occurrences, in blocks of 1-4: runs cross blocks

    @pytest.mark.parametrize("kernel", KERNELS)
    @pytest.mark.parametrize("spec", gpu_checks.SPECS, ids=repr)
    def test_fused_update(spec, kernel):
        gpu_checks.check_update(DEVICE, spec, kernel=kernel, **SMALL)

    @pytest.mark.parametrize("spec", gpu_checks.SPECS, ids=repr)
    def test_fused_update_of_rows_across_blocks(spec):
        gpu_checks.check_update(DEVICE, spec, block=4, kernel="run", **HOT)

    @pytest.mark.parametrize(
        "kernel, dim, weighted, block, shape",
        [
            ("run", 5, False, None, SMALL),
            ("scan", 5, False, None, SMALL),
            ("run", 128, True, 2, dict(HOT, max_len=20)),
            ("scan", 128, True, 2, dict(HOT, max_len=20)),
            ("run", 5, True, 1, HOT),
            ("scan", 5, False, 4, HOT),
        ],
    )
    @pytest.mark.parametrize("spec", [gpu_checks.SPECS[2], gpu_checks.SPECS[6]], ids=repr)
    def test_fused_update_any_block_length(spec, kernel, dim, weighted, block, shape):
        """Unweighted bags, wide and narrow rows, single-occurrence blocks, with the optimizers of
        a row-wise state and of two states."""
        gpu_checks.check_update(DEVICE, spec, dim=dim, weighted=weighted, block=block, kernel=kernel, **shape)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("spec", gpu_checks.SPECS, ids=repr)
def test_packed_rows_of_several_dims_are_looked_up_and_updated_as_each_table_apart(spec, kernel):
    gpu_checks.check_packed(DEVICE, spec, kernel=kernel, max_len=lane(60, 6), steps=lane(3, 2), bags=lane(9, 4))


@pytest.mark.parametrize("host_where", ["device", "locked"])
@pytest.mark.parametrize("halves", [("out", "in"), ("out",), ("in",)], ids=["both", "out", "in"])
@pytest.mark.parametrize(
    "dtype, width", [(torch.float32, 1), (torch.float32, 128), (torch.bfloat16, 70), (torch.float16, 8)]
)
def test_exchange_rows_moves_rows_bit_for_bit_between_a_cache_and_host_memory(dtype, width, halves, host_where):
    gpu_checks.check_exchange_rows(DEVICE, [(dtype, width)], host_where, halves)


# A table's fields: bf16 weights with Adam's two states; fp16 weights with RowWise Adagrad's one
# float a row; four fields (more than a launch takes: two launches).
FIELD_SETS = [
    [(torch.bfloat16, 70), (torch.float32, 70), (torch.float32, 70)],
    [(torch.float16, 9), (torch.float32, 1)],
    [(torch.float32, 16), (torch.float32, 1), (torch.bfloat16, 33), (torch.float32, 2)],
]


@pytest.mark.parametrize("host_where", ["device", "locked"])
@pytest.mark.parametrize("halves", [("out", "in"), ("out",), ("in",)], ids=["both", "out", "in"])
@pytest.mark.parametrize("records", [False, True], ids=["apart", "records"])
@pytest.mark.parametrize("fields", FIELD_SETS, ids=["adam-bf16", "rowwise-fp16", "four"])
def test_exchange_rows_moves_every_field_of_a_row_in_one_launch(fields, records, halves, host_where):
    """Several fields at once, their host rows apart or side by side in one record a row
    (strided views, as a host-memory tier keeps them)."""
    gpu_checks.check_exchange_rows(DEVICE, fields, host_where, halves, records=records)
