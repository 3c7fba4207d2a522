"""From YAML to tables: one optimizer spec reaches every table, fixed and dynamic."""

import pytest
import torch

from dynarec.config import config_from_dict, load_config
from dynarec.embedding import Initializer, JaggedBatch
from dynarec.embedding.dynamic import DynamicTable
from dynarec.optim import SGD, Adagrad
from dynarec.planner import plan_from_config
from dynarec.train.task import RankingTask
from dynarec.train.trainer import Trainer
from tests.pipeline_fixtures import config_dict, write_config


def test_initial_accumulator_value_from_yaml_reaches_every_table(tmp_path):
    cfg = load_config(write_config(tmp_path, config_dict()))
    task = RankingTask(cfg)
    coll = task.embeddings
    assert {t.config.kind for t in coll.tables.values()} == {"fixed", "dynamic"}
    for t in coll.tables.values():
        assert t.spec == Adagrad(lr=0.05, initial_accumulator_value=0.1)
        if not isinstance(t, DynamicTable):
            m1 = t.read_rows(torch.arange(t.num_embeddings))["momentum1"]
            assert torch.equal(m1, torch.full_like(m1, 0.1)), t.name
    # One training forward: pooled user_id (dynamic), item_id and cate_id (pooled) and the
    # histories (sequences) on the shared item and cate tables.
    batch = {
        "user_id": [[2**40]],
        "age": [[3]],
        "item_id": [[7]],
        "cate_id": [[2]],
        "hist_item_id": [[8, 9]],
        "hist_cate_id": [[4, 5]],
    }
    out = coll(JaggedBatch.from_lists(batch))
    ids = {"user_id": [2**40], "age": [3], "item": [7, 8, 9], "cate": [2, 4, 5]}
    before = {}
    for name, keys in ids.items():
        rows = coll.read_rows(name, torch.tensor(keys))  # fresh rows through the real path
        assert torch.equal(rows["momentum1"], torch.full_like(rows["momentum1"], 0.1)), name
        before[name] = rows["weight"].clone()
    sum(v.sum() for v in out.values()).backward()  # g = 1 everywhere
    h = torch.tensor(1.1)
    for name, keys in ids.items():
        rows = coll.read_rows(name, torch.tensor(keys))
        torch.testing.assert_close(rows["momentum1"], torch.full_like(rows["momentum1"], 1.1))
        torch.testing.assert_close(rows["weight"], before[name] - 0.05 / (h.sqrt() + 1e-8), rtol=1e-6, atol=1e-7)


def test_table_overrides_and_backend():
    c = config_dict(train__table_optimizers={"cate": {"sgd_optimizer": {"lr": 0.5}}})
    plan = plan_from_config(config_from_dict(c))
    specs = {t.table.name: t.optimizer for t in plan.tables}
    assert specs["cate"] == SGD(lr=0.5) and specs["item"] == Adagrad(lr=0.05, initial_accumulator_value=0.1)
    assert "item_id(sum), hist_item_id(none)" in plan.format()


def test_sparse_lr_schedule_changes_every_tables_updates(backend, tmp_path):
    c = config_dict(
        train__sparse_optimizer={"sgd_optimizer": {"lr": 0.5}},
        train__sparse_backend=backend,
        train__sparse_lr_schedule={"kind": "exponential_decay", "decay_steps": 1, "decay_rate": 0.5},
    )
    trainer = Trainer(config_from_dict(c), tmp_path / "m", progress=False)
    coll = trainer.task.embeddings
    batch = JaggedBatch.from_lists(
        {
            "user_id": [[11]],
            "age": [[3]],
            "item_id": [[7]],
            "cate_id": [[2]],
            "hist_item_id": [[8]],
            "hist_cate_id": [[4]],
        }
    )
    ids = {"user_id": [11], "age": [3], "item": [7], "cate": [2]}
    for step in range(3):
        trainer.step = step
        trainer._set_learning_rates()  # what every train step does first
        out = coll(batch)
        before = {n: coll.read_rows(n, torch.tensor(k))["weight"].clone() for n, k in ids.items()}
        sum(v.sum() for v in out.values()).backward()
        for name, keys in ids.items():
            delta = before[name] - coll.read_rows(name, torch.tensor(keys))["weight"]
            torch.testing.assert_close(
                delta, torch.full_like(delta, 0.5 * 0.5**step), rtol=1e-5, atol=1e-7, msg=f"{name} step {step}"
            )
    if backend == "fbgemm":
        assert coll.tables["item"].store.tbe.get_learning_rate() == pytest.approx(0.125)


# -- one vocabulary: every dynamic-table setting set in YAML arrives in the plan and the table -------

# A non-default value for every field of the core dynamic-table settings. A field added to
# DynamicTableOptions (or AdmissionConfig) without a value here fails the test below.
DYNAMIC_VALUES = {
    "max_capacity": 4096,
    "init_capacity": 128,
    "bucket_size": 8,
    "growth_load_factor": 0.5,
    "score_strategy": "lfu",
    "check_mode": "ignore",
    "admission": {"threshold": 3, "capacity": 1024, "initializer": {"kind": "constant", "value": 0.125}},
    "eval_initializer": {"kind": "normal", "mean": 0.5, "std": 0.01},
}


def test_the_plan_prints_each_tables_row_dtype():
    c = config_dict()
    for f in c["feature_configs"]:
        body = next(iter(f.values()))
        if body.get("embedding_name") == "item" or body["feature_name"] == "item_id":
            body["data_type"] = "bf16"
    plan = plan_from_config(config_from_dict(c))
    rows = {r["table"]: r for r in plan.describe()}
    assert rows["item"]["dtype"] == "bf16" and rows["cate"]["dtype"] == "fp32"
    assert plan.format().splitlines()[0].split()[:6] == ["table", "kind", "backend", "rows", "dim", "dtype"]


def test_every_dynamic_table_setting_reaches_plan_and_table():
    import dataclasses

    from dynarec.embedding import AdmissionConfig, DynamicTableOptions, Initializer

    assert {f.name for f in dataclasses.fields(DynamicTableOptions)} == set(DYNAMIC_VALUES)
    assert {f.name for f in dataclasses.fields(AdmissionConfig)} == set(DYNAMIC_VALUES["admission"])
    defaults = DynamicTableOptions(max_capacity=16)
    c = config_dict()
    c["feature_configs"][0]["id_feature"]["dynamicemb"] = DYNAMIC_VALUES
    plan = plan_from_config(config_from_dict(c))
    (user,) = [t.table for t in plan.tables if t.table.name == "user_id"]
    options = user.dynamic
    for name, value in DYNAMIC_VALUES.items():
        got = getattr(options, name)
        if name == "admission":
            value = AdmissionConfig(3, 1024, Initializer("constant", value=0.125))
        elif name == "eval_initializer":
            value = Initializer("normal", mean=0.5, std=0.01)
        assert got == value, name
        assert got != getattr(defaults, name), f"{name}: the test value must differ from the default"
    task = RankingTask(config_from_dict(c))
    assert task.embeddings.tables["user_id"].options is not None
    assert task.embeddings.tables["user_id"].options == options


@pytest.mark.parametrize(
    "setting, a, b",
    [
        ("backend", "native", "fbgemm"),
        ("initializer", {"kind": "constant", "value": 0.1}, {"kind": "normal", "std": 0.1}),
        ("trainable", True, False),
        ("num_buckets", 200, 300),
    ],
)
def test_settings_of_one_table_given_by_two_features_must_agree(setting, a, b):
    from dynarec.config import ConfigError

    c = config_dict()
    c["feature_configs"][2]["id_feature"][setting] = a  # item_id
    c["feature_configs"][4]["sequence_feature"][setting] = b  # hist_item_id, the same table 'item'
    with pytest.raises(
        ConfigError,
        match=rf"feature_configs\[4\] \(hist_item_id\): shares table 'item' with "
        rf"'item_id' but its {setting} differs \(item_id: .*, hist_item_id: .*\)",
    ):
        config_from_dict(c)
    c["feature_configs"][4]["sequence_feature"][setting] = a
    table = {t.table.name: t.table for t in plan_from_config(config_from_dict(c)).tables}["item"]
    assert {"backend": table.backend, "initializer": table.initializer, "num_buckets": table.num_embeddings}.get(
        setting, a
    ) == (Initializer(**a) if setting == "initializer" else a)


def test_yaml_refuses_bools_and_unknown_keys_in_core_types():
    from dynarec.config import ConfigError

    c = config_dict()
    c["feature_configs"][2]["id_feature"]["embedding_dim"] = True
    with pytest.raises(ConfigError, match=r"feature_configs\[2\].id_feature.embedding_dim"):
        config_from_dict(c)
    c = config_dict()
    c["feature_configs"][0]["id_feature"]["dynamicemb"]["max_capacity"] = True
    with pytest.raises(ConfigError, match=r"dynamicemb: max_capacity must be a number, got True"):
        config_from_dict(c)
    c = config_dict()
    c["feature_configs"][0]["id_feature"]["dynamicemb"]["admission"] = {"threshold": True}
    with pytest.raises(ConfigError, match=r"dynamicemb: threshold must be a number, got True"):
        config_from_dict(c)
    c = config_dict()
    c["feature_configs"][0]["id_feature"]["dynamicemb"]["max_capacty"] = 5
    with pytest.raises(ConfigError, match=r"feature_configs\[0\].id_feature.dynamicemb.max_capacty: unknown key"):
        config_from_dict(c)
    c = config_dict()
    c["feature_configs"][0]["id_feature"]["initializer"] = {"kind": "uniform", "bund": 0.1}
    with pytest.raises(ConfigError, match=r"feature_configs\[0\].id_feature.initializer.bund: unknown key"):
        config_from_dict(c)


def test_a_billion_key_dynamic_table_and_a_100m_row_table_plan_onto_64_ranks_of_80_gib():
    """The on-paper check that the design scales past the machines here (benchmarks/configs)."""
    from pathlib import Path

    from dynarec.config import load_config

    config = load_config(Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "plan_world64.yaml")
    plan = plan_from_config(config, world_size=64, memory_budget=80 << 30)
    assert {t.table.name: t.sharding.kind for t in plan.tables} == {"user_id": "key_hash", "item": "row_wise"}
    worst = max(plan.bytes_on(r) for r in range(64))
    assert 15 << 30 < worst < 20 << 30  # ~16.7 GiB: 1e9 x 128 x (weight + Adagrad state) / 64, plus the index
    assert "exchanged per step per rank" in plan.format()


def test_a_10b_key_dynamic_table_fits_64_h200s_with_its_rows_in_host_memory():
    """Issue 31's on-paper check: 10 billion keys at dim 128 (Adagrad) on 64 ranks of 141 GB HBM
    and 1 TB host memory fit with the rows in host memory behind a cache of a tenth of them, and
    not without; a host budget too small is an error naming the table."""
    from pathlib import Path

    import yaml

    from dynarec.config import config_from_dict
    from dynarec.planner.plan import PlanError

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "plan_world64_10b.yaml"
    raw = yaml.safe_load(path.read_text())
    plan = plan_from_config(config_from_dict(raw), world_size=64)
    device, host = max(plan.bytes_on(r) for r in range(64)), max(plan.host_bytes_on(r) for r in range(64))
    # per rank 156.25M slots: index 21 B + cache map 4 B a slot, a tenth cached at 1 KiB + 16 B; rows 1 KiB each
    assert 18 << 30 < device < 22 << 30 and 148 << 30 < host < 150 << 30
    assert "149.0 GiB in its host memory" in plan.format() and "host bytes/rank" in plan.format()
    whole = yaml.safe_load(path.read_text())
    del whole["feature_configs"][0]["id_feature"]["cache_load_factor"]
    with pytest.raises(PlanError, match=r"over train.memory_budget_per_rank 131.3 GiB: table 'user_id' \(key_hash\)"):
        plan_from_config(config_from_dict(whole), world_size=64)
    # Growing from 262,144 rows a rank by doubling, its last growth (134,217,728 -> 156,250,000 rows
    # a rank) holds the rows it grows from until the step commits: 128 GiB more host memory
    assert "and 277.0 GiB in its host memory at a last growth" in plan.format()
    raw["train"]["host_memory_budget_per_rank"] = "200GiB"
    with pytest.raises(
        PlanError,
        match=r"277.0 GiB of tables in the host memory of rank 0 of 64 \(a growing table's last growth included\), "
        r"over train.host_memory_budget_per_rank 200.0 GiB: table 'user_id' \(key_hash\) 277.0 GiB",
    ):
        plan_from_config(config_from_dict(raw), world_size=64)


def test_a_fixed_table_kept_in_host_memory_is_split_by_rows_where_it_would_overflow_a_ranks_host_budget():
    """A billion rows at dim 8 (Adagrad) behind a tiny cache: little on each device, but 59.6 GiB
    of rows in host memory — more than a quarter of a 40 GiB host budget, so split by rows (it
    fits 4 ranks), where the device bytes alone put it on one rank and refused the plan."""
    from dynarec.planner.plan import PlanError

    c = config_dict()
    c["feature_configs"][2]["id_feature"].update(num_buckets=1_000_000_000, cache_load_factor=0.0001)
    c["feature_configs"][4]["sequence_feature"].update(num_buckets=1_000_000_000, cache_load_factor=0.0001)
    c["train"].update(memory_budget_per_rank="40GiB", host_memory_budget_per_rank="40GiB")
    plan = plan_from_config(config_from_dict(c), world_size=4)
    item = next(t for t in plan.tables if t.table.name == "item")
    assert item.sharding.kind == "row_wise"
    assert max(plan.host_bytes_on(r) for r in range(4)) < 40 << 30
    with pytest.raises(
        PlanError, match=r"over train.host_memory_budget_per_rank 40.0 GiB: table 'item' \(table_wise\)"
    ):
        plan_from_config(config_from_dict(c), world_size=1)
