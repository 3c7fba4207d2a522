"""`dynarec import-config` of TorchEasyRec's DlrmHSTU (``dlrm_hstu``): the vendored kuairand
configs convert to dynarec's ``dlrm_hstu`` block (dynarec/config/hstu.py), and every field
dynarec cannot carry is refused by its path (configs written by editing the vendored ones)."""

import re
from pathlib import Path

import pytest

from dynarec.config import config_from_dict
from dynarec.config.tzrec import ConversionError, convert_pipeline_config

TESTS = Path(__file__).parent / "tzrec" / "tests"
RTP = (TESTS / "dlrm_hstu_rtp_kuairand_1k.config").read_text()
HSTU = "model_config.dlrm_hstu"


def convert(text: str, **kw):
    return convert_pipeline_config(text, train_input_path="d/train", eval_input_path="d/eval", **kw)


def edit(old: str, new: str, text: str = RTP) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def refusal(text: str, **kw) -> str:
    with pytest.raises(ConversionError) as e:
        convert(text, **kw)
    return str(e.value)


def test_the_rtp_config_converts_to_dlrm_hstu():
    result = convert(RTP)
    assert not result.dropped
    config = config_from_dict(result.config)
    assert config.model.name == "dlrm_hstu"
    cfg = config.model.dlrm_hstu
    assert cfg is not None
    assert (cfg.max_seq_len, cfg.item_embedding_hidden_dim) == (4096, 512)
    hstu = cfg.hstu
    stu = hstu.stu
    assert (stu.embedding_dim, stu.num_heads, stu.hidden_dim, stu.attention_dim) == (512, 4, 128, 128)
    assert stu.output_dropout_ratio == 0.1 and stu.use_group_norm and stu.attn_alpha is None
    assert stu.max_attn_len == 0
    assert (hstu.attn_num_layers, hstu.input_dropout_ratio) == (3, 0.2)
    pe = hstu.positional_encoder
    assert (pe.num_position_buckets, pe.num_time_buckets, pe.use_time_encoding) == (8192, 2048, True)
    assert (pe.time_bucket_fn, pe.time_bucket_increments) == ("sqrt", 60.0)
    assert hstu.content_mlp_hidden_dim == 256 and hstu.action_mlp_hidden_dim == 256
    assert hstu.action_encoder is not None
    assert hstu.action_encoder.action_embedding_dim == 8
    assert hstu.action_encoder.action_weights == [1, 2, 4, 8, 16, 32, 64, 128]
    post = hstu.postprocessor
    assert post.kind == "timestamp_layernorm"
    assert post.time_duration_period_units == [3600, 86400] and post.time_duration_units_per_period == [24, 7]
    assert cfg.fusion_hidden_units == [512] and cfg.fusion_activation == "silu" and cfg.fusion_layer_norm
    towers = cfg.task_towers
    assert len(towers) == 8
    assert [t.task_bitmask for t in towers] == [1, 2, 4, 8, 16, 32, 64, 128]
    assert [t.tower_name for t in towers][:3] == ["is_click", "is_like", "is_follow"]
    assert {t.label_name for t in towers} == {"cand_seq_action_weight"}
    assert all(t.kind == "binary" and t.metrics == ["auc"] and t.weight == 1.0 for t in towers)
    # the groups keep TorchEasyRec's names (JAGGED_SEQUENCE -> sequence); the labels are lists
    assert [g.group_name for g in config.model.feature_groups] == [
        "contextual",
        "uih",
        "candidate",
        "uih_action",
        "uih_watchtime",
        "uih_timestamp",
        "candidate_timestamp",
    ]
    assert config.model.group("uih").group_type == "sequence"
    assert config.candidate_feature() == "cand_seq_video_id"
    assert config.data.label_field is None and config.label_fields() == ["cand_seq_action_weight"]
    notes = "\n".join(result.notes)
    # a label no task reads is dropped with a note
    assert "data_config.label_fields: ['cand_seq_watch_time']: read by no task tower" in notes
    assert f"{HSTU}.fusion_mtl_tower.mlp.activation: nn.SiLU on every layer" in notes


def test_the_cli_writes_a_config_that_loads(tmp_path):
    from dynarec.cli import main
    from dynarec.config import load_config

    source = tmp_path / "rtp.config"
    source.write_text(RTP)
    out = tmp_path / "rtp.yaml"
    main(["import-config", str(source), "--output", str(out), "--train-input-path", "x", "--eval-input-path", "y"])
    assert load_config(out).model.name == "dlrm_hstu"


@pytest.mark.parametrize("name", ["dlrm_hstu_kuairand_1k", "dlrm_hstu_cutlass_kuairand_1k"])
def test_the_fp16_jrc_and_watchtime_configs_convert(name):
    result = convert((TESTS / f"{name}.config").read_text())
    config = config_from_dict(result.config)
    cfg = config.model.dlrm_hstu
    assert cfg is not None and len(cfg.task_towers) == 9
    like = cfg.task_towers[1]
    assert like.tower_name == "is_like" and like.num_class == 2 and like.task_bitmask == 2
    assert like.losses[0].kind == "jrc_loss" and like.losses[0].settings.session_name == "user_id"
    assert like.metrics == ["grouped_auc"] and config.eval.grouped_auc_field == "user_id"
    watch = cfg.task_towers[-1]
    assert watch.kind == "regression" and watch.task_bitmask is None and watch.metrics == ["mean_absolute_error"]
    assert config.label_fields() == ["cand_seq__action_weight", "cand_seq__watch_time"]
    assert config.train.mixed_precision == "bf16"
    assert config.feature("cand_seq__video_id").data_type == "fp16"
    kernel = "CUTLASS" if "cutlass" in name else "TRITON"
    assert any(
        n.startswith(f"model_config.kernel: {kernel}: dynarec computes TorchEasyRec's PyTorch reference formulas")
        for n in result.notes
    )


def test_defaults_and_settings_with_no_effect_on_the_numbers_are_accepted():
    text = edit("max_seq_len: 4096", "max_seq_len: 4096 enable_global_average_loss: true item_embedding_hidden_dim: 64")
    text = edit(
        "use_group_norm: true",
        "use_group_norm: true recompute_uvqk: false recompute_y: false recompute_normed_x: false "
        "sort_by_length: false contextual_seq_len: 6 scaling_seqlen: -1 attn_alpha: 0.5 max_attn_len: 16",
        text,
    )
    text = edit("action_embedding_dim: 8", "action_embedding_dim: 8 embedding_init_std: 0.02", text)
    text = edit(
        "use_time_encoding: true", "use_time_encoding: true time_bucket_fn: 'log' time_bucket_increments: 30", text
    )
    result = convert(text)
    cfg = config_from_dict(result.config).model.dlrm_hstu
    assert cfg is not None and cfg.item_embedding_hidden_dim == 64
    assert cfg.hstu.stu.attn_alpha == 0.5 and cfg.hstu.stu.max_attn_len == 16
    assert cfg.hstu.positional_encoder.time_bucket_fn == "log"
    assert cfg.hstu.positional_encoder.time_bucket_increments == 30
    notes = "\n".join(result.notes)
    for key in ("recompute_uvqk", "recompute_y", "recompute_normed_x", "sort_by_length"):
        assert f"{HSTU}.hstu.stu.{key}: ignored" in notes
    assert f"{HSTU}.hstu.stu.contextual_seq_len: 6: the contextual group's feature count" in notes
    assert (
        f"{HSTU}.hstu.input_preprocessor.contextual_preprocessor.action_encoder.simple_action_encoder."
        "embedding_init_std: ignored (TorchEasyRec's action encoder initializes its embeddings with std 0.1" in notes
    )


def test_other_postprocessors_and_activations():
    text = re.sub(
        r"timestamp_layernorm_postprocessor \{[^}]*\}", "l2norm_postprocessor {}", RTP.replace('"nn.SiLU"', '""')
    )
    cfg = config_from_dict(convert(text).config).model.dlrm_hstu
    assert cfg is not None
    assert cfg.hstu.postprocessor.kind == "l2norm" and cfg.fusion_activation == "none"
    text = re.sub(r"timestamp_layernorm_postprocessor \{[^}]*\}", "layernorm_postprocessor {}", RTP)
    text = edit('activation: "nn.SiLU"', "", text)
    cfg = config_from_dict(convert(text).config).model.dlrm_hstu
    assert cfg is not None
    assert cfg.hstu.postprocessor.kind == "layernorm" and cfg.fusion_activation == "relu"
    # a task's weight and num_class, and a single label field (dlrm_hstu's labels are its tasks')
    text = edit("task_bitmask: 128", "task_bitmask: 128 weight: 0.5", RTP)
    text = edit('label_fields: ["cand_seq_action_weight", "cand_seq_watch_time"]', 'label_fields: "x"', text)
    config = config_from_dict(convert(text).config)
    assert config.model.task_towers[-1].weight == 0.5 and config.data.label_field is None


P = f"{HSTU}.hstu"
PRE = f"{P}.input_preprocessor"
CP = f"{PRE}.contextual_preprocessor"
MLP = f"{HSTU}.fusion_mtl_tower.mlp"


@pytest.mark.parametrize(
    ("old", "new", "path"),
    [
        (
            "max_seq_len: 4096",
            "max_seq_len: 4096 enable_global_average_loss: false",
            f"{HSTU}.enable_global_average_loss",
        ),
        (
            "max_seq_len: 4096",
            "max_seq_len: 4096 sequence_timestamp_is_ascending: false",
            f"{HSTU}.sequence_timestamp_is_ascending",
        ),
        (
            "max_seq_len: 4096",
            "max_seq_len: 4096 concat_contextual_features: true",
            f"{HSTU}.concat_contextual_features",
        ),
        ("attn_num_layers: 3", "attn_num_layers: 3 attn_truncation_split_layer: 1", f"{P}.attn_truncation_split_layer"),
        ("attn_num_layers: 3", "attn_num_layers: 3 attn_truncation_tail_len: 64", f"{P}.attn_truncation_tail_len"),
        ("attn_num_layers: 3", 'attn_num_layers: 3 name: "uih_click"', f"{P}.name"),
        ("use_group_norm: true", "use_group_norm: true contextual_seq_len: 3", f"{P}.stu.contextual_seq_len"),
        ("use_group_norm: true", "use_group_norm: true scaling_seqlen: 4096", f"{P}.stu.scaling_seqlen"),
        ("use_group_norm: true", "use_group_norm: true sla_k1: 16", f"{P}.stu.sla_k1"),
        ("use_group_norm: true", "use_group_norm: true sla_k2: 16", f"{P}.stu.sla_k2"),
        ("use_group_norm: true", "use_group_norm: true attn_alpha: -1.0", f"{P}.stu.attn_alpha"),
        (
            "use_time_encoding: true",
            "use_time_encoding: true time_bucket_fn: 'cube'",
            f"{P}.positional_encoder.time_bucket_fn",
        ),
        ("num_time_buckets: 2048", "", f"{P}.positional_encoder.num_time_buckets"),
        (
            "contextual_preprocessor {",
            "contextual_interleave_preprocessor {",
            f"{PRE}.contextual_interleave_preprocessor: interleaved targets are not supported",
        ),
        ("contextual_preprocessor {", "uih_preprocessor {", f"{PRE}.uih_preprocessor: hstu_match's preprocessor"),
        ("slice_content_encoder {}", "pad_content_encoder {}", f"{CP}.content_encoder.pad_content_encoder"),
        (
            "slice_content_encoder {}",
            "mlp_content_encoder { uih_mlp { hidden_units: 8 } target_mlp { hidden_units: 8 } }",
            f"{CP}.content_encoder.mlp_content_encoder",
        ),
        (
            "action_embedding_dim: 8",
            "action_embedding_dim: 8 watchtime_to_action_thresholds: [60]",
            f"{CP}.action_encoder.simple_action_encoder.watchtime_to_action_thresholds",
        ),
        (
            "action_embedding_dim: 8",
            "action_embedding_dim: 8 watchtime_to_action_weights: [256]",
            f"{CP}.action_encoder.simple_action_encoder.watchtime_to_action_weights",
        ),
        ("use_ln: true", "use_ln: true use_bn: true", f"{MLP}.use_bn"),
        ("use_ln: true", "use_ln: true dropout_ratio: 0.1", f"{MLP}.dropout_ratio"),
        ("use_ln: true", "use_ln: true bias: false", f"{MLP}.bias"),
        ('activation: "nn.SiLU"', 'activation: "nn.Tanh"', f"{MLP}.activation: 'nn.Tanh' is not supported"),
        ("task_bitmask: 1\n", "task_bitmask: 0\n", f"{HSTU}.fusion_mtl_tower.task_configs[0].task_bitmask"),
        ("kernel: PYTORCH", "kernel: CUDA", "model_config.kernel: 'CUDA' is not supported"),
        (
            "    kernel: PYTORCH",
            "    losses { binary_cross_entropy {} }",
            "model_config.losses: dlrm_hstu's losses belong in",
        ),
        (
            'group_name: "uih_watchtime"',
            'group_name: "uih_extra"',
            "model_config.feature_groups: dlrm_hstu reads the groups",
        ),
        (
            "group_type: DEEP",
            "group_type: JAGGED_SEQUENCE",
            "model_config.feature_groups: dlrm_hstu's group 'contextual' must be a DEEP group",
        ),
        (
            'group_name: "uih_timestamp"',
            'group_name: "uih_stamps"',
            "model_config.feature_groups: dlrm_hstu needs a group named 'uih_timestamp'",
        ),
    ],
)
def test_what_dlrm_hstu_cannot_carry_is_refused_by_path(old, new, path):
    text = refusal(edit(old, new))
    assert f"\n  {path}" in text, text


@pytest.mark.parametrize(
    ("pattern", "new", "path"),
    [
        (r"content_mlp \{\s*simple_mlp", "content_mlp { parameterized_mlp", f"{CP}.content_mlp.parameterized_mlp"),
        (r"action_mlp \{\s*simple_mlp", "action_mlp { parameterized_mlp", f"{CP}.action_mlp.parameterized_mlp"),
        (
            r"action_mlp \{\s*simple_mlp \{\s*hidden_dim: 256\s*\}\s*\}",
            "",
            f"{CP}.action_mlp: action_encoder and action_mlp go together",
        ),
        (
            r"time_duration_units_per_period: \[24, 7\]",
            "time_duration_units_per_period: [24]",
            f"{P}.output_postprocessor.timestamp_layernorm_postprocessor: time_duration_period_units and",
        ),
        (
            r"output_postprocessor \{",
            "output_postprocessor { layernorm_postprocessor {}",
            f"{P}.output_postprocessor: give exactly one of",
        ),
    ],
)
def test_what_dlrm_hstu_cannot_carry_is_refused_by_path_in_blocks(pattern, new, path):
    changed, n = re.subn(pattern, new, RTP, count=1)
    assert n == 1
    text = refusal(changed)
    assert f"\n  {path}" in text, text


def test_lenient_cannot_drop_what_changes_the_model():
    text = refusal(edit("max_seq_len: 4096", "max_seq_len: 4096 concat_contextual_features: true"), lenient=True)
    assert "--lenient cannot drop" in text and f"{HSTU}.concat_contextual_features" in text


@pytest.mark.parametrize(
    ("name", "model", "why"),
    [
        ("ultra_hstu_cutlass_kuairand_1k", "ultra_hstu", "UltraHSTU's HSTU channels"),
        ("hstu_kuairand_1k", "hstu_match", "HSTU retrieval"),
    ],
)
def test_ultra_hstu_and_hstu_match_are_refused_with_their_reason(name, model, why):
    text = refusal((TESTS / f"{name}.config").read_text())
    assert f"\n  model_config.{model}: this model is not supported yet: {why}" in text, text
