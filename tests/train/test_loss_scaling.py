"""FP16 training with dynamic loss scaling (dynarec/train/loss_scaling.py): the scale moves as
torch.amp.GradScaler moves it, the tables' fused updates see the gradient of the unscaled loss
(scale 1: bit for bit the plain fp16 step), an overflowing step writes nothing anywhere, and a
checkpoint carries the scale."""

import pytest
import torch

from dynarec.config import ConfigError
from dynarec.config.schema import GradScalerCfg
from dynarec.train.loss_scaling import LossScaler
from dynarec.train.trainer import Trainer
from tests.train.test_trainer import _dense_params, _training_data, small_config


def test_the_scale_moves_as_torchs_grad_scaler_moves_it():
    cfg = GradScalerCfg(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    ours = LossScaler(cfg)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    for overflow in [False, False, False, True, False, False, False, False, True, True, False]:
        theirs.scale(torch.ones(()))
        p.grad = torch.tensor([float("inf") if overflow else 1.0, 0.0])
        theirs.step(opt)
        theirs.update()
        ours.overflowed = overflow
        ours.update()
        assert ours.scale == theirs.get_scale()
    assert ours.skipped_steps == 3


def _tables(trainer):
    return {n: t.dump()["weight"].clone() for n, t in trainer.task.embeddings.tables.items()}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def _fp16(tmp_path, name, path, device="cpu", **scaler):
    train = {"num_steps": 3, "mixed_precision": "fp16", "sparse_optimizer": {"sgd_optimizer": {"lr": 0.5}}}
    train["grad_scaler"] = scaler
    trainer = Trainer(small_config(path, **train), tmp_path / name, device, progress=False)
    report = trainer.fit()
    return trainer, report


@pytest.mark.parametrize("device", DEVICES)
def test_the_tables_see_the_gradient_of_the_unscaled_loss(device, tmp_path):
    """SGD tables (an update linear in the gradient): scale 1 is the plain fp16 step bit for bit;
    scale 2^12 (exact in binary) the same up to float16's rounding of small gradients."""
    path = _training_data(tmp_path)
    train = {"num_steps": 3, "mixed_precision": "fp16", "sparse_optimizer": {"sgd_optimizer": {"lr": 0.5}}}
    plain = Trainer(small_config(path, **train), tmp_path / "plain", device, progress=False)
    plain.fit()
    one, report = _fp16(tmp_path, "one", path, device, init_scale=1.0)
    assert report["overflow_skipped_steps"] == 0 and report["loss_scale"] == 1.0
    for name, w in _tables(plain).items():
        assert torch.equal(_tables(one)[name], w), name
    assert all(torch.equal(a, b) for a, b in zip(_dense_params(one), _dense_params(plain)))
    big, report = _fp16(tmp_path, "big", path, device, init_scale=2.0**12)
    assert report["loss_scale"] == 2.0**12
    initial = _tables(Trainer(small_config(path, **train), tmp_path / "init", device, progress=False))["item"]
    assert not torch.equal(_tables(plain)["item"], initial)  # the steps moved the rows
    for name, w in _tables(plain).items():
        torch.testing.assert_close(_tables(big)[name], w, rtol=1e-3, atol=1e-6)


def test_an_overflowing_step_writes_nothing_and_backs_the_scale_off(tmp_path):
    path = _training_data(tmp_path)
    train = {"mixed_precision": "fp16", "grad_scaler": {"init_scale": 2.0**60}, "num_steps": 1}
    trainer = Trainer(small_config(path, **train), tmp_path / "m", progress=False)
    tables, dense = _tables(trainer), _dense_params(trainer)
    report = trainer.fit()  # 2^60 times the loss overflows float16 in the backward
    assert report["overflow_skipped_steps"] == 1 and report["loss_scale"] == 2.0**59
    for name, w in tables.items():
        assert torch.equal(_tables(trainer)[name], w), name
    assert all(torch.equal(a, b) for a, b in zip(_dense_params(trainer), dense))
    # the scale comes down until the steps go through, and a resumed run continues from it
    train = {**train, "num_steps": 60}
    trainer = Trainer(small_config(path, **train), tmp_path / "m2", progress=False)
    report = trainer.fit()
    skipped = report["overflow_skipped_steps"]
    assert 0 < skipped < 60 and report["loss_scale"] == 2.0 ** (60 - skipped)  # no growth in 60 steps
    assert any(not torch.equal(a, b) for a, b in zip(_dense_params(trainer), dense))
    resumed = Trainer(small_config(path, **train), tmp_path / "m2", progress=False)
    resumed.restore()
    assert resumed.loss_scaler.state() == trainer.loss_scaler.state()


def test_grad_scaler_is_fp16s():
    with pytest.raises(ConfigError, match="grad_scaler: loss scaling is for mixed_precision fp16"):
        small_config("x", mixed_precision="bf16", grad_scaler={})
    with pytest.raises(ConfigError, match="growth_factor"):
        small_config("x", mixed_precision="fp16", grad_scaler={"growth_factor": 0.5})
