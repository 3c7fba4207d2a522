"""The training log's history across resumes: evaluations metrics.json reports at or before the
checkpoint's step are kept (a run's final evaluation follows its last save), NaN metrics (written
as null) stay NaN, one evaluation a step, the running loss carries on."""

import json
import math

from dynarec.files import json_text
from dynarec.train.sink import TrainingLog


def written(model_dir, evals):
    (model_dir / "metrics.json").write_text(json_text({"final": {}, "history": {"train_loss": [], "eval": evals}}))


def test_a_resume_keeps_the_reported_evaluations_up_to_its_checkpoint_and_nan_stays_nan(tmp_path):
    written(tmp_path, [[4, {"auc": 0.6}], [12, {"auc": 0.7, "grouped_auc": math.nan}], [20, {"auc": 0.8}]])
    assert "null" in (tmp_path / "metrics.json").read_text()
    log = TrainingLog(tmp_path, progress=False)
    checkpoint = {"train_loss": [[12, 0.5]], "eval": [[4, {"auc": 0.61}]]}  # its own at step 4 stands
    log.load_state(json.dumps(checkpoint), 12)  # resumed from step 12: step 20's evaluation is retrained
    assert [s for s, _ in log.history["eval"]] == [4, 12]
    assert log.history["eval"][0][1] == {"auc": 0.61}
    assert math.isnan(log.history["eval"][1][1]["grouped_auc"])
    log.eval(12, {"auc": 0.7, "grouped_auc": math.nan})  # a run resumed at its end evaluates step 12 again
    assert [s for s, _ in log.history["eval"]] == [4, 12]
    log.finish({})  # metrics.json and the curves, with a NaN metric
    assert [s for s, _ in json.loads((tmp_path / "metrics.json").read_text())["history"]["eval"]] == [4, 12]


def test_an_unreadable_metrics_file_leaves_the_checkpoints_history(tmp_path):
    (tmp_path / "metrics.json").write_text("{not json")
    log = TrainingLog(tmp_path, progress=False)
    log.load_state(json.dumps({"train_loss": [], "eval": [[3, {"auc": 0.5}]]}), 12)
    assert log.history["eval"] == [[3, {"auc": 0.5}]]


def test_the_running_loss_is_the_mean_since_the_last_record_and_a_resume_keeps_it(tmp_path):
    """The running loss was an average (weight 0.02) updated at the recorded steps alone (every
    log_step_count_steps): step 1's loss kept most of the weight for hundreds of steps, and a run
    shorter than 50 steps showed step 1's loss throughout. It is the trainer's mean over the steps
    since the last record now; and after a resume it is shown until the next record, where it
    restarted from nothing."""
    log = TrainingLog(tmp_path / "run", progress=False, enabled=False)
    log.train_step(1, 0.9, 0, record=True, mean_loss=0.9)
    log.train_step(2, None, 0, record=False)  # (not recorded: nothing read from the device)
    log.train_step(3, 0.5, 0, record=True, mean_loss=0.6)  # steps 2 and 3: 0.7 and 0.5
    assert log.running_loss == 0.6 and log.history["train_loss"] == [[1, 0.9], [3, 0.5]]
    resumed = TrainingLog(tmp_path / "run", progress=False, enabled=False)
    resumed.load_state(log.state(), 3)
    assert resumed.running_loss == 0.6 and resumed.history == log.history and "running_loss" not in resumed.history


def test_the_curves_show_a_multi_task_models_metrics(tmp_path):
    """curves.png looked up "auc" and "grouped_auc" alone: a multi-task model's eval panel
    (auc_ctr, grouped_auc_cvr, ...) was blank, and a regression's too; its loss panel said BCE
    whatever the loss."""
    from dynarec.train.sink import _plotted_metrics, plot_curves

    multi = [[10, {"num_examples": 400.0, "auc_ctr": 0.6, "log_loss_ctr": 0.5, "grouped_auc_cvr": math.nan}]]
    assert _plotted_metrics(multi) == ["auc_ctr", "grouped_auc_cvr"]
    assert _plotted_metrics([[10, {"num_examples": 4.0, "mse": 0.3, "mae": 0.4}]]) == ["mse", "mae"]
    plot_curves({"train_loss": [[1, 0.7], [10, 0.5]], "eval": multi}, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
