"""Config errors name the field path; the sparse optimizer becomes one typed spec."""

import copy

import pytest

from dynarec.config import ConfigError, config_from_dict, load_config
from dynarec.optim import Adagrad, RowWiseAdagrad
from tests.pipeline_fixtures import config_dict, write_config


def error_of(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        config_from_dict(cfg, source="test.yaml")
    return str(e.value)


def test_valid_config_builds_specs():
    cfg = config_from_dict(config_dict())
    assert cfg.train.sparse_optimizer == Adagrad(lr=0.05, initial_accumulator_value=0.1)
    assert cfg.model.name == "multi_tower_din"


def test_unknown_key_names_path():
    c = config_dict()
    c["train"]["sparse_optimizer"]["adagrad_optimizer"]["initial_accumulator_valu"] = 0.1
    assert "train.sparse_optimizer: adagrad_optimizer: unknown key 'initial_accumulator_valu'" in error_of(c)
    c = config_dict()
    c["feature_configs"][1]["id_feature"]["num_bucket"] = 3
    assert "feature_configs[1].id_feature.num_bucket: unknown key 'num_bucket'" in error_of(c)
    c = config_dict()
    c["trian"] = {}
    assert "trian: unknown key 'trian'" in error_of(c)


def test_wrong_type_names_path():
    c = config_dict()
    c["feature_configs"][2]["id_feature"]["embedding_dim"] = "sixteen"
    msg = error_of(c)
    assert "feature_configs[2].id_feature.embedding_dim" in msg and "'sixteen'" in msg


def test_missing_required_names_path():
    c = config_dict()
    del c["data"]["train_input_path"]
    assert "data.train_input_path: required field is missing" in error_of(c)


def test_bad_optimizer_field_names_path():
    c = config_dict(train__sparse_optimizer={"adagrad_optimizer": {"lr": 0.1, "eps": -1.0}})
    msg = error_of(c)
    assert "train.sparse_optimizer" in msg and "Adagrad.eps must be > 0" in msg


def test_initial_accumulator_value_under_sgd_is_an_error():
    c = config_dict(train__sparse_optimizer={"sgd_optimizer": {"lr": 0.1, "initial_accumulator_value": 0.1}})
    msg = error_of(c)
    assert "train.sparse_optimizer" in msg and "'initial_accumulator_value'" in msg and "SGD has no accumulator" in msg


def test_two_optimizers_is_an_error():
    c = config_dict(train__sparse_optimizer={"sgd_optimizer": {}, "adam_optimizer": {}})
    assert "train.sparse_optimizer: give exactly one of" in error_of(c)


def test_cross_reference_errors():
    c = config_dict()
    c["model"]["feature_groups"][0]["feature_names"].append("nope")
    assert "model.feature_groups[0].feature_names[2]: unknown feature 'nope'" in error_of(c)
    c = config_dict()
    c["feature_configs"][4]["sequence_feature"]["embedding_dim"] = 16
    assert "shares table 'item' with 'item_id' but its embedding_dim differs" in error_of(c)
    c = config_dict(train__table_optimizers={"itme": {"sgd_optimizer": {}}})
    assert "train.table_optimizers: unknown table 'itme'" in error_of(c)


def test_table_override_is_typed():
    c = config_dict(train__table_optimizers={"item": {"rowwise_adagrad_optimizer": {"lr": 0.2}}})
    cfg = config_from_dict(c)
    assert cfg.train.table_optimizers["item"] == RowWiseAdagrad(lr=0.2)


def test_load_config_resolves_paths_and_reports_file(tmp_path):
    path = write_config(tmp_path, config_dict())
    cfg = load_config(path)
    assert cfg.data.train_input_path == str(tmp_path / "data/train")
    bad = config_dict()
    bad["model"]["dinn"] = {}
    with pytest.raises(ConfigError, match=str(path)):
        load_config(write_config(tmp_path, bad, "bad.yaml").rename(path))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda c: c["model"]["multi_tower_din"]["towers"][0].update(input="usr"),
            r"model: multi_tower_din.towers\[0\]: input 'usr' names no feature group; "
            r"groups: \['item', 'seq', 'user'\]",
        ),
        (
            lambda c: c["model"]["multi_tower_din"]["din_towers"][0].update(input="user"),
            r"multi_tower_din.din_towers\[0\]: input 'user' is a 'deep' group; this tower needs a sequence group",
        ),
        (
            lambda c: c["model"]["multi_tower_din"].update(towers=[], din_towers=[]),
            r"multi_tower_din: give at least one of towers or din_towers",
        ),
        (
            lambda c: c["model"]["feature_groups"][0]["feature_names"].append("user_id"),
            r"feature_groups\[0\] \(user\): feature\(s\) \['user_id'\] listed twice",
        ),
        (
            lambda c: c["feature_configs"][5]["sequence_feature"].update(sequence_length=4),
            r"model.feature_groups\[2\] \(seq\): its sequence features are concatenated position by position and need "
            r"one sequence_length",
        ),
    ],
)
def test_model_config_errors_name_the_path(change, message):
    c = config_dict()
    change(c)
    with pytest.raises(ConfigError, match=message):
        config_from_dict(c)


@pytest.mark.parametrize(
    "path, value, message",
    [
        (
            "train__sparse_optimizer",
            {"adagrad_optimizer": {"lr": float("nan")}},
            r"train.sparse_optimizer: .*Adagrad.lr must be finite",
        ),
        (
            "train__dense_optimizer",
            {"adam_optimizer": {"lr": float("nan")}},
            r"train.dense_optimizer: .*lr must be finite",
        ),
        (
            "train__sparse_lr_schedule",
            {"kind": "exponential_decay", "decay_steps": 10, "decay_rate": float("nan")},
            r"train.sparse_lr_schedule.decay_rate: Input should be a finite number",
        ),
    ],
)
def test_nan_numbers_name_the_config_path(path, value, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(config_dict(**{path: value}))


def test_a_capacity_beyond_int64_in_yaml_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    write_config(tmp_path, config_dict(), "c.yaml")
    path.write_text(path.read_text().replace("max_capacity: 512", "max_capacity: 1.0e+30"))
    with pytest.raises(ConfigError, match=r"dynamicemb.max_capacity"):
        load_config(path)


def test_a_yaml_key_given_twice_is_refused_naming_its_path_and_lines(tmp_path):
    """YAML keeps the last of two equal keys: ``batch_size: 256`` then ``batch_size: 4`` trained at 4."""
    path = write_config(tmp_path, config_dict(), "c.yaml")
    text = path.read_text()
    path.write_text(text.replace("  batch_size: 100\n", "  batch_size: 256\n  batch_size: 4\n"))
    with pytest.raises(ConfigError, match=r"c.yaml: data.batch_size is given twice \(lines \d+ and \d+\)"):
        load_config(path)
    path.write_text(text.replace("- group_name: user", "- group_name: user\n    group_name: again"))
    with pytest.raises(ConfigError, match=r"model.feature_groups\[0\].group_name is given twice"):
        load_config(path)


def test_a_config_that_is_not_a_text_file_or_holds_a_huge_number_is_named(tmp_path):
    binary = tmp_path / "c.yaml"
    binary.write_bytes(b"data: \xff\xfe")
    with pytest.raises(ConfigError, match=r"c.yaml is not UTF-8 text \(byte 6"):
        load_config(binary)
    with pytest.raises(ConfigError, match=r"config file .* is a directory"):
        load_config(tmp_path)
    path = write_config(tmp_path, config_dict(), "n.yaml")
    path.write_text(path.read_text().replace("batch_size: 100", "batch_size: " + "9" * 5000))
    with pytest.raises(ConfigError, match=r"n.yaml: data.batch_size \(line \d+\) is a 5000-digit number"):
        load_config(path)


# -- feature kinds (docs/features.md) -------------------------------------------------------

EVERY_KIND = [
    {"id_feature": {"feature_name": "v", "embedding_dim": 4, "vocab_list": ["a", "b"], "default_value": ""}},
    {"id_feature": {"feature_name": "w", "embedding_dim": 4, "hash_bucket_size": 9, "hash_function": "murmur2"}},
    {"id_feature": {"feature_name": "z", "embedding_dim": 4, "zch": {"zch_size": 64, "lfu": {}}, "trainable": False}},
    {"raw_feature": {"feature_name": "r", "value_dim": 4, "boundaries": [0.5], "embedding_dim": 4}},
    {"raw_feature": {"feature_name": "a", "embedding_dim": 4, "autodis": {"num_channels": 3}}},
    {
        "combo_feature": {
            "feature_name": "c",
            "expression": ["user:a", "item:b"],
            "hash_bucket_size": 9,
            "embedding_dim": 4,
        }
    },
    {"lookup_feature": {"feature_name": "l", "map": "user:m", "key": "feature:r", "embedding_dim": 4, "mlp": {}}},
    {"match_feature": {"feature_name": "m", "nested_map": "user:n", "pkey": "item:p", "skey": "ALL"}},
    {"expr_feature": {"feature_name": "e", "expression": "a ^ 2", "variables": ["user:a"]}},
    {"custom_feature": {"feature_name": "k", "operator_name": "EditDistance", "expression": ["user:q", "item:t"]}},
    {"sequence_raw_feature": {"feature_name": "s", "sequence_length": 5, "value_dim": 2}},
]


def every_kind_config() -> dict:
    c = config_dict()
    c["feature_configs"] += copy.deepcopy(EVERY_KIND)  # callers edit what they get
    c["model"]["feature_groups"][1]["feature_names"] += [next(iter(f.values()))["feature_name"] for f in EVERY_KIND]
    return c


def test_every_kind_validates_and_survives_a_dump_and_reload():
    """Model directories and exports keep the config as JSON and load it back."""
    cfg = config_from_dict(every_kind_config())
    again = config_from_dict(cfg.model_dump(mode="json"))
    assert again == cfg
    assert [f.feature_name for f in cfg.features_in_order()].index("r") < [
        f.feature_name for f in cfg.features_in_order()
    ].index("l")
    kinds = {f.KIND for f in cfg.features()}
    assert kinds >= {"combo_feature", "lookup_feature", "match_feature", "expr_feature", "custom_feature"}


@pytest.mark.parametrize("kind", ["lookup_feature", "match_feature", "combo_feature", "sequence_raw_feature"])
def test_unknown_keys_of_the_new_kinds_name_their_path(kind):
    c = every_kind_config()
    i = next(i for i, f in enumerate(c["feature_configs"]) if kind in f)
    c["feature_configs"][i][kind]["bogus"] = 1
    assert f"feature_configs[{i}].{kind}.bogus: unknown key 'bogus'" in error_of(c)


def test_features_sharing_a_table_agree_on_its_settings():
    c = config_dict()
    c["feature_configs"].append(
        {"lookup_feature": {"feature_name": "l", "map": "m", "key": "k", "num_buckets": 300, "embedding_dim": 8}}
    )
    c["feature_configs"][-1]["lookup_feature"]["embedding_name"] = "item"
    assert "shares table 'item' with 'item_id' but its num_buckets differs (item_id: 200, l: 300)" in error_of(c)
    c["feature_configs"][-1]["lookup_feature"]["num_buckets"] = 200
    config_from_dict(c)
    c["feature_configs"][-1]["lookup_feature"]["trainable"] = False
    assert "its trainable differs" in error_of(c)
    c = config_dict()
    c["feature_configs"].append(
        {"id_feature": {"feature_name": "u2", "embedding_dim": 8, "embedding_name": "user_id", "value_type": "int"}}
    )
    c["feature_configs"][-1]["id_feature"]["dynamicemb"] = {"max_capacity": 512, "init_capacity": 64, "bucket_size": 8}
    msg = error_of(c)
    assert "its key_space differs (user_id: 'farmhash', u2: 'int')" in msg and "value_type / hash_function" in msg


def test_an_attention_mlp_without_layers_is_refused_by_path():
    """``attn_hidden_units: []`` (a DIN tower, a DIN model, a deep group's DIN encoder) ended in
    an IndexError traceback when the model was built; it is refused by path like any MLP's."""
    c = config_dict()
    c["model"]["multi_tower_din"]["din_towers"][0]["attn_hidden_units"] = []
    assert "model.multi_tower_din.din_towers[0].attn_hidden_units" in error_of(c)
    c = config_dict()
    c["model"] = {
        "feature_groups": c["model"]["feature_groups"],
        "din": {"din_tower": {"input": "seq", "attn_hidden_units": []}},
    }
    assert "model.din.din_tower.attn_hidden_units" in error_of(c)
    c = config_dict()
    groups = c["model"]["feature_groups"]
    deep = {"group_name": "deep", "feature_names": ["user_id", "age"], "sequence_groups": [
        {"group_name": "s", "feature_names": ["item_id", "hist_item_id"]}
    ], "sequence_encoders": [{"din_encoder": {"input": "s", "attn_hidden_units": []}}]}  # fmt: skip
    c["model"] = {
        "feature_groups": [deep, *groups[:2]],
        "dbmtl": {"task_towers": [{"tower_name": "ctr", "label_name": "clk"}]},
    }
    message = error_of(c)
    assert "sequence_encoders[0].din_encoder.attn_hidden_units" in message, message


def test_config_differences_name_paths_and_values_both_ways():
    from dynarec.config.load import config_differences, config_sections

    a = config_sections(config_from_dict(config_dict()))
    c = config_dict()
    c["feature_configs"][0]["id_feature"]["dynamicemb"]["max_capacity"] = 1024
    c["model"]["multi_tower_din"]["final_hidden_units"] = [8, 4]
    b = config_sections(config_from_dict(c))
    assert config_differences(a, b) == [
        "feature_configs[0].id_feature.dynamicemb.max_capacity: 512 in the checkpoint's, 1024 in this one",
        "model.multi_tower_din.final_hidden_units: [8] in the checkpoint's, [8, 4] in this one",
    ]
    assert config_differences({"f": [{"a": 1}]}, {"f": [{"a": 1}, {"b": 2}]}) == [
        "f: 1 in the checkpoint's, 2 in this one"
    ]
    assert config_differences(a, a) == [] and len(config_differences({"x": list(range(9))}, {"x": [9] * 9}, 3)) == 3
    assert config_differences({"k": 1}, {"j": 1}) == [
        "k: 1 in the checkpoint's, absent in this one",
        "j: absent in the checkpoint's, 1 in this one",
    ]


@pytest.mark.parametrize(
    "block, message",
    [
        ({"num_buckets": 10, "default_value": "x"}, "default_value 'x': 'x' is not an integer id"),
        ({"num_buckets": 10, "default_value": "50"}, "default_value '50': id 50 is out of range [0, 10)"),
        ({"num_buckets": 10, "default_value": "3|12", "separator": "|"}, "id 12 is out of range [0, 10)"),
        ({"num_buckets": 10, "default_value": "3:1.0,11:2.0", "separator": ",", "weighted": True}, "id 11 is out"),
    ],
)
def test_a_default_value_a_table_cannot_take_is_refused_when_the_config_loads(block, message):
    """A num_buckets feature's default_value of a non-integer or out-of-range id was reported as
    the data's, at the first row missing a value ("row 1: malformed value 'x'", a QA pass)."""
    c = config_dict()
    c["feature_configs"][1]["id_feature"].update(block)
    text = error_of(c)
    assert "feature_configs[1].id_feature" in text and message in text, text


def test_a_default_value_the_table_takes_loads():
    c = config_dict()
    c["feature_configs"][1]["id_feature"].update(default_value="7")
    c["feature_configs"][4]["sequence_feature"].update(default_value="1|199")
    assert config_from_dict(c).feature("age").default_value == "7"


@pytest.mark.parametrize(
    "where, key, value, message",
    [
        ("table", "cache_load_factor", True, r"cache_load_factor: .*a number, not a boolean"),
        ("train", "memory_budget_per_rank", True, r"train.memory_budget_per_rank: .*a number, not a boolean"),
        ("train", "host_memory_budget_per_rank", True, r"train.host_memory_budget_per_rank: .*not a boolean"),
        ("raw", "data_type", "bf16", r"data_type: belong\(s\) to a feature with a table"),
    ],
)
def test_memory_settings_take_no_boolean_and_belong_to_tables(where, key, value, message):
    c = config_dict()
    if where == "train":
        c["train"][key] = value
    else:
        index = 1 if where == "table" else -1  # age (a fixed table), price (a raw feature)
        next(iter(c["feature_configs"][index].values()))[key] = value
    with pytest.raises(ConfigError, match=message):
        config_from_dict(c)


def test_a_torcheasyrec_pipeline_config_given_as_a_config_says_to_import_it(tmp_path):
    """`dynarec train --config pipeline.config` printed PyYAML's seven-line "while scanning a
    simple key ... could not find expected ':'"."""
    from pathlib import Path

    from dynarec.config import ConfigError, load_config

    config = Path(__file__).parent / "tzrec" / "examples" / "deepfm_criteo.config"
    with pytest.raises(ConfigError, match=r"deepfm_criteo.config is a TorchEasyRec pipeline.config, not a dynarec"):
        load_config(config)
