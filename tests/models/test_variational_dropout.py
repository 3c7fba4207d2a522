"""Variational dropout over a deep group's parts: TorchEasyRec's formulas (concrete relaxation in
training, the expected keep rate in eval), its penalty in the step's loss, and where it applies."""

import pytest
import torch

from dynarec.config import ConfigError, config_from_dict
from dynarec.models import build_model
from dynarec.models.variational_dropout import VariationalDropout, penalties
from tests.models.test_models import inputs, model_config


def test_training_scales_each_part_by_one_minus_its_concrete_sample():
    torch.manual_seed(0)
    vd = VariationalDropout([2, 1, 3], regularization_lambda=0.02).train()
    x = torch.randn(4, 6)
    torch.manual_seed(1)
    out = vd(x)
    torch.manual_seed(1)
    u = torch.rand(4, 3)
    q = torch.sigmoid(vd.logit_p)
    eps = torch.finfo(torch.float32).eps
    z = torch.sigmoid((torch.log(q + eps) - torch.log(1 - q + eps) + torch.log(u + eps) - torch.log(1 - u + eps)) / 0.1)
    scale = torch.cat([(1 - z[:, :1]).expand(4, 2), 1 - z[:, 1:2], (1 - z[:, 2:]).expand(4, 3)], dim=1)
    torch.testing.assert_close(out, x * scale)
    torch.testing.assert_close(vd.penalty, 0.02 * (1 - q).sum())


def test_eval_scales_each_part_by_its_keep_rate_and_leaves_no_penalty():
    vd = VariationalDropout([2, 1], regularization_lambda=0.01).eval()
    x = torch.randn(3, 3)
    q = torch.sigmoid(vd.logit_p)
    want = x * torch.stack([1 - q[0], 1 - q[0], 1 - q[1]])[None]
    torch.testing.assert_close(vd(x), want)
    assert vd.penalty is None


def test_the_penalty_is_torcheasyrecs_per_batch_term_shared_by_the_ranks():
    vd = VariationalDropout([1, 1], regularization_lambda=0.5).train()
    vd(torch.randn(8, 2))
    one_process = penalties([vd], 8, 8)
    torch.testing.assert_close(one_process, 0.5 * (1 - torch.sigmoid(vd.logit_p)).sum() / 8)
    two_ranks = penalties([vd], 3, 8) + penalties([vd], 5, 8)  # two ranks' shares of one global batch
    torch.testing.assert_close(two_ranks, one_process)


def vd_config(name):
    raw = model_config(name).model_dump(mode="json", exclude_none=True)
    raw["model"]["variational_dropout"] = {"regularization_lambda": 0.1}
    return raw


@pytest.mark.parametrize("name", ["mmoe", "dcn_v2", "multi_tower_din"])
def test_every_deep_group_of_several_parts_gets_one(name):
    model = build_model(config_from_dict(vd_config(name))).train()
    groups = [m for m in model.modules() if isinstance(m, VariationalDropout)]
    assert groups and all(len(g.logit_p) > 1 for g in groups)
    emb, lengths, dense = inputs()
    out = model(emb, lengths, dense)
    (out.sum() + penalties(groups, 5, 5)).backward()
    assert all(g.logit_p.grad is not None and g.logit_p.grad.abs().sum() > 0 for g in groups)


@pytest.mark.parametrize("name", ["deepfm", "dlrm", "xdeepfm", "wukong"])
def test_models_reading_fields_one_by_one_refuse_it(name):
    with pytest.raises(ConfigError, match=rf"variational_dropout: {name} reads its groups feature by feature"):
        config_from_dict(vd_config(name))
