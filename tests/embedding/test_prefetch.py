"""EmbeddingCollection.prefetch: the next batch's input stage run ahead (on a GPU, on the input
stream beside the step's backward) changes nothing a training run computes, and a prefetched
find that the table outgrew is redone."""

import numpy as np
import pytest
import torch

from dynarec import DynamicTableOptions, EmbeddingCollection, FeatureConfig, Initializer, JaggedBatch, TableConfig
from dynarec.optim import Adagrad
from tests.reference_model import zipf_batch


def collection(device, prefetch_depth=None):
    features = ["user", FeatureConfig("hist", pooling="none")]
    tables = [
        # 300 keys through 64 slots: grows, then evicts every step
        TableConfig(
            name="dyn", dim=4, features=features, dynamic=DynamicTableOptions(64, init_capacity=16, bucket_size=4)
        ),
        TableConfig(name="fix", dim=4, num_embeddings=50, features=["item"], initializer=Initializer("uniform", 0.3)),
    ]
    return EmbeddingCollection(
        tables, Adagrad(lr=0.1, initial_accumulator_value=0.1), device=device, prefetch_depth=prefetch_depth
    )


def batches(device, n=10, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        feats = {"user": zipf_batch(rng, 6, 3, 300, a=1.1), "hist": zipf_batch(rng, 6, 4, 300, a=1.1)}
        feats["item"] = zipf_batch(rng, 6, 3, 50)
        kjt = JaggedBatch.from_lists(feats)
        out.append(kjt.pin_memory() if device == "cuda" else kjt)
    return out


def loss_of(out):
    return sum((v * (1 + torch.arange(v.numel(), device=v.device).view(v.shape) % 3)).sum() for v in out.values())


def assert_same_tables(a, b):
    for name in a.tables:
        da, db = a.tables[name].dump(), b.tables[name].dump()
        assert da.keys() == db.keys()
        for field in da:
            assert torch.equal(da[field], db[field]), (name, field)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_prefetched_run_equals_one_without(device, depth):
    """Batches prefetched ``depth`` steps ahead, through growth, inserts and evictions between a
    find and its use: the same outputs and tables. A find is redone only where the table changed
    in a way that can change its answer: never one step ahead."""
    plain, ahead = collection(device), collection(device, prefetch_depth=depth)
    data = batches(device, n=12)
    table, finds = ahead.tables["dyn"], []
    find = table.find
    table.find = lambda bags: finds.append(1) or find(bags)  # counts the finds of `ahead`
    for kjt in data[:depth]:
        ahead.prefetch(kjt)
    for i, kjt in enumerate(data):
        out_plain = plain(kjt)
        loss_of(out_plain).backward()
        out_ahead = ahead(kjt)
        loss_of(out_ahead).backward()
        if i + depth < len(data):
            ahead.prefetch(data[i + depth])  # once the backward is queued, as the trainer does
        for k in out_plain:
            assert torch.equal(out_plain[k], out_ahead[k]), (i, k)
    assert ahead.tables["dyn"].report()["evicted_keys"] > 0  # the finds ran ahead of evictions
    redone = len(finds) - len(data)
    assert redone == 0 if depth == 1 else 0 < redone < len(data)
    assert_same_tables(plain, ahead)


def test_a_find_made_ahead_holds_while_keys_are_only_added(device):
    coll = collection(device, prefetch_depth=2)
    coll.eval()
    table = coll.tables["dyn"]
    table.write_rows(torch.tensor([1, 2]), {"weight": torch.ones(2, 4)})
    warm = JaggedBatch.from_lists({"user": [[1]], "hist": [[2]], "item": [[0]]})
    cold = JaggedBatch.from_lists({"user": [[3]], "hist": [[1]], "item": [[0]]})
    warm, cold = (b.pin_memory() for b in (warm, cold)) if device == "cuda" else (warm, cold)
    coll.prefetch(warm)
    coll.prefetch(cold)
    table.write_rows(torch.tensor([3]), {"weight": torch.full((1, 4), 2.0)})  # adds key 3 in a free slot
    finds = []
    find = table.find
    table.find = lambda bags: finds.append(1) or find(bags)
    assert torch.equal(coll(warm)["user"].cpu(), torch.ones(1, 4))  # every key found then: holds
    assert finds == []
    assert torch.equal(coll(cold)["user"].cpu(), torch.full((1, 4), 2.0))  # key 3 was absent then: found again
    assert finds == [1]


def test_a_prefetched_find_is_redone_when_the_table_was_written_since(device):
    coll = collection(device)
    coll.eval()
    kjt = JaggedBatch.from_lists({"user": [[5]], "hist": [[]], "item": [[1]]})
    kjt = kjt.pin_memory() if device == "cuda" else kjt
    coll.prefetch(kjt)  # key 5 has no row yet
    coll.write_rows("dyn", torch.tensor([5]), {"weight": torch.full((1, 4), 3.0)})
    out = coll(kjt)
    assert torch.equal(out["user"].cpu(), torch.full((1, 4), 3.0))  # the written row, not the eval zeros


def test_a_prefetched_find_is_redone_after_an_aborted_step(device):
    plain, ahead = collection(device), collection(device)
    first, second = batches(device, n=2, seed=1)
    for coll in (plain, ahead):
        coll(first)  # creates rows...
        if coll is ahead:
            coll.prefetch(second)  # ...that this find sees
        coll.abort_step()  # ...and the abort takes back
        loss_of(coll(second)).backward()
    assert_same_tables(plain, ahead)


def test_a_prefetch_survives_a_forward_of_another_batch(device):
    """``a`` prefetched, then a training step of ``b`` (inserting, evicting): ``a``'s forward
    takes its prepared stage, finds again where ``b`` changed the table, and equals a run
    without prefetch."""
    plain, ahead = collection(device), collection(device)
    a, b = batches(device, n=2, seed=2)
    ahead.prefetch(a)
    for kjt in (b, a):
        loss_of(plain(kjt)).backward()
        loss_of(ahead(kjt)).backward()
    assert_same_tables(plain, ahead)


BAD_BATCHES = {
    "id": (
        lambda: JaggedBatch.from_lists({"user": [[1]], "hist": [[2]], "item": [[50]]}),  # item has rows 0..49
        "table 'fix', feature 'item': id 50 is out of range",
    ),
    "weight": (
        lambda: JaggedBatch.from_lists(
            {"user": [[1, 2]], "hist": [[3]], "item": [[4]]},
            {"user": [[1.0, float("nan")]], "hist": [[1.0]], "item": [[1.0]]},
        ),
        "feature 'user': per-sample weight nan is not a finite number",
    ),
}


@pytest.mark.parametrize("bad", sorted(BAD_BATCHES))
@pytest.mark.parametrize("prefetched", [True, False])
def test_a_bad_batch_raises_at_its_own_forward_and_writes_nothing(device, bad, prefetched):
    coll = collection(device)
    loss_of(coll(batches(device, n=1)[0])).backward()
    before = {name: t.dump() for name, t in coll.tables.items()}
    make, message = BAD_BATCHES[bad]
    kjt = make()
    if prefetched:
        coll.prefetch(kjt)  # nothing raised here: the step being run is not the bad batch's
    with pytest.raises(ValueError, match=message):
        coll(kjt)
    after = {name: t.dump() for name, t in coll.tables.items()}
    for name in before:
        assert all(torch.equal(before[name][k], after[name][k]) for k in before[name]), name


def test_a_find_made_ahead_is_redone_when_its_key_was_evicted_since(device):
    """Every key found (the find would hold through mere additions), then evicted: the lookup
    finds again and reads the eval initializer, not the row of the key now in that slot."""
    table = TableConfig(name="dyn", dim=4, features=["user"], dynamic=DynamicTableOptions(4, bucket_size=4))
    coll = EmbeddingCollection([table], Adagrad(lr=0.1), device=device, prefetch_depth=2)
    coll.eval()
    coll.write_rows("dyn", torch.tensor([1, 2, 3, 4]), {"weight": torch.ones(4, 4)})  # full: one bucket
    kjt = JaggedBatch.from_lists({"user": [[1]]})
    kjt = kjt.pin_memory() if device == "cuda" else kjt
    coll.prefetch(kjt)
    coll.write_rows("dyn", torch.tensor([5]), {"weight": torch.full((1, 4), 5.0)})  # evicts key 1 (ties: slot 0)
    assert not bool(coll.read_rows("dyn", torch.tensor([1]))["present"])
    assert torch.equal(coll(kjt)["user"].cpu(), torch.zeros(1, 4))


def test_a_prefetch_depth_below_one_is_refused():
    with pytest.raises(ValueError, match="prefetch_depth must be at least 1, got 0"):
        collection("cpu", prefetch_depth=0)
