"""Incremental export: a full export at step s1 plus the deltas after it equal a full export at
the last delta's step — every table row by row, dynamic tables by key and slot, predictions —
including keys evicted and re-admitted in between; a delta applied to the wrong base is refused;
a delta after a few steps is a small fraction of a full export."""

import json
import shutil

import numpy as np
import pytest
import torch

from dynarec.cli import main
from dynarec.serving import ExportedModel, ExportError
from dynarec.train.checkpoint import load_checkpoint
from tests.pipeline_fixtures import config_dict, make_data, write_config

pytestmark = pytest.mark.slow


def train_to(root, model_dir, steps, resume, **changes):
    c = config_dict(**changes)
    del c["train"]["num_epochs"]
    c["train"].update(num_steps=steps, save_checkpoints_steps=2, keep_checkpoints=100)
    cfg = write_config(root, c, f"cfg-{steps}.yaml")
    args = ["train", "--config", str(cfg), "--model-dir", str(model_dir), "--no-progress"]
    assert main([*args, "--resume"] if resume else args) == 0


def export(model_dir, export_dir, since=None):
    args = ["export", "--model-dir", str(model_dir), "--export-dir", str(export_dir)]
    assert main([*args, "--since", str(since)] if since else args) == 0
    return export_dir


def assert_same_model(a: ExportedModel, b: ExportedModel, eval_file):
    assert a.step == b.step and a.key_counts == b.key_counts
    for name, ta in a.embeddings.tables.items():
        da, db = ta.dump(), b.embeddings.tables[name].dump()
        for field in ("keys", "weight", "slots", "scores", "layout"):
            if field in da:
                assert torch.equal(da[field], db[field]), (name, field)
    np.testing.assert_array_equal(
        a.predict_files(str(eval_file))["probability"], b.predict_files(str(eval_file))["probability"]
    )


SMALL_USER_TABLE = {"max_capacity": 128, "init_capacity": 64, "bucket_size": 8}  # 300 users: evictions


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Steps 10 (full E1), 14 (delta D1 on E1, full F2), 15 (delta D2 on D1, full F3)."""
    root = tmp_path_factory.mktemp("delta")
    make_data(root)
    m = root / "m"
    changes = {"data__batch_size": 60}
    c = config_dict()
    user = c["feature_configs"][0]
    user["id_feature"]["dynamicemb"] = SMALL_USER_TABLE
    changes["feature_configs"] = c["feature_configs"]
    train_to(root, m, 10, False, **changes)
    e1 = export(m, root / "e1")
    train_to(root, m, 14, True, **changes)
    d1, f2 = export(m, root / "d1", since=e1), export(m, root / "f2")
    train_to(root, m, 15, True, **changes)
    d2, f3 = export(m, root / "d2", since=d1), export(m, root / "f3")
    return root, m, e1, d1, f2, d2, f3


def test_full_plus_deltas_equals_the_full_export(chain):
    root, _, e1, d1, f2, d2, f3 = chain
    eval_file = root / "data" / "eval" / "part-0.parquet"
    assert_same_model(ExportedModel(d1), ExportedModel(f2), eval_file)  # E1 + D1 == F2
    assert_same_model(ExportedModel(d2), ExportedModel(f3), eval_file)  # E1 + D1 + D2 == F3
    online = ExportedModel(e1)
    online.apply_delta(d1)
    online.apply_delta(d2)
    assert_same_model(online, ExportedModel(f3), eval_file)


def test_keys_evicted_and_readmitted_between_exports_are_carried(chain):
    _, m, e1, d1, f2, _, _ = chain
    meta = json.loads((d1 / "export.json").read_text())
    assert meta["kind"] == "delta" and meta["base"]["step"] == 10 and meta["step"] == 14
    assert meta["tombstones"]["user_id"] > 0  # keys evicted since E1
    _, (mid,) = load_checkpoint(m / "checkpoints" / "ckpt-0000000012")
    k1 = set(ExportedModel(e1).embeddings.tables["user_id"].dump()["keys"].tolist())
    k2 = ExportedModel(f2).embeddings.tables["user_id"].dump()
    back = (k1 & set(k2["keys"].tolist())) - set(mid["user_id"]["keys"].tolist())
    assert back, "no key left the table and came back between the exports"
    from safetensors.torch import load_file

    delta = load_file(str(d1 / "tables" / "user_id.safetensors"))
    assert back <= set(delta["keys"].tolist())  # each re-admitted key's fresh row is in the delta


def test_a_delta_on_the_wrong_base_is_refused(chain, tmp_path):
    _, _, e1, d1, _, d2, f3 = chain
    model = ExportedModel(e1)
    with pytest.raises(
        ExportError, match=r"d2: a delta on export \w+ \(step 14\), but this model serves export \w+ \(step 10\)"
    ):
        model.apply_delta(d2)
    with pytest.raises(ExportError, match="is a full export, not a delta"):
        model.apply_delta(f3)
    # A base moved away from the chain is named with the step it had.
    moved = tmp_path / "d1-moved"
    d1.rename(moved)
    try:
        with pytest.raises(
            ExportError, match=r"a delta on export \w+ \(step 14\), which is neither where it was written \(nothing at"
        ):
            ExportedModel(d2)
    finally:
        moved.rename(d1)
    # Its base's directory overwritten by another export: named, the path as it is.
    shutil.copytree(d1, tmp_path / "x" / "d1")
    shutil.copytree(f3, tmp_path / "x" / "e1")
    with pytest.raises(
        ExportError, match=r"/x/e1 holds export \w+: another export was written there since\) nor beside"
    ):
        ExportedModel(tmp_path / "x" / "d1")


def test_a_delta_applied_online_serves_with_its_own_config(chain, monkeypatch):
    """A delta from a model that normalizes a feature differently (same tables): applied to a
    served model, it scores as the delta loaded whole — with its own normalizer, not its base's.
    A delta that fails to load leaves the model serving what it served."""
    root, _, e1, *_ = chain
    changes = {"data__batch_size": 60}
    c = config_dict()
    c["feature_configs"][0]["id_feature"]["dynamicemb"] = SMALL_USER_TABLE
    c["feature_configs"][-1]["raw_feature"]["normalizer"] = {"log1p": True, "mean": 0.0, "std": 0.1}
    changes["feature_configs"] = c["feature_configs"]
    other = root / "other"
    train_to(root, other, 2, False, **changes)
    delta = export(other, root / "other-delta", since=e1)
    eval_file = root / "data" / "eval" / "part-0.parquet"
    online = ExportedModel(e1)
    before = online.predict_files(str(eval_file))["probability"]
    with monkeypatch.context() as m:  # its program fails to load after its tables did (a torch upgrade, say)
        m.setattr("dynarec.serving.load_export_file", lambda path, load: (_ for _ in ()).throw(ExportError(path)))
        with pytest.raises(ExportError, match=r"dense\.pt2"):
            online.apply_delta(delta)
    assert online.export_id == ExportedModel(e1).export_id and online.config.feature("price").normalizer.mean == 3.0
    np.testing.assert_array_equal(online.predict_files(str(eval_file))["probability"], before)
    online.apply_delta(delta)
    assert online.config.feature("price").normalizer.mean == 0.0
    assert_same_model(online, ExportedModel(delta), eval_file)


def test_a_chain_copied_to_another_place_still_serves(chain, tmp_path):
    """Bases were recorded by absolute path: a chain copied to another host could not be served.
    Now by a path relative to the delta, and by id among the delta's siblings."""
    root, _, e1, d1, _, d2, f3 = chain
    for d in (e1, d1, d2):
        shutil.copytree(d, tmp_path / "copy" / d.name)
    eval_file = root / "data" / "eval" / "part-0.parquet"
    assert_same_model(ExportedModel(tmp_path / "copy" / "d2"), ExportedModel(f3), eval_file)
    # Renamed within the chain's directory: found by id.
    (tmp_path / "copy" / "d1").rename(tmp_path / "copy" / "delta-1")
    assert_same_model(ExportedModel(tmp_path / "copy" / "d2"), ExportedModel(f3), eval_file)


def test_a_delta_written_over_its_own_chains_base_is_refused_and_the_chain_stays(chain, tmp_path, capsys):
    """``export --export-dir e1 --since d2`` (d2 a delta on d1 on e1) replaced e1, after which
    neither the new delta nor d2 could be served."""
    root, m, e1, d1, _, d2, f3 = chain
    before = {p: p.read_bytes() for p in sorted(e1.rglob("*")) if p.is_file()}
    for target in (e1, d1):
        assert main(["export", "--model-dir", str(m), "--export-dir", str(target), "--since", str(d2)]) == 2
        assert "that the delta's base chain" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in sorted(e1.rglob("*")) if p.is_file()} == before
    assert_same_model(ExportedModel(d2), ExportedModel(f3), root / "data" / "eval" / "part-0.parquet")


def test_a_full_export_over_an_export_says_its_deltas_no_longer_apply_and_files_are_readable(chain, tmp_path, capsys):
    """A full export written where an export was replaced it silently, and every delta written
    on the old one stopped serving; the tables' files were the owner's alone (safetensors makes
    them 0600) while the manifest and dense model followed the umask."""
    import os
    import stat

    _, m, e1, *_ = chain
    target = tmp_path / "e"
    shutil.copytree(e1, target)
    capsys.readouterr()
    export(m, target)
    err = capsys.readouterr().err
    assert f"it replaced the export of step 10 that {target} held; a delta written on that one does not apply" in err
    umask = os.umask(0)
    os.umask(umask)
    for path in (target / "export.json", *sorted((target / "tables").iterdir())):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


def test_a_delta_after_one_step_is_a_fraction_of_a_full_export(chain, capsys):
    _, _, _, _, _, d2, f3 = chain

    def table_bytes(d):
        return sum(p.stat().st_size for p in (d / "tables").iterdir())

    delta, full = table_bytes(d2), table_bytes(f3)
    meta = json.loads((d2 / "export.json").read_text())
    print(f"delta after 1 step: {delta:,} bytes of tables vs {full:,} in a full export; rows {meta['rows']}")
    assert delta < 0.5 * full  # 60 rows touch a fraction of each table (measured in the docs at scale)


def test_an_export_given_as_a_model_dir_is_named_and_evaluate_needs_its_inputs(chain, capsys):
    """`evaluate --model-dir <an export>` said that config.yaml did not exist; `evaluate --input`
    with no path evaluated data.eval_input_path (a QA pass)."""
    root, m, e1, *_ = chain
    for command in ("evaluate", "export"):
        argv = [command, "--model-dir", str(e1)] + (["--export-dir", str(root / "x")] if command == "export" else [])
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"--model-dir {e1} is an export (dynarec export), not a model directory" in err, err
        assert f"dynarec predict --export-dir {e1}" in err
    with pytest.raises(SystemExit) as exited:
        main(["evaluate", "--model-dir", str(m), "--input"])
    assert exited.value.code == 2 and "--input: expected at least one argument" in capsys.readouterr().err
