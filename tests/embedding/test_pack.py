"""pack (dynarec.embedding.pack): the features of a batch that lie one after another in it are
packed without a copy (their ids one view of the batch's), bags of one id each get their offsets
without adding lengths, and either way the bags equal those of the general path."""

import numpy as np
import pytest
import torch

from dynarec.embedding.jagged import JaggedBatch, split_features
from dynarec.embedding.pack import _span, pack


def _inputs(batch: JaggedBatch, names: list[str], pooling: str = "sum"):
    slices = split_features(batch)
    return [(n, pooling, slices[n]) for n in names]


def _general(inputs):
    """The bags as the general path makes them: each feature's ids and lengths concatenated."""
    ids = torch.cat([s.values for *_, s in inputs])
    lengths = torch.cat([s.lengths for *_, s in inputs])
    return ids, torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


@pytest.mark.parametrize("order", [["a", "b", "c"], ["b", "c"], ["c", "a"]])
@pytest.mark.parametrize("one_id_each", [True, False])
def test_features_in_the_batchs_order_are_packed_as_a_view(order, one_id_each):
    lists = {"a": [[1], [2], [3]], "b": [[4], [5], [6]], "c": [[7], [8], [9]]}
    if not one_id_each:
        lists["b"] = [[4, 40], [], [6]]
    batch = JaggedBatch.from_lists(lists)
    inputs = _inputs(batch, order)
    bags, layout = pack(inputs)
    ids, offsets = _general(inputs)
    assert torch.equal(bags.ids, ids) and torch.equal(bags.offsets, offsets)
    assert [f.num_bags for f in layout.features] == [3] * len(order)
    in_order = order != ["c", "a"]
    assert (bags.ids.untyped_storage().data_ptr() == batch.values().untyped_storage().data_ptr()) == in_order


def test_a_span_is_refused_where_pieces_do_not_follow_each_other():
    whole = torch.arange(10)
    assert torch.equal(_span([whole[0:3], whole[3:5], whole[5:10]]), whole)
    assert _span([whole[0:3], whole[4:6]]) is None  # a gap
    assert _span([whole[3:5], whole[0:3]]) is None  # out of order
    assert _span([whole[0:3], torch.arange(3, 6)]) is None  # another tensor
    assert _span([whole[0:4:2], whole[4:6]]) is None  # strided
    assert _span([whole[0:3], whole[3:6].int()]) is None  # another dtype
    shared = np.arange(10)  # two storages beginning at one address, the first the shorter
    assert _span([torch.from_numpy(shared[:4]), torch.from_numpy(shared)[4:]]) is None
    weights = torch.ones(6, requires_grad=True)
    assert _span(list(weights.split(3))) is None  # a gradient would reach the first piece only


def test_sequences_and_weights_keep_the_general_path():
    batch = JaggedBatch.from_lists(
        {"a": [[1, 2], [3]], "b": [[4], [5, 6]]}, {"a": [[1.0, 2.0], [3.0]], "b": [[4.0], [5.0, 6.0]]}
    )
    bags, layout = pack(_inputs(batch, ["a", "b"], "none"))
    assert [f.num_bags for f in layout.features] == [4, 4]  # padded [2, 2] positions each
    assert bags.offsets.tolist() == [0, 1, 2, 3, 3, 4, 4, 5, 6]
    assert bags.weights.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # one view of the batch's weights
    bags, _ = pack(_inputs(batch, ["a", "b"], "mean"))
    assert bags.weights.tolist() == pytest.approx([0.5, 1.0, 3.0, 4.0, 2.5, 3.0])
