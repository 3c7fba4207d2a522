"""Every feature kind of docs/features.md, built into batches, against hand-computed values:
TorchEasyRec's examples (docs/tzrec_features_spec.md: murmur2 buckets, vocabularies, boundaries,
combo, lookup, match, expr, EditDistance), the batch contract (ids and weights in the KJT, dense
``[B]`` / ``[B, k]`` / ``[B, L, k]`` with ``dense_lengths``), and a bad value named by its row."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from dynarec.config import ConfigError, config_from_dict
from dynarec.data import BatchBuilder, DataError

H = "\x1d"  # TorchEasyRec's multi-value separator


def config(*features, **data):
    names = [next(iter(f.values()))["feature_name"] for f in features]
    return config_from_dict(
        {
            "feature_configs": list(features),
            "model": {"feature_groups": [{"group_name": "all", "feature_names": names}], "wide_and_deep": {}},
            "data": {"train_input_path": "x", "label_field": "clk", **data},
            "train": {"sparse_optimizer": {"sgd_optimizer": {"lr": 0.1}}},
            "eval": {"metrics": ["auc"]},
        }
    )


def build(features, **columns):
    """A batch of ``columns`` (plus a label) built for ``features``."""
    if isinstance(features, dict):
        features = [features]
    n = len(next(iter(columns.values())))
    table = pa.table({**columns, "clk": [0] * n})
    return BatchBuilder(config(*features)).build(table, "t.parquet")


def ids(batch, name):
    """``[[ids of row 0], [ids of row 1], ...]`` of feature ``name``."""
    kjt = batch.sparse
    keys = kjt.keys()
    lengths = kjt.lengths().view(len(keys), -1)
    start = int(lengths[: keys.index(name)].sum())
    out, values = [], kjt.values().tolist()
    for n in lengths[keys.index(name)].tolist():
        out.append(values[start : start + n])
        start += n
    return out


def weights(batch, name):
    kjt = batch.sparse
    keys = kjt.keys()
    lengths = kjt.lengths().view(len(keys), -1)
    start = int(lengths[: keys.index(name)].sum())
    return kjt.weights_or_none()[start : start + int(lengths[keys.index(name)].sum())].tolist()


def id_feature(**kw):
    return {"id_feature": {"feature_name": "f", "embedding_dim": 4, **kw}}


# -- id_feature: bucketizers --------------------------------------------------------------


def test_vocab_list_torcheasyrec_convention():
    """``[default_value, <OOV>, *words]``: a word i -> i + 2, unknown -> 1, missing -> 0 (or no id
    with ``default_value: ""``); with default_bucketize_value the list as it is."""
    col = pa.array(["abc", "efg", "zzz", None, ""])
    b = build(id_feature(vocab_list=["abc", "efg", "hij"], default_value=""), f=col)
    assert ids(b, "f") == [[2], [3], [1], [], []]
    b = build(id_feature(vocab_list=["abc", "efg", "hij"], default_value="xyz"), f=col)
    assert ids(b, "f") == [[2], [3], [1], [0], [0]]
    b = build(id_feature(vocab_list=["abc", "efg", "hij"], default_value="abc"), f=col)  # listed: its index wins
    assert ids(b, "f")[3] == [2]
    b = build(id_feature(vocab_list=["abc", "efg", "hij"], default_bucketize_value=2, default_value=""), f=col)
    assert ids(b, "f") == [[0], [1], [2], [], []]
    assert config(id_feature(vocab_list=["a", "b", "c"])).feature("f").table_rows == 5
    assert config(id_feature(vocab_list=["a", "b", "c"], default_bucketize_value=0)).feature("f").table_rows == 3


def test_vocab_list_of_integers_and_several_values_a_row():
    b = build(id_feature(vocab_list=[1, 2, 3], separator=H), f=pa.array([f"1{H}3", "9"]))
    assert ids(b, "f") == [[2, 4], [1]]
    b = build(id_feature(vocab_list=["1", "2"]), f=pa.array([2, 7]))  # an integer column: its decimal form
    assert ids(b, "f") == [[3], [1]]


def test_vocab_dict_and_vocab_file(tmp_path):
    b = build(id_feature(vocab_dict={"abc": 2, "efg": 2, "hij": 3}), f=pa.array(["abc", "efg", "zzz"]))
    assert ids(b, "f") == [[2], [2], [1]]
    assert config(id_feature(vocab_dict={"abc": 2, "hij": 3})).feature("f").table_rows == 4
    (tmp_path / "v").write_text("<BLK>\n<OOV>\nabc\nefg\n")  # TorchEasyRec's data/test/id_vocab_list_0
    b = build(id_feature(vocab_file=str(tmp_path / "v"), default_bucketize_value=1), f=pa.array(["abc", "efg", "x"]))
    assert ids(b, "f") == [[2], [3], [1]]
    (tmp_path / "w").write_text("abc 7\nefg 3\n")
    f = id_feature(vocab_file=str(tmp_path / "w"), default_bucketize_value=0)
    assert ids(build(f, f=pa.array(["abc", "efg", "x"])), "f") == [[7], [3], [0]]
    assert config(f).feature("f").table_rows == 8


def test_vocab_file_relative_to_the_config_and_a_missing_one_named(tmp_path):
    from dynarec.config import load_config
    from tests.pipeline_fixtures import config_dict, write_config

    c = config_dict()
    c["feature_configs"][1] = {
        "id_feature": {"feature_name": "age", "embedding_dim": 4, "vocab_file": "v.txt", "default_bucketize_value": 0}
    }
    path = write_config(tmp_path, c, "c.yaml")
    cfg = load_config(path)
    assert cfg.feature("age").vocab_file == str(tmp_path / "v.txt")
    with pytest.raises(ValueError, match=r"vocab_file '.*v.txt' cannot be read"):
        BatchBuilder(cfg)
    (tmp_path / "v.txt").write_text("a\nb b b\n")
    with pytest.raises(ValueError, match=r"v.txt', line 2: 'b b b' is neither a word nor 'word id'"):
        _ = load_config(path).feature("age").table_rows


def test_murmur2_buckets_as_torcheasyrec():
    """id_feature_test.py: abc -> 33, efg -> 44, hij -> 66; an integer hashes as its decimal string."""
    f = id_feature(hash_bucket_size=100, hash_function="murmur2", separator=H)
    b = build(f, f=pa.array([f"abc{H}efg", "hij", ""]))
    assert ids(b, "f") == [[33, 44], [66], []]
    b = build(id_feature(hash_bucket_size=100, hash_function="murmur2"), f=pa.array([1, 2, 3, 4]))
    assert ids(b, "f") == [[95], [70], [13], [56]]
    with __import__("dynarec.features.native", fromlist=["x"]).python_path():  # the pyarrow path: the same
        assert ids(build(f, f=pa.array([f"abc{H}efg", "hij", ""])), "f") == [[33, 44], [66], []]


def test_a_default_value_replaces_missing_and_empty_values():
    f = id_feature(hash_bucket_size=100, hash_function="murmur2", separator="|", default_value="0")
    b = build(f, f=pa.array(["abc||efg", None, "", "hij|"]))  # an empty token too takes the default
    assert ids(b, "f") == [[33, 26, 44], [26], [26], [66, 26]]
    f = id_feature(num_buckets=10, separator="|", default_value="")
    assert ids(build(f, f=pa.array(["1||2", None, ""])), "f") == [[1, 2], [], []]


def test_weighted_pairs_and_map_columns_carry_weights_in_the_kjt():
    """id_feature_test.py:214-251: ``12:0.9\\x1d123:0.21`` with num_buckets -> ids [12, 123],
    weights [0.9, 0.21]; features that are not weighted get 1.0."""
    f = id_feature(num_buckets=1000, weighted=True)
    other = {"id_feature": {"feature_name": "g", "embedding_dim": 4, "num_buckets": 10}}
    b = build([f, other], f=pa.array([f"12:0.9{H}123:0.21", "5:2"]), g=pa.array([1, 2]))
    assert ids(b, "f") == [[12, 123], [5]]
    assert weights(b, "f") == pytest.approx([0.9, 0.21, 2.0])
    assert weights(b, "g") == [1.0, 1.0]
    assert b.sparse.host_stats().weights_finite is True  # said by the maker: the step reads no weight
    with pytest.raises(DataError, match=r"row 0: feature 'f' \(column 'f'\): weight nan is not a finite number"):
        build([f, other], f=pa.array([f"12:nan{H}123:0.21", "5:2"]), g=pa.array([1, 2]))
    m = pa.array([[(3, 0.5), (7, 1.5)], [], [(1, 1.0)]], pa.map_(pa.int64(), pa.float32()))
    b = build(id_feature(num_buckets=10, weighted=True), f=m)
    assert ids(b, "f") == [[3, 7], [], [1]]
    assert weights(b, "f") == [0.5, 1.5, 1.0]
    b = build(id_feature(num_buckets=10, weighted=True, default_value="0:0.5"), f=pa.array(["3:2", None]))
    assert ids(b, "f") == [[3], [0]] and weights(b, "f") == [2.0, 0.5]


def test_max_values_keeps_a_rows_first_values():
    """TorchEasyRec's value_dim k on an id feature keeps a row's first k values (pyfg's
    value_dimension truncates); an explicit value_dim 1 converted without a separator hashed
    "a\\x1db" whole. max_values cuts strings, list columns and weighted pairs alike."""
    f = id_feature(num_buckets=10, separator="|", max_values=2, default_value="")
    assert ids(build(f, f=pa.array(["1|2|3", "4", None, "", "5|6"])), "f") == [[1, 2], [4], [], [], [5, 6]]
    assert ids(build(f, f=pa.array([[1, 2, 3], [4], None, []], pa.list_(pa.int64()))), "f") == [[1, 2], [4], [], []]
    one = id_feature(vocab_list=["a", "b"], separator=H, max_values=1)
    assert ids(build(one, f=pa.array([f"a{H}b", f"b{H}a", "a"])), "f") == [[2], [3], [2]]
    weighted = id_feature(num_buckets=1000, weighted=True, separator=H, max_values=1)
    b = build(weighted, f=pa.array([f"12:0.9{H}123:0.21", "5:2"]))
    assert ids(b, "f") == [[12], [5]] and weights(b, "f") == pytest.approx([0.9, 2.0])
    m = pa.array([[(3, 0.5)]], pa.map_(pa.int64(), pa.float32()))
    with pytest.raises(DataError, match="max_values cuts a list or a string of values; a map column"):
        build(id_feature(num_buckets=10, weighted=True, max_values=1), f=m)
    with pytest.raises(ConfigError, match="remove max_values"):
        config(id_feature(boundaries=[1.0, 2.0], max_values=1))


def test_zch_is_a_dynamic_table_of_zch_size():
    f = id_feature(zch={"zch_size": 1000, "lru": {}}, value_type="string")
    feat = config(f).feature("f")
    assert feat.embedded and feat.dynamic and feat.table_rows is None
    assert feat.dynamic_table.max_capacity == 1000 and feat.dynamic_table.score_strategy == "step"
    lfu = config(id_feature(zch={"zch_size": 64, "lfu": {}})).feature("f").dynamic_table
    assert lfu.score_strategy == "lfu"
    b = build(f, f=pa.array(["abc", "abc", "x"]))
    keys = ids(b, "f")
    assert keys[0] == keys[1] != keys[2] and keys[0][0] >= 1000  # keys, not rows: the table maps them


# -- raw_feature ---------------------------------------------------------------------------


def test_raw_value_dim_list_and_string_columns_are_b_by_k():
    f = {"raw_feature": {"feature_name": "r", "value_dim": 2}}
    b = build(f, r=pa.array([[1.0, 2.0], [3.0, 4.0]]))
    assert b.dense["r"].dtype == torch.float32 and b.dense["r"].tolist() == [[1.0, 2.0], [3.0, 4.0]]
    b = build(f, r=pa.array([f"1{H}2", f"3{H}4"]))
    assert b.dense["r"].tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert build({"raw_feature": {"feature_name": "r"}}, r=pa.array([1.5, 2.5])).dense["r"].shape == (2,)


def test_raw_boundaries_one_id_per_number_and_defaults_not_normalized():
    """raw_feature_test.py:195-203: value_dim 2 with boundaries -> two ids a row; :132-155: a
    missing value takes default_value as it is (not normalized)."""
    f = {
        "raw_feature": {
            "feature_name": "r",
            "value_dim": 2,
            "boundaries": [0.1, 0.2, 0.3, 0.4],
            "embedding_dim": 4,
            "default_value": "0.15",
        }
    }
    b = build(f, r=pa.array([[0.05, 0.25], None, [0.4, 0.1]]))
    assert ids(b, "r") == [[0, 2], [1, 1], [4, 1]]
    norm = {"expression": "x > 1e-8 ? log10(x) : -8"}  # TorchEasyRec's method=log10
    f = {"raw_feature": {"feature_name": "r", "normalizer": norm, "default_value": "0.01"}}
    b = build(f, r=pa.array([100.0, None, 0.0]))
    assert b.dense["r"].tolist() == pytest.approx([2.0, 0.01, -8.0])


def test_an_empty_list_is_a_missing_value_where_a_default_is_given():
    """id_feature_test.py:769-770: a list column's [] takes default_value as a null does (was: no
    id, no element, "row holds 0 numbers"): value_dim 0 [[1, 2], [], [3], [4, 6]] with default 0
    -> ids 1, 2, 0, 3, 4, 6 in sequences of 2, 1, 1, 2; without a default, [] is still no id."""
    f = {"sequence_feature": {"feature_name": "s", "num_buckets": 10, "embedding_dim": 4, "sequence_length": 5,
                              "value_dim": 0, "default_value": "0"}}  # fmt: skip
    b = build(f, s=pa.array([[1, 2], [], [3], [4, 6]]))
    assert ids(b, "s") == [[1, 2], [0], [3], [4, 6]] and b.sequence_lengths(["s"])["s"].tolist() == [2, 1, 1, 2]
    f = {"sequence_feature": {"feature_name": "s", "num_buckets": 10, "embedding_dim": 4, "sequence_length": 5,
                              "default_value": "0"}}  # fmt: skip
    assert ids(build(f, s=pa.array([[1, 2], [], None])), "s") == [[1, 2], [0], [0]]
    f = {"id_feature": {"feature_name": "i", "num_buckets": 10, "embedding_dim": 4, "default_value": "7"}}
    assert ids(build(f, i=pa.array([[1], [], None])), "i") == [[1], [7], [7]]
    f = {"id_feature": {"feature_name": "i", "num_buckets": 10, "embedding_dim": 4}}
    assert ids(build(f, i=pa.array([[1], []])), "i") == [[1], []]
    f = {"raw_feature": {"feature_name": "r", "value_dim": 2, "default_value": "0.1\x1d0.4"}}
    assert build(f, r=pa.array([[0.2, 0.5], []])).dense["r"].flatten().tolist() == pytest.approx([0.2, 0.5, 0.1, 0.4])


def test_an_empty_string_is_a_raw_features_missing_number():
    """raw_feature_test.py:95: "0.2", "", "0.3", null with default_value 0.1 -> 0.2, 0.1, 0.3,
    0.1; :194: with boundaries and default_value "" the empty row has no id (was: "'' is not a
    number"); without a default it is the missing-value error naming the row."""
    f = {"raw_feature": {"feature_name": "r", "default_value": "0.1"}}
    assert build(f, r=["0.2", "", "0.3", None]).dense["r"].tolist() == pytest.approx([0.2, 0.1, 0.3, 0.1])
    f = {"raw_feature": {"feature_name": "r", "boundaries": [0.05, 0.15, 0.25], "embedding_dim": 4,
                         "default_value": ""}}  # fmt: skip
    assert ids(build(f, r=["0.2", "", "0.3"]), "r") == [[2], [], [3]]
    with pytest.raises(DataError, match=r"row 1: feature .r. \(column .r.\): missing value"):
        build({"raw_feature": {"feature_name": "r"}}, r=["0.2", ""])


def test_raw_autodis_and_mlp_reach_the_batch_as_numbers():
    f = {"raw_feature": {"feature_name": "r", "embedding_dim": 8, "autodis": {"num_channels": 3}}}
    feat = config(f).feature("r")
    assert not feat.embedded and feat.dense_embedding == "autodis" and feat.embedding_dim == 8
    assert feat.autodis.temperature == 0.1 and feat.autodis.keep_prob == 0.8
    assert build(f, r=pa.array([1.0, 2.0])).dense["r"].tolist() == [1.0, 2.0]
    f = {"raw_feature": {"feature_name": "r", "embedding_dim": 8, "value_dim": 2, "mlp": {}}}
    assert config(f).feature("r").dense_embedding == "mlp"
    assert build(f, r=pa.array([[1.0, 2.0]])).dense["r"].shape == (1, 2)


# -- combo ---------------------------------------------------------------------------------


def test_combo_is_the_cartesian_product_joined_by_underscore():
    """combo_feature_test.py: ua x [abc, efg, hij] -> 2, 42, 3; ub_hij -> 23; a missing input makes
    the whole output the default (``xyz`` -> 13)."""
    f = {
        "combo_feature": {
            "feature_name": "c",
            "expression": ["user:u", "item:i"],
            "hash_bucket_size": 100,
            "hash_function": "murmur2",
            "embedding_dim": 4,
            "default_value": "xyz",
        }
    }
    b = build(f, u=pa.array(["ua", "ub", f"ua{H}ub", ""]), i=pa.array([f"abc{H}efg{H}hij", "hij", "hij", "abc"]))
    assert ids(b, "c") == [[2, 42, 3], [23], [3, 23], [13]]
    f["combo_feature"]["default_value"] = ""
    assert ids(build(f, u=pa.array([None]), i=pa.array(["abc"])), "c") == [[]]


# -- lookup --------------------------------------------------------------------------------


def lookup(**kw):
    return {"lookup_feature": {"feature_name": "l", "map": "user:m", "key": "item:k", **kw}}


def test_lookup_combines_the_values_found():
    """lookup_feature_test.py:95-174: ca + cb -> 3, mean 1.5, ca (cd not found) -> 1, cd -> the
    default 0."""
    m = pa.array([f"ca:1{H}cb:2"] * 4)
    k = pa.array([f"ca{H}cb", f"ca{H}cd", "cd", ""])
    assert build(lookup(), m=m, k=k).dense["l"].tolist() == [3.0, 1.0, 0.0, 0.0]
    assert build(lookup(combiner="mean"), m=m, k=k).dense["l"].tolist() == [1.5, 1.0, 0.0, 0.0]
    assert build(lookup(combiner="max"), m=m, k=k).dense["l"].tolist() == [2.0, 1.0, 0.0, 0.0]
    assert build(lookup(combiner="count"), m=m, k=k).dense["l"].tolist() == [2.0, 1.0, 0.0, 0.0]
    boundaries = lookup(combiner="mean", boundaries=[-0.5, 0.5, 1.5, 2.5], embedding_dim=4)
    assert ids(build(boundaries, m=m, k=k), "l") == [[3], [2], [1], [1]]  # mean 1.5 on a boundary -> 3


def test_lookup_map_columns_value_dim_and_discrete_values():
    m = pa.array([[("ca", 1.0), ("cb", 2.0)], None], pa.map_(pa.string(), pa.float64()))
    assert build(lookup(default_value="-1"), m=m, k=pa.array(["cb", "ca"])).dense["l"].tolist() == [2.0, -1.0]
    vec = lookup(value_dim=2)  # lookup_feature_test.py:175-190
    b = build(vec, m=pa.array([f"ca:1,2{H}cb:3,4"] * 2), k=pa.array(["ca", "zz"]))
    assert b.dense["l"].tolist() == [[1.0, 2.0], [0.0, 0.0]]
    disc = lookup(hash_bucket_size=100, hash_function="murmur2", embedding_dim=4, default_value="")
    b = build(disc, m=pa.array([f"a:x{H}b:y{H}c:z"] * 2), k=pa.array([f"a{H}b{H}c", "q"]))
    assert ids(b, "l") == [[35, 30, 54], []]  # lookup_feature_test.py:350: x -> 35, y -> 30, z -> 54
    vocab = lookup(vocab_list=["e", "f", "g"], embedding_dim=4)
    assert ids(build(vocab, m=pa.array(["1:f"]), k=pa.array([1])), "l") == [[3]]


def test_a_feature_input_reads_another_features_bucketized_output():
    """The vendored multi_tower_din_fg_mock: lookup key ``feature:raw_6_id`` (a boundaries id)."""
    raw6 = {"raw_feature": {"feature_name": "raw_6_id", "expression": "item:raw_6", "boundaries": [0.1, 0.2, 0.3]}}
    raw6["raw_feature"]["embedding_dim"] = 4
    lk = {
        "lookup_feature": {
            "feature_name": "lookup_5",
            "map": "user:map_5",
            "key": "feature:raw_6_id",
            "vocab_list": ["e", "f", "g"],
            "embedding_dim": 4,
        }
    }
    cfg = config(lk, raw6)
    assert [f.feature_name for f in cfg.features_in_order()] == ["raw_6_id", "lookup_5"]
    assert cfg.feature("lookup_5").columns == ("map_5",) and cfg.feature("lookup_5").feature_inputs == ("raw_6_id",)
    table = pa.table({"map_5": [f"0:e{H}2:g", "1:f"], "raw_6": [0.25, 0.05], "clk": [0, 1]})
    b = BatchBuilder(cfg).build(table, "t.parquet")
    assert ids(b, "raw_6_id") == [[2], [0]]  # 0.25 -> bucket 2, 0.05 -> bucket 0
    # row 0: key "2" finds "g" (vocab id 4); row 1: key "0" is not in "1:f": the default "0" -> 0
    assert ids(b, "lookup_5") == [[4], [0]]
    assert b.sparse.keys() == ["lookup_5", "raw_6_id"]  # the KJT in config order


# -- match ---------------------------------------------------------------------------------


def match(**kw):
    return {"match_feature": {"feature_name": "m", "nested_map": "user:nm", "pkey": "item:p", "skey": "item:s", **kw}}


def test_match_finds_the_value_at_pkey_skey():
    """match_feature_test.py:55-90: ``ca^ba`` -> 1, the others the default 0; ``ALL``: every key."""
    nm = pa.array(["ca^ba:1,bb:2|cb^ba:3"] * 4)
    p, s = pa.array(["ca", "cb", "ca", "cc"]), pa.array(["ba", "bb", "bc", "ba"])
    assert build(match(), nm=nm, p=p, s=s).dense["m"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert build(match(pkey="ALL"), nm=nm, s=s).dense["m"].tolist() == [4.0, 2.0, 0.0, 4.0]
    assert build(match(skey="ALL"), nm=nm, p=p).dense["m"].tolist() == [3.0, 3.0, 3.0, 0.0]
    b = build(match(num_buckets=10, embedding_dim=4), nm=nm, p=p, s=s)
    assert ids(b, "m") == [[1], [0], [0], [0]]  # the number 1, and the default "0" of the others
    nested = pa.array([[("ca", [("ba", 5.0)])]], pa.map_(pa.string(), pa.map_(pa.string(), pa.float64())))
    assert build(match(), nm=nested, p=pa.array(["ca"]), s=pa.array(["ba"])).dense["m"].tolist() == [5.0]
    strings = pa.array([[("ca", "ba:6,bb:7")]], pa.map_(pa.string(), pa.string()))
    assert build(match(), nm=strings, p=pa.array(["ca"]), s=pa.array(["bb"])).dense["m"].tolist() == [7.0]


# -- expr ----------------------------------------------------------------------------------


def expr(text, variables, **kw):
    return {"expr_feature": {"feature_name": "e", "expression": text, "variables": variables, **kw}}


def test_expr_feature():
    """expr_feature_test.py:84-99: a missing variable makes the output the default (0.1, not
    0.1 + b); :190-193 a dot product of 0.1 with boundaries [0.05, 0.10, 0.15] -> 2."""
    f = expr("a + b", ["user:a", "item:b"], default_value="0.1")
    b = build(f, a=pa.array([0.1, None, 2.0]), b=pa.array([0.2, 0.5, 3.0]))
    assert b.dense["e"].tolist() == pytest.approx([0.3, 0.1, 5.0])
    f = expr("dot(a, b)", ["user:a", "item:b"], boundaries=[0.05, 0.10, 0.15], embedding_dim=4)
    b = build(f, a=pa.array([f"0.1{H}0.2", "1"]), b=pa.array([f"0.6{H}0.2", "0.01"]))
    assert ids(b, "e") == [[2], [0]]
    ragged = expr("reduce_sum(a) * b", ["a", "b"])  # a: 2 numbers in row 0, 3 in row 1 (row by row)
    b = build(ragged, a=pa.array([[1.0, 2.0], [1.0, 1.0, 1.0]]), b=pa.array([2.0, 10.0]))
    assert b.dense["e"].tolist() == [6.0, 30.0]
    assert build(expr("log(x) ^ 2", ["x"]), x=pa.array([np.e])).dense["e"].tolist() == pytest.approx([1.0])
    # An int64 beyond 2**53 (a nanosecond timestamp) was "values of type int64 are not numbers"; it
    # rounds to the nearest float64, as a raw_feature's does.
    big = 1_733_481_600_123_456_789
    b = build(expr("t / 1e9", ["t"]), t=pa.array([big, 1]))
    assert b.dense["e"].tolist() == pytest.approx([float(big) / 1e9, 1e-9])


# -- custom --------------------------------------------------------------------------------


def test_edit_distance():
    """custom_feature_test.py: 裙子 vs 连衣裙 (utf-8) -> 3; with boundaries [0, 5, 10] -> 1."""
    f = {
        "custom_feature": {
            "feature_name": "c",
            "operator_name": "EditDistance",
            "operator_lib_file": "pyfg/lib/libedit_distance.so",
            "expression": ["user:query", "item:title"],
            "operator_params": {"encoding": "utf-8"},
        }
    }
    b = build(f, query=pa.array(["裙子", "abc", None]), title=pa.array(["连衣裙", "abd", "x"]))
    assert b.dense["c"].tolist() == [3.0, 1.0, 0.0]  # a missing input: the default 0
    f["custom_feature"].update(boundaries=[0, 5, 10], embedding_dim=16)
    assert ids(build(f, query=pa.array(["裙子"]), title=pa.array(["连衣裙"])), "c") == [[1]]
    latin = {
        k: v for k, v in f["custom_feature"].items() if k not in ("operator_params", "boundaries", "embedding_dim")
    }
    b = build({"custom_feature": latin}, query=pa.array(["裙子"]), title=pa.array(["连衣裙"]))
    assert b.dense["c"].tolist() == [8.0]  # latin (the default): UTF-8 bytes


# -- sequences -----------------------------------------------------------------------------


def test_sequence_raw_is_b_by_l_by_k_with_its_lengths():
    f = {"sequence_raw_feature": {"feature_name": "s", "sequence_length": 3, "value_dim": 2}}
    b = build(f, s=pa.array(["1,2|3,4", "", "5,6|7,8|9,10|11,12"]))
    assert b.dense["s"].shape == (3, 3, 2) and b.dense["s"].dtype == torch.float32
    assert b.dense["s"][0].tolist() == [[1, 2], [3, 4], [0, 0]]
    assert b.dense["s"][2].tolist() == [[7, 8], [9, 10], [11, 12]]  # the last 3 kept
    assert b.dense_lengths["s"].tolist() == [2, 0, 3] and b.dense_lengths["s"].dtype == torch.int64
    assert b.sequence_lengths(["s"])["s"].tolist() == [2, 0, 3]
    b = build(f, s=pa.array([[[1.0, 2.0]], []], pa.list_(pa.list_(pa.float64()))))
    assert b.dense["s"].tolist() == [[[1.0, 2.0]], [[0.0, 0.0]]]
    bucketized = {"sequence_raw_feature": {"feature_name": "s", "sequence_length": 5, "boundaries": [1, 2]}}
    bucketized["sequence_raw_feature"]["embedding_dim"] = 4
    b = build(bucketized, s=pa.array(["0.5|1|2.5", "1.5"]))
    assert ids(b, "s") == [[0, 1, 2], [1]] and b.sequence_lengths(["s"])["s"].tolist() == [3, 1]


def test_sequence_feature_takes_vocabularies():
    f = {
        "sequence_feature": {
            "feature_name": "h",
            "sequence_length": 2,
            "embedding_dim": 4,
            "vocab_list": ["abc", "efg"],
        }
    }
    b = build(f, h=pa.array(["zzz|abc|efg", "efg"]))
    assert ids(b, "h") == [[2, 3], [3]]


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "features, columns, message",
    [
        (
            {"raw_feature": {"feature_name": "r", "value_dim": 2}},
            {"r": pa.array([[1.0, 2.0], [1.0, 2.0, 3.0]])},
            r"t.parquet, row 1: feature 'r' \(column 'r'\): row holds 3 numbers; value_dim is 2",
        ),
        (
            {"raw_feature": {"feature_name": "r"}},
            {"r": pa.array([1.0, None])},
            r"row 1: feature 'r' \(column 'r'\): missing value",
        ),
        (
            id_feature(num_buckets=100, weighted=True),
            {"f": pa.array(["1:2", f"3:1{H}4"])},
            r"row 1: feature 'f' \(column 'f'\): weighted value '4' is not 'id:weight'",
        ),
        (
            id_feature(num_buckets=100, weighted=True),
            {"f": pa.array(["1:2", "3:x"])},
            r"row 1: feature 'f' \(column 'f'\): weight 'x' is not a number",
        ),
        (
            lookup(),
            {"m": pa.array(["a:1", f"a:1{H}b"]), "k": pa.array(["a", "a"])},
            r"row 1: feature 'l' \(inputs 'm', 'k'\): malformed map entry 'b' \(expected key:value\)",
        ),
        (
            lookup(),
            {"m": pa.array(["a:1", "a:x"]), "k": pa.array(["a", "a"])},
            r"row 1: feature 'l' .*value 'x' is not a number",
        ),
        (
            match(),
            {"nm": pa.array(["a^b:1", "a:1"]), "p": pa.array(["a", "a"]), "s": pa.array(["b", "b"])},
            r"row 1: feature 'm' .*malformed nested map entry 'a:1' \(expected pkey\^skey:value\)",
        ),
        (
            expr("a / b", ["a", "b"]),
            {"a": pa.array([1.0, 1.0]), "b": pa.array([1.0, 0.0])},
            r"row 1: feature 'e' \(inputs 'a', 'b'\): expression 'a / b' gives inf for this row \(a=1.0, b=0.0\)",
        ),
        (
            {"sequence_raw_feature": {"feature_name": "s", "sequence_length": 3, "value_dim": 2}},
            {"s": pa.array(["1,2", "1,2|3"])},
            r"row 1: feature 's' \(column 's'\): an element holds 1 numbers; value_dim is 2",
        ),
        (
            {"sequence_raw_feature": {"feature_name": "s", "sequence_length": 3}},
            {"s": pa.array(["1|2", "1||2"])},
            r"row 1: feature 's' .*malformed sequence \(empty token between '\|' separators\)",
        ),
        (
            id_feature(num_buckets=5),
            {"f": pa.array([1, 5])},
            r"row 1: feature 'f' .*id 5 is out of range \[0, 5\)",
        ),
    ],
)
def test_bad_values_are_named_by_row(features, columns, message):
    with pytest.raises(DataError, match=message):
        build(features, **columns)


@pytest.mark.parametrize(
    "feature, message",
    [
        (id_feature(), r"give exactly one of \['num_buckets', 'hash_bucket_size', 'vocab_list'"),
        (id_feature(num_buckets=3, vocab_list=["a"]), r"give exactly one of .*got \['num_buckets', 'vocab_list'\]"),
        (id_feature(vocab_file="v"), "vocab_file needs default_bucketize_value"),
        (id_feature(vocab_list=["a", "b"], default_bucketize_value=2), "default_bucketize_value 2 must be below"),
        (id_feature(num_buckets=3, default_bucketize_value=0), "default_bucketize_value belongs to vocab_list"),
        (id_feature(num_buckets=3, hash_function="md5"), "hash_function"),
        (id_feature(num_buckets=3, weighted=True, default_value="1"), "an 'id:weight' pair, got '1'"),
        (id_feature(zch={"zch_size": 100}), r"give exactly one of \['lfu', 'lru', 'distance_lfu'\]"),
        (id_feature(zch={"zch_size": 100, "lfu": {}, "threshold_filtering_func": "lambda x: x"}), "admission"),
        ({"raw_feature": {"feature_name": "r", "embedding_dim": 4}}, "embedding_dim: a dense raw_feature"),
        ({"raw_feature": {"feature_name": "r", "autodis": {"num_channels": 3}}}, "autodis: needs embedding_dim"),
        (
            {"raw_feature": {"feature_name": "r", "value_dim": 2, "embedding_dim": 4, "autodis": {"num_channels": 3}}},
            "autodis embeds one number a row",
        ),
        ({"raw_feature": {"feature_name": "r", "num_buckets": 3}}, "raw_feature.num_buckets: unknown key"),
        ({"raw_feature": {"feature_name": "r", "embedding_name": "t"}}, "embedding_name: belong"),
        (
            {"combo_feature": {"feature_name": "c", "expression": ["a", "b"], "num_buckets": 3, "embedding_dim": 4}},
            "combo_feature.num_buckets: unknown key",
        ),
        ({"combo_feature": {"feature_name": "c", "expression": ["a"], "hash_bucket_size": 3}}, "at least 2 items"),
        (lookup(value_dim=2, combiner="count"), "combiner count gives one number"),
        (lookup(need_discrete=True), "need_discrete: the values found become ids"),
        (expr("a + c", ["a", "b"]), "unknown variable 'c'"),
        (expr("a + b", ["a", "x:b"]), "an input must be 'side:column'"),
        (
            {
                "custom_feature": {
                    "feature_name": "c",
                    "operator_name": "SeqExpr",
                    "operator_lib_file": "pyfg/lib/libseq_expr.so",
                    "expression": ["a"],
                }
            },
            r"the custom operator 'SeqExpr' is not built into dynarec .*built in: \['EditDistance', 'RegexReplace'\]",
        ),
        (
            {
                "custom_feature": {
                    "feature_name": "c",
                    "operator_name": "EditDistance",
                    "expression": ["a", "b"],
                    "operator_params": {"encoding": "gbk"},
                }
            },
            r"operator_params.encoding: one of \['latin', 'utf-8'\]",
        ),
        (
            {
                "sequence_raw_feature": {
                    "feature_name": "s",
                    "sequence_length": 3,
                    "value_dim": 2,
                    "boundaries": [1],
                    "embedding_dim": 4,
                }
            },
            "boundaries in a sequence take one number an element",
        ),
    ],
)
def test_config_errors_name_the_field(feature, message):
    with pytest.raises(ConfigError, match=message):
        config(feature)


def test_feature_inputs_unknown_cyclic_or_sequences_are_refused():
    a = lookup(map="user:m", key="feature:b")
    a["lookup_feature"]["feature_name"] = "a"
    b = lookup(map="user:m", key="feature:a")
    b["lookup_feature"]["feature_name"] = "b"
    with pytest.raises(ConfigError, match="features read each other in a cycle: a -> b -> a"):
        config(a, b)
    with pytest.raises(ConfigError, match=r"feature_configs\[0\].lookup_feature: feature:zz names no feature"):
        config(lookup(key="feature:zz"))
    seq = {"sequence_feature": {"feature_name": "h", "sequence_length": 2, "embedding_dim": 4, "num_buckets": 9}}
    with pytest.raises(ConfigError, match="feature:h is a sequence"):
        config(lookup(key="feature:h"), seq)


def test_the_common_interface():
    feats = config(
        id_feature(num_buckets=7, embedding_name="t", trainable=False),
        {"raw_feature": {"feature_name": "r", "value_dim": 3}},
        lookup(boundaries=[1.0], embedding_dim=4),
        {"sequence_raw_feature": {"feature_name": "s", "sequence_length": 3, "value_dim": 2}},
        expr("a", ["user:a"], embedding_dim=4, mlp={}),
    ).features()
    f, r, lk, s, e = feats
    assert (f.embedded, f.table_name, f.table_rows, f.trainable, f.is_sequence, f.value_dim) == (
        True,
        "t",
        7,
        False,
        False,
        1,
    )
    assert (r.embedded, r.value_dim, r.columns, r.embedding_dim, r.dense_embedding) == (False, 3, ("r",), None, None)
    assert (lk.embedded, lk.table_rows, lk.columns, lk.table_name) == (True, 2, ("m", "k"), "l")
    assert (s.embedded, s.is_sequence, s.value_dim) == (False, True, 2)
    assert (e.embedded, e.dense_embedding, e.embedding_dim, e.columns) == (False, "mlp", 4, ("a",))


# -- overlap, kv_dot_product, bool_mask: TorchEasyRec's own test cases ------------------------------


@pytest.mark.parametrize(
    "method, query, title, expected",
    [
        # tzrec/features/overlap_feature_test.py (terms joined by \x1d, or lists)
        ("query_common_ratio", [f"abc{H}efg", f"abc{H}efg", "", None],
         [f"abc{H}qwe{H}rty{H}uio", f"abc{H}efg{H}rty", "", None], [0.5, 1.0, 0.0, 0.0]),
        ("query_common_ratio", [["abc", "efg"], ["abc", "efg"], [], None],
         [["abc", "qwe", "rty", "uio"], ["abc", "efg", "rty"], [], None], [0.5, 1.0, 0.0, 0.0]),
        ("title_common_ratio", [f"abc{H}efg", f"abc{H}efg", "", None],
         [f"abc{H}qwe{H}rty{H}uio", "abc", "", None], [0.25, 1.0, 0.0, 0.0]),
        ("is_contain", [f"abc{H}efg", f"abc{H}efg", "", None],
         [f"abc{H}qwe{H}rty{H}uio", f"abc{H}efg{H}rty", "", None], [0.0, 1.0, 0.0, 0.0]),
        ("is_equal", [f"abc{H}efg", f"abc{H}efg", "", None], [f"abc{H}efg{H}rty", f"abc{H}efg", "", None],
         [0.0, 1.0, 0.0, 0.0]),
        ("query_common_ratio", [["abc", "defg"], ["abc", "efg"], [], None],
         [["abc", "qwe", "rty", "uio"], ["abc", "efg", "rty"], [], None], [0.5, 1.0, 0.0, 0.0]),
        # dynarec's reading of the documented ones: in order, not necessarily adjacent; index_of whole
        ("is_contain", [f"abc{H}rty", f"rty{H}abc"], [f"abc{H}qwe{H}rty", f"abc{H}qwe{H}rty"], [1.0, 0.0]),
        ("index_of", [f"efg{H}rty", f"abc{H}rty", ""], [f"abc{H}efg{H}rty", f"abc{H}efg{H}rty", "abc"],
         [1.0, -1.0, -1.0]),
    ],
)  # fmt: skip
def test_overlap_feature(method, query, title, expected):
    f = {"overlap_feature": {"feature_name": "o", "query": "user:q", "title": "item:t", "method": method}}
    batch = build(f, q=pa.array(query), t=pa.array(title))
    assert batch.dense["o"].flatten().tolist() == pytest.approx(expected)


def test_kv_dot_product():
    """tzrec's docs: "a:0.5|b:0.5" . "d:0.5|b:0.5" = 0.25; keys alone weigh 1 (a set
    intersection's size); map columns and lists of k:w alike; an empty document: default_value."""
    f = {"kv_dot_product": {"feature_name": "k", "query": "user:q", "document": "item:d", "separator": "|"}}
    batch = build(f, q=["a:0.5|b:0.5", "a|b|c", "a|b|c", "x:2|x:3", "a"], d=["d:0.5|b:0.5", "a|b|d", "", "x:2", None])
    assert batch.dense["k"].flatten().tolist() == [0.25, 2.0, 0.0, 6.0, 0.0]  # a key twice: its last weight
    m = pa.map_(pa.string(), pa.float64())
    f["kv_dot_product"]["default_value"] = "-1"
    batch = build(f, q=pa.array([["a:0.5", "b:0.5"], ["a", "b", "c"], ["a"]]),
                  d=pa.array([[("d", 0.5), ("b", 0.5)], [("a", 0.5), ("b", 0.5)], []], m))  # fmt: skip
    assert batch.dense["k"].flatten().tolist() == [0.25, 1.0, -1.0]
    with pytest.raises(DataError, match=r"row 1.*document weight"):
        build(f, q=["a", "a"], d=["a:1", "a:x"])


def test_bool_mask_feature():
    """tzrec/features/bool_mask_feature_test.py's cases: "123,456,90,80" & "true,false,true,false"
    -> 123, 90; lists and 1/0 masks alike; then bucketized as ids."""
    f = {"bool_mask_feature": {"feature_name": "m", "expression": ["user:v", "user:k"], "separator": ",",
                               "num_buckets": 1000, "embedding_dim": 4, "default_value": "7"}}  # fmt: skip
    batch = build(f, v=["123,456,90,80", "123,456,90,80", "1,2"], k=["true,false,true,false", "1,0,1,0", "0,0"])
    assert ids(batch, "m") == [[123, 90], [123, 90], [7]]  # nothing kept: the default
    batch = build(f, v=pa.array([[1, 2, 3, 4]]), k=pa.array([[True, False, True, False]]))
    assert ids(batch, "m") == [[1, 3]]
    with pytest.raises(DataError, match=r"row 0.*2 value\(s\) but 3 mask value\(s\)"):
        build(f, v=["1,2"], k=["1,0,1"])
    with pytest.raises(DataError, match=r"mask value 'yes' is not true/false"):
        build(f, v=["1,2"], k=["1,yes"])


def test_a_bool_mask_row_missing_its_values_or_its_mask_keeps_none():
    """bool_mask_feature_test.py:33: values "1", "2", null under masks true, false, true ->
    [1], [], [] (was: "0 value(s) but 1 mask value(s)")."""
    f = {"bool_mask_feature": {"feature_name": "m", "expression": ["user:v", "user:k"], "separator": ",",
                               "num_buckets": 10, "embedding_dim": 4}}  # fmt: skip
    assert ids(build(f, v=["1", "2", None], k=["true", "false", "true"]), "m") == [[1], [], []]
    assert ids(build(f, v=["1", "2"], k=["true", None]), "m") == [[1], []]


def test_regex_replace_replaces_every_match_then_bucketizes():
    """TorchEasyRec's documented RegexReplace (regex_patten, replacement): the string with every
    match replaced ($n: a group), bucketized; a missing or emptied string takes default_value."""
    params = {"regex_patten": "([a-z]+)([0-9]+)", "replacement": "$2$1"}
    f = {"custom_feature": {"feature_name": "r", "operator_name": "RegexReplace", "operator_params": params,
                            "expression": ["user:q"], "vocab_list": ["12ab", "3c-4d"], "default_value": "",
                            "embedding_dim": 4}}  # fmt: skip
    # vocab_list without default_bucketize_value: word i -> i + 2, unknown -> 1
    assert ids(build(f, q=["ab12", "c3-d4", "zz", "", None]), "r") == [[2], [3], [1], [], []]
    with pytest.raises(ConfigError, match="RegexReplace gives strings"):
        config({"custom_feature": {**f["custom_feature"], "vocab_list": None, "boundaries": [1.0]}})
    with pytest.raises(ConfigError, match="regex_patten: '\\(' is not a regular expression"):
        config({"custom_feature": {**f["custom_feature"], "operator_params": {"regex_patten": "("}}})
    with pytest.raises(ConfigError, match="RegexReplace takes one input"):
        config({"custom_feature": {**f["custom_feature"], "expression": ["user:q", "item:t"]}})


def test_a_large_string_column_takes_a_default_as_a_string_column_does():
    """A large_string column with a separator and a default raised pyarrow's "arrays to be
    concatenated must be identically typed"."""
    f = id_feature(hash_bucket_size=100, separator="|", default_value="0")
    rows = ["a|b", None, ""]
    assert ids(build(f, f=pa.array(rows, pa.large_string())), "f") == ids(build(f, f=pa.array(rows)), "f")
