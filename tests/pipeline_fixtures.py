"""A tiny synthetic data set and config for pipeline tests."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from dynarec.data.synthetic import SyntheticSpec, make_click_log

TINY = SyntheticSpec(
    train_rows=1200, eval_rows=400, train_files=2, num_users=300, num_items=200, num_cates=10, max_hist_len=8, seed=1
)

BASE_CONFIG = {
    "feature_configs": [
        {
            "id_feature": {
                "feature_name": "user_id",
                "embedding_dim": 8,
                "value_type": "string",
                "dynamicemb": {"max_capacity": 512, "init_capacity": 64, "bucket_size": 8},
            }
        },
        {"id_feature": {"feature_name": "age", "embedding_dim": 4, "num_buckets": 8}},
        {"id_feature": {"feature_name": "item_id", "embedding_dim": 8, "num_buckets": 200, "embedding_name": "item"}},
        {"id_feature": {"feature_name": "cate_id", "embedding_dim": 4, "num_buckets": 10, "embedding_name": "cate"}},
        {
            "sequence_feature": {
                "feature_name": "hist_item_id",
                "sequence_length": 6,
                "embedding_dim": 8,
                "num_buckets": 200,
                "embedding_name": "item",
            }
        },
        {
            "sequence_feature": {
                "feature_name": "hist_cate_id",
                "sequence_length": 6,
                "embedding_dim": 4,
                "num_buckets": 10,
                "embedding_name": "cate",
            }
        },
        {"raw_feature": {"feature_name": "price", "normalizer": {"log1p": True, "mean": 3.0, "std": 0.8}}},
    ],
    "model": {
        "feature_groups": [
            {"group_name": "user", "feature_names": ["user_id", "age"]},
            {"group_name": "item", "feature_names": ["item_id", "cate_id", "price"]},
            {
                "group_name": "seq",
                "group_type": "sequence",
                "feature_names": ["item_id", "cate_id", "hist_item_id", "hist_cate_id"],
            },
        ],
        "multi_tower_din": {
            "towers": [{"input": "user", "hidden_units": [8]}, {"input": "item", "hidden_units": [8]}],
            "din_towers": [{"input": "seq", "attn_hidden_units": [8]}],
            "final_hidden_units": [8],
        },
    },
    "data": {"train_input_path": "data/train", "eval_input_path": "data/eval", "label_field": "clk", "batch_size": 100},
    "train": {
        "sparse_optimizer": {"adagrad_optimizer": {"lr": 0.05, "initial_accumulator_value": 0.1}},
        "dense_optimizer": {"adam_optimizer": {"lr": 0.01}},
        "num_epochs": 1,
        "log_step_count_steps": 5,
    },
}


def make_data(root: Path) -> dict:
    return make_click_log(root / "data", TINY)


def config_dict(**changes) -> dict:
    return changed(copy.deepcopy(BASE_CONFIG), **changes)


def changed(cfg: dict, **changes) -> dict:
    """``cfg`` with each ``section__key=value`` of ``changes`` set in place; returns it."""
    for path, value in changes.items():
        node = cfg
        *parents, last = path.split("__")
        for p in parents:
            node = node[p]
        node[last] = value
    return cfg


def write_config(root: Path, cfg: dict, name: str = "config.yaml") -> Path:
    path = root / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


CLICK_AND_BUY = [  # the click log's two labels: a purchase follows a click
    {"tower_name": "ctr", "label_name": "clk", "hidden_units": [8], "metrics": ["auc", "grouped_auc", "log_loss"]},
    {"tower_name": "cvr", "label_name": "buy", "hidden_units": [8], "metrics": ["auc", "log_loss"]},
]


def multi_task_config_dict(block: dict | None = None) -> dict:
    """BASE_CONFIG's features in one deep group, trained by an MMoE (or ``block``) on the click
    and the purchase."""
    cfg = config_dict()
    names = [next(iter(f.values()))["feature_name"] for f in cfg["feature_configs"]]
    del cfg["data"]["label_field"]
    cfg["model"] = {
        "feature_groups": [{"group_name": "all", "feature_names": names}],
        **copy.deepcopy(
            block or {"mmoe": {"expert_hidden_units": [16], "num_expert": 2, "task_towers": CLICK_AND_BUY}}
        ),
    }
    cfg["eval"] = {"grouped_auc_field": "user_id"}
    return cfg
