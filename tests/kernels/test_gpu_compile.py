"""Every Triton kernel compiles for a CUDA GPU (sm_90, the H200s) on any machine, without one:
code generation down to the GPU binary checks what Triton's interpreter does not (globals that are
not constexpr, types, the constexpr branches of each optimizer). Each kernel's constexpr choices
are compiled once; the signatures are the launches' (pointer dtypes, int and float scalars)."""

import pytest

from dynarec.kernels import gpu
from dynarec.optim.kernel import KernelCode, WeightDecayCode

pytestmark = [
    pytest.mark.skipif(not gpu.HAVE_TRITON, reason="Triton is not installed"),
    pytest.mark.skipif(gpu.INTERPRETED, reason="the kernels are interpreted in this process, not compiled"),
]

I64, U8, I32, F32 = "*i64", "*u8", "*i32", "*fp32"
# the step's id count and scalars are read from the device (a captured update replays them)
STEP = dict(n_ptr=I64, hyper_ptr="*fp64", D="i32", keys_ptr=I64)
UPDATE = dict(
    weight_ptr=F32, s1_ptr=F32, s2_ptr=F32, grad_ptr=F32, sorted_rows_ptr=I32, bag_ptr=I64,
    psw_ptr=F32, scores_ptr=I64, part_first_ptr=F32, part_last_ptr=F32, **STEP,
)  # fmt: skip
CROSSING = dict(
    weight_ptr=F32, s1_ptr=F32, s2_ptr=F32, sorted_rows_ptr=I32, part_first_ptr=F32, part_last_ptr=F32, **STEP
)
# half-precision rows: (the weight pointer, the ROUND code, whether a key array gives the rows' keys)
HALF = [("*bf16", 1, True), ("*fp16", 2, False)]
# (optimizer code, weight-decay mode): every code without weight decay, and the modes each offers
OPTIMIZERS = [(int(code), int(WeightDecayCode.NONE)) for code in KernelCode] + [
    (int(KernelCode.ROWWISE_ADAGRAD), int(WeightDecayCode.L2)),
    (int(KernelCode.ROWWISE_ADAGRAD), int(WeightDecayCode.DECOUPLED)),
    (int(KernelCode.ADAM), int(WeightDecayCode.DECOUPLED)),
]


def kernels():
    from dynarec.kernels.gpu import hashing, lookup, plan, rows, update

    find = dict(keys_ptr=I64, tags_ptr=U8, query_ptr=I64, out_ptr=I64, absent_ptr=I32, n="i32", num_buckets="i64")
    claim = dict(
        tags_ptr=U8, claimed_ptr=I64, sorted_ptr=I32, perm_ptr=I64, first_ptr=I64, order_ptr=I64, out_ptr=I64,
        lane_ptr=I64, placed_ptr=I32, m="i32", num_buckets="i32",
    )  # fmt: skip
    displace = dict(
        keys_ptr=I64, tags_ptr=U8, scores_ptr=I64, claimed_ptr=I64, pins_ptr=I32, pin_ids_ptr=I32, num_pins="i32",
        new_keys_ptr=I64, todo_ptr=I64, slot_ptr=I64, dst_ptr=I32, live_ptr="*i8", bids_ptr=I64, bid_round="i32",
        m="i32", num_buckets="i64",
    )  # fmt: skip
    settle = dict(
        slot_ptr=I64, bids_ptr=I64, todo_ptr=I64, out_ptr=I64, won_ptr=I32, live_ptr="*i8", claimed_ptr=I64,
        bid_round="i32", m="i32",
    )  # fmt: skip
    uniform_rows = dict(
        keys_ptr=I64, rows_ptr=I64, out_ptr=F32, n="i32", dim="i32", row_stride="i64", salt_hi="i32", salt_lo="i32",
        bound_hi="i32", bound_lo="i32",
    )  # fmt: skip
    choose = dict(
        tags_ptr=U8, claimed_ptr=I64, keys_ptr=I64, order_ptr=I64, out_ptr=I64, choice_ptr=I32, m="i32",
        num_buckets="i64",
    )  # fmt: skip
    place = dict(
        keys_ptr=I64, scores_ptr=I64, tags_ptr=U8, slots_ptr=I64, new_keys_ptr=I64, new_scores_ptr=I64, n="i32"
    )
    pooled = dict(weight_ptr=F32, rows_ptr=I64, offsets_ptr=I64, psw_ptr=F32, out_ptr=F32, D="i32")
    exchange = dict(slots_ptr=I64, out_ptr=I64, in_ptr=I64, n="i32")
    for k, ptr in enumerate(("*bf16", F32, F32)):  # bf16 weights, Adam's two states: fields of one record
        exchange.update({f"cache{k}": ptr, f"host{k}": ptr, f"W{k}": "i32", f"stride{k}": "i32"})
    moves = [
        dict(WRITE_OUT=True, READ_IN=True),
        dict(WRITE_OUT=True, READ_IN=False),
        dict(WRITE_OUT=False, READ_IN=True),
    ]
    cases = [
        *[(hashing._find_kernel, find, dict(BS=16, BSP=16, FLAG=flag, BLOCK=128)) for flag in (True, False)],
        (hashing._find_kernel, find, dict(BS=12, BSP=16, FLAG=True, BLOCK=128)),
        (hashing._candidate_buckets_kernel, dict(keys_ptr=I64, b1_ptr=I64, b2_ptr=I64, n="i32", num_buckets="i64"),
         dict(BLOCK=512)),
        (plan._choose_kernel, choose, dict(BS=12, BSP=16, BLOCK=128)),
        (plan._claim_kernel, claim, dict(BS=64, BSP=64, BLOCK=128)),
        (plan._mark_claimed_kernel, dict(claimed_ptr=I64, sorted_ptr=I32, lane_ptr=I64, m="i32"), dict(BLOCK=128)),
        (plan._mark_slots_kernel, dict(claimed_ptr=I64, slots_ptr=I64, m="i32"), dict(BS=16, BLOCK=256)),
        *[(plan._displace_kernel, displace, dict(BS=16, BSP=16, EVICT=evict, BLOCK=64)) for evict in (True, False)],
        (plan._settle_kernel, settle, dict(BS=16, BLOCK=64)),
        (plan._place_kernel, place, dict(BLOCK=256)),
        *[(hashing._uniform_rows_kernel, dict(uniform_rows, out_ptr=out), dict(ROWS=32, COLS=128, BLOCKS=1))
          for out in (F32, "*bf16", "*fp16")],
        *[(lookup._pooled_kernel, pooled, dict(HAS_W=w, BLOCK_D=128)) for w in (True, False)],
        (lookup._pooled_kernel, dict(pooled, weight_ptr="*bf16"), dict(HAS_W=True, BLOCK_D=128)),
        *[(rows._exchange_kernel, exchange, dict(m, FIELDS=f, BLOCK_R=8, B0=128, B1=128, B2=128))
          for m in moves for f in (1, 3)],
    ]  # fmt: skip
    for opt, wd in OPTIMIZERS:
        flags = dict(OPT=opt, WD_MODE=wd, ROUND=0, HAS_KEYS=False)
        cases += [
            (update._update_run_kernel, UPDATE, dict(flags, HAS_W=True, HAS_SCORES=True, BLOCK_D=128, L=128)),
            (update._update_block_kernel, UPDATE, dict(flags, HAS_W=False, HAS_SCORES=False, BLOCK_D=16, L=64)),
            (update._update_crossing_kernel, CROSSING, dict(flags, BLOCK_D=128, L=128, P=16)),
        ]
        for weight, code, keyed in HALF:
            half = dict(flags, ROUND=code, HAS_KEYS=keyed)
            cases += [
                (update._update_run_kernel, dict(UPDATE, weight_ptr=weight),
                 dict(half, HAS_W=True, HAS_SCORES=True, BLOCK_D=128, L=128)),
                (update._update_block_kernel, dict(UPDATE, weight_ptr=weight),
                 dict(half, HAS_W=False, HAS_SCORES=False, BLOCK_D=16, L=64)),
                (update._update_crossing_kernel, dict(CROSSING, weight_ptr=weight),
                 dict(half, BLOCK_D=128, L=128, P=16)),
            ]  # fmt: skip
    return cases


CASES = kernels() if gpu.HAVE_TRITON and not gpu.INTERPRETED else []


@pytest.mark.parametrize(
    "kernel, signature, constants",
    CASES,
    ids=[f"{k.__name__}-" + "-".join(f"{n}{v}" for n, v in c.items()) for k, _, c in CASES],
)
def test_the_kernel_compiles_for_the_gpu(kernel, signature, constants):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(
        fn=kernel, signature={**signature, **dict.fromkeys(constants, "constexpr")}, constexprs=constants
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]
