"""Tasks: each loss is TorchEasyRec's formula, task-space weights are normalized over the global
batch (two ranks' shares add up to one process's loss), metrics and the config's refusals."""

import numpy as np
import pytest
import torch

from dynarec.config import config_from_dict
from dynarec.config.tasks import TaskTowerCfg
from dynarec.metrics import accuracy, mean_absolute_error, mean_squared_error
from dynarec.models.tasks import Tasks, task_loss
from tests.models.test_models import MULTI_TASK, model_config


def tower(**kw) -> TaskTowerCfg:
    return TaskTowerCfg.model_validate({"tower_name": "t", "label_name": "y", **kw})


def test_binary_cross_entropy_with_label_smoothing():
    z, y = torch.tensor([0.3, -1.2, 2.0]), torch.tensor([1.0, 0.0, 1.0])
    got = task_loss(tower(losses=[{"binary_cross_entropy": {"label_smoothing": 0.2}}]), z, y)
    target = y * 0.8 + 0.1
    p = torch.sigmoid(z)
    torch.testing.assert_close(got, -(target * p.log() + (1 - target) * (1 - p).log()))


def test_binary_focal_loss_is_torcheasyrecs():
    z, y = torch.tensor([0.3, -1.2, 2.0, 0.0]), torch.tensor([1.0, 0.0, 0.0, 1.0])
    got = task_loss(tower(losses=[{"binary_focal_loss": {"gamma": 2.0, "alpha": 0.25}}]), z, y)
    p = torch.sigmoid(z)
    w = 0.25 * y * (1 - p) ** 2 + 0.75 * (1 - y) * p**2
    torch.testing.assert_close(got, -w * (y * p.log() + (1 - y) * (1 - p).log()))


def test_softmax_cross_entropy_and_l2():
    z = torch.tensor([[0.1, 2.0, -1.0], [1.0, 0.0, 0.5]])
    y = torch.tensor([1.0, 2.0])
    got = task_loss(tower(num_class=3, losses=[{"softmax_cross_entropy": {}}]), z, y)
    torch.testing.assert_close(got, -torch.log_softmax(z, 1)[[0, 1], [1, 2]])
    r = task_loss(tower(losses=[{"l2_loss": {}}]), torch.tensor([1.5, -2.0]), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(r, torch.tensor([0.25, 9.0]))


def test_one_tasks_loss_is_its_rows_sum_over_the_global_rows_with_no_op_beyond():
    """A single binary task of weight 1 (the demo's): ``bce(rows).sum() / global_rows``, to the
    bit, in three dispatched ops (no zeros to add to, no multiply by the weight 1), and a weight
    other than 1 multiplies the sum before the division, as the formula was written."""
    from torch.utils._python_dispatch import TorchDispatchMode

    tasks = Tasks(model_config("multi_tower_din"))
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(16, 1, generator=g), (torch.rand(16, 1, generator=g) > 0.5).float()
    rows = torch.nn.functional.binary_cross_entropy_with_logits(logits[:, 0], labels[:, 0], reduction="none")
    assert torch.equal(tasks.loss(logits, labels, 40), rows.sum() / 40)

    ops: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Count():
        tasks.loss(logits, labels, 40)
    computed = [op for op in ops if not op.startswith(("view", "select", "slice", "split", "squeeze", "reshape"))]
    assert computed == ["binary_cross_entropy_with_logits.default", "sum.default", "div.Tensor"], ops

    weighted = tower(weight=2.5)
    assert weighted.weight == 2.5
    tasks.towers[0] = weighted.model_copy(update={"label_name": tasks.towers[0].label_name})
    assert torch.equal(tasks.loss(logits, labels, 40), (2.5 * rows.sum()) / 40)


def _two_tasks():
    return Tasks(model_config("mmoe"))  # ctr on 'label'; cvr on 'label2' weighted by the click space


def test_task_space_weights_are_normalized_and_weigh_the_tasks():
    tasks = _two_tasks()
    assert tasks.labels == ["label", "label2"] and tasks.output_names() == ["probs_ctr", "probs_cvr"]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 2, generator=g)
    labels = torch.tensor([[1, 1], [0, 0], [1, 0], [0, 0], [1, 1], [0, 0], [0, 0], [1, 0]], dtype=torch.float32)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    clicked = labels[:, 0] > 0
    want = bce(logits[:, 0], labels[:, 0]) + bce(logits[clicked, 1], labels[clicked, 1])  # out-of-space weight 0
    torch.testing.assert_close(tasks.loss(logits, labels, 8), want)


def test_shares_of_a_global_batch_add_up_to_its_loss():
    """What two ranks compute with a global sum of the weights equals one process's loss."""
    tasks = _two_tasks()
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(10, 2, generator=g)
    labels = torch.stack(
        [torch.tensor([1, 0, 1, 1, 0, 0, 0, 1, 0, 0.0]), torch.tensor([1, 0, 0, 1, 0, 0, 0, 0, 0, 0.0])], 1
    )
    whole = tasks.loss(logits, labels, 10)
    halves = [(logits[:4], labels[:4]), (logits[4:], labels[4:])]
    total = sum(tasks.sample_weights(y)[1].sum() for _, y in halves)
    global_sum = lambda t: torch.stack([t[0] * 0 + 10, total])
    shares = [tasks.loss(z, y, 10, global_sum) for z, y in halves]
    torch.testing.assert_close(shares[0] + shares[1], whole)


def test_a_task_without_rows_in_its_space_adds_nothing():
    tasks = _two_tasks()
    logits, labels = torch.zeros(3, 2), torch.zeros(3, 2)
    torch.testing.assert_close(tasks.loss(logits, labels, 3), torch.tensor(np.log(2.0), dtype=torch.float32))


def test_predictions_and_metrics_carry_the_task_names():
    tasks = _two_tasks()
    preds = {k: v.numpy() for k, v in tasks.predictions(torch.tensor([[0.0, 10.0], [1.0, -10.0]])).items()}
    np.testing.assert_allclose(preds["probs_ctr"], [0.5, 1 / (1 + np.exp(-1))], rtol=1e-6)
    labels = np.array([[0.0, 1.0], [1.0, 0.0]])
    m = tasks.metrics(preds, labels, None)
    assert m == {"auc_ctr": 1.0, "auc_cvr": 1.0}
    single = Tasks(model_config("dlrm"))
    assert single.output_names() == ["probability"]
    assert set(single.metrics({"probability": np.array([0.2, 0.9])}, np.array([[0.0], [1.0]]), None)) == {
        "auc",
        "log_loss",
    }


def test_metric_functions():
    assert accuracy(np.array([[0.2, 0.8], [0.9, 0.1], [0.4, 0.6]]), np.array([1, 1, 1])) == pytest.approx(2 / 3)
    assert mean_squared_error(np.array([1.0, 3.0]), np.array([0.0, 1.0])) == 2.5
    assert mean_absolute_error(np.array([1.0, 3.0]), np.array([0.0, 1.0])) == 1.5


@pytest.mark.parametrize(
    "change, message",
    [
        ({"losses": [{"softmax_cross_entropy": {}}]}, "softmax_cross_entropy needs num_class >= 2"),
        ({"num_class": 3}, r"need\(s\) num_class 1, got 3"),
        ({"losses": [{"l2_loss": {}}], "metrics": ["auc"]}, "metric 'auc' does not score a regression task"),
        ({"losses": [{"l2_loss": {}}, {"binary_cross_entropy": {}}]}, "l2_loss trains a regression output"),
        ({"losses": []}, "give at least one loss"),
        ({"losses": [{"binary_cross_entropy": {}, "l2_loss": {}}]}, "give exactly one of"),
        ({"relation_tower_names": ["ctr"]}, "relation_tower_names need relation_hidden_units"),
    ],
)
def test_a_task_tower_refuses(change, message):
    with pytest.raises(ValueError, match=message):
        tower(**change)


def _multi(name="mmoe", **changes):
    raw = model_config(name).model_dump(mode="json", exclude_unset=True)
    raw["model"][name].update(changes)
    return raw


def test_a_multi_task_config_refuses_names_it_cannot_resolve():
    raw = _multi(task_towers=[{"tower_name": "a", "label_name": "x"}, {"tower_name": "a", "label_name": "y"}])
    with pytest.raises(ValueError, match=r"task_towers\[1\]: tower_name 'a' is used twice"):
        config_from_dict(raw)
    raw = _multi(
        "dbmtl",
        task_towers=[
            {"tower_name": "a", "label_name": "x", "relation_tower_names": ["b"], "relation_hidden_units": [2]},
            {"tower_name": "b", "label_name": "y"},
        ],
    )
    with pytest.raises(ValueError, match=r"relation tower 'b' is not an earlier tower"):
        config_from_dict(raw)
    raw = _multi()
    raw["data"]["label_field"] = "clk"
    with pytest.raises(ValueError, match=r"data\.label_field: model 'mmoe' reads the labels its task_towers name"):
        config_from_dict(raw)


@pytest.mark.parametrize("name", MULTI_TASK)
def test_label_fields_of_a_multi_task_model(name):
    assert model_config(name).label_fields() == ["label", "label2"]


# -- JRC ---------------------------------------------------------------------------------------

JRC_LOGITS = torch.tensor(
    [[0.9, 0.1], [0.5, 0.5], [0.3, 0.7], [0.2, 0.8], [0.8, 0.2], [0.55, 0.45], [0.33, 0.67], [0.55, 0.45]]
)
JRC_LABELS = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1], dtype=torch.float32)
JRC_SESSIONS = torch.tensor([1, 1, 1, 1, 2, 2, 2, 2])


def jrc_reference(logits, labels, sessions, alpha=0.5):
    """TorchEasyRec's first JRCLoss, the batch-by-batch mask form, row by row."""
    y = labels.long()
    rows = []
    for i in range(len(y)):
        channel = int(y[i])
        same = (sessions == sessions[i]) & (y != y[i])
        same[i] = True
        z = logits[:, channel].masked_fill(~same, -1e9)
        rows.append(torch.nn.functional.cross_entropy(z[None], torch.tensor([i]), reduction="none")[0])
    ce = torch.nn.functional.cross_entropy(logits, y, reduction="none")
    return alpha * ce + (1 - alpha) * torch.stack(rows)


def test_jrc_is_torcheasyrecs_loss_on_its_own_example():
    from dynarec.models.tasks import jrc_rows

    rows = jrc_rows(JRC_LOGITS, JRC_LABELS, JRC_SESSIONS, 0.5)
    assert round(rows.mean().item(), 4) == 0.7199  # tzrec/loss/jrc_loss_test.py
    torch.testing.assert_close(rows, jrc_reference(JRC_LOGITS, JRC_LABELS, JRC_SESSIONS))


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_jrc_matches_the_mask_form_with_one_class_sessions_and_lone_rows(alpha):
    from dynarec.models.tasks import jrc_rows

    g = torch.Generator().manual_seed(0)
    sessions = torch.tensor([5, 3, 3, 9, 9, 9, 7, 7, 5, 11])  # 11 alone; 7 all positive
    labels = torch.tensor([1, 0, 1, 0, 0, 1, 1, 1, 0, 0], dtype=torch.float32)
    logits = torch.randn(10, 2, generator=g, requires_grad=True)
    rows = jrc_rows(logits, labels, sessions, alpha)
    torch.testing.assert_close(rows, jrc_reference(logits, labels, sessions, alpha))
    rows.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_jrc_needs_two_classes_and_one_session_column():
    from dynarec.config.tasks import TaskTowerCfg, check_task_towers

    with pytest.raises(ValueError, match="jrc_loss needs num_class 2"):
        TaskTowerCfg(tower_name="ctr", label_name="clk", losses=[{"jrc_loss": {"session_name": "u"}}])
    towers = [
        TaskTowerCfg(tower_name=n, label_name=n, num_class=2, losses=[{"jrc_loss": {"session_name": s}}])
        for n, s in (("ctr", "user_id"), ("cvr", "query_id"))
    ]
    with pytest.raises(ValueError, match=r"m.task_towers: jrc_loss: one session_name for every task"):
        check_task_towers(towers, "m")
