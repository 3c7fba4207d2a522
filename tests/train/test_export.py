"""Exports: never delete what they are pointed at, carry a checked manifest, serve every key."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from dynarec.cli import main
from dynarec.config import load_config
from dynarec.serving import ExportedModel, ExportError
from dynarec.train.checkpoint import latest_checkpoint, load_checkpoint
from dynarec.train.export import diff_tables
from dynarec.train.trainer import Trainer
from tests.pipeline_fixtures import config_dict, make_data, write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    make_data(root)
    cfg = write_config(root, config_dict(), "cfg.yaml")
    model_dir = root / "m"
    assert main(["train", "--config", str(cfg), "--model-dir", str(model_dir), "--no-progress"]) == 0
    export_dir = root / "export"
    assert main(["export", "--model-dir", str(model_dir), "--export-dir", str(export_dir)]) == 0
    return root, cfg, model_dir, export_dir


def listing(d):
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_export_into_the_model_dir_is_refused_and_deletes_nothing(trained, capsys):
    _, _, model_dir, _ = trained
    before = listing(model_dir)
    assert main(["export", "--model-dir", str(model_dir), "--export-dir", str(model_dir)]) == 2
    err = capsys.readouterr().err
    assert f"{model_dir} is a non-empty directory that is not a dynarec export" in err
    assert listing(model_dir) == before


def test_export_into_a_users_directory_or_file_is_refused(trained, tmp_path, capsys):
    _, _, model_dir, _ = trained
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my work")
    assert main(["export", "--model-dir", str(model_dir), "--export-dir", str(mine)]) == 2
    assert "not a dynarec export" in capsys.readouterr().err
    assert listing(mine) == {"notes.txt": b"my work"}
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert main(["export", "--model-dir", str(model_dir), "--export-dir", str(a_file)]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err and a_file.read_text() == "x"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_an_export_is_replaced_and_a_failed_export_keeps_the_previous_one(trained, tmp_path, monkeypatch):
    _, cfg, model_dir, _ = trained
    target = tmp_path / "e"
    assert main(["export", "--model-dir", str(model_dir), "--export-dir", str(target)]) == 0
    assert main(["export", "--model-dir", str(model_dir), "--export-dir", str(target)]) == 0  # replaced
    before = listing(target)
    import dynarec.train.export as export_module

    def broken(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_module, "save_file", broken)
    with pytest.raises(OSError):
        export_module.export_model(
            Trainer(load_config(cfg), model_dir, progress=False).task,
            Trainer(load_config(cfg), model_dir, progress=False).example_batch(),
            target,
        )
    assert listing(target) == before


def test_serving_loads_every_exported_key(trained):
    root, _, model_dir, export_dir = trained
    meta = json.loads((export_dir / "export.json").read_text())
    _, (tables,) = load_checkpoint(latest_checkpoint(model_dir / "checkpoints"))
    model = ExportedModel(export_dir)
    for name, dump in tables.items():
        in_ckpt = dump["keys"].numel() if "keys" in dump else dump["weight"].shape[0]
        assert meta["keys"][name] == model.key_counts[name] == in_ckpt, name
    # The rows of every exported user key score the same from the export and the checkpoint.
    eval_file = root / "data" / "eval" / "part-0.parquet"
    trainer = Trainer(load_config(model_dir / "config.yaml"), model_dir, progress=False)
    trainer.restore()
    from_ckpt, _, _ = trainer.predict(str(eval_file))
    served = model.predict_files(str(eval_file))
    np.testing.assert_allclose(served["probability"], from_ckpt["probability"], rtol=0, atol=1e-6)
    for size in (0, -1):  # (was torch's "cannot reshape tensor of 0 elements")
        with pytest.raises(ValueError, match=f"predict_files: batch_size is at least 1 row, got {size}"):
            model.predict_files(str(eval_file), batch_size=size)
    users = model.embeddings.tables["user_id"].read_rows(tables["user_id"]["keys"])
    assert bool(users["present"].all())
    assert torch.equal(users["weight"], tables["user_id"]["weight"])


def test_an_export_of_more_keys_than_its_max_capacity_serves_every_key(trained, tmp_path):
    """A table read, not trained, takes the buckets its keys need: an export whose config says a
    max_capacity smaller than its keys (a model written by full shards of several ranks holds as
    many keys as their slots) serves every key as exported. (It was refused; before that, 4 keys
    were silently dropped.)"""
    root, _, _, export_dir = trained
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(export_dir), str(copy)], check=True)
    meta = json.loads((copy / "export.json").read_text())
    assert meta["keys"]["user_id"] > 64
    meta["config"]["feature_configs"][0]["id_feature"]["dynamicemb"].update(max_capacity=64, init_capacity=64)
    (copy / "export.json").write_text(json.dumps(meta))
    small, whole = ExportedModel(copy), ExportedModel(export_dir)
    assert small.key_counts == whole.key_counts
    eval_file = str(root / "data" / "eval" / "part-0.parquet")
    np.testing.assert_array_equal(
        small.predict_files(eval_file)["probability"], whole.predict_files(eval_file)["probability"]
    )


@pytest.mark.parametrize("damage", ["tables", "dense", "manifest", "json", "config"])
def test_a_damaged_export_names_the_file(trained, tmp_path, damage, capsys):
    root, _, _, export_dir = trained
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(export_dir), str(copy)], check=True)
    if damage in ("tables", "dense"):
        f = copy / ("tables/user_id.safetensors" if damage == "tables" else "dense.pt2")
        data = bytearray(f.read_bytes())
        data[100:2100] = bytes(2000)  # the case: 2,000 bytes overwritten
        f.write_bytes(bytes(data))
        expected = f"{f} does not match its SHA-256"
    elif damage == "manifest":
        meta = json.loads((copy / "export.json").read_text())
        meta["files"] = ["dense.pt2"]
        (copy / "export.json").write_text(json.dumps(meta))
        expected = "its file list is malformed"
    elif damage == "config":  # (the field named: it said "Extra inputs are not permitted" alone)
        meta = json.loads((copy / "export.json").read_text())
        meta["config"]["model"]["foo"] = 1
        (copy / "export.json").write_text(json.dumps(meta))
        expected = "its config is invalid (1 error(s), the first at model.foo: Extra inputs are not permitted)"
    else:
        (copy / "export.json").write_text("{not json")
        expected = "export.json is unreadable or not valid JSON"
    with pytest.raises(ExportError, match=re.escape(expected)):
        ExportedModel(copy)
    eval_file = root / "data" / "eval" / "part-0.parquet"
    rc = main(
        ["predict", "--export-dir", str(copy), "--input", str(eval_file), "--output", str(tmp_path / "p.parquet")]
    )
    assert rc == 2 and expected in capsys.readouterr().err
    assert not (tmp_path / "p.parquet").exists()


HOLD = r"""
import sys, time
from dynarec.files import DirectoryLock
DirectoryLock(sys.argv[1]).acquire()
print("LOCKED", flush=True)
time.sleep(120)
"""


def test_one_writer_per_model_dir_and_no_stale_lock_after_sigkill(trained, tmp_path):
    _, cfg, _, _ = trained
    target = tmp_path / "m"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(target)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "dynarec",
                "train",
                "--config",
                str(cfg),
                "--model-dir",
                str(target),
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 2, proc.stderr
        assert f"is in use by process {holder.pid} on host " in proc.stderr
        assert not (target / "checkpoints").exists()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    time.sleep(0.1)
    assert main(["train", "--config", str(cfg), "--model-dir", str(target), "--no-progress"]) == 0


HOLD_AND_FORK = """
import os, sys, time
from dynarec.files import DirectoryLock
DirectoryLock(sys.argv[1]).acquire()
if os.fork() == 0:  # a DataLoader worker's fork: it outlives its parent for a while
    time.sleep(10)
    os._exit(0)
print("LOCKED", flush=True)
time.sleep(60)
"""


def test_a_killed_runs_forked_workers_do_not_keep_its_model_dir_locked(tmp_path):
    """A flock belongs to the open file: forked children (DataLoader workers) kept their copy of
    the lock's descriptor, so after a SIGKILL the model directory stayed locked, naming the dead
    process, until they noticed and exited. Children close it at the fork."""
    from dynarec.files import DirectoryLock

    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_FORK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    DirectoryLock(tmp_path).acquire().release()  # the child still sleeps: its copy is closed


def test_an_export_carries_its_vocabulary_files_and_serves_from_its_copies(tmp_path):
    """An export read a feature's vocab_file where the config pointed: gone, serving failed;
    rewritten in place, the served scores changed silently (a QA pass). The export copies it (in
    its checked manifest), and serving reads the copy."""
    make_data(tmp_path)
    vocab = tmp_path / "vocab" / "age.txt"
    vocab.parent.mkdir()
    vocab.write_text("".join(f"{a}\n" for a in reversed(range(8))))  # age a -> row 7 - a
    c = config_dict()
    c["feature_configs"][1] = {
        "id_feature": {
            "feature_name": "age",
            "embedding_dim": 4,
            "vocab_file": "vocab/age.txt",
            "default_bucketize_value": 7,
        }
    }
    cfg = write_config(tmp_path, c, "cfg.yaml")
    assert main(["train", "--config", str(cfg), "--model-dir", str(tmp_path / "m"), "--no-progress"]) == 0
    assert main(["export", "--model-dir", str(tmp_path / "m"), "--export-dir", str(tmp_path / "e")]) == 0
    meta = json.loads((tmp_path / "e" / "export.json").read_text())
    assert meta["assets"] == [
        {"where": ["feature_configs", 1, "id_feature", "vocab_file"], "file": "assets/00-age.txt"}
    ]
    assert "assets/00-age.txt" in meta["files"]
    eval_file = str(tmp_path / "data" / "eval" / "part-0.parquet")
    before = ExportedModel(tmp_path / "e").predict_files(eval_file)["probability"]
    vocab.write_text("".join(f"{a}\n" for a in range(8)))  # regenerated in place: another mapping
    np.testing.assert_array_equal(ExportedModel(tmp_path / "e").predict_files(eval_file)["probability"], before)
    vocab.unlink()
    np.testing.assert_array_equal(ExportedModel(tmp_path / "e").predict_files(eval_file)["probability"], before)
    (tmp_path / "e" / "assets" / "00-age.txt").write_text("0\n")  # the copy damaged: named
    with pytest.raises(ExportError, match=r"00-age\.txt"):
        ExportedModel(tmp_path / "e")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_delta_of_half_precision_rows_of_an_odd_dim_holds_the_rows_changed(dtype):
    base = {"weight": torch.arange(15, dtype=torch.float32).reshape(5, 3).to(dtype)}
    current = {"weight": base["weight"].clone()}
    current["weight"][3, 2] = 0.5
    delta = diff_tables(base, current, "table 't'")
    assert delta["keys"].tolist() == [3] and torch.equal(delta["weight"], current["weight"][3:4])
    if dtype == torch.float32:
        return
    # A dynamic table's base of half rows widened to float32 (as its dumps were before): compared as half rows.
    index = {
        "keys": torch.arange(5),
        "slots": torch.arange(5),
        "scores": torch.zeros(5),
        "layout": torch.tensor([1, 8, 1]),
    }
    widened = diff_tables({**index, "weight": base["weight"].float()}, {**index, **current}, "table 't'")
    assert widened["keys"].tolist() == [3] and widened["weight"].dtype == dtype
    refused = r"table 't': rows of torch\.\w+ in the base export, torch\.\w+ now; write a full export"
    for old, now in (
        ({**index, "weight": base["weight"].float() + 1e-6}, {**index, **current}),  # not half rows widened
        ({"weight": base["weight"].float()}, current),  # a fixed table's dumps always kept their dtype
        ({"weight": base["weight"]}, {"weight": current["weight"].float()}),  # half rows, then float32 ones
    ):
        with pytest.raises(ValueError, match=refused):
            diff_tables(old, now, "table 't'")


def test_a_model_whose_cache_cannot_hold_the_traced_rows_exports_and_serves_as_it_predicts(trained, tmp_path):
    # item's 200 rows behind a cache of 60: a step's 8 rows fit, the 256 rows export traces on do not.
    root, _, _, _ = trained
    c = config_dict(data__batch_size=8)
    del c["train"]["num_epochs"]
    c["train"]["num_steps"] = 4
    c["feature_configs"][2]["id_feature"]["cache_load_factor"] = 0.3
    c["feature_configs"][4]["sequence_feature"]["cache_load_factor"] = 0.3
    cfg = write_config(root, c, "cached-item.yaml")
    model_dir, export_dir = tmp_path / "m", tmp_path / "e"
    assert main(["train", "--config", str(cfg), "--model-dir", str(model_dir), "--no-progress"]) == 0
    assert main(["export", "--model-dir", str(model_dir), "--export-dir", str(export_dir)]) == 0
    eval_file = str(root / "data" / "eval" / "part-0.parquet")
    out = tmp_path / "p.parquet"
    assert main(["predict", "--model-dir", str(model_dir), "--input", eval_file, "--output", str(out)]) == 0
    expected = pq.read_table(out).column("probability").to_numpy()
    served = ExportedModel(export_dir)  # (on the CPU served whole: any batch)
    np.testing.assert_array_equal(served.predict_files(eval_file, batch_size=8)["probability"], expected)
    np.testing.assert_allclose(served.predict_files(eval_file)["probability"], expected, rtol=0, atol=1e-6)
