"""From YAML to tables: one optimizer spec reaches every table, fixed and dynamic."""

import pytest
import torch

from dynarec.config import config_from_dict, load_config
from dynarec.embedding import JaggedBatch
from dynarec.embedding.dynamic import DynamicTable
from dynarec.embedding.fbgemm_store import fbgemm_available
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
    batch = {"user_id": [[2**40]], "age": [[3]], "item_id": [[7]], "cate_id": [[2]],
             "hist_item_id": [[8, 9]], "hist_cate_id": [[4, 5]]}
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
    assert "item_id(sum), hist_item_id(none)" in plan.describe()


BACKENDS = ["native"] + (["fbgemm"] if fbgemm_available() else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_lr_schedule_changes_every_tables_updates(backend, tmp_path):
    c = config_dict(train__sparse_optimizer={"sgd_optimizer": {"lr": 0.5}},
                    train__sparse_backend=backend,
                    train__sparse_lr_schedule={"kind": "exponential_decay", "decay_steps": 1, "decay_rate": 0.5})
    trainer = Trainer(config_from_dict(c), tmp_path / "m", progress=False)
    coll = trainer.task.embeddings
    batch = JaggedBatch.from_lists({"user_id": [[11]], "age": [[3]], "item_id": [[7]], "cate_id": [[2]],
                                    "hist_item_id": [[8]], "hist_cate_id": [[4]]})
    ids = {"user_id": [11], "age": [3], "item": [7], "cate": [2]}
    for step in range(3):
        trainer.step = step
        trainer._set_learning_rates()  # what every train step does first
        out = coll(batch)
        before = {n: coll.read_rows(n, torch.tensor(k))["weight"].clone() for n, k in ids.items()}
        sum(v.sum() for v in out.values()).backward()
        for name, keys in ids.items():
            delta = before[name] - coll.read_rows(name, torch.tensor(keys))["weight"]
            torch.testing.assert_close(delta, torch.full_like(delta, 0.5 * 0.5**step), rtol=1e-5, atol=1e-7,
                                       msg=f"{name} step {step}")
    if backend == "fbgemm":
        assert coll.tables["item"].store.tbe.get_learning_rate() == pytest.approx(0.125)
