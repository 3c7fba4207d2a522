"""A row's score depends on that row alone: every model in the registry scores the same rows
identically at batch sizes 1, 37 and 4096, through an export (padding masked everywhere)."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynarec.config import config_from_dict
from dynarec.config.schema import RETRIEVAL_KEYS
from dynarec.config.sid import SID_KEYS
from dynarec.data.tree import init_tree, write_tree
from dynarec.serving import ExportedModel
from dynarec.train.export import export_model
from dynarec.train.trainer import Trainer
from tests.models.test_models import MULTI_TASK, ROW_MODELS, model_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """300 rows; histories of 0 to 5 ids, so batches pad to different lengths."""
    rng = np.random.default_rng(0)
    n = 300
    lengths = rng.integers(0, 5, n)
    lengths[7] = 5  # the longest history sits in one row only
    root = tmp_path_factory.mktemp("rows")
    pq.write_table(
        pa.table(
            {
                "a": rng.integers(0, 10, n),
                "b": rng.integers(0, 10, n),
                "s": ["|".join(str(x) for x in rng.integers(0, 10, k)) for k in lengths],
                "x": rng.normal(size=n),
                "label": rng.integers(0, 2, n),
                "label2": rng.integers(0, 2, n),
            }
        ),
        root / "rows.parquet",
    )
    return root / "rows.parquet"


@pytest.mark.parametrize("name", ROW_MODELS)
def test_scores_do_not_depend_on_the_batch(name, data, tmp_path):
    raw = model_config(name).model_dump(mode="json")
    raw["data"] = {"train_input_path": str(data), "batch_size": 64}
    if name == "tdm":  # trained on the samples of a tree over the items "b", scored row by row
        ids = np.arange(10)
        write_tree(init_tree(ids, pa.array(["c"] * 10), []), tmp_path / "tree")
        raw["data"]["tdm_sampler"] = {
            "item_input_path": str(tmp_path / "tree" / "node_table.txt"),
            "edge_input_path": str(tmp_path / "tree" / "edge_table.txt"),
            "item_id_field": "b",
            "layer_num_sample": [0, 1, 1, 1, 1],
        }
        for f in raw["feature_configs"]:  # the table of "b" (and "s") holds the inner nodes' ids too (up to 24)
            body = next(v for v in f.values() if v is not None)
            if body["feature_name"] in ("b", "s"):
                body["num_buckets"] = 32
    if name not in MULTI_TASK and name not in SID_KEYS:
        raw["data"]["label_field"] = "label"
    raw["train"]["num_epochs"] = 1
    raw["eval"] = {"metrics": ["auc"]}
    trainer = Trainer(config_from_dict(raw), tmp_path / "m", progress=False)
    trainer.fit()
    export = export_model(trainer.task, trainer.example_batch(), tmp_path / "export")
    model = ExportedModel(export)
    scores = {b: model.predict_files(str(data), batch_size=b) for b in (1, 37, 4096)}
    served = ["user_embedding", "item_embedding"] if name in RETRIEVAL_KEYS else ["probability"]
    if name == "mind":
        served[0] = "user_interests"
    if name in SID_KEYS:
        served = ["codes"]
    assert list(scores[1]) == (["probs_ctr", "probs_cvr"] if name in MULTI_TASK else served)
    for output, one in scores[1].items():
        assert one.shape[0] == 300 and one.ndim == (2 if name in RETRIEVAL_KEYS or name in SID_KEYS else 1)
        np.testing.assert_allclose(scores[37][output], one, rtol=0, atol=1e-6)
        np.testing.assert_allclose(scores[4096][output], one, rtol=0, atol=1e-6)
