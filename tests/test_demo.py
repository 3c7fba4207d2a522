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
