"""`dynarec import-config`: TorchEasyRec pipeline.config files converted, refused field by field,
and the converted configs trained.

tests/config/tzrec/*.config are TorchEasyRec's own examples (alibaba/TorchEasyRec, Apache-2.0,
examples/ at 54cac31), unmodified; the configs below are hand-written in its format.
"""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynarec.cli import main
from dynarec.config import config_from_dict, load_config
from dynarec.config.textproto import Enum, TextFormatError, parse
from dynarec.config.tzrec import ConversionError, convert_pipeline_config
from dynarec.optim import SGD, Adagrad, RowWiseAdagrad
from dynarec.planner import plan_from_config
from dynarec.train.trainer import Trainer
from dynarec.verify import verify_config

EXAMPLES = Path(__file__).parent / "tzrec"


def convert_example(name: str, **kw):
    text = (EXAMPLES / f"{name}.config").read_text()
    return convert_pipeline_config(text, train_input_path="data/train", eval_input_path="data/eval", **kw)


# -- TorchEasyRec's own examples -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["multi_tower_din_taobao", "deepfm_criteo", "dlrm_criteo"])
def test_torcheasyrecs_examples_convert_without_lenient(name):
    result = convert_example(name)
    assert not result.dropped
    config = config_from_dict(result.config)
    assert config.train.sparse_optimizer == Adagrad(lr=0.001)
    assert config.data.batch_size == 8192 and config.eval.metrics == ["auc"]
    assert any("model_dir: pass it to dynarec as --model-dir" in n for n in result.notes)


def test_the_taobao_din_example_maps_features_as_torcheasyrec_names_them():
    config = config_from_dict(convert_example("multi_tower_din_taobao").config)
    seq = config.feature("click_50_seq__adgroup_id")
    assert seq.column == "click_50_seq__adgroup_id" and seq.sequence_length == 100 and seq.separator == "|"
    assert config.feature("user_id").column == "user_id" and config.feature("user_id").expression == "user:user_id"
    price = config.feature("price")
    assert price.boundaries[:3] == [1.1, 2.2, 3.6] and price.table_rows == len(price.boundaries) + 1 == 99
    assert price.embedding_dim == 16
    assert config.feature("pid").hash_bucket_size == 20 and config.feature("pid").hashed
    din = config.model.multi_tower_din
    assert din.towers[0].hidden_units == [512, 256, 128] and din.din_towers[0].attn_hidden_units == [256, 64]
    assert din.final_hidden_units == [64]
    assert config.model.group("seq").group_type == "sequence"


def test_fg_none_reads_encoded_ids_and_wide_groups_get_their_own_tables():
    config = config_from_dict(convert_example("deepfm_criteo").config)
    cat = config.feature("cat_0")
    assert cat.num_buckets == 40_000_000 and cat.separator == "\x03"
    wide = config.feature("cat_0_wide")
    assert (wide.embedding_dim, wide.table_name, wide.column, wide.num_buckets) == (
        4,
        "cat_0_wide",
        "cat_0",
        40_000_000,
    )
    assert config.model.group("wide").feature_names[0] == "cat_0_wide"
    assert config.model.deepfm.fm_group == "fm" and config.model.deepfm.final_hidden_units == [64]
    assert config.eval.max_steps == 100


def test_the_dlrm_example_keeps_its_expression_normalizer():
    config = config_from_dict(convert_example("dlrm_criteo").config)
    assert config.feature("int_0").normalizer.expression == "log(x+3)"
    dlrm = config.model.dlrm
    assert (dlrm.bottom_hidden_units, dlrm.top_hidden_units, dlrm.arch_with_sparse) == ([64], [64, 32], True)


def test_a_table_service_path_needs_a_replacement_named_in_the_error():
    text = (EXAMPLES / "deepfm_criteo.config").read_text()
    with pytest.raises(ConversionError, match=r"train_input_path: 'odps://.*' is a table service.*--train-input-path"):
        convert_pipeline_config(text)


# -- refusals --------------------------------------------------------------------------------------


def test_a_field_dynarec_cannot_carry_is_an_error_naming_its_path_or_dropped_with_lenient():
    text = (EXAMPLES / "multi_tower_din_taobao.config").read_text()
    text = text.replace("hidden_units: [256, 64]\n", "hidden_units: [256, 64]\n                use_bn: true\n")
    text = text.replace(
        "din_towers {", "towers { input: 'deep' mlp { hidden_units: [8] dropout_ratio: 0.5 } }\n din_towers {"
    )
    with pytest.raises(ConversionError) as e:
        convert_pipeline_config(text, train_input_path="a", eval_input_path="b")
    message = str(e.value)
    assert "model_config.multi_tower_din.din_towers.attn_mlp.use_bn: not supported" in message
    assert "model_config.multi_tower_din.towers[1].mlp.dropout_ratio: dropout is not supported" in message
    result = convert_pipeline_config(text, train_input_path="a", eval_input_path="b", lenient=True)
    assert len(result.dropped) == 2 and config_from_dict(result.config)


def test_the_refusal_says_which_fields_lenient_can_drop():
    """The error without --lenient said "--lenient drops them" of fields --lenient then refused
    (a model's own MLP: the model would not be the same): it says which it would drop."""
    text = (EXAMPLES / "multi_tower_din_taobao.config").read_text()
    droppable = text.replace("hidden_units: [256, 64]\n", "hidden_units: [256, 64]\n                use_bn: true\n")
    both = droppable.replace(
        "attn_mlp {\n                hidden_units: [256, 64]", "attn_mlp {\n                hidden_units: []"
    )
    needed = text.replace(
        "attn_mlp {\n                hidden_units: [256, 64]", "attn_mlp {\n                hidden_units: []"
    )
    messages = {}
    for name, edited in (("droppable", droppable), ("both", both), ("needed", needed)):
        with pytest.raises(ConversionError) as e:
            convert_pipeline_config(edited, train_input_path="a", eval_input_path="b")
        messages[name] = str(e.value)
    assert "cannot be carried (--lenient drops them):" in messages["droppable"]
    assert (
        "cannot be carried (--lenient cannot drop them: the model would not be the same model):" in messages["needed"]
    )
    assert "cannot be carried (--lenient drops all but those the model needs):" in messages["both"]
    lines = sorted(messages["both"].splitlines()[1:])
    assert len(lines) == 2 and "hidden_units: at least one layer is needed" in lines[0], lines
    assert lines[0].endswith("(the model needs it: --lenient cannot drop it)")
    assert "use_bn: not supported" in lines[1] and "needs it" not in lines[1]


@pytest.mark.parametrize(
    "edit, path",
    [
        (("num_epochs: 1", "num_epochs: 1\n    unknown_field: 3"), "train_config.unknown_field: not supported"),
        (
            ('label_fields: "clk"', 'label_fields: "clk"\n    sample_weight_fields: "w"'),
            "data_config.sample_weight_fields",
        ),
        (
            ("binary_cross_entropy {}", "softmax_cross_entropy {}"),
            "model_config.losses: softmax_cross_entropy is not supported for a single-task model",
        ),
        (
            ("auc {}", "mean_absolute_error {}"),
            "model_config.metrics: mean_absolute_error is not supported for a single-task model",
        ),
        (
            ("hash_bucket_size: 20", 'hash_bucket_size: 20\n        vocab_list: ["a"]'),
            "feature_configs[15].id_feature.vocab_list",
        ),
        (("fg_mode: FG_DAG", "fg_mode: FG_BUCKETIZE"), "data_config.fg_mode: FG_BUCKETIZE is not supported"),
    ],
)
def test_each_refusal_names_the_field(edit, path):
    text = (EXAMPLES / "multi_tower_din_taobao.config").read_text()
    assert edit[0] in text
    with pytest.raises(ConversionError, match=None) as e:
        convert_pipeline_config(text.replace(edit[0], edit[1], 1), train_input_path="a", eval_input_path="b")
    assert path in str(e.value)


def test_a_single_task_models_accuracy_is_mapped_to_eval_metrics():
    text = (EXAMPLES / "multi_tower_din_taobao.config").read_text()
    assert "auc {}" in text
    result = convert_pipeline_config(text.replace("auc {}", "auc {}\n    }\n    metrics {\n        accuracy {}", 1),
                                     train_input_path="a", eval_input_path="b")  # fmt: skip
    assert result.config["eval"]["metrics"] == ["auc", "accuracy"]
    config_from_dict(result.config)


# -- the text format -------------------------------------------------------------------------------


def test_the_text_format_parser():
    m = parse(
        """
        # a comment
        a: -1.5e3  b: 0x10 c: "x\\ty" 'z'
        d: [1, 2, 3]
        e < f: FOO >
        g [{h: 1}, {h: 2}]
        i: true j: 2.0f
        """
    )
    assert m.values("a") == [-1500.0] and m.values("b") == [16] and m.values("c") == ["x\tyz"]
    assert m.values("d") == [1, 2, 3] and m.values("i") == [True] and m.values("j") == [2.0]
    (e,) = m.values("e")
    assert e.values("f") == ["FOO"] and isinstance(e.values("f")[0], Enum)
    assert [g.values("h") for g in m.values("g")] == [[1], [2]]
    with pytest.raises(TextFormatError, match="line 2: missing '}'"):
        parse("a {\n b: 1")
    with pytest.raises(TextFormatError, match=r"line 1: expected ':' or '\{' after 'a'"):
        parse("a 1")


# -- hand-written configs, converted and trained ---------------------------------------------------

COMMON_TRAIN = """
train_input_path: "{data}"
model_dir: "experiments/x"
train_config {{
    sparse_optimizer {{
        {sparse}
    }}
    dense_optimizer {{
        adam_optimizer {{ lr: 0.01 }}
        constant_learning_rate {{}}
    }}
    num_steps: 4
    save_checkpoints_steps: 2
    log_step_count_steps: 1
}}
data_config {{
    batch_size: 32
    dataset_type: ParquetDataset
    fg_mode: {fg_mode}
    label_fields: "clk"
    num_workers: 0
}}
"""

MULTI_TOWER_DIN = """
feature_configs {
    id_feature {
        feature_name: "user_id"
        expression: "user:user_id"
        embedding_dim: 8
        dynamicemb {
            max_capacity: 4096
            init_capacity_per_rank: 256
            score_strategy: "STEP"
            bucket_capacity: 16
            eval_initializer_args { mode: "CONSTANT" value: 0.0 }
        }
    }
}
feature_configs { id_feature { feature_name: "age" expression: "user:age" num_buckets: 10 embedding_dim: 4 } }
feature_configs {
    id_feature { feature_name: "item_id" expression: "item:item_id" num_buckets: 500 embedding_dim: 8 embedding_name: "item" }
}
feature_configs {
    id_feature { feature_name: "cate_id" expression: "item:cate_id" num_buckets: 50 embedding_dim: 4 embedding_name: "cate" }
}
feature_configs {
    raw_feature { feature_name: "price" expression: "item:price" boundaries: [1, 5, 10, 50] embedding_dim: 4 }
}
feature_configs { id_feature { feature_name: "pid" expression: "context:pid" hash_bucket_size: 20 embedding_dim: 4 } }
feature_configs {
    sequence_feature {
        sequence_name: "click_seq"
        sequence_length: 10
        sequence_delim: "|"
        features {
            id_feature { feature_name: "item_id" expression: "item:item_id" num_buckets: 500 embedding_dim: 8 embedding_name: "item" }
        }
        features {
            id_feature { feature_name: "cate_id" expression: "item:cate_id" num_buckets: 50 embedding_dim: 4 embedding_name: "cate" }
        }
    }
}
model_config {
    feature_groups { group_name: "deep" feature_names: ["user_id", "age", "price", "pid"] group_type: DEEP }
    feature_groups {
        group_name: "seq"
        feature_names: ["item_id", "cate_id", "click_seq__item_id", "click_seq__cate_id"]
        group_type: SEQUENCE
    }
    multi_tower_din {
        towers { input: "deep" mlp { hidden_units: [16] } }
        din_towers { input: "seq" attn_mlp { hidden_units: [8] } }
        final { hidden_units: [8] }
    }
    metrics { auc {} }
    losses { binary_cross_entropy {} }
}
"""

DEEPFM = """
feature_configs { raw_feature { feature_name: "int_0" } }
feature_configs { raw_feature { feature_name: "int_1" } }
feature_configs { id_feature { feature_name: "cat_0" num_buckets: 100 embedding_dim: 8 } }
feature_configs { id_feature { feature_name: "cat_1" num_buckets: 50 embedding_dim: 8 } }
model_config {
    feature_groups { group_name: "wide" feature_names: ["cat_0", "cat_1"] group_type: WIDE }
    feature_groups { group_name: "fm" feature_names: ["cat_0", "cat_1"] group_type: DEEP }
    feature_groups { group_name: "deep" feature_names: ["int_0", "int_1", "cat_0", "cat_1"] group_type: DEEP }
    deepfm { deep { hidden_units: [16, 8] } final { hidden_units: [8] } wide_embedding_dim: 4 }
    metrics { auc {} }
    losses { binary_cross_entropy {} }
}
"""

DLRM = """
feature_configs {
    raw_feature { feature_name: "int_0" expression: "user:int_0" normalizer: "method=expression,expr=log(x+3)" }
}
feature_configs { raw_feature { feature_name: "int_1" expression: "user:int_1" normalizer: "method=zscore,mean=1,standard_deviation=2" } }
feature_configs { id_feature { feature_name: "cat_0" expression: "item:cat_0" hash_bucket_size: 100 embedding_dim: 8 } }
feature_configs { id_feature { feature_name: "cat_1" expression: "item:cat_1" num_buckets: 50 embedding_dim: 8 } }
model_config {
    feature_groups { group_name: "dense" feature_names: ["int_0", "int_1"] group_type: DEEP }
    feature_groups { group_name: "sparse" feature_names: ["cat_0", "cat_1"] group_type: DEEP }
    dlrm { dense_mlp { hidden_units: [16, 8] } final { hidden_units: [16] } }
    num_class: 1
    metrics { auc {} }
    losses { binary_cross_entropy {} }
}
"""

WIDE_AND_DEEP = """
feature_configs { raw_feature { feature_name: "int_0" } }
feature_configs { id_feature { feature_name: "cat_0" num_buckets: 100 embedding_dim: 8 init_fn: "nn.init.uniform_,a=-0.05,b=0.05" } }
feature_configs { id_feature { feature_name: "cat_1" num_buckets: 50 embedding_dim: 8 } }
model_config {
    feature_groups { group_name: "wide" feature_names: ["cat_0", "cat_1"] group_type: WIDE }
    feature_groups { group_name: "deep" feature_names: ["int_0", "cat_0", "cat_1"] group_type: DEEP }
    wide_and_deep { deep { hidden_units: [16] } wide_embedding_dim: 2 wide_init_fn: "nn.init.zeros_" }
    metrics { auc {} }
    losses { binary_cross_entropy {} }
}
"""

MULTI_TOWER = """
feature_configs { id_feature { feature_name: "cat_0" num_buckets: 100 embedding_dim: 8 pooling: "mean" } }
feature_configs {
    sequence_id_feature { feature_name: "hist" sequence_length: 5 sequence_delim: ";" num_buckets: 100 embedding_dim: 8 }
}
feature_configs { raw_feature { feature_name: "int_0" } }
model_config {
    feature_groups { group_name: "all" feature_names: ["cat_0", "hist", "int_0"] group_type: DEEP }
    multi_tower { towers { input: "all" mlp { hidden_units: [8] } } final { hidden_units: [4] } }
    metrics { auc {} }
    losses { binary_cross_entropy {} }
}
"""

ZOO_FEATURES = """
feature_configs { raw_feature { feature_name: "int_0" } }
feature_configs { raw_feature { feature_name: "int_1" } }
feature_configs { id_feature { feature_name: "cat_0" num_buckets: 100 embedding_dim: 8 } }
feature_configs { id_feature { feature_name: "cat_1" num_buckets: 50 embedding_dim: 8 } }
"""
METRICS = "metrics { auc {} } losses { binary_cross_entropy {} }"
ALL = 'feature_groups { group_name: "all" feature_names: ["int_0", "int_1", "cat_0", "cat_1"] group_type: DEEP }'
MASK_NET = (
    ZOO_FEATURES
    + f"""model_config {{ {ALL}
    mask_net {{ mask_net_module {{ n_mask_blocks: 2 mask_block {{ reduction_ratio: 2 hidden_dim: 8 }}
        top_mlp {{ hidden_units: [8, 4] }} use_parallel: false }} }} {METRICS} }}"""
)
WUKONG = (
    ZOO_FEATURES
    + f"""model_config {{
    feature_groups {{ group_name: "dense" feature_names: ["int_0", "int_1"] group_type: DEEP }}
    feature_groups {{ group_name: "sparse" feature_names: ["cat_0", "cat_1"] group_type: DEEP }}
    wukong {{ dense_mlp {{ hidden_units: [16, 8] }}
        wukong_layers {{ lcb_feature_num: 2 fmb_feature_num: 2 compressed_feature_num: 2 feature_num_mlp {{ hidden_units: [8] }} }}
        final {{ hidden_units: [8] }} }} {METRICS} }}"""
)
DCN_V1 = (
    ZOO_FEATURES
    + f"""model_config {{ {ALL}
    dcn_v1 {{ cross {{ cross_num: 2 }} deep {{ hidden_units: [8] }} final {{ hidden_units: [4] }} }} {METRICS} }}"""
)
DCN_V2 = (
    ZOO_FEATURES
    + f"""model_config {{ {ALL}
    dcn_v2 {{ backbone {{ hidden_units: [16] }} cross {{ cross_num: 2 low_rank: 4 }} deep {{ hidden_units: [8] }}
        final {{ hidden_units: [4] }} }} {METRICS} }}"""
)
XDEEPFM = (
    ZOO_FEATURES
    + f"""model_config {{
    feature_groups {{ group_name: "wide" feature_names: ["cat_0", "cat_1"] group_type: WIDE }}
    feature_groups {{ group_name: "deep" feature_names: ["int_0", "int_1", "cat_0", "cat_1"] group_type: DEEP }}
    xdeepfm {{ cin {{ cin_layer_size: [4, 4] }} deep {{ hidden_units: [8] }} final {{ hidden_units: [4] }} }}
    {METRICS} }}"""
)

CTR = 'task_towers { tower_name: "ctr" label_name: "clk" mlp { hidden_units: [4] } metrics { auc {} } losses { binary_cross_entropy {} } }'
CVR = (
    'task_towers { tower_name: "cvr" label_name: "buy" metrics { auc {} } losses { binary_focal_loss { gamma: 1.0 } } '
    'task_space_indicator_label: "clk" out_task_space_weight: 0.0 }'
)
SIMPLE_MULTI_TASK = (
    ZOO_FEATURES
    + f"""model_config {{ {ALL} simple_multi_task {{ {CTR}
    task_towers {{ tower_name: "y" label_name: "int_1" losses {{ l2_loss {{}} }} metrics {{ mean_squared_error {{}} }} }} }} }}"""
)
MMOE = (
    ZOO_FEATURES
    + f"""model_config {{ {ALL}
    mmoe {{ expert_mlp {{ hidden_units: [8] }} gate_mlp {{ hidden_units: [4] }} num_expert: 2 {CTR} {CVR} }} }}"""
)
PLE = (
    ZOO_FEATURES
    + f"""model_config {{ {ALL}
    ple {{
        extraction_networks {{ network_name: "l1" expert_num_per_task: 1 share_num: 2
            task_expert_net {{ hidden_units: [8] }} share_expert_net {{ hidden_units: [8] }} }}
        extraction_networks {{ network_name: "l2" expert_num_per_task: 2 share_num: 1
            task_expert_net {{ hidden_units: [4] }} share_expert_net {{ hidden_units: [4] }} }}
        {CTR} {CVR} }} }}"""
)
DBMTL = (
    ZOO_FEATURES
    + f"""model_config {{ {ALL}
    dbmtl {{
        mask_net {{ n_mask_blocks: 1 mask_block {{ reduction_ratio: 1 hidden_dim: 8 }} top_mlp {{ hidden_units: [8] }} }}
        bottom_mlp {{ hidden_units: [8] }} expert_mlp {{ hidden_units: [8] }} num_expert: 2
        task_towers {{ tower_name: "ctr" mlp {{ hidden_units: [4] }} losses {{ binary_cross_entropy {{}} }} }}
        task_towers {{ tower_name: "cvr" label_name: "buy" relation_tower_names: "ctr" relation_mlp {{ hidden_units: [4] }}
            losses {{ binary_cross_entropy {{ label_smoothing: 0.1 }} }} metrics {{ auc {{}} }} }} }} }}"""
)

ADAGRAD = "adagrad_optimizer { lr: 0.05 initial_accumulator_value: 0.1 }\n exponential_decay_learning_rate { decay_size: 2 decay_factor: 0.5 }"
CASES = {
    "multi_tower_din": (MULTI_TOWER_DIN, "FG_DAG", ADAGRAD),
    "deepfm": (DEEPFM, "FG_NONE", ADAGRAD),
    "dlrm": (
        DLRM,
        "FG_DAG",
        "sgd_optimizer { lr: 0.1 }\n manual_step_learning_rate { schedule_sizes: [2] learning_rates: [0.01] }",
    ),
    "wide_and_deep": (WIDE_AND_DEEP, "FG_NONE", "rowwise_adagrad_optimizer { lr: 0.05 }"),
    "multi_tower": (MULTI_TOWER, "FG_NONE", ADAGRAD),
    "mask_net": (MASK_NET, "FG_NONE", ADAGRAD),
    "wukong": (WUKONG, "FG_NONE", ADAGRAD),
    "dcn_v1": (DCN_V1, "FG_NONE", ADAGRAD),
    "dcn_v2": (DCN_V2, "FG_NONE", ADAGRAD),
    "xdeepfm": (XDEEPFM, "FG_NONE", ADAGRAD),
    "simple_multi_task": (SIMPLE_MULTI_TASK, "FG_NONE", ADAGRAD),
    "mmoe": (MMOE, "FG_NONE", ADAGRAD),
    "ple": (PLE, "FG_NONE", ADAGRAD),
    "dbmtl": (DBMTL, "FG_NONE", ADAGRAD),
}
MODEL_NAMES = {"multi_tower": "multi_tower_din", "dcn_v1": "dcn"}  # TorchEasyRec's -> dynarec's


def write_data(path: Path, rows: int = 256, seed: int = 0) -> None:
    """Every column the hand-written configs read, in one Parquet file."""
    rng = np.random.default_rng(seed)

    def seq(n):
        return ["|".join(str(x) for x in rng.integers(0, n, rng.integers(0, 8))) for _ in range(rows)]

    items = seq(500)
    cates = ["|".join(str(int(x) % 50) for x in s.split("|")) if s else "" for s in items]
    columns = {
        "user_id": [f"u{x}" for x in rng.integers(0, 300, rows)],
        "age": rng.integers(0, 10, rows),
        "item_id": rng.integers(0, 500, rows),
        "cate_id": rng.integers(0, 50, rows),
        "price": rng.exponential(10.0, rows),
        "pid": [f"p{x}" for x in rng.integers(0, 7, rows)],
        "click_seq__item_id": items,
        "click_seq__cate_id": cates,
        "int_0": rng.exponential(3.0, rows),
        "int_1": rng.normal(size=rows),
        "cat_0": rng.integers(0, 100, rows),
        "cat_1": rng.integers(0, 50, rows),
        "hist": [";".join(str(x) for x in rng.integers(0, 100, rng.integers(0, 6))) for _ in range(rows)],
        "clk": rng.integers(0, 2, rows),
    }
    columns["buy"] = columns["clk"] * rng.integers(0, 2, rows)
    path.mkdir(parents=True)
    pq.write_table(pa.table(columns), path / "part-0.parquet")


@pytest.mark.parametrize("model", list(CASES))
def test_a_hand_written_config_converts_trains_and_verifies(model, tmp_path):
    body, fg_mode, sparse = CASES[model]
    write_data(tmp_path / "data")
    text = COMMON_TRAIN.format(data=tmp_path / "data", sparse=sparse, fg_mode=fg_mode) + body
    (tmp_path / "pipeline.config").write_text(text)
    out = tmp_path / "config.yaml"
    assert main(["import-config", str(tmp_path / "pipeline.config"), "-o", str(out)]) == 0
    config = load_config(out)
    assert config.model.name == MODEL_NAMES.get(model, model)
    trainer = Trainer(config, tmp_path / "model", progress=False)
    trainer.fit()
    assert trainer.step == 4
    verdicts = verify_config(config, steps=3)
    assert all(v.ok for v in verdicts), [v.line() for v in verdicts]
    specs = {t.name: t.optimizer for t in plan_from_config(config).table_configs()}
    if sparse == ADAGRAD:  # initial_accumulator_value reaches every table, fixed and dynamic
        assert set(specs.values()) == {Adagrad(lr=0.05, initial_accumulator_value=0.1)}
    if model == "multi_tower_din":
        kinds = {t.name: t.dynamic is not None for t in plan_from_config(config).table_configs()}
        assert kinds["user_id"] and not kinds["item"]
        assert config.feature("user_id").dynamicemb.init_capacity == 256
    if model == "dlrm":
        assert set(specs.values()) == {SGD(lr=0.1)}
        schedule = config.train.sparse_lr_schedule
        assert [schedule.learning_rate(k, 0.1) for k in range(4)] == [0.1, 0.1, 0.1, 0.01]
    if model == "xdeepfm":  # xDeepFM's WIDE group: tables of wide_embedding_dim, default 16
        assert config.feature("cat_0_wide").embedding_dim == 16
        assert config.model.xdeepfm.cin_layer_size == [4, 4]
    if model == "dcn_v2":
        cfg = config.model.dcn_v2
        assert (cfg.backbone_hidden_units, cfg.cross_num, cfg.low_rank, cfg.deep_hidden_units) == ([16], 2, 4, [8])
    if model == "mask_net":
        assert config.model.mask_net.mask_block.reduction_ratio == 2 and not config.model.mask_net.use_parallel
    if model in ("mmoe", "ple"):
        ctr, cvr = config.tasks()
        assert (ctr.label_name, ctr.hidden_units, cvr.label_name, cvr.task_space_indicator_label) == (
            "clk",
            [4],
            "buy",
            "clk",
        )
        assert cvr.losses[0].binary_focal_loss.gamma == 1.0 and cvr.out_task_space_weight == 0.0
        assert set(trainer.evaluate(str(tmp_path / "data"))) == {"num_examples", "auc_ctr", "auc_cvr"}
    if model == "dbmtl":  # a BayesTaskTower's label defaults to label_fields[i]
        ctr, cvr = config.tasks()
        assert (ctr.label_name, cvr.relation_tower_names, cvr.relation_hidden_units) == ("clk", ["ctr"], [4])
        assert cvr.losses[0].binary_cross_entropy.label_smoothing == pytest.approx(0.1)
        assert config.model.dbmtl.mask_net.mask_block.hidden_dim == 8
    if model == "simple_multi_task":
        assert set(trainer.evaluate(str(tmp_path / "data"))) == {"num_examples", "auc_ctr", "mean_squared_error_y"}
    if model == "wide_and_deep":
        assert specs["cat_0_wide"] == RowWiseAdagrad(lr=0.05)
        assert config.feature("cat_0_wide").initializer.kind == "constant"
        assert config.feature("cat_0").initializer.bound == 0.05


def test_exponential_decay_is_torcheasyrecs_formula():
    text = COMMON_TRAIN.format(
        data="d",
        fg_mode="FG_NONE",
        sparse="adagrad_optimizer { lr: 0.1 }\n exponential_decay_learning_rate { decay_size: 10 decay_factor: 0.5 "
        "warmup_size: 4 warmup_learning_rate: 0.02 min_learning_rate: 0.03 }",
    )
    schedule = config_from_dict(convert_pipeline_config(text + DEEPFM).config).train.sparse_lr_schedule
    got = [schedule.learning_rate(k, 0.1) for k in (0, 2, 4, 13, 14, 24, 60)]
    # warmup 0.02 -> 0.1 over 4 steps; then 0.1 * 0.5 ** floor((k - 4) / 10), never below 0.03
    assert got == pytest.approx([0.02, 0.06, 0.1, 0.1, 0.05, 0.03, 0.03])


@pytest.mark.parametrize(
    "edit, message",
    [
        (("embedding_dim: 16", "embedding_dim: 16.5"), r"embedding_dim: expected an integer, got 16\.5"),
        (("embedding_dim: 16", 'embedding_dim: "sixteen"'), r"embedding_dim: expected an integer, got 'sixteen'"),
        (("embedding_dim: 16", "embedding_dim: 1e999"), r"embedding_dim: expected an integer, got inf"),
        (("lr: 0.001", "lr: 1e999"), r"\.lr: inf is not a finite number"),
        (("boundaries: [", "boundaries: [1e999, "), r"boundaries\[0\]: inf is not a finite number"),
        (("batch_size: 8192", "batch_size: 99999999999999999999"), r"batch_size: 99999999999999999999 does not fit"),
    ],
)
def test_numbers_of_the_wrong_kind_are_refused_by_path(edit, message):
    """``embedding_dim: 16.5`` became 16; ``1e999`` or an id past int64 raised raw Python errors."""
    text = (EXAMPLES / "multi_tower_din_taobao.config").read_text()
    assert edit[0] in text
    with pytest.raises(ConversionError, match=message):
        convert_pipeline_config(text.replace(edit[0], edit[1], 1), train_input_path="a", eval_input_path="b")


@pytest.mark.parametrize(
    "text, message",
    [
        ('a: "\\uZZZZ"', r"line 1: bad \\u escape '\\\\uZZZZ'"),
        ('a: "\\U00110000"', r"line 1: bad \\U escape"),
        ("x: 1\na: " + "9" * 5000, r"line 2: a number of 5000 digits"),
        ("a {" * 3000 + "}" * 3000, r"line 1: messages nested more than 100 deep"),
    ],
)
def test_malformed_text_format_is_a_named_error_with_its_line(text, message):
    with pytest.raises(TextFormatError, match=message):
        parse(text)


def test_import_config_refuses_what_it_cannot_read_by_name(tmp_path, capsys):
    out = str(tmp_path / "out.yaml")
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)))
    deep = tmp_path / "deep.config"
    deep.write_text("model_config " + "{ a " * 3000 + "}" * 3000)
    source = EXAMPLES / "multi_tower_din_taobao.config"
    cases = [
        ([str(tmp_path)], "is a directory"),
        ([str(binary)], "model.bin is not UTF-8 text (byte 128: a binary file?)"),
        ([str(deep)], "deep.config: line 1: messages nested more than 100 deep"),
    ]
    for args, message in cases:
        assert main(["import-config", *args, "-o", out]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    copy = tmp_path / "p.config"
    copy.write_text(source.read_text())
    assert main(["import-config", str(copy), "-o", str(copy)]) == 2
    assert "never writes over its input" in capsys.readouterr().err and copy.read_text() == source.read_text()
    assert not (tmp_path / "out.yaml").exists()


def test_import_config_replaces_its_own_output_but_not_a_file_it_did_not_write(tmp_path, capsys):
    """-o over an existing file replaced it silently: a config of the user's own, or a converted
    one edited by hand since, lost. Now both are refused unless --overwrite (the header records a
    digest of the YAML it wrote); its own untouched output is replaced, as a build step's is."""
    source = str(EXAMPLES / "multi_tower_din_taobao.config")
    paths = ["--train-input-path", "train", "--eval-input-path", "eval"]
    out = tmp_path / "mine.yaml"
    out.write_text("# my own config\nmodel: {}\n")
    assert main(["import-config", source, "-o", str(out), *paths]) == 2
    err = capsys.readouterr().err
    assert f"-o {out} exists and was not written by import-config" in err and "--overwrite" in err, err
    assert out.read_text() == "# my own config\nmodel: {}\n"
    assert main(["import-config", source, "-o", str(out), *paths, "--overwrite"]) == 0
    converted = out.read_text()
    assert converted.startswith("# Converted by `dynarec import-config`")
    assert main(["import-config", source, "-o", str(out), *paths]) == 0  # its own output, untouched
    assert out.read_text() == converted
    out.write_text(converted.replace("batch_size: ", "batch_size: 1", 1))  # an edit keeps the header
    assert main(["import-config", source, "-o", str(out), *paths]) == 2
    assert f"-o {out} was edited since import-config wrote it" in capsys.readouterr().err
    assert out.read_text() != converted
    assert main(["import-config", source, "-o", str(out), *paths, "--overwrite"]) == 0
    assert out.read_text() == converted


# -- non-feature fields of the vendored configs ----------------------------------------------------

VENDORED = EXAMPLES / "tests"
MOCK = VENDORED / "multi_tower_din_mock.config"  # FG_NONE, train_input_path: "", train_metrics


def test_an_empty_train_input_path_converts_with_a_note():
    """``train_input_path: ""`` (TorchEasyRec takes it on its command line) was a pydantic error."""
    result = convert_pipeline_config(MOCK.read_text())
    assert result.config["data"]["train_input_path"] == [] and "eval_input_path" not in result.config["data"]
    notes = "\n".join(result.notes)
    assert "train_input_path: empty (TorchEasyRec takes it on its command line): written as []; pass " in notes
    assert "--train-input-path to import-config" in notes
    config = config_from_dict(result.config)
    with pytest.raises(FileNotFoundError, match=r"input path: \[\] match no \.parquet or \.csv file"):
        from dynarec.data.reader import resolve_files

        resolve_files(config.data.train_input_path)
    assert "model_config.train_metrics: ignored (metrics of the training batches, logged only" in notes


def test_save_checkpoints_steps_0_means_no_periodic_saves_and_epochs_replace_steps():
    result = convert_example("benchmark/criteo/dlrm")
    train = config_from_dict(result.config).train
    assert train.save_checkpoints_steps is None and train.eval_every_steps is None
    assert any("save_checkpoints_steps: 0: no periodic checkpoints or evaluations" in n for n in result.notes)
    text = MOCK.read_text().replace(
        "num_epochs: 1", "num_epochs: 4\n save_checkpoints_steps: 10 save_checkpoints_epochs: 2"
    )
    result = convert_pipeline_config(text, train_input_path="d")
    train = config_from_dict(result.config).train
    # TorchEasyRec saves by epochs when save_checkpoints_epochs > 0, its steps then ignored
    assert (train.save_checkpoints_epochs, train.save_checkpoints_steps, train.eval_every_steps) == (2, None, None)
    assert any("save_checkpoints_steps: ignored: save_checkpoints_epochs is set" in n for n in result.notes)


def test_mixed_precision_clipping_and_accumulation_map_onto_the_train_section():
    text = MOCK.read_text().replace(
        "num_epochs: 1",
        "num_epochs: 1\n mixed_precision: 'BF16' gradient_accumulation_steps: 4\n"
        " grad_clipping { clipping_type: 'norm' max_gradient: 0.5 norm_type: 2.0 }",
    )
    train = config_from_dict(convert_pipeline_config(text, train_input_path="d").config).train
    assert (train.mixed_precision, train.gradient_accumulation_steps) == ("bf16", 4)
    assert (train.gradient_clipping.max_norm, train.gradient_clipping.norm_type) == (0.5, 2.0)
    fp16 = "mixed_precision: 'FP16' grad_scaler { init_scale: 1024 growth_interval: 100 }"
    text = MOCK.read_text().replace("num_epochs: 1", f"num_epochs: 1\n {fp16}")
    train = config_from_dict(convert_pipeline_config(text, train_input_path="d").config).train
    assert train.mixed_precision == "fp16"
    assert (train.grad_scaler.init_scale, train.grad_scaler.growth_interval, train.grad_scaler.growth_factor) == (
        1024.0, 100, 2.0,
    )  # fmt: skip
    for edit, message in [
        ("mixed_precision: 'FP8'", r"train_config\.mixed_precision: 'FP8' is not a mixed precision TorchEasyRec takes"),
        ("grad_scaler { init_scale: 'x' }", r"train_config\.grad_scaler\.init_scale"),
        ("grad_clipping { clipping_type: 'value' }", r"train_config\.grad_clipping\.clipping_type: 'value' is not"),
    ]:
        with pytest.raises(ConversionError, match=message):
            convert_pipeline_config(
                MOCK.read_text().replace("num_epochs: 1", f"num_epochs: 1\n {edit}"), train_input_path="d"
            )


def test_dice_maps_onto_the_din_towers_activation_and_is_refused_where_dynarec_has_none():
    config = config_from_dict(convert_example("tests/multi_tower_din_zch_fg_mock").config)
    assert config.model.multi_tower_din.din_towers[0].activation == "dice"
    assert config.model.multi_tower_din.towers[0].activation == "relu"
    text = (
        (EXAMPLES / "deepfm_criteo.config")
        .read_text()
        .replace("hidden_units: [512, 256, 128]", 'hidden_units: [512, 256, 128] activation: "Dice"', 1)
    )
    with pytest.raises(ConversionError, match=r"model_config\.deepfm\.deep\.activation: 'Dice' is not supported here"):
        convert_pipeline_config(text, train_input_path="a", eval_input_path="b")


# -- the seed's config: multi_tower_din with dynamicemb and fixed tables, one Adagrad --------------

SEED = VENDORED / "multi_tower_din_fg_dynamicemb_mock.config"


def test_the_seeds_config_converts_without_lenient():
    result = convert_pipeline_config(SEED.read_text(), train_input_path="d", config_dir=SEED.parent)
    assert not result.dropped


def test_the_seeds_one_adagrad_reaches_its_dynamic_and_fixed_tables():
    result = convert_pipeline_config(SEED.read_text(), train_input_path="d", config_dir=SEED.parent)
    tables = plan_from_config(config_from_dict(result.config)).table_configs()
    dynamic = {t.name for t in tables if t.dynamic is not None}
    assert dynamic == {"user_id", "id_8"}
    assert len(tables) > len(dynamic) + 10  # and the fixed ones: ids, vocabularies, hashes, boundaries
    assert {t.optimizer for t in tables} == {Adagrad(lr=0.001, initial_accumulator_value=0.0)}
    assert "initial_accumulator_value=0.0" in repr(tables[0].optimizer)


def test_the_seeds_config_with_torcheasyrecs_initial_accumulator_value_verifies_on_every_table():
    """The bug this project answers: Adagrad's initial_accumulator_value 0.1 (TensorFlow's, as the
    vendored adagrad_init_acc mock sets it) written into the seed's config reaches its dynamic
    tables and its fixed ones alike, and `dynarec verify` holds every one of them to the
    reference (FBGEMM's twin where the table has one)."""
    text = SEED.read_text()
    assert text.count("adagrad_optimizer {") == 1
    text = text.replace("adagrad_optimizer {", "adagrad_optimizer {\n            initial_accumulator_value: 0.1", 1)
    config = config_from_dict(convert_pipeline_config(text, train_input_path="d", config_dir=SEED.parent).config)
    tables = plan_from_config(config).table_configs()
    assert {t.optimizer for t in tables} == {Adagrad(lr=0.001, initial_accumulator_value=0.1)}
    assert {t.name for t in tables if t.dynamic is not None} == {"user_id", "id_8"}
    verdicts = verify_config(config, steps=2)
    assert len(verdicts) == len(tables) and all(v.ok for v in verdicts), [v.line() for v in verdicts if not v.ok]


def test_sparse_gradient_clipping_reaches_every_table():
    path = VENDORED / "multi_tower_din_fg_mock_gradient_clipping.config"
    result = convert_pipeline_config(path.read_text(), train_input_path="d", config_dir=path.parent)
    tables = plan_from_config(config_from_dict(result.config)).table_configs()
    assert {t.optimizer for t in tables} == {Adagrad(lr=0.001, gradient_clipping=True, max_gradient=1.0)}
    config = config_from_dict(result.config)
    assert (config.train.gradient_clipping.max_norm, config.train.gradient_clipping.norm_type) == (1.0, 2.0)


def _with_optimizers(sparse: str, dense: str = "adam_optimizer { lr: 0.01 }") -> str:
    text = (EXAMPLES / "multi_tower_din_taobao.config").read_text()
    start = text.index("train_config {")
    end = text.index("num_epochs", start)
    optimizers = f"sparse_optimizer {{ {sparse} constant_learning_rate {{}} }}\n"
    optimizers += f"dense_optimizer {{ {dense} constant_learning_rate {{}} }}\n"
    return text[:start] + "train_config {\n" + optimizers + text[end:]


def test_rowwise_adagrads_weight_decay_under_mode_none_is_carried_as_no_decay_with_a_note():
    """TorchEasyRec's weight_decay_mode defaults to NONE, under which FBGEMM applies no decay: a
    config setting weight_decay alone was refused by the converted YAML's schema (even with
    --lenient). It now trains as in TorchEasyRec, without decay, and says so."""
    text = _with_optimizers("rowwise_adagrad_optimizer { lr: 0.01 weight_decay: 0.00001 }")
    result = convert_pipeline_config(text, train_input_path="a", eval_input_path="b")
    spec = config_from_dict(result.config).train.sparse_optimizer
    assert (spec.weight_decay, spec.weight_decay_mode) == (0.0, "none")
    assert any("weight_decay: 1e-05 decays nothing under weight_decay_mode NONE" in n for n in result.notes)
    text = _with_optimizers("rowwise_adagrad_optimizer { lr: 0.01 weight_decay: 0.00001 weight_decay_mode: L2 }")
    result = convert_pipeline_config(text, train_input_path="a", eval_input_path="b")
    spec = config_from_dict(result.config).train.sparse_optimizer
    assert (spec.weight_decay, spec.weight_decay_mode) == (1e-05, "l2")


@pytest.mark.parametrize(
    "sparse, dense, path",
    [
        ("lamb_optimizer { lr: 0.01 }", "adam_optimizer { lr: 0.01 }", "train_config.sparse_optimizer.lamb_optimizer"),
        (
            "sgd_optimizer { lr: 0.01 }",
            "rmsprop_optimizer { lr: 0.01 }",
            "train_config.dense_optimizer.rmsprop_optimizer",
        ),
    ],
)
def test_an_optimizer_dynarec_lacks_is_refused_by_path_even_with_lenient(sparse, dense, path):
    """--lenient dropped the optimizer's fields and kept its name, which the converted config's
    schema then refused (after the refusal had said --lenient would drop it)."""
    text = _with_optimizers(sparse, dense)
    for lenient in (False, True):
        with pytest.raises(ConversionError, match=rf"{path}: not supported \(dynarec's: .*\)") as e:
            convert_pipeline_config(text, train_input_path="a", eval_input_path="b", lenient=lenient)
        assert "--lenient drops" not in str(e.value)


# -- --lenient ------------------------------------------------------------------------------------


def test_lenient_drops_a_feature_with_its_group_entries_table_and_emptied_group_and_tower(tmp_path, capsys):
    """A refused feature goes with its group entries and table; the features reading it go too; a
    group left empty goes with its tower; the CLI prints the list."""
    text = (
        MULTI_TOWER_DIN.replace(
            'feature_configs { id_feature { feature_name: "pid" expression: "context:pid" hash_bucket_size: 20 embedding_dim: 4 } }',
            'feature_configs { id_feature { feature_name: "pid" expression: "context:pid" hash_bucket_size: 20 embedding_dim: 4 '
            "use_mask: true } }\n"
            'feature_configs { lookup_feature { feature_name: "lk" map: "user:m" key: "feature:pid" } }',
        )
        .replace(
            'feature_groups { group_name: "deep" feature_names: ["user_id", "age", "price", "pid"] group_type: DEEP }',
            'feature_groups { group_name: "deep" feature_names: ["user_id", "age", "price"] group_type: DEEP }\n'
            'feature_groups { group_name: "side" feature_names: ["pid", "lk"] group_type: DEEP }',
        )
        .replace(
            'towers { input: "deep" mlp { hidden_units: [16] } }',
            'towers { input: "deep" mlp { hidden_units: [16] } }\n towers { input: "side" mlp { hidden_units: [4] } }',
        )
    )
    full = COMMON_TRAIN.format(data="d", sparse=ADAGRAD, fg_mode="FG_DAG") + text
    with pytest.raises(ConversionError, match=r"feature_configs\[5\]\.id_feature\.use_mask"):
        convert_pipeline_config(full)
    result = convert_pipeline_config(full, lenient=True)
    assert result.dropped == [
        "feature_configs[5].id_feature: feature 'pid' dropped (feature_configs[5].id_feature.use_mask: masking "
        "inputs (data_config.sample_mask_prob) is not supported (only False, its default, is))",
        "feature_configs[6].lookup_feature: feature 'lk' dropped (reads the dropped feature 'pid')",
        "model_config.feature_groups[1]: pid, lk taken out of group 'side'",
        "model_config.feature_groups[1]: group 'side' left empty, dropped",
        "model_config.multi_tower_din.towers[1]: reads dropped group 'side', dropped",
    ]
    config = config_from_dict(result.config)
    assert [t.input for t in config.model.multi_tower_din.towers] == ["deep"]
    assert "pid" not in {t.name for t in plan_from_config(config).table_configs()}
    (tmp_path / "p.config").write_text(full)
    assert main(["import-config", str(tmp_path / "p.config"), "-o", str(tmp_path / "c.yaml"), "--lenient"]) == 0
    out = capsys.readouterr().out
    assert "dropped: model_config.multi_tower_din.towers[1]: reads dropped group 'side', dropped" in out
    assert "# Dropped (--lenient):" in (tmp_path / "c.yaml").read_text()


def test_lenient_refuses_by_path_what_cannot_be_dropped_consistently():
    """A group the model needs, left empty, and a model dynarec does not have."""
    text = COMMON_TRAIN.format(data="d", sparse=ADAGRAD, fg_mode="FG_NONE") + DEEPFM.replace(
        'feature_configs { id_feature { feature_name: "cat_1" num_buckets: 50 embedding_dim: 8 } }',
        'feature_configs { id_feature { feature_name: "cat_1" num_buckets: 50 embedding_dim: 8 use_mask: true } }',
    ).replace('feature_names: ["cat_0", "cat_1"] group_type: WIDE', 'feature_names: ["cat_1"] group_type: WIDE')
    with pytest.raises(ConversionError) as e:
        convert_pipeline_config(text, lenient=True)
    assert "--lenient cannot drop them" in str(e.value)
    assert "model_config.feature_groups[0]: group 'wide' left empty by the dropped features; deepfm needs it" in str(
        e.value
    )
    # a model TorchEasyRec may grow that dynarec does not have (here: TDM's block under another name)
    text = (EXAMPLES / "examples" / "tdm_taobao.config").read_text().replace("    tdm {", "    tdm_v2 {")
    with pytest.raises(ConversionError, match=r"model_config\.tdm_v2: this model is not supported .*issue 30"):
        convert_pipeline_config(text, train_input_path="d", lenient=True, tree_dir="t")


# -- relative paths --------------------------------------------------------------------------------


def test_a_vocab_file_is_relative_to_the_pipeline_config_and_written_relative_to_the_yaml(tmp_path, capsys):
    source = tmp_path / "tzrec" / "configs"
    (source / "vocab").mkdir(parents=True)
    (source / "vocab" / "words.txt").write_text("apple 2\nbanana 3\npear 7\n")
    text = COMMON_TRAIN.format(data="d", sparse=ADAGRAD, fg_mode="FG_DAG") + MULTI_TOWER.replace(
        'feature_configs { id_feature { feature_name: "cat_0" num_buckets: 100 embedding_dim: 8 pooling: "mean" } }',
        'feature_configs { id_feature { feature_name: "cat_0" expression: "user:fruit" vocab_file: "vocab/words.txt"'
        ' default_bucketize_value: 1 embedding_dim: 8 pooling: "mean" } }',
    ).replace(
        'feature_name: "hist" sequence_length', 'feature_name: "hist" expression: "user:hist" sequence_length'
    ).replace('raw_feature { feature_name: "int_0" }', 'raw_feature { feature_name: "int_0" expression: "user:int_0" }')
    (source / "pipeline.config").write_text(text)
    out = tmp_path / "out" / "cfg.yaml"
    out.parent.mkdir()
    assert main(["import-config", str(source / "pipeline.config"), "-o", str(out)]) == 0
    assert "vocab_file: 'vocab/words.txt' resolved against the pipeline config's directory" in capsys.readouterr().out
    import yaml

    written = yaml.safe_load(out.read_text())["feature_configs"][0]["id_feature"]["vocab_file"]
    assert written == "../tzrec/configs/vocab/words.txt"
    assert load_config(out).feature("cat_0").table_rows == 8  # "word id" lines: max(id) + 1
    (source / "vocab" / "words.txt").unlink()
    assert main(["import-config", str(source / "pipeline.config"), "-o", str(tmp_path / "x.yaml")]) == 2
    err = capsys.readouterr().err
    assert "feature_configs[0].id_feature.vocab_file: " in err and "words.txt does not exist" in err


def test_the_configs_own_relative_data_paths_are_relative_to_the_current_directory(tmp_path, monkeypatch, capsys):
    """TorchEasyRec reads a relative train_input_path from where it runs; dynarec resolves the
    YAML's against the YAML's directory: import-config writes it so (as it did for the same path
    given as --train-input-path), with a note."""
    import yaml

    monkeypatch.chdir(tmp_path)
    write_data(tmp_path / "data" / "train")
    text = COMMON_TRAIN.format(data="data/train", sparse=ADAGRAD, fg_mode="FG_NONE") + MULTI_TOWER
    (tmp_path / "pipeline.config").write_text(text)
    out = tmp_path / "out" / "cfg.yaml"
    out.parent.mkdir()
    assert main(["import-config", "pipeline.config", "-o", str(out)]) == 0
    assert (
        "train_input_path: 'data/train' is relative to the current directory (TorchEasyRec's): written '../data/train'"
        in capsys.readouterr().out
    )
    assert yaml.safe_load(out.read_text())["data"]["train_input_path"] == "../data/train"
    assert load_config(out).data.train_input_path == str(tmp_path / "data" / "train")
    # a flag's relative path replaces it: the note says how the YAML has it (it said the flag's alone)
    assert main(["import-config", "pipeline.config", "-o", str(out), "--train-input-path", "data/train"]) == 0
    assert (
        "train_input_path: 'data/train' replaced by 'data/train' (written '../data/train': relative to the YAML)"
        in capsys.readouterr().out
    )


# -- docs/import_config.md -------------------------------------------------------------------------


def test_every_field_the_conversion_speaks_of_is_in_the_field_table():
    """The field table of docs/import_config.md names every field a vendored config gets a note
    or a refusal for."""
    import re

    from tests.config.test_tzrec_vendored import CONFIGS, ROOT

    doc = (Path(__file__).parents[2] / "docs" / "import_config.md").read_text()
    table = doc[doc.index("## Field by field") :]
    named = {word for span in re.findall(r"`([^`]+)`", table) for word in re.findall(r"[A-Za-z_]\w*", span)}
    missing = set()
    for name in CONFIGS:
        path = ROOT / name
        try:
            result = convert_pipeline_config(path.read_text(), config_dir=path.parent, lenient=True)
            lines = result.notes + result.dropped
        except ConversionError as e:
            lines = [line.strip() for line in str(e).splitlines()[1:]]
        for line in lines:
            field_path = line.split(": ")[0]
            last = re.sub(r"\[\d+\]", "", field_path).split(".")[-1]
            if last and last not in named:
                missing.add(f"{last} ({name}: {line[:100]})")
    assert not missing, sorted(missing)


def test_lenient_drops_a_nested_sequence_group_left_without_its_sequence_with_its_encoder():
    """dbmtl_has_sequence_mock with its click sequence refused: --lenient drops the four
    click_50_seq__* features, then the deep group's nested click_50_seq group (only query
    features left) and the DIN encoder reading it; buy_50_seq and its encoder stay."""
    text = (EXAMPLES / "tests" / "dbmtl_has_sequence_mock.config").read_text()
    text = text.replace('sequence_name: "click_50_seq"', 'sequence_name: "click_50_seq"\n        no_such_field: 1', 1)
    result = convert_pipeline_config(text, train_input_path="d/train", eval_input_path="d/eval", lenient=True)
    assert "model_config.feature_groups: sequence group 'click_50_seq' left incomplete, dropped with its encoders" in (
        result.dropped
    )
    deep = config_from_dict(result.config).model.feature_groups[0]
    assert [s.group_name for s in deep.sequence_groups] == ["buy_50_seq"]
    assert [e.body.input for e in deep.sequence_encoders] == ["buy_50_seq"]


def test_rocket_launching_of_two_classes_is_one_logit_under_binary_cross_entropy():
    """TorchEasyRec's criteo rocket_launching: num_class 2 under softmax_cross_entropy becomes one
    logit under dynarec's binary cross-entropy (the same likelihood), said in a note."""
    path = EXAMPLES / "examples" / "rocket_launching_criteo.config"
    result = convert_pipeline_config(path.read_text(), train_input_path="d/train", eval_input_path="d/eval")
    block = result.config["model"]["rocket_launching"]
    assert block == {
        "booster_hidden_units": [256, 128, 64, 32],
        "light_hidden_units": [96, 64, 32],
        "feature_based_distillation": True,
    }
    assert any("num_class 2 under softmax_cross_entropy: one logit" in n for n in result.notes)
    assert config_from_dict(result.config).tasks()[0].num_class == 1


# -- MIND ------------------------------------------------------------------------------------------


def test_mind_converts_with_its_capsules_mlps_and_defaults():
    path = EXAMPLES / "examples" / "mind_taobao.config"
    result = convert_pipeline_config(
        path.read_text(), train_input_path="d", eval_input_path="e", sampler_input_path="i.tsv"
    )
    mind = config_from_dict(result.config).model.mind
    user = mind.user_tower
    assert (user.input, user.history_input, user.hidden_units, user.dropout_ratio) == (
        "user",
        "hist",
        [256, 128],
        [0.2],
    )
    assert user.hist_seq_mlp.hidden_units == [256, 128] and user.hist_seq_mlp.bias is False
    assert user.concat_mlp.bias is False and user.concat_mlp.dropout_ratio == [0.2]
    c = user.capsule
    assert (c.max_k, c.num_iters, c.max_seq_len, c.high_dim, c.squash_pow, c.const_caps_num) == (
        8,
        3,
        50,
        64,
        0.2,
        False,
    )
    assert (c.routing_logits_scale, c.routing_logits_stddev, c.routing_init_method) == (20.0, 1.0, "normal")
    assert (mind.item_tower.hidden_units, mind.item_tower.dropout_ratio) == ([256, 128], [0.2])
    assert (mind.output_dim, mind.simi_pow, mind.similarity, mind.temperature) == (32, 20.0, "cosine", 0.01)
    assert mind.recall_at_k == [1, 5] and mind.embedding_dim == 32


def test_mind_without_output_dim_serves_its_concat_mlps_width():
    """mind_mock sets no output_dim (TorchEasyRec then adds no output layers), batch-normalized
    MLPs, and its sampler's attr_delimiter twice with one value (protobuf's text_format.Merge
    keeps the last)."""
    path = VENDORED / "mind_mock.config"
    result = convert_pipeline_config(
        path.read_text(), train_input_path="d", eval_input_path="e", sampler_input_path="i.tsv"
    )
    config = config_from_dict(result.config)
    mind = config.model.mind
    assert mind.output_dim == 0 and mind.embedding_dim == 128 and mind.similarity == "cosine"
    assert mind.user_tower.use_bn and mind.user_tower.concat_mlp.use_bn and mind.item_tower.use_bn
    assert config.data.negative_sampler.attr_delimiter == "\x02"
    twice = path.read_text().replace(
        'attr_delimiter: "\\x02"\n        attr_delimiter: "\\x02"', 'attr_delimiter: "\\x02"\n attr_delimiter: ","'
    )
    assert twice != path.read_text()
    with pytest.raises(ConversionError, match=r"data_config\.negative_sampler\.attr_delimiter: expected one value"):
        convert_pipeline_config(twice, train_input_path="d", eval_input_path="e", sampler_input_path="i.tsv")


def test_pepnet_converts_with_its_groups_gates_and_domains():
    path = EXAMPLES / "examples" / "pepnet_taobao.config"
    result = convert_pipeline_config(path.read_text(), train_input_path="d", eval_input_path="e")
    config = config_from_dict(result.config)
    p = config.model.pepnet
    assert (p.main_input, p.domain_input, p.uia_input) == ("all", "domain", "uia")
    assert (p.ppnet_hidden_units, p.ppnet_dropout_ratio, p.epnet_gamma, p.ppnet_gamma) == (
        [512, 256],
        [0.1, 0.1],
        2.0,
        2.0,
    )
    assert (p.domain_label, p.task_domain_num, p.domains) == ("occupation", 3, 3)
    assert [t.tower_name for t in p.task_towers] == ["ctr", "cvr"]
    assert config.label_fields() == ["clk", "buy", "occupation"]


def test_dssm_v2_without_its_sampler_path_is_refused_for_that_alone():
    """force_base_data_group (dssm_v2's towers sharing tables over the sampled items' rows) was
    refused as "not supported" beside the missing sampler input path, as if the config needed
    more than the path; given the path it converts."""
    text = (EXAMPLES / "examples" / "dssm_v2_taobao.config").read_text()
    with pytest.raises(ConversionError) as e:
        convert_pipeline_config(text, train_input_path="d", eval_input_path="e")
    assert "--sampler-input-path" in str(e.value) and "force_base_data_group" not in str(e.value)
    result = convert_pipeline_config(text, train_input_path="d", eval_input_path="e", sampler_input_path="i.tsv")
    assert any("force_base_data_group" in n for n in result.notes)
