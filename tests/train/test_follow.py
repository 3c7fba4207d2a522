"""`dynarec train --follow`: a directory receiving files, trained as they arrive, gives what one
run over the finished directory gives; a restart resumes at the right file; files arriving out
of name order or changing after use are refused by name."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dynarec.cli import main
from dynarec.train.checkpoint import latest_checkpoint, load_checkpoint
from tests.pipeline_fixtures import config_dict, make_data, write_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS = 12  # 1,200 rows in 4 files of 300, batches of 100


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """The tiny click log's 1,200 training rows as 4 files of 300."""
    root = tmp_path_factory.mktemp("follow")
    make_data(root)
    rows = pa.concat_tables(pq.read_table(p) for p in sorted((root / "data" / "train").glob("*.parquet")))
    return root, [rows.slice(300 * i, 300) for i in range(4)]


def add(directory: Path, name: str, table) -> None:
    """Writes a file the way a streaming writer should: a hidden name, then a rename."""
    pq.write_table(table, directory / f".{name}.tmp")
    (directory / f".{name}.tmp").rename(directory / name)


def config(root, data_dir, name, **train):
    c = config_dict()
    c["data"].update(train_input_path=str(data_dir), eval_input_path=None)
    del c["train"]["num_epochs"]
    c["train"].update(save_checkpoints_steps=3, **train)
    return write_config(root, c, name)


def tables_of(model_dir):
    _, (tables,) = load_checkpoint(latest_checkpoint(model_dir / "checkpoints"))
    return tables


def assert_same_tables(a, b):
    assert a.keys() == b.keys()
    for name in a:
        for field in a[name]:
            assert torch.equal(a[name][field], b[name][field]), (name, field)


@pytest.fixture(scope="module")
def reference(parts, tmp_path_factory):
    """One ordinary run over the four finished files."""
    root, tables = parts
    d = tmp_path_factory.mktemp("all")
    for i, t in enumerate(tables):
        add(d, f"part-{i}.parquet", t)
    cfg = config(root, d, "all.yaml", num_steps=STEPS)
    assert main(["train", "--config", str(cfg), "--model-dir", str(d / "m"), "--no-progress"]) == 0
    return tables_of(d / "m")


def follow(cfg, model_dir, *extra, idle=6.0):
    args = [sys.executable, "-m", "dynarec", "train", "--config", str(cfg), "--model-dir", str(model_dir)]
    args += ["--no-progress", "--follow", "--poll-seconds", "0.1", "--idle-timeout", str(idle), *extra]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_files_trained_as_they_arrive_equal_one_run_over_all_of_them(parts, reference, tmp_path):
    root, tables = parts
    stream = tmp_path / "stream"
    stream.mkdir()
    add(stream, "part-0.parquet", tables[0])
    proc = follow(config(root, stream, "stream.yaml"), tmp_path / "m")
    for i in (1, 2, 3):
        time.sleep(0.7)
        (stream / "_SUCCESS").write_text("")  # a writer's marker file: ignored
        add(stream, f"part-{i}.parquet", tables[i])
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "follow: no new file in 6.0s; stopping" in out
    state, _ = load_checkpoint(latest_checkpoint(tmp_path / "m" / "checkpoints"))
    assert state["step"] == STEPS and state["row"] == 1200
    assert [n for n, _ in state["followed_files"]] == [f"part-{i}.parquet" for i in range(4)]
    assert_same_tables(tables_of(tmp_path / "m"), reference)


def test_a_restart_resumes_at_the_right_file_and_out_of_order_files_are_refused(parts, reference, tmp_path, capsys):
    root, tables = parts
    stream = tmp_path / "stream"
    stream.mkdir()
    for i in (0, 1):
        add(stream, f"part-{i}.parquet", tables[i])
    cfg = config(root, stream, "stream.yaml")
    out, _ = follow(cfg, tmp_path / "m", idle=1.0).communicate(timeout=240)
    state, _ = load_checkpoint(latest_checkpoint(tmp_path / "m" / "checkpoints"))
    assert state["step"] == 6 and [n for n, _ in state["followed_files"]] == ["part-0.parquet", "part-1.parquet"]
    # A file sorting before a consumed one would shift every row position: refused by name.
    add(stream, "part-0a.parquet", tables[2])
    proc = follow(cfg, tmp_path / "m", "--resume", idle=1.0)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 2 and "'part-0a.parquet' sorts where the consumed file 'part-1.parquet' was" in out
    (stream / "part-0a.parquet").unlink()
    # Resumed without --follow, its position would count through the files as an epoch reads them.
    plain = config(root, stream, "plain.yaml", num_steps=STEPS)
    assert main(["train", "--config", str(plain), "--model-dir", str(tmp_path / "m"), "--resume", "--no-progress"]) == 2
    assert "was written by `train --follow`" in capsys.readouterr().err
    assert load_checkpoint(latest_checkpoint(tmp_path / "m" / "checkpoints"))[0]["step"] == 6
    for i in (2, 3):
        add(stream, f"part-{i}.parquet", tables[i])
    proc = follow(cfg, tmp_path / "m", "--resume", idle=1.0)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert_same_tables(tables_of(tmp_path / "m"), reference)


def test_follow_needs_a_directory_and_no_epochs(parts, tmp_path, capsys):
    root, tables = parts
    add(tmp_path, "one.parquet", tables[0])
    cfg = config(root, tmp_path / "one.parquet", "file.yaml")
    assert main(["train", "--config", str(cfg), "--model-dir", str(tmp_path / "m"), "--follow"]) == 2
    assert "--follow polls one directory for new files" in capsys.readouterr().err
    cfg = config(root, tmp_path, "epochs.yaml", num_epochs=2)
    assert main(["train", "--config", str(cfg), "--model-dir", str(tmp_path / "m"), "--follow"]) == 2
    assert "train.num_epochs: --follow reads a growing input" in capsys.readouterr().err


def test_a_followed_directory_that_gives_no_batch_is_an_error_and_writes_nothing(parts, tmp_path, capsys):
    """--follow that timed out before any batch arrived exited 0 with an untrained model's
    checkpoint and evaluation; it is an error now, naming the data files in subdirectories
    (a partitioned layout), which --follow does not read."""
    root, tables = parts
    stream = tmp_path / "stream"
    (stream / "dt=2024-01-01").mkdir(parents=True)
    add(stream / "dt=2024-01-01", "part-0.parquet", tables[0])
    cfg = config(root, stream, "nested.yaml")
    args = ["train", "--config", str(cfg), "--model-dir", str(tmp_path / "m"), "--no-progress", "--follow"]
    assert main([*args, "--poll-seconds", "0.05", "--idle-timeout", "0.2"]) == 2
    err = capsys.readouterr().err
    assert f"follow: {stream}: no data file arrived in 0.2s (--idle-timeout); nothing trained, nothing written" in err
    assert "1 data file(s) lie in its subdirectories, which --follow does not read" in err
    assert not (tmp_path / "m").exists()
    add(stream, "few.parquet", tables[0].slice(0, 50))  # half a batch
    assert main([*args, "--poll-seconds", "0.05", "--idle-timeout", "0.2"]) == 2
    assert "its 1 file(s) hold less than one batch in 0.2s" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_two_ranks_follow_the_directory_as_one_process_does(parts, reference, tmp_path):
    """torchrun ranks see rank 0's listing of the directory: 2 x 50 rows a step = 1 x 100."""
    root, tables = parts
    stream = tmp_path / "stream"
    stream.mkdir()
    for i, t in enumerate(tables):
        add(stream, f"part-{i}.parquet", t)
    c = config_dict(data__batch_size=50)
    c["data"].update(train_input_path=str(stream), eval_input_path=None)
    del c["train"]["num_epochs"]
    c["train"].update(save_checkpoints_steps=3)
    cfg = write_config(root, c, "two.yaml")
    proc = follow(cfg, tmp_path / "m", "--nproc", "2", idle=1.0)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    mine = tables_of_any_world(tmp_path / "m")
    for name, dump in reference.items():
        keys = dump.get("keys")
        order = torch.argsort(keys) if keys is not None else slice(None)
        theirs = mine[name]
        their_order = torch.argsort(theirs["keys"]) if keys is not None else slice(None)
        if keys is not None:
            assert torch.equal(keys[order], theirs["keys"][their_order]), name
        torch.testing.assert_close(theirs["weight"][their_order], dump["weight"][order], rtol=1e-5, atol=1e-6)


def tables_of_any_world(model_dir):
    """A model dir's latest tables, merged from however many ranks wrote them."""
    from dynarec.config import load_config
    from dynarec.distributed.reshard import tables_for_rank
    from dynarec.planner import plan_from_config

    state, shards = load_checkpoint(latest_checkpoint(model_dir / "checkpoints"))
    plan = plan_from_config(load_config(model_dir / "config.yaml"))
    return tables_for_rank(plan, 0, state["plan"], shards)


def test_sigterm_while_waiting_for_files_stops_with_the_steps_saved(parts, tmp_path):
    """A follower waiting for the next file (no idle timeout) ignored SIGTERM's request until a
    file came; it stops at its next poll, the steps trained saved (exit 143)."""
    root, tables = parts
    stream = tmp_path / "stream"
    stream.mkdir()
    add(stream, "part-0.parquet", tables[0])  # 3 steps, then nothing more arrives
    args = [sys.executable, "-m", "dynarec", "train", "--config", str(config(root, stream, "wait.yaml"))]
    args += ["--model-dir", str(tmp_path / "m"), "--no-progress", "--follow", "--poll-seconds", "0.1"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and latest_checkpoint(tmp_path / "m" / "checkpoints") is None:
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert "dynarec train: stopped by SIGTERM after step 3; the model is saved in" in out
    assert "(continue with --follow --resume)" in out  # (a plain --resume of a followed run is refused)
    state, _ = load_checkpoint(latest_checkpoint(tmp_path / "m" / "checkpoints"))
    assert state["step"] == 3 and state["row"] == 300


def test_rows_short_of_a_global_batch_at_the_idle_timeout_are_named(parts, tmp_path):
    root, tables = parts
    stream = tmp_path / "stream"
    stream.mkdir()
    add(stream, "part-0.parquet", tables[0].slice(0, 250))
    out, _ = follow(config(root, stream, "stream.yaml"), tmp_path / "m", idle=1.0).communicate(timeout=240)
    assert (
        "stopping (200 rows of 1 file(s) consumed; 50 rows after them wait for a full global batch of 100: "
        "--follow --resume trains them once more rows arrive)" in out
    ), out


def test_the_idle_timeout_counts_from_the_last_file_that_arrived(parts, tmp_path):
    """Files smaller than a global batch, arriving faster than the idle timeout: the timeout
    counted from the last step trained, not from the last file, and the run stopped part-way
    through the stream with "no new file in 3.0s" one second after a file came."""
    root, tables = parts
    stream = tmp_path / "stream"
    stream.mkdir()
    add(stream, "part-0.parquet", tables[0].slice(0, 250))  # 2 steps, 50 rows waiting
    proc = follow(config(root, stream, "stream.yaml"), tmp_path / "m", idle=3.0)
    deadline = time.monotonic() + 120
    while not (tmp_path / "m" / "config.yaml").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)  # (the run has started following)
    for i in range(5):  # 10 rows a second: the 5th completes step 3
        time.sleep(1.0)
        add(stream, f"part-1-{i}.parquet", tables[1].slice(10 * i, 10))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "stopping (300 rows of 6 file(s) consumed)" in out, out
    state, _ = load_checkpoint(latest_checkpoint(tmp_path / "m" / "checkpoints"))
    assert state["step"] == 3 and state["row"] == 300


def test_a_mid_epoch_checkpoint_of_an_epoch_run_is_not_followed(parts, tmp_path):
    # Its row counts through the epoch's files; a followed directory's files are another list.
    root, tables = parts
    d = tmp_path / "files"
    d.mkdir()
    for i, t in enumerate(tables):
        add(d, f"part-{i}.parquet", t)
    five = config(root, d, "five.yaml", num_steps=5)
    assert main(["train", "--config", str(five), "--model-dir", str(tmp_path / "m"), "--no-progress"]) == 0
    out, _ = follow(config(root, d, "follow.yaml"), tmp_path / "m", "--resume", idle=1.0).communicate(timeout=240)
    assert "was written mid-epoch (epoch 0, row 500) by a run over data.train_input_path's files" in out, out
