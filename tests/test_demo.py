"""The demo (`dynarec demo`, README's first command): its model directory is one the other
commands take as it is, from any working directory."""

from dynarec.cli import main


def test_the_demos_model_dir_evaluates_from_another_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["demo", "--work-dir", "out", "--train-rows", "3000", "--eval-rows", "600", "--epochs", "1"]
    assert main([*args, "--no-baseline", "--no-progress"]) == 0
    monkeypatch.chdir(tmp_path / "out")  # elsewhere: its config's data paths are absolute
    assert main(["evaluate", "--model-dir", "model"]) == 0
    assert '"auc"' in capsys.readouterr().out


def test_the_demo_replaces_its_own_work_dir_and_no_other(tmp_path, monkeypatch, capsys):
    """`--work-dir` was deleted whole before the demo wrote into it: a directory of the user's own,
    or `--work-dir .` (the working directory's files gone, then "Invalid argument"). Now the demo
    empties only a directory holding its own outputs (its marker lists them), and says what else
    it found, deleting nothing."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.py").write_text("my code")
    args = ["--train-rows", "2000", "--eval-rows", "500", "--epochs", "1", "--no-baseline", "--no-progress"]
    assert main(["demo", "--work-dir", ".", *args]) == 2
    assert "--work-dir . holds notes.py, which the demo did not write" in capsys.readouterr().err
    assert (tmp_path / "notes.py").read_text() == "my code"
    out = tmp_path / "out"
    assert main(["demo", "--work-dir", str(out), *args]) == 0
    (out / "data" / "mine.txt").write_text("keep")
    assert main(["demo", "--work-dir", str(out), *args]) == 2
    assert "holds data/mine.txt, which the demo did not write" in capsys.readouterr().err
    assert (out / "data" / "mine.txt").read_text() == "keep" and (out / "model" / "checkpoints").is_dir()
    (out / "data" / "mine.txt").unlink()
    (out / "demo.json").unlink()  # a demo directory written before the marker: its outputs alone
    assert main(["demo", "--work-dir", str(out), *args]) == 0
    assert (out / "demo.json").is_file() and (out / "demo_summary.json").is_file()
