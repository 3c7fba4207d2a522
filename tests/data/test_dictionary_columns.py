"""Dictionary-encoded string columns (Parquet's usual encoding of ids, read so where a column
is stored so): an id feature's ids are worked out once a distinct value and taken for each row,
and every batch equals the one built from the decoded column — values, lengths, weights,
defaults, missing values and the errors, which still name the row holding the bad value."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dynarec.data import ArrowBatchDataset, BatchBuilder, DataError, make_loader, shared_decode
from dynarec.data.reader import dictionary_encoded, read_table
from tests.data.test_kinds import H, config, id_feature

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def sparse(batch):
    kjt = batch.sparse
    w = kjt.weights_or_none()
    return kjt.values().tolist(), kjt.lengths().tolist(), None if w is None else w.tolist()


def encoded(table: pa.Table) -> pa.Table:
    """``table`` with its string column ``f`` dictionary-encoded."""
    i = table.schema.get_field_index("f")
    return table.set_column(i, "f", pa.chunked_array([c.dictionary_encode() for c in table.column("f").chunks]))


def rows(values, n=40, seed=0):
    """A column of ``n`` values drawn from ``values`` (None: a missing row) and a label."""
    rng = np.random.default_rng(seed)
    return pa.table({"f": pa.array([values[i] for i in rng.integers(0, len(values), n)], pa.string()), "clk": [0] * n})


FEATURES = {
    "hashed": (id_feature(hash_bucket_size=97), ["a", "b", "ccc", "d"]),
    "parsed, several a row, missing ones": (
        id_feature(num_buckets=50, separator=H, default_value=""),
        ["1", f"2{H}3", "", None, f"4{H}{H}5", "49"],
    ),
    "a default for missing ones": (
        id_feature(hash_bucket_size=10, separator="|", default_value="x"),
        ["a|b", None, ""],
    ),
    "dynamic, string keys": (id_feature(zch={"zch_size": 1000, "lru": {}}, value_type="string"), ["u1", "u2", "u3"]),
    "a sequence's last ids": (
        {"sequence_feature": {"feature_name": "f", "embedding_dim": 4, "sequence_length": 2, "num_buckets": 9}},
        ["1|2|3", "4", "5|6", "7|8|8|1"],
    ),
    "first values": (id_feature(num_buckets=10, separator="|", max_values=2, default_value=""), ["1|2|3", "4", None]),
    "weighted pairs": (id_feature(num_buckets=1000, weighted=True, separator=H), [f"12:0.9{H}123:0.21", "5:2", "7:1"]),
    "a vocabulary": (id_feature(vocab_list=["a", "b"], separator=H, default_value=""), ["a", f"b{H}a", "c", None]),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_a_dictionary_encoded_column_gives_the_batches_of_its_values(name):
    feature, values = FEATURES[name]
    b = BatchBuilder(config(feature))
    table = rows(values)
    whole = encoded(table)
    for start, n in [(0, 40), (0, 16), (16, 16), (32, 8)]:  # slices sharing one dictionary
        expect = b.build(table.slice(start, n), "t.parquet")
        got = b.build(whole.slice(start, n), "t.parquet")
        assert sparse(got) == sparse(expect), (start, n)
    assert b._by_value["f"].ids is not None  # (the values' ids were worked out, not the rows')


def test_the_values_ids_are_kept_for_an_equal_dictionary_and_worked_out_again_for_another():
    """A Parquet row group's batches each hold a copy of its dictionary: an equal one reuses the
    ids; another one of the same length (the next row group's) gets its own."""
    b = BatchBuilder(config(id_feature(num_buckets=100)))
    calls = []
    real = b._ids

    def counting(f, col, origin):
        calls.append(len(col))
        return real(f, col, origin)

    b._ids = counting
    first = pa.DictionaryArray.from_arrays(pa.array([0, 1, 2, 1], pa.int32()), pa.array(["10", "11", "12"]))
    copy = pa.DictionaryArray.from_arrays(pa.array([2, 2, 0, 1], pa.int32()), pa.array(["10", "11", "12"]))
    other = pa.DictionaryArray.from_arrays(pa.array([2, 2, 0, 1], pa.int32()), pa.array(["20", "21", "22"]))
    got = [sparse(b.build(pa.table({"f": col, "clk": [0] * 4}), "t.parquet"))[0] for col in (first, copy, other)]
    assert got == [[10, 11, 12, 11], [12, 12, 10, 11], [22, 22, 20, 21]]
    assert calls == [4, 3, 4, 4, 3]  # each build's call, and the values' of `first` and of `other`


def test_the_values_ids_are_worked_out_once_as_many_rows_came_with_them():
    """A loader's chunk holds a copy of its row group's dictionary, of more values than the
    chunk's rows: the rows' own path runs until as many rows came with equal dictionaries as
    they hold values, then the values' ids are worked out, once."""
    b = BatchBuilder(config(id_feature(hash_bucket_size=1000)))
    values = [f"v{i}" for i in range(100)]
    rng = np.random.default_rng(2)
    worked_out = []
    for _ in range(14):  # 10 rows a chunk, each with its own copy of the 100 values
        codes = pa.array(rng.integers(0, 100, 10).astype(np.int32))
        col = pa.DictionaryArray.from_arrays(codes, pa.array(list(values)))
        got = b.build(pa.table({"f": col, "clk": [0] * 10}), "t.parquet")
        expect = b.build(pa.table({"f": col.dictionary_decode(), "clk": [0] * 10}), "t.parquet")
        assert sparse(got) == sparse(expect)
        worked_out.append(b._by_value["f"].worked_out)
    assert worked_out == [False] * 9 + [True] * 5


def test_a_bad_value_is_named_by_its_row_and_one_no_row_holds_is_no_error():
    b = BatchBuilder(config(id_feature(num_buckets=8)))
    table = pa.table({"f": pa.array(["1", "2", "3", "1", "2", "9", "1", "2"]), "clk": [0] * 8})
    whole = encoded(table)
    with pytest.raises(DataError) as plain:
        b.build(table, "t.parquet")
    with pytest.raises(DataError) as e:
        b.build(whole, "t.parquet")
    assert (
        str(e.value)
        == str(plain.value)
        == "t.parquet, row 5: feature 'f' (column 'f'): id 9 is out of range [0, 8) (num_buckets)"
    )
    assert sparse(b.build(whole.slice(0, 5), "t.parquet"))[0] == [1, 2, 3, 1, 2]  # "9" is in the dictionary only


def test_a_missing_value_without_a_default_is_named_by_its_row():
    b = BatchBuilder(config(id_feature(hash_bucket_size=10)))
    table = encoded(pa.table({"f": pa.array(["a", "b", None, "a"]), "clk": [0] * 4}))
    with pytest.raises(DataError, match=r"t.parquet, row 2: feature 'f' \(column 'f'\): missing value"):
        b.build(table, "t.parquet")


def test_only_the_columns_of_id_features_alone_are_read_as_dictionaries():
    raw = {"raw_feature": {"feature_name": "r", "expression": "user:p"}}
    ids_of_p = {"id_feature": {"feature_name": "g", "expression": "user:p", "embedding_dim": 4, "hash_bucket_size": 5}}
    b = BatchBuilder(config(id_feature(hash_bucket_size=10), ids_of_p, raw))
    assert b.dictionary_columns() == frozenset({"f"})  # p is read as numbers too; clk is the label


def test_the_reader_takes_dictionaries_only_of_columns_stored_dictionary_encoded(tmp_path):
    n = 20_000
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "small": pa.array([f"v{i}" for i in rng.integers(0, 50, n)]),
            "plain": pa.array([f"v{i}" for i in rng.integers(0, 50, n)]),
            "unique": pa.array([f"a long distinct value {i}" for i in range(n)]),  # outgrows a small dictionary page
        }
    )
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, use_dictionary=["small", "unique"], dictionary_pagesize_limit=64 * 1024)
    meta = pq.ParquetFile(path).metadata
    assert dictionary_encoded(meta, [0], frozenset({"small", "plain", "unique"})) == ["small"]
    assert dictionary_encoded(meta, [0], frozenset({"plain"})) == []


@pytest.mark.parametrize("workers, chunk_rows", [(0, None), (2, None), (2, 700), (3, 1_000), (2, 100)])
def test_batches_read_with_dictionaries_equal_the_files_values(tmp_path, monkeypatch, workers, chunk_rows):
    """Row groups of 3,000 rows stored dictionary-encoded, read by one process and by workers
    decoding for each other (in chunks of the row group's rows or fewer, each holding the
    dictionary): the batches are those of the decoded values."""
    if chunk_rows is not None:
        monkeypatch.setattr(shared_decode, "CHUNK_ROWS", chunk_rows)
    n = 9_000
    rng = np.random.default_rng(1)
    table = pa.table(
        {
            "f": pa.array([None if i % 97 == 0 else f"{i % 40}{H}{i % 7}" for i in rng.integers(0, 10_000, n)]),
            "price": rng.random(n),
            "clk": rng.integers(0, 2, n),
        }
    )
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=3_000)
    price = {"raw_feature": {"feature_name": "price"}}  # (a column read whole beside the codes)
    b = BatchBuilder(config(id_feature(num_buckets=50, separator=H, default_value=""), price))
    assert dictionary_encoded(pq.ParquetFile(path).metadata, [0, 1, 2], b.dictionary_columns()) == ["f"]
    plain = read_table(str(path), ["f", "price", "clk"])
    assert not pa.types.is_dictionary(plain.schema.field("f").type)

    def contents(batch):
        return sparse(batch), batch.dense["price"].tolist(), batch.labels.tolist()

    expect = [contents(b.build(plain.slice(i, 1_000), "t.parquet")) for i in range(0, n, 1_000)]
    got = [contents(batch) for batch in make_loader(ArrowBatchDataset([str(path)], b, 1_000), workers)]
    assert got == expect
    assert torch.tensor(got[0][0][1]).sum() > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_workers_work_out_a_dictionary_they_mapped_read_only(tmp_path, workers):
    """Workers map each other's decoded chunks read-only; the C++ extension took only writable
    memory, so hashing a mapped dictionary's values (a feature without a default reads them as
    they are) failed every batch with "could not retrieve buffer from object"."""
    n = 2_000
    path = tmp_path / "t.parquet"
    pq.write_table(
        pa.table({"f": [f"u{i % 10}" for i in range(n)], "clk": [i % 2 for i in range(n)]}), path, row_group_size=1_000
    )
    b = BatchBuilder(config(id_feature(hash_bucket_size=10)))
    plain = read_table(str(path), ["f", "clk"])
    expect = [sparse(b.build(plain.slice(i, 500), "t.parquet")) for i in range(0, n, 500)]
    assert [sparse(batch) for batch in make_loader(ArrowBatchDataset([str(path)], b, 500), workers)] == expect


def test_codes_of_the_narrowest_type_with_missing_rows():
    """int8 codes of 128 values: a missing row's code (the value after them) did not fit."""
    b = BatchBuilder(config(id_feature(hash_bucket_size=10, default_value="")))
    codes = pa.array([None if i % 3 == 0 else i % 128 for i in range(384)], pa.int8())
    col = pa.DictionaryArray.from_arrays(codes, pa.array([f"v{i}" for i in range(128)]))
    got = b.build(pa.table({"f": col, "clk": [0] * 384}), "t.parquet")
    assert sparse(got) == sparse(b.build(pa.table({"f": col.dictionary_decode(), "clk": [0] * 384}), "t.parquet"))


def test_a_label_column_is_read_as_numbers_whatever_an_id_feature_reads_of_it(tmp_path):
    """A label column an id feature read too came as a dictionary, which the labels did not
    take: " 1 " was refused, and a bad label lost its row."""
    g = {"id_feature": {"feature_name": "g", "expression": "user:clk", "embedding_dim": 4, "hash_bucket_size": 10}}
    b = BatchBuilder(config(id_feature(hash_bucket_size=10), g))
    assert b.dictionary_columns() == frozenset({"f"})
    labels = [str(i % 2) for i in range(1_000)]
    labels[7] = " 1 "
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"f": [f"u{i % 9}" for i in range(1_000)], "clk": labels}), path)
    (batch,) = make_loader(ArrowBatchDataset([str(path)], b, 1_000), 0)
    assert batch.labels.flatten()[5:9].tolist() == [1.0, 0.0, 1.0, 0.0]
    categorical = pa.table({"f": ["a", "b"], "clk": pa.array(["1", "x"]).dictionary_encode()})  # (a file's own)
    with pytest.raises(DataError, match="row 1: label column 'clk': 'x' is not a number"):
        b.build(categorical, "t.parquet")
