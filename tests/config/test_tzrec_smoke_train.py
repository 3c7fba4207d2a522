"""Every vendored TorchEasyRec config that converts (tests/config/test_tzrec_vendored.py), as a
user would smoke-test it: import-config (strict), make-data, 20 training steps, an evaluation
with finite metrics, on the CPU and (where there is one) the GPU (on an H200, 2026-12-03, the
same conversion at batch 64 of 1,500 generated rows: all 58 that converted then trained and
evaluated, 80 s; at batch 16, the 62 that convert now, semantic ids and HSTUMatch included).
Batches and evaluation are kept small, and so are the fixed tables (at most ``ROWS`` rows: the
Criteo benchmarks' 40M-row tables take 30 GiB)."""

import math

import numpy as np
import pytest
import torch

from dynarec.config import config_from_dict
from dynarec.data.generate import GenerateSpec, make_config_data
from dynarec.train.trainer import Trainer
from tests.config.test_tzrec_vendored import CONFIGS, DYNAREC_MODELS, REFUSED, convert

pytestmark = pytest.mark.slow

CONVERTING = sorted(DYNAREC_MODELS - set(REFUSED))
ROWS = 10_000


def _small_tables(c: dict) -> None:
    for entry in c["feature_configs"]:
        f = next(iter(entry.values()))
        for key in ("num_buckets", "hash_bucket_size"):
            if key in f:
                f[key] = min(f[key], ROWS)


def test_every_config_with_a_model_dynarec_has_is_smoke_trained():
    assert len(CONVERTING) == 64 and set(CONVERTING) <= set(CONFIGS)


def _fit_to_the_tree(c: dict) -> dict:
    """A TDM config's layer_num_sample cut to the tree make-data wrote over the generated items
    (about 100 of them: 8 levels where the config's tree has 21), each level's count at most its
    nodes but one."""
    from dynarec.data.tree import read_tree

    s = c["data"]["tdm_sampler"]
    tree = read_tree(s["item_input_path"], s["edge_input_path"], len(s["attr_fields"]), s["attr_delimiter"])
    sizes = np.diff(tree.level_starts)
    given = s["layer_num_sample"]
    s["layer_num_sample"] = [min(given[min(i, len(given) - 1)], int(sizes[i]) - 1) for i in range(tree.num_levels)]
    s["layer_num_sample"][0] = 0
    return c


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CONVERTING)
def test_a_converted_config_trains_20_steps_and_evaluates(name, device, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the converted data paths (d/...) are relative
    c = convert(name).config
    _small_tables(c)
    c["data"].update(batch_size=16, eval_batch_size=16, num_workers=0)
    c["train"].update(num_steps=20, save_checkpoints_steps=None, save_checkpoints_epochs=None, num_epochs=None)
    c["train"].pop("eval_every_steps", None)
    c.setdefault("eval", {})["max_steps"] = 2
    config = config_from_dict(c)
    make_config_data(
        config, tmp_path / "d", GenerateSpec(train_rows=96, eval_rows=48, train_files=1, max_sequence_length=5)
    )
    if "tdm_sampler" in c["data"]:
        config = config_from_dict(_fit_to_the_tree(c))
    report = Trainer(config, tmp_path / "m", device, progress=False).fit()
    assert report["step"] == 20
    metrics = report["eval"]
    assert metrics and all(math.isfinite(v) or k.startswith(("grouped_auc", "auc")) for k, v in metrics.items()), (
        metrics
    )
