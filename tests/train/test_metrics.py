import warnings

import numpy as np
import pytest
import torch

from dynarec.metrics import NULL_GROUP, auc, grouped_auc, log_loss


def test_auc_matches_torchmetrics_with_ties():
    tm = pytest.importorskip("torchmetrics.functional.classification")
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 20, 500) / 20.0  # many ties
    labels = (rng.random(500) < 0.3).astype(int)
    expected = float(tm.binary_auroc(torch.tensor(scores), torch.tensor(labels)))
    assert auc(scores, labels) == pytest.approx(expected, abs=1e-6)


def test_auc_by_hand():
    assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert auc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)
    assert np.isnan(auc([0.1, 0.2], [1, 1]))


def test_grouped_auc_weights_groups_by_size_and_skips_single_class():
    scores = [0.1, 0.9, 0.8, 0.9, 0.3, 0.5, 0.7]
    labels = [0, 1, 0, 1, 1, 0, 1]
    groups = [1, 1, 2, 2, 2, 3, 4]  # group 1: AUC 1 (2 rows); group 2: AUC 0.5 (3 rows); 3, 4 single class
    assert grouped_auc(scores, labels, groups) == pytest.approx((1.0 * 2 + 0.5 * 3) / 5)
    # Rows without a user (a null grouping value) have no user's AUC: left out, both classes or not.
    without_user = [*groups[:5], NULL_GROUP, NULL_GROUP]
    assert grouped_auc(scores, labels, without_user) == pytest.approx((1.0 * 2 + 0.5 * 3) / 5)


def test_log_loss():
    assert log_loss([0.5, 0.5], [0, 1]) == pytest.approx(np.log(2))


def test_an_undefined_auc_is_reported_with_its_reason():
    """Eval labels of one class gave NaN AUC and grouped AUC in the run's report with no word
    why; each now warns, naming the task, its label and what the labels hold."""
    from dynarec.config import config_from_dict
    from dynarec.models.tasks import tasks_of
    from tests.pipeline_fixtures import config_dict

    tasks = tasks_of(config_from_dict(config_dict()))
    names = tasks.output_names()
    predictions = {names[0]: np.array([0.2, 0.7, 0.4, 0.9], dtype=np.float32)}
    with pytest.warns(UserWarning) as caught:
        out = tasks.metrics(predictions, np.zeros((4, 1), np.float32), np.array([1, 1, 2, 2]))
    messages = [str(w.message) for w in caught]
    assert np.isnan(out["auc"]) and np.isnan(out["grouped_auc"]) and np.isfinite(out["log_loss"])
    assert "eval: auc of task 'main' (label 'clk') is undefined (NaN): its 4 labels are all 0" in messages
    assert any("grouped_auc of task 'main' (label 'clk') is undefined (NaN): no group holds both labels" in m
               for m in messages)  # fmt: skip
    labels = np.array([[0], [1], [0], [1]], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # defined: no warning
        tasks.metrics(predictions, labels, np.array([1, 1, 2, 2]))


def test_a_single_task_model_reports_accuracy_of_the_probabilitys_class():
    """docs/models.md lists accuracy for binary tasks and import-config maps it, but a single-task
    model's eval.metrics refused it (a QA pass)."""
    from dynarec.config import config_from_dict
    from dynarec.models.tasks import tasks_of
    from tests.pipeline_fixtures import config_dict

    tasks = tasks_of(config_from_dict(config_dict(eval={"metrics": ["auc", "accuracy"]})))
    (name,) = tasks.output_names()
    predictions = {name: np.array([0.2, 0.7, 0.5, 0.9, 0.6], dtype=np.float32)}
    labels = np.array([[0], [1], [1], [0], [1]], np.float32)  # right, right, wrong (a tie is 0), wrong, right
    out = tasks.metrics(predictions, labels, None)
    assert set(out) == {"auc", "accuracy"} and out["accuracy"] == pytest.approx(3 / 5)
