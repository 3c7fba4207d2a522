"""A table's training step: begin -> commit (backward) or abort, and an abort leaves no trace."""

import pytest
import torch

from dynarec import AdmissionConfig, DynamicTableOptions, EmbeddingCollection, JaggedBatch, TableConfig
from dynarec.embedding.jagged import split_features
from dynarec.embedding.pack import pack, unpack
from dynarec.embedding.step import StepPendingError
from dynarec.optim import Adagrad, Adam

D = 4


def dumps(coll):
    return {n: t.dump() for n, t in coll.tables.items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for k in a[name]:
            assert torch.equal(a[name][k], b[name][k]), (name, k)


def train(coll, feats):
    out = coll(JaggedBatch.from_lists(feats))
    sum(v.sum() for v in out.values()).backward()


def test_abort_restores_evicted_keys_with_their_rows_and_states():
    # One bucket of 4 slots at max capacity, step scores: new keys evict the oldest rows.
    coll = EmbeddingCollection(
        [TableConfig(name="d", dim=D, features=["f"], dynamic=DynamicTableOptions(4, bucket_size=4))], Adam(lr=0.1)
    )
    for keys in ([1, 2], [3, 4], [1, 3]):
        train(coll, {"f": [keys]})
    t = coll.tables["d"]
    before = dumps(coll)
    evicted_before = t.evicted_keys
    coll(JaggedBatch.from_lists({"f": [[7, 8]]}))  # evicts 2 and 4 (scores 1 and 2)
    assert t.evicted_keys == evicted_before + 2 and t.step == 4
    assert not bool(t.read_rows(torch.tensor([2]))["present"][0])
    coll.abort_step()  # e.g. the loss was NaN: no backward will run
    assert_same(before, dumps(coll))
    assert t.evicted_keys == evicted_before and t.step == 3 and not t.steps.pending
    # Training goes on as if the aborted step never happened.
    train(coll, {"f": [[1]]})
    assert t.step == 4


def test_abort_takes_back_admission_counts_and_admitted_rows():
    coll = EmbeddingCollection(
        [
            TableConfig(
                name="d",
                dim=D,
                features=["f"],
                dynamic=DynamicTableOptions(64, bucket_size=4, admission=AdmissionConfig(threshold=2)),
            )
        ],
        Adagrad(lr=0.1, initial_accumulator_value=0.1),
    )
    train(coll, {"f": [[5, 6]]})  # counts 5:1, 6:1; no rows yet
    t = coll.tables["d"]
    assert t.size == 0
    before = dumps(coll)
    coll(JaggedBatch.from_lists({"f": [[5, 9]]}))  # 5 reaches 2: admitted; 9 counted
    assert t.size == 1
    coll.abort_step()
    assert_same(before, dumps(coll))
    assert t.size == 0


def test_abort_undoes_a_growth():
    coll = EmbeddingCollection(
        [
            TableConfig(
                name="d", dim=D, features=["f"], dynamic=DynamicTableOptions(256, init_capacity=8, bucket_size=4)
            )
        ],
        Adagrad(lr=0.1),
    )
    train(coll, {"f": [[1, 2, 3]]})
    t = coll.tables["d"]
    before = dumps(coll)
    coll(JaggedBatch.from_lists({"f": [list(range(10, 60))]}))
    assert t.capacity > 8
    coll.abort_step()
    assert t.capacity == 8 and t.size == 3
    assert_same(before, dumps(coll))


def test_scores_change_only_when_the_step_commits():
    coll = EmbeddingCollection(
        [
            TableConfig(
                name="d", dim=D, features=["f"], dynamic=DynamicTableOptions(64, bucket_size=4, score_strategy="lfu")
            )
        ],
        Adagrad(lr=0.1),
    )
    train(coll, {"f": [[1, 1, 2]]})
    t = coll.tables["d"]
    assert dict(zip(t.dump()["keys"].tolist(), t.dump()["scores"].tolist())) == {1: 2, 2: 1}
    out = coll(JaggedBatch.from_lists({"f": [[1]]}))
    assert dict(zip(t.dump()["keys"].tolist(), t.dump()["scores"].tolist())) == {1: 2, 2: 1}
    out["f"].sum().backward()
    assert dict(zip(t.dump()["keys"].tolist(), t.dump()["scores"].tolist())) == {1: 3, 2: 1}


def test_step_counter_moves_only_through_the_lifecycle():
    coll = EmbeddingCollection([TableConfig(name="f", dim=D, num_embeddings=10, features=["a"])], Adam(lr=0.1))
    t = coll.tables["f"]
    assert t.step == 0
    out = coll(JaggedBatch.from_lists({"a": [[1]]}))
    assert t.step == 1 and len(t.steps.pending) == 1
    with pytest.raises(StepPendingError, match="table 'f': load while a training step is pending"):
        t.load(t.dump())
    out["a"].sum().backward()
    assert t.step == 1 and not t.steps.pending
    coll.eval()
    coll(JaggedBatch.from_lists({"a": [[1]]}))
    assert t.step == 1
    with pytest.raises(AttributeError):
        t.step = 5  # no setter: the counter is the lifecycle's


def late_backward_tables():
    """A dynamic table of one bucket of 2 slots at max capacity (a new key evicts), a fixed
    table, a group of two fixed tables of one dim (one lookup, one step for both), and a group
    of two dynamic tables like the first (one index of two partitions)."""
    coll = EmbeddingCollection(
        [
            TableConfig(name="d", dim=D, features=["f"], dynamic=DynamicTableOptions(2, bucket_size=2)),
            TableConfig(name="x", dim=D, num_embeddings=10, features=["a"]),
            TableConfig(name="y", dim=D + 1, num_embeddings=10, features=["b"]),
            TableConfig(name="z", dim=D + 1, num_embeddings=10, features=["c"]),
            TableConfig(name="g", dim=D + 2, features=["g"], dynamic=DynamicTableOptions(2, bucket_size=2)),
            TableConfig(name="h", dim=D + 2, features=["h"], dynamic=DynamicTableOptions(2, bucket_size=2)),
        ],
        Adagrad(lr=0.5),
    )
    assert coll.lookup_groups == [("d",), ("x",), ("y", "z"), ("g", "h")]
    return coll


def features(key: int) -> dict[str, list[list[int]]]:
    return {"f": [[key]], "a": [[key % 10]], "b": [[key % 10]], "c": [[key % 10]], "g": [[key]], "h": [[key]]}


def batch(key: int):
    return JaggedBatch.from_lists(features(key))


@pytest.mark.parametrize("table", ["d", "x", "y", "g"])
@pytest.mark.parametrize("late", ["after its abort", "after a later step's commit and a forward"])
def test_a_stale_steps_backward_is_refused_before_any_row_changes(table, late):
    """The backward of a step aborted updates nothing, on any table kind; that of a step a later
    step's backward committed, with a forward since that gave its dynamic rows to other keys,
    updates nothing either (it updated another key's row: the late gradient landed on the key
    that took the slot). A fixed table's rows stay its ids': there the late update applies."""
    coll = late_backward_tables()
    for key in (1, 2):
        train(coll, features(key))
    out_a = coll(batch(3))
    if late == "after its abort":
        coll.abort_step()
        out_b = coll(batch(4))
    else:
        out_b = coll(batch(4))
        sum(v.sum() for v in out_b.values()).backward()  # commits step A too (abandoned)
        out_b = coll(batch(5))  # a forward since: slots move
    before = dumps(coll)
    feature = {"d": "f", "x": "a", "y": "b", "g": "g"}[table]
    if late != "after its abort" and table in ("x", "y"):
        (100 * out_a[feature]).sum().backward()  # a fixed row is its id's: the late update applies
        assert not torch.equal(before[table]["weight"], coll.tables[table].dump()["weight"])
    else:
        named = "g', 'h" if table == "g" and late != "after its abort" else table  # (both tables' rows moved)
        with pytest.raises(RuntimeError, match=rf"table '{named}': the backward of training step \d+ came after"):
            (100 * out_a[feature]).sum().backward()
        assert_same(before, dumps(coll))
    sum(v.sum() for v in out_b.values()).backward()  # the live step still trains


def test_two_lookups_before_one_backward_both_apply():
    """A model that looks a table up twice before one backward: the later step's hook commits
    the earlier one, whose own backward, in the same pass, still applies (nothing changed)."""
    coll, twice = late_backward_tables(), late_backward_tables()
    for c in (coll, twice):
        train(c, features(1))
    first, second = twice(batch(1)), twice(batch(1))
    (sum(v.sum() for v in first.values()) + sum(v.sum() for v in second.values())).backward()
    for _ in range(2):  # the same two updates, one after the other
        train(coll, features(1))
    assert_same(dumps(coll), dumps(twice))


def test_a_no_grad_training_forward_commits_at_once():
    coll = EmbeddingCollection(
        [TableConfig(name="d", dim=D, features=["f"], dynamic=DynamicTableOptions(64))], Adagrad(lr=0.1)
    )
    with torch.no_grad():
        coll(JaggedBatch.from_lists({"f": [[1, 2]]}))
    t = coll.tables["d"]
    assert t.size == 2 and t.step == 1 and not t.steps.pending


def test_forward_is_pack_lookup_unpack():
    from dynarec import FeatureConfig

    features = ["item", FeatureConfig("hist", pooling="none"), FeatureConfig("m", pooling="mean")]
    coll = EmbeddingCollection([TableConfig(name="t", dim=D, num_embeddings=20, features=features)], Adagrad())
    coll.eval()
    kjt = JaggedBatch.from_lists(
        {"item": [[1], [2, 3]], "hist": [[4, 5, 6], []], "m": [[7, 8], [9]]},
        {"item": [[1.0], [0.5, 2.0]], "hist": [[1.0, 1.0, 3.0], []], "m": [[1.0, 1.0], [4.0]]},
    )
    table = coll.tables["t"]
    bags, layout = table.pack(split_features(kjt))
    # item: 2 bags; hist: a bag per position of the padded [2, 3] (3 of one id, 3 empty); m: 2
    # bags with 1/L in the weights.
    assert bags.offsets.tolist() == [0, 1, 3, 4, 5, 6, 6, 6, 6, 8, 9]
    assert bags.weights.tolist() == [1.0, 0.5, 2.0, 1.0, 1.0, 3.0, 0.5, 0.5, 4.0]
    pooled = table.lookup(bags, train=False)
    assert pooled.shape == (10, D)
    out = unpack(pooled, layout)
    assert out["hist"].data_ptr() == pooled[2].data_ptr()  # a view of the lookup's rows: no padding pass
    expected = coll(kjt)
    assert out.keys() == expected.keys()
    for k in out:
        assert torch.equal(out[k], expected[k]), k
    assert out["hist"].shape == (2, 3, D) and torch.equal(out["hist"][1], torch.zeros(3, D))
    # Unpadded (bags sent to other ranks): one bag per id, padded by unpack; the same outputs.
    slices = split_features(kjt)
    bags, layout = pack(
        [(f.name, table.config.pooling_of(f), slices[f.name]) for f in table.features], pad_sequences=False
    )
    assert bags.offsets.tolist() == [0, 1, 3, 4, 5, 6, 8, 9]
    out = unpack(table.lookup(bags, train=False), layout)
    for k in out:
        assert torch.equal(out[k], expected[k]), k


def test_a_groups_late_backward_names_the_table_whose_rows_moved():
    """In a group of dynamic tables, the refusal names the table whose rows were given to other
    keys, not the group's first one."""
    coll = late_backward_tables()

    def step_of(h_key: int):
        return coll(JaggedBatch.from_lists({**features(1), "h": [[h_key]]}))

    for key in (1, 2):
        sum(v.sum() for v in step_of(key).values()).backward()
    out_a = step_of(3)
    sum(v.sum() for v in step_of(4).values()).backward()  # commits step A too
    out_b = step_of(5)  # g's row keeps key 1; h's rows move
    before = dumps(coll)
    with pytest.raises(RuntimeError, match=r"table 'h': the backward of training step \d+ came after"):
        out_a["h"].sum().backward()
    assert_same(before, dumps(coll))
    sum(v.sum() for v in out_b.values()).backward()
