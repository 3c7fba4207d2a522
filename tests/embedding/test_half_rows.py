"""Half-precision rows (``data_type: fp16 / bf16``): the fp32 update of the reference, stored by
the seeded stochastic rounding, on fixed and dynamic tables; unbiased where nearest rounding
would lose the update; reproducible; dumped and loaded exactly."""

import numpy as np
import pytest
import torch

from dynarec import DynamicTableOptions, EmbeddingCollection, FeatureConfig, Initializer, JaggedBatch, TableConfig
from dynarec.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from dynarec.optim.reference import initial_states
from dynarec.optim.rounding import ROW_DTYPES, rounded_match, rounding_noise, stochastic_round
from tests.embedding.test_fixed_tables import grads_for, random_batches
from tests.matrix import needs_cuda
from tests.reference_model import reference_table_step

N, D, STEPS = 50, 8, 3
SPECS = {
    "sgd": SGD(lr=0.3),
    "adagrad": Adagrad(lr=0.2, initial_accumulator_value=0.1),
    "rowwise_l2": RowWiseAdagrad(lr=0.2, weight_decay=0.3, weight_decay_mode="l2"),
    "adam": Adam(lr=0.05, weight_decay=0.1),
    "adagrad_clip": Adagrad(lr=0.2, gradient_clipping=True, max_gradient=0.3),
}
POOLINGS = {"item_id": "mean", "hist_item_id": "none"}


def table(data_type, spec, num_embeddings=N, dynamic=None, features=tuple(POOLINGS), seed=7):
    return TableConfig(
        name="t",
        dim=D,
        num_embeddings=None if dynamic else num_embeddings,
        dynamic=dynamic,
        features=[FeatureConfig(f, POOLINGS.get(f)) for f in features],
        initializer=Initializer("uniform", bound=0.5),
        seed=seed,
        data_type=data_type,
        optimizer=spec,
    )


@pytest.mark.parametrize("data_type", ["fp16", "bf16"])
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_fixed_half_rows_are_the_fp32_update_stochastically_rounded(spec_name, data_type):
    """The reference updates an fp32 copy of the stored rows, then rounds each touched row
    with the draws of (table seed, step, row): the table's rows are that rounding, except where
    a draw lies within the float32 updates' tolerance of its threshold (rounded_match)."""
    spec, dtype = SPECS[spec_name], ROW_DTYPES[data_type]
    coll = EmbeddingCollection([table(data_type, spec)], spec)
    assert coll.tables["t"].store.weight.dtype == dtype
    weight = coll.read_rows("t", torch.arange(N))["weight"]  # float32, the stored values exactly
    states = initial_states(spec, N, D)
    for step, (feats, weights) in enumerate(random_batches(POOLINGS, True, 3), start=1):
        out = coll(JaggedBatch.from_lists(feats, weights))
        grads = grads_for(out, 3 + step)
        ref = reference_table_step(
            spec, lr=spec.lr, step=step, weight=weight, states=states, features=feats, poolings=POOLINGS,
            grads=grads, weights=weights,
        )  # fmt: skip
        for k in out:
            torch.testing.assert_close(out[k].detach(), ref[k], rtol=1e-5, atol=1e-6)
        sum((out[k] * grads[k]).sum() for k in out).backward()
        touched = torch.tensor(sorted({i for v in feats.values() for s in v for i in s}), dtype=torch.int64)
        noise = rounding_noise(7, step, touched, D)
        stored = coll.read_rows("t", touched)["weight"]
        assert rounded_match(stored, weight[touched], dtype, noise, rtol=1e-5, atol=1e-6).all()
        assert (stored == stochastic_round(weight[touched], dtype, noise).float()).float().mean() > 0.99
        weight[touched] = stored  # the next step starts from the stored rows
    rows = coll.read_rows("t", torch.arange(N))
    assert torch.equal(rows["weight"], weight)
    for name, s in states.items():
        torch.testing.assert_close(rows[name], s, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("data_type", ["fp16", "bf16"])
def test_updates_below_half_an_ulp_survive_on_average(data_type):
    """SGD steps of a quarter of the spacing below 1.0 (bf16: 2**-8, fp16: 2**-11) on weights
    of 1.0: nearest rounding would store 1.0 again; the stored rows move by the step on average."""
    lr = 1e-3 if data_type == "bf16" else 1e-4
    spec = SGD(lr=lr)
    config = TableConfig(
        name="t", dim=64, num_embeddings=4096, features=["f"], data_type=data_type,
        initializer=Initializer("constant", value=1.0),
    )  # fmt: skip
    coll = EmbeddingCollection([config], spec)
    out = coll(JaggedBatch.from_lists({"f": [[i] for i in range(4096)]}))
    out["f"].sum().backward()  # gradient 1 on every weight
    w = coll.read_rows("t", torch.arange(4096))["weight"]
    below = 1.0 - (2**-8 if data_type == "bf16" else 2**-11)  # the storage value just below 1.0
    assert set(torch.unique(w).tolist()) == {1.0, below}
    assert abs(float(w.mean()) - (1.0 - lr)) < lr / 20


def dynamic_run(data_type, seed=0, steps=6):
    spec = Adagrad(lr=0.2, initial_accumulator_value=0.1)
    options = DynamicTableOptions(max_capacity=256, init_capacity=16, bucket_size=4)
    coll = EmbeddingCollection([table(data_type, spec, dynamic=options)], spec)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        feats = {f: [[int(x) for x in rng.integers(0, 60, rng.integers(0, 5))] for _ in range(6)] for f in POOLINGS}
        out = coll(JaggedBatch.from_lists(feats))
        g = torch.Generator().manual_seed(1)
        sum((v * torch.randn(v.shape, generator=g)).sum() for v in out.values()).backward()
    return coll


@pytest.mark.parametrize("data_type", ["fp16", "bf16"])
def test_dynamic_half_rows_grow_reproducibly_and_track_fp32(data_type):
    half, again, full = dynamic_run(data_type), dynamic_run(data_type), dynamic_run("fp32")
    t = half.tables["t"]
    assert t.store.weight.dtype == ROW_DTYPES[data_type] and t.capacity > 16  # it grew on the way
    keys = torch.arange(60)
    a, b, f = half.read_rows("t", keys), again.read_rows("t", keys), full.read_rows("t", keys)
    assert torch.equal(a["present"], f["present"]) and int(a["present"].sum()) > 30
    for k in ("weight", "momentum1"):
        assert torch.equal(a[k], b[k])  # the same run, bit for bit
    w = a["weight"][a["present"]]
    assert torch.equal(w, w.to(ROW_DTYPES[data_type]).float())  # stored values, read exactly
    # within a few ulps of the fp32 table after 6 steps
    torch.testing.assert_close(w, f["weight"][f["present"]], rtol=0.03, atol=0.01)


@pytest.mark.parametrize("kind", ["fixed", "dynamic"])
def test_half_rows_dump_and_load_exactly(kind):
    spec = Adagrad(lr=0.2)
    options = DynamicTableOptions(max_capacity=256, init_capacity=16, bucket_size=4) if kind == "dynamic" else None
    make = lambda: EmbeddingCollection([table("bf16", spec, dynamic=options)], spec)
    coll = make()
    for feats, weights in random_batches(POOLINGS, False, 5):
        out = coll(JaggedBatch.from_lists(feats, weights))
        sum(v.sum() for v in out.values()).backward()
    dump = coll.tables["t"].dump()
    assert dump["weight"].dtype == torch.bfloat16  # the rows' own bytes, a fixed or dynamic table's
    other = make()
    other.tables["t"].load(dump)
    keys = torch.arange(N)
    a, b = coll.read_rows("t", keys), other.read_rows("t", keys)
    for k in a:
        assert torch.equal(a[k], b[k])


def test_half_rows_are_refused_on_the_fbgemm_backend():
    with pytest.raises(ValueError, match=r"table 't': data_type bf16 rows are trained by backend='native'"):
        TableConfig(name="t", dim=4, num_embeddings=10, features=["f"], data_type="bf16", backend="fbgemm")
    with pytest.raises(ValueError, match=r"table 't': data_type must be one of \('fp32', 'fp16', 'bf16'\)"):
        TableConfig(name="t", dim=4, num_embeddings=10, features=["f"], data_type="int8")


@needs_cuda
@pytest.mark.parametrize("kind", ["fixed", "dynamic"])
def test_half_rows_on_cuda_draw_as_on_cpu(kind):
    """The draws are the same on any device: a bf16 table trained on CUDA and on CPU ends within
    a storage step (their fp32 updates may differ in the last bits, flipping a rare rounding)."""
    spec = Adagrad(lr=0.2)
    options = DynamicTableOptions(max_capacity=256, init_capacity=16, bucket_size=4) if kind == "dynamic" else None
    rows = {}
    for device in ("cpu", "cuda"):
        coll = EmbeddingCollection([table("bf16", spec, dynamic=options)], spec, device=device)
        for feats, weights in random_batches(POOLINGS, True, 9):
            out = coll(JaggedBatch.from_lists(feats, weights))
            sum(v.sum() for v in out.values()).backward()
        rows[device] = {k: v.cpu() for k, v in coll.read_rows("t", torch.arange(N)).items()}
    assert (rows["cuda"]["weight"] == rows["cpu"]["weight"]).float().mean() > 0.99
    torch.testing.assert_close(rows["cuda"]["weight"], rows["cpu"]["weight"], rtol=0.01, atol=0.01)
