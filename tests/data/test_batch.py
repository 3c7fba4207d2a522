"""Batch building and readers: values, layouts, and an error naming the culprit per bad input."""

import pickle
import re

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

from dynarec.config import config_from_dict
from dynarec.data import ArrowBatchDataset, BatchBuilder, DataError, make_loader
from dynarec.embedding.jagged import split_features
from dynarec.features import DYNAMIC_KEY_BUCKETS, native, to_hash_bucket_fast
from tests.matrix import needs_fg_kernels
from tests.pipeline_fixtures import config_dict

ROWS = {
    "user_id": ["u1", "u2", "u1"],
    "age": [1, 2, 3],
    "item_id": [5, 6, 7],
    "cate_id": [1, 2, 3],
    "hist_item_id": ["1|2|3|4|5|6|7|8", "", "9"],
    "hist_cate_id": ["1|1|1|1|1|1|1|2", "", "3"],
    "price": [10.0, 20.0, 30.0],
    "clk": [1, 0, 1],
}


def builder():
    return BatchBuilder(config_from_dict(config_dict(eval={"metrics": ["auc", "grouped_auc"]})))


def table(**changes):
    rows = {**ROWS, **changes}
    return pa.table(rows)


def test_batch_values_and_layout():
    b = builder().build(table(), "t.parquet")
    kjt = b.sparse
    assert kjt.keys() == ["user_id", "age", "item_id", "cate_id", "hist_item_id", "hist_cate_id"]
    lengths = kjt.lengths().view(6, 3)
    assert lengths[4].tolist() == [6, 0, 1]  # truncated to sequence_length 6, empty, one
    values = kjt.values()
    users = to_hash_bucket_fast(["u1", "u2", "u1"], DYNAMIC_KEY_BUCKETS).tolist()
    assert values[:3].tolist() == users
    start = int(lengths[:4].sum())
    assert values[start : start + 7].tolist() == [3, 4, 5, 6, 7, 8, 9]  # the last 6 of row 0, then row 2
    torch.testing.assert_close(
        b.dense["price"], torch.tensor((np.log1p([10.0, 20.0, 30.0]) - 3.0) / 0.8, dtype=torch.float32)
    )
    assert b.labels.tolist() == [[1.0], [0.0], [1.0]]  # [B, L]: one label column
    assert b.groups.tolist() == users
    # each feature's smallest and largest id, worked out beside the ids (the training process
    # checks them against its tables from these), through the DataLoader's pickling too
    for got in (kjt, pickle.loads(pickle.dumps(b)).sparse):
        ranges, start = got.host_stats().id_range_per_key, 0
        for key, n in zip(kjt.keys(), lengths.sum(1).tolist()):
            ids = values[start : start + n]
            assert ranges[kjt.keys().index(key)] == ((int(ids.min()), int(ids.max())) if n else (0, -1))
            start += n


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(price=[1.0, float("nan"), 2.0]),
            r"t.parquet, row 1: feature 'price' \(column 'price'\): value nan is not a finite number",
        ),
        (
            dict(hist_item_id=["1|2", "3||4", "5"]),
            r"t.parquet, row 1: feature 'hist_item_id' .*malformed multi-value field",
        ),
        (dict(hist_item_id=["1|2", "3|x", "5"]), r"t.parquet, row 1: feature 'hist_item_id' .*malformed value 'x'"),
        (
            dict(item_id=[5, -1, 7]),
            r"t.parquet, row 1: feature 'item_id' \(column 'item_id'\): id -1 is out of range \[0, 200\)",
        ),
        (dict(cate_id=[1, 2, 10]), r"t.parquet, row 2: feature 'cate_id' .*id 10 is out of range \[0, 10\)"),
        (dict(clk=[1, 2, 0]), r"t.parquet, row 1: label column 'clk' holds 2.0"),
        (dict(user_id=["a", None, "b"]), r"t.parquet, row 1: feature 'user_id' .*missing value"),
    ],
)
def test_bad_values_name_feature_file_and_row(changes, message):
    with pytest.raises(DataError, match=message):
        builder().build(table(**changes), "t.parquet")


def test_missing_column_names_column_and_feature():
    t = table().drop_columns(["hist_cate_id"])
    with pytest.raises(DataError, match=r"t.parquet: missing column 'hist_cate_id' \(feature 'hist_cate_id'\)"):
        builder().build(t, "t.parquet")


def test_parquet_and_csv_give_the_same_batches_of_exact_size(tmp_path):
    big = pa.concat_tables([table()] * 7)  # 21 rows
    pq.write_table(big.slice(0, 10), tmp_path / "a.parquet", row_group_size=3)
    pq.write_table(big.slice(10), tmp_path / "b.parquet", row_group_size=4)
    pacsv.write_csv(big, tmp_path / "all.csv")
    b = builder()
    pq_batches = list(
        make_loader(ArrowBatchDataset([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], b, 8), 0)
    )
    csv_batches = list(make_loader(ArrowBatchDataset([str(tmp_path / "all.csv")], b, 8), 0))
    assert [x.num_rows for x in pq_batches] == [x.num_rows for x in csv_batches] == [8, 8, 5]
    for x, y in zip(pq_batches, csv_batches):
        assert torch.equal(x.sparse.values(), y.sparse.values())
        assert torch.equal(x.sparse.lengths(), y.sparse.lengths())
        assert torch.equal(x.labels, y.labels)


def test_workers_are_deterministic(tmp_path):
    for i in range(4):
        pq.write_table(table(item_id=[i, i, i]), tmp_path / f"p{i}.parquet")
    files = sorted(str(p) for p in tmp_path.glob("*.parquet"))
    ds = ArrowBatchDataset(files, builder(), 3)
    runs = [[int(b.sparse.values()[3 * 2]) for b in make_loader(ds, 2)] for _ in range(2)]
    assert runs[0] == runs[1] and sorted(runs[0]) == [0, 1, 2, 3]


def test_error_in_second_file_names_that_file(tmp_path):
    pq.write_table(table(), tmp_path / "a.parquet")
    pq.write_table(table(price=[1.0, 2.0, float("nan")]), tmp_path / "b.parquet")
    ds = ArrowBatchDataset([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], builder(), 4)
    with pytest.raises(DataError, match=r"b.parquet, row 2: feature 'price'"):
        list(make_loader(ds, 0))


def test_error_in_a_batch_spanning_files_names_its_own_file_and_row(tmp_path):
    pq.write_table(table(), tmp_path / "a.parquet")
    pq.write_table(table(price=[float("nan"), 2.0, 3.0]), tmp_path / "b.parquet")
    ds = ArrowBatchDataset([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], builder(), 4)
    with pytest.raises(DataError, match=r"b.parquet, row 0: feature 'price'"):  # batch 0 = a[0:3] + b[0:1]
        list(make_loader(ds, 0))


def test_row_origin_locates_batch_rows():
    from dynarec.data import RowOrigin

    origin = RowOrigin((("a.parquet", 10, 2), ("b.parquet", 0, 3)))
    assert [origin.locate(i) for i in (0, 1, 2, 4)] == [
        "a.parquet, row 10",
        "a.parquet, row 11",
        "b.parquet, row 0",
        "b.parquet, row 2",
    ]
    assert origin.label == "a.parquet (+1 more file(s))"
    with pytest.raises(IndexError):
        origin.locate(5)


def feature_builder(*features):
    """A builder whose config adds ``features`` (feature blocks) to the tiny config's model."""
    c = config_dict()
    c["feature_configs"] += list(features)
    names = [next(iter(f.values()))["feature_name"] for f in features]
    c["model"]["feature_groups"][1]["feature_names"] += names
    return BatchBuilder(config_from_dict(c))


def ids_of(batch, name):
    kjt = batch.sparse
    per_key = kjt.lengths().view(len(kjt.keys()), -1).sum(1).tolist()
    start = sum(per_key[: kjt.keys().index(name)])
    return kjt.values()[start : start + per_key[kjt.keys().index(name)]].tolist()


def test_boundaries_bucketize_left_closed():
    b = feature_builder(
        {"id_feature": {"feature_name": "p", "input_name": "price", "embedding_dim": 4, "boundaries": [10, 20]}}
    )
    batch = b.build(table(price=[9.99, 10.0, 20.0]), "t.parquet")
    assert ids_of(batch, "p") == [0, 1, 2]  # [.., 10) -> 0, [10, 20) -> 1, [20, ..) -> 2
    with pytest.raises(DataError, match=r"t.parquet, row 1: feature 'p' \(column 'price'\): value nan is not a finite"):
        b.build(table(price=[1.0, float("nan"), 2.0]), "t.parquet")


def test_hash_bucket_size_hashes_the_string_form_of_ids():
    b = feature_builder(
        {"id_feature": {"feature_name": "h", "input_name": "age", "embedding_dim": 4, "hash_bucket_size": 7}},
        {"id_feature": {"feature_name": "u", "expression": "user:user_id", "embedding_dim": 4, "hash_bucket_size": 7}},
    )
    batch = b.build(table(), "t.parquet")
    assert ids_of(batch, "h") == to_hash_bucket_fast(["1", "2", "3"], 7).tolist()
    assert ids_of(batch, "u") == to_hash_bucket_fast(["u1", "u2", "u1"], 7).tolist()


def test_an_expression_normalizer_applies_and_a_non_finite_result_names_the_row():
    b = feature_builder(
        {"raw_feature": {"feature_name": "lp", "input_name": "price", "normalizer": {"expression": "log(x - 15)"}}}
    )
    with pytest.raises(
        DataError, match=r"row 0: feature 'lp' \(column 'price'\): normalizer 'log\(x - 15\)' gives nan"
    ):
        b.build(table(), "t.parquet")
    batch = b.build(table(price=[16.0, 15.0 + np.e, 20.0]), "t.parquet")
    assert batch.dense["lp"].tolist() == pytest.approx([0.0, 1.0, np.log(5.0)])


@pytest.mark.parametrize(
    "block, message",
    [
        ({"normalizer": {"expression": "os.system(1)"}}, r"normalizer: expression 'os.system\(1\)': unexpected '.'"),
        ({"normalizer": {"expression": "__import__(x)"}}, r"normalizer: expression .*unknown function '__import__'"),
        ({"normalizer": {"expression": "foo(x)"}}, "unknown function 'foo'"),
        ({"expression": "bogus:price"}, "an input must be 'side:column'"),
        ({"expression": "feature:nope"}, "feature:nope names no feature"),
        ({"expression": "item:price", "input_name": "price"}, "give input_name or expression, not both"),
    ],
)
def test_bad_expressions_are_config_errors(block, message):
    c = config_dict()
    c["feature_configs"].append({"raw_feature": {"feature_name": "x", **block}})
    with pytest.raises(ValueError, match=message):
        config_from_dict(c)


def hashed_builder():
    """Every hashed feature kind: a string id of a dynamic table (also the grouped-AUC field), a
    '|'-joined string id list of a hashed fixed table, hashed string sequences (one longer than
    its sequence_length), an integer column hashed as str(x), a list<string> column."""
    string_seq = {"sequence_length": 6, "embedding_dim": 4, "value_type": "string"}
    c = config_dict(eval={"metrics": ["auc", "grouped_auc"]})
    c["feature_configs"] += [
        {"id_feature": {"feature_name": "tags", "embedding_dim": 4, "hash_bucket_size": 1000, "separator": "|"}},
        {"id_feature": {"feature_name": "pair", "embedding_dim": 4, "hash_bucket_size": 97, "separator": "::"}},
        {"id_feature": {"feature_name": "age_h", "input_name": "age", "embedding_dim": 4, "hash_bucket_size": 7}},
        {"id_feature": {"feature_name": "words", "embedding_dim": 4, "hash_bucket_size": 50}},
        {"sequence_feature": {"feature_name": "hist_s", "hash_bucket_size": 5000, **string_seq}},
        {"sequence_feature": {"feature_name": "hist_d", "dynamicemb": {"max_capacity": 64}, **string_seq}},
    ]
    names = ["tags", "pair", "age_h", "words", "hist_s", "hist_d"]
    c["model"]["feature_groups"][1]["feature_names"] += names
    return BatchBuilder(config_from_dict(c))


def hashed_table(rows: int, large: bool = False) -> pa.Table:
    rng = np.random.default_rng(rows)
    kind = pa.large_string() if large else pa.string()
    words = ["a", "中文", "ü", "x" * 70, "tok", "😀", "0", ""]

    def joined(sep: str, most: int) -> list[str]:
        return [sep.join(rng.choice(words[:-1], size=rng.integers(0, most + 1))) for _ in range(rows)]

    return pa.table(
        {
            "user_id": pa.array([f"u{i % 7}" for i in range(rows)], kind),
            "age": [i % 8 for i in range(rows)],
            "item_id": [i % 200 for i in range(rows)],
            "cate_id": [i % 10 for i in range(rows)],
            "hist_item_id": ["1|2"] * rows,
            "hist_cate_id": ["3|4"] * rows,
            "price": [1.0] * rows,
            "clk": [i % 2 for i in range(rows)],
            "tags": pa.array(joined("|", 4), kind),
            "pair": pa.array(joined("::", 3), kind),
            "words": pa.array(
                [list(rng.choice(words[:-1], size=rng.integers(0, 3))) for _ in range(rows)]
            ),  # ("" is missing)
            "hist_s": pa.array(joined("|", 40), kind),
            "hist_d": pa.array(joined("|", 9), kind),
        }
    )


def assert_same_batches(a, b):
    assert a.sparse.keys() == b.sparse.keys()
    assert torch.equal(a.sparse.values(), b.sparse.values()) and torch.equal(a.sparse.lengths(), b.sparse.lengths())
    assert torch.equal(a.groups, b.groups) and torch.equal(a.labels, b.labels)


@needs_fg_kernels
@pytest.mark.parametrize("large", [False, True])
def test_the_native_data_stage_builds_the_batches_of_the_pyarrow_path(large):
    b = hashed_builder()
    t = hashed_table(300, large)
    for piece in (t, t.slice(17, 150), pa.concat_tables([t.slice(0, 5), t.slice(200, 60)])):
        fast = b.build(piece, "t.parquet")
        with native.python_path():
            slow = b.build(piece, "t.parquet")
        assert_same_batches(fast, slow)
        assert int(fast.sparse.lengths().view(len(fast.sparse.keys()), -1)[-2].max()) == 6  # kept the last 6


@pytest.mark.parametrize("column", ["tags", "pair", "hist_s"])
@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_an_empty_token_names_the_row_on_both_paths(column, where):
    sep = "::" if column == "pair" else "|"
    bad = {"start": sep + "a", "middle": "a" + sep + sep + "b", "end": "a" + sep}[where]
    t = hashed_table(30)
    values = t.column(column).to_pylist()
    values[21] = bad
    t = t.set_column(t.schema.get_field_index(column), column, pa.array(values)).slice(10)
    message = (
        rf"t.parquet, row 11: feature '{column}' \(column '{column}'\): malformed multi-value field "
        rf"\(empty token between '{sep}' separators\)"
    )
    with pytest.raises(DataError, match=message):
        hashed_builder().build(t, "t.parquet")
    with native.python_path(), pytest.raises(DataError, match=message):
        hashed_builder().build(t, "t.parquet")


@needs_fg_kernels
@pytest.mark.parametrize("sep", ["|", "::"])
@pytest.mark.parametrize("default", ["", "9"])
@pytest.mark.parametrize("bucketizer", ["hash_bucket_size", "num_buckets"])
def test_a_defaulted_id_list_takes_the_native_pass_with_the_pyarrow_paths_batch(sep, default, bucketizer):
    """TorchEasyRec's id features default to "": null and empty fields hold no id and empty
    tokens are dropped, in one native pass (split, then hash or parse); another default takes
    pyarrow's path where a field is missing. Both paths build the same batch, and the ids are
    those of the kept tokens."""
    c = config_dict()
    feature = {"feature_name": "tags", "embedding_dim": 4, bucketizer: 1000, "separator": sep}
    c["feature_configs"].append({"id_feature": {**feature, "default_value": default}})
    c["model"]["feature_groups"][1]["feature_names"].append("tags")
    b = BatchBuilder(config_from_dict(c))
    fields = ["1", None, "", f"{sep}2", f"1{sep}{sep}2", f"2{sep}", f"1{sep}2{sep}3", sep, "3"]
    base = table(**{k: v * 3 for k, v in ROWS.items()})
    t = base.append_column("tags", pa.array(fields, pa.string()))
    clean = base.append_column("tags", pa.array(["1", "2", f"1{sep}3"] * 3, pa.string()))
    for piece in (t, clean):
        fast = b.build(piece, "t.parquet")
        with native.python_path():
            slow = b.build(piece, "t.parquet")
        assert_same_batches(fast, slow)
    tags = split_features(b.build(t, "t.parquet").sparse)["tags"]
    ends = tags.lengths.cumsum(0).tolist()
    per_row = [tags.values[e - n : e].tolist() for e, n in zip(ends, tags.lengths.tolist())]
    if bucketizer == "num_buckets":
        i = {s: int(s) for s in "1239"}
    else:
        i = {s: int(to_hash_bucket_fast([s], 1000)[0]) for s in "1239"}
    d = [] if default == "" else [i["9"]]  # a missing field's ids; pyarrow's path puts it for an empty token too
    assert per_row == [
        [i["1"]],
        d,
        d,
        [*d, i["2"]],
        [i["1"], *d, i["2"]],
        [i["2"], *d],
        [i["1"], i["2"], i["3"]],
        d * 2 if default else d,
        [i["3"]],
    ]


def test_rows_without_a_grouping_value_form_one_group_of_their_own():
    from dynarec.metrics import NULL_GROUP

    b = builder()
    users = to_hash_bucket_fast(["u1", "u2"], DYNAMIC_KEY_BUCKETS).tolist()
    assert b._group_ids(pa.array(["u1", None, "u2", None])).tolist() == [users[0], NULL_GROUP, users[1], NULL_GROUP]
    assert b._group_ids(pa.array([7, None, -1], pa.int64())).tolist() == [7, NULL_GROUP, -1]
    assert b._group_ids(pa.array([1.5, None])).tolist()[1] == NULL_GROUP


@pytest.mark.parametrize("bad", ["+2", "1_0", "٣"])
def test_an_integer_id_arrow_cannot_read_is_named_though_python_would_take_it(bad):
    with pytest.raises(
        DataError, match=rf"row 1: feature 'age' \(column 'age'\): malformed value '{re.escape(bad)}' \(value_type"
    ):
        builder().build(table(age=["1", bad, "3"]), "t.parquet")


def test_an_empty_string_id_is_a_missing_value_as_a_null_is():
    # One value a row, no default_value: an error naming the row, as for a null.
    with pytest.raises(DataError, match=r"row 1: feature 'user_id' \(column 'user_id'\): missing value \(an empty"):
        builder().build(table(user_id=["u1", "", "u2"]), "t.parquet")
    # A list column's empty element: an error without a default, dropped with default_value "".
    lists = pa.array([["1", "2"], ["", "3"], ["4"]], pa.list_(pa.string()))
    with pytest.raises(DataError, match=r"row 1: feature 'hist_item_id' .*an empty string in the list"):
        builder().build(table(hist_item_id=lists), "t.parquet")
    c = config_dict(eval={"metrics": ["auc", "grouped_auc"]})
    for i in (4, 5):
        c["feature_configs"][i]["sequence_feature"]["default_value"] = ""
    b = BatchBuilder(config_from_dict(c)).build(table(hist_item_id=lists, hist_cate_id=lists), "t.parquet")
    lengths = b.sparse.lengths().view(6, 3)
    assert lengths[4].tolist() == [2, 1, 1]  # row 1's empty element dropped
    start = int(lengths[:4].sum())
    assert b.sparse.values()[start : start + 4].tolist() == [1, 2, 3, 4]


def test_a_dense_column_of_large_integers_or_padded_numbers_reads_as_numbers():
    big = 2**53 + 1  # (a timestamp in microseconds: no exact float64)
    b = builder().build(table(price=pa.array([1, 2, big], pa.int64())), "t.parquet")
    assert b.dense["price"][2].item() == pytest.approx((np.log1p(float(big)) - 3.0) / 0.8)
    b = builder().build(table(price=[" 10", "20 ", "30"]), "t.parquet")
    torch.testing.assert_close(
        b.dense["price"], torch.tensor((np.log1p([10.0, 20.0, 30.0]) - 3.0) / 0.8, dtype=torch.float32)
    )
    with pytest.raises(DataError, match=r"t.parquet, row 1: feature 'price' \(column 'price'\): ' x' is not a number"):
        builder().build(table(price=["1", " x", "3"]), "t.parquet")


def test_a_dictionary_encoded_column_reads_as_its_values():
    plain = builder().build(table(), "t.parquet")
    encoded = builder().build(
        table(age=pa.array([1, 2, 3]).dictionary_encode(), user_id=pa.array(["u1", "u2", "u1"]).dictionary_encode()),
        "t.parquet",
    )
    assert torch.equal(plain.sparse.values(), encoded.sparse.values())


def test_a_nan_in_a_float_id_column_is_a_missing_value():
    c = config_dict(eval={"metrics": ["auc", "grouped_auc"]})
    c["feature_configs"][0]["id_feature"]["default_value"] = "u0"
    b = BatchBuilder(config_from_dict(c))
    with pytest.raises(DataError, match=r"row 1: feature 'user_id' \(column 'user_id'\): missing value$"):
        builder().build(table(user_id=[1.0, float("nan"), 2.0]), "t.parquet")  # (was: the id "nan")
    filled = b.build(table(user_id=[1.0, float("nan"), 2.0]), "t.parquet")
    expected = b.build(table(user_id=["1", "u0", "2"]), "t.parquet")
    assert filled.sparse.values()[:3].tolist() == expected.sparse.values()[:3].tolist()
