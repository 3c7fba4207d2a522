"""TorchEasyRec's own configs through the pipeline a user runs: import-config (strict), make-data,
train, export, predict; the served scores equal eval's."""

import numpy as np
import pyarrow.parquet as pq
import pytest

from dynarec.cli import main
from dynarec.config import load_config
from dynarec.train.trainer import Trainer
from tests.config.test_tzrec import EXAMPLES


@pytest.mark.parametrize(
    "name, outputs",
    [
        # The seed's config: a dynamicemb table beside FBGEMM ones under one Adagrad, sequences of
        # several ids an element (value_dim: 0), DIN towers, dense sequences.
        ("tests/multi_tower_din_fg_dynamicemb_mock", ["probability"]),
        # A deep group nesting two sequence groups (id and dense sequences, ids and numbers as the
        # query) read by DIN encoders; two tasks.
        ("tests/dbmtl_has_sequence_mock", ["probs_ctr", "probs_cvr"]),
        # The same with variational dropout over the deep group's parts.
        ("tests/dbmtl_has_sequence_variational_dropout_mock", ["probs_ctr", "probs_cvr"]),
        # Two tasks of 2 classes each under JRC, sessions by user (their [2] probabilities served).
        ("examples/dbmtl_taobao_jrc", ["probs_ctr", "probs_cvr"]),
    ],
)
def test_a_torcheasyrec_config_imports_trains_and_serves(name, outputs, tmp_path, capsys):
    config = tmp_path / "c" / "config.yaml"
    d = tmp_path / "c" / "d"
    paths = ["--train-input-path", str(d / "train"), "--eval-input-path", str(d / "eval")]
    assert main(["import-config", str(EXAMPLES / f"{name}.config"), "-o", str(config), *paths]) == 0
    args = ["make-data", "--config", str(config), "--output-dir", str(d), "--train-rows", "300", "--eval-rows", "100"]
    assert main(args) == 0
    model_dir, export_dir = tmp_path / "m", tmp_path / "e"
    assert main(["train", "--config", str(config), "--model-dir", str(model_dir), "--no-progress"]) == 0
    assert main(["export", "--model-dir", str(model_dir), "--export-dir", str(export_dir)]) == 0
    out = tmp_path / "p.parquet"
    assert main(["predict", "--export-dir", str(export_dir), "--input", str(d / "eval"), "--output", str(out)]) == 0
    capsys.readouterr()
    served = pq.read_table(out)
    trainer = Trainer(load_config(model_dir / "config.yaml"), model_dir, progress=False)
    trainer.restore(training=False)
    scores, _, _ = trainer.predict(str(d / "eval"))
    for column in outputs:
        np.testing.assert_allclose(np.array(served.column(column).to_pylist()), scores[column], rtol=0, atol=1e-5)


def test_the_seeds_config_keeps_its_sequences_of_several_ids_an_element(tmp_path):
    config_path = tmp_path / "config.yaml"
    pipeline = EXAMPLES / "tests" / "multi_tower_din_fg_dynamicemb_mock.config"
    assert main(["import-config", str(pipeline), "-o", str(config_path)]) == 0
    config = load_config(config_path)
    several = {
        f.feature_name: (f.value_separator, f.pooling) for f in config.features() if getattr(f, "value_dim", 1) == 0
    }
    assert several == {"click_50_seq__id_3": ("\x1d", "sum"), "buy_50_id_6_seq": ("\x1d", "sum")}


def test_the_dbmtl_configs_sequence_groups_are_nested_in_its_deep_group(tmp_path):
    config_path = tmp_path / "config.yaml"
    assert (
        main(["import-config", str(EXAMPLES / "tests" / "dbmtl_has_sequence_mock.config"), "-o", str(config_path)]) == 0
    )
    deep = load_config(config_path).model.feature_groups[0]
    assert [s.group_name for s in deep.sequence_groups] == ["click_50_seq", "buy_50_seq"]
    assert [e.din_encoder is not None for e in deep.sequence_encoders] == [True, True]


@pytest.mark.parametrize(
    "name, suffix",
    [("dssm_v2_fg_mock", "tsv"), ("dssm_fg_hard_negative_mock", "tsv"), ("dssm_fg_hard_negative_mock", "parquet")],
)
def test_a_dssm_config_with_a_tokenize_feature_imports_trains_and_evaluates(name, suffix, tmp_path, capsys):
    """TorchEasyRec's dssm_v2_fg_mock: an item title tokenized by TorchEasyRec's own BPE file
    (vendored), pooled into the item tower, its sampled items' titles too; dssm_fg_hard_negative_mock
    the same with each user's hard negatives from an edge table (make-data writes one: Parquet
    where its name says so; it wrote text there, which train then could not read)."""
    config = tmp_path / "config.yaml"
    d = tmp_path / "d"
    paths = ["--train-input-path", str(d / "train"), "--eval-input-path", str(d / "eval")]
    paths += ["--sampler-input-path", str(d / f"i.{suffix}"), "--hard-negative-edge-path", str(d / f"e.{suffix}")]
    assert main(["import-config", str(EXAMPLES / "tests" / f"{name}.config"), "-o", str(config), *paths]) == 0
    loaded = load_config(config)
    title = next(f for f in loaded.features() if f.feature_name == "item_title")
    assert (title.KIND, title.table_rows, title.text_normalizer.normalizer()("Ｔｉｔｌｅ, 漢字")) == (
        "tokenize_feature", 50277, "TITLE 汉字",
    )  # fmt: skip
    hard = loaded.data.negative_sampler.hard_negatives
    assert (hard is not None) == (name == "dssm_fg_hard_negative_mock")
    rows = ["--train-rows", "300", "--eval-rows", "100"]
    assert main(["make-data", "--config", str(config), "--output-dir", str(d), *rows]) == 0
    assert (d / f"e.{suffix}").exists() == (hard is not None)
    assert main(["train", "--config", str(config), "--model-dir", str(tmp_path / "m"), "--no-progress"]) == 0
    assert '"recall@5"' in capsys.readouterr().out
