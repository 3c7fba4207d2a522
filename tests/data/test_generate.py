"""``dynarec make-data --config C``: columns every feature of any config reads, of the types it
expects, with a learnable label."""

import pyarrow.parquet as pq
import pytest

from dynarec.cli import main
from dynarec.config import config_from_dict, load_config
from dynarec.config.tzrec import convert_pipeline_config
from dynarec.data import ArrowBatchDataset, BatchBuilder, make_loader
from dynarec.data.generate import GenerateSpec, make_config_data
from tests.config.test_tzrec import EXAMPLES
from tests.pipeline_fixtures import config_dict


def batches_of(config, directory):
    files = sorted(str(p) for p in (directory / "train").glob("*.parquet"))
    ds = ArrowBatchDataset(files, BatchBuilder(config), 64)
    ds.check_files()
    return list(make_loader(ds, 0))


def test_the_columns_of_the_pipeline_config_fixtures_build_batches(tmp_path):
    config = config_from_dict(config_dict())
    meta = make_config_data(config, tmp_path / "d", GenerateSpec(train_rows=300, eval_rows=100, train_files=2))
    assert meta["train_rows"] == 300 and 0.6 < meta["bayes_optimal_eval_auc"] <= 1.0
    (batch, *rest) = batches_of(config, tmp_path / "d")
    assert sum(b.num_rows for b in [batch, *rest]) == 300
    table = pq.read_table(tmp_path / "d" / "train" / "part-0.parquet")
    assert table.schema.field("user_id").type == "string"  # value_type: string
    assert table.schema.field("age").type == "int64"
    lengths = batch.sequence_lengths(["hist_item_id", "hist_cate_id"])
    assert lengths["hist_item_id"].tolist() == lengths["hist_cate_id"].tolist()  # one sequence group
    assert int(lengths["hist_item_id"].max()) <= 6 and int(lengths["hist_item_id"].min()) >= 1
    assert set(batch.labels.flatten().tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("name", ["dlrm_criteo", "deepfm_criteo", "multi_tower_din_taobao"])
def test_torcheasyrecs_examples_get_data_they_train_on(name, tmp_path):
    text = (EXAMPLES / f"{name}.config").read_text()
    result = convert_pipeline_config(text, train_input_path="d/train", eval_input_path="d/eval")
    config = config_from_dict(result.config)
    make_config_data(config, tmp_path / "d", GenerateSpec(train_rows=200, eval_rows=64, train_files=1))
    assert sum(b.num_rows for b in batches_of(config, tmp_path / "d")) == 200


def test_make_data_with_a_config_on_the_command_line(tmp_path, capsys):
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config_dict()))
    args = ["make-data", "--config", str(tmp_path / "c.yaml"), "--output-dir", str(tmp_path / "data")]
    assert main([*args, "--train-rows", "200", "--eval-rows", "50"]) == 0
    assert "of the columns of" in capsys.readouterr().out
    config = load_config(tmp_path / "c.yaml")
    assert sum(b.num_rows for b in batches_of(config, tmp_path / "data")) == 200


def test_make_data_of_a_config_using_every_kind_builds_batches(tmp_path):
    """Columns of the right types for every kind (map columns for lookup, nested maps for match,
    vector columns for value_dim, dense sequences, vocabulary words, id:weight pairs); a vocab_file
    that does not exist is written where the config names it."""
    from tests.config.test_config import every_kind_config

    c = every_kind_config()
    vocab = tmp_path / "vocab" / "words.txt"
    c["feature_configs"] += [
        {
            "id_feature": {
                "feature_name": "vf",
                "embedding_dim": 4,
                "vocab_file": str(vocab),
                "default_bucketize_value": 0,
            }
        },
        {"id_feature": {"feature_name": "wt", "embedding_dim": 4, "num_buckets": 50, "weighted": True}},
        {"lookup_feature": {"feature_name": "lv", "map": "user:mv", "key": "item:kv", "value_dim": 3}},
        {
            "lookup_feature": {
                "feature_name": "ld",
                "map": "user:md",
                "key": "item:kd",
                "vocab_list": ["x", "y"],
                "embedding_dim": 4,
            }
        },
        {"match_feature": {"feature_name": "mn", "nested_map": "user:nn", "pkey": "item:pp", "skey": "item:ss"}},
    ]
    c["feature_configs"][-1]["match_feature"].update(num_buckets=20, embedding_dim=4)
    c["model"]["feature_groups"][1]["feature_names"] += ["vf", "wt", "lv", "ld", "mn"]
    config = config_from_dict(c)
    meta = make_config_data(config, tmp_path / "d", GenerateSpec(train_rows=300, eval_rows=64, train_files=2))
    assert meta["vocab_files_written"] == [str(vocab)] and vocab.read_text().startswith("vf_w0\n")
    table = pq.read_table(tmp_path / "d" / "train" / "part-0.parquet")
    types = {name: str(table.schema.field(name).type) for name in table.column_names}
    assert types["m"].startswith("map<string, double") and types["mv"].startswith("map<string, string")
    assert types["n"].startswith("map<string, string") and types["r"].startswith("list<")
    assert types["s"].count("list<") == 2 and types["v"] == "string" and types["q"] == "string"
    assert set(table.column("v").to_pylist()) & {"a", "b"}
    assert ":" in table.column("wt").to_pylist()[0]
    batches = batches_of(config, tmp_path / "d")
    assert sum(b.num_rows for b in batches) == 300
    b = batches[0]
    assert b.dense["lv"].shape == (64, 3) and b.dense["s"].shape[2] == 2 and b.dense_lengths["s"].shape == (64,)
    assert b.sparse.weights_or_none() is not None
    assert float((b.dense["lv"] != 0).float().mean()) > 0.05  # the map is keyed by what the key column holds


def test_torcheasyrecs_fg_mock_with_every_kind_gets_data_it_trains_on(tmp_path):
    """The vendored multi_tower_din_fg_mock (combo, lookup with feature: keys, match, expr,
    EditDistance, raw value_dim 4, autodis / mlp, dense sequences), imported with --lenient."""
    from tests.config.test_tzrec import EXAMPLES

    text = (EXAMPLES / "tests" / "multi_tower_din_fg_mock.config").read_text()
    result = convert_pipeline_config(text, train_input_path="d/train", eval_input_path="d/eval", lenient=True)
    config = config_from_dict(result.config)
    assert {f.KIND for f in config.features()} >= {"combo_feature", "lookup_feature", "match_feature", "expr_feature"}
    make_config_data(config, tmp_path / "d", GenerateSpec(train_rows=200, eval_rows=64, train_files=1))
    assert sum(b.num_rows for b in batches_of(config, tmp_path / "d")) == 200


def test_every_kind_builds_the_same_batch_on_the_python_path(tmp_path):
    """The C++ extension's paths (split-and-hash, hashing, EditDistance) and pyarrow's give one
    batch, for every kind; an empty and a one-row table build too."""
    import torch

    from dynarec.features import native
    from tests.config.test_config import every_kind_config

    config = config_from_dict(every_kind_config())
    make_config_data(config, tmp_path / "d", GenerateSpec(train_rows=200, eval_rows=8, train_files=1))
    table = pq.read_table(tmp_path / "d" / "train" / "part-0.parquet")
    builder = BatchBuilder(config)
    fast = builder.build(table, "t.parquet")
    with native.python_path():
        slow = builder.build(table, "t.parquet")
    assert torch.equal(fast.sparse.values(), slow.sparse.values())
    assert torch.equal(fast.sparse.lengths(), slow.sparse.lengths())
    assert fast.dense.keys() == slow.dense.keys() and all(torch.equal(fast.dense[k], slow.dense[k]) for k in fast.dense)
    for n in (0, 1):
        b = builder.build(table.slice(0, n), "t.parquet")
        assert b.num_rows == n and b.dense["s"].shape[:1] == (n,) and b.dense_lengths["s"].shape == (n,)


def test_make_data_writes_every_label_of_a_multi_task_model(tmp_path):
    """A click, a purchase that needs the click, a class label and a regression target."""
    from tests.models.test_models import model_config

    raw = model_config("mmoe").model_dump(mode="json", exclude_unset=True)
    raw["model"]["mmoe"]["task_towers"] += [
        {"tower_name": "stars", "label_name": "stars", "num_class": 3, "losses": [{"softmax_cross_entropy": {}}]},
        {"tower_name": "dwell", "label_name": "dwell", "losses": [{"l2_loss": {}}]},
    ]
    config = config_from_dict(raw)
    make_config_data(config, tmp_path / "d", GenerateSpec(train_rows=2000, eval_rows=100, train_files=1))
    table = pq.read_table(tmp_path / "d" / "train" / "part-0.parquet")
    click, buy = table.column("label").to_numpy(), table.column("label2").to_numpy()
    assert set(click) == {0, 1} and set(buy) == {0, 1}
    assert (buy <= click).all() and buy.mean() < click.mean()
    assert sorted(set(table.column("stars").to_pylist())) == [0, 1, 2]
    assert table.schema.field("dwell").type == "double"
    (batch, *_) = batches_of(config, tmp_path / "d")
    assert batch.labels.shape == (64, 4)  # label, label2, stars, dwell: Config.label_fields()
