"""End to end on tiny data: train -> evaluate -> export -> predict, exact resume, atomic
checkpoints, and bad input that names the culprit and writes nothing."""

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dynarec.cli import main
from dynarec.config import load_config
from dynarec.serving import ExportedModel
from dynarec.train.checkpoint import latest_checkpoint, load_checkpoint
from dynarec.train.trainer import Trainer
from tests.pipeline_fixtures import config_dict, make_data, write_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    make_data(root)
    return root


def run_cli(*args) -> tuple[int, str]:
    """The CLI in a fresh process (as a user runs it)."""
    proc = subprocess.run(
        [sys.executable, "-m", "dynarec.cli", *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_train_evaluate_export_predict(data_root, tmp_path, capsys):
    cfg_path = write_config(
        data_root, config_dict(train__eval_every_steps=6, train__save_checkpoints_steps=5), "e2e.yaml"
    )
    model_dir, export_dir = tmp_path / "model", tmp_path / "export"
    assert main(["train", "--config", str(cfg_path), "--model-dir", str(model_dir), "--no-progress"]) == 0
    for name in ("config.yaml", "metrics.json", "curves.png"):
        assert (model_dir / name).is_file(), name
    assert any((model_dir / "tb").iterdir())
    metrics = json.loads((model_dir / "metrics.json").read_text())
    assert metrics["final"]["step"] == 12 and 0.0 < metrics["final"]["eval"]["auc"] <= 1.0
    assert [s for s, _ in metrics["history"]["eval"]] == [6, 12]  # the last step is evaluated once

    capsys.readouterr()
    assert main(["evaluate", "--model-dir", str(model_dir)]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["auc"] == pytest.approx(metrics["final"]["eval"]["auc"], abs=1e-12)

    assert main(["export", "--model-dir", str(model_dir), "--export-dir", str(export_dir)]) == 0
    assert (export_dir / "dense.pt2").is_file() and (export_dir / "tables" / "user_id.safetensors").is_file()

    eval_file = data_root / "data" / "eval" / "part-0.parquet"
    out_export, out_ckpt = tmp_path / "p_export.parquet", tmp_path / "p_ckpt.parquet"
    assert (
        main(["predict", "--export-dir", str(export_dir), "--input", str(eval_file), "--output", str(out_export)]) == 0
    )
    assert main(["predict", "--model-dir", str(model_dir), "--input", str(eval_file), "--output", str(out_ckpt)]) == 0
    served = pq.read_table(out_export).column("probability").to_numpy()
    from_ckpt = pq.read_table(out_ckpt).column("probability").to_numpy()

    trainer = Trainer(load_config(model_dir / "config.yaml"), model_dir, progress=False)
    trainer.restore()
    outputs, labels, _ = trainer.predict(str(eval_file))
    eval_probs = outputs["probability"]
    assert served.shape == eval_probs.shape == (400,)
    np.testing.assert_allclose(served, eval_probs, rtol=0, atol=1e-5)
    np.testing.assert_allclose(from_ckpt, eval_probs, rtol=0, atol=1e-6)
    assert pq.read_table(out_export).column("clk").to_numpy().tolist() == labels[:, 0].astype(int).tolist()
    # One row at a time through the export, too (batch of 1 against a batch-dynamic program).
    one = ExportedModel(export_dir).predict_files(str(eval_file), batch_size=1)["probability"]
    np.testing.assert_allclose(one, eval_probs, rtol=0, atol=1e-5)


def snapshot(model_dir: Path):
    state, (tables,) = load_checkpoint(latest_checkpoint(model_dir / "checkpoints"))
    return state, tables


def assert_same(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def straight_and_resumed(straight, half, tmp_path):
    """``(snapshot of a, snapshot of b)``: model dir a trained by the ``straight`` config; b by
    ``half``, then resumed in a fresh process by ``straight``."""
    for args in (
        (straight, tmp_path / "a"),
        (half, tmp_path / "b"),
        (straight, tmp_path / "b", "--resume"),
    ):
        rc, out = run_cli("train", "--config", args[0], "--model-dir", args[1], "--no-progress", *args[2:])
        assert rc == 0, out
    return snapshot(tmp_path / "a"), snapshot(tmp_path / "b")


def test_resume_is_exact_across_processes(data_root, tmp_path):
    # Two epochs of 12 steps; stop at 15 (mid-epoch 2), resume in a fresh process to 24.
    c = config_dict(data__eval_input_path=None)
    del c["train"]["num_epochs"]
    c["train"]["sparse_optimizer"] = {"adagrad_optimizer": {"lr": 0.05, "initial_accumulator_value": 0.1}}
    straight = write_config(data_root, {**c, "train": {**c["train"], "num_steps": 24}}, "straight.yaml")
    half = write_config(data_root, {**c, "train": {**c["train"], "num_steps": 15}}, "half.yaml")
    (sa, ta), (sb, tb) = straight_and_resumed(straight, half, tmp_path)
    assert sa["step"] == sb["step"] == 24
    assert ta["user_id"]["keys"].numel() > 64  # the dynamic table grew past init_capacity
    assert_same(ta, tb, "tables")
    assert_same(sa["dense"], sb["dense"], "dense")
    assert_same(sa["dense_optimizer"], sb["dense_optimizer"], "dense_optimizer")


KILL_SCRIPT = r"""
import sys, time
from dynarec.config import load_config
from dynarec.train import checkpoint
from dynarec.train.trainer import Trainer

trainer = Trainer(load_config(sys.argv[1]), sys.argv[2], progress=False)
trainer.fit()  # 12 steps, checkpoint ckpt-12 committed

real_write = checkpoint._write_file
def slow_write(path, obj):
    real_write(path, obj)
    with open(path, "r+b") as f:  # leave a half-written file behind, then hang
        f.truncate(f.seek(0, 2) // 2)
    print("WRITING", flush=True)
    time.sleep(120)
checkpoint._write_file = slow_write
trainer.step += 1
trainer.save()
"""


def test_kill_during_checkpoint_leaves_previous_loadable(data_root, tmp_path):
    cfg = write_config(data_root, config_dict(data__eval_input_path=None), "kill.yaml")
    model_dir = tmp_path / "m"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(cfg), str(model_dir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    deadline = time.time() + 120
    line = ""
    while time.time() < deadline and "WRITING" not in line:
        line = proc.stdout.readline()
    assert "WRITING" in line
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert any(p.name.startswith(".ckpt-") for p in (model_dir / "checkpoints").iterdir())  # the debris
    state, _ = load_checkpoint(latest_checkpoint(model_dir / "checkpoints"))
    assert state["step"] == 12
    trainer = Trainer(load_config(cfg), model_dir, progress=False)
    assert trainer.restore().name == "ckpt-0000000012"


# -- bad input: the culprit is named, nothing is written ----------------------------------------------


def _bad_train_file(root: Path, name: str, change) -> Path:
    src = pq.read_table(root / "data" / "train" / "part-0.parquet").slice(0, 200)
    d = root / name
    d.mkdir(exist_ok=True)
    pq.write_table(change(src), d / "part-0.parquet")
    return d


def _set(col: str, row: int, value):
    def change(t: pa.Table) -> pa.Table:
        values = t.column(col).to_pylist()
        values[row] = value
        return t.set_column(t.schema.get_field_index(col), col, pa.array(values, type=t.schema.field(col).type))

    return change


@pytest.mark.parametrize(
    "name, change, message",
    [
        ("missing_column", lambda t: t.drop_columns(["price"]), "missing column 'price' (feature 'price')"),
        ("nan_dense", _set("price", 7, float("nan")), "row 7: feature 'price' (column 'price'): value nan"),
        (
            "malformed_multi",
            _set("hist_item_id", 3, "12||7"),
            "row 3: feature 'hist_item_id' (column 'hist_item_id'): malformed",
        ),
        ("negative_id", _set("item_id", 5, -3), "row 5: feature 'item_id' (column 'item_id'): id -3 is out of range"),
        (
            "out_of_range_id",
            _set("cate_id", 9, 10),
            "row 9: feature 'cate_id' (column 'cate_id'): id 10 is out of range [0, 10)",
        ),
    ],
)
def test_bad_data_names_culprit_and_writes_nothing(data_root, tmp_path, name, change, message):
    bad = _bad_train_file(data_root, name, change)
    cfg = write_config(
        data_root, config_dict(data__train_input_path=str(bad), data__eval_input_path=None), f"{name}.yaml"
    )
    model_dir = tmp_path / "m"
    rc, out = run_cli("train", "--config", cfg, "--model-dir", model_dir, "--no-progress")
    assert rc == 2, out
    assert message in out and "part-0.parquet" in out, out
    assert not model_dir.exists()


@pytest.fixture(scope="module")
def trained(data_root, tmp_path_factory):
    cfg = write_config(data_root, config_dict(data__eval_input_path=None), "trained.yaml")
    model_dir = tmp_path_factory.mktemp("trained") / "m"
    assert main(["train", "--config", str(cfg), "--model-dir", str(model_dir), "--no-progress"]) == 0
    return cfg, model_dir


def _listing(d: Path) -> dict[str, int]:
    """Every file and its size, but the lock file (each run writes its own PID there)."""
    return {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_checkpoint_on_resume_names_the_file(trained, tmp_path, damage):
    cfg, src = trained
    model_dir = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(src), str(model_dir)], check=True)
    state = latest_checkpoint(model_dir / "checkpoints") / "tables.pt"
    data = state.read_bytes()
    state.write_bytes(
        data[: len(data) // 3] if damage == "truncate" else data[:100] + bytes([data[100] ^ 1]) + data[101:]
    )
    before = _listing(model_dir)
    rc, out = run_cli("train", "--config", cfg, "--model-dir", model_dir, "--resume", "--no-progress")
    assert rc == 2 and "corrupt checkpoint" in out and str(state) in out, out
    assert _listing(model_dir) == before


def test_the_cli_prints_its_own_warnings_as_its_errors_without_pythons_source_lines(trained, tmp_path):
    cfg, src = trained
    model_dir = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(src), str(model_dir)], check=True)
    (model_dir / "checkpoints" / "latest").write_text("garbage\n")  # the newest complete one is used
    rc, out = run_cli("evaluate", "--config", cfg, "--model-dir", model_dir, "--input", cfg.parent / "data/eval")
    assert rc == 0, out
    assert "dynarec evaluate: warning: " in out and "using the newest complete checkpoint" in out, out
    assert "UserWarning" not in out and ".py:" not in out, out


def test_model_dir_of_a_different_config_is_refused(trained, data_root):
    cfg, model_dir = trained
    other = config_dict(data__eval_input_path=None)
    other["feature_configs"][1]["id_feature"]["embedding_dim"] = 6
    other_cfg = write_config(data_root, other, "other.yaml")
    before = _listing(model_dir)
    rc, out = run_cli("train", "--config", other_cfg, "--model-dir", model_dir, "--resume", "--no-progress")
    assert rc == 2 and "was written with a different config (" in out, out
    # named by its config path, its values both ways
    assert "feature_configs[1].id_feature.embedding_dim: 4 in the checkpoint's, 6 in this one" in out, out
    rc, out = run_cli("train", "--config", cfg, "--model-dir", model_dir, "--no-progress")
    assert rc == 2 and "already holds checkpoints" in out and "--resume" in out, out
    assert _listing(model_dir) == before


def test_a_resumed_runs_metrics_keep_the_final_evaluation_of_the_run_before(data_root, tmp_path):
    # A run's final evaluation comes after its last checkpoint: metrics.json keeps it across a resume.
    c = config_dict()
    one = write_config(data_root, {**c, "train": {**c["train"], "num_epochs": 1}}, "one-epoch.yaml")
    two = write_config(data_root, {**c, "train": {**c["train"], "num_epochs": 2}}, "two-epochs.yaml")
    rc, out = run_cli("train", "--config", one, "--model-dir", tmp_path / "m", "--no-progress")
    assert rc == 0, out
    first = json.loads((tmp_path / "m" / "metrics.json").read_text())["history"]["eval"]
    rc, out = run_cli("train", "--config", two, "--model-dir", tmp_path / "m", "--no-progress", "--resume")
    assert rc == 0, out
    evals = json.loads((tmp_path / "m" / "metrics.json").read_text())["history"]["eval"]
    assert [s for s, _ in first] == [12] and [s for s, _ in evals] == [12, 24]
    assert evals[0] == first[0]


def test_a_run_resumes_with_its_tables_cache_changed_as_if_it_never_had_one(data_root, tmp_path):
    # cache_load_factor says where rows live, not what they are: a resume may change it.
    c = config_dict(data__eval_input_path=None)
    del c["train"]["num_epochs"]
    cached = copy.deepcopy(c)
    cached["feature_configs"][0]["id_feature"]["cache_load_factor"] = 0.5  # user_id: 256 of 512 rows on the device
    straight = write_config(data_root, {**c, "train": {**c["train"], "num_steps": 12}}, "uncached-12.yaml")
    half = write_config(data_root, {**cached, "train": {**cached["train"], "num_steps": 6}}, "cached-6.yaml")
    (sa, ta), (sb, tb) = straight_and_resumed(straight, half, tmp_path)
    assert sa["step"] == sb["step"] == 12
    assert_same(ta, tb, "tables")
    assert_same(sa["dense"], sb["dense"], "dense")
    # Anything else about a table still differs by name.
    other = copy.deepcopy(c)
    other["feature_configs"][0]["id_feature"]["embedding_dim"] = 4
    path = write_config(data_root, {**other, "train": {**other["train"], "num_steps": 14}}, "other-14.yaml")
    rc, out = run_cli("train", "--config", path, "--model-dir", tmp_path / "b", "--no-progress", "--resume")
    assert rc == 2 and "feature_configs[0].id_feature.embedding_dim: 8 in the checkpoint's, 4 in this one" in out
