"""Every vendored TorchEasyRec config that converts (tests/config/test_tzrec_vendored.py), as a
user would smoke-test it: import-config (strict), make-data, 20 training steps, an evaluation
with finite metrics, on the CPU and (where there is one) the GPU (on an H200, 2026-12-03, the
same conversion at batch 64 of 1,500 generated rows: all 58 that converted then trained and
evaluated, 80 s; at batch 16, the 62 that convert now, semantic ids and HSTUMatch included).
Batches and evaluation are kept small, and so are the fixed tables (at most ``ROWS`` rows: the
Criteo benchmarks' 40M-row tables take 30 GiB)."""

import math

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
    assert len(CONVERTING) == 62 and set(CONVERTING) <= set(CONFIGS)


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
    report = Trainer(config, tmp_path / "m", device, progress=False).fit()
    assert report["step"] == 20
    metrics = report["eval"]
    assert metrics and all(math.isfinite(v) or k.startswith(("grouped_auc", "auc")) for k, v in metrics.items()), (
        metrics
    )
