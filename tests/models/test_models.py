"""Every model in the registry builds from a config and trains; DIN attention ignores padding."""

import pytest
import torch

from dynarec.config import config_from_dict
from dynarec.config.schema import CANDIDATE_KEYS
from dynarec.config.sid import SID_KEYS
from dynarec.models import MODELS, build_model
from dynarec.models.blocks import DINAttention
from dynarec.models.tasks import Tasks, no_logits, tasks_of
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

TASK_TOWERS = [  # a click task and a conversion task inside the clicks' space
    {"tower_name": "ctr", "label_name": "label", "hidden_units": [4]},
    {
        "tower_name": "cvr",
        "label_name": "label2",
        "hidden_units": [4],
        "task_space_indicator_label": "label",
        "out_task_space_weight": 0.0,
    },
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
    "dcn": ({"cross_num": 2, "deep_hidden_units": [8], "final_hidden_units": [4]}, False),
    "dcn_v2": (
        {
            "backbone_hidden_units": [8],
            "cross_num": 2,
            "low_rank": 3,
            "deep_hidden_units": [8],
            "final_hidden_units": [4],
        },
        False,
    ),
    "xdeepfm": ({"cin_layer_size": [3, 2], "deep_hidden_units": [8], "final_hidden_units": [4]}, False),
    "mask_net": (
        {"n_mask_blocks": 2, "mask_block": {"hidden_dim": 6, "reduction_ratio": 0.5}, "top_hidden_units": [4]},
        False,
    ),
    "wukong": (
        {
            "dense_hidden_units": [4],
            "wukong_layers": [{"lcb_feature_num": 2, "fmb_feature_num": 2, "feature_num_hidden_units": [8]}],
            "final_hidden_units": [4],
        },
        False,
    ),
    "rocket_launching": ({"booster_hidden_units": [8, 4], "light_hidden_units": [4]}, False),
    "simple_multi_task": ({"task_towers": TASK_TOWERS}, False),
    "mmoe": (
        {"expert_hidden_units": [8], "num_expert": 2, "gate_hidden_units": [4], "task_towers": TASK_TOWERS},
        False,
    ),
    "ple": (
        {
            "extraction_networks": [
                {
                    "share_num": 1,
                    "expert_num_per_task": 2,
                    "share_expert_hidden_units": [8],
                    "task_expert_hidden_units": [8],
                },
                {
                    "share_num": 2,
                    "expert_num_per_task": 1,
                    "share_expert_hidden_units": [6],
                    "task_expert_hidden_units": [6],
                },
            ],
            "task_towers": TASK_TOWERS,
        },
        False,
    ),
    "dbmtl": (
        {
            "mask_net": {"n_mask_blocks": 2, "mask_block": {"hidden_dim": 6}, "top_hidden_units": [8]},
            "bottom_hidden_units": [8],
            "expert_hidden_units": [6],
            "num_expert": 2,
            "task_towers": [
                TASK_TOWERS[0],
                {**TASK_TOWERS[1], "relation_tower_names": ["ctr"], "relation_hidden_units": [4]},
            ],
        },
        False,
    ),
}
MODEL_BLOCKS["dssm"] = (
    {
        "user_tower": {"input": "deep", "hidden_units": [8]},
        "item_tower": {"input": "item", "hidden_units": [8], "use_bn": True},
        "output_dim": 3,
        "in_batch_negative": True,
    },
    False,
)
MODEL_BLOCKS["dat"] = (
    {
        "user_tower": {"input": "deep", "augment_input": "user_aug", "hidden_units": [8]},
        "item_tower": {"input": "item", "augment_input": "item_aug", "hidden_units": [8]},
        "output_dim": 4,
        "in_batch_negative": True,
        "similarity": "cosine",
    },
    False,
)
MODEL_BLOCKS["mind"] = (
    {
        "user_tower": {
            "input": "deep",
            "history_input": "seq",
            "hidden_units": [8, 6],
            "use_bn": True,
            "hist_seq_mlp": {"hidden_units": [8, 5], "use_bn": True, "bias": False},
            "capsule": {"max_k": 3, "max_seq_len": 4, "high_dim": 6, "squash_pow": 0.2},
            "concat_mlp": {"hidden_units": [8], "bias": False, "dropout_ratio": [0.1]},
        },
        "item_tower": {"input": "item", "hidden_units": [8], "dropout_ratio": [0.1]},
        "output_dim": 4,
        "in_batch_negative": True,
        "simi_pow": 20,
    },
    True,
)
MODEL_BLOCKS["pepnet"] = (
    {
        "main_input": "deep",
        "domain_input": "dom",
        "uia_input": "uia",
        "epnet_hidden_unit": 5,
        "ppnet_hidden_units": [6, 4],
        "ppnet_dropout_ratio": [0.1],
        "task_towers": TASK_TOWERS,
    },
    False,
)
MODEL_BLOCKS["sid_rqvae"] = ({"codebook": [4, 3], "embed_dim": 4, "hidden_dims": [6]}, False)
MODEL_BLOCKS["sid_rqkmeans"] = ({"codebook": [4, 3]}, False)
MODEL_BLOCKS["tdm"] = (
    {"multiwindow_din": {"windows_len": [1, 2]}, "final_hidden_units": [8], "final_batch_norm": True},
    True,
)
MULTI_TASK = ("simple_multi_task", "mmoe", "ple", "dbmtl", "pepnet")
# The models scoring rows; those scoring each row's candidates (dlrm_hstu: other groups, a label a
# candidate, no export yet; hstu_match: a query a candidate) are tested in their own files
# (tests/models/test_dlrm_hstu.py, tests/models/test_hstu_match.py).
ROW_MODELS = sorted(set(MODELS) - set(CANDIDATE_KEYS) - {"hstu_match"})
# a row's width: dssm [user | item] of 3 each; dat [user | item | user augment | item augment] of
# 4 each; mind [user | item | 3 interests] of 4 each
RETRIEVAL_WIDTH = {"dssm": 6, "dat": 16, "mind": 20}


def model_config(name):
    block, with_seq = MODEL_BLOCKS[name]
    groups = [{"group_name": "deep", "feature_names": ["a", "b", "x"]}]
    if with_seq:
        groups.append({"group_name": "seq", "group_type": "sequence", "feature_names": ["b", "s"]})
    if name == "wide_and_deep":
        groups.append({"group_name": "wide", "group_type": "wide", "feature_names": ["a"]})
    if name in ("deepfm", "dlrm"):
        groups[0]["feature_names"].append("s")
    if name == "xdeepfm":
        groups.append({"group_name": "wide", "group_type": "wide", "feature_names": ["a", "b"]})
    if name == "wukong":  # one width of fields, the dense features apart
        groups = [
            {"group_name": "sparse", "feature_names": ["a", "b", "s"]},
            {"group_name": "dense", "feature_names": ["x"]},
        ]
    if name in ("dssm", "dat", "mind"):  # a user and an item group (dat: and their augmented vectors, 4 wide)
        groups = [
            {"group_name": "deep", "feature_names": ["a", "x"]},
            {"group_name": "item", "feature_names": ["b", "s"]},
            {"group_name": "user_aug", "feature_names": ["a"]},
            {"group_name": "item_aug", "feature_names": ["b"]},
        ]
        if name == "mind":  # and the user's history
            groups[1]["feature_names"] = ["b"]
            groups[2:] = [{"group_name": "seq", "group_type": "sequence", "feature_names": ["s"]}]
    if name == "pepnet":  # its domain and user-item-author groups
        groups += [{"group_name": "dom", "feature_names": ["b"]}, {"group_name": "uia", "feature_names": ["a"]}]
    c = config_dict(feature_configs=SAME_DIM)
    c["model"] = {"feature_groups": groups, name: block}
    if name == "tdm":  # its tree (read when batches are built)
        c["data"]["tdm_sampler"] = {
            "item_input_path": "tree/node_table.txt",
            "edge_input_path": "tree/edge_table.txt",
            "item_id_field": "b",
            "layer_num_sample": [0, 1],
        }
    if name in MULTI_TASK or name in SID_KEYS:  # their task towers name their labels; semantic ids read none
        del c["data"]["label_field"]
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


@pytest.mark.parametrize("name", ROW_MODELS)
def test_model_forward_backward(name):
    model = build_model(model_config(name))
    emb, lengths, dense = inputs()
    for v in emb.values():
        v.requires_grad_(True)
    out = model(emb, lengths, dense)
    if name == "tdm":  # the windows of the sequence and the query: (2 + 1) x 4, the deep group 9
        assert model.multiwindow.out_dim == 12
    shape = (5, 2) if name in MULTI_TASK else (5, RETRIEVAL_WIDTH[name]) if name in RETRIEVAL_WIDTH else (5,)
    if name in SID_KEYS:  # codes (2 layers), x_hat and x (9 wide: a, b, x), rqvae's z and latents (4; 2 x 4)
        shape = (5, 2 + 9 + 9 + (4 + 8 if name == "sid_rqvae" else 0))
    assert out.shape == shape and torch.isfinite(out).all()
    teaching = getattr(model, "teaching", None)  # RocketLaunching: the booster trains the embeddings
    (out.sum() + (teaching.booster_logits.sum() if teaching is not None else 0)).backward()
    assert emb["a"].grad is not None and any(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", ROW_MODELS)
def test_outputs_of_no_rows_have_each_outputs_shape_and_type(name):
    """predict over input of no rows writes each output column in the type rows would have (a
    row of classes, an embedding, codes): the head's outputs of ``no_logits`` are those of a
    real output's rows, none of them."""
    config = model_config(name)
    model, tasks = build_model(config), tasks_of(config)
    with torch.no_grad():
        out = model(*inputs())
    assert (out.shape[1] if out.dim() > 1 else 1) == tasks.logits_width
    heads = [tasks.served]
    if isinstance(tasks, Tasks):
        heads.append(tasks.predictions)
    for head in heads:
        rows, none = head(out), head(no_logits(tasks))
        assert rows.keys() == none.keys()
        for k in rows:
            assert none[k].shape == (0, *rows[k].shape[1:]) and none[k].dtype == rows[k].dtype, k


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


def test_a_sequence_groups_query_may_be_narrower_than_its_sequence_not_wider():
    c = config_dict()
    c["model"]["feature_groups"][2]["feature_names"] = ["item_id", "hist_item_id", "hist_cate_id"]
    build_model(config_from_dict(c))  # query 8 wide, zero-padded to the sequence's 12
    c["model"]["feature_groups"][2]["feature_names"] = ["item_id", "cate_id", "hist_cate_id"]
    with pytest.raises(ValueError, match="'seq': query widths add up to 12 but sequence widths to 4"):
        build_model(config_from_dict(c))


def test_autodis_is_torcheasyrecs_formula():
    """AutoDis of one number a row against TorchEasyRec's einsum form (n = 1 feature)."""
    from dynarec.models.features import AutoDisEmbedding

    torch.manual_seed(0)
    m = AutoDisEmbedding(dim=6, num_channels=3, temperature=0.1, keep_prob=0.8)
    x = torch.tensor([0.5, -1.0, 2.0])
    w, mm, meta = m.proj_w[None], m.proj_m[None], m.meta[None]  # [n=1, ...]
    hidden = torch.nn.functional.leaky_relu(torch.einsum("nc,bn->bnc", w, x[:, None]))
    x_bar = torch.einsum("nij,bnj->bni", mm, hidden) + 0.8 * hidden
    want = torch.einsum("ncd,bnc->bnd", meta, torch.softmax(x_bar / 0.1, dim=-1)).reshape(3, 6)
    torch.testing.assert_close(m(x), want)


def test_mlp_embedding_is_a_linear_map_without_bias():
    from dynarec.models.features import MLPEmbedding

    torch.manual_seed(0)
    m = MLPEmbedding(dim=5, value_dim=4)
    x = torch.randn(3, 4)
    torch.testing.assert_close(m(x), x @ m.proj_w)
    one = MLPEmbedding(dim=5, value_dim=1)
    torch.testing.assert_close(one(torch.tensor([2.0])), 2.0 * one.proj_w)


def test_dice_gates_between_x_and_alpha_x_and_uses_running_statistics_in_eval():
    from dynarec.models.blocks import Dice

    torch.manual_seed(0)
    d = Dice(4)
    with torch.no_grad():
        d.alpha.fill_(0.25)
    x = torch.randn(16, 4)
    p = torch.sigmoid((x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + d.bn.eps))
    torch.testing.assert_close(d(x), p * x + (1 - p) * 0.25 * x)
    seq = torch.randn(3, 5, 4)  # [B, L, units]: statistics over every row and position
    flat = seq.reshape(-1, 4)
    p3 = torch.sigmoid((flat - flat.mean(0)) / torch.sqrt(flat.var(0, unbiased=False) + d.bn.eps)).reshape(3, 5, 4)
    torch.testing.assert_close(d(seq), p3 * seq + (1 - p3) * 0.25 * seq)
    d.eval()
    one, many = d(x[:1]), d(x)[:1]
    torch.testing.assert_close(one, many)  # eval: a row's output depends on that row alone


def test_towers_and_attention_take_dice():
    c = model_config("multi_tower_din").model_dump(mode="json")
    c["model"]["multi_tower_din"]["towers"][0]["activation"] = "dice"
    c["model"]["multi_tower_din"]["din_towers"][0]["activation"] = "dice"
    model = build_model(config_from_dict(c))
    from dynarec.models.blocks import Dice

    assert sum(isinstance(m, Dice) for m in model.modules()) == 2
    emb, lengths, dense = inputs()
    assert torch.isfinite(model(emb, lengths, dense)).all()


def test_interaction_layers_by_hand():
    from dynarec.models.interaction import CIN, Cross, CrossV2

    torch.manual_seed(0)
    x = torch.randn(3, 5)
    cross = Cross(5, 2)
    want = x
    for w, b in zip(cross.w, cross.b):
        want = (want @ w.weight.T) * x + b + want
    torch.testing.assert_close(cross(x), want)
    v2 = CrossV2(5, 2, 2)
    want = x
    for u, v in zip(v2.u, v2.v):
        want = x * v(u(want)) + want
    torch.testing.assert_close(v2(x), want)
    fields = torch.randn(3, 4, 2)  # [B, F, D]
    cin = CIN(4, [3])
    conv = cin.layers[0]
    z = (fields[:, :, None, :] * fields[:, None, :, :]).reshape(3, 16, 2)  # every pair of rows
    want = (torch.einsum("oc,bcd->bod", conv.weight[:, :, 0], z) + conv.bias[None, :, None]).sum(2)
    torch.testing.assert_close(cin(fields), want)
