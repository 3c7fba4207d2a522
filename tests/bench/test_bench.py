"""``dynarec bench``: each benchmark runs end to end on a tiny workload and reports what it
promises (its baseline beside it, runs, ratios, tables as sized). Speeds are not asserted: a
benchmark is read, not tested (docs/benchmarks.md)."""

import json
import math
import os
import re
import statistics
import subprocess
from pathlib import Path

import pytest
import torch

from dynarec.bench.common import Workload
from dynarec.bench.suite import CHECKOUT, figures_of
from dynarec.cli import main
from tests.matrix import BACKENDS

TINY = ["--rows", "2000", "--dim", "8", "--bags", "64", "--pooling-factor", "4", "--steps", "1", "--runs", "2"]


def same_run_ratio(a: dict, b: dict) -> float:
    """The median over runs of a's rate over b's in the same run (interleaved)."""
    return statistics.median(x / y for x, y in zip(a["ids_per_s_runs"], b["ids_per_s_runs"]))


def run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "report.json"
    assert main(["bench", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_hash_find_times_find_and_the_training_insert_from_the_same_load(tmp_path):
    report = run(tmp_path, "hash-find", "--slots", str(1 << 16), "--runs", "2", "--steps", "1")
    assert report["benchmark"] == "hash-find" and report["slots"] == 1 << 16
    for load, result in report["results"].items():
        for runs in ("find_runs", "insert_runs"):
            assert len(result[runs]) == 2 and all(rate > 0 for rate in result[runs]), (load, runs)
        assert result["insert_batch"] == (1 << 16) // 64
    # every timed insert is undone (one left behind would add 1/64 to the load): at 0.5 every
    # drawn key has its slot, at 0.9 some find both buckets full
    assert report["results"]["load_0.5"]["actual_load"] == pytest.approx(0.5, abs=1e-3)
    assert 0.85 < report["results"]["load_0.9"]["actual_load"] < 0.9
    find = [f for f in figures_of("hash-find", report) if f.what.startswith("find, ")]
    assert [f.what for f in find] == ["find, load_0.5", "find, load_0.9"] and find[0].headline


@pytest.mark.parametrize("new_keys", [0.05, 0.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_step_reports_the_fixed_baselines_beside_it_and_drops_no_key(tmp_path, backend, new_keys):
    """The timed steps meet the share of new keys asked for: the table ends holding the keys of
    every batch the steps ran (8 warm-up steps over the Zipf draws, then one a run), each new
    key counted once; with none asked, the keys of the 8 draws alone."""
    report = run(tmp_path, "dynamic-step", *TINY, "--warmup", "1", "--new-keys", str(new_keys))
    assert report["workload"]["new_keys"] == new_keys
    result = report["results"][backend]
    for kind in ("dynamic", "fixed", "fixed_scattered"):
        assert len(result[kind]["ids_per_s_runs"]) == 2
    assert result["dynamic_over_fixed"] == pytest.approx(same_run_ratio(result["dynamic"], result["fixed"]))
    w = Workload(**{k: v for k, v in report["workload"].items() if k != "new_keys"})
    stepped = w.batches(keys_over_int64=True, new_keys=new_keys, count=8 + 2 if new_keys else None)
    keys = torch.unique(torch.cat([b.values() for b in stepped]))
    assert result["dynamic_report"]["dropped_keys"] == 0 and result["dynamic_report"]["size"] == keys.numel()
    if new_keys:  # each timed step brought exactly its own new keys
        warm = torch.unique(torch.cat([b.values() for b in stepped[:8]])).numel()
        assert keys.numel() == warm + 2 * round(new_keys * w.ids_per_step)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_step_of_several_tables_deals_them_the_bags_and_groups_the_native_ones(tmp_path, backend, capsys):
    """``--tables 4``: four tables of each kind, a quarter of the rows and bags each; the native
    dynamic tables (they never grow) are one lookup, FBGEMM's each its own; the first table holds
    the keys of its feature's bags."""
    report = run(tmp_path, "dynamic-step", *TINY, "--warmup", "1", "--new-keys", "0", "--tables", "4")
    assert report["workload"]["tables"] == 4 and report["workload"]["num_embeddings"] == 500
    result = report["results"][backend]
    names = [f"t{i}" for i in range(4)]
    assert result["dynamic_lookup_groups"] == ([names] if backend == "native" else [[n] for n in names])
    w = Workload(**{k: v for k, v in report["workload"].items() if k != "new_keys"})
    first = torch.unique(torch.cat([b.values().view(4, -1)[0] for b in w.batches(keys_over_int64=True)]))
    assert result["dynamic_report"]["dropped_keys"] == 0 and result["dynamic_report"]["size"] == first.numel()
    assert main(["bench", "dynamic-step", *TINY, "--tables", "3"]) == 2
    assert "--tables must be at least 1 and divide --bags (64), got 3" in capsys.readouterr().err


def test_a_workload_stream_holds_new_keys_where_a_fixed_table_holds_rows_in_range():
    w = Workload(num_embeddings=500, bags=16, pooling_factor=5, num_batches=3)
    fixed, dynamic = w.batches(new_keys=0.2, count=7), w.batches(keys_over_int64=True, new_keys=0.2, count=7)
    zipf = w.batches(keys_over_int64=True)
    assert len(fixed) == len(dynamic) == 7
    seen: set[int] = set()
    for k, (f, d) in enumerate(zip(fixed, dynamic)):
        changed = d.values() != zipf[k % 3].values()
        assert 0 < int(changed.sum()) <= 16  # 20% of 80 positions (a new key may not differ by chance: never)
        if k >= 3:  # a draw gives up the same positions every time: the Zipf ids it keeps are the same
            assert torch.equal(changed, dynamic[k - 3].values() != zipf[k % 3].values())
        new = set(d.values()[changed].tolist())
        assert len(new) == int(changed.sum()) and not new & seen  # each new key once
        seen |= new
        assert 0 <= int(f.values().min()) and int(f.values().max()) < 500


def test_a_bounded_zipf_workload_draws_ranks_of_the_tables_rows_by_their_zipf_weight():
    """Zipf(1.05) over 50 rows: every id a row, rank k drawn (k + 1) ** -1.05 as often as rank 0
    (to the sampling error of 400k draws); the wrapped draw's tail lands on every row instead."""
    w = Workload(num_embeddings=50, bags=20_000, pooling_factor=20, num_batches=1, zipf_bounded=True)
    ids = w.batches()[0].values()
    assert ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < 50
    counts = torch.bincount(ids, minlength=50).double()
    expected = torch.arange(1, 51, dtype=torch.float64) ** -1.05
    expected *= ids.numel() / expected.sum()
    assert torch.all((counts - expected).abs() <= 5 * expected.sqrt() + 5)
    wrapped = Workload(num_embeddings=50, bags=20_000, pooling_factor=20, num_batches=1).batches()[0].values()
    assert abs(float(torch.bincount(wrapped, minlength=50)[49]) - expected[49]) > 10 * float(expected[49].sqrt())


@pytest.mark.parametrize("kind, ids", [("fixed", "bounded"), ("dynamic", "bounded"), ("fixed", "wrapped")])
def test_host_tier_times_a_cached_table_against_the_table_whole_and_counts_its_traffic(tmp_path, kind, ids):
    tiny = [*TINY[:-4], "--steps", "8", "--runs", "2"]
    args = ["--warmup", "1", "--kind", kind, "--cache-load-factor", "0.15", "--ids", ids]
    report = run(tmp_path, "host-tier", *tiny, *args)
    results = report["results"]
    assert report["kind"] == kind and report["cache_rows"] >= 0.15 * 2000
    assert report["workload"]["zipf_bounded"] == (ids == "bounded")
    assert report["workload"]["num_batches"] == 1 + 3 * 8 + 2  # a stream: warm-up, the runs, the count, the prefetch
    assert results["cached_over_whole"] == pytest.approx(same_run_ratio(results["cached"], results["whole"]))
    step = report["steady_step"]
    # 256 Zipf ids a step over 2,000 rows: some rows miss the cache of 300+, and a row moved in is
    # one moved out once the cache is full
    assert step["loaded"] > 0 and step["loaded"] <= step["distinct_rows"]
    assert step["bytes"] == (step["loaded"] + step["written_back"]) * 4 * (8 + 8)  # Adagrad: rows and states


def test_fused_step_reports_native_over_fbgemm_or_native_alone(tmp_path):
    report = run(tmp_path, "fused-step", *TINY, "--warmup", "1")
    results = report["results"]
    assert len(results["native"]["ids_per_s_runs"]) == 2
    if "fbgemm" in results:
        assert results["native_over_fbgemm"] == pytest.approx(same_run_ratio(results["native"], results["fbgemm"]))
    assert 0 < results["unique_fraction"] <= 1
    # Adam: no FBGEMM baseline, and the report says why (it printed the native rate alone)
    adam = run(tmp_path, "fused-step", *TINY, "--warmup", "1", "--optimizer", "adam")
    assert (
        "fbgemm" not in adam["results"]
        and adam["summary"][-1] == "no baseline in this run: FBGEMM's CPU TBE has no Adam"
    )


def test_sweep_reports_every_grid_point_with_the_rates_behind_its_ratios(tmp_path):
    report = run(
        tmp_path,
        "sweep",
        "--grid-rows",
        "2000",
        "4000",
        "--grid-bags",
        "64",
        "--steps",
        "1",
        "--runs",
        "2",
        "--warmup",
        "1",
    )
    rows = report["results"]
    assert [(r["bags"], r["rows"]) for r in rows] == [(64, 2000), (64, 4000)]
    for row in rows:
        for backend in ("native", *(["fbgemm"] if row["native_over_fbgemm"] is not None else [])):
            assert row[f"dynamic_over_fixed_{backend}"] > 0
            assert row[f"dynamic_{backend}_ids_per_s"] > 0 and row[f"fixed_{backend}_ids_per_s"] > 0
    figures = figures_of("sweep", report)
    worst = [f for f in figures if "worst" in f.what]
    best = [f for f in figures if "best" in f.what]
    assert len(worst) == len(best) > 0
    assert all(w.ratio <= b.ratio for w, b in zip(worst, best))


def test_data_stage_times_the_native_path_against_pyarrow_on_identical_batches(tmp_path):
    from dynarec.features import native

    report = run(tmp_path, "data-stage", "--data-batch", "64", "--steps", "2", "--runs", "2", "--warmup", "1")
    result = report["results"]
    assert result["rows_per_batch"] == 64 and result["batches_per_run"] == 2
    assert len(result["pyarrow"]["rows_per_s_runs"]) == 2
    if native.available():
        assert result["identical_batches"] is True and len(result["native"]["rows_per_s_runs"]) == 2
        assert result["native_over_pyarrow"] > 0


def test_train_step_times_the_trainer_step_against_plain_torch(tmp_path):
    argv = ["--batch", "64", "--users", "300", "--items", "100", "--steps", "2", "--runs", "2", "--warmup", "1"]
    report = run(tmp_path, "train-step", *argv)
    r = report["results"]
    assert r["world_size"] == 1 and r["batch_per_rank"] == 64 and len(r["dynarec_runs"]) == 2
    assert all(x > 0 for x in r["dynarec_runs"] + r["baseline_runs"])
    expected = statistics.median(a / b for a, b in zip(r["dynarec_runs"], r["baseline_runs"]))
    assert r["dynarec_over_baseline"] == pytest.approx(expected)


def test_cached_click_log_is_one_directory_per_spec_holding_that_spec():
    from dataclasses import asdict

    from dynarec.bench.common import cached_click_log
    from dynarec.data.synthetic import SyntheticSpec

    small, other = SyntheticSpec(train_rows=500, eval_rows=100), SyntheticSpec(train_rows=500, eval_rows=100, seed=1)
    path = cached_click_log(small)
    assert cached_click_log(small) == path and cached_click_log(other) != path
    assert json.loads((path / "meta.json").read_text())["spec"] == asdict(small)


def test_e2e_histories_are_30_long_unless_a_shortest_is_given():
    from dynarec.bench.e2e import e2e_spec

    assert (e2e_spec(1000, 100).min_hist_len, e2e_spec(1000, 100).max_hist_len) == (30, 30)  # issue 27's workload
    assert (e2e_spec(1000, 100, 3).min_hist_len, e2e_spec(1000, 100, 3).max_hist_len) == (3, 30)  # the demo's
    with pytest.raises(ValueError, match="--min-history must be within 1 and 30, got 31"):
        e2e_spec(1000, 100, 31)


def test_e2e_runs_the_train_command_and_its_plain_torch_peer_to_a_better_than_chance_auc(tmp_path):
    rows, batch, epochs = 3000, 256, 2
    report = run(
        tmp_path,
        "e2e",
        "--train-rows",
        str(rows),
        "--batch",
        str(batch),
        "--epochs",
        str(epochs),
        "--eval-rows",
        "1000",
        "--min-history",
        "3",
    )
    r = report["results"]
    assert r["command"] == "dynarec train --config config.yaml --model-dir model --device cpu"
    ours, peer = r["dynarec"], r["peer"]
    assert ours["steps"] == epochs * math.ceil(rows / batch)
    assert ours["eval"]["num_examples"] == 1000
    # the command's wall time holds its steps and more (start-up, checks, checkpoint, eval)
    assert ours["wall_seconds"] > ours["train_seconds"] > 0 and ours["samples_per_s_wall"] > 0
    assert peer["samples_per_s"] > 0
    assert r["dynarec_over_peer"] == pytest.approx(ours["samples_per_s_report"] / peer["samples_per_s"])
    # the rows trained, as the peer counts its own: the last batch of 184 rows is not one of 256
    assert ours["samples_per_s_report"] == pytest.approx(rows * epochs / ours["train_seconds"])
    assert ours["runs"] == [{k: v for k, v in ours.items() if k != "runs"}] and len(peer["runs"]) == 1
    assert peer["pid"] != os.getpid()  # a fresh process, as each dynarec train is
    # both learned something of the generator's signal in the same epochs, on the same rows
    assert 0.5 < ours["eval_auc"] <= 1 and 0.5 < peer["eval_auc"] <= 1
    assert (
        peer["eval_auc"] < r["data"]["bayes_optimal_eval_auc"]
        and ours["eval_auc"] < r["data"]["bayes_optimal_eval_auc"]
    )
    # the data are generated once per parameters, outside the timed part
    assert r["data"]["spec"]["string_ids"] is True and r["data"]["spec"]["min_hist_len"] == 3  # (as the demo's)
    assert "histories of 3 to 30" in " ".join(report["summary"])


DLRM_CRITEO = Path(__file__).parents[1] / "config" / "tzrec" / "examples" / "dlrm_criteo.config"


def test_e2e_imports_a_torcheasyrec_config_and_races_it_against_a_one_table_peer(tmp_path):
    # TorchEasyRec's dlrm_criteo, its tables shrunk to fit a test (up to 40M rows each otherwise)
    config = tmp_path / "dlrm_criteo.config"
    config.write_text(re.sub(r"num_buckets: \d+", "num_buckets: 997", DLRM_CRITEO.read_text()))
    rows, batch, epochs = 3000, 512, 2
    argv = ["--config", str(config), "--peer", "one-table", "--cache-batches", "disk", "--eval-rows", "1000"]
    report = run(tmp_path, "e2e", "--train-rows", str(rows), "--batch", str(batch), "--epochs", str(epochs), *argv)
    r = report["results"]
    assert r["peer_tables"] == "one-table" and r["cache_batches"] == "disk"
    assert r["data"]["config"] == str(config) and r["data"]["generate"]["train_rows"] == rows
    ours, peer = r["dynarec"], r["peer"]
    assert ours["steps"] == epochs * math.ceil(rows / batch) and ours["eval"]["num_examples"] == 1000
    assert peer["samples_per_s"] > 0 and 0.5 < peer["eval_auc"] <= 1 and 0.5 < ours["eval_auc"] <= 1
    assert "the first epoch cached (disk)" in report["summary"][0] and "one nn.Embedding" in report["summary"][3]
    # each epoch's pace, from the train report: the first builds its batches and fills the cache
    assert len(ours["epoch_samples_per_s"]) == epochs and all(v > 0 for v in ours["epoch_samples_per_s"])
    assert report["summary"][2].startswith("dynarec by epoch (its report): ")
    assert "the first epoch builds its batches and fills the cache" in report["summary"][2]


def test_the_one_table_peer_looks_up_every_table_at_its_row_offset():
    from dynarec.bench.train import _PlainTorchModel, _tensorize
    from dynarec.config import config_from_dict
    from dynarec.config.tzrec import convert_pipeline_config
    from dynarec.data.batch import Batch
    from dynarec.embedding import JaggedBatch

    text = re.sub(r"num_buckets: \d+", "num_buckets: 10", DLRM_CRITEO.read_text())
    config = config_from_dict(convert_pipeline_config(text, train_input_path="x", eval_input_path="x").config)
    torch.manual_seed(0)
    tables = _PlainTorchModel(config, key_rows=0, device=torch.device("cpu"))
    one = _PlainTorchModel(config, key_rows=0, device=torch.device("cpu"), one_table=True)
    names = [f"cat_{i}" for i in range(26)]
    assert one.offsets == {n: 10 * i for i, n in enumerate(names)} and one.tables["all"].num_embeddings == 260
    for i, n in enumerate(names):  # the same rows in both: each table's at its offset
        one.tables["all"].weight.data[10 * i : 10 * (i + 1)] = tables.tables[tables.table_of[n]].weight.data
    one.dense.load_state_dict(tables.dense.state_dict())
    ids = torch.randint(0, 10, (26, 3))
    sparse = JaggedBatch(names, ids.flatten(), torch.ones(78, dtype=torch.int64))
    dense = {f"int_{i}": torch.rand(3) for i in range(13)}
    batch = Batch(sparse=sparse, dense=dense, labels=torch.zeros(3, 1), groups=None, num_rows=3)
    stacked = _tensorize(batch, [], {}, torch.device("cpu"), one.offsets)
    assert stacked["stacked"][0] == names and torch.equal(stacked["stacked"][1], ids.T + torch.arange(26) * 10)
    torch.testing.assert_close(one(stacked), tables(_tensorize(batch, [], {}, torch.device("cpu"))))
    two = JaggedBatch(names, torch.zeros(79, dtype=torch.int64), torch.tensor([2] + [1] * 77))
    with pytest.raises(ValueError, match="feature 'cat_0': the plain-torch peer looks up one id a row"):
        _tensorize(
            Batch(sparse=two, dense=dense, labels=torch.zeros(3, 1), groups=None, num_rows=3),
            [],
            {},
            torch.device("cpu"),
        )


def test_suite_writes_one_dated_results_file_with_the_revision_and_a_history_row(tmp_path):
    results = tmp_path / "results"
    argv = ["--smoke", "--cases", "fused-step", "data-stage", "--results-dir", str(results)]
    report = run(tmp_path, "suite", *argv)
    record = report["results"]
    sha = record["revision"]["sha"]
    # the checkout's HEAD then (others may commit meanwhile: it is HEAD or one of its ancestors)
    git = ["git", "merge-base", "--is-ancestor", sha, "HEAD"]
    assert subprocess.run(git, cwd=CHECKOUT).returncode == 0 and record["revision"]["short"] == sha[:7]
    assert isinstance(record["revision"]["dirty"], bool)
    path = results / f"{record['date']}-{sha[:7]}-cpu-smoke.json"
    assert report["results_file"] == str(path) and json.loads(path.read_text()) == json.loads(json.dumps(record))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", record["date"])
    assert record["machine"]["cpu_count"] > 0 and record["versions"]["torch"]
    assert len(record["machine"]["load_average"]) == len(record["machine"]["load_average_after"]) == 3
    assert [c["command"].split()[:3] for c in record["cases"]] == [
        ["dynarec", "bench", "fused-step"],
        ["dynarec", "bench", "data-stage"],
    ]
    for case in record["cases"]:
        assert case["returncode"] == 0 and case["figures"], case["case"]
        for f in case["figures"]:
            assert f["value"] > 0
            if f["baseline_value"] is not None:
                assert f["ratio"] > 0
    assert any(f["headline"] for c in record["cases"] for f in c["figures"])
    assert path.with_suffix(".md").read_text().startswith("# dynarec bench suite --device cpu")
    # a second run the same day appends its own file and row, and leaves the first alone
    first = path.read_text()
    second = run(tmp_path, "suite", *argv, "--cases", "data-stage")
    assert path.read_text() == first
    if second["results"]["revision"]["sha"] == sha:
        assert second["results_file"] == str(path.with_name(f"{path.stem}-2.json"))
    history = (results / "README.md").read_text().splitlines()
    rows = [line for line in history if line.startswith(f"| {record['date']} | ")]
    assert len(rows) == 2 and rows[0].startswith(f"| {record['date']} | {sha[:7]}")
    assert rows[0].endswith(f"[{path.stem}.md]({path.stem}.md) |")


def test_the_suites_group_case_is_named_apart_from_one_tables():
    """The suite's two dynamic-step cases (one table; 26 tables in one group) give figures of
    different names and headlines (the group's report says its tables)."""
    path = CHECKOUT / "benchmarks/results/2026-12-05-4642569-cpu-dynamic-step-26-tables.json"
    group = json.loads(path.read_text())
    one = json.loads(json.dumps(group))
    one["workload"]["tables"] = 1
    single, grouped = figures_of("dynamic-step", one), figures_of("dynamic-step", group)
    assert {f.baseline for f in grouped} == {"26 fixed tables in one group, same ids"}
    assert [f.headline for f in grouped if f.headline] == ["26-table group / fixed"]
    assert [f.headline for f in single if f.headline] == ["dynamic / fixed"]
    assert {f.what for f in grouped}.isdisjoint(f.what for f in single)
    native = next(f for f in grouped if f.headline)
    assert native.ratio == group["results"]["native"]["dynamic_over_fixed"] and native.value > 0


@pytest.mark.parametrize(
    "optimizer, bound", [("adagrad", (32 + 32) / (16 + 32)), ("rowwise_adagrad", (32 + 4) / (16 + 4))]
)
def test_row_dtype_states_what_half_rows_can_gain_where_bytes_bound_the_step(tmp_path, optimizer, bound):
    """bench row-dtype measures every row type on the same ids, and says the most a half row can
    gain by bytes: its weights halve, its float32 states do not (Adagrad's are a row wide)."""
    report = run(tmp_path, "row-dtype", *TINY, "--warmup", "1", "--optimizer", optimizer)  # dim 8
    r = report["results"]
    assert r["half_over_fp32_byte_bound"] == pytest.approx(bound)
    assert r["bf16_over_fp32"] > 0 and r["fp16_over_fp32"] > 0
    assert "at most" in report["summary"][-1]


def test_the_suites_varying_history_case_is_named_apart_from_the_30_long_one():
    """The suite's two e2e cases on a GPU (histories all 30 long; 3 to 30) give figures of
    different names and headlines (the report's data spec says the lengths)."""
    path = CHECKOUT / "benchmarks/results/2026-12-07-h100-e2e-din-4096-histories-3-30.json"
    varying = json.loads(path.read_text())
    fixed = json.loads(json.dumps(varying))
    fixed["results"]["data"]["spec"]["min_hist_len"] = 30
    of_fixed, of_varying = figures_of("e2e", fixed), figures_of("e2e", varying)
    assert [f.headline for f in of_fixed if f.headline] == ["e2e samples/s", "e2e AUC"]
    assert [f.headline for f in of_varying if f.headline] == [
        "e2e samples/s, histories of 3 to 30",
        "e2e AUC, histories of 3 to 30",
    ]
    assert {f.what for f in of_varying}.isdisjoint(f.what for f in of_fixed)
    assert of_varying[0].ratio == varying["results"]["dynarec_over_peer"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["e2e", "--runs", "0"], "--runs: 0 is below 1"),
        (["e2e", "--train-rows", "0"], "--train-rows: 0 is below 1"),
        (["e2e", "--min-history", "0"], "--min-history: 0 is below 1"),
        (["data-stage", "--data-batch", "0"], "--data-batch: 0 is below 1"),
        (["data-stage", "--steps", "-1"], "--steps: -1 is below 1"),
        (["fused-step", "--bags", "0"], "--bags: 0 is below 1"),
        (["fused-step", "--warmup", "-1"], "--warmup: -1 is below 0"),
        (["sweep", "--grid-rows", "100", "0"], "--grid-rows: 0 is below 1"),
        (["hash-find", "--slots", "10"], "--slots: 10 is below 64"),
    ],
)
def test_a_bench_number_out_of_range_is_argparses_error_naming_the_option(argv, message, capsys):
    """Zero runs, steps, bags or rows ended in IndexError, ZeroDivisionError or a kernel's
    RuntimeError traceback (a QA pass); they are argparse's error naming the option."""
    with pytest.raises(SystemExit) as exited:
        main(["bench", *argv])
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["sweep", "--optimizer", "sgd"],
        ["sweep", "--dim", "8"],
        ["hash-find", "--rows", "1000"],
        ["hash-find", "--warmup", "1"],
        ["fused-step", "--slots", "1024"],
        ["row-dtype", "--score-strategy", "lfu"],
        ["host-tier", "--slots", "1024"],
    ],
)
def test_a_bench_refuses_an_option_it_does_not_read(argv, capsys):
    """Every step benchmark took every step option: `sweep --optimizer sgd --dim 8` ran Adagrad at
    dim 64 and said nothing, `fused-step --slots` changed nothing. Each takes its own now."""
    with pytest.raises(SystemExit) as exited:
        main(["bench", *argv])
    assert exited.value.code == 2 and f"unrecognized arguments: {' '.join(argv[1:])}" in capsys.readouterr().err


@pytest.mark.parametrize("ids, zipf, floor", [("bounded", "0", "0"), ("bounded", "-1", "0"), ("wrapped", "1", "1")])
def test_host_tier_refuses_a_zipf_exponent_its_draw_cannot_take(ids, zipf, floor, capsys):
    assert main(["bench", "host-tier", "--ids", ids, "--zipf", zipf, *TINY]) == 2
    assert f"--zipf must be above {floor} with --ids {ids}, got {float(zipf)}" in capsys.readouterr().err


def test_set_changes_a_dotted_field_of_the_config_and_names_a_bad_one():
    from dynarec.bench.common import set_field

    raw = {"train": {"num_epochs": 1}, "data": {"batch_size": 8}}
    set_field(raw, "train.whole_step_graphs_eager_lookups=true")
    set_field(raw, "data.batch_size=4096")
    set_field(raw, "model.dlrm.top_hidden_units=[64, 32]")
    assert raw["train"] == {"num_epochs": 1, "whole_step_graphs_eager_lookups": True}
    assert raw["data"]["batch_size"] == 4096 and raw["model"] == {"dlrm": {"top_hidden_units": [64, 32]}}
    with pytest.raises(ValueError, match="give KEY=VALUE"):
        set_field(raw, "train.num_epochs")
    with pytest.raises(ValueError, match="batch_size is not a section"):
        set_field(raw, "data.batch_size.x=1")
