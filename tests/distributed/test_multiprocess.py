"""Multi-process training on CPU (gloo, torchrun): the same results as one process on the same
global batches, checkpoints that reshard across world sizes, and faults that stop every rank."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dynarec.cli import main
from dynarec.config import load_config
from dynarec.distributed.reshard import tables_for_rank
from dynarec.planner import plan_from_config
from dynarec.serving import ExportedModel
from dynarec.train.checkpoint import latest_checkpoint, load_checkpoint
from tests.pipeline_fixtures import config_dict, make_data, multi_task_config_dict, write_config

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
TOL = dict(rtol=1e-5, atol=1e-6)
STEPS = 10


def run(*args, timeout=300):
    proc = subprocess.run(
        [sys.executable, "-m", "dynarec", *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    return proc.returncode, proc.stdout + proc.stderr


def mixed_config(root, batch_size, **train):
    """Every sharding type at 2 ranks: a dynamic user table (key_hash), a replicated age table
    (data_parallel), an item table shared by the candidate and the history (row_wise) and a
    category table (table_wise); Adagrad with initial_accumulator_value 0.1."""
    c = config_dict()
    c["feature_configs"][0]["id_feature"]["dynamicemb"] = {"max_capacity": 4096, "init_capacity": 64, "bucket_size": 8}
    for i in (2, 4):
        next(iter(c["feature_configs"][i].values()))["sharding"] = "row_wise"
    for i in (3, 5):
        next(iter(c["feature_configs"][i].values()))["sharding"] = "table_wise"
    c["data"]["batch_size"] = batch_size
    del c["train"]["num_epochs"]
    c["train"].update({"num_steps": STEPS, "save_checkpoints_steps": 5, **train})
    return c


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 10 global batches of 120 rows: one process (batch 120), two (60 each)."""
    root = tmp_path_factory.mktemp("dist")
    make_data(root)
    one = write_config(root, mixed_config(root, 120), "one.yaml")
    two = write_config(root, mixed_config(root, 60), "two.yaml")
    rc, out = run("train", "--config", one, "--model-dir", root / "m1", "--no-progress")
    assert rc == 0, out
    rc, out = run("train", "--config", two, "--model-dir", root / "m2", "--no-progress", "--nproc", 2)
    assert rc == 0, out
    return root


def merged_tables(model_dir):
    """Every table of a model dir's latest checkpoint, whole (merged from its shards)."""
    state, shards = load_checkpoint(latest_checkpoint(model_dir / "checkpoints"))
    plan = plan_from_config(load_config(model_dir / "config.yaml"))
    return state, tables_for_rank(plan, 0, state["plan"], shards)


def assert_tables_close(a, b, exact=False, steps=STEPS):
    assert a.keys() == b.keys()
    for name in a:
        ka, kb = a[name].get("keys"), b[name].get("keys")
        if ka is not None:  # dynamic: the same keys, compared by key
            assert torch.equal(ka.sort().values, kb.sort().values), name
            ia, ib = torch.argsort(ka), torch.argsort(kb)
        else:
            ia = ib = slice(None)
        for field in ("weight", "momentum1"):
            x, y = a[name][field][ia], b[name][field][ib]
            if exact:
                assert torch.equal(x, y), (name, field)
            else:
                torch.testing.assert_close(x, y, **TOL, msg=f"{name}.{field}")
        assert int(a[name]["step"]) == int(b[name]["step"]) == steps


def test_two_processes_equal_one_on_the_same_global_batches(runs):
    s1, t1 = merged_tables(runs / "m1")
    s2, t2 = merged_tables(runs / "m2")
    assert s1["step"] == s2["step"] == STEPS and s2["plan"]["world_size"] == 2
    assert {n: t["kind"] for n, t in s2["plan"]["tables"].items()} == {
        "user_id": "key_hash",
        "age": "data_parallel",
        "item": "row_wise",
        "cate": "table_wise",
    }
    assert t1["user_id"]["keys"].numel() > 64  # the dynamic shards grew on the way
    assert_tables_close(t1, t2)
    for k in s1["dense"]:
        torch.testing.assert_close(s1["dense"][k], s2["dense"][k], **TOL, msg=k)
    # the loss logged is the global batch's (a rank's share of it was logged: about half)
    h1, h2 = (json.loads((runs / m / "metrics.json").read_text())["history"]["train_loss"] for m in ("m1", "m2"))
    assert [s for s, _ in h1] == [s for s, _ in h2] and len(h1) >= 2
    np.testing.assert_allclose([v for _, v in h2], [v for _, v in h1], rtol=1e-5)


def test_the_export_of_a_two_process_run_equals_the_one_process_export(runs, tmp_path):
    for m in ("m1", "m2"):
        assert main(["export", "--model-dir", str(runs / m), "--export-dir", str(tmp_path / m)]) == 0
    e1, e2 = ExportedModel(tmp_path / "m1"), ExportedModel(tmp_path / "m2")
    assert e1.key_counts == e2.key_counts
    for name, table in e1.embeddings.tables.items():
        keys = table.dump().get("keys", torch.arange(table.dump()["weight"].shape[0]))
        torch.testing.assert_close(
            table.read_rows(keys)["weight"], e2.embeddings.tables[name].read_rows(keys)["weight"], **TOL
        )
    eval_file = runs / "data" / "eval" / "part-0.parquet"
    np.testing.assert_allclose(
        e1.predict_files(str(eval_file))["probability"],
        e2.predict_files(str(eval_file))["probability"],
        rtol=0,
        atol=1e-5,
    )


def test_a_two_process_model_whose_dynamic_shards_are_full_is_evaluated_and_exported_in_one(runs, tmp_path):
    """A table that fills and evicts (the steady state of a real run), trained on 2 ranks: each
    shard full, one process's max_capacity cannot place all their keys in its buckets, and
    evaluate, export and predict refused the model for good. They read it with every key."""
    c = mixed_config(runs, 60)
    c["feature_configs"][0]["id_feature"]["dynamicemb"] = {
        "max_capacity": 128, "init_capacity": 128, "bucket_size": 8, "score_strategy": "step",
    }  # fmt: skip
    cfg = write_config(runs, c, "full2.yaml")
    rc, out = run("train", "--config", cfg, "--model-dir", tmp_path / "m", "--no-progress", "--nproc", 2)
    assert rc == 0, out
    _, tables = merged_tables(tmp_path / "m")
    keys = tables["user_id"]["keys"]
    assert keys.numel() == 128  # both shards full
    assert main(["export", "--model-dir", str(tmp_path / "m"), "--export-dir", str(tmp_path / "e")]) == 0
    served = ExportedModel(tmp_path / "e").embeddings.tables["user_id"]
    assert bool(served.read_rows(keys)["present"].all())
    order = torch.argsort(keys)
    torch.testing.assert_close(served.read_rows(keys[order])["weight"], tables["user_id"]["weight"][order], **TOL)
    rc, out = run("evaluate", "--model-dir", tmp_path / "m")
    assert rc == 0 and '"auc"' in out, out


def test_gradient_accumulation_on_two_processes_equals_one(runs, tmp_path):
    """The dense model's gradients are summed over the ranks (a comm hook) and accumulated over a
    window's steps: each rank's earlier steps must be summed over the ranks once."""
    models = {}
    for name, batch, nproc in (("one", 120, 1), ("two", 60, 2)):
        c = mixed_config(runs, batch, gradient_accumulation_steps=2, save_checkpoints_steps=STEPS)
        cfg = write_config(runs, c, f"acc-{name}.yaml")
        rc, out = run("train", "--config", cfg, "--model-dir", tmp_path / name, "--no-progress", "--nproc", nproc)
        assert rc == 0, out
        models[name] = merged_tables(tmp_path / name)
    (s1, t1), (s2, t2) = models["one"], models["two"]
    assert_tables_close(t1, t2)
    for k in s1["dense"]:
        torch.testing.assert_close(s1["dense"][k], s2["dense"][k], **TOL, msg=k)


def assert_one_process_equals_two(configs, tmp_path) -> dict:
    """Trains ``configs[0]`` in one process and ``configs[1]`` on two; their tables and dense
    models must agree. Returns the dense model's state."""
    for config, model_dir, nproc in ((configs[0], "m1", 1), (configs[1], "m2", 2)):
        rc, out = run(
            "train", "--config", config, "--model-dir", tmp_path / model_dir, "--no-progress", "--nproc", nproc
        )
        assert rc == 0, out
    s1, t1 = merged_tables(tmp_path / "m1")
    s2, t2 = merged_tables(tmp_path / "m2")
    assert s2["plan"]["world_size"] == 2
    assert_tables_close(t1, t2)
    for k in s1["dense"]:
        torch.testing.assert_close(s1["dense"][k], s2["dense"][k], **TOL, msg=k)
    return s1["dense"]


def test_a_multi_task_model_on_two_processes_equals_one(runs, tmp_path):
    """MMoE with a task-space weight (its normalizer summed over both ranks' rows): the tables
    and the dense model of 2 x 60 rows a step equal those of 1 x 120."""
    configs = []
    for batch in (120, 60):
        c = multi_task_config_dict()
        mixed = mixed_config(runs, batch)
        c["feature_configs"], c["train"] = mixed["feature_configs"], mixed["train"]
        c["data"]["batch_size"] = batch
        c["model"]["mmoe"]["task_towers"][1].update(task_space_indicator_label="clk", out_task_space_weight=0.25)
        configs.append(write_config(runs, c, f"mt{batch}.yaml"))
    assert_one_process_equals_two(configs, tmp_path)


def test_batch_norms_on_two_processes_equal_one(runs, tmp_path):
    """Dice activations (a batch norm each) in every MLP: their statistics are the global
    batch's, so the dense model, running statistics included, and the tables of 2 x 60 rows a
    step equal those of 1 x 120."""
    configs = []
    for batch in (120, 60):
        c = mixed_config(runs, batch)
        din = c["model"]["multi_tower_din"]
        for tower in din["towers"] + din["din_towers"]:
            tower["activation"] = "dice"
        din["final_activation"] = "dice"
        configs.append(write_config(runs, c, f"dice{batch}.yaml"))
    dense = assert_one_process_equals_two(configs, tmp_path)
    assert any(k.endswith("bn.running_var") for k in dense)


def test_half_precision_rows_on_two_processes_equal_one(runs, tmp_path):
    """bf16 rows on every sharding type: the rounding draws are keyed by (seed, step, key), not
    by where a row lives, so 2 x 60 rows a step store what 1 x 120 store (a draw could flip only
    where the fp32 updates, equal to 1e-5, straddle it)."""
    configs = []
    for batch in (120, 60):
        c = mixed_config(runs, batch)
        for f in c["feature_configs"]:
            body = next(iter(f.values()))
            if "embedding_dim" in body:
                body["data_type"] = "bf16"
        configs.append(write_config(runs, c, f"bf16_{batch}.yaml"))
    for config, model_dir, nproc in ((configs[0], "h1", 1), (configs[1], "h2", 2)):
        rc, out = run(
            "train", "--config", config, "--model-dir", tmp_path / model_dir, "--no-progress", "--nproc", nproc
        )
        assert rc == 0, out
    (_, t1), (s2, t2) = merged_tables(tmp_path / "h1"), merged_tables(tmp_path / "h2")
    assert s2["plan"]["world_size"] == 2 and t1.keys() == t2.keys()
    for name in t1:
        ka, kb = t1[name].get("keys"), t2[name].get("keys")
        ia, ib = (torch.argsort(ka), torch.argsort(kb)) if ka is not None else (slice(None), slice(None))
        x, y = t1[name]["weight"][ia].float(), t2[name]["weight"][ib].float()
        assert torch.equal(x, x.to(torch.bfloat16).float())  # stored as bf16
        assert (x == y).float().mean() > 0.999, name
        torch.testing.assert_close(x, y, rtol=2**-7, atol=1e-6, msg=name)  # a flip is one bf16 step


def test_fp16_loss_scaling_on_two_processes(runs, tmp_path):
    """FP16 with loss scaling on every sharding type. A scale that overflows none of the steps
    (2^10): the tables see the unscaled gradients on each rank, and 2 x 60 rows a step equal
    1 x 120 to fp16's 1e-3 (the dense model to 5e-3). A scale that overflows the first steps
    (2^30): every rank takes every overflow as its own (a rank that aborted alone would leave the
    others' collectives waiting), and the run ends with the steps after them applied."""
    configs = []
    for batch in (120, 60):
        c = mixed_config(runs, batch, mixed_precision="fp16", grad_scaler={"init_scale": 1024.0})
        configs.append(write_config(runs, c, f"fp16_{batch}.yaml"))
    c = mixed_config(runs, 60, mixed_precision="fp16", grad_scaler={"init_scale": 2.0**30})
    overflowing = write_config(runs, c, "fp16_overflow.yaml")
    for config, model_dir, nproc in ((configs[0], "f1", 1), (configs[1], "f2", 2), (overflowing, "f3", 2)):
        rc, out = run(
            "train", "--config", config, "--model-dir", tmp_path / model_dir, "--no-progress", "--nproc", nproc
        )
        assert rc == 0, out
    finals = [json.loads((tmp_path / d / "metrics.json").read_text())["final"] for d in ("f1", "f2", "f3")]
    assert finals[0]["overflow_skipped_steps"] == finals[1]["overflow_skipped_steps"] == 0
    assert 0 < finals[2]["overflow_skipped_steps"] < STEPS and finals[2]["loss_scale"] < 2.0**30
    (s1, t1), (s2, t2) = merged_tables(tmp_path / "f1"), merged_tables(tmp_path / "f2")
    assert s2["plan"]["world_size"] == 2 and s1["loss_scaler"] == s2["loss_scaler"]
    for name in t1:
        ka, kb = t1[name].get("keys"), t2[name].get("keys")
        ia, ib = (torch.argsort(ka), torch.argsort(kb)) if ka is not None else (slice(None), slice(None))
        if ka is not None:
            assert torch.equal(ka.sort().values, kb.sort().values), name
        torch.testing.assert_close(t1[name]["weight"][ia], t2[name]["weight"][ib], rtol=1e-3, atol=1e-5, msg=name)
    for k in s1["dense"]:
        # Adam's normalized steps carry float16's rounding of the two splits of a batch (measured 2.7e-3)
        torch.testing.assert_close(s1["dense"][k], s2["dense"][k], rtol=0, atol=5e-3, msg=k)


def test_tables_cached_from_host_memory_on_two_processes_equal_one(runs, tmp_path):
    """The item table (row_wise), the category table (table_wise) and the user table (dynamic,
    key-hash sharded; a cache of a tenth of each shard's keys) with their rows in host memory
    behind a device cache (``cache_load_factor``), on two processes: each shard caches its own
    rows, and the run equals the one-process run without caches (to the sharded runs' 1e-5)."""
    c = mixed_config(runs, 60)
    for i in (2, 3, 4, 5):
        next(iter(c["feature_configs"][i].values()))["cache_load_factor"] = 1.0
    c["feature_configs"][0]["id_feature"]["cache_load_factor"] = 0.1
    config = write_config(runs, c, "cached_60.yaml")
    rc, out = run("train", "--config", config, "--model-dir", tmp_path / "c2", "--no-progress", "--nproc", 2)
    assert rc == 0, out
    (_, t1), (s2, t2) = merged_tables(runs / "m1"), merged_tables(tmp_path / "c2")
    assert s2["plan"]["world_size"] == 2
    assert_tables_close(t1, t2)


def test_a_run_resumes_with_its_tables_sharding_changed_as_if_it_had_not(runs, tmp_path):
    """sharding says where rows live, as cache_load_factor does: a resume with the item table
    table_wise and the category table row_wise (they were row_wise and table_wise) trains on to
    the tables of a resume that changed nothing (was: refused as a different config)."""
    swapped = mixed_config(runs, 60, num_steps=STEPS + 2)
    for i, kind in ((2, "table_wise"), (4, "table_wise"), (3, "row_wise"), (5, "row_wise")):
        next(iter(swapped["feature_configs"][i].values()))["sharding"] = kind
    configs = {"same": mixed_config(runs, 60, num_steps=STEPS + 2), "swapped": swapped}
    tables = {}
    for name, c in configs.items():
        subprocess.run(["cp", "-r", str(runs / "m2"), str(tmp_path / name)], check=True)
        cfg = write_config(runs, c, f"sharding-{name}.yaml")
        model_dir = tmp_path / name
        rc, out = run("train", "--config", cfg, "--model-dir", model_dir, "--resume", "--no-progress", "--nproc", 2)
        assert rc == 0, out
        state, tables[name] = merged_tables(tmp_path / name)
        assert state["step"] == STEPS + 2
    assert state["plan"]["tables"]["item"]["kind"] == "table_wise", state["plan"]["tables"]["item"]
    assert_tables_close(tables["same"], tables["swapped"], exact=True, steps=STEPS + 2)


def test_checkpoints_reshard_two_to_three_to_one_and_one_to_two(runs, tmp_path):
    # A resume needs the same global batch: 2 x 60 -> 3 x 50 is refused naming both.
    subprocess.run(["cp", "-r", str(runs / "m2"), str(tmp_path / "m3")], check=True)
    wrong = write_config(runs, mixed_config(runs, 50), "wrong.yaml")
    rc, out = run("train", "--config", wrong, "--model-dir", tmp_path / "m3", "--resume", "--no-progress", "--nproc", 3)
    assert rc != 0, out
    assert "global batch of 120 rows (2 ranks x data.batch_size 60), this run's is 150 (3 ranks x" in out, out
    assert "resume with data.batch_size 40 at 3 ranks" in out, out
    # 2 -> 3 (3 x 40): no step left, so the checkpoint is rewritten by 3 ranks, every row and
    # state as it was; then 3 -> 1 (merged_tables loads it whole).
    three = write_config(runs, mixed_config(runs, 40), "three.yaml")
    rc, out = run("train", "--config", three, "--model-dir", tmp_path / "m3", "--resume", "--no-progress", "--nproc", 3)
    assert rc == 0, out
    s3, t3 = merged_tables(tmp_path / "m3")
    assert s3["plan"]["world_size"] == 3
    _, t2 = merged_tables(runs / "m2")
    assert_tables_close(t2, t3, exact=True)
    # 1 -> 2: the one-process checkpoint resumed by two ranks, then merged back: unchanged.
    subprocess.run(["cp", "-r", str(runs / "m1"), str(tmp_path / "m12")], check=True)
    rc, out = run(
        "train",
        "--config",
        runs / "two.yaml",
        "--model-dir",
        tmp_path / "m12",
        "--resume",
        "--no-progress",
        "--nproc",
        2,
    )
    assert rc == 0, out
    _, t12 = merged_tables(tmp_path / "m12")
    _, t1 = merged_tables(runs / "m1")
    assert_tables_close(t1, t12, exact=True)


def with_bad_value(path, column, row, value, directory):
    """``directory`` holding a copy of the Parquet file ``path`` whose ``column`` is ``value`` at ``row``."""
    src = pq.read_table(path)
    values = src.column(column).to_pylist()
    values[row] = value
    i = src.schema.get_field_index(column)
    directory.mkdir()
    pq.write_table(src.set_column(i, column, pa.array(values, src.schema.field(column).type)), directory / path.name)
    return directory


def train_two_ranks(config, model_dir):
    return run("train", "--config", config, "--model-dir", model_dir, "--no-progress", "--nproc", 2, timeout=240)


def test_a_bad_row_in_one_ranks_share_stops_both_ranks_with_its_message(runs, tmp_path):
    # step 3 (rows 240-359): rank 1's share is rows 300-359
    data = with_bad_value(runs / "data" / "train" / "part-0.parquet", "cate_id", 305, 10_000, tmp_path / "data")
    c = mixed_config(runs, 60)
    c["data"].update(train_input_path=str(data), eval_input_path=None)
    rc, out = train_two_ranks(write_config(runs, c, "bad.yaml"), tmp_path / "m")
    assert rc != 0
    message = "part-0.parquet, row 305: feature 'cate_id' (column 'cate_id'): id 10000 is out of range"
    assert out.count(message) >= 2, out  # both ranks report rank 1's message
    assert "rank 1: DataError" in out
    # the two steps before it are saved by both ranks (the failed step was undone on both)
    assert f"the 2 steps trained are saved in {tmp_path / 'm' / 'checkpoints' / 'ckpt-0000000002'}" in out, out
    # at the failed step's batch: a resume trains it once the data is fixed (it recorded the row after it)
    state = torch.load(tmp_path / "m" / "checkpoints" / "ckpt-0000000002" / "state.pt", weights_only=False)
    assert (state["step"], state["epoch"], state["row"]) == (2, 0, 240)


def test_a_bad_eval_row_in_one_ranks_share_stops_both_ranks_saving_the_steps(runs, tmp_path):
    """The evaluation twin of the above: rank 1 raised its DataError alone, rank 0 waited in the
    forward's collectives and died of the closed connection, and nothing was saved; now every
    rank agrees at the batch, both save the steps trained and stop with rank 1's message."""
    # eval batch 1 (rows 0-119): rank 1's share is rows 60-119
    data = with_bad_value(runs / "data" / "eval" / "part-0.parquet", "clk", 70, 2, tmp_path / "eval")
    c = mixed_config(runs, 60, num_steps=4, eval_every_steps=2)
    c["data"]["eval_input_path"] = str(data)
    rc, out = train_two_ranks(write_config(runs, c, "bad-eval.yaml"), tmp_path / "m")
    assert rc != 0
    assert "reading eval batch 1 failed on rank 1: DataError" in out and "row 70: label column 'clk'" in out, out
    assert f"the 2 steps trained are saved in {tmp_path / 'm' / 'checkpoints' / 'ckpt-0000000002'}" in out, out
    assert "Connection closed" not in out and "Traceback" not in out, out


KILL = r"""
import os, signal, sys
from dynarec.config import load_config
from dynarec.distributed.context import init_distributed
from dynarec.train import checkpoint
from dynarec.train.trainer import Trainer

ctx = init_distributed("cpu", timeout_s=60)
trainer = Trainer(load_config(sys.argv[1]), sys.argv[2], progress=False, ctx=ctx)
trainer.fit()  # 10 steps; ckpt-10 committed
if ctx.rank == 1:
    real = checkpoint._write_file
    def die(path, obj):
        real(path, obj)
        os.kill(os.getpid(), signal.SIGKILL)  # killed in the middle of writing its files
    checkpoint._write_file = die
trainer.step += 1
trainer.save()
"""


def test_a_bad_config_with_nproc_is_one_error_and_starts_no_rank(runs, tmp_path):
    """Every rank printed the same config error, then torchrun its failure lines (or the ranks'
    lines ran together); the launcher now checks the config first."""
    c = mixed_config(runs, 60)
    c["train"]["no_such_key"] = 1
    cfg = write_config(runs, c, "bad-key.yaml")
    rc, out = run("train", "--config", cfg, "--model-dir", tmp_path / "m", "--nproc", 2)
    assert rc == 2, out
    errors = [line for line in out.splitlines() if line.startswith("dynarec train: error:")]
    assert len(errors) == 1 and "train.no_such_key: unknown key" in out, out
    assert "torchrun" not in out and "exitcode" not in out and "Traceback" not in out, out
    assert not (tmp_path / "m").exists()


NODE_LOCAL = r"""
import sys
from dynarec.config import load_config
from dynarec.distributed.context import init_distributed
from dynarec.train.trainer import Trainer

ctx = init_distributed("cpu", timeout_s=60)
config = load_config(sys.argv[1])
data = config.data.model_copy(update={"train_input_path": sys.argv[3 + ctx.rank]})  # each "node" its own copy
Trainer(config.model_copy(update={"data": data}), sys.argv[2], progress=False, ctx=ctx).fit()
"""


def test_ranks_reading_different_training_files_are_refused_naming_the_file(runs, tmp_path):
    """Node-local copies of the data where one node lacks a file: the job hung until the
    collective timeout (num_epochs) or trained on inconsistent global batches and exited 0
    (num_steps); now every rank stops at once naming the file, before anything is written."""
    import shutil

    for node in ("a", "b"):
        shutil.copytree(runs / "data" / "train", tmp_path / node)
    (tmp_path / "b" / "part-1.parquet").unlink()
    script = tmp_path / "node_local.py"
    script.write_text(NODE_LOCAL)
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)),
            *(str(runs / "two.yaml"), str(tmp_path / "m"), str(tmp_path / "a"), str(tmp_path / "b")),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "the ranks do not read the same training files: file 2 of epoch 1 is 'part-1.parquet'" in out, out[-3000:]
    assert "and no file on rank 1 (2 and 1 files)" in out, out[-3000:]
    assert "gave up waiting" not in out, out[-3000:]
    assert not (tmp_path / "m" / "checkpoints").exists()


def test_a_rank_killed_mid_checkpoint_leaves_the_previous_one_latest(runs, tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(KILL)
    cfg = runs / "two.yaml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(script),
            str(cfg),
            str(tmp_path / "m"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode != 0
    # the survivor fails at once, and never says it gave up waiting past the timeout (it did); where
    # a collective of dynarec's reports it (not always: gloo may fail first elsewhere), it says so
    out = proc.stdout + proc.stderr
    assert "gave up waiting" not in out, out[-3000:]
    assert "collective timeout" not in out or "before the collective timeout" in out, out[-3000:]
    latest = latest_checkpoint(tmp_path / "m" / "checkpoints")
    assert latest.name == "ckpt-0000000010"
    state, shards = load_checkpoint(latest)
    assert state["step"] == STEPS and len(shards) == 2


SIGTERM_IN_EVAL = r"""
import sys
from dynarec.config import load_config
from dynarec.distributed.context import init_distributed
from dynarec.train.stop import TrainingStopped
from dynarec.train.trainer import Trainer
from tests.train.test_faults import _SigtermAfterFirstEvalBatch

import torch.distributed as dist

ctx = init_distributed("cpu", timeout_s=60)
trainer = Trainer(load_config(sys.argv[1]), sys.argv[2], progress=False, ctx=ctx)
if ctx.rank == 1:  # the signal reaches one rank only
    trainer.evaluator.input = probe = _SigtermAfterFirstEvalBatch(trainer.input)
try:
    trainer.fit()
except TrainingStopped as e:
    print(f"rank {ctx.rank} stopped: {e}", flush=True)
finally:  # as `dynarec train` ends a rank: a process group left to the interpreter's exit may abort it
    dist.destroy_process_group()
"""


def test_a_sigterm_to_one_rank_during_an_evaluation_stops_both_at_the_same_batch_saved(runs, tmp_path):
    """A stop asked of one rank while the ranks evaluate is agreed at every eval batch: both
    leave the evaluation at the same batch (a rank left alone in its collectives would wait for
    the timeout), save the steps together and stop."""
    c = mixed_config(runs, 60, eval_every_steps=3, save_checkpoints_steps=None)
    c["data"]["eval_batch_size"] = 50  # 8 eval batches a rank
    config = write_config(runs, c, "sigterm-eval.yaml")
    script = tmp_path / "sigterm_eval.py"
    script.write_text(SIGTERM_IN_EVAL)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), str(config),
         str(tmp_path / "m")],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    checkpoint = tmp_path / "m" / "checkpoints" / "ckpt-0000000003"
    for rank in (0, 1):
        assert (
            f"rank {rank} stopped: stopped by SIGTERM after step 3; the model is saved in {checkpoint}" in proc.stdout
        )
    state, shards = load_checkpoint(latest_checkpoint(tmp_path / "m" / "checkpoints"))
    assert state["step"] == 3 and len(shards) == 2 and json.loads(state["history"])["eval"] == []


def test_a_retrieval_model_with_its_negative_sampler_trains_on_two_processes(tmp_path):
    """DSSM with TorchEasyRec's negative sampler on two processes: each rank samples the items of
    its share of the batch and scores its users against them (per-rank negatives, as
    TorchEasyRec's: the run differs from one process by design, so it is compared on quality).
    With as many steps (two processes of the same batch each, twice the epochs), both runs learn
    the click log to far better than chance recall (1/21 at recall@1; measured 0.55 and 0.55)."""
    import json

    from tests.data.test_sampler import dssm_config
    from tests.models.test_retrieval import item_table_of

    make_data(tmp_path)
    c = dssm_config(item_table_of(tmp_path), num_sample=20)
    for key in ("train_input_path", "eval_input_path"):
        c["data"][key] = str(tmp_path / c["data"][key])
    recall = {}
    for nproc in (1, 2):
        c["train"]["num_epochs"] = 6 * nproc
        config = write_config(tmp_path, c, f"dssm{nproc}.yaml")
        rc, out = run("train", "--config", config, "--model-dir", tmp_path / f"d{nproc}", "--no-progress", "--nproc",
                      nproc)  # fmt: skip
        assert rc == 0, out
        final = json.loads((tmp_path / f"d{nproc}" / "metrics.json").read_text())["final"]
        assert final["step"] == 72, final
        recall[nproc] = final["eval"]["recall@1"]
    assert recall[1] > 0.3 and recall[2] > 0.3, recall


def test_an_rqvae_with_pairs_on_two_processes_equals_one(tmp_path):
    """RQ-VAE's Sinkhorn assignment (its cost standardized and its sums taken over both ranks'
    rows) and the pair contrastive loss (every rank's pair rows as columns): the dense model of
    2 x 60 rows a step equals that of 1 x 120."""
    from tests.models.test_sid import hierarchical_items, sid_config, write_items

    x = hierarchical_items(1200, seed=3)
    data = write_items(tmp_path / "items.parquet", x, pairs=x + 0.05)
    states = []
    for nproc, batch in ((1, 120), (2, 60)):
        c = sid_config(pairs=True, data=data)
        c["data"]["batch_size"] = batch
        c["train"].update(num_epochs=None, num_steps=STEPS)
        config = write_config(tmp_path, c, f"rqvae{nproc}.yaml")
        rc, out = run("train", "--config", config, "--model-dir", tmp_path / f"r{nproc}", "--no-progress", "--nproc",
                      nproc)  # fmt: skip
        assert rc == 0, out
        states.append(load_checkpoint(latest_checkpoint(tmp_path / f"r{nproc}" / "checkpoints"))[0]["dense"])
    for k in states[0]:
        torch.testing.assert_close(states[0][k], states[1][k], **TOL, msg=k)


def test_hstu_match_with_a_dynamic_item_table_trains_on_two_processes(tmp_path):
    """HSTUMatch on two processes (each rank samples the items of its share and scores its
    queries against them, as TorchEasyRec's; the loss the mean over both ranks' queries), its
    item table dynamic and row-wise sharded: both runs learn the users' tastes far above chance
    (1/21 at recall@1)."""
    from tests.models.test_hstu_match import config, write_log

    write_log(tmp_path, 1500, 0)
    write_log(tmp_path, 300, 1)
    finals = _runs_with_a_dynamic_item_table(tmp_path, lambda: config(tmp_path), 15, "match")
    recall = {nproc: final["eval"]["recall@1"] for nproc, final in finals.items()}
    assert recall[1] > 0.2 and recall[2] > 0.2, recall


def _runs_with_a_dynamic_item_table(tmp_path, config_of, epochs: int, name: str) -> dict[int, dict]:
    """The final metrics of ``dynarec train`` on one and on two processes of ``config_of()``,
    its ``item`` table made dynamic, with as many steps (two ranks of the same batch each: twice
    the epochs)."""
    finals = {}
    for nproc in (1, 2):
        c = config_of()
        for f in c["feature_configs"]:
            body = next(iter(f.values()))
            if body.get("embedding_name") == "item":
                body.pop("num_buckets")
                body["dynamicemb"] = {"max_capacity": 1024, "init_capacity": 64, "bucket_size": 8}
        c["train"]["num_epochs"] = epochs * nproc
        config_path = write_config(tmp_path, c, f"{name}{nproc}.yaml")
        model_dir = tmp_path / f"{name}{nproc}"
        rc, out = run("train", "--config", config_path, "--model-dir", model_dir, "--no-progress", "--nproc", nproc)
        assert rc == 0, out
        finals[nproc] = json.loads((model_dir / "metrics.json").read_text())["final"]
    return finals


def test_tdm_with_a_dynamic_item_table_trains_on_two_processes(tmp_path):
    """TDM on two processes, its item table (the items and the tree's inner nodes) dynamic and
    row-wise sharded: each rank samples the tree for its share of the batch (its draws keyed by
    where its rows start, so the runs differ by design and are compared on quality). With as
    many steps, both learn the sampled rows far above chance (eval AUC over them > 0.9)."""
    from dynarec.data.tree import init_tree, write_tree
    from tests.models.test_tdm import ITEMS, config_dict, write_log

    write_log(tmp_path, 1500, "train.parquet", 0)
    write_log(tmp_path, 200, "eval.parquet", 1)
    ids = np.arange(ITEMS)
    write_tree(
        init_tree(ids, pa.array((ids // 16).astype(str)), [pa.array((ids // 16).astype(str))]), tmp_path / "tree"
    )
    finals = _runs_with_a_dynamic_item_table(tmp_path, lambda: config_dict(tmp_path), 2, "tdm")
    assert all(final["eval"]["num_examples"] == 200 * (1 + 7 + 36) for final in finals.values())
    auc = {nproc: final["eval"]["auc"] for nproc, final in finals.items()}
    assert auc[1] > 0.9 and auc[2] > 0.9, auc


def test_sigterm_to_a_two_process_job_stops_both_ranks_after_one_step_saved(runs, tmp_path):
    """torchrun passes a SIGTERM on to the ranks, each at its own point of a step; they agree
    (in the step's loss check) to stop after the same step, save it together, and the job ends
    with 143 naming the checkpoint."""
    from tests.train.test_faults import _train_until_terminated

    c = mixed_config(runs, 60, num_steps=1_000_000, save_checkpoints_steps=None)
    c["data"]["eval_input_path"] = None
    model_dir = tmp_path / "m"
    config = write_config(runs, c, "sigterm.yaml")  # (beside the data its paths name)
    argv = ["train", "--config", str(config), "--model-dir", str(model_dir), "--no-progress", "--nproc", "2"]
    rc, err = _train_until_terminated(argv, model_dir, settle=8.0)
    assert rc == 143, err[-4000:]
    stopped = [line for line in err.splitlines() if "stopped by SIGTERM after step" in line]
    assert len(stopped) == 2 and stopped[0] == stopped[1], err[-4000:]  # both ranks, the same step
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    assert (model_dir / "checkpoints" / f"ckpt-{step:010d}").is_dir()
    assert err.strip().splitlines()[-1] == (
        f"dynarec train: the 2-process job stopped by SIGTERM; the latest checkpoint is "
        f"{model_dir / 'checkpoints' / f'ckpt-{step:010d}'} (continue with --resume)"
    )
