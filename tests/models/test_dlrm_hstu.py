"""DlrmHSTU end to end on CPU: a label a candidate (bitmask tasks), trained and evaluated through
the trainer; the data's candidate lists checked against the labels; what it refuses."""

import copy
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from dynarec.config import config_from_dict, load_config
from dynarec.data import BatchBuilder, DataError
from dynarec.models.tasks import Tasks
from dynarec.train.trainer import Trainer

ITEMS = 50


def _table(n: int, seed: int, **columns) -> pa.Table:
    """Rows of a user's history (items, times, action bitmasks) and 1-3 candidates, whose click
    (bit 1) depends on the item, and whose like (bit 2) on nothing."""
    rng = np.random.default_rng(seed)
    history, targets = rng.integers(0, 9, n), rng.integers(1, 4, n)
    effect = np.sin(np.arange(ITEMS) * 1.7)
    candidates = [rng.integers(0, ITEMS, t) for t in targets]
    actions = [
        [int(rng.random() < 1 / (1 + np.exp(-3 * effect[c]))) | 2 * int(rng.random() < 0.3) for c in cs]
        for cs in candidates
    ]
    data = {
        "user_id": pa.array(rng.integers(0, 20, n)),
        "age": pa.array(rng.integers(0, 5, n)),
        "hist_item": pa.array([rng.integers(0, ITEMS, u).tolist() for u in history], pa.list_(pa.int64())),
        "hist_time": pa.array([sorted(1.6e9 + rng.random(u) * 1e5) for u in history], pa.list_(pa.float64())),
        "hist_action": pa.array(
            [rng.integers(0, 4, u).astype(float).tolist() for u in history], pa.list_(pa.float64())
        ),
        "cand_item": pa.array([c.tolist() for c in candidates], pa.list_(pa.int64())),
        "cand_time": pa.array([[1.6e9 + 2e5] * t for t in targets], pa.list_(pa.float64())),
        "actions": pa.array(actions, pa.list_(pa.int64())),
    }
    data.update(columns)
    return pa.table(data)


CONFIG = {
    "feature_configs": [
        {"id_feature": {"feature_name": "user_id", "embedding_dim": 8, "num_buckets": 20}},
        {"id_feature": {"feature_name": "age", "embedding_dim": 8, "num_buckets": 5}},
        {
            "sequence_feature": {
                "feature_name": "hist_item",
                "sequence_length": 10,
                "embedding_dim": 8,
                "num_buckets": ITEMS,
                "embedding_name": "item",
            }
        },
        {"sequence_raw_feature": {"feature_name": "hist_time", "sequence_length": 10}},
        {"sequence_raw_feature": {"feature_name": "hist_action", "sequence_length": 10}},
        {
            "sequence_feature": {
                "feature_name": "cand_item",
                "sequence_length": 5,
                "embedding_dim": 8,
                "num_buckets": ITEMS,
                "embedding_name": "item",
            }
        },
        {"sequence_raw_feature": {"feature_name": "cand_time", "sequence_length": 5}},
    ],
    "model": {
        "feature_groups": [
            {"group_name": "contextual", "feature_names": ["user_id", "age"]},
            {"group_name": "uih", "group_type": "sequence", "feature_names": ["hist_item"]},
            {"group_name": "uih_timestamp", "group_type": "sequence", "feature_names": ["hist_time"]},
            {"group_name": "uih_action", "group_type": "sequence", "feature_names": ["hist_action"]},
            {"group_name": "candidate", "group_type": "sequence", "feature_names": ["cand_item"]},
            {"group_name": "candidate_timestamp", "group_type": "sequence", "feature_names": ["cand_time"]},
        ],
        "dlrm_hstu": {
            "max_seq_len": 32,
            "item_embedding_hidden_dim": 16,
            "hstu": {
                "stu": {
                    "embedding_dim": 16,
                    "num_heads": 2,
                    "hidden_dim": 8,
                    "attention_dim": 8,
                    "use_group_norm": True,
                },
                "attn_num_layers": 2,
                "positional_encoder": {"num_position_buckets": 64, "num_time_buckets": 32, "use_time_encoding": True},
                "content_mlp_hidden_dim": 16,
                "action_encoder": {"action_embedding_dim": 4, "action_weights": [1, 2]},
                "action_mlp_hidden_dim": 16,
                "postprocessor": {
                    "kind": "timestamp_layernorm",
                    "time_duration_period_units": [3600, 86400],
                    "time_duration_units_per_period": [24, 7],
                },
            },
            "fusion_hidden_units": [16],
            "fusion_activation": "silu",
            "fusion_layer_norm": True,
            "task_towers": [
                {"tower_name": "click", "label_name": "actions", "task_bitmask": 1},
                {"tower_name": "like", "label_name": "actions", "task_bitmask": 2},
            ],
        },
    },
    "data": {"train_input_path": "data/train", "eval_input_path": "data/eval", "batch_size": 32},
    "train": {
        "sparse_optimizer": {"adagrad_optimizer": {"lr": 0.05}},
        "dense_optimizer": {"adam_optimizer": {"lr": 0.003}},
        "num_epochs": 3,
    },
}


def _setup(tmp_path: Path) -> Path:
    for part, rows, seed in (("train", 400, 0), ("eval", 200, 1)):
        (tmp_path / "data" / part).mkdir(parents=True)
        pq.write_table(_table(rows, seed), tmp_path / "data" / part / "part-0.parquet")
    cfg = copy.deepcopy(CONFIG)
    for key in ("train_input_path", "eval_input_path"):
        cfg["data"][key] = str(tmp_path / cfg["data"][key])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_dlrm_hstu_learns_each_candidate_s_label(tmp_path):
    config = load_config(_setup(tmp_path))
    trainer = Trainer(config, tmp_path / "model", device="cpu", progress=False)
    report = trainer.fit()
    candidates = pq.read_table(tmp_path / "data" / "eval" / "part-0.parquet").column("cand_item")
    assert report["eval"]["num_examples"] == sum(len(c) for c in candidates.to_pylist())
    assert report["eval"]["auc_click"] > 0.8  # the click follows the candidate's item
    assert 0.35 < report["eval"]["auc_like"] < 0.65  # the like follows nothing
    with pytest.raises(ValueError, match=r"export: model.dlrm_hstu scores each row's candidates"):
        from dynarec.train.export import export_model

        export_model(trainer.task, trainer.example_batch(), tmp_path / "export")
    # predict writes a list a row, its candidates' scores (and passes the label lists through)
    from dynarec.cli import main

    out, eval_dir = tmp_path / "scores.parquet", str(tmp_path / "data" / "eval")
    assert main(["predict", "--model-dir", str(tmp_path / "model"), "--input", eval_dir, "--output", str(out)]) == 0
    written = pq.read_table(out)
    flat, _, _ = trainer.predict(eval_dir, with_labels=False)
    for name in ("probs_click", "probs_like"):
        rows = written.column(name).to_pylist()
        assert [len(r) for r in rows] == [len(c) for c in candidates.to_pylist()]
        np.testing.assert_allclose(np.concatenate([np.array(r) for r in rows if r]), flat[name], rtol=1e-6)
    assert (
        written.column("actions").to_pylist() == pq.read_table(tmp_path / "data" / "eval").column("actions").to_pylist()
    )


def test_the_labels_are_each_candidate_s_with_its_row_s_ids():
    config = config_from_dict(CONFIG)
    table = _table(4, 2)
    batch = BatchBuilder(config).build(table, "t.parquet")
    counts = [len(c) for c in table.column("cand_item").to_pylist()]
    assert batch.num_rows == 4 and batch.labels.shape == (sum(counts), 1)
    assert batch.labels[:, 0].tolist() == [float(a) for row in table.column("actions").to_pylist() for a in row]
    tasks = Tasks(config)
    bits = tasks.label(0, batch.labels), tasks.label(1, batch.labels)
    actions = batch.labels[:, 0].long()
    assert (
        bits[0].tolist() == (actions & 1 > 0).float().tolist()
        and bits[1].tolist() == (actions & 2 > 0).float().tolist()
    )
    assert tasks.label(1, batch.labels.numpy()).tolist() == bits[1].tolist()


@pytest.mark.parametrize(
    "column, message",
    [
        (
            pa.array([[1], [1, 2], [3], [0]], pa.list_(pa.int64())),
            r"t.parquet, row 1: label column 'actions' holds 2 value\(s\) for the row's 1 candidate\(s\) "
            r"\(feature 'cand_item'\)",
        ),
        (pa.array([1, 2, 3, 0]), r"label column 'actions' has type int64; the model scores each row's candidates"),
        (
            pa.array([[-1], [1], [2], [0]], pa.list_(pa.int64())),
            r"row 0: label column 'actions' holds -1.0; a bitmask label \(task_bitmask\) must be an integer from 0",
        ),
    ],
)
def test_labels_that_are_not_a_value_a_candidate_are_named(column, message):
    config = config_from_dict(CONFIG)
    one = {
        "cand_item": pa.array([[1], [2], [3], [4]], pa.list_(pa.int64())),
        "cand_time": pa.array([[1.6e9]] * 4, pa.list_(pa.float64())),
    }
    table = _table(4, 3, **one)
    with pytest.raises(DataError, match=message):
        BatchBuilder(config).build(
            table.set_column(table.schema.get_field_index("actions"), "actions", column), "t.parquet"
        )


def test_a_history_whose_times_do_not_line_up_with_its_items_is_named():
    config = config_from_dict(CONFIG)
    table = _table(3, 4, hist_item=pa.array([[1, 2], [3], []], pa.list_(pa.int64())))
    with pytest.raises(
        DataError, match=r"sequence features 'hist_item' and 'hist_\w+' .* history groups are one group"
    ):
        BatchBuilder(config).build(table, "t.parquet")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c["model"]["feature_groups"].pop(1), r"dlrm_hstu: needs the feature group\(s\) \['uih'\]"),
        (
            lambda c: c["model"]["dlrm_hstu"]["task_towers"][0].update(hidden_units=[8]),
            r"the fusion tower is shared; a task has no MLP of its own",
        ),
        (
            lambda c: c["model"]["feature_groups"].append({"group_name": "other", "feature_names": ["age"]}),
            r"group 'other' would be ignored",
        ),
        (
            lambda c: c["model"]["dlrm_hstu"]["hstu"].pop("action_mlp_hidden_dim"),
            r"action_encoder and action_mlp_hidden_dim go together",
        ),
    ],
)
def test_a_dlrm_hstu_config_that_cannot_work_is_refused(change, message):
    cfg = copy.deepcopy(CONFIG)
    change(cfg)
    with pytest.raises(Exception, match=message):
        config_from_dict(cfg)


def test_a_candidate_s_scores_do_not_depend_on_the_other_rows(tmp_path):
    config = load_config(_setup(tmp_path))
    trainer = Trainer(config, tmp_path / "model", device="cpu", progress=False)
    trainer.task.eval()
    table = _table(3, 5)
    builder = BatchBuilder(config)
    with torch.no_grad():
        together = trainer.task(builder.build(table, "t.parquet"))
        alone = torch.cat([trainer.task(builder.build(table.slice(i, 1), "t.parquet")) for i in range(3)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def _ultra(cfg: dict) -> dict:
    """CONFIG as an UltraHSTU of two channels over the same history: 'uih_a' as DlrmHSTU's,
    'uih_b' with semi-local attention and its history truncated to 2 tokens from layer 1."""
    cfg = copy.deepcopy(cfg)
    groups = cfg["model"]["feature_groups"]
    for g in list(groups):
        if g["group_name"].startswith("uih"):
            for channel in ("uih_a", "uih_b"):
                groups.append(dict(g, group_name=g["group_name"].replace("uih", channel)))
            groups.remove(g)
    block = cfg["model"].pop("dlrm_hstu")
    first = dict(block.pop("hstu"), name="uih_a")
    second = copy.deepcopy(first)
    second.update(name="uih_b", attn_truncation_split_layer=1, attn_truncation_tail_len=2)
    second["stu"].update(sla_k1=2, sla_k2=3)
    cfg["model"]["ultra_hstu"] = {**block, "hstu": [first, second]}
    return cfg


def test_ultra_hstu_mixes_its_channels_encodings(tmp_path):
    path = _setup(tmp_path)
    raw = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump(_ultra(raw), sort_keys=False))
    config = load_config(path)
    trainer = Trainer(config, tmp_path / "model", device="cpu", progress=False)
    model = trainer.task.dense
    assert len(model.transducers) == 2 and model.transducers[1].sla == (2, 3)
    assert model.tower.mlp[0].in_features == 32  # the fusion tower reads both channels' 16 + 16
    assert model.item_mlp[-1].normalized_shape == (32,)
    report = trainer.fit()
    assert report["eval"]["auc_click"] > 0.75
    with pytest.raises(Exception, match=r"ultra_hstu.hstu: each channel needs its own name"):
        cfg = _ultra(CONFIG)
        cfg["model"]["ultra_hstu"]["hstu"][1]["name"] = "uih_a"
        config_from_dict(cfg)


def _newest_first(table: pa.Table, columns: list[str]) -> pa.Table:
    """``table`` with each row's ``columns`` (lists) in reverse: its histories newest first."""
    for name in columns:
        reversed_rows = pa.array([row[::-1] for row in table.column(name).to_pylist()], table.column(name).type)
        table = table.set_column(table.schema.get_field_index(name), name, reversed_rows)
    return table


@pytest.mark.parametrize("kind", ["dlrm_hstu", "ultra_hstu"])
def test_newest_first_histories_score_as_the_same_histories_oldest_first(tmp_path, kind):
    """``sequence_timestamp_is_ascending: false`` (TorchEasyRec's flip of the features): a model
    reading each history newest first scores as the same model reading it oldest first."""
    cfg = copy.deepcopy(CONFIG) if kind == "dlrm_hstu" else _ultra(CONFIG)
    ascending = Trainer(config_from_dict(cfg), tmp_path / "a", device="cpu", progress=False)
    cfg["model"][kind]["sequence_timestamp_is_ascending"] = False
    descending = Trainer(config_from_dict(cfg), tmp_path / "d", device="cpu", progress=False)
    descending.task.load_state_dict(ascending.task.state_dict())
    table = _table(12, 7)  # (ultra_hstu's two channels read the same history)
    history = ["hist_item", "hist_time", "hist_action"]
    flipped = _newest_first(table, history)
    ascending.task.eval()
    descending.task.eval()
    with torch.no_grad():
        want = ascending.task(BatchBuilder(ascending.config).build(table, "t.parquet"))
        got = descending.task(BatchBuilder(descending.config).build(flipped, "t.parquet"))
        other = ascending.task(BatchBuilder(ascending.config).build(flipped, "t.parquet"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(other, want, atol=1e-3)  # (the order matters to the model)
