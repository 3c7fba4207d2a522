"""Multi-GPU training through NCCL: two processes on two GPUs give one GPU's results on the same
global batches (skipped where fewer than two CUDA devices are present)."""

import pytest
import torch

from tests.distributed.test_multiprocess import STEPS, assert_tables_close, merged_tables, mixed_config, run
from tests.pipeline_fixtures import make_data, write_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="fewer than two CUDA devices"),
]


def test_two_gpus_equal_one_gpu_on_the_same_global_batches(tmp_path):
    make_data(tmp_path)
    one = write_config(tmp_path, mixed_config(tmp_path, 120), "one.yaml")
    two = write_config(tmp_path, mixed_config(tmp_path, 60), "two.yaml")
    for config, model_dir, nproc in ((one, "g1", 1), (two, "g2", 2)):
        rc, out = run(
            "train", "--config", config, "--model-dir", tmp_path / model_dir, "--no-progress", "--device", "cuda",
            "--nproc", nproc,
        )  # fmt: skip
        assert rc == 0, out
    s1, t1 = merged_tables(tmp_path / "g1")
    s2, t2 = merged_tables(tmp_path / "g2")
    assert s1["step"] == s2["step"] == STEPS and s2["plan"]["world_size"] == 2
    assert t1["user_id"]["keys"].numel() > 64
    assert_tables_close(t1, t2)
    for k in s1["dense"]:
        torch.testing.assert_close(s1["dense"][k].cpu(), s2["dense"][k].cpu(), rtol=1e-5, atol=1e-6, msg=k)
