"""MIND: the capsule layer against a plain per-row reference of TorchEasyRec's routing, the
label-aware attention by hand, and training on the click log."""

import math

import pytest
import torch

from dynarec.config.schema import CapsuleCfg
from dynarec.models.mind import MIND, CapsuleLayer
from tests.data.test_sampler import dssm_config
from tests.models.test_retrieval import trained_on_the_click_log


def reference_capsules(cfg: CapsuleCfg, bilinear, sequence, length, start_logits):
    """One user's interests, straight from TorchEasyRec's B2I routing: ``sequence`` ``[L, low]``,
    ``start_logits`` ``[max_seq_len, max_k]`` (before the stddev)."""
    s, k = cfg.max_seq_len, cfg.max_k
    x = torch.zeros(s, sequence.shape[1])
    n = min(length, s, sequence.shape[0])
    x[:n] = sequence[:n]
    valid_pos = [j < length for j in range(s)]
    if cfg.const_caps_num:
        count = float(k)
    else:
        count = max(1.0, min(float(k), math.log2(length) if length > 0 else -math.inf))
    valid_caps = [c < count for c in range(k)]
    low = x @ bilinear  # [s, h]
    direction = low / low.norm(dim=1, keepdim=True).clamp_min(1e-12)
    logits = start_logits * cfg.routing_logits_stddev
    for it in range(cfg.num_iters):
        w = torch.zeros(s, k)
        for j in range(s):
            row = [logits[j, c] * cfg.routing_logits_scale if valid_caps[c] else -math.inf for c in range(k)]
            w[j] = torch.softmax(torch.tensor(row), 0) * (1.0 if valid_pos[j] else 0.0)
        high = torch.stack([sum(w[j, c] * low[j] for j in range(s)) for c in range(k)])
        if it + 1 < cfg.num_iters:
            logits = w + direction @ high.T  # [s, k]: the weights plus each position's agreement
        else:
            out = []
            for c in range(k):
                norm = max(float(high[c].norm()), 1e-7)
                scale = (norm**2 / (1 + norm**2)) ** cfg.squash_pow / norm
                out.append(high[c] * scale if valid_caps[c] else torch.zeros_like(high[c]))
            return torch.stack(out), torch.tensor(valid_caps)


@pytest.mark.parametrize("init", ["zeros", "normal"])
@pytest.mark.parametrize("const_caps_num", [False, True])
def test_capsules_match_a_per_row_reference_of_the_routing(init, const_caps_num):
    torch.manual_seed(0)
    cfg = CapsuleCfg(
        max_k=3, max_seq_len=5, high_dim=4, num_iters=3, routing_logits_scale=2.0, routing_logits_stddev=0.7,
        squash_pow=0.2, const_caps_num=const_caps_num, routing_init_method=init,
    )  # fmt: skip
    layer = CapsuleLayer(cfg, low_dim=6).eval()
    lengths = torch.tensor([0, 1, 3, 5, 7])  # the last one longer than max_seq_len: cut
    sequence = torch.randn(5, 7, 6)
    interests, mask = layer(sequence, lengths)
    assert interests.shape == (5, 3, 4) and mask.shape == (5, 3)
    start = layer.eval_routing_logits if init == "normal" else torch.zeros(5, 3)
    for b in range(5):
        want, want_mask = reference_capsules(cfg, layer.bilinear.detach(), sequence[b], int(lengths[b]), start)
        assert mask[b].tolist() == want_mask.tolist()
        torch.testing.assert_close(interests[b].detach(), want, rtol=1e-4, atol=1e-5)
    if not const_caps_num:  # max(1, min(3, log2(length))) interests: 1, 1, 1 (log2 3 = 1.58 -> 2 slots), 3, 3
        assert mask.sum(1).tolist() == [1, 1, 2, 3, 3]
    # training draws fresh logits for every batch (TorchEasyRec's), evaluation the saved draw
    if init == "normal":
        layer.train()
        a, _ = layer(sequence, lengths)
        b_, _ = layer(sequence, lengths)
        assert not torch.allclose(a, b_)
        layer.eval()
        torch.testing.assert_close(layer(sequence, lengths)[0], interests)


def test_label_aware_attention_by_hand():
    """softmax over the valid interests of simi_pow * <interest, own item>, mixing them."""
    model = MIND.__new__(MIND)
    torch.nn.Module.__init__(model)
    model.simi_pow = 2.0
    interests = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]])
    mask = torch.tensor([[True, True, False]])
    item = torch.tensor([[0.5, 0.0]])
    w = torch.softmax(torch.tensor([2.0 * 0.5, 0.0]), 0)
    torch.testing.assert_close(
        model.label_aware(interests, mask, item), (w[0] * interests[0, 0] + w[1] * interests[0, 1])[None]
    )


def mind_config(path, **sampler):
    c = dssm_config(path, **sampler)
    c["model"]["feature_groups"] = [
        {"group_name": "user", "feature_names": ["user_id", "age"]},
        {"group_name": "item", "feature_names": ["item_id", "cate_id"]},
        {"group_name": "hist", "group_type": "sequence", "feature_names": ["hist_item_id"]},
    ]
    c["model"]["mind"] = {
        "user_tower": {
            "input": "user",
            "history_input": "hist",
            "hidden_units": [8, 8],
            "hist_seq_mlp": {"hidden_units": [8, 8], "bias": False},
            "capsule": {"max_k": 3, "max_seq_len": 6, "high_dim": 8, "squash_pow": 0.2},
            "concat_mlp": {"hidden_units": [8], "bias": False},
        },
        "item_tower": {"input": "item", "hidden_units": [8]},
        "output_dim": 8,
        "simi_pow": 20,
        "temperature": 0.1,
    }
    del c["model"]["dssm"]
    return c


def test_mind_trains_on_the_click_log_to_far_better_than_chance_recall(tmp_path):
    """20 sampled items a batch: chance recall@1 is 1/21; the users' histories point at their
    items. The export serves each user's 3 interests (8 numbers each) and each item."""
    c, trainer, before, after = trained_on_the_click_log(tmp_path, mind_config)
    # chance: 0.048; train.seed 0-3 ended at recall@1 0.54, 0.52, 0.48, 0.49 (recall@5 0.70-0.78)
    assert before["recall@1"] < 0.1 and after["recall@1"] > 0.35
    assert after["recall@5"] > 0.6
    from dynarec.serving import ExportedModel
    from dynarec.train.export import export_model

    served = ExportedModel(export_model(trainer.task, trainer.example_batch(), tmp_path / "export"))
    out = served.predict_files(c["data"]["eval_input_path"], batch_size=37)
    assert out["user_interests"].shape == (400, 24) and out["item_embedding"].shape == (400, 8)
    norms = torch.from_numpy(out["user_interests"]).view(400, 3, 8).norm(dim=2)
    assert ((norms - 1).abs() < 1e-4).logical_or(norms == 0).all()  # cosine: unit interests, or none
    assert (norms[:, 0] > 0).all()
