"""Every model in the registry builds from a config and trains; DIN attention ignores padding."""

import pytest
import torch

from dynarec.config import config_from_dict
from dynarec.models import MODELS, build_model
from dynarec.models.blocks import DINAttention
from tests.pipeline_fixtures import config_dict

SAME_DIM = [  # DeepFM and DLRM want one embedding dim
    {"id_feature": {"feature_name": "a", "embedding_dim": 4, "num_buckets": 10}},
    {"id_feature": {"feature_name": "b", "embedding_dim": 4, "num_buckets": 10}},
    {
        "sequence_feature": {
            "feature_name": "s",
            "sequence_length": 5,
            "embedding_dim": 4,
            "num_buckets": 10,
            "embedding_name": "b",
        }
    },
    {"raw_feature": {"feature_name": "x"}},
]

MODEL_BLOCKS = {
    "multi_tower_din": (
        {
            "towers": [{"input": "deep", "hidden_units": [8]}],
            "din_towers": [{"input": "seq", "attn_hidden_units": [8]}],
        },
        True,
    ),
    "din": ({"din_tower": {"input": "seq"}}, True),
    "deepfm": ({}, False),
    "wide_and_deep": ({}, False),
    "dlrm": ({}, False),
}


def model_config(name):
    block, with_seq = MODEL_BLOCKS[name]
    groups = [{"group_name": "deep", "feature_names": ["a", "b", "x"]}]
    if with_seq:
        groups.append({"group_name": "seq", "group_type": "sequence", "feature_names": ["b", "s"]})
    if name == "wide_and_deep":
        groups.append({"group_name": "wide", "group_type": "wide", "feature_names": ["a"]})
    if name in ("deepfm", "dlrm"):
        groups[0]["feature_names"].append("s")
    c = config_dict(feature_configs=SAME_DIM)
    c["model"] = {"feature_groups": groups, name: block}
    return config_from_dict(c)


def inputs(batch=5, seq=3):
    g = torch.Generator().manual_seed(0)
    emb = {
        "a": torch.randn(batch, 4, generator=g),
        "b": torch.randn(batch, 4, generator=g),
        "s": torch.randn(batch, seq, 4, generator=g),
    }
    lengths = {"s": torch.tensor([3, 0, 1, 2, 3][:batch])}
    return emb, lengths, {"x": torch.randn(batch, generator=g)}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_forward_backward(name):
    model = build_model(model_config(name))
    emb, lengths, dense = inputs()
    for v in emb.values():
        v.requires_grad_(True)
    out = model(emb, lengths, dense)
    assert out.shape == (5,) and torch.isfinite(out).all()
    out.sum().backward()
    assert emb["a"].grad is not None and any(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("pooling", ["attention", "mean"])
def test_din_attention_ignores_padding(pooling):
    torch.manual_seed(0)
    att = DINAttention(4, [8], pooling)
    q, k = torch.randn(2, 4), torch.randn(2, 3, 4)
    lengths = torch.tensor([2, 0])
    out = att(q, k, lengths)
    padded = torch.cat([k, torch.randn(2, 4, 4)], dim=1)  # garbage past the lengths
    torch.testing.assert_close(att(q, padded, lengths), out)
    assert torch.equal(out[1], torch.zeros(4))  # an empty history reads zeros
    if pooling == "mean":
        torch.testing.assert_close(out[0], k[0, :2].mean(0))


def test_sequence_group_dims_must_match():
    c = config_dict()
    c["model"]["feature_groups"][2]["feature_names"] = ["item_id", "hist_item_id", "hist_cate_id"]
    with pytest.raises(ValueError, match="query dims add up to 8 but sequence dims to 12"):
        build_model(config_from_dict(c))
