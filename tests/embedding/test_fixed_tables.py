"""Fixed tables: every optimizer x backend x pooling scenario against the plain reference."""

import numpy as np
import pytest
import torch

from dynarec import DynamicTableOptions, EmbeddingCollection, FeatureConfig, Initializer, JaggedBatch, TableConfig
from dynarec.embedding.jagged import split_features
from dynarec.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from dynarec.optim.reference import initial_states
from tests.matrix import needs_fbgemm
from tests.reference_model import reference_table_step, zipf_batch

N, D, B, STEPS = 50, 8, 6, 3
TOL = dict(rtol=1e-5, atol=1e-6)

SPECS = {
    "sgd": SGD(lr=0.3),
    "adagrad_iav0": Adagrad(lr=0.2),
    "adagrad_iav0.1": Adagrad(lr=0.2, initial_accumulator_value=0.1),
    "adagrad_iav1": Adagrad(lr=0.2, initial_accumulator_value=1.0),
    "rowwise": RowWiseAdagrad(lr=0.2, initial_accumulator_value=0.1),
    "rowwise_l2": RowWiseAdagrad(lr=0.2, weight_decay=0.3, weight_decay_mode="l2"),
    "rowwise_decoupled": RowWiseAdagrad(lr=0.2, weight_decay=0.3, weight_decay_mode="decoupled"),
    "adam": Adam(lr=0.05),
    "adam_wd": Adam(lr=0.05, weight_decay=0.1, beta1=0.8, beta2=0.95),
    # FBGEMM's gradient_clipping: the bags' output gradients (randn here) clamped to 0.3
    "sgd_clip": SGD(lr=0.3, gradient_clipping=True, max_gradient=0.3),
    "adagrad_clip": Adagrad(lr=0.2, initial_accumulator_value=0.1, gradient_clipping=True, max_gradient=0.3),
    "rowwise_clip": RowWiseAdagrad(
        lr=0.2, weight_decay=0.3, weight_decay_mode="l2", gradient_clipping=True, max_gradient=0.3
    ),
    "adam_clip": Adam(lr=0.05, gradient_clipping=True, max_gradient=0.3),
}

# scenario -> {feature: pooling}, weighted?
SCENARIOS = {
    "sum": ({"f": "sum"}, False),
    "mean": ({"f": "mean"}, False),
    "weighted_sum": ({"f": "sum"}, True),
    "weighted_mean": ({"f": "mean"}, True),
    "pooled_and_sequence": ({"item_id": "sum", "hist_item_id": "none"}, False),
}


def supported(backend, spec):
    return not (backend == "fbgemm" and isinstance(spec, Adam))


def make_collection(backend, spec, poolings, num_embeddings=N):
    features = [FeatureConfig(name, pooling) for name, pooling in poolings.items()]
    return EmbeddingCollection(
        [
            TableConfig(
                name="t",
                dim=D,
                num_embeddings=num_embeddings,
                features=features,
                backend=backend,
                initializer=Initializer("uniform", bound=0.5),
                seed=7,
            )
        ],
        optimizer=spec,
    )


def random_batches(poolings, weighted, seed):
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(STEPS):
        feats = {name: zipf_batch(rng, B, 5, N) for name in poolings}
        weights = None
        if weighted:
            weights = {
                name: [[float(x) for x in rng.uniform(0.1, 2.0, size=len(s))] for s in samples]
                for name, samples in feats.items()
            }
        batches.append((feats, weights))
    return batches


def grads_for(outs, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in outs.items()}


def run_and_compare(backend, spec, poolings, weighted, seed=0):
    coll = make_collection(backend, spec, poolings)
    table = coll.tables["t"]
    weight = table.store.weight.clone()
    states = initial_states(spec, N, D)
    for step, (feats, weights) in enumerate(random_batches(poolings, weighted, seed), start=1):
        kjt = JaggedBatch.from_lists(feats, weights)
        out = coll(kjt)
        grads = grads_for(out, seed + step)
        ref_out = reference_table_step(
            spec,
            lr=spec.lr,
            step=step,
            weight=weight,
            states=states,
            features=feats,
            poolings=poolings,
            grads=grads,
            weights=weights,
        )
        for k in out:
            torch.testing.assert_close(out[k].detach(), ref_out[k], **TOL)
        sum((out[k] * grads[k]).sum() for k in out).backward()
    rows = coll.read_rows("t", torch.arange(N))
    torch.testing.assert_close(rows["weight"], weight, **TOL)
    for name, s in states.items():
        torch.testing.assert_close(rows[name], s, **TOL)
    assert table.step == STEPS
    return rows


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_matches_reference(backend, spec_name, scenario):
    spec = SPECS[spec_name]
    poolings, weighted = SCENARIOS[scenario]
    if not supported(backend, spec):
        with pytest.raises(ValueError, match="backend='native'"):
            make_collection(backend, spec, poolings)
        return
    run_and_compare(backend, spec, poolings, weighted)


@needs_fbgemm
@pytest.mark.parametrize("spec_name", [s for s in SPECS if not s.startswith("adam")])
def test_native_and_fbgemm_agree(spec_name):
    spec = SPECS[spec_name]
    poolings, weighted = {"item_id": "mean", "hist_item_id": "none"}, True
    native = run_and_compare("native", spec, poolings, weighted, seed=3)
    fbgemm = run_and_compare("fbgemm", spec, poolings, weighted, seed=3)
    for k in native:
        torch.testing.assert_close(native[k], fbgemm[k], **TOL)


@pytest.mark.parametrize("cls", [Adagrad, RowWiseAdagrad])
@pytest.mark.parametrize("iav", [0.0, 0.1, 1.0])
def test_initial_accumulator_value_visible_and_drives_first_update(backend, cls, iav):
    spec = cls(lr=0.5, initial_accumulator_value=iav)
    coll = make_collection(backend, spec, {"f": "sum"}, num_embeddings=10)
    m1 = coll.read_rows("t", torch.arange(10))["momentum1"]
    assert m1.shape == (10, D if cls is Adagrad else 1)
    assert torch.equal(m1, torch.full_like(m1, iav))
    w0 = coll.read_rows("t", torch.tensor([3]))["weight"][0]
    out = coll(JaggedBatch.from_lists({"f": [[3]]}))
    g = torch.linspace(-1.0, 2.0, D)
    (out["f"] * g).sum().backward()
    row = coll.read_rows("t", torch.tensor([3]))
    # By hand, float32: h = iav + g^2 (elementwise) or iav + mean(g^2) (row-wise).
    h = torch.tensor(iav, dtype=torch.float32) + (g * g if cls is Adagrad else (g * g).mean())
    expected = w0 - 0.5 * g / (h.sqrt() + 1e-8)
    torch.testing.assert_close(row["momentum1"][0], h.expand(row["momentum1"].shape[1:]), rtol=1e-6, atol=0)
    torch.testing.assert_close(row["weight"][0], expected, rtol=1e-6, atol=1e-7)


@needs_fbgemm
def test_fbgemm_cpu_fast_path_still_drops_rowwise_weight_decay():
    """Documents the FBGEMM CPU pitfall our fbgemm store works around: a TBE whose table serves a
    single feature ignores RowWiseAdagrad weight decay. If this starts failing, FBGEMM fixed it."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
    from fbgemm_gpu.tbe.config.embedding_config import ComputeDevice, EmbeddingLocation
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(4, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.1,
        weight_decay=0.5,
        weight_decay_mode=WeightDecayMode.L2,
    )
    tbe.split_embedding_weights()[0].fill_(1.0)
    tbe(torch.tensor([1]), torch.tensor([0, 1])).sum().backward()
    assert torch.allclose(tbe.split_optimizer_states()[0][0][1], torch.tensor(1.0))  # mean(g^2), no wd*w

    # Our store, same settings: the L2 term is applied.
    coll = EmbeddingCollection(
        [
            TableConfig(
                name="t",
                dim=4,
                num_embeddings=4,
                features=["f"],
                backend="fbgemm",
                initializer=Initializer("constant", value=1.0),
            )
        ],
        optimizer=RowWiseAdagrad(lr=0.1, weight_decay=0.5, weight_decay_mode="l2"),
    )
    coll(JaggedBatch.from_lists({"f": [[1]]}))["f"].sum().backward()
    assert torch.allclose(coll.read_rows("t", torch.tensor([1]))["momentum1"], torch.tensor([[1.5**2]]))


@pytest.mark.parametrize("bad", [-1, 10, 2**40])
def test_out_of_range_ids_name_table_feature_value_and_write_nothing(backend, bad):
    coll = EmbeddingCollection(
        [
            TableConfig(name="cate", dim=4, num_embeddings=10, features=["cate_id"], backend=backend),
            TableConfig(name="user", dim=4, dynamic=DynamicTableOptions(64), features=["user_id"]),
        ],
        optimizer=SGD(lr=1.0),
    )
    before = coll.read_rows("cate", torch.arange(10))["weight"]
    kjt = JaggedBatch.from_lists({"cate_id": [[1, bad]], "user_id": [[5]]})
    with pytest.raises(ValueError, match=rf"table 'cate', feature 'cate_id': id {bad} is out of range \[0, 10\)"):
        coll(kjt)
    assert torch.equal(coll.read_rows("cate", torch.arange(10))["weight"], before)
    assert coll.tables["user"].size == 0 and coll.tables["user"].step == 0


def test_ids_are_checked_from_the_ranges_their_batch_was_made_with(backend):
    """A batch from a DataLoader worker holds each feature's smallest and largest id, worked out
    where it was built: the check reads those, not the ids (an empty feature's (0, -1) passes)."""
    coll = EmbeddingCollection(
        [TableConfig(name="cate", dim=4, num_embeddings=10, features=["cate_id", "other"], backend=backend)],
        optimizer=SGD(lr=1.0),
    )
    kjt = JaggedBatch.from_lists({"cate_id": [[1, 2]], "other": [[]]})
    with pytest.raises(ValueError, match=r"table 'cate', feature 'cate_id': id 12 is out of range \[0, 10\)"):
        coll(kjt.with_id_ranges([(1, 12), (0, -1)]))  # (what its maker said)
    coll(kjt.with_id_ranges([(1, 2), (0, -1)]))
    with pytest.raises(ValueError, match="1 id ranges for 2 keys"):
        kjt.with_id_ranges([(1, 2)])


def test_negative_length_names_feature():
    coll = make_collection("native", SGD(), {"f": "sum"})
    kjt = JaggedBatch(["f"], torch.tensor([1, 2]), torch.tensor([3, -1]))
    with pytest.raises(ValueError, match="feature 'f' has a negative length"):
        coll(kjt)


def test_lengths_that_fit_no_key_are_errors():
    with pytest.raises(ValueError, match="lengths has 2 entries but the batch has no keys"):
        split_features(JaggedBatch([], torch.empty(0, dtype=torch.int64), torch.tensor([0, 0])))
    with pytest.raises(ValueError, match="lengths has 3 entries, not a multiple of 2 keys"):
        split_features(JaggedBatch(["a", "b"], torch.tensor([5, 6]), torch.tensor([1, 0, 1])))
    assert split_features(JaggedBatch([], torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))) == {}


def test_unknown_and_missing_features_are_errors():
    coll = make_collection("native", SGD(), {"f": "sum"})
    with pytest.raises(ValueError, match=r"\['g'\] are not served"):
        coll(JaggedBatch.from_lists({"f": [[1]], "g": [[1]]}))
    with pytest.raises(ValueError, match=r"missing feature\(s\) \['f'\]"):
        coll(JaggedBatch.from_lists({}))


def test_eval_mode_changes_nothing(backend):
    coll = make_collection(backend, Adagrad(lr=0.5, initial_accumulator_value=0.1), {"f": "sum"})
    before = coll.read_rows("t", torch.arange(N))
    coll.eval()
    out = coll(JaggedBatch.from_lists({"f": [[1, 2, 2], [3]]}))
    assert not out["f"].requires_grad
    after = coll.read_rows("t", torch.arange(N))
    for k in before:
        assert torch.equal(before[k], after[k])
    assert coll.tables["t"].step == 0


def test_collection_has_no_parameters_for_dense_optimizers(backend):
    # FBGEMM's TBE registers weights_host / momentum1_host as parameters on CPU; they must never
    # reach a dense optimizer through the collection.
    coll = make_collection(backend, Adagrad(), {"f": "sum"})
    assert list(coll.parameters()) == [] and list(coll.named_buffers()) == []


def test_per_table_optimizer_override():
    coll = EmbeddingCollection(
        [
            TableConfig(name="a", dim=4, num_embeddings=5, features=["fa"]),
            TableConfig(name="b", dim=4, num_embeddings=5, features=["fb"], optimizer=SGD(lr=1.0)),
        ],
        optimizer=Adagrad(lr=0.1, initial_accumulator_value=0.1),
    )
    assert coll.tables["a"].spec == Adagrad(lr=0.1, initial_accumulator_value=0.1)
    assert coll.tables["b"].spec == SGD(lr=1.0)
    assert set(coll.read_rows("b", torch.tensor([0]))) == {"weight"}
    with pytest.raises(ValueError, match="table 'c' has no optimizer"):
        EmbeddingCollection([TableConfig(name="c", dim=4, num_embeddings=5, features=["fc"])])


def test_torchrec_keyed_jagged_tensor_is_accepted():
    kjt_mod = pytest.importorskip("torchrec.sparse.jagged_tensor")
    coll = make_collection("native", SGD(lr=0.1), {"f": "sum"})
    kjt = kjt_mod.KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1])
    )
    out = coll(kjt)
    w = coll.read_rows("t", torch.tensor([1, 2, 3]))["weight"]
    torch.testing.assert_close(out["f"].detach(), torch.stack([w[0] + w[1], w[2]]))


def test_a_variable_batch_keyed_jagged_tensor_is_refused_by_name():
    """torchrec's variable-batch KJT (a batch size per feature) was split as if every feature had
    the same samples: its features' outputs got the wrong ids, without an error."""
    kjt_mod = pytest.importorskip("torchrec.sparse.jagged_tensor")
    coll = make_collection("native", SGD(lr=0.1), {"f": "sum", "g": "sum"})
    kjt = kjt_mod.KeyedJaggedTensor(
        keys=["f", "g"],
        values=torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 1]),
        stride_per_key_per_rank=[[1], [2]],
    )
    with pytest.raises(
        ValueError, match=r"a variable-batch KeyedJaggedTensor \(samples per feature \{'f': 1, 'g': 2\}\)"
    ):
        coll(kjt)
    assert coll.tables["t"].step == 0
    uniform = kjt_mod.KeyedJaggedTensor(  # flagged variable, every feature the same samples: as any KJT
        keys=["f", "g"],
        values=torch.tensor([1, 2, 3, 4]),
        lengths=torch.tensor([1, 1, 1, 1]),
        stride_per_key_per_rank=[[2], [2]],
    )
    plain = kjt_mod.KeyedJaggedTensor.from_lengths_sync(
        ["f", "g"], torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 1, 1])
    )
    coll.eval()
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(coll(uniform).values(), coll(plain).values()))


@needs_fbgemm
def test_a_padded_sequence_of_an_fbgemm_store_sliced_to_its_dim_is_contiguous():
    """RowWise Adagrad with weight decay runs FBGEMM's generic path, whose output is wider than
    the table and sliced to its dim: a sequence's padded [B, L, D] is then made contiguous (a
    model may view it, as it could the padded copy before), with the native backend's values."""
    spec = RowWiseAdagrad(lr=0.1, weight_decay=0.5, weight_decay_mode="l2")
    kjt = JaggedBatch.from_lists({"s": [[1, 2, 3], [4]]})
    outs = []
    for backend in ("fbgemm", "native"):
        features = [FeatureConfig("s", pooling="none")]
        table = TableConfig(name="t", dim=4, num_embeddings=8, features=features, backend=backend, seed=1)
        out = EmbeddingCollection([table], optimizer=spec)(kjt)["s"]
        assert out.shape == (2, 3, 4) and out.is_contiguous(), backend
        outs.append(out.detach())
    torch.testing.assert_close(outs[0], outs[1])
    assert torch.equal(outs[0][1, 1:], torch.zeros(2, 4))
