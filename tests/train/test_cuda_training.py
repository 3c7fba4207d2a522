"""The trainer on a CUDA device: pinned batches (with and without DataLoader workers), their copy
and the hash finds on the collection's input stream; the same run as on the CPU (skipped where
no GPU is present)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynarec.config import load_config
from dynarec.train.trainer import Trainer
from tests.matrix import needs_cuda
from tests.pipeline_fixtures import config_dict, make_data, write_config

pytestmark = [needs_cuda, pytest.mark.slow]


def test_a_cuda_trainer_is_freed_when_its_last_reference_goes(tmp_path):
    """No reference cycle keeps a CUDA trainer alive: the dense model's graphs held a bound
    method of the trainer (the report of a refused capture), which left it and its process
    group's pending work to a GC pass or the interpreter's exit."""
    import weakref

    make_data(tmp_path)
    trainer = Trainer(load_config(write_config(tmp_path, config_dict())), tmp_path / "m", device="cuda", progress=False)
    assert trainer.task.graphs is not None and trainer.task.graphs.on_refusal is not None
    ref = weakref.ref(trainer)
    del trainer
    assert ref() is None


@pytest.mark.parametrize("workers", [0, 2])
def test_cuda_training_matches_the_cpu_run(tmp_path, workers):
    make_data(tmp_path)
    config = load_config(write_config(tmp_path, config_dict(data__num_workers=workers)))
    runs = {}
    for device in ("cpu", "cuda"):
        trainer = Trainer(config, tmp_path / f"model-{device}", device=device, progress=False)
        metrics = trainer.fit()
        runs[device] = (metrics, trainer.task.embeddings)
    (m_cpu, e_cpu), (m_gpu, e_gpu) = runs["cpu"], runs["cuda"]
    assert m_gpu["step"] == m_cpu["step"] == 12
    assert m_gpu["eval"]["auc"] == pytest.approx(m_cpu["eval"]["auc"], abs=2e-3)
    for name, table in e_cpu.tables.items():
        dc, dg = table.dump(), e_gpu.tables[name].dump()
        for field in ("keys", "slots", "scores"):
            if field in dc:  # a dynamic table: the same keys in the same slots
                assert torch.equal(dc[field], dg[field]), (name, field)
        # float sums in another order on the GPU (the dense model, the kernels): close, not equal
        torch.testing.assert_close(dg["weight"], dc["weight"], rtol=1e-3, atol=1e-4)


def test_training_with_workers_on_cuda_equals_training_without(tmp_path):
    """``dynarec train --device cuda`` with DataLoader workers: every worker aborted with ``CUDA
    error: initialization error`` (forked after CUDA was initialized). Workers now start from a
    fork server; the run equals the one without workers bit for bit."""
    from dynarec.cli import main

    make_data(tmp_path)
    dumps = {}
    for workers in (0, 3):
        c = config_dict(data__num_workers=workers)
        cfg = write_config(tmp_path, c, f"w{workers}.yaml")
        model_dir = tmp_path / f"m{workers}"
        assert main(["train", "--config", str(cfg), "--model-dir", str(model_dir), "--device", "cuda"]) == 0
        trainer = Trainer(load_config(cfg), model_dir, device="cuda", progress=False)
        trainer.restore(training=False)
        dumps[workers] = {n: t.dump() for n, t in trainer.task.embeddings.tables.items()}
    for name, dump in dumps[0].items():
        for field, value in dump.items():
            assert torch.equal(value, dumps[3][name][field]), (name, field)


@pytest.mark.parametrize("workers", [0, 2])
def test_cached_epochs_on_cuda_train_on_device_copies_and_equal_an_uncached_run(tmp_path, workers, monkeypatch):
    """data.cache_batches: memory on a GPU keeps the first epoch's batches in device memory and
    trains every epoch on those copies (read ahead with their event); the run equals the one
    without a cache bit for bit."""
    from dynarec.data.batch_cache import MemoryBatchCache

    make_data(tmp_path)
    kept: list[str] = []
    real_add = MemoryBatchCache.add

    def recording_add(self, batch):
        out = real_add(self, batch)
        kept.append(out.labels.device.type)
        return out

    monkeypatch.setattr(MemoryBatchCache, "add", recording_add)
    dumps = {}
    for cache in (False, "memory"):
        c = config_dict(data__num_workers=workers, data__cache_batches=cache, data__eval_input_path=None)
        c["train"]["num_epochs"] = 3
        trainer = Trainer(load_config(write_config(tmp_path, c, f"c{cache}.yaml")), tmp_path / f"m{cache}",
                          device="cuda", progress=False)  # fmt: skip
        assert trainer.fit()["step"] == 36
        dumps[cache] = {n: t.dump() for n, t in trainer.task.embeddings.tables.items()}
    assert kept == ["cuda"] * 12  # the first epoch's batches, each copied to the device once
    for name, dump in dumps[False].items():
        for field, value in dump.items():
            assert torch.equal(value, dumps["memory"][name][field]), (name, field)


_OOM_CHILD = "DYNAREC_TEST_OOM_CHILD"  # set in the process the test runs itself in


def test_out_of_memory_in_a_step_is_a_named_error_and_the_checkpoint_stays(tmp_path):
    """A step that cannot allocate (the process capped just above what it holds, the free room
    of the segments it holds taken, and a batch of 10 times the rows of the steps before, whose
    freed tensors would serve a step of their size) ends in one named error naming the step,
    the device and the latest checkpoint, which still loads.

    Run in a fresh process: after other tests the allocator's cache holds free blocks (of
    released CUDA graphs' pools, in segments still partly used) that can serve the whole step,
    and the cap, which bounds new segments only, would not bite."""
    if os.environ.get(_OOM_CHILD) != "1":
        node = f"{Path(__file__).name}::test_out_of_memory_in_a_step_is_a_named_error_and_the_checkpoint_stays"
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/train/{node}"],
            cwd=Path(__file__).resolve().parents[2], env={**os.environ, _OOM_CHILD: "1"}, capture_output=True,
            text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0 and "1 passed" in done.stdout, (done.stdout + done.stderr)[-6000:]
        return
    from dynarec.train.checkpoint import load_checkpoint
    from dynarec.train.input import TrainInput
    from dynarec.train.trainer import TrainingError

    make_data(tmp_path)
    c = config_dict(data__eval_input_path=None)
    del c["train"]["num_epochs"]
    c["train"].update(num_steps=2, save_checkpoints_steps=1)
    trainer = Trainer(load_config(write_config(tmp_path, c)), tmp_path / "m", device="cuda", progress=False)
    trainer.fit()
    latest = trainer.checkpoints.latest()
    c["data"].update(batch_size=1000, num_workers=0)  # the rest of the 1,200 rows
    batches = TrainInput(load_config(write_config(tmp_path, c, "big.yaml")), trainer.ctx, "cuda").batches(
        trainer.position
    )
    batch, _, rows = next(batches)
    assert rows == 1000
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # The free blocks of the segments still held taken by tensors of their size, on their stream
    # (the caching allocator reuses a free block of the exact size; its snapshot's keys as torch
    # 2.11-2.13 name them). Without this the small tensors of the step could fit in their room;
    # the 10-times batch is what must fail to allocate.
    held = [
        _tensor_on(segment["stream"], block["size"])
        for segment in torch.cuda.memory_snapshot()
        if segment.get("segment_pool_id", (0, 0)) == (0, 0)  # not a CUDA graph's pool
        and segment["device"] == torch.cuda.current_device()
        for block in segment["blocks"]
        if block["state"] == "inactive"
    ]
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (1 << 16)) / total)
        with pytest.raises(TrainingError, match=rf"step 3: out of memory on cuda.*the latest checkpoint is {latest}"):
            trainer.train_step(batch, rows)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        del held
    load_checkpoint(latest)


def _tensor_on(stream: int, size: int) -> torch.Tensor:
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        return torch.empty(size, dtype=torch.uint8, device="cuda")
