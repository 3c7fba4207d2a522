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


def test_a_resumed_run_continues_the_running_loss(tmp_path):
    """The running loss (TensorBoard's train/running_loss, the progress line's) restarted from the
    first loss after every resume, a jump in its curve; the checkpoint carries it now."""
    losses = [0.9, 0.7, 0.6, 0.5]
    whole = TrainingLog(tmp_path / "whole", progress=False, enabled=False)
    for step, loss in enumerate(losses, 1):
        whole.train_step(step, loss, 0, record=True)
    first = TrainingLog(tmp_path / "resumed", progress=False, enabled=False)
    for step, loss in enumerate(losses[:2], 1):
        first.train_step(step, loss, 0, record=True)
    resumed = TrainingLog(tmp_path / "resumed", progress=False, enabled=False)
    resumed.load_state(first.state(), 2)
    for step, loss in enumerate(losses[2:], 3):
        resumed.train_step(step, loss, 0, record=True)
    assert resumed.running_loss == whole.running_loss != losses[-1]
    assert resumed.history == whole.history and "running_loss" not in resumed.history
