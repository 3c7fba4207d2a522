"""Faults during training and around checkpoints: named errors, exact recovery, nothing lost."""

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

from dynarec.cli import main
from dynarec.config import config_from_dict
from dynarec.data.batch import DataError
from dynarec.train import checkpoint as checkpoint_module
from dynarec.train.checkpoint import CheckpointError
from dynarec.train.stop import TrainingStopped
from dynarec.train.trainer import Trainer, TrainingError
from tests.pipeline_fixtures import config_dict, make_data, write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    make_data(root)
    return root


def trainer_for(data_root, model_dir, **train):
    c = config_dict(data__eval_input_path=None)
    del c["train"]["num_epochs"]
    c["train"].update(train)
    c["data"]["train_input_path"] = str(data_root / "data" / "train")
    return Trainer(config_from_dict(c), model_dir, progress=False)


def first_batch(trainer):
    return next(trainer.input.batches(trainer.position))[0]


def state_of(trainer):
    tables = {n: t.dump() for n, t in trainer.task.embeddings.tables.items()}
    return tables, {k: v.clone() for k, v in trainer.task.dense.state_dict().items()}


def assert_same_state(a, b):
    for name in a[0]:
        for k in a[0][name]:
            assert torch.equal(a[0][name][k], b[0][name][k]), (name, k)
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


@pytest.mark.parametrize("policy", ["error", "skip_batch"])
def test_a_nan_loss_writes_nothing(data_root, tmp_path, policy):
    trainer = trainer_for(data_root, tmp_path / "m", num_steps=5, nan_policy=policy)
    batch = first_batch(trainer)
    trainer.train_step(batch)
    before = state_of(trainer)
    batch.labels[3] = float("nan")  # what a diverging model or a bad label would give
    if policy == "error":
        with pytest.raises(TrainingError, match=r"step 2: the loss is nan; nothing of this step was written"):
            trainer.train_step(batch)
    else:
        assert trainer.train_step(batch) is None and trainer.skipped_batches == 1
    assert trainer.step == 1
    assert_same_state(before, state_of(trainer))
    assert all(not t.steps.pending and t.step == 1 for t in trainer.task.embeddings.tables.values())


def test_evaluate_on_zero_rows_is_an_error(data_root, tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text(
        ",".join(["user_id", "age", "item_id", "cate_id", "hist_item_id", "hist_cate_id", "price", "clk"]) + "\n"
    )
    trainer = trainer_for(data_root, tmp_path / "m", num_steps=1)
    with pytest.raises(DataError, match=r"nothing to evaluate: .*empty\.csv holds no rows"):
        trainer.evaluate(str(empty))


def test_a_ctrl_c_during_a_checkpoint_is_a_keyboard_interrupt_and_keeps_the_previous_one(tmp_path):
    """SIGINT at many points of a save: it surfaces as KeyboardInterrupt (the CLI's exit 130), never
    as another error, and ``latest`` always names a complete checkpoint that loads."""
    ckpt_dir = tmp_path / "checkpoints"
    tables = {"t": {"weight": torch.zeros(8_000_000)}}  # ~32 MB: a save takes tens of ms
    checkpoint_module.save_checkpoint(ckpt_dir, 1, {"step": 1}, tables)
    armed = [False]

    def on_sigint(signum, frame):
        if armed[0]:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    outcomes = []
    try:
        for i in range(12):
            timer = threading.Timer(0.001 + 0.004 * i, lambda: signal.raise_signal(signal.SIGINT))
            armed[0] = True
            try:
                timer.start()
                checkpoint_module.save_checkpoint(ckpt_dir, 2 + i, {"step": 2 + i}, tables)
                timer.join()
                outcomes.append("saved")
            except KeyboardInterrupt:
                timer.join()
                outcomes.append("interrupted")
            finally:
                armed[0] = False
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                checkpoint_module.load_checkpoint(checkpoint_module.latest_checkpoint(ckpt_dir))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "interrupted" in outcomes, outcomes


@pytest.mark.parametrize("damage", ["deleted", "garbage"])
def test_a_missing_or_garbage_latest_resumes_from_the_newest_complete_checkpoint(data_root, tmp_path, damage):
    trainer = trainer_for(data_root, tmp_path / "m", num_steps=4, save_checkpoints_steps=2)
    trainer.fit()
    pointer = tmp_path / "m" / "checkpoints" / "latest"
    if damage == "deleted":
        pointer.unlink()
    else:
        pointer.write_bytes(b"\x00\xffnot a checkpoint")
    resumed = trainer_for(data_root, tmp_path / "m", num_steps=6)
    with pytest.warns(UserWarning, match=r"using the newest complete checkpoint ckpt-0000000004 \(by its manifest\)"):
        assert resumed.fit(resume=True)["step"] == 6


def test_a_malformed_checkpoint_manifest_is_named(data_root, tmp_path):
    trainer = trainer_for(data_root, tmp_path / "m", num_steps=2)
    trainer.fit()
    manifest = trainer.checkpoints.latest() / "manifest.json"
    manifest.write_text("{truncated")
    with pytest.raises(CheckpointError, match=rf"corrupt checkpoint: {manifest} is unreadable or not valid JSON"):
        trainer_for(data_root, tmp_path / "m", num_steps=4).fit(resume=True)
    manifest.write_text(json.dumps({"step": 2}))
    with pytest.raises(CheckpointError, match=r"manifest.json does not list state.pt, tables.pt"):
        trainer_for(data_root, tmp_path / "m", num_steps=4).fit(resume=True)
    manifest.write_text(json.dumps({"files": {"state.pt": {}, "extra.pt": {}}}))  # the one missing is named
    with pytest.raises(CheckpointError, match=r"manifest.json does not list tables.pt and lists extra.pt, which a"):
        trainer_for(data_root, tmp_path / "m", num_steps=4).fit(resume=True)


def test_a_corrupt_latest_checkpoint_names_the_earlier_one_and_how_to_use_it(data_root, tmp_path):
    trainer = trainer_for(data_root, tmp_path / "m", num_steps=4, save_checkpoints_steps=2)
    trainer.fit()
    tables = trainer.checkpoints.latest() / "tables.pt"
    tables.write_bytes(tables.read_bytes()[:100])
    pointer = tmp_path / "m" / "checkpoints" / "latest"
    with pytest.raises(CheckpointError) as e:
        trainer_for(data_root, tmp_path / "m", num_steps=6).fit(resume=True)
    assert f"corrupt checkpoint: {tables}" in str(e.value)
    assert (
        f"the earlier checkpoint ckpt-0000000002 is listed as complete: to go on from it, write its name into {pointer}"
        in str(e.value)
    )
    pointer.write_text("ckpt-0000000002\n")
    assert trainer_for(data_root, tmp_path / "m", num_steps=6).fit(resume=True)["step"] == 6


def test_ctrl_c_stops_cleanly_with_exit_130_naming_the_latest_checkpoint(data_root, tmp_path):
    c = config_dict(data__eval_input_path=None)
    del c["train"]["num_epochs"]
    c["train"].update(num_steps=100_000, save_checkpoints_steps=5)
    cfg = write_config(data_root, c, "ctrl_c.yaml")
    model_dir = tmp_path / "m"
    # A terminal's Ctrl-C: the child gets Python's SIGINT handler even where this suite runs with
    # SIGINT ignored (a background job of a non-interactive shell, nohup), which the child would
    # inherit, and Python then leaves SIGINT ignored.
    launcher = (
        "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "runpy.run_module('dynarec', run_name='__main__', alter_sys=True)"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-X",
            "faulthandler",  # a run that does not stop prints its threads' stacks on SIGABRT
            "-c",
            launcher,
            "train",
            "--config",
            str(cfg),
            "--model-dir",
            str(model_dir),
            "--no-progress",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (model_dir / "checkpoints" / "latest").exists():
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        signals = _signal_state(proc.pid)
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=60)
        pytest.fail(f"dynarec train did not stop within 60 s of SIGINT; {signals}; its stacks:\n{err[-8000:]}")
    assert proc.returncode == 130, err
    assert "dynarec train: interrupted; the latest checkpoint is" in err and "continue with --resume" in err
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        latest = checkpoint_module.latest_checkpoint(model_dir / "checkpoints")
    checkpoint_module.load_checkpoint(latest)


def _signal_state(pid: int) -> str:
    """The process's and each thread's signal masks (/proc), to tell a blocked or ignored
    SIGINT from one that was handled and lost."""
    lines = []
    for status in [f"/proc/{pid}/status", *sorted(glob.glob(f"/proc/{pid}/task/*/status"))]:
        try:
            text = open(status).read()
        except OSError:
            continue
        keys = ("Name", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
        fields = [line for line in text.splitlines() if line.startswith(keys)]
        lines.append(f"{status}: {' '.join(fields)}")
    return "\n".join(lines)


def test_a_run_closes_its_tensorboard_writer_however_it_ends(data_root, tmp_path, monkeypatch):
    """A run that ends (here by Ctrl-C at step 12, then normally) leaves no TensorBoard writer
    thread or open event file behind (a process that trains again and again would pile them
    up), and its event file holds every scalar it logged (steps 1, 5 and 10)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def writer_threads() -> int:
        return sum(type(t).__name__ == "_AsyncWriterThread" for t in threading.enumerate())

    before = writer_threads()
    trainer = trainer_for(data_root, tmp_path / "m", num_steps=100)
    train_step = trainer.train_step

    def interrupted(*args, **kwargs):
        if trainer.step == 12:
            raise KeyboardInterrupt
        return train_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert writer_threads() == before
    events = EventAccumulator(str(tmp_path / "m" / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 5, 10]
    trainer_for(data_root, tmp_path / "n", num_steps=6).fit()
    assert writer_threads() == before


def test_cli_output_paths_of_the_wrong_kind_are_refused(data_root, tmp_path, capsys):
    a_file = tmp_path / "f"
    a_file.write_text("mine")
    assert main(["make-data", "--output-dir", str(a_file), "--train-rows", "10", "--eval-rows", "10"]) == 2
    assert "is a file; make-data writes a directory" in capsys.readouterr().err and a_file.read_text() == "mine"
    cfg = write_config(data_root, config_dict(data__eval_input_path=None), "p.yaml")
    assert main(["train", "--config", str(cfg), "--model-dir", str(tmp_path / "m"), "--no-progress"]) == 0
    capsys.readouterr()
    eval_file = data_root / "data" / "eval" / "part-0.parquet"
    assert (
        main(["predict", "--model-dir", str(tmp_path / "m"), "--input", str(eval_file), "--output", str(tmp_path)]) == 2
    )
    assert "is a directory; predict writes one Parquet file" in capsys.readouterr().err


def test_predict_needs_exactly_one_source(tmp_path, capsys):
    args = ["predict", "--input", str(tmp_path / "x.parquet"), "--output", str(tmp_path / "p.parquet")]
    assert main(args) == 2
    assert main([*args, "--export-dir", "e", "--model-dir", "m"]) == 2
    assert capsys.readouterr().err.count("give exactly one of --export-dir or --model-dir") == 2
    assert main([*args, "--export-dir", "e", "--config", "c.yaml"]) == 2  # (the export's own config would be used)
    assert "--config goes with --model-dir; an export directory carries the config" in capsys.readouterr().err


def test_follow_options_without_follow_are_refused(tmp_path, capsys):
    """--poll-seconds and --idle-timeout tune --follow; without it they were silently ignored (a
    run meant to follow a directory trained once over what was there and stopped). A negative
    poll trained, then crashed at its first wait ("sleep length must be non-negative", its last
    steps unsaved); an idle timeout of nan never stopped."""
    args = ["train", "--model-dir", str(tmp_path / "m"), "--no-progress"]
    assert main([*args, "--idle-timeout", "60"]) == 2
    assert "dynarec train: error: --idle-timeout goes with --follow" in capsys.readouterr().err
    assert main([*args, "--poll-seconds", "1", "--idle-timeout", "60"]) == 2
    assert "--poll-seconds and --idle-timeout go with --follow" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
    for option, value in (("--poll-seconds", "-1"), ("--idle-timeout", "nan"), ("--idle-timeout", "-5")):
        with pytest.raises(SystemExit):  # (argparse's error, naming the option; a negative poll crashed mid-run)
            main([*args, "--follow", option, value])
        assert f"argument {option}: {value} is not a number of seconds above 0" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_write_rows_with_duplicate_keys_is_refused():
    from dynarec import DynamicTableOptions, EmbeddingCollection, TableConfig
    from dynarec.optim import SGD

    coll = EmbeddingCollection([TableConfig(name="d", dim=2, dynamic=DynamicTableOptions(64), features=["f"])], SGD())
    with pytest.raises(ValueError, match="table 'd': write_rows got duplicate keys"):
        coll.write_rows("d", torch.tensor([3, 3]), {"weight": torch.zeros(2, 2)})
    assert coll.tables["d"].size == 0


def test_evaluate_and_predict_never_report_over_scores_that_are_not_numbers(data_root, tmp_path):
    """A model whose scores are NaN for some rows (here an item row's weights; before, a dense
    value of 1e39 did it): evaluate printed NaN log loss and an AUC over NaNs, predict wrote NaN
    probabilities with exit 0. Now both name the first such row."""
    from dynarec.serving import ExportedModel
    from dynarec.train.export import export_model

    trainer = trainer_for(data_root, tmp_path / "m", num_steps=2)
    trainer.fit()
    eval_file = data_root / "data" / "eval" / "part-0.parquet"
    state = trainer.task.embeddings.state_dict()  # (write_rows refuses a NaN weight; a loaded state is as saved)
    key = "tables.item.weight"
    state[key] = torch.full_like(state[key], float("nan"))
    trainer.task.embeddings.load_state_dict(state)
    with pytest.raises(
        ValueError, match=rf"{eval_file}, row 0: the model's prediction 'probability' is nan \(400 of 400"
    ):
        trainer.evaluate(str(eval_file))
    export_model(trainer.task, trainer.example_batch(), tmp_path / "e", step=trainer.step)
    with pytest.raises(ValueError, match=rf"{eval_file}, row 0: the model's prediction 'probability' is nan"):
        ExportedModel(tmp_path / "e").predict_files(str(eval_file))


def test_no_command_writes_over_what_another_reads_or_keeps(data_root, tmp_path, capsys):
    """predict's --output over its input, into an input, export or model directory; train into
    an export or data directory (their next rewrite deleted its checkpoints); make-data and export
    over a directory holding a file they did not write: each refused by name, nothing changed."""
    cfg = write_config(data_root, config_dict(data__eval_input_path=None), "w.yaml")
    model = tmp_path / "m"
    assert main(["train", "--config", str(cfg), "--model-dir", str(model), "--no-progress"]) == 0
    export = tmp_path / "e"
    assert main(["export", "--model-dir", str(model), "--export-dir", str(export)]) == 0
    capsys.readouterr()
    eval_dir = data_root / "data" / "eval"
    eval_file = next(eval_dir.glob("*.parquet"))
    before = eval_file.read_bytes()
    refused = {
        str(eval_file): "is one of the --input files",
        str(eval_dir / "p.parquet"): f"lies in --input {eval_dir}",
        str(export / "export.json"): f"lies in --export-dir {export}",
    }
    for output, message in refused.items():
        assert main(["predict", "--export-dir", str(export), "--input", str(eval_dir), "--output", output]) == 2
        assert message in capsys.readouterr().err
    ckpt = next((model / "checkpoints").glob("ckpt-*"))
    args = ["predict", "--model-dir", str(model), "--input", str(eval_file), "--output", str(ckpt / "tables.pt")]
    assert main(args) == 2 and f"lies in --model-dir {model / 'checkpoints'}" in capsys.readouterr().err
    args[-1] = str(model / "config.yaml")
    assert main(args) == 2 and "is a file of --model-dir" in capsys.readouterr().err
    args[-1] = str(model / "predictions.parquet")  # a new file beside the model's is fine
    assert main(args) == 0
    assert eval_file.read_bytes() == before and not (eval_dir / "p.parquet").exists()
    assert (
        main(
            ["predict", "--export-dir", str(export), "--input", str(eval_file), "--output", str(tmp_path / "p.parquet")]
        )
        == 0
    )

    notes = tmp_path / "notes"  # a user's own meta.json does not make a data directory
    notes.mkdir()
    (notes / "meta.json").write_text("{}")
    args = ["train", "--config", str(cfg), "--model-dir", str(notes), "--no-progress"]
    assert main([*args, "--resume"]) == 0 and (notes / "checkpoints").is_dir()
    data = tmp_path / "d"
    assert main(["make-data", "--output-dir", str(data), "--train-rows", "40", "--eval-rows", "20"]) == 0
    for kind, place in (("an export (dynarec export)", export), ("a data directory (dynarec make-data)", data)):
        assert main(["train", "--config", str(cfg), "--model-dir", str(place), "--no-progress"]) == 2
        assert f"{place} is {kind}" in capsys.readouterr().err
        assert not (place / "checkpoints").exists() and not (place / ".lock").exists()
    (data / "train" / "mine.parquet").write_bytes(b"mine")
    assert main(["make-data", "--output-dir", str(data), "--train-rows", "40", "--eval-rows", "20"]) == 2
    assert "(it holds ['train/mine.parquet'])" in capsys.readouterr().err
    assert (data / "train" / "mine.parquet").read_bytes() == b"mine"
    assert main(["export", "--model-dir", str(model), "--export-dir", str(model)]) == 2
    assert main(["export", "--model-dir", str(model), "--export-dir", str(export)]) == 0  # its own export: replaced
    (export / "notes.txt").write_text("mine")
    assert main(["export", "--model-dir", str(model), "--export-dir", str(export)]) == 2
    assert "(it holds ['notes.txt'])" in capsys.readouterr().err and (export / "notes.txt").read_text() == "mine"


def test_a_full_table_mid_run_is_one_named_line_and_the_cli_checks_its_numbers(data_root, tmp_path, capsys):
    """A dynamic table that cannot take a step's new keys (check_mode error) stopped `dynarec train`
    with a raw traceback; it is one line naming the table and the latest checkpoint. Whole-number
    options below their least value are argparse's errors naming the option (plan --world-size 0
    raised ZeroDivisionError, verify --steps 0 checked nothing and said ok, make-data
    --num-items 0 raised IndexError)."""
    c = config_dict(data__eval_input_path=None)
    for entry in c["feature_configs"]:
        feature = next(iter(entry.values()))
        if "dynamicemb" in feature:
            feature["dynamicemb"].update(max_capacity=16, init_capacity=16, score_strategy="none")
    cfg = write_config(data_root, c, "full.yaml")
    assert main(["train", "--config", str(cfg), "--model-dir", str(tmp_path / "m"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dynarec train: error: table 'user_id':" in err[0]
    assert "holds no complete checkpoint" in err[0]
    for argv, option in (
        (["plan", "--config", str(cfg), "--world-size", "0"], "--world-size: 0 is below 1"),
        (["verify", "--config", str(cfg), "--steps", "0"], "--steps: 0 is below 1"),
        (["make-data", "--output-dir", str(tmp_path / "d"), "--num-items", "0"], "--num-items: 0 is below 1"),
        (
            ["make-data", "--output-dir", str(tmp_path / "d"), "--seed", "-1"],
            "--seed: -1 is below 0",
        ),  # (numpy's words)
        (["demo", "--work-dir", str(tmp_path / "d"), "--epochs", "0"], "--epochs: 0 is below 1"),  # (after 400k rows)
        (
            ["make-data", "--output-dir", str(tmp_path / "d"), "--eval-rows", "x"],
            "--eval-rows: 'x' is not a whole number",
        ),
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and option in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_a_kill_while_a_rotated_checkpoint_is_deleted_leaves_nothing_the_next_save_misses(tmp_path, monkeypatch):
    """Rotation deleted a checkpoint in place: a kill mid-delete left a `ckpt-*` without its
    manifest, which no listing found again (stranded files, as large as the tables). It leaves
    its name first; the next save removes what a killed delete left, and older debris."""
    ckpt_dir = tmp_path / "checkpoints"
    tables = {"t": {"weight": torch.zeros(4, 2)}}
    for step in (1, 2):
        checkpoint_module.save_checkpoint(ckpt_dir, step, {"step": step}, tables, keep=2)
    real_rmtree = checkpoint_module.shutil.rmtree

    def killed(path, *a, **k):  # the process dies once the manifest is gone
        (path / checkpoint_module.MANIFEST).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint_module.save_checkpoint(ckpt_dir, 3, {"step": 3}, tables, keep=2)
    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", real_rmtree)
    assert sorted(p.name for p in ckpt_dir.glob("ckpt-*")) == ["ckpt-0000000002", "ckpt-0000000003"]
    (ckpt_dir / "ckpt-0000000000").mkdir()  # an earlier version's half-deleted checkpoint
    (ckpt_dir / "ckpt-0000000000" / "tables.pt").write_bytes(b"stranded")
    (ckpt_dir / ".latest.tmp-99999").write_text("ckpt-0000000003\n")  # a kill before `latest`'s rename
    checkpoint_module.save_checkpoint(ckpt_dir, 4, {"step": 4}, tables, keep=2)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["ckpt-0000000003", "ckpt-0000000004", "latest"]


def test_predict_copies_reserved_columns_beside_each_rows_prediction(data_root, tmp_path, capsys):
    """`predict --reserved-columns` (TorchEasyRec's --reserved_columns) puts input columns beside
    each row's prediction, so predictions join back to their rows; a column the input lacks, or
    one named as a prediction, is refused by name before anything is written."""
    import pyarrow.parquet as pq

    cfg = write_config(data_root, config_dict(data__eval_input_path=None), "r.yaml")
    model = tmp_path / "m"
    assert main(["train", "--config", str(cfg), "--model-dir", str(model), "--no-progress"]) == 0
    train_dir = data_root / "data" / "train"
    out = tmp_path / "p.parquet"
    base = ["predict", "--model-dir", str(model), "--input", str(train_dir), "--output", str(out)]
    assert main([*base, "--reserved-columns", "user_id, clk"]) == 0  # (a space after the comma is no part of a name)
    got = pq.read_table(out)
    whole = [pq.read_table(str(f)) for f in sorted(train_dir.glob("*.parquet"))]  # predict's order
    assert len(whole) > 1 and got.num_rows == sum(t.num_rows for t in whole) and "probability" in got.column_names
    for name in ("user_id", "clk"):
        assert got.column(name).to_pylist() == [v for t in whole for v in t.column(name).to_pylist()], name
    capsys.readouterr()
    assert main([*base[:-1], str(tmp_path / "q.parquet"), "--reserved-columns", "user_id,nope"]) == 2
    assert "--reserved-columns: " in capsys.readouterr().err and not (tmp_path / "q.parquet").exists()
    scored = tmp_path / "scored.parquet"  # an input carrying an earlier run's column
    pq.write_table(whole[0].append_column("probability", whole[0].column("clk").cast("float32")), str(scored))
    args = ["predict", "--model-dir", str(model), "--input", str(scored), "--output", str(tmp_path / "q.parquet")]
    assert main([*args, "--reserved-columns", "probability"]) == 2
    assert "the predictions have column(s) of that name" in capsys.readouterr().err


def test_predict_passes_columns_through_as_the_input_holds_them(data_root, tmp_path, capsys):
    """Reserved and label columns were read apart from scoring: a CSV id "00270" came out as 270
    (scoring read it as the string it is), files storing a column as string and large_string
    failed after all the scoring with pyarrow's "Cannot append scalar", a 0-row input wrote a
    null-typed column, and a label with nulls came out as float64 NaN. They are read as scoring
    reads them now, in the type that holds every file's, before any scoring."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    cfg = write_config(data_root, config_dict(data__eval_input_path=None), "pass.yaml")
    model = tmp_path / "m"
    assert main(["train", "--config", str(cfg), "--model-dir", str(model), "--no-progress"]) == 0
    t = pq.read_table(str(sorted((data_root / "data" / "train").glob("*.parquet"))[0])).slice(0, 60)
    t = t.set_column(0, "user_id", pa.array([f"00{i:03d}" for i in range(60)]))
    clk = pa.array([None if i % 3 == 0 else v for i, v in enumerate(t.column("clk").to_pylist())], pa.int64())
    t = t.set_column(t.schema.get_field_index("clk"), "clk", clk)
    pcsv.write_csv(t, tmp_path / "in.csv")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    pq.write_table(t.slice(0, 30), mixed / "a.parquet")
    pq.write_table(
        t.slice(30).set_column(0, "user_id", pc.cast(t.slice(30).column(0), pa.large_string())), mixed / "b.parquet"
    )
    pq.write_table(t.slice(0, 0), tmp_path / "empty.parquet")
    out = tmp_path / "p.parquet"
    for source, rows in ((tmp_path / "in.csv", 60), (mixed, 60), (tmp_path / "empty.parquet", 0)):
        args = ["predict", "--model-dir", str(model), "--input", str(source), "--output", str(out)]
        assert main([*args, "--reserved-columns", "user_id"]) == 0, capsys.readouterr().err
        got = pq.read_table(out)
        assert got.num_rows == rows and got.schema.field("user_id").type in (pa.string(), pa.large_string())
        assert got.column("user_id").to_pylist() == t.column("user_id").to_pylist()[:rows]
        assert got.schema.field("clk").type == pa.int64() and got.column("clk").to_pylist() == clk.to_pylist()[:rows]
    other = tmp_path / "other"
    other.mkdir()
    pq.write_table(t.slice(0, 30), other / "a.parquet")
    pq.write_table(t.slice(30).set_column(0, "user_id", pa.array(range(30), pa.int64())), other / "b.parquet")
    capsys.readouterr()
    args = ["predict", "--model-dir", str(model), "--input", str(other), "--output", str(tmp_path / "q.parquet")]
    assert main([*args, "--reserved-columns", "user_id"]) == 2
    assert "column 'user_id' is string in" in capsys.readouterr().err and not (tmp_path / "q.parquet").exists()


def _with_nan_price(source, target, row: int) -> None:
    """``source``'s Parquet files copied to ``target``, the overall ``row``'s price NaN."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.copytree(source, target)
    for path in sorted(target.glob("*.parquet")):
        table = pq.read_table(path)
        if row < table.num_rows:
            prices = table.column("price").to_pylist()
            prices[row] = float("nan")
            i = table.column_names.index("price")
            pq.write_table(table.set_column(i, "price", pa.array(prices, table.schema.field("price").type)), path)
            return
        row -= table.num_rows
    raise AssertionError("row beyond the data")


@pytest.mark.parametrize("bad", ["train", "eval"])
def test_data_that_fails_mid_run_keeps_every_step_trained(data_root, tmp_path, capsys, bad):
    """A row that cannot be read mid-run (a NaN in the training files, or in the eval files at a
    mid-run evaluation) stopped `dynarec train` with the steps since the last checkpoint lost.
    They are saved (the failed step was never applied), the one-line error names the row and the
    checkpoint, and --resume carries on from it once the data is fixed."""
    data = data_root / "data"
    _with_nan_price(data / bad, tmp_path / bad, 550 if bad == "train" else 3)  # train: step 6's batch
    c = config_dict(train__save_checkpoints_steps=3, train__eval_every_steps=4 if bad == "eval" else None)
    c["data"]["train_input_path"] = str(tmp_path / "train" if bad == "train" else data / "train")
    c["data"]["eval_input_path"] = str(tmp_path / "eval" if bad == "eval" else data / "eval")
    model = tmp_path / "m"
    argv = ["train", "--config", str(write_config(tmp_path, c)), "--model-dir", str(model), "--no-progress"]
    assert main(argv) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    steps, row = (5, 550) if bad == "train" else (4, 3)
    assert f"part-0.parquet, row {row}: feature 'price' (column 'price'): value nan is not a finite number" in err
    assert err.endswith(
        f"; the {steps} steps trained are saved in {model}/checkpoints/ckpt-{steps:010d}; "
        "--resume continues from it once the data is fixed"
    ), err
    c["data"]["train_input_path" if bad == "train" else "eval_input_path"] = str(data / bad)  # the data fixed
    argv = ["train", "--config", str(write_config(tmp_path, c)), "--model-dir", str(model), "--no-progress"]
    assert main([*argv, "--resume"]) == 0
    capsys.readouterr()
    resumed = Trainer(config_from_dict(c), model, progress=False)
    assert resumed.restore().name == "ckpt-0000000012" and resumed.step == 12


def test_eval_data_failing_after_training_names_the_saved_model(data_root, tmp_path, capsys):
    data = data_root / "data"
    _with_nan_price(data / "eval", tmp_path / "eval", 3)
    c = config_dict()
    c["data"]["train_input_path"] = str(data / "train")
    c["data"]["eval_input_path"] = str(tmp_path / "eval")
    model = tmp_path / "m"
    argv = ["train", "--config", str(write_config(tmp_path, c)), "--model-dir", str(model), "--no-progress"]
    assert main(argv) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "row 3: feature 'price'" in err and "value nan is not a finite number" in err, err
    assert err.endswith("ckpt-0000000012: `dynarec evaluate` evaluates it once the data is fixed"), err
    assert (model / "checkpoints" / "ckpt-0000000012").is_dir()


def test_a_table_filling_mid_run_keeps_the_steps_before_it(data_root, tmp_path, capsys):
    """The steps trained before a table filled (with no checkpoint written yet) were lost."""
    c = config_dict(data__eval_input_path=None)
    c["data"]["train_input_path"] = str(data_root / "data" / "train")
    for entry in c["feature_configs"]:
        feature = next(iter(entry.values()))
        if "dynamicemb" in feature:
            feature["dynamicemb"].update(max_capacity=128, init_capacity=128, score_strategy="none")
    model = tmp_path / "m"
    argv = ["train", "--config", str(write_config(tmp_path, c)), "--model-dir", str(model), "--no-progress"]
    assert main(argv) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("dynarec train: error: table 'user_id':") and "could not get a row" in err, err
    assert err.endswith(f"the latest checkpoint is {model}/checkpoints/ckpt-0000000004 (continue with --resume)"), err


def test_resuming_mid_epoch_on_changed_training_files_warns_what_changed(data_root, tmp_path):
    """A checkpoint's data position is a row offset into the training files; resumed on files
    that changed before it (a file rewritten with other rows, renamed, removed), training went on
    from that offset silently, skipping or repeating rows. It warns, naming the file; files added
    after the recorded ones, or a position at an epoch's start, change nothing."""
    import shutil

    import pyarrow.parquet as pq

    data = tmp_path / "train"
    shutil.copytree(data_root / "data" / "train", data)
    c = config_dict(data__eval_input_path=None, train__num_steps=3)
    del c["train"]["num_epochs"]
    c["data"]["train_input_path"] = str(data)
    Trainer(config_from_dict(c), tmp_path / "m", progress=False).fit()  # position: epoch 0, row 300
    c["train"]["num_steps"] = 4

    def resumed() -> list[str]:
        shutil.rmtree(tmp_path / "r", ignore_errors=True)
        shutil.copytree(tmp_path / "m", tmp_path / "r")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Trainer(config_from_dict(c), tmp_path / "r", progress=False).fit(resume=True)
        return [str(w.message) for w in caught if "data position" in str(w.message)]

    assert resumed() == []
    shutil.copy(data / "part-1.parquet", data / "part-2.parquet")  # a file added after them
    assert resumed() == []
    later = pq.read_table(data / "part-1.parquet")
    pq.write_table(later.slice(0, 400), data / "part-1.parquet")  # rows removed after the position
    assert resumed() == []
    table = pq.read_table(data / "part-0.parquet")
    pq.write_table(table.slice(0, 500), data / "part-0.parquet")  # rows removed before the position
    (message,) = resumed()
    assert "ckpt-0000000003: its data position (epoch 0, row 300) counts through the training files" in message
    assert "file 1 was 'part-0.parquet' with 600 rows, and is 'part-0.parquet' with 500 rows now" in message


def _train_until_terminated(argv: list[str], model_dir, settle: float = 3.0, group: bool = False) -> tuple[int, str]:
    """Runs ``dynarec <argv>``, sends it SIGTERM once it has trained a while (``group``: to its
    whole process group, as a scheduler does); its exit code and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-m", "dynarec", *argv],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=group,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (model_dir / "config.yaml").exists():
        time.sleep(0.2)
    time.sleep(settle)
    if group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=60)
        pytest.fail(f"dynarec did not stop within 120 s of SIGTERM; its stacks:\n{err[-8000:]}")
    return proc.returncode, err


def test_sigterm_finishes_the_step_saves_it_and_resume_goes_on(data_root, tmp_path):
    """A scheduler's SIGTERM (preemption) killed the run, losing every step since the last
    checkpoint (here: all of them). The step in progress finishes, the steps are saved, the run
    exits with 143 naming the checkpoint, and --resume continues from it."""
    c = config_dict(data__eval_input_path=None)
    del c["train"]["num_epochs"]
    c["train"].update(num_steps=1_000_000)  # no checkpoint on the way
    c["data"]["train_input_path"] = str(data_root / "data" / "train")
    model_dir = tmp_path / "m"
    argv = ["train", "--config", str(write_config(tmp_path, c)), "--model-dir", str(model_dir), "--no-progress"]
    rc, err = _train_until_terminated(argv, model_dir)
    assert rc == 143, err
    assert "SIGTERM: stopping after this step, its checkpoint first" in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("dynarec train: stopped by SIGTERM after step ") and line.endswith(
        "(continue with --resume)"
    )
    step = int(line.split("after step ")[1].split(";")[0])
    assert step >= 1 and f"the model is saved in {model_dir}/checkpoints/ckpt-{step:010d}" in line
    c["train"]["num_steps"] = step + 2
    assert main([*argv[:2], str(write_config(tmp_path, c)), *argv[3:], "--resume"]) == 0
    resumed = Trainer(config_from_dict(c), model_dir, progress=False)
    assert resumed.restore().name == f"ckpt-{step + 2:010d}"


def test_a_second_sigterm_stops_at_once_and_a_repeat_at_once_is_the_same_request():
    """The first SIGTERM asks for a stop after the step; one right after it is the same request
    delivered twice (a scheduler signals every process, torchrun passes its own on); a second
    one later is SIGTERM's default: the process ends by it (a step that never finishes can still
    be stopped)."""
    code = (
        "import os, signal, time\n"
        "from dynarec.train import stop as s\n"
        "s.REPEAT_SECONDS = 1.0\n"
        "stop = s.StopSignal()\n"
        "with stop.installed():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.2)\n"
        "    assert stop.requested == signal.SIGTERM, stop.requested\n"
        "    print('after the repeat', flush=True)\n"
        "    time.sleep(1.0)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "print('still running')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr)
    assert "after the repeat" in proc.stdout and "still running" not in proc.stdout
    assert proc.stderr.count("SIGTERM: stopping after this step, its checkpoint first") == 1, proc.stderr


class _SigtermAfterFirstEvalBatch:
    """A trainer's input whose eval loader delivers SIGTERM to this process as it hands out its
    first batch (the run's own handler records it); otherwise the input itself."""

    def __init__(self, input):
        self._input = input
        self.batches = 0  # handed out

    def __getattr__(self, name):
        return getattr(self._input, name)

    def loader(self, dataset):
        for batch in self._input.loader(dataset):
            self.batches += 1
            if self.batches == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch


def _sigterm_in_evaluation(data_root, tmp_path, **train):
    """A trainer whose evaluations (4 batches of the eval data) see a SIGTERM after their first
    batch, and the probe that sends it."""
    c = config_dict(data__eval_batch_size=100)
    del c["train"]["num_epochs"]
    c["train"].update(train)
    c["data"]["train_input_path"] = str(data_root / "data" / "train")
    c["data"]["eval_input_path"] = str(data_root / "data" / "eval")
    trainer = Trainer(config_from_dict(c), tmp_path / "m", progress=False)
    probe = _SigtermAfterFirstEvalBatch(trainer.input)
    trainer.evaluator.input = probe
    return trainer, probe


def test_sigterm_during_an_evaluation_stops_it_and_saves_the_steps(data_root, tmp_path):
    """A SIGTERM during a periodic evaluation was acted on once the whole evaluation ended: a
    scheduler's grace period is seconds, an evaluation can take minutes, and the kill that
    follows lost every step since the last checkpoint. The evaluation stops at its next batch,
    the steps trained are saved, and the run stops as after a step."""
    trainer, probe = _sigterm_in_evaluation(data_root, tmp_path, num_steps=8, eval_every_steps=3)
    with pytest.raises(TrainingStopped) as stopped:
        trainer.fit()
    assert stopped.value.signum == signal.SIGTERM
    assert probe.batches == 1  # of the evaluation's 4
    message = str(stopped.value)
    assert message.startswith("stopped by SIGTERM after step 3;") and "ckpt-0000000003" in message, message
    assert trainer.log.history["eval"] == []  # no metrics of a partial evaluation
    assert trainer.task.training
    resumed = Trainer(trainer.config, tmp_path / "m", progress=False)
    assert resumed.restore().name == "ckpt-0000000003" and resumed.step == 3
    trainer.evaluator.input = trainer.input
    assert trainer.evaluate()["num_examples"] == 400  # the request was the run's: an evaluation after it runs


def test_sigterm_during_the_final_evaluation_stops_it_with_the_model_saved(data_root, tmp_path):
    """The final evaluation runs after the last checkpoint: stopped at its next batch, the run
    says where the model is and how to evaluate it."""
    trainer, probe = _sigterm_in_evaluation(data_root, tmp_path, num_steps=2)
    with pytest.raises(TrainingStopped) as stopped:
        trainer.fit()
    assert stopped.value.signum == signal.SIGTERM and probe.batches == 1
    message = str(stopped.value)
    assert message.startswith(
        "stopped by SIGTERM during the final evaluation (the evaluation stopped after 1 of its 4 batches); the model "
        f"trained to step 2 is saved in {tmp_path / 'm' / 'checkpoints' / 'ckpt-0000000002'}"
    ), message
    assert Trainer(trainer.config, tmp_path / "m", progress=False).restore().name == "ckpt-0000000002"


def test_sigterm_to_the_whole_process_group_spares_the_dataloader_workers(data_root, tmp_path):
    """A scheduler signals every process of the job: DataLoader workers killed by it failed the
    step in progress ("DataLoader worker ... killed by signal: Terminated"), nothing saved. The
    workers ignore it; the training process stops after its step, saved."""
    c = config_dict(data__eval_input_path=None, data__num_workers=2)
    del c["train"]["num_epochs"]
    c["train"].update(num_steps=1_000_000)
    c["data"]["train_input_path"] = str(data_root / "data" / "train")
    model_dir = tmp_path / "m"
    argv = ["train", "--config", str(write_config(tmp_path, c)), "--model-dir", str(model_dir), "--no-progress"]
    rc, err = _train_until_terminated(argv, model_dir, group=True)
    assert rc == 143, err[-4000:]
    assert err.strip().splitlines()[-1].startswith("dynarec train: stopped by SIGTERM after step "), err[-4000:]
    assert "killed by signal" not in err


def test_the_stop_signal_handler_is_only_there_while_installed():
    stop = __import__("dynarec.train.stop", fromlist=["StopSignal"]).StopSignal()
    before = signal.getsignal(signal.SIGTERM)
    with stop.installed():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before and stop.requested is None


def test_a_trainer_is_freed_when_its_last_reference_goes(data_root, tmp_path):
    """No reference cycle keeps a trainer alive: a cycle (the input held a callback into the
    trainer) left it, and its process group's pending work, to the interpreter's exit, where a
    two-process run's rank aborted tearing Gloo down ("terminate called without an active
    exception")."""
    import weakref

    trainer = trainer_for(data_root, tmp_path / "m", num_steps=1)
    ref = weakref.ref(trainer)
    del trainer
    assert ref() is None
