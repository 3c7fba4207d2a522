"""The trainer's parts: data position and seeking resume, num_steps, RNG, refusals."""

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

from dynarec.config import config_from_dict
from dynarec.data.batch import BatchBuilder, DataError
from dynarec.data.reader import DataPosition
from dynarec.embedding.dynamic import TableFullError
from dynarec.train.checkpoint import CheckpointError
from dynarec.train.trainer import Trainer
from tests.pipeline_fixtures import config_dict

pytestmark = pytest.mark.slow


def small_config(path, dynamicemb=None, **train):
    """One fixed and one dynamic id feature (``dynamicemb``: the latter's settings), integer ids:
    cheap to read at a million rows."""
    return config_from_dict(
        {
            "feature_configs": [
                {"id_feature": {"feature_name": "item", "embedding_dim": 4, "num_buckets": 100}},
                {
                    "id_feature": {
                        "feature_name": "user",
                        "embedding_dim": 4,
                        "dynamicemb": dynamicemb or {"max_capacity": 4096},
                    }
                },
            ],
            "model": {
                "feature_groups": [{"group_name": "all", "feature_names": ["item", "user"]}],
                "multi_tower_din": {"towers": [{"input": "all", "hidden_units": [16]}]},
            },
            "data": {"train_input_path": str(path), "label_field": "clk", "batch_size": 100},
            "train": {"sparse_optimizer": {"adagrad_optimizer": {"lr": 0.05}}, **train},
            "eval": {"metrics": ["auc"]},
        }
    )


@pytest.fixture(scope="module")
def million(tmp_path_factory):
    """1,000,000 rows in one Parquet file of 16 row groups."""
    rng = np.random.default_rng(0)
    n = 1_000_000
    path = tmp_path_factory.mktemp("big") / "train.parquet"
    pq.write_table(
        pa.table({"item": rng.integers(0, 100, n), "user": rng.integers(0, 10_000, n), "clk": rng.integers(0, 2, n)}),
        path,
        row_group_size=n // 16,
    )
    return path


def test_resume_deep_into_a_large_file_seeks_instead_of_replaying(million, tmp_path, monkeypatch):
    # A checkpoint at step 9,990 (row 999,000); the resumed run trains steps 9,991 and 9,992.
    first = Trainer(small_config(million, num_steps=9990), tmp_path / "m", progress=False)
    first.step, first.position = 9990, DataPosition(0, 999_000)
    first.save()
    built = []
    real_build = BatchBuilder.build
    monkeypatch.setattr(BatchBuilder, "build", lambda self, t, o: built.append(t.num_rows) or real_build(self, t, o))
    resumed = Trainer(small_config(million, num_steps=9992), tmp_path / "m", progress=False)
    start = time.perf_counter()
    report = resumed.fit(resume=True)
    seconds = time.perf_counter() - start
    assert report["step"] == 9992 and resumed.position == DataPosition(0, 999_200)
    assert built == [100, 100]  # exactly the two batches trained: nothing replayed
    # Replaying 9,990 batches would take over 10 s at this machine's ~500 batches/s.
    assert seconds < 5, f"resume took {seconds:.1f}s"
    print(f"resume at row 999,000 of 1,000,000: {seconds:.2f}s for 2 steps (incl. checkpoint)")


def _small_csv(path):
    """250 rows of the small config's columns: 3 batches an epoch (100, 100, 50)."""
    rng = np.random.default_rng(1)
    pacsv.write_csv(
        pa.table({"item": rng.integers(0, 100, 250), "user": rng.integers(0, 50, 250), "clk": rng.integers(0, 2, 250)}),
        path,
    )


def test_num_steps_trains_exactly_that_many_cycling_the_data(tmp_path):
    _small_csv(tmp_path / "t.csv")
    trainer = Trainer(small_config(tmp_path / "t.csv", num_steps=7), tmp_path / "m", progress=False)
    report = trainer.fit()
    assert report["step"] == 7  # 3 batches per epoch (100, 100, 50): epochs 0, 1 and step 1 of 2
    assert trainer.position == DataPosition(2, 100)
    # each epoch ended in the run, with its steps and their pace (the third did not end)
    assert [(e["epoch"], e["steps"]) for e in report["epochs"]] == [(0, 3), (1, 3)]
    assert all(e["seconds"] > 0 and e["steps_per_second"] == e["steps"] / e["seconds"] for e in report["epochs"])
    # a run resumed within an epoch counts that epoch's steps of its own
    resumed = Trainer(small_config(tmp_path / "t.csv", num_steps=10), tmp_path / "m", progress=False)
    assert [(e["epoch"], e["steps"]) for e in resumed.fit(resume=True)["epochs"]] == [(2, 2)]  # steps 8, 9; 10 begins 3


def test_the_logged_running_loss_is_the_mean_of_the_steps_since_the_last_record(tmp_path, monkeypatch):
    """The trainer sums each step's loss on the device and hands the log the mean of the window
    at each record (step 1, then every log_step_count_steps): it was an average updated at the
    recorded steps alone, mostly step 1's loss."""
    _small_csv(tmp_path / "t.csv")
    trainer = Trainer(
        small_config(tmp_path / "t.csv", num_steps=7, log_step_count_steps=3), tmp_path / "m", progress=False
    )
    losses, logged = [], []
    step = trainer.train_step
    monkeypatch.setattr(trainer, "train_step", lambda *a: (lambda loss: losses.append(float(loss)) or loss)(step(*a)))
    log_step = trainer.log.train_step
    monkeypatch.setattr(
        trainer.log,
        "train_step",
        lambda s, v, e, r, mean=None: (logged.append((s, v, mean)), log_step(s, v, e, r, mean)),
    )
    trainer.fit()
    recorded = [(s, v, m) for s, v, m in logged if v is not None]
    assert [s for s, _, _ in recorded] == [1, 3, 6]
    windows = {1: losses[0:1], 3: losses[1:3], 6: losses[3:6]}
    for s, value, mean in recorded:
        assert value == pytest.approx(losses[s - 1]) and mean == pytest.approx(sum(windows[s]) / len(windows[s]))
    assert trainer.log.running_loss == pytest.approx(sum(losses[3:6]) / 3)


def test_an_epochs_checkpoint_at_its_end_counts_in_its_own_pace(tmp_path):
    """save_checkpoints_epochs: the save made at an epoch's last step is that epoch's time, not
    the next one's; the epochs' seconds add up to the run's."""
    _small_csv(tmp_path / "t.csv")
    config = small_config(tmp_path / "t.csv", num_epochs=2, save_checkpoints_epochs=1)
    trainer = Trainer(config, tmp_path / "m", progress=False)
    save = trainer.save

    def slow_first_save():
        if trainer.step == 3:  # epoch 0's checkpoint, at its last step
            time.sleep(1.0)
        return save()

    trainer.save = slow_first_save
    report = trainer.fit()
    first, second = report["epochs"]
    assert (first["epoch"], first["steps"], second["epoch"], second["steps"]) == (0, 3, 1, 3)
    assert first["seconds"] >= 1.0 > second["seconds"]
    assert sum(e["seconds"] for e in report["epochs"]) <= report["train_seconds"]


def test_an_epoch_whose_last_batch_is_skipped_still_ends_there(tmp_path):
    """nan_policy skip_batch: a skipped batch that ends an epoch ends it in the report's paces."""
    _small_csv(tmp_path / "t.csv")
    trainer = Trainer(small_config(tmp_path / "t.csv", num_epochs=2), tmp_path / "m", progress=False)
    step, calls = trainer.train_step, [0]

    def skipping_the_third(batch, rows=None):  # as a non-finite loss under skip_batch: nothing trained
        calls[0] += 1
        return None if calls[0] == 3 else step(batch, rows)

    trainer.train_step = skipping_the_third
    report = trainer.fit()
    assert report["step"] == 5 and [(e["epoch"], e["steps"]) for e in report["epochs"]] == [(0, 2), (1, 3)]


def test_num_steps_and_num_epochs_together_are_refused(tmp_path):
    from dynarec.config import ConfigError

    with pytest.raises(ConfigError, match="give one of num_epochs or num_steps"):
        small_config(tmp_path, num_steps=7, num_epochs=2)


def test_input_without_rows_is_an_error_and_writes_nothing(tmp_path):
    (tmp_path / "empty.csv").write_text("item,user,clk\n")
    trainer = Trainer(small_config(tmp_path / "empty.csv"), tmp_path / "m", progress=False)
    with pytest.raises(DataError, match=r"data.train_input_path: the input holds no rows \(.*empty.csv\)"):
        trainer.fit()
    assert not (tmp_path / "m").exists()


def test_resume_with_another_batch_size_is_refused_naming_both(million, tmp_path):
    first = Trainer(small_config(million, num_steps=2), tmp_path / "m", progress=False)
    first.fit()
    cfg = small_config(million, num_steps=4)
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"batch_size": 64})})
    with pytest.raises(
        CheckpointError,
        match=r"global batch of 100 rows \(1 rank x data.batch_size 100\), this run's is 64 \(1 rank x data.batch_size "
        r"64\); resume with data.batch_size 100 at 1 rank",
    ):
        Trainer(cfg, tmp_path / "m", progress=False).fit(resume=True)


def test_the_dense_model_is_seeded_without_touching_the_global_rng(tmp_path):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = Trainer(config_from_dict(config_dict()), tmp_path / "a", progress=False)
    assert torch.equal(torch.get_rng_state(), before)
    b = Trainer(config_from_dict(config_dict()), tmp_path / "b", progress=False)
    for (name, x), (_, y) in zip(a.task.dense.state_dict().items(), b.task.dense.state_dict().items()):
        assert torch.equal(x, y), name


def test_cached_epochs_train_on_the_first_epochs_batches_with_the_same_result(tmp_path, monkeypatch):
    """data.cache_batches: the batches of the first whole epoch are built once; later epochs train on
    them — bit-identical to building them again."""
    rng = np.random.default_rng(0)
    n = 1000
    table = pa.table({"item": rng.integers(0, 100, n), "user": rng.integers(0, 10**9, n), "clk": rng.integers(0, 2, n)})
    pq.write_table(table, tmp_path / "t.parquet")
    built = []
    real_build = BatchBuilder.build

    def counting_build(self, *args, **kwargs):
        built.append(1)
        return real_build(self, *args, **kwargs)

    monkeypatch.setattr(BatchBuilder, "build", counting_build)
    dumps = {}
    cache_dir = tmp_path / "batch-cache"
    for cache in (False, True, "disk"):
        config = small_config(tmp_path / "t.parquet", num_epochs=3)
        data = {"cache_batches": cache, "batch_cache_dir": str(cache_dir)}
        config = config.model_copy(update={"data": config.data.model_copy(update=data)})
        built.clear()
        trainer = Trainer(config, tmp_path / f"m{cache}", progress=False)
        trainer.fit()
        assert trainer.step == 30 and len(built) == (10 if cache else 30)
        dumps[cache] = {name: t.dump() for name, t in trainer.task.embeddings.tables.items()}
        if cache == "disk":  # the run's own directory was made there, and removed when it ended
            assert cache_dir.is_dir() and list(cache_dir.iterdir()) == []
    for cache in (True, "disk"):
        for name, dump in dumps[False].items():
            assert all(torch.equal(v, dumps[cache][name][k]) for k, v in dump.items()), (cache, name)


def test_a_cached_batch_file_lost_between_epochs_has_its_epoch_built_again(tmp_path, monkeypatch):
    """cache_batches: disk, a cached file removed after the first epoch: a warning, the rest of the
    second epoch is built from the files again (and the third too: the cache is dropped), and the
    run trains as without a cache."""
    from dynarec.data.batch_cache import DiskBatchCache

    rng = np.random.default_rng(0)
    n = 1000
    table = pa.table({"item": rng.integers(0, 100, n), "user": rng.integers(0, 10**9, n), "clk": rng.integers(0, 2, n)})
    pq.write_table(table, tmp_path / "t.parquet")
    real_iter = DiskBatchCache.__iter__

    def losing_iter(self):
        os.unlink(self._files[4].path)  # lost between the epochs
        yield from real_iter(self)

    dumps = {}
    for cache in (False, "disk"):
        config = small_config(tmp_path / "t.parquet", num_epochs=3)
        data = {"cache_batches": cache, "batch_cache_dir": str(tmp_path / "cache")}
        config = config.model_copy(update={"data": config.data.model_copy(update=data)})
        trainer = Trainer(config, tmp_path / f"m{cache}", progress=False)
        if cache:
            monkeypatch.setattr(DiskBatchCache, "__iter__", losing_iter)
            with pytest.warns(UserWarning, match=r"cached batch 4 could not be read back .*goes on from the files"):
                trainer.fit()
        else:
            trainer.fit()
        assert trainer.step == 30
        dumps[cache] = {name: t.dump() for name, t in trainer.task.embeddings.tables.items()}
    for name, dump in dumps[False].items():
        assert all(torch.equal(v, dumps["disk"][name][k]) for k, v in dump.items()), name


def _training_data(tmp_path, n=400):
    rng = np.random.default_rng(1)
    table = pa.table({"item": rng.integers(0, 100, n), "user": rng.integers(0, 10**9, n), "clk": rng.integers(0, 2, n)})
    pq.write_table(table, tmp_path / "t.parquet")
    return tmp_path / "t.parquet"


def _dense_params(trainer):
    return [p.detach().clone() for p in trainer.task.dense.parameters()]


def test_gradient_clipping_bounds_the_dense_step(tmp_path):
    path = _training_data(tmp_path)
    moved = {}
    for clip in (None, {"max_norm": 1e-3}):
        train = {"num_steps": 1, "dense_optimizer": {"sgd_optimizer": {"lr": 1.0}}}
        if clip:
            train["gradient_clipping"] = clip
        trainer = Trainer(small_config(path, **train), tmp_path / f"m{bool(clip)}", progress=False)
        before = _dense_params(trainer)
        batch, trainer.position, rows = next(trainer.input.batches(trainer.position))
        trainer.train_step(batch, rows)
        moved[bool(clip)] = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(_dense_params(trainer), before)))
    assert moved[True] <= 1e-3 * (1 + 1e-5) < moved[False]


def test_gradient_accumulation_steps_the_dense_model_every_n_steps_and_the_tables_every_step(tmp_path):
    path = _training_data(tmp_path)
    config = small_config(
        path, num_steps=4, gradient_accumulation_steps=2, dense_optimizer={"sgd_optimizer": {"lr": 0.5}}
    )
    trainer = Trainer(config, tmp_path / "m", progress=False)
    batches = trainer.input.batches(trainer.position)
    item = trainer.task.embeddings.tables["item"]
    history = []
    for _ in range(3):
        batch, trainer.position, rows = next(batches)
        dense, rows_before = _dense_params(trainer), item.dump()["weight"].clone()
        trainer.train_step(batch, rows)
        dense_moved = any(not torch.equal(a, b) for a, b in zip(_dense_params(trainer), dense))
        history.append((dense_moved, not torch.equal(item.dump()["weight"], rows_before)))
    assert history == [(False, True), (True, True), (False, True)]
    before = _dense_params(trainer)
    trainer.save()  # saving changes nothing: the third step's gradient stays pending, saved
    assert all(torch.equal(a, b) for a, b in zip(_dense_params(trainer), before))


def test_checkpoints_inside_an_accumulation_window_change_nothing_and_resume_inside_it_exactly(tmp_path):
    """A save inside a window applied the window's gradients so far (a dense step more): the
    model depended on save_checkpoints_steps (a QA pass: 8 dense steps in 8 training steps with
    N = 4, saving every step). The checkpoint holds the pending gradients instead."""
    path = _training_data(tmp_path, n=800)

    def config(steps, every):
        return small_config(
            path, num_steps=steps, gradient_accumulation_steps=4, save_checkpoints_steps=every,
            keep_checkpoints=100, dense_optimizer={"adam_optimizer": {"lr": 0.01}},
        )  # fmt: skip

    def final(trainer):
        return _dense_params(trainer), trainer.task.embeddings.tables["item"].dump()["weight"].clone()

    straight = Trainer(config(8, 8), tmp_path / "a", progress=False)
    straight.fit()
    every_step = Trainer(config(8, 1), tmp_path / "b", progress=False)
    every_step.fit()
    resumed = Trainer(config(6, 3), tmp_path / "c", progress=False)  # saves at 3 and 6: inside windows
    resumed.fit()
    resumed = Trainer(config(8, 3), tmp_path / "c", progress=False)
    resumed.fit(resume=True)
    (dense, rows) = final(straight)
    for other in (every_step, resumed):
        other_dense, other_rows = final(other)
        assert all(torch.equal(a, b) for a, b in zip(dense, other_dense))
        assert torch.equal(rows, other_rows)


def test_bf16_mixed_precision_runs_the_dense_model_in_bfloat16_and_keeps_the_tables_float32(tmp_path):
    path = _training_data(tmp_path)
    seen = []
    losses = {}
    for precision in (None, "bf16"):
        train = {"num_steps": 3} | ({"mixed_precision": precision} if precision else {})
        trainer = Trainer(small_config(path, **train), tmp_path / f"m{precision}", progress=False)
        hook = trainer.task.dense.register_forward_hook(lambda m, i, o: seen.append(torch.get_autocast_dtype("cpu")))
        report = trainer.fit()
        hook.remove()
        losses[precision] = trainer.log.history["train_loss"][-1][1]
        assert report["step"] == 3
        assert all(t.dump()["weight"].dtype == torch.float32 for t in trainer.task.embeddings.tables.values())
        assert np.isfinite(losses[precision])
    assert losses["bf16"] != losses[None]  # the dense model ran in another precision
    assert abs(losses["bf16"] - losses[None]) < 0.05


def test_save_checkpoints_epochs_writes_one_at_every_epochs_end(tmp_path):
    path = _training_data(tmp_path)  # 400 rows: 4 steps an epoch
    config = small_config(path, num_epochs=3, save_checkpoints_epochs=1, keep_checkpoints=10)
    trainer = Trainer(config, tmp_path / "m", progress=False)
    trainer.fit()
    assert [p.name for p in trainer.checkpoints.list()] == [f"ckpt-{s:010d}" for s in (4, 8, 12)]


def test_the_heap_built_before_training_is_frozen_for_the_steps_and_thawed_after(tmp_path, monkeypatch):
    import gc

    _small_csv(tmp_path / "t.csv")
    trainer = Trainer(small_config(tmp_path / "t.csv", num_steps=3), tmp_path / "m", progress=False)
    frozen = []
    real_step = Trainer.train_step
    monkeypatch.setattr(
        Trainer, "train_step", lambda self, b, r: frozen.append(gc.get_freeze_count()) or real_step(self, b, r)
    )
    assert gc.get_freeze_count() == 0
    trainer.fit()
    # the model, its tables and the data stage are among the frozen: not scanned by the steps' collections
    assert len(frozen) == 3 and min(frozen) > 10_000, frozen
    assert gc.get_freeze_count() == 0 and gc.isenabled()

    # a process that froze objects itself keeps them frozen, and only those
    keep = [object() for _ in range(3)]
    gc.freeze()
    try:
        before, frozen[:] = gc.get_freeze_count(), []
        Trainer(small_config(tmp_path / "t.csv", num_steps=3), tmp_path / "m2", progress=False).fit()
        # (a frozen object freed by its last reference leaves the count: it can only fall)
        assert len(frozen) == 3 and max(frozen) <= before and gc.get_freeze_count() <= before
    finally:
        gc.unfreeze()
    del keep


def test_a_step_that_fails_saves_the_position_of_its_batch_and_resume_trains_it(tmp_path):
    """A full table stops step 3 (undone); the two steps before it are saved at row 200, where
    the failed batch begins (the checkpoint said 300, and a resume skipped the batch): a resume
    once the data is fixed trains rows 200-299 as step 3."""
    path = tmp_path / "t.csv"

    def write(users):
        pacsv.write_csv(pa.table({"item": np.arange(300) % 100, "user": users, "clk": np.arange(300) % 2}), path)

    write(list(range(10)) * 20 + list(range(100, 200)))  # rows 200-299: 100 users more than fit
    full = {"max_capacity": 32, "init_capacity": 32, "score_strategy": "none"}
    trainer = Trainer(small_config(path, full, num_epochs=1), tmp_path / "m", progress=False)
    with pytest.raises(TableFullError, match="table 'user'"):
        trainer.fit()
    assert trainer.step == 2 and trainer.position == DataPosition(0, 200)
    state = torch.load(tmp_path / "m" / "checkpoints" / "ckpt-0000000002" / "state.pt", weights_only=False)
    assert (state["step"], state["epoch"], state["row"]) == (2, 0, 200)
    write(list(range(10)) * 30)  # fixed
    resumed = Trainer(small_config(path, full, num_epochs=1), tmp_path / "m", progress=False)
    report = resumed.fit(resume=True)
    assert report["step"] == 3 and resumed.position == DataPosition(1, 0)


def test_a_window_resumed_with_another_accumulation_count_weighs_its_saved_steps_as_this_runs(tmp_path):
    """The saved window's gradients hold each step at 1/N of the saving run; a resume with
    another N (or loss scale) takes them at its own weight, not the saved one."""
    path = _training_data(tmp_path, n=800)

    def config(n):
        return small_config(path, num_steps=6, gradient_accumulation_steps=n, save_checkpoints_steps=6)

    Trainer(config(4), tmp_path / "m", progress=False).fit()  # saved at step 6: steps 5 and 6 pending, at 1/4
    state = torch.load(tmp_path / "m" / "checkpoints" / "ckpt-0000000006" / "state.pt", weights_only=False)
    saved = [g for g in state["dense_grads"] if g is not None]
    assert saved and state["dense_grads_weight"] == 0.25
    resumed = Trainer(config(2), tmp_path / "m", progress=False)
    resumed.restore()
    restored = [p.grad for p in resumed.task.dense.parameters() if p.grad is not None]
    assert len(restored) == len(saved)
    for a, b in zip(restored, saved):
        torch.testing.assert_close(a, b * 2, rtol=0, atol=0)
