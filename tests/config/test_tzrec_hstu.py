"""`dynarec import-config` of TorchEasyRec's generative rankers, DlrmHSTU (``dlrm_hstu``) and
UltraHSTU (``ultra_hstu``): the vendored kuairand configs convert to dynarec's blocks of those
names (dynarec/config/hstu.py), and every field dynarec cannot carry is refused by its path
(configs written by editing the vendored ones)."""

import re
from pathlib import Path

import pytest

from dynarec.config import config_from_dict
from dynarec.config.tzrec import ConversionError, convert_pipeline_config

TESTS = Path(__file__).parent / "tzrec" / "tests"
RTP = (TESTS / "dlrm_hstu_rtp_kuairand_1k.config").read_text()
ULTRA = (TESTS / "ultra_hstu_cutlass_kuairand_1k.config").read_text()
BENCHMARK = Path(__file__).parent / "tzrec" / "benchmark" / "kuairand" / "dlrm_hstu.config"
HSTU = "model_config.dlrm_hstu"
UH = "model_config.ultra_hstu"


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
            "max_seq_len: 4096 concat_contextual_features: true",
            f"{HSTU}.concat_contextual_features",
        ),
        # attention truncation: both fields above 0, the split below attn_num_layers (TorchEasyRec's rule)
        (
            "attn_num_layers: 3",
            "attn_num_layers: 3 attn_truncation_split_layer: 1",
            f"{P}.attn_truncation_split_layer: attn_truncation_split_layer 1, attn_truncation_tail_len 0: both 0",
        ),
        (
            "attn_num_layers: 3",
            "attn_num_layers: 3 attn_truncation_tail_len: 64",
            f"{P}.attn_truncation_tail_len: attn_truncation_split_layer 0, attn_truncation_tail_len 64: both 0",
        ),
        (
            "attn_num_layers: 3",
            "attn_num_layers: 3 attn_truncation_split_layer: 3 attn_truncation_tail_len: 64",
            f"{P}.attn_truncation_split_layer: attn_truncation_split_layer 3, attn_truncation_tail_len 64",
        ),
        # a named channel is UltraHSTU's
        ("attn_num_layers: 3", 'attn_num_layers: 3 name: "uih_click"', f"{P}.name: 'uih_click': a named channel"),
        ("use_group_norm: true", "use_group_norm: true contextual_seq_len: 3", f"{P}.stu.contextual_seq_len"),
        ("use_group_norm: true", "use_group_norm: true scaling_seqlen: 4096", f"{P}.stu.scaling_seqlen"),
        ("use_group_norm: true", "use_group_norm: true sla_k1: -1", f"{P}.stu.sla_k1: -1: must be 0 or above"),
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


def test_dlrm_hstu_maps_semi_local_attention_and_attention_truncation():
    text = edit("use_group_norm: true", "use_group_norm: true sla_k1: 16 sla_k2: 4")
    text = edit(
        "attn_num_layers: 3", "attn_num_layers: 3 attn_truncation_split_layer: 1 attn_truncation_tail_len: 64", text
    )
    cfg = config_from_dict(convert(text).config).model.dlrm_hstu
    assert cfg is not None
    assert (cfg.hstu.stu.sla_k1, cfg.hstu.stu.sla_k2) == (16, 4)
    assert (cfg.hstu.attn_truncation_split_layer, cfg.hstu.attn_truncation_tail_len) == (1, 64)
    # one side of semi-local attention alone is TorchEasyRec's too (the other 0: that side off)
    cfg = config_from_dict(
        convert(edit("use_group_norm: true", "use_group_norm: true sla_k2: 8")).config
    ).model.dlrm_hstu
    assert cfg is not None and (cfg.hstu.stu.sla_k1, cfg.hstu.stu.sla_k2) == (0, 8)
    # unset: off, and not written
    block = convert(RTP).config["model"]["dlrm_hstu"]["hstu"]
    assert "sla_k1" not in block["stu"] and "attn_truncation_split_layer" not in block
    # TorchEasyRec's Triton kernel has no semi-local mask: it refuses the pair
    text = refusal(
        edit("kernel: PYTORCH", "kernel: TRITON", edit("use_group_norm: true", "use_group_norm: true sla_k1: 16"))
    )
    assert "\n  model_config.kernel: TRITON with semi-local attention" in text, text


def test_the_ultra_hstu_config_converts_with_two_channels():
    result = convert(ULTRA)
    assert not result.dropped
    config = config_from_dict(result.config)
    assert config.model.name == "ultra_hstu"
    cfg = config.model.ultra_hstu
    assert cfg is not None
    assert (cfg.max_seq_len, cfg.item_embedding_hidden_dim) == (4096, 512)
    assert [c.name for c in cfg.hstu] == ["uih_click", "uih_view"]
    assert [c.history_group for c in cfg.channels] == ["uih_click", "uih_view"]
    for c in cfg.hstu:
        assert (c.stu.sla_k1, c.stu.sla_k2) == (256, 32)
        assert (c.attn_truncation_split_layer, c.attn_truncation_tail_len) == (2, 512)
        assert c.attn_num_layers == 4 and c.stu.embedding_dim == 512 and c.stu.use_group_norm
        assert c.action_encoder is not None and c.action_encoder.action_weights == [1, 2, 4, 8, 16, 32, 64, 128]
        assert c.content_mlp_hidden_dim == 256 and c.postprocessor.kind == "timestamp_layernorm"
    assert cfg.fusion_hidden_units == [512] and cfg.fusion_activation == "silu" and cfg.fusion_layer_norm
    assert len(cfg.task_towers) == 9 and cfg.task_towers[1].losses[0].kind == "jrc_loss"
    groups = [g.group_name for g in config.model.feature_groups]
    assert groups[1:5] == ["uih_click", "uih_click_action", "uih_click_watchtime", "uih_click_timestamp"]
    assert groups[5:9] == ["uih_view", "uih_view_action", "uih_view_watchtime", "uih_view_timestamp"]
    assert config.candidate_feature() == "cand_seq__video_id"
    assert config.label_fields() == ["cand_seq__action_weight", "cand_seq__watch_time"]
    notes = "\n".join(result.notes)
    assert f"{UH}.fusion_mtl_tower.mlp.activation: nn.SiLU on every layer" in notes
    assert "model_config.kernel: CUTLASS: dynarec computes" in notes


def test_one_unnamed_ultra_hstu_channel_reads_the_uih_groups():
    """UltraHSTU of one channel, unnamed: DlrmHSTU's groups (TorchEasyRec allows it)."""
    text = RTP.replace("dlrm_hstu {", "ultra_hstu {", 1)
    cfg = config_from_dict(convert(text).config).model.ultra_hstu
    assert cfg is not None and len(cfg.hstu) == 1 and cfg.hstu[0].history_group == "uih"


CH_VIEW = '\n            name: "uih_view"'  # the second channel's name (not the group's)


def ultra(old: str, new: str) -> str:
    assert old in ULTRA, old
    return ULTRA.replace(old, new, 1)


@pytest.mark.parametrize(
    ("text", "path"),
    [
        (ultra(CH_VIEW, ""), f"{UH}.hstu[1].name: with two or more hstu channels each needs a name"),
        (ultra(CH_VIEW, 'name: "uih_click"'), f"{UH}.hstu[1].name: 'uih_click': another channel"),
        (
            ultra('group_name: "uih_view_timestamp"', 'group_name: "uih_view_stamps"'),
            "model_config.feature_groups: ultra_hstu needs a group named 'uih_view_timestamp'",
        ),
        (
            ultra(CH_VIEW, 'name: "uih_other"'),
            "model_config.feature_groups: ultra_hstu needs a group named 'uih_other'",
        ),
        (
            ultra(CH_VIEW, 'name: "uih_other"'),
            "model_config.feature_groups: ultra_hstu reads the groups ['contextual', 'candidate', "
            "'candidate_timestamp', 'uih_click', 'uih_click_action', 'uih_click_watchtime', 'uih_click_timestamp', "
            "'uih_other', 'uih_other_action', 'uih_other_watchtime', 'uih_other_timestamp']; group 'uih_view' would "
            "be ignored by TorchEasyRec",
        ),
        (
            ultra("attn_truncation_split_layer: 2", "attn_truncation_split_layer: 4"),
            f"{UH}.hstu[0].attn_truncation_split_layer: attn_truncation_split_layer 4, attn_truncation_tail_len 512",
        ),
        (ultra("kernel: CUTLASS", "kernel: TRITON"), "model_config.kernel: TRITON with semi-local attention"),
        (
            re.sub(
                r"hstu \{\s*name: \"uih_click\".*?\n        \}\n        hstu \{\s*name: \"uih_view\".*?\n        \}\n",
                "",
                ULTRA,
                flags=re.S,
            ),
            f"{UH}.hstu: at least one hstu channel is needed",
        ),
        (
            ultra("    kernel: CUTLASS", "    metrics { auc {} }"),
            "model_config.metrics: ultra_hstu's metrics belong in its fusion_mtl_tower.task_configs",
        ),
    ],
)
def test_what_ultra_hstu_cannot_carry_is_refused_by_path(text, path):
    out = refusal(text)
    assert f"\n  {path}" in out, out


def test_the_benchmark_config_maps_a_missing_sequence_length_to_max_seq_len():
    """FG_NONE sequence_id_feature / sequence_raw_feature without sequence_length: TorchEasyRec
    truncates nothing (only pyfg reads it); dynarec keeps the model's max_seq_len."""
    result = convert(BENCHMARK.read_text())
    config = config_from_dict(result.config)
    assert config.model.name == "dlrm_hstu"
    sequences = ["video_id", "item_video_id", "action_timestamp", "item_query_time", "action_weight", "watch_time"]
    assert {n: config.feature(n).sequence_length for n in sequences} == dict.fromkeys(sequences, 8000)
    notes = "\n".join(result.notes)
    for i, kind in enumerate(["sequence_id_feature"] * 2 + ["sequence_raw_feature"] * 4):
        assert (
            f"feature_configs[{i}].{kind}.sequence_length: not given: 8000. TorchEasyRec does not truncate FG_NONE "
            "sequences; dynarec keeps each row's last 8000 elements, the model's max_seq_len" in notes
        )
    # a given sequence_length is kept, with a note that TorchEasyRec would read the whole sequence
    text = BENCHMARK.read_text().replace(
        'feature_name: "watch_time"', 'feature_name: "watch_time" sequence_length: 8000'
    )
    notes = [n for n in convert(text).notes if n.startswith("feature_configs[5]")]
    assert notes == [
        "feature_configs[5].sequence_raw_feature: FG_NONE: TorchEasyRec reads the whole sequence (only pyfg "
        "truncates by sequence_length); dynarec keeps its last 8000 elements"
    ], notes


def test_a_missing_sequence_length_is_refused_elsewhere():
    """Without FG_NONE (pyfg truncates by sequence_length), or outside a generative ranker."""
    text = BENCHMARK.read_text().replace("fg_mode: FG_NONE", "fg_mode: FG_DAG")
    text = re.sub(r'feature_name: "(\w+)"', r'feature_name: "\1" expression: "user:\1"', text)
    out = refusal(text)
    assert "\n  feature_configs[0].sequence_id_feature: dynarec's sequence_feature needs 'sequence_length'" in out
    din = (TESTS / "multi_tower_din_fg_mock.config").read_text().replace("fg_mode: FG_DAG", "fg_mode: FG_NONE")
    old = 'feature_name: "buy_50_user_id_seq"\n        sequence_length: 50'
    assert old in din
    out = refusal(din.replace(old, 'feature_name: "buy_50_user_id_seq"'))
    assert re.search(
        r"\n  feature_configs\[\d+\]\.sequence_id_feature: dynarec's sequence_feature needs 'sequence_length'", out
    )


def test_newest_first_histories_are_carried():
    """``sequence_timestamp_is_ascending: false`` (histories newest first) on DlrmHSTU and
    HSTUMatch: the same field (the models read each history in reverse)."""
    text = RTP.replace("max_seq_len: 4096", "max_seq_len: 4096 sequence_timestamp_is_ascending: false", 1)
    assert text != RTP
    assert config_from_dict(convert(text).config).model.dlrm_hstu.sequence_timestamp_is_ascending is False
    match = (TESTS / "hstu_kuairand_1k.config").read_text()
    text = match.replace("similarity: COSINE", "similarity: COSINE\n        sequence_timestamp_is_ascending: false")
    assert text != match
    assert config_from_dict(convert(text).config).model.hstu_match.sequence_timestamp_is_ascending is False


def test_the_hstu_match_config_converts():
    """TorchEasyRec's HSTUMatch on KuaiRand: the user tower's hstu as dlrm_hstu's with the
    uih_preprocessor's action encoder, the item tower's linear MLP, the first label read, the
    sampler's attr_fields named as the candidates' sub-feature."""
    result = convert((TESTS / "hstu_kuairand_1k.config").read_text())
    c = result.config
    block = c["model"]["hstu_match"]
    assert block["user_tower"]["input"] == "uih" and block["user_tower"]["max_seq_len"] == 4096
    hstu = block["user_tower"]["hstu"]
    assert hstu["action_mlp_hidden_dim"] == 64 and hstu["postprocessor"] == {"kind": "l2norm"}
    assert "content_mlp_hidden_dim" not in hstu
    assert block["item_tower"] == {"input": "candidate", "hidden_units": [32], "activation": "none"}
    assert (block["similarity"], block["temperature"], block["recall_at_k"]) == ("cosine", 0.05, [1, 5])
    assert c["data"]["label_field"] == "cand_seq__action_weight"
    sampler = c["data"]["negative_sampler"]
    assert sampler["attr_fields"] == ["cand_seq__video_id"] and sampler["item_id_field"] == "cand_seq__video_id"
    config = config_from_dict(c)
    assert config.candidate_feature() == "cand_seq__video_id"


@pytest.mark.parametrize(
    ("old", "new", "path"),
    [
        ("uih_preprocessor {", "contextual_preprocessor {", r"hstu_match\.user_tower\.hstu\.input_preprocessor"),
        ("softmax_cross_entropy {}", "binary_cross_entropy {}", r"model_config\.losses: \['binary_cross_entropy'\]"),
    ],
)
def test_what_hstu_match_cannot_carry_is_refused_by_path(old, new, path):
    text = (TESTS / "hstu_kuairand_1k.config").read_text()
    assert old in text
    with pytest.raises(ConversionError, match=path):
        convert(text.replace(old, new))


@pytest.mark.parametrize("name", ["hstu_kuairand_1k.config", "dat_mock.config"])
def test_a_match_models_unsupported_similarity_is_refused_and_dropped_by_lenient(name):
    text = (TESTS / name).read_text()
    text = text.replace("similarity: COSINE", "similarity: EUCLID").replace(
        "similarity: INNER_PRODUCT", "similarity: EUCLID"
    )
    assert "EUCLID" in text
    with pytest.raises(ConversionError, match=r"similarity: EUCLID is not supported \(INNER_PRODUCT, COSINE are\)"):
        convert(text, sampler_input_path="d/items.tsv")
    result = convert(text, sampler_input_path="d/items.tsv", lenient=True)
    model = next(v for k, v in result.config["model"].items() if k != "feature_groups")
    assert model["similarity"] == "inner_product"
    config_from_dict(result.config)


def test_lenient_keeps_the_sequence_groups_an_hstu_model_reads_alone():
    """An HSTU model's sequence groups hold no query features (its transducer reads them as
    sequences): a --lenient conversion dropping an unrelated field keeps them."""
    text = (TESTS / "hstu_kuairand_1k.config").read_text().replace("similarity: COSINE", "similarity: EUCLID")
    model = convert(text, lenient=True).config["model"]
    assert [g["group_name"] for g in model["feature_groups"]][:3] == ["contextual", "uih", "candidate"]
    text = edit("use_group_norm: true", "use_group_norm: true attn_alpha: -1")
    with pytest.raises(ConversionError) as e:
        convert(text, lenient=True)
    assert "left without sequence features" not in str(e.value)
