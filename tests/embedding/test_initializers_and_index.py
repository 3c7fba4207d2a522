"""Key-seeded initializers and the bucketed hash index."""

import dataclasses
import math

import pytest
import torch

from dynarec.embedding import EmbeddingCollection, TableConfig
from dynarec.embedding.fbgemm_store import check_fbgemm_supports, fbgemm_available
from dynarec.embedding.hash_index import BucketedHashIndex
from dynarec.embedding.initializers import Initializer
from dynarec.optim import Adagrad
from tests.matrix import DEVICES

KEYS = torch.arange(-20_000, 20_000) * 7919


@pytest.mark.parametrize("kind", ["uniform", "normal", "truncated_normal", "constant"])
def test_values_depend_on_seed_and_key_only(kind):
    init = Initializer(kind, value=0.3)
    a = init.values(KEYS, 8, seed=5, default_bound=0.1)
    b = init.values(KEYS.flip(0), 8, seed=5, default_bound=0.1).flip(0)  # another order
    c = init.values(KEYS[:1000], 8, seed=5, default_bound=0.1, chunk_elements=56)  # chunks of 7 rows
    assert a.dtype == torch.float32 and a.shape == (KEYS.numel(), 8)
    assert torch.equal(a, b) and torch.equal(a[:1000], c)
    if kind != "constant":
        assert not torch.equal(a, init.values(KEYS, 8, seed=6, default_bound=0.1))
    if kind == "uniform":  # (2u - 1) * bound of the float64 draws, rounded once to float32
        u = torch.ops.dynarec.uniform01(KEYS, 8, 5, 0)
        assert torch.equal(a, ((2.0 * u - 1.0) * 0.1).float())


def test_distributions():
    u = Initializer("uniform").values(KEYS, 16, seed=1, default_bound=0.25)
    assert float(u.min()) >= -0.25 and float(u.max()) <= 0.25
    assert abs(float(u.mean())) < 2e-3 and abs(float(u.std()) - 0.25 / math.sqrt(3)) < 2e-3
    n = Initializer("normal", mean=1.0, std=0.5).values(KEYS, 16, seed=1, default_bound=0.1)
    assert abs(float(n.mean()) - 1.0) < 5e-3 and abs(float(n.std()) - 0.5) < 5e-3
    t = Initializer("truncated_normal", std=0.5).values(KEYS, 16, seed=1, default_bound=0.1)
    assert float(t.abs().max()) <= 1.0 + 1e-6  # cut at two std
    assert abs(float(t.std()) - 0.5 * 0.8796) < 5e-3  # std of N(0,1) truncated at +-2
    assert torch.equal(Initializer("constant", value=0.3).values(KEYS[:3], 2, 0, 0.1), torch.full((3, 2), 0.3))


def test_initializer_validation():
    with pytest.raises(ValueError, match="initializer kind must be one of"):
        Initializer("xavier")
    with pytest.raises(ValueError, match="initializer bound"):
        Initializer(bound=-1.0)


def test_fbgemm_backend_refuses_what_it_cannot_run_naming_native():
    # Where FBGEMM is installed, CUDA is refused (its CUDA build is not in the stack); where it
    # is not (the GPU machines), the backend itself is.
    expected = "CPU only" if fbgemm_available() else "needs FBGEMM"
    with pytest.raises(ValueError, match=f"table 't': backend 'fbgemm' .*{expected}.*backend='native'"):
        check_fbgemm_supports(Adagrad(), torch.device("cuda"), "table 't'")


def test_index_find_insert_remove_and_priority():
    index = BucketedHashIndex(num_buckets=1, bucket_size=4)
    plan = index.plan_insert(torch.tensor([30, 10, 20]))
    assert plan.slots.tolist() == [2, 0, 1]  # ascending keys take free slots in order
    index.commit(plan, torch.tensor([5, 7, 6]))
    assert index.size == 3 and index.find(torch.tensor([10, 20, 30, 40])).tolist() == [0, 1, 2, -1]
    # Key 40 takes the free slot 3; key 50 then evicts the lowest unpinned score: key 30 (score
    # 5) sits in slot 2, pinned by pending step 7, so key 20 (score 6, slot 1) goes.
    index.pin(torch.tensor([2]), step_id=7)
    plan = index.plan_insert(torch.tensor([50, 40]), pinned_by=torch.tensor([7]))
    assert plan.slots.tolist() == [1, 3] and plan.evicted_slots.tolist() == [1]
    assert index.commit(plan, torch.tensor([9, 9])).tolist() == [20]
    assert index.size == 4 and index.find(torch.tensor([20, 30, 40, 50])).tolist() == [-1, 2, 3, 1]
    # Priority: the highest priorities win the slots (ties to the smaller key).
    fresh = BucketedHashIndex(num_buckets=1, bucket_size=2)
    plan = fresh.plan_insert(torch.tensor([1, 2, 3]), allow_evict=False, priority=torch.tensor([5, 9, 5]))
    assert plan.slots.tolist() == [1, 0, -1]
    fresh.commit(plan, torch.tensor([5, 9, 5]))
    fresh.remove(torch.tensor([0]))
    assert fresh.size == 1 and fresh.find(torch.tensor([2, 1])).tolist() == [-1, 1]


def test_fbgemm_backend_without_fbgemm_names_native(monkeypatch):
    import dynarec.embedding.fbgemm_store as store

    monkeypatch.setattr(store, "fbgemm_available", lambda: False)
    with pytest.raises(
        ValueError,
        match=r"table 't': backend 'fbgemm' needs FBGEMM \(fbgemm-gpu-cpu==1.8.0\) installed; use backend='native'",
    ):
        check_fbgemm_supports(Adagrad(), torch.device("cpu"), "table 't'")


def test_a_table_of_backend_fbgemm_and_a_dim_it_cannot_hold_is_refused_when_planned(tmp_path, capsys):
    """The table's own config refuses it, so `dynarec plan` does too (it printed a plan of a
    config that verify and train then refused)."""
    from dynarec.cli import main
    from tests.pipeline_fixtures import config_dict, write_config

    with pytest.raises(
        ValueError, match=r"table 't': backend 'fbgemm' needs an embedding dim that is a multiple of 4.*got 6"
    ):
        TableConfig(name="t", dim=6, num_embeddings=10, features=["f"], backend="fbgemm")
    c = config_dict()
    feature = next(f["id_feature"] for f in c["feature_configs"] if f["id_feature"]["feature_name"] == "age")
    feature.update(embedding_dim=6, backend="fbgemm")
    assert main(["plan", "--config", str(write_config(tmp_path, c))]) == 2
    assert "table 'age': backend 'fbgemm' needs an embedding dim that is a multiple of 4" in capsys.readouterr().err


@pytest.mark.skipif(not fbgemm_available(), reason="FBGEMM is not installed")
def test_fbgemm_refuses_a_dim_that_is_not_a_multiple_of_4_by_name():
    with pytest.raises(
        ValueError, match=r"table 't': backend 'fbgemm' needs an embedding dim that is a multiple of 4.*got 6"
    ):
        EmbeddingCollection(
            [TableConfig(name="t", dim=6, num_embeddings=10, features=["f"], backend="fbgemm")], Adagrad()
        )


@pytest.mark.parametrize("kind", ["uniform", "normal", "truncated_normal", "constant"])
@pytest.mark.parametrize("data_type", ["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_fixed_tables_rows_start_at_their_ids_initial_weights(kind, data_type, device):
    """Row ``i`` of a fixed table (of a row-wise shard: its global row; of a host tier: its host
    row, on the host beside a GPU table) starts at the initializer's values for key ``i``, in the
    rows' type: written in place, in more than one chunk of rows."""
    from dynarec.embedding.table import FixedTable

    init = Initializer(kind, value=0.3)
    config = TableConfig(
        name="t", dim=8, num_embeddings=140_000, features=["f"], initializer=init, data_type=data_type, seed=3
    )
    shard = FixedTable(config, Adagrad(lr=0.1), torch.device(device), rows=(1_000, 140_000))
    want = init.values(torch.arange(1_000, 140_000), 8, seed=3, default_bound=config.default_bound)
    assert torch.equal(shard.store.weight.cpu(), want.to(shard.store.weight.dtype))
    whole = EmbeddingCollection([config], Adagrad(lr=0.1), device=device).tables["t"]
    assert torch.equal(whole.store.weight[1_000:], shard.store.weight)
    tiered = EmbeddingCollection(
        [dataclasses.replace(config, cache_load_factor=0.05)], Adagrad(lr=0.1), device=device
    ).tables["t"]
    assert torch.equal(tiered.store.weight.cpu(), whole.store.weight.cpu())
