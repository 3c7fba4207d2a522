"""Sequence encoders against plain per-row references (TorchEasyRec's formulas), and deep groups
that nest sequence groups: their width, their errors, every model that takes them."""

import pytest
import torch

from dynarec.config import ConfigError, config_from_dict
from dynarec.models import build_model
from dynarec.models.blocks import DeepGroup
from dynarec.models.features import FeatureInputs
from dynarec.models.mlp import MLP
from dynarec.models.sequence import DINAttention, SequencePooling, SimpleAttention
from tests.models.test_models import MODEL_BLOCKS, MULTI_TASK, SAME_DIM, inputs
from tests.pipeline_fixtures import config_dict

LENGTHS = torch.tensor([3, 0, 1, 2])


def rows(seed=0, dq=4, d=6, length=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, dq, generator=g), torch.randn(4, length, d, generator=g)


def test_din_attention_zero_pads_a_narrower_query():
    """TorchEasyRec's DINEncoder: a query of width 4 under a sequence of width 6 is padded with
    zeros; the scores are softmaxed over each row's valid positions only."""
    torch.manual_seed(0)
    att = DINAttention(6, [5])
    q, k = rows()
    out = att(q, k, LENGTHS)
    for b, n in enumerate(LENGTHS.tolist()):
        if n == 0:
            assert torch.equal(out[b], torch.zeros(6))
            continue
        qq = torch.cat([q[b], torch.zeros(2)]).expand(n, 6)
        kk = k[b, :n]
        w = torch.softmax(att.score(torch.cat([qq, kk, qq - kk, qq * kk], dim=1)).squeeze(1), dim=0)
        torch.testing.assert_close(out[b], w @ kk)


@pytest.mark.parametrize("activation", ["relu", "dice"])
def test_din_attention_scores_and_their_gradients_are_the_plain_mlp_on_q_k_q_minus_k_q_times_k(activation):
    """The score MLP's first layer is computed factored (once a row for the query's part): its
    scores and every parameter's gradient equal the plain MLP on the concatenated input's."""
    torch.manual_seed(0)
    att = DINAttention(6, [5, 3], activation=activation)
    q, k = rows(dq=6)
    plain = att.score(torch.cat([q[:, None].expand_as(k), k, q[:, None] - k, q[:, None] * k], dim=-1)).squeeze(-1)
    factored = att._scores(q, k)
    torch.testing.assert_close(factored, plain)
    weights = torch.randn_like(plain)
    want = torch.autograd.grad((plain * weights).sum(), list(att.parameters()))
    got = torch.autograd.grad((att._scores(q, k) * weights).sum(), list(att.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_simple_attention_is_a_softmax_of_dot_products():
    q, k = rows(dq=6)
    out = SimpleAttention()(q, k, LENGTHS)
    for b, n in enumerate(LENGTHS.tolist()):
        want = torch.softmax(k[b, :n] @ q[b], dim=0) @ k[b, :n] if n else torch.zeros(6)
        torch.testing.assert_close(out[b], want)


@pytest.mark.parametrize("pooling_type", ["mean", "sum"])
def test_pooling_reads_the_valid_positions_only(pooling_type):
    _, k = rows()
    garbage = torch.cat([k, torch.full((4, 2, 6), 1e6)], dim=1)
    out = SequencePooling(pooling_type)(None, garbage, LENGTHS)
    for b, n in enumerate(LENGTHS.tolist()):
        s = k[b, :n].sum(0)
        torch.testing.assert_close(out[b], s / max(n, 1) if pooling_type == "mean" else s)


def nested_config(encoders, seq_features=("a", "x", "s"), model="mmoe"):
    """SAME_DIM's features: a deep group ``deep`` of ``a, b, x`` nesting the sequence group
    ``hist`` (``seq_features``) read by ``encoders``."""
    name = model if model in MODEL_BLOCKS else "mmoe"
    raw = config_dict(feature_configs=SAME_DIM)
    block, _ = MODEL_BLOCKS[name]
    group = {
        "group_name": "deep",
        "feature_names": ["a", "b", "x"],
        "sequence_groups": [{"group_name": "hist", "feature_names": list(seq_features)}],
        "sequence_encoders": encoders,
    }
    raw["model"] = {"feature_groups": [group], name: block}
    if name in MULTI_TASK:
        del raw["data"]["label_field"]
    return raw


DIN = {"din_encoder": {"attn_hidden_units": [8]}}


@pytest.mark.parametrize(
    "encoders",
    [[DIN], [{"simple_attention": {}}], [{"pooling_encoder": {"pooling_type": "sum"}}], [DIN, {"pooling_encoder": {}}]],
)
def test_a_deep_group_appends_its_encoders_outputs(encoders):
    """``deep`` is ``[a, b, x]`` (9 wide) and one ``[B, 4]`` per encoder over ``hist`` (query
    ``a``, sequence ``s``), each equal to the encoder applied to the group's tensors."""
    config = config_from_dict(nested_config(encoders, seq_features=("a", "s")))
    inputs_ = FeatureInputs(config)
    group = DeepGroup(config, config.model.feature_groups[0], inputs_)
    assert group.out_dim == 9 + 4 * len(encoders)
    emb, lengths, dense = inputs()
    out = group(emb, lengths, dense)
    assert out.shape == (5, 9 + 4 * len(encoders))
    torch.testing.assert_close(out[:, :4], emb["a"])
    for i, encoder in enumerate(group.encoders):
        torch.testing.assert_close(out[:, 9 + 4 * i : 13 + 4 * i], encoder(emb["a"], emb["s"], lengths["s"]))


@pytest.mark.parametrize("name", ["mmoe", "ple", "dbmtl", "simple_multi_task", "dcn_v2", "mask_net", "multi_tower_din"])
def test_models_reading_a_deep_group_take_its_sequence_encoders(name):
    raw = nested_config([DIN], seq_features=("a", "s"), model=name)
    if name == "multi_tower_din":
        raw["model"]["multi_tower_din"] = {"towers": [{"input": "deep", "hidden_units": [8]}]}
    model = build_model(config_from_dict(raw))
    emb, lengths, dense = inputs()
    for v in emb.values():
        v.requires_grad_(True)
    out = model(emb, lengths, dense)
    out.sum().backward()
    assert emb["s"].grad is not None and emb["s"].grad[0].abs().sum() > 0  # the history reaches the loss
    assert torch.equal(emb["s"].grad[1], torch.zeros(3, 4))  # an empty history reads nothing


@pytest.mark.parametrize("name", ["deepfm", "dlrm", "xdeepfm", "wukong"])
def test_field_wise_models_refuse_sequence_groups(name):
    raw = nested_config([DIN], seq_features=("a", "s"), model=name)
    with pytest.raises(ConfigError, match=rf"{name}: reads its groups feature by feature .* \['deep'\]"):
        config_from_dict(raw)


@pytest.mark.parametrize(
    "change, error",
    [
        (lambda g: g.update(sequence_encoders=[]), r"sequence_groups: no sequence_encoders entry reads them"),
        (
            lambda g: g["sequence_encoders"].append({"din_encoder": {"input": "other"}}),
            r"sequence_encoders\[1\]: input 'other' names no sequence group; groups: \['hist'\]",
        ),
        (
            lambda g: g["sequence_groups"].append({"group_name": "h2", "feature_names": ["b", "s"]}),
            r"sequence_encoders\[0\]: give input, the sequence group to encode \(of \['hist', 'h2'\]\)",
        ),
        (
            lambda g: g["sequence_groups"][0]["feature_names"].append("nope"),
            r"model.feature_groups\[0\].sequence_groups\[0\].feature_names\[2\]: unknown feature 'nope'",
        ),
        (
            lambda g: g["sequence_groups"][0].update(group_name="deep"),
            r"duplicate group_name in \['deep', 'deep'\] \(sequence_groups included\)",
        ),
        (
            lambda g: g.update(group_type="wide"),
            r"sequence_groups and sequence_encoders belong to a deep group",
        ),
        (
            lambda g: g["sequence_encoders"].append({"din_encoder": {}, "pooling_encoder": {}}),
            r"give exactly one of \['din_encoder', 'simple_attention', 'pooling_encoder'\]",
        ),
    ],
)
def test_a_bad_nested_sequence_group_is_an_error_by_path(change, error):
    raw = nested_config([DIN], seq_features=("a", "s"))
    change(raw["model"]["feature_groups"][0])
    with pytest.raises(ConfigError, match=error):
        config_from_dict(raw)


def test_a_query_wider_than_the_sequence_is_refused_naming_the_group():
    raw = nested_config([DIN], seq_features=("a", "b", "s"))  # query 8 wide, sequence 4
    with pytest.raises(ValueError, match=r"'deep' sequence_encoders\[0\] \(input 'hist'\): query widths add up to 8"):
        build_model(config_from_dict(raw))


def test_simple_attention_needs_a_query_as_wide_as_the_sequence():
    raw = nested_config([{"simple_attention": {}}], seq_features=("x", "s"))  # query 1 wide
    with pytest.raises(ValueError, match=r"simple_attention takes a query as wide as the sequence"):
        build_model(config_from_dict(raw))


def test_pooling_needs_no_query():
    config = config_from_dict(nested_config([{"pooling_encoder": {}}], seq_features=("s",)))
    emb, lengths, dense = inputs()
    assert build_model(config)(emb, lengths, dense).shape == (5, 2)


@pytest.mark.parametrize("dropout, layers", [([], 0), ([0.5], 2), ([0.0, 0.3], 1)])
def test_mlp_dropout_follows_each_layer_given_a_ratio(dropout, layers):
    mlp = MLP(4, [8, 8], dropout=dropout)
    assert sum(isinstance(m, torch.nn.Dropout) for m in mlp) == layers
    x = torch.randn(16, 4)
    mlp.eval()
    torch.testing.assert_close(mlp(x), mlp(x))  # off in eval


def test_dropout_ratios_must_be_one_or_one_per_layer():
    raw = nested_config([DIN], seq_features=("a", "s"))
    raw["model"]["mmoe"] = {**raw["model"]["mmoe"], "expert_dropout_ratio": [0.1, 0.2]}
    with pytest.raises(ConfigError, match=r"expert_dropout_ratio: 2 ratios for the 1 layers of expert_hidden_units"):
        config_from_dict(raw)
