"""RocketLaunching: the light net served, the booster teaching it in training (TorchEasyRec's
losses, against a plain recomputation), and a training step whose loss is the sum of them."""

import pytest
import torch
import torch.nn.functional as F

from dynarec.config import config_from_dict
from dynarec.models import build_model
from dynarec.models.tasks import Tasks
from tests.models.test_models import inputs, model_config


def config(**block):
    c = model_config("rocket_launching")
    raw = c.model_dump(mode="json", exclude_none=True, by_alias=True)
    raw["model"]["rocket_launching"].update(block)
    return config_from_dict(raw)


def manual(model, emb, lengths, dense):
    """The light and booster nets recomputed layer by layer."""
    net = model.group(emb, lengths, dense)
    shared = model.share(net) if model.share is not None else net
    light, booster = [], []
    x = shared
    for layer in model.light:
        x = layer(x)
        if isinstance(layer, torch.nn.ReLU):
            light.append(x)
    y = shared
    for layer in model.booster:
        y = layer(y)
        if isinstance(layer, torch.nn.ReLU):
            booster.append(y)
    return model.light_out(x).squeeze(1), model.booster_out(y).squeeze(1), light, booster


@pytest.mark.parametrize("function", ["cosine", "l2"])
def test_teaching_is_torcheasyrecs_hint_and_similarity(function):
    torch.manual_seed(0)
    model = build_model(
        config(
            share_hidden_units=[8],
            booster_hidden_units=[8, 6, 4],
            light_hidden_units=[6, 4],
            feature_based_distillation=True,
            feature_distillation_function=function,
        )
    ).train()
    emb, lengths, dense = inputs()
    logits = model(emb, lengths, dense)
    light_logits, booster_logits, light, booster = manual(model, emb, lengths, dense)
    torch.testing.assert_close(logits, light_logits)
    t = model.teaching
    torch.testing.assert_close(t.booster_logits, booster_logits)
    hint = (light_logits - booster_logits) ** 2
    pairs = [(0, 1), (1, 2)]  # light 6 <-> booster 6, light 4 <-> booster 4
    if function == "cosine":
        sim = sum(-0.1 * (F.normalize(booster[j], dim=1) * F.normalize(light[i], dim=1)).sum(1) for i, j in pairs)
        torch.testing.assert_close(t.rows, hint + sim)
        assert float(t.batch) == 0.0
    else:
        torch.testing.assert_close(t.rows, hint)
        want = sum(torch.sqrt(((booster[j] - light[i]) ** 2).sum()) for i, j in pairs)
        torch.testing.assert_close(t.batch, want)


def test_the_light_net_never_trains_what_it_shares_and_the_booster_is_not_taught_back():
    torch.manual_seed(0)
    model = build_model(config(share_hidden_units=[8], booster_hidden_units=[6], light_hidden_units=[4])).train()
    emb, lengths, dense = inputs()
    for v in emb.values():
        v.requires_grad_(True)
    model(emb, lengths, dense)
    model.teaching.rows.sum().backward()  # the hint alone: the light net's, not the booster's
    assert all(p.grad is None or not p.grad.any() for p in model.share.parameters())
    assert all(p.grad is None or not p.grad.any() for p in model.booster.parameters())
    assert any(p.grad is not None and p.grad.any() for p in model.light.parameters())
    assert emb["a"].grad is None or not emb["a"].grad.any()


def test_eval_runs_the_light_net_alone():
    model = build_model(config()).eval()
    emb, lengths, dense = inputs()
    out = model(emb, lengths, dense)
    assert out.shape == (5,) and model.teaching is None


def test_the_step_loss_adds_the_boosters_task_loss_and_the_teaching():
    from dynarec.models.tasks import Teaching

    tasks = Tasks(config())
    g = torch.Generator().manual_seed(0)
    light, booster, rows = torch.randn(6, generator=g), torch.randn(6, generator=g), torch.rand(6, generator=g)
    labels = torch.tensor([[1.0], [0.0], [1.0], [1.0], [0.0], [0.0]])
    loss = tasks.loss(light, labels, 12, teaching=Teaching(booster, rows, torch.tensor(0.25)))
    bce = F.binary_cross_entropy_with_logits
    y = labels[:, 0]
    want = (bce(light, y, reduction="sum") + bce(booster, y, reduction="sum") + rows.sum()) / 12 + 0.25
    torch.testing.assert_close(loss, want)


def test_rocket_launching_trains_through_the_pipeline(tmp_path):
    from dynarec.train.trainer import Trainer
    from tests.pipeline_fixtures import make_data, multi_task_config_dict

    make_data(tmp_path)
    block = {"booster_hidden_units": [16, 8], "light_hidden_units": [8], "feature_based_distillation": True}
    raw = multi_task_config_dict({"rocket_launching": block})
    raw["data"]["label_field"] = "clk"
    report = Trainer(config_from_dict(raw, base_dir=tmp_path), tmp_path / "m", progress=False).fit()
    assert 0.5 < report["eval"]["auc"] < 1.0
