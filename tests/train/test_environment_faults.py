"""Faults of the environment met for real — a full disk (tmpfs), a file size limit (``ulimit
-f``), read-only targets, a path under a file — and what the user's files go through: each ends
in one named error with exit status 2, nothing half-written, and nothing the user made changed."""

import os
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from dynarec.cli import main
from dynarec.config import load_config
from dynarec.serving import ExportedModel
from dynarec.train import checkpoint as checkpoint_module
from dynarec.train.checkpoint import CheckpointError, load_checkpoint
from dynarec.train.model_dir import HEADER
from dynarec.train.trainer import Trainer
from tests.faults import file_size_limit, fill, read_only, small_disk
from tests.pipeline_fixtures import config_dict, make_data, write_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("env-faults")
    make_data(root)
    return root


def steps_config(root, name="cfg.yaml", steps=2, **changes):
    c = config_dict(data__eval_input_path=None, **changes)
    del c["train"]["num_epochs"]
    c["train"].update(num_steps=steps, save_checkpoints_steps=1)
    return write_config(root, c, name)


def train(cfg, model_dir, *extra):
    return main(["train", "--config", str(cfg), "--model-dir", str(model_dir), "--no-progress", *extra])


@pytest.fixture(scope="module")
def trained(root, tmp_path_factory):
    """A model directory trained 2 steps, and a full export of it."""
    base = tmp_path_factory.mktemp("trained")
    assert train(steps_config(root), base / "m") == 0
    assert main(["export", "--model-dir", str(base / "m"), "--export-dir", str(base / "e")]) == 0
    return base / "m", base / "e"


def error_line(capsys, command):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"dynarec {command}: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(directory):
    """Every file under ``directory`` with its bytes."""
    return {p.relative_to(directory): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def snapshot_unlocked(directory):
    """:func:`snapshot` without the model directory's lock file (each run takes it anew)."""
    return {p: data for p, data in snapshot(directory).items() if p.name != ".lock"}


# -- a full disk --------------------------------------------------------------------------------


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(root, tmp_path, capsys):
    """A real ENOSPC (a tmpfs filled up) while ``tables.pt`` is written — torch's zip writer
    reports it as "unexpected pos", which is named as the full disk it is."""
    with small_disk(tmp_path / "disk", "4m") as disk:
        assert train(steps_config(root, steps=1), disk / "m") == 0
        previous = checkpoint_module.latest_checkpoint(disk / "m" / "checkpoints")
        capsys.readouterr()
        fill(disk, leave=16 << 10)  # room for the run's small files (its config, logs), not a checkpoint
        rc = train(steps_config(root, "more.yaml", steps=3), disk / "m", "--resume")
        line = error_line(capsys, "train")
        assert rc == 2
        assert "no space left on the device (the disk is full)" in line and f"{previous} is intact" in line, line
        assert checkpoint_module.latest_checkpoint(disk / "m" / "checkpoints") == previous
        assert not list((disk / "m" / "checkpoints").glob(".ckpt-*"))
        load_checkpoint(previous)


def test_a_file_size_limit_during_a_checkpoint_keeps_the_previous_one(root, tmp_path):
    assert train(steps_config(root, steps=1), tmp_path / "m") == 0
    previous = checkpoint_module.latest_checkpoint(tmp_path / "m" / "checkpoints")
    tables = (previous / "tables.pt").stat().st_size
    from dynarec.config import load_config
    from dynarec.train.trainer import Trainer

    trainer = Trainer(load_config(steps_config(root, steps=3)), tmp_path / "m", progress=False)
    trainer.restore()
    trainer.step += 1
    with file_size_limit(tables // 2), pytest.raises(CheckpointError) as e:
        trainer.save()
    assert "the file size limit is reached (ulimit -f)" in str(e.value) and f"{previous} is intact" in str(e.value)
    assert checkpoint_module.latest_checkpoint(tmp_path / "m" / "checkpoints") == previous
    assert not list((tmp_path / "m" / "checkpoints").glob(".ckpt-*"))
    load_checkpoint(previous)


def test_a_full_disk_during_an_export_keeps_the_previous_export_and_leaves_no_temporary(
    root, trained, tmp_path, capsys
):
    """torch's file writer aborted the process on a failed write (exit 134, a temporary
    directory left behind); now the export is a named error and the previous export stands."""
    m, _ = trained
    with small_disk(tmp_path / "disk", "8m") as disk:
        assert main(["export", "--model-dir", str(m), "--export-dir", str(disk / "e")]) == 0
        before = snapshot(disk / "e")
        capsys.readouterr()
        fill(disk, leave=64 << 10)
        assert main(["export", "--model-dir", str(m), "--export-dir", str(disk / "e")]) == 2
        assert "the disk is full" in error_line(capsys, "export")
        assert snapshot(disk / "e") == before
        assert sorted(p.name for p in disk.iterdir()) == [".filler", "e"]
        ExportedModel(disk / "e")


def test_a_file_size_limit_during_an_export_is_named(trained, tmp_path, capsys):
    m, _ = trained
    capsys.readouterr()
    with file_size_limit(16 << 10):
        rc = main(["export", "--model-dir", str(m), "--export-dir", str(tmp_path / "e")])
    assert rc == 2 and "the file size limit is reached" in error_line(capsys, "export")
    assert list(tmp_path.iterdir()) == []


def test_config_yaml_is_rewritten_atomically_and_only_when_it_changes(root, tmp_path, capsys):
    """``(ulimit -f 1; dynarec train --resume)`` cut ``m/config.yaml`` short, after which
    evaluate and export failed; now the record stays whole."""
    m = tmp_path / "m"
    cfg = steps_config(root, "two.yaml", steps=2)
    assert train(cfg, m) == 0
    record = m / "config.yaml"
    text, inode = record.read_text(), record.stat().st_ino
    assert text.startswith(HEADER)
    # The same config again: the record is not touched.
    assert train(cfg, m, "--resume") == 0
    assert record.stat().st_ino == inode
    changed = yaml.safe_load(record.read_text())
    # A changed config under a 1 KiB file size limit: the new record cannot be written whole.
    cfg = steps_config(root, "lr.yaml", steps=3, train__dense_optimizer={"adam_optimizer": {"lr": 0.02}})
    capsys.readouterr()
    with file_size_limit(1024):
        rc = train(cfg, m, "--resume")
    assert rc == 2 and "the file size limit is reached" in error_line(capsys, "train")
    assert yaml.safe_load(record.read_text()) == changed
    assert not [p for p in m.iterdir() if p.name.startswith(".config.yaml")]
    assert main(["evaluate", "--model-dir", str(m), "--input", str(root / "data" / "eval")]) == 0


# -- the user's own files -----------------------------------------------------------------------


def test_the_users_own_config_in_the_model_dir_is_never_written_over(root, tmp_path, capsys):
    """``dynarec train --config exp/config.yaml --model-dir exp`` replaced the user's file
    (comments gone, relative paths rewritten so that export then failed)."""
    exp = tmp_path / "exp"
    exp.mkdir()
    shutil.copytree(root / "data", exp / "data")
    c = config_dict(data__eval_input_path="data/eval")
    del c["train"]["num_epochs"]
    c["train"]["num_steps"] = 2
    mine = "# my experiment: do not touch\n" + yaml.safe_dump(c, sort_keys=False)
    (exp / "config.yaml").write_text(mine)
    assert train(exp / "config.yaml", exp) == 0
    assert (exp / "config.yaml").read_text() == mine
    assert main(["export", "--model-dir", str(exp), "--export-dir", str(tmp_path / "e")]) == 0
    # Another config trained into the same directory would describe the model wrongly: refused.
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.yaml").write_text(mine)
    capsys.readouterr()
    assert train(steps_config(root, steps=2, train__dense_optimizer={"sgd_optimizer": {"lr": 0.1}}), other) == 2
    assert "is not dynarec's record of this model directory" in error_line(capsys, "train")
    assert (other / "config.yaml").read_text() == mine
    assert sorted(p.name for p in other.iterdir()) == [".lock", "config.yaml"]  # the lock file stays (files.py)


def test_relative_paths_of_a_relative_config_hold_from_another_directory(root, tmp_path, monkeypatch):
    """A relative ``--config`` with relative data paths stored them relative to the current
    directory, so ``export --model-dir`` from anywhere else failed."""
    work = tmp_path / "work"
    shutil.copytree(root / "data", work / "data")
    c = config_dict(data__eval_input_path="data/eval")
    del c["train"]["num_epochs"]
    c["train"]["num_steps"] = 2
    write_config(work, c, "cfg.yaml")
    monkeypatch.chdir(tmp_path)
    assert train("work/cfg.yaml", "work/m") == 0
    monkeypatch.chdir(work / "data")
    assert main(["export", "--model-dir", str(work / "m"), "--export-dir", str(tmp_path / "e")]) == 0
    assert main(["evaluate", "--model-dir", str(work / "m")]) == 0


def test_an_import_configs_relative_input_path_is_relative_to_the_current_directory(root, tmp_path, monkeypatch):
    config = "tests/config/tzrec/multi_tower_din_taobao.config"
    source = os.path.abspath(config)
    monkeypatch.chdir(root)
    (tmp_path / "out").mkdir()
    args = ["import-config", source, "-o", str(tmp_path / "out" / "cfg.yaml")]
    assert main([*args, "--train-input-path", "data/train", "--eval-input-path", "data/eval"]) == 0
    from dynarec.config import load_config

    loaded = load_config(tmp_path / "out" / "cfg.yaml")
    assert loaded.data.train_input_path == str(root / "data" / "train")
    assert loaded.data.eval_input_path == str(root / "data" / "eval")


# -- read-only targets, paths under a file ------------------------------------------------------


def test_read_only_targets_are_named_errors_and_change_nothing(root, trained, tmp_path, capsys):
    m, e = trained
    ro = tmp_path / "ro"
    ro.mkdir()
    shutil.copytree(m, ro / "m")
    (ro / "keep").write_text("mine")
    eval_file = str(root / "data" / "eval" / "part-0.parquet")
    before = snapshot(ro)
    capsys.readouterr()
    more = steps_config(root, "r.yaml", steps=3)
    commands = [
        ("train", ["train", "--config", str(steps_config(root)), "--model-dir", str(ro / "new"), "--no-progress"]),
        ("train", ["train", "--config", str(more), "--model-dir", str(ro / "m"), "--resume", "--no-progress"]),
        ("export", ["export", "--model-dir", str(m), "--export-dir", str(ro / "e")]),
        ("predict", ["predict", "--export-dir", str(e), "--input", eval_file, "--output", str(ro / "p.parquet")]),
        ("make-data", ["make-data", "--output-dir", str(ro / "d"), "--train-rows", "10", "--eval-rows", "10"]),
    ]
    with read_only(ro):
        for command, args in commands:
            assert main(args) == 2, command
            line = error_line(capsys, command)
            assert str(ro) in line and ("read-only" in line or "permission denied" in line), line
    assert snapshot(ro) == before


def test_a_model_dir_under_a_file_is_a_named_error(root, tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    assert train(steps_config(root), tmp_path / "afile" / "m") == 2
    line = error_line(capsys, "train")
    assert "afile" in line and "a part of the path is a file, not a directory" in line, line
    assert (tmp_path / "afile").read_text() == "mine"


# -- exports: chains and temporaries ------------------------------------------------------------


def test_a_killed_exports_temporary_is_removed_by_the_next_export_to_that_parent(trained, tmp_path):
    m, _ = trained
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".e.tmp-{host}-{dead.pid}"
    (stale / "tables").mkdir(parents=True)
    live = tmp_path / f".f.tmp-{host}-{os.getpid()}"  # a running writer's: kept
    (live / "tables").mkdir(parents=True)
    users = tmp_path / f".g.tmp-{host}-{dead.pid}"  # a name like ours, not an export's files: kept
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    other_host = tmp_path / f".h.tmp-another-host-{dead.pid}"  # another host's process: kept
    (other_host / "tables").mkdir(parents=True)
    assert main(["export", "--model-dir", str(m), "--export-dir", str(tmp_path / "e")]) == 0
    assert not stale.exists() and live.exists() and users.exists() and other_host.exists()


def test_export_retries_when_training_rotates_away_the_checkpoint_it_reads(root, tmp_path, monkeypatch):
    """An export beside a training run whose checkpoint rotation (keep 1) deletes the checkpoint
    being read: the export reads the new latest one and says so, instead of "corrupt"."""
    m = tmp_path / "m"
    c = config_dict(data__eval_input_path=None)
    del c["train"]["num_epochs"]
    c["train"].update(num_steps=2, save_checkpoints_steps=1, keep_checkpoints=1)
    assert train(write_config(root, c, "keep1.yaml"), m) == 0
    first = checkpoint_module.latest_checkpoint(m / "checkpoints")
    real_load = checkpoint_module.load_checkpoint
    rotated = []

    def load_while_training_rotates(path):
        if not rotated:  # the trainer saves step 3 and deletes the checkpoint being read
            state, shards = real_load(path)
            state["step"] = 3
            checkpoint_module.save_checkpoint(m / "checkpoints", 3, state, shards[0], keep=1)
            rotated.append(path)
        return real_load(path)

    monkeypatch.setattr(checkpoint_module, "load_checkpoint", load_while_training_rotates)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["export", "--model-dir", str(m), "--export-dir", str(tmp_path / "e")]) == 0
    assert rotated == [first] and not first.exists()
    assert any("was removed while being read" in str(w.message) for w in caught)
    assert ExportedModel(tmp_path / "e").step == 3


# -- resume, the dense model --------------------------------------------------------------------


def test_a_checkpoint_from_before_a_schema_field_was_added_still_loads(root, tmp_path, capsys, monkeypatch):
    """A checkpoint keeps its config's sections with every default written out; when the schema
    gained an optional field (id_feature.max_values), every earlier checkpoint was refused as
    "written with a different config (max_values: absent in the checkpoint's, null in this one)"
    by evaluate, export, predict and --resume alike. A field at its default is no change."""
    import hashlib
    import json

    from dynarec.config import load
    from dynarec.train import trainer as trainer_module

    def older(config):  # the sections as the dynarec before the field wrote them
        sections = load.config_sections(config)
        for f in sections["feature_configs"]:
            for body in f.values():
                if isinstance(body, dict):
                    body.pop("max_values", None)
        return sections

    def older_fingerprint(config):
        return {
            k: hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16] for k, v in older(config).items()
        }

    m = tmp_path / "m"
    with monkeypatch.context() as patch:
        patch.setattr(trainer_module, "config_sections", older)
        patch.setattr(trainer_module, "config_fingerprint", older_fingerprint)
        assert train(steps_config(root, steps=1), m) == 0
    assert train(steps_config(root, steps=2), m, "--resume") == 0
    changed = steps_config(root, "dim.yaml", steps=3)
    text = changed.read_text().replace("embedding_dim: 8", "embedding_dim: 6", 1)
    changed.write_text(text)
    capsys.readouterr()
    assert train(changed, m, "--resume") == 2  # a real change is still refused, named
    assert "embedding_dim: 8 in the checkpoint's, 6 in this one" in error_line(capsys, "train")


def test_resume_into_a_model_dir_without_checkpoints_says_it_starts_from_the_beginning(root, tmp_path, capsys):
    """--resume on a model directory with no checkpoint (a job that always passes it, or a mistyped
    --model-dir) trained from step 0 without a word; it still does, and says so."""
    m = tmp_path / "typo"
    capsys.readouterr()
    assert train(steps_config(root, steps=1), m, "--resume") == 0
    assert f"--resume: {m} holds no checkpoint yet; training from the start" in capsys.readouterr().err


def test_resume_past_the_configs_num_steps_is_refused_before_anything_is_written(root, tmp_path, capsys):
    """A checkpoint at step 3 resumed with num_steps 2 trained nothing and rewrote the model
    directory's config record to num_steps 2; now a named error, nothing written. Resuming a
    finished run at its own num_steps still works (nothing to train, the final evaluation)."""
    m = tmp_path / "m"
    assert train(steps_config(root, steps=3), m) == 0
    assert train(steps_config(root, steps=3), m, "--resume") == 0
    before = snapshot_unlocked(m)
    capsys.readouterr()
    assert train(steps_config(root, "fewer.yaml", steps=2), m, "--resume") == 2
    line = error_line(capsys, "train")
    assert "is at step 3, past this config's train.num_steps 2: nothing to train" in line, line
    assert snapshot_unlocked(m) == before


def test_resume_past_the_configs_num_epochs_is_refused_and_a_finished_run_rewrites_no_checkpoint(
    root, tmp_path, capsys
):
    """The num_epochs twin of the above: a run of 2 epochs resumed with num_epochs 1 trained
    nothing, exited 0, rewrote its last checkpoint and its config record; now a named error,
    nothing written. A finished run resumed with its own config trains nothing and writes no
    checkpoint."""
    m = tmp_path / "m"
    two = write_config(
        root, config_dict(data__eval_input_path=None, data__batch_size=400, train__num_epochs=2), "e2.yaml"
    )
    one = write_config(
        root, config_dict(data__eval_input_path=None, data__batch_size=400, train__num_epochs=1), "e1.yaml"
    )
    assert train(two, m) == 0
    checkpoints = snapshot(m / "checkpoints")
    assert train(two, m, "--resume") == 0
    assert snapshot(m / "checkpoints") == checkpoints
    before = snapshot_unlocked(m)
    capsys.readouterr()
    assert train(one, m, "--resume") == 2
    line = error_line(capsys, "train")
    assert "is at the end of epoch 2, past this config's train.num_epochs 1: nothing to train" in line, line
    assert snapshot_unlocked(m) == before


@pytest.mark.parametrize(
    "optimizer",
    [{"rowwise_adagrad_optimizer": {"lr": 0.05}}, {"adam_optimizer": {"lr": 0.05}}],
    ids=["rowwise", "adam"],
)
def test_resume_after_changing_the_sparse_optimizer_is_refused_naming_the_table(root, tmp_path, capsys, optimizer):
    """Adagrad -> RowWiseAdagrad said "'momentum1' must have shape (1072, 1), got (1072, 16)",
    naming no table, checkpoint or setting; it names them now, before anything is written."""
    m = tmp_path / "m"
    assert train(steps_config(root, steps=1), m) == 0
    before = snapshot_unlocked(m)
    cfg = steps_config(root, "sparse.yaml", steps=3, train__sparse_optimizer=optimizer)
    capsys.readouterr()
    assert train(cfg, m, "--resume") == 2
    line = error_line(capsys, "train")
    name = "RowWiseAdagrad" if "rowwise_adagrad_optimizer" in optimizer else "Adam"
    assert f"table 'user_id' was trained with Adagrad, this config gives it {name}" in line, line
    assert snapshot_unlocked(m) == before


def test_resume_after_changing_the_dense_optimizer_is_refused_before_anything_is_written(root, tmp_path, capsys):
    m = tmp_path / "m"
    assert train(steps_config(root, steps=1), m) == 0
    before = snapshot_unlocked(m)
    cfg = steps_config(root, "sgd.yaml", steps=3, train__dense_optimizer={"adagrad_optimizer": {"lr": 0.1}})
    capsys.readouterr()
    assert train(cfg, m, "--resume") == 2
    line = error_line(capsys, "train")
    assert "was trained with another dense optimizer (Adam)" in line and "(Adagrad)" in line, line
    assert snapshot_unlocked(m) == before


def test_evaluate_and_export_read_the_weights_under_a_config_with_other_optimizers(root, tmp_path, capsys):
    """evaluate and export need a checkpoint's weights, not its optimizer states: under a config
    whose sparse and dense optimizers had changed since (a config edited for the next run) they
    refused with "resume with Adagrad"; now they read the same weights and score the same."""
    import json

    import pyarrow.parquet as pq

    m = tmp_path / "m"
    assert train(steps_config(root, steps=2), m) == 0
    other = steps_config(
        root,
        "other-optimizers.yaml",
        steps=2,
        train__sparse_optimizer={"adam_optimizer": {"lr": 0.01}},
        train__dense_optimizer={"sgd_optimizer": {"lr": 0.1}},
    )
    metrics = []
    for cfg in (steps_config(root, steps=2), other):
        capsys.readouterr()
        evaluate = ["evaluate", "--config", str(cfg), "--model-dir", str(m), "--input", str(root / "data" / "eval")]
        assert main(evaluate) == 0
        metrics.append(json.loads(capsys.readouterr().out))
        export = tmp_path / f"e-{cfg.stem}"
        assert main(["export", "--config", str(cfg), "--model-dir", str(m), "--export-dir", str(export)]) == 0
        out = tmp_path / f"p-{cfg.stem}.parquet"
        args = ["--export-dir", str(export), "--input", str(root / "data" / "eval"), "--output", str(out)]
        assert main(["predict", *args]) == 0
        metrics.append(pq.read_table(out).column("probability").to_pylist())
    assert metrics[0] == metrics[2] and metrics[1] == metrics[3]


def test_resume_trains_with_the_configs_dense_optimizer_settings_and_the_checkpoints_states(root, tmp_path):
    """A resume whose config changes Adam's betas, eps or weight decay trained on with the
    checkpoint's settings (torch's load_state_dict puts them back) while config.yaml recorded the
    new ones; now the config's settings apply, as they do to the tables, and the states carry on."""
    import torch

    m = tmp_path / "m"
    assert train(steps_config(root, steps=2), m) == 0
    changed = {"adam_optimizer": {"lr": 0.002, "beta1": 0.5, "beta2": 0.9, "eps": 0.1, "weight_decay": 0.5}}
    assert train(steps_config(root, "adam2.yaml", steps=3, train__dense_optimizer=changed), m, "--resume") == 0
    state = torch.load(m / "checkpoints" / "ckpt-0000000003" / "state.pt", weights_only=True)["dense_optimizer"]
    group = state["param_groups"][0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.5, 0.9), 0.1, 0.5), group
    assert all(float(s["step"]) == 3 for s in state["state"].values())  # the moments carried on


@pytest.mark.parametrize("field", ["train_input_path", "eval_input_path"])
def test_a_missing_input_path_is_named_by_its_config_field(root, tmp_path, capsys, field):
    c = config_dict(**{f"data__{field}": str(tmp_path / "nope")})
    cfg = write_config(root, c, f"missing-{field}.yaml")
    assert train(cfg, tmp_path / "m") == 2
    line = error_line(capsys, "train")
    assert f"data.{field}: {tmp_path / 'nope'} does not exist" in line, line
    assert not (tmp_path / "m").exists()


def test_predict_refuses_an_output_named_for_another_format_and_a_bad_o_names_the_path(root, trained, tmp_path, capsys):
    """predict --output x.csv wrote Parquet bytes under that name; import-config -o into a
    directory named its hidden temporary file, a missing input printed "[Errno 2] ..."."""
    _, e = trained
    assert main(["predict", "--export-dir", str(e), "--input", "nope", "--output", str(tmp_path / "p.parquet")]) == 2
    assert error_line(capsys, "predict").endswith("error: --input: nope does not exist")
    data = str(root / "data" / "eval" / "part-0.parquet")
    assert main(["predict", "--export-dir", str(e), "--input", data, "--output", str(tmp_path / "p.csv")]) == 2
    assert "p.csv: predict writes one Parquet file; name it .parquet" in error_line(capsys, "predict")
    assert not (tmp_path / "p.csv").exists()
    (tmp_path / "out").mkdir()
    config = str(ROOT / "tests" / "config" / "tzrec" / "examples" / "deepfm_criteo.config")
    paths = ["--train-input-path", "d", "--eval-input-path", "e"]
    assert main(["import-config", config, "-o", str(tmp_path / "out"), *paths]) == 2
    assert error_line(capsys, "import-config").endswith(f"error: {tmp_path / 'out'}: it is a directory")
    assert main(["import-config", str(tmp_path / "nope.config"), "-o", str(tmp_path / "x.yaml"), *paths]) == 2
    assert error_line(capsys, "import-config").endswith(f"error: {tmp_path / 'nope.config'}: No such file or directory")


def test_a_dense_model_too_large_for_memory_is_refused_before_allocating(root, tmp_path, capsys):
    c = config_dict()
    c["model"]["multi_tower_din"]["final_hidden_units"] = [1_000_000, 1_000_000]
    cfg = write_config(root, c, "huge.yaml")
    assert train(cfg, tmp_path / "m") == 2
    line = error_line(capsys, "train")
    assert "the dense model needs" in line and "[1000000, 1000000]" in line and "hidden_units" in line, line
    assert not (tmp_path / "m").exists()


def test_cuda_on_a_build_without_it_is_a_named_error(root, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert train(steps_config(root), tmp_path / "m", "--device", "cuda") == 2
    line = error_line(capsys, "train")
    assert "--device cuda" in line and "README" in line, line
    assert not (tmp_path / "m").exists()


def test_a_trainer_made_for_cuda_on_a_build_without_it_is_a_named_error(root, tmp_path):
    # (the Python API's counterpart of --device: it met torch's "Torch not compiled with CUDA enabled")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"Trainer\(device='cuda'\): .*README"):
        Trainer(load_config(steps_config(root)), tmp_path / "m", device="cuda", progress=False)
    assert not (tmp_path / "m").exists()
