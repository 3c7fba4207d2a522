"""PEPNet: its gates and towers by hand, and its domains: a row's loss and metrics read its own
domain's tower, predictions give every domain's."""

import numpy as np
import pytest
import torch

from dynarec.config import config_from_dict
from dynarec.models import build_model
from dynarec.models.tasks import Tasks, task_loss
from tests.models.test_models import inputs, model_config


def domain_config(domains=3):
    raw = model_config("pepnet").model_dump(mode="json")
    raw["model"]["pepnet"].update(domain_label="dom_id", task_domain_num=domains)
    return config_from_dict(raw)


def test_the_forward_is_epnet_then_ppnet_then_the_towers_by_hand():
    torch.manual_seed(0)
    config = model_config("pepnet")
    model = build_model(config).eval()
    emb, lengths, dense = inputs()
    torch.set_grad_enabled(False)
    out = model(emb, lengths, dense)
    assert out.shape == (5, 2)
    main = model.main(emb, lengths, dense)
    dom, uia = model.domain(emb, lengths, dense), model.uia(emb, lengths, dense)

    def gate(g, x):  # gamma * sigmoid(W2 relu(W1 x + b1) + b2)
        l1, l2 = g.net[0], g.net[2]
        return g.gamma * torch.sigmoid(torch.relu(x @ l1.weight.T + l1.bias) @ l2.weight.T + l2.bias)

    scaled = gate(model.epnet, torch.cat([dom, main], 1)) * main
    assert (
        0 < float(gate(model.epnet, torch.cat([dom, main], 1)).min())
        and float(gate(model.epnet, torch.cat([dom, main], 1)).max()) < 2
    )
    want = []
    for k, layers in enumerate(model.ppnet.tasks):
        x = scaled
        for layer in layers:
            lin = layer.linear
            x = torch.relu(x @ lin.weight.T + lin.bias) * gate(layer.gate, torch.cat([uia, scaled], 1))
        tower = model.towers[k][0]
        want.append(tower(x))
    torch.set_grad_enabled(True)
    torch.testing.assert_close(out, torch.cat(want, 1))


def test_the_gates_hold_the_main_vector_constant():
    """EPNet's and PPNet's gates read the main vector detached (TorchEasyRec's): a gate's
    gradient does not flow into the main group through the gate's input."""
    model = build_model(model_config("pepnet")).eval()
    main = torch.randn(3, model.main.out_dim, requires_grad=True)
    dom = torch.randn(3, model.domain.out_dim)
    scale = model.epnet(torch.cat([dom, main.detach()], 1))
    (scale * main).sum().backward()
    torch.testing.assert_close(main.grad, scale.detach())  # d(s * m)/dm = s alone


def test_each_row_reads_its_own_domains_tower():
    config = domain_config(3)
    tasks = Tasks(config)
    assert tasks.labels == ["label", "label2", "dom_id"] and config.label_fields() == ["label", "label2", "dom_id"]
    assert tasks.output_names() == [f"probs_{t}_{d}" for t in ("ctr", "cvr") for d in range(3)]
    torch.manual_seed(1)
    logits = torch.randn(4, 6)  # [ctr_0, ctr_1, ctr_2, cvr_0, cvr_1, cvr_2]
    labels = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 2.0]])
    own = torch.stack(
        [logits[torch.arange(4), labels[:, 2].long()], logits[torch.arange(4), 3 + labels[:, 2].long()]], 1
    )
    torch.testing.assert_close(tasks.choose(logits, labels), own)
    plain = Tasks(model_config("pepnet"))
    torch.testing.assert_close(tasks.loss(logits, labels, 4), plain.loss(own, labels[:, :2], 4))
    ctr = task_loss(config.tasks()[0], own[:, 0], labels[:, 0])
    assert float(tasks.loss(logits, labels, 4)) > float(ctr.sum() / 4) - 1e-6  # and the cvr term
    predictions = {k: v.numpy() for k, v in tasks.predictions(logits).items()}
    np.testing.assert_allclose(predictions["probs_ctr_2"], torch.sigmoid(logits[:, 2]).numpy(), rtol=1e-6)
    metrics = tasks.metrics(predictions, labels.numpy(), None)
    from dynarec.metrics import auc

    assert metrics["auc_ctr"] == auc(torch.sigmoid(own[:, 0]).numpy(), labels[:, 0].numpy())


@pytest.mark.parametrize("bad", [3.0, -1.0, 0.5])
def test_a_domain_outside_the_towers_is_an_error_naming_the_label(bad):
    tasks = Tasks(domain_config(3))
    labels = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, bad]])
    with pytest.raises(
        ValueError,
        match=rf"label 'dom_id' \(model.pepnet.domain_label\) is {bad:g} in a row: a domain is an integer in \[0, 3\)",
    ):
        tasks.loss(torch.zeros(2, 6), labels, 2)


def test_domain_settings_that_cannot_work_are_config_errors():
    raw = model_config("pepnet").model_dump(mode="json")
    raw["model"]["pepnet"]["task_domain_num"] = 2
    with pytest.raises(ValueError, match="task_domain_num: several towers a task need a domain_label"):
        config_from_dict(raw)
    raw["model"]["pepnet"].update(task_domain_num=1, uia_input=None)
    with pytest.raises(ValueError, match="ppnet_hidden_units: PPNet runs only with a uia_input group"):
        config_from_dict(raw)
