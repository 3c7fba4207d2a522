"""Sequences of several ids an element (TorchEasyRec's ``value_dim: 0`` in a sequence): the batch
carries every id of a row and the ids of each element; the model reads one pooled embedding an
element."""

import pyarrow as pa
import pytest
import torch

from dynarec.config import config_from_dict
from dynarec.data import BatchBuilder, DataError
from dynarec.models.inputs import pool_elements
from tests.pipeline_fixtures import config_dict


def several(pooling="sum", **extra):
    """BASE_CONFIG with hist_item_id holding several ids an element ('1\\x1d2|3'); its sequence
    group's cate sequence dropped (the two would not be one length per row)."""
    c = config_dict()
    seq = c["feature_configs"][4]["sequence_feature"]
    seq.update(value_dim=0, pooling=pooling, **extra)
    c["feature_configs"].pop(5)
    c["model"]["feature_groups"][2]["feature_names"] = ["item_id", "hist_item_id"]
    return config_from_dict(c)


def table(hist):
    n = len(hist)
    return pa.table(
        {
            "user_id": ["u"] * n,
            "age": [1] * n,
            "item_id": [5] * n,
            "cate_id": [1] * n,
            "hist_item_id": hist,
            "price": [10.0] * n,
            "clk": [1] * n,
        }
    )


def test_the_batch_carries_every_id_and_each_elements_ids():
    b = BatchBuilder(several()).build(table(["1\x1d2|3", "", "4|5\x1d6\x1d7|8"]), "t.parquet")
    keys = b.sparse.keys()
    i = keys.index("hist_item_id")
    lengths = b.sparse.lengths().view(len(keys), 3)[i]
    assert lengths.tolist() == [3, 0, 5]  # ids a row
    start = int(b.sparse.lengths().view(len(keys), 3)[:i].sum())
    assert b.sparse.values()[start : start + 8].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert b.element_lengths["hist_item_id"].tolist() == [[2, 1, 0], [0, 0, 0], [1, 3, 1]]
    assert b.sequence_lengths(["hist_item_id"])["hist_item_id"].tolist() == [2, 0, 3]  # elements a row


def test_the_last_sequence_length_elements_are_kept_with_all_their_ids():
    b = BatchBuilder(several()).build(table(["1|2\x1d3|4|5|6|7|8\x1d9"]), "t.parquet")  # 7 elements, 6 kept
    assert b.element_lengths["hist_item_id"].tolist() == [[2, 1, 1, 1, 1, 2]]
    keys = b.sparse.keys()
    start = int(b.sparse.lengths().view(len(keys), 1)[: keys.index("hist_item_id")].sum())
    assert b.sparse.values()[start:].tolist()[:8] == [2, 3, 4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize(
    "hist, message",
    [
        (["1||2"], r"t.parquet, row 0: feature 'hist_item_id' .*empty token between '\|' separators"),
        (["1|2", "3\x1d\x1d4"], r"t.parquet, row 1: feature 'hist_item_id' .*sequence element"),
        (["1|2", "7|300"], r"t.parquet, row 1: feature 'hist_item_id' .*300"),  # past the table's 200 rows
    ],
)
def test_a_bad_element_names_its_row(hist, message):
    with pytest.raises(DataError, match=message):
        BatchBuilder(several()).build(table(hist), "t.parquet")


def test_value_separator_must_differ_from_separator():
    with pytest.raises(Exception, match=r"value_separator '\|' \(between an element's ids\) must differ"):
        several(value_separator="|")


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_pool_elements_pools_each_elements_rows(pooling):
    g = torch.Generator().manual_seed(0)
    element_lengths = torch.tensor([[2, 1, 0], [0, 0, 0], [1, 3, 1]])
    ids = element_lengths.sum(1)
    seq = torch.randn(3, 5, 4, generator=g)
    seq[torch.arange(5)[None, :] >= ids[:, None]] = 0  # the collection's zero padding
    out = pool_elements(seq, element_lengths, pooling)
    assert out.shape == (3, 3, 4)
    for b in range(3):
        start = 0
        for e, n in enumerate(element_lengths[b].tolist()):
            rows = seq[b, start : start + n]
            want = rows.sum(0) if pooling == "sum" else rows.sum(0) / max(n, 1)
            torch.testing.assert_close(out[b, e], want)
            start += n


def test_the_model_reads_one_pooled_embedding_an_element(tmp_path):
    """model_inputs (train, export and serving's one path) hands the model the element sums of
    the ids' rows, and the elements' count as the sequence's length."""
    from dynarec.models.inputs import model_inputs
    from dynarec.train.trainer import Trainer

    config = several()
    task = Trainer(config, tmp_path / "m", progress=False).task.eval()
    batch = BatchBuilder(config).build(table(["1\x1d2|3", "4", "5|6\x1d7\x1d8"]), "t.parquet")
    with torch.no_grad():
        rows = task.embeddings(batch.sparse)["hist_item_id"]  # [3, 4, 8]: ids a row
        emb, lengths, _ = model_inputs(task.embeddings, batch, task.sequence_features, "cpu", task.element_pooling)
    assert lengths["hist_item_id"].tolist() == [2, 1, 2]
    seq = emb["hist_item_id"]
    assert seq.shape == (3, 2, 8)
    torch.testing.assert_close(seq[0, 0], rows[0, 0] + rows[0, 1])
    torch.testing.assert_close(seq[0, 1], rows[0, 2])
    torch.testing.assert_close(seq[1, 1], torch.zeros(8))
    torch.testing.assert_close(seq[2, 1], rows[2, 1] + rows[2, 2] + rows[2, 3])
