"""Config errors name the field path; the sparse optimizer becomes one typed spec."""

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
