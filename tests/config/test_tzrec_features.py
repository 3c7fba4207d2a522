"""`dynarec import-config`: TorchEasyRec's feature kinds mapped onto dynarec's (docs/features.md)
with TorchEasyRec's semantics (docs/tzrec_features_spec.md), checked field by field against
hand-computed values. Most cases read the vendored configs themselves."""

import math
from pathlib import Path

import pytest

from dynarec.config import config_from_dict
from dynarec.config.tzrec import ConversionError, convert_pipeline_config
from dynarec.planner import plan_from_config

ROOT = Path(__file__).parent / "tzrec"
SEED = ROOT / "tests" / "multi_tower_din_fg_dynamicemb_mock.config"

HEAD = """
train_config {
    sparse_optimizer { adagrad_optimizer { lr: 0.01 } constant_learning_rate {} }
    dense_optimizer { adam_optimizer { lr: 0.01 } constant_learning_rate {} }
    num_steps: 4
}
data_config { batch_size: 8 dataset_type: ParquetDataset fg_mode: %s label_fields: "clk" }
"""


def config_text(features: str, groups: str, fg_mode: str = "FG_DAG", model: str = "") -> str:
    model = model or 'multi_tower { towers { input: "deep" mlp { hidden_units: [8] } } }'
    return (
        HEAD % fg_mode
        + features
        + f"model_config {{ {groups} {model} metrics {{ auc {{}} }} losses {{ binary_cross_entropy {{}} }} }}"
    )


def convert(text: str, **kw):
    return convert_pipeline_config(text, train_input_path="d/train", **kw)


def bodies(result) -> dict:
    return {next(iter(f.values()))["feature_name"]: f for f in result.config["feature_configs"]}


def body(result, name: str) -> dict:
    return next(iter(bodies(result)[name].values()))


def kind(result, name: str) -> str:
    return next(iter(bodies(result)[name]))


def seed(**kw):
    """The seed's config, converted with --lenient: its two features with several ids a sequence
    element are the only ones dropped (test_tzrec.py says why)."""
    return convert_pipeline_config(SEED.read_text(), train_input_path="d", config_dir=SEED.parent, lenient=True, **kw)


# -- ids -------------------------------------------------------------------------------------------


def test_dynamicemb_carries_every_field_and_torcheasyrecs_defaults():
    user = body(seed(), "user_id")
    assert user["dynamicemb"] == {
        "max_capacity": 1_000_000,
        "init_capacity": 128,  # init_capacity_per_rank
        "score_strategy": "step",
        # frequency_admission_strategy {threshold: 5}: keys not yet admitted read CONSTANT 0
        "admission": {"threshold": 5, "initializer": {"kind": "constant", "value": 0.0}},
    }
    assert user["initializer"] == {"kind": "normal", "mean": 0.0, "std": 0.05}  # initializer_args
    assert (user["value_type"], user["hash_function"]) == ("string", "murmur2")  # FG hashes the string form
    text = config_text(
        """feature_configs { id_feature { feature_name: "u" expression: "user:u" embedding_dim: 16
             init_fn: "nn.init.uniform_,a=-0.5,b=0.5"
             dynamicemb { max_capacity: 4096 bucket_capacity: 32 score_strategy: "LFU" cache_load_factor: 0.5
               initializer_args { mode: "TRUNCATED_NORMAL" }
               eval_initializer_args { mode: "UNIFORM" lower: -0.1 upper: 0.1 }
               frequency_admission_strategy { threshold: 2 counter_capacity: 1024 counter_bucket_capacity: 64
                 initializer_args { mode: "CONSTANT" value: 0.5 } } } } }""",
        'feature_groups { group_name: "deep" feature_names: "u" }',
    )
    result = convert(text)
    u = body(result, "u")
    assert u["dynamicemb"] == {
        "max_capacity": 4096,
        "score_strategy": "lfu",
        "bucket_size": 32,
        "eval_initializer": {"kind": "uniform", "bound": 0.1},
        "admission": {"threshold": 2, "capacity": 1024, "initializer": {"kind": "constant", "value": 0.5}},
    }
    # NORMAL / TRUNCATED_NORMAL's std_dev defaults to 1/sqrt(embedding_dim) in dynamicemb; init_fn is
    # not used for a dynamicemb table (TorchEasyRec initializes it by initializer_args).
    assert u["initializer"] == {"kind": "truncated_normal", "mean": 0.0, "std": 1 / math.sqrt(16)}
    assert any("init_fn: ignored" in n for n in result.notes)
    # "percentage of embedding rows caching on gpu": the table's rows in host memory behind a cache
    assert u["cache_load_factor"] == 0.5
    assert any("cache_load_factor: the table's rows in host memory" in n for n in result.notes)
    config_from_dict(result.config)
    half = convert(text.replace("embedding_dim: 16", 'embedding_dim: 16 data_type: "BF16"', 1))
    assert (body(half, "u")["cache_load_factor"], body(half, "u")["data_type"]) == (0.5, "bf16")
    config_from_dict(half.config)


def test_vocabularies_weighted_and_trainable():
    result = seed()
    assert body(result, "id_3")["vocab_list"] == ["a", "b", "c"]
    id7 = body(result, "id_7")
    assert id7["default_bucketize_value"] == 1 and Path(id7["vocab_file"]).name == "id_vocab_list_1"
    # TorchEasyRec's data/test/id_vocab_list_1: xyz, <OOV>, abc, efg -> ids 0..3, a table of 4 rows
    config = config_from_dict(result.config)
    assert config.feature("id_7").table_rows == 4 and config.feature("id_3").table_rows == 3 + 2
    text = config_text(
        """feature_configs { id_feature { feature_name: "w" expression: "user:w" hash_bucket_size: 10
             embedding_dim: 4 weighted: true trainable: false } }
           feature_configs { id_feature { feature_name: "v" expression: "user:v" embedding_dim: 4
             vocab_dict { key: "x" value: 2 } vocab_dict { key: "y" value: 5 } default_value: "x" } }""",
        'feature_groups { group_name: "deep" feature_names: ["w", "v"] }',
    )
    result = convert(text)
    assert body(result, "w")["weighted"] is True and body(result, "w")["trainable"] is False
    assert body(result, "v")["vocab_dict"] == {"x": 2, "y": 5} and body(result, "v")["default_value"] == "x"
    config = config_from_dict(result.config)
    assert config.feature("v").table_rows == 6  # max(id) + 1


def test_fg_none_turns_every_bucketizer_into_the_rows_of_its_table():
    """FG_NONE: the column holds FG output, ids of the table TorchEasyRec sizes (spec §1.4)."""
    text = config_text(
        """feature_configs { id_feature { feature_name: "a" vocab_list: ["x", "y", "z"] embedding_dim: 4 } }
           feature_configs { id_feature { feature_name: "b" vocab_list: ["x", "y", "z"] default_bucketize_value: 0
             embedding_dim: 4 } }
           feature_configs { id_feature { feature_name: "c" hash_bucket_size: 7 embedding_dim: 4 } }
           feature_configs { raw_feature { feature_name: "d" boundaries: [1, 2, 3] embedding_dim: 4 } }
           feature_configs { raw_feature { feature_name: "e" value_dim: 3 normalizer: "method=zscore,mean=1" } }
           feature_configs { combo_feature { feature_name: "f" expression: ["user:a", "item:b"] hash_bucket_size: 9
             embedding_dim: 4 } }
           feature_configs { match_feature { feature_name: "g" nested_map: "user:m" pkey: "item:p" skey: "item:s"
             vocab_list: ["x", "y"] embedding_dim: 4 } }""",
        'feature_groups { group_name: "deep" feature_names: ["a", "b", "c", "d", "e", "f", "g"] }',
        fg_mode="FG_NONE",
    )
    result = convert(text)
    rows = {n: body(result, n).get("num_buckets") for n in "abcdfg"}
    # vocab_list: [default, <OOV>] + words; with default_bucketize_value the words alone; a match
    # feature's vocabulary table is one row larger (match_feature.py:90)
    assert rows == {"a": 5, "b": 3, "c": 7, "d": 4, "f": 9, "g": 5}
    assert {kind(result, n) for n in "abcdfg"} == {"id_feature"}
    assert all(body(result, n)["separator"] == "\x03" for n in "abcfg")  # several ids, fg_encoded_multival_sep
    assert body(result, "e") == {"feature_name": "e", "value_dim": 3, "separator": "\x03"}  # no normalizer
    assert any(
        n.startswith("feature_configs[4].raw_feature.normalizer: FG_NONE: TorchEasyRec applies no")
        for n in result.notes
    )
    config_from_dict(result.config)


TOKENIZER = ROOT / "tests" / "data" / "test" / "tokenizer.json"  # TorchEasyRec's, vendored


@pytest.mark.parametrize("fg_mode", ["FG_DAG", "FG_NONE"])
def test_tokenize_feature_keeps_its_tokenizer_and_normalizer(fg_mode):
    """FG modes: the text tokenized as TorchEasyRec does; FG_NONE: the column holds the token ids,
    a fixed table of the tokenizer's vocabulary size (50277 with its added tokens)."""
    text = config_text(
        f"""feature_configs {{ tokenize_feature {{ feature_name: "t" expression: "item:title" vocab_file: "{TOKENIZER}"
             embedding_dim: 8 pooling: MEAN default_value: "x"
             text_normalizer {{ norm_options: [TEXT_UPPER2LOWER, TEXT_SBC2DBC] max_length: 64 }} }} }}""",
        'feature_groups { group_name: "deep" feature_names: ["t"] }',
        fg_mode=fg_mode,
    )
    result = convert(text)
    if fg_mode == "FG_NONE":
        assert bodies(result)["t"] == {
            "id_feature": {"feature_name": "t", "embedding_dim": 8, "pooling": "mean", "num_buckets": 50277,
                           "separator": "\x03", "default_value": ""},
        }  # fmt: skip
    else:
        assert bodies(result)["t"] == {
            "tokenize_feature": {
                "feature_name": "t", "expression": "item:title", "embedding_dim": 8, "pooling": "mean",
                "vocab_file": str(TOKENIZER), "default_value": "x",
                "text_normalizer": {"norm_options": ["TEXT_UPPER2LOWER", "TEXT_SBC2DBC"], "max_length": 64},
            }
        }  # fmt: skip
    config_from_dict(result.config)


def test_tokenize_feature_refusals_name_the_field(tmp_path):
    text = config_text(
        """feature_configs { tokenize_feature { feature_name: "t" expression: "item:title" vocab_file: "missing.json"
             embedding_dim: 8 tokens_as_sequence: true tokenizer_type: "wordpiece"
             text_normalizer { norm_options: [TEXT_NOPE] } } }""",
        'feature_groups { group_name: "deep" feature_names: ["t"] }',
    )
    with pytest.raises(ConversionError) as e:
        convert(text, config_dir=tmp_path)
    message = str(e.value)
    for field in ("vocab_file: ", "tokens_as_sequence: ", "tokenizer_type: 'wordpiece'", "norm_options: ['TEXT_NOPE']"):
        assert f"  feature_configs.tokenize_feature.{field}" in message or f".text_normalizer.{field}" in message, (
            message
        )
    assert f"{tmp_path / 'missing.json'} does not exist" in message


@pytest.mark.parametrize("fg_mode", ["FG_DAG", "FG_NONE"])
def test_overlap_kv_dot_product_and_bool_mask_keep_torcheasyrecs_fields(fg_mode):
    text = config_text(
        """feature_configs { overlap_feature { feature_name: "o" query: "user:q" title: "item:t"
             method: "title_common_ratio" } }
           feature_configs { overlap_feature { feature_name: "ob" query: "user:q" title: "item:t" method: "is_contain"
             boundaries: [0.5] embedding_dim: 4 } }
           feature_configs { kv_dot_product { feature_name: "k" query: "user:q" document: "item:d" separator: "|" } }
           feature_configs { bool_mask_feature { feature_name: "m" expression: ["user:v", "user:mask"] separator: ","
             num_buckets: 100 embedding_dim: 4 } }""",
        'feature_groups { group_name: "deep" feature_names: ["o", "ob", "k", "m"] }',
        fg_mode=fg_mode,
    )
    result = convert(text)
    got = bodies(result)
    if fg_mode == "FG_NONE":  # the columns hold the FG outputs: numbers, bucket ids
        assert {n: next(iter(b)) for n, b in got.items()} == {
            "o": "raw_feature", "ob": "id_feature", "k": "raw_feature", "m": "id_feature",
        }  # fmt: skip
        assert (body(result, "ob")["num_buckets"], body(result, "m")["num_buckets"]) == (2, 100)
    else:
        assert got["o"] == {
            "overlap_feature": {
                "feature_name": "o",
                "query": "user:q",
                "title": "item:t",
                "method": "title_common_ratio",
            }
        }
        assert body(result, "ob")["boundaries"] == [0.5]
        assert body(result, "k") == {
            "feature_name": "k", "query": "user:q", "document": "item:d", "separator": "|", "default_value": "0",
        }  # fmt: skip
        assert body(result, "m")["expression"] == ["user:v", "user:mask"] and body(result, "m")["separator"] == ","
    config_from_dict(result.config)
    bad = config_text(
        """feature_configs { overlap_feature { feature_name: "o" query: "user:q" title: "item:t"
             method: "proximity_min_cover" } }""",
        'feature_groups { group_name: "deep" feature_names: ["o"] }',
    )
    with pytest.raises(ConversionError, match=r"overlap_feature\.method: 'proximity_min_cover': dynarec's methods"):
        convert(bad)


def test_hash_bucket_size_hashes_with_torcheasyrecs_default_hash():
    result = convert_pipeline_config(
        (ROOT / "examples" / "multi_tower_din_taobao.config").read_text(), train_input_path="d", eval_input_path="e"
    )
    assert body(result, "pid")["hash_bucket_size"] == 20 and body(result, "pid")["hash_function"] == "murmur2"
    assert (
        "feature_configs[15].id_feature.hash_bucket_size: hash_function: murmur2 (TorchEasyRec's default std::hash"
        in "\n".join(result.notes)
    )


def test_zch_is_carried_onto_a_dynamic_table():
    result = convert_pipeline_config(
        (ROOT / "tests" / "multi_tower_din_zch_fg_mock.config").read_text(), train_input_path="d"
    )
    assert body(result, "user_id")["zch"] == {"zch_size": 1_000_000, "eviction_interval": 2, "lfu": {}}
    assert body(result, "item_id")["zch"] == {"zch_size": 10_000, "eviction_interval": 2, "lru": {}}
    assert body(result, "click_50_seq__item_id")["zch"]["zch_size"] == 10_000
    assert body(result, "id_7")["weighted"] is True
    config = config_from_dict(result.config)
    table = config.feature("user_id").dynamic_table
    assert (table.max_capacity, table.score_strategy) == (1_000_000, "lfu")
    assert config.feature("item_id").dynamic_table.score_strategy == "step"  # lru: least recently used


def test_half_precision_rows_reach_their_tables():
    name = ROOT / "tests" / "multi_tower_din_fg_mock_bf16_emb_fp16.config"
    result = convert_pipeline_config(name.read_text(), train_input_path="d", config_dir=name.parent)
    assert body(result, "user_id")["data_type"] == "fp16"
    assert any("data_type: FP16 rows, updated in fp32 and stored by stochastic rounding" in n for n in result.notes)
    tables = {t.name: t for t in plan_from_config(config_from_dict(result.config)).table_configs()}
    half = {n for n, t in tables.items() if t.data_type == "fp16"}
    assert len(half) == 9 and all(tables[n].kind == "fixed" for n in half)
    assert config_from_dict(result.config).train.mixed_precision == "bf16"


def test_embedding_name_shares_a_table_and_a_conflict_is_refused_by_path():
    result = seed()
    assert body(result, "id_4")["embedding_name"] == body(result, "id_5")["embedding_name"] == "id_4_emb"
    text = config_text(
        """feature_configs { id_feature { feature_name: "a" expression: "user:a" num_buckets: 10 embedding_dim: 4
             embedding_name: "t" } }
           feature_configs { id_feature { feature_name: "b" expression: "user:b" num_buckets: 20 embedding_dim: 4
             embedding_name: "t" } }""",
        'feature_groups { group_name: "deep" feature_names: ["a", "b"] }',
    )
    with pytest.raises(
        ConversionError, match=r"feature_configs\[1\]\.id_feature: shares table 't' with 'a'.*num_buckets"
    ):
        convert(text)


# -- numbers ---------------------------------------------------------------------------------------


def test_raw_features_vectors_bucketized_vectors_and_dense_embeddings():
    result = seed()
    assert body(result, "raw_3") == {
        "feature_name": "raw_3",
        "expression": "item:raw_3",
        "value_dim": 4,
        "separator": "\x1d",
        "default_value": "0",  # TorchEasyRec's numeric default, not normalized
    }
    raw4 = body(result, "raw_4")
    assert kind(result, "raw_4") == "raw_feature" and raw4["boundaries"] == [0.1, 0.2, 0.3, 0.4]
    assert raw4["value_dim"] == 4 and raw4["embedding_dim"] == 16
    assert body(result, "raw_7")["autodis"] == {"num_channels": 3, "temperature": 0.1, "keep_prob": 0.8}
    assert body(result, "raw_9")["mlp"] == {} and body(result, "raw_9")["embedding_dim"] == 16
    assert kind(result, "raw_1") == "id_feature" and body(result, "raw_1")["boundaries"] == [0.1, 0.2, 0.3, 0.4]
    text = config_text(
        """feature_configs { raw_feature { feature_name: "p" expression: "item:p"
             normalizer: "method=expression,expr=x^2+1" } }
           feature_configs { raw_feature { feature_name: "q" expression: "item:q"
             normalizer: "method=minmax,min=2,max=6" } }""",
        'feature_groups { group_name: "deep" feature_names: ["p", "q"] }',
    )
    result = convert(text)
    assert body(result, "p")["normalizer"] in ({"expression": "x^2+1"}, {"expression": "x**2+1"})
    assert body(result, "q")["normalizer"] == {"mean": 2.0, "std": 4.0}
    config_from_dict(result.config)


def test_combo_lookup_match_expr_custom_keep_torcheasyrecs_fields():
    result = seed()
    assert body(result, "combo_1") == {
        "feature_name": "combo_1",
        "expression": ["user:id_1", "item:id_2"],
        "embedding_dim": 16,
        "hash_bucket_size": 1_000_000,
        "hash_function": "murmur2",
        "pooling": "sum",
        "separator": "\x1d",
        "default_value": "",
    }
    assert body(result, "lookup_1") == {
        "feature_name": "lookup_1",
        "map": "user:map_1",
        "key": "item:id_2",
        "default_value": "0",
    }
    assert body(result, "lookup_5")["key"] == "feature:raw_6_id" and body(result, "lookup_5")["vocab_list"] == list(
        "efg"
    )
    assert body(result, "lookup_6")["mlp"] == {}
    assert body(result, "match_3")["num_buckets"] == 10_000 and body(result, "match_3")["skey"] == "item:id_3"
    assert body(result, "expr_1")["expression"] == "raw_1 + raw_2"
    assert body(result, "expr_1")["variables"] == ["item:raw_1", "item:raw_2"]
    custom = body(result, "custom_1")
    assert (custom["operator_name"], custom["operator_params"]) == ("EditDistance", {"encoding": "utf-8"})
    assert custom["expression"] == ["user:query", "item:title"] and "operator_lib_file" not in custom
    # raw_6_id is in no group, but lookup_5 reads it (feature:raw_6_id): kept; id_9 is read by none
    assert "raw_6_id" in bodies(result) and "id_9" not in bodies(result)
    assert any("'id_9' is in no feature group and read by no feature" in n for n in result.notes)


def test_an_operator_dynarec_does_not_run_is_refused_by_path():
    text = config_text(
        """feature_configs { custom_feature { feature_name: "c" operator_name: "MyOp"
             operator_lib_file: "libmy.so" expression: ["user:a"] } }""",
        'feature_groups { group_name: "deep" feature_names: "c" }',
    )
    with pytest.raises(
        ConversionError,
        match=r"feature_configs\.custom_feature\.operator_name: 'MyOp' is not an operator dynarec implements",
    ):
        convert(text)


# -- sequences -------------------------------------------------------------------------------------


def test_sequence_sub_features_read_torcheasyrecs_columns():
    """A sub-feature is <sequence_name>__<feature_name> and reads <sequence_name>__<input>
    (spec §1.7); FG_NONE: <sequence_name>__<feature_name>."""
    result = seed()
    assert body(result, "click_50_seq__item_id") == {
        "feature_name": "click_50_seq__item_id",
        "input_name": "click_50_seq__item_id",
        "embedding_dim": 16,
        "num_buckets": 10_000,
        "sequence_length": 50,
        "separator": "|",
        "default_value": "0",  # an empty sequence is one element "0" in TorchEasyRec
    }
    raw3 = body(result, "click_50_seq__raw_3")
    assert kind(result, "click_50_seq__raw_3") == "sequence_raw_feature"
    assert (raw3["value_dim"], raw3["value_separator"], raw3["separator"]) == (4, "\x1d", "|")
    raw1 = body(result, "click_50_seq__raw_1")
    assert raw1["boundaries"] == [0.1, 0.2, 0.3, 0.4] and raw1["embedding_dim"] == 16
    text = config_text(
        """feature_configs { sequence_feature { sequence_name: "s" sequence_length: 5 sequence_delim: ";"
             features { id_feature { feature_name: "item" expression: "item:iid" num_buckets: 9 embedding_dim: 4 } }
             features { raw_feature { feature_name: "price" expression: "item:p" value_dim: 2 } } } }
           feature_configs {
             id_feature { feature_name: "item" expression: "item:iid" num_buckets: 9 embedding_dim: 4 } }""",
        'feature_groups { group_name: "seq" feature_names: ["item", "s__item", "s__price"] group_type: SEQUENCE }',
        model='multi_tower_din { din_towers { input: "seq" attn_mlp { hidden_units: [4] } } }',
    )
    dag = convert(text)
    assert body(dag, "s__item")["input_name"] == "s__iid" and body(dag, "s__price")["input_name"] == "s__p"
    none = convert(text.replace("FG_DAG", "FG_NONE"))
    assert body(none, "s__item")["input_name"] == "s__item" and body(none, "s__price")["input_name"] == "s__price"
    assert body(none, "s__price")["value_separator"] == "\x03" and body(none, "s__price")["separator"] == ";"
    config_from_dict(dag.config)
    config_from_dict(none.config)


def test_an_fg_none_sequence_of_ids_reads_a_null_row_as_an_empty_sequence():
    """id_feature_test.py:534-555: FG_NONE sequences "1;2", "", "3", null -> lengths 2, 0, 1, 0
    (was: the null row an error). TorchEasyRec does not truncate FG_NONE sequences: the note says
    dynarec keeps the last sequence_length elements."""
    import pyarrow as pa

    from dynarec.data.batch import BatchBuilder

    text = config_text(
        """feature_configs { sequence_feature { sequence_name: "s" sequence_length: 5 sequence_delim: ";"
             features { id_feature { feature_name: "item" expression: "item:iid" num_buckets: 9 embedding_dim: 4 } } } }
           feature_configs {
             id_feature { feature_name: "item" expression: "item:iid" num_buckets: 9 embedding_dim: 4 } }""",
        'feature_groups { group_name: "seq" feature_names: ["item", "s__item"] group_type: SEQUENCE }',
        fg_mode="FG_NONE",
        model='multi_tower_din { din_towers { input: "seq" attn_mlp { hidden_units: [4] } } }',
    )
    result = convert(text)
    assert any("TorchEasyRec reads the whole sequence" in n and "keeps its last 5 elements" in n for n in result.notes)
    config = config_from_dict(result.config)
    table = pa.table({"item": ["1", "2", "3", "4"], "s__item": ["1;2", "", "3", None], "clk": [0, 1, 0, 1]})
    batch = BatchBuilder(config).build(table, "t.parquet")
    assert batch.sequence_lengths(["s__item"])["s__item"].tolist() == [2, 0, 1, 0]


@pytest.mark.parametrize("fg_mode", ["FG_DAG", "FG_NONE"])
def test_an_id_features_explicit_value_dim_keeps_a_rows_first_values(fg_mode):
    """pyfg's value_dimension truncates an id feature's values: value_dim 1 keeps the first, k
    the first k. value_dim 1 converted with no separator (a row's "a\\x1db" looked up whole) and
    value_dim 2 was refused. FG_NONE splits on its separator whatever value_dim says."""
    features = "".join(
        f'feature_configs {{ id_feature {{ feature_name: "{n}" expression: "item:{n}" embedding_dim: 4 '
        f"num_buckets: 10 {dim} }} }}"
        for n, dim in (("one", "value_dim: 1"), ("two", "value_dim: 2"), ("all", "value_dim: 0"), ("unset", ""))
    )
    groups = 'feature_groups { group_name: "deep" feature_names: ["one", "two", "all", "unset"] }'
    result = convert(config_text(features, groups, fg_mode))
    config_from_dict(result.config)
    sep = "\x03" if fg_mode == "FG_NONE" else "\x1d"
    got = {
        n: (body(result, n).get("separator"), body(result, n).get("max_values")) for n in ("one", "two", "all", "unset")
    }
    if fg_mode == "FG_NONE":
        assert got == {n: (sep, None) for n in got}
    else:
        assert got == {"one": (sep, 1), "two": (sep, 2), "all": (sep, None), "unset": (sep, None)}


def test_a_sequence_elements_several_values_keep_the_first_as_torcheasyrecs_value_dim_1():
    """id_feature_test.py:643 and :698: a sequence sub-feature's value_dim 1 (its default)
    truncates an element's \\x1d-joined values to the first: "abc\\x1defg;hij", "", "hij" ->
    [33, 66], [26] (the default "0"), [66] (was: 7, the hash of the whole element)."""
    import pyarrow as pa

    from dynarec.data.batch import BatchBuilder

    text = config_text(
        """feature_configs { sequence_feature { sequence_name: "click_50_seq" sequence_length: 50 sequence_delim: ";"
             features { id_feature { feature_name: "id_feat" expression: "user:id_str" hash_bucket_size: 100
                                     embedding_dim: 4 embedding_name: "t" } } } }
           feature_configs { id_feature { feature_name: "q" expression: "user:q" hash_bucket_size: 100
                                          embedding_dim: 4 embedding_name: "t" } }""",
        'feature_groups { group_name: "seq" feature_names: ["q", "click_50_seq__id_feat"] group_type: SEQUENCE }',
        model='multi_tower_din { din_towers { input: "seq" attn_mlp { hidden_units: [4] } } }',
    )
    config = config_from_dict(convert(text).config)
    table = pa.table({"q": ["a", "b", "c"], "click_50_seq__id_str": ["abc\x1defg;hij", "", "hij"], "clk": [0, 1, 0]})
    kjt = BatchBuilder(config).build(table, "t.parquet").sparse
    n = kjt.lengths().view(len(kjt.keys()), -1)
    i = kjt.keys().index("click_50_seq__id_feat")
    start = int(n[:i].sum())
    ids = kjt.values()[start : start + int(n[i].sum())].tolist()
    assert n[i].tolist() == [2, 1, 1] and ids == [33, 66, 26, 66]


def test_a_config_written_for_use_rtp_names_sub_features_with_one_underscore():
    result = convert_pipeline_config(
        (ROOT / "tests" / "multi_tower_din_fg_rtp_mock.config").read_text(), train_input_path="d"
    )
    assert "click_50_seq_item_id" in bodies(result)
    assert body(result, "click_50_seq_item_id")["input_name"] == "click_50_seq_item_id"
    assert any("USE_RTP=1" in n for n in result.notes)


def test_several_ids_a_sequence_element_keep_value_dim_0_their_separator_and_pooling():
    result = convert_pipeline_config(SEED.read_text(), train_input_path="d", config_dir=SEED.parent)
    several = {
        body["feature_name"]: (body["value_dim"], body["value_separator"], body["pooling"])
        for entry in result.config["feature_configs"]
        for kind, body in entry.items()
        if kind == "sequence_feature" and "value_dim" in body
    }
    assert several == {"click_50_seq__id_3": (0, "\x1d", "sum"), "buy_50_id_6_seq": (0, "\x1d", "sum")}
