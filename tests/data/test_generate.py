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
    assert set(batch.labels.tolist()) <= {0.0, 1.0}


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
