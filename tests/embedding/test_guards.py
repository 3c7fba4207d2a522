"""Library misuse is refused before anything is written."""

import pytest
import torch

from dynarec import DynamicTableOptions, EmbeddingCollection, JaggedBatch, TableConfig
from dynarec.optim import Adagrad, Adam


def collection():
    return EmbeddingCollection(
        [
            TableConfig(name="f", dim=4, num_embeddings=10, features=["a"]),
            TableConfig(name="d", dim=4, dynamic=DynamicTableOptions(64), features=["b"]),
        ],
        Adam(lr=0.1),
    )


def dumps(coll):
    return {n: t.dump() for n, t in coll.tables.items()}


def same(a, b):
    return all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_per_sample_weight_is_refused_and_writes_nothing(bad):
    coll = collection()
    before = dumps(coll)
    kjt = JaggedBatch.from_lists({"a": [[1, 2]], "b": [[5]]}, {"a": [[1.0, bad]], "b": [[1.0]]})
    with pytest.raises(ValueError, match=rf"feature 'a': per-sample weight {bad} is not a finite number"):
        coll(kjt)
    assert same(before, dumps(coll)) and coll.tables["d"].size == 0


def test_a_feature_twice_in_one_batch_is_refused():
    coll = collection()
    kjt = JaggedBatch(["a", "b", "a"], torch.tensor([1, 5, 2]), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match=r"feature\(s\) \['a'\] appear more than once"):
        coll(kjt)


def test_lengths_and_values_on_different_devices_are_refused():
    kjt = JaggedBatch(["a", "b"], torch.tensor([1, 5]), torch.tensor([1, 1], device="meta"))
    with pytest.raises(ValueError, match=r"lengths are on meta but values on cpu; move the whole batch to one device"):
        collection()(kjt)


def test_weights_on_another_device_and_lengths_that_are_not_integers_are_refused():
    """Weights on another device than the ids met torch's raw error at a host read; float or
    bool lengths were taken as counts (0.5 and 1.5: "lengths add up to 1 ids but values holds 2")."""
    kjt = JaggedBatch(["a", "b"], torch.tensor([1, 5]), torch.tensor([1, 1]), torch.ones(2, device="meta"))
    with pytest.raises(ValueError, match=r"weights are on meta but values on cpu; move the whole batch to one device"):
        collection()(kjt)
    for lengths in (torch.tensor([0.5, 1.5]), torch.tensor([True, True])):
        kjt = JaggedBatch(["a", "b"], torch.tensor([1, 5]), lengths)
        with pytest.raises(ValueError, match=r"lengths must be int64 \(or int32\), got torch\.(float32|bool)"):
            collection()(kjt)


def test_a_second_backward_through_a_step_is_refused_and_updates_once():
    coll = EmbeddingCollection([TableConfig(name="f", dim=4, num_embeddings=10, features=["a"])], Adagrad(lr=0.5))
    out = coll(JaggedBatch.from_lists({"a": [[3]]}))["a"].sum()
    out.backward(retain_graph=True)
    once = coll.read_rows("f", torch.tensor([3]))
    with pytest.raises(RuntimeError, match=r"table 'f': a second backward through the lookup of training step 1"):
        out.backward()
    again = coll.read_rows("f", torch.tensor([3]))
    assert all(torch.equal(once[k], again[k]) for k in once)


@pytest.mark.parametrize(
    "table, message",
    [
        (
            TableConfig(name="huge", dim=16, dynamic=DynamicTableOptions(10**12, init_capacity=4096), features=["x"]),
            r"table 'huge': 135\.5 TiB = 1,000,000,000,000 rows x dim 16 .* dynamicemb\.max_capacity",
        ),
        (
            TableConfig(name="wide", dim=10**6, num_embeddings=100_000, features=["x"]),
            r"table 'wide': 745\.1 GiB = 100,000 rows x dim 1000000 .* num_buckets and embedding_dim",
        ),
        (TableConfig(name="long", dim=8, num_embeddings=10**12, features=["x"]), r"table 'long'"),
    ],
)
def test_tables_that_do_not_fit_are_refused_before_allocating(table, message):
    with pytest.raises(ValueError, match=r"the tables need .* at their (largest|peak .*) but .* is available on cpu"):
        EmbeddingCollection([table], Adagrad())
    with pytest.raises(ValueError, match=message):
        EmbeddingCollection([table], Adagrad())


def test_a_growing_table_must_fit_with_the_allocation_it_grows_from():
    """Growing by doubling, a dynamic table keeps the rows, states and index it grows from until
    the step commits (so that the step can be undone): 4,096 -> 8,192 -> 16,384 -> 20,000 rows
    holds 16,384 rows' more at its last growth. A budget between its largest and that peak refuses
    it, naming the growth; starting at max_capacity it fits."""
    from dynarec.embedding.memory import INDEX_BYTES_PER_SLOT, check_fits, table_bytes

    spec = Adagrad()
    growing = TableConfig(name="g", dim=8, dynamic=DynamicTableOptions(20_000, init_capacity=4096), features=["x"])
    b = table_bytes(growing, spec)
    row = 8 * 4 + 8 * 4 + INDEX_BYTES_PER_SLOT  # weight, Adagrad state, index slot
    assert (b.rows, b.total, b.growth) == (20_000, 20_000 * row, 16_384 * row)
    budget = b.total + b.growth // 2
    with pytest.raises(ValueError, match=r"(?s)at their peak .* table 'g': .* more while it grows to them"):
        check_fits([(growing, spec)], torch.device("cpu"), budget)
    whole = TableConfig(name="g", dim=8, dynamic=DynamicTableOptions(20_000), features=["x"])
    assert table_bytes(whole, spec).growth == 0
    check_fits([(whole, spec)], torch.device("cpu"), budget)


@pytest.mark.parametrize("field", ["values", "lengths", "weights"])
def test_two_dimensional_batch_tensors_are_refused_by_name(field):
    coll = collection()
    before = dumps(coll)
    parts = {"values": torch.tensor([1, 5, 2]), "lengths": torch.tensor([2, 1]), "weights": torch.ones(3)}
    parts[field] = parts[field][:, None]
    kjt = JaggedBatch(["a", "b"], parts["values"], parts["lengths"], parts["weights"])
    with pytest.raises(ValueError, match=rf"the batch's {field} must be 1-D .*got shape \("):
        coll(kjt)
    assert same(before, dumps(coll)) and coll.tables["d"].size == 0


def test_weights_are_checked_from_what_their_batch_was_made_with():
    """A batch from a DataLoader worker says whether its weights are all finite (worked out where
    it was built): the check reads that, not the weights; unsaid, the weights are read."""
    kjt = JaggedBatch.from_lists({"a": [[1, 2]], "b": [[5]]}, {"a": [[1.0, float("nan")]], "b": [[1.0]]})
    with pytest.raises(ValueError, match=r"feature 'a': per-sample weight nan is not a finite number"):
        collection()(kjt.with_id_ranges([(1, 2), (5, 5)], weights_finite=None))
    with pytest.raises(ValueError, match=r"feature 'a': per-sample weight nan is not a finite number"):
        collection()(kjt.with_id_ranges([(1, 2), (5, 5)], weights_finite=False))
    collection()(kjt.with_id_ranges([(1, 2), (5, 5)], weights_finite=True))  # (what its maker said)


def test_a_second_backward_through_grouped_tables_is_refused_and_updates_once():
    """Tables sharing one lookup commit their steps through one hook; a second backward through it
    is refused for the first of them, and no table's rows move again."""
    tables = [TableConfig(name=n, dim=4, num_embeddings=10, features=[n]) for n in ("f", "g")]
    coll = EmbeddingCollection(tables, Adagrad(lr=0.5))
    assert coll.lookup_groups == [("f", "g")]
    out = coll(JaggedBatch.from_lists({"f": [[3]], "g": [[4]]}))
    loss = out["f"].sum() + out["g"].sum()
    loss.backward(retain_graph=True)
    assert [coll.tables[n].step for n in ("f", "g")] == [1, 1]
    once = dumps(coll)
    with pytest.raises(RuntimeError, match=r"table 'f': a second backward through the lookup of training step 1"):
        loss.backward()
    assert same(once, dumps(coll))
