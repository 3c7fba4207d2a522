"""``dynarec bench``: each benchmark runs end to end on a tiny workload and reports what it
promises (its baseline beside it, runs, ratios, tables as sized). Speeds are not asserted: a
benchmark is read, not tested (docs/benchmarks.md)."""

import json
import statistics

import pytest

from dynarec.cli import main
from tests.matrix import BACKENDS

TINY = ["--rows", "2000", "--dim", "8", "--bags", "64", "--pooling-factor", "4", "--steps", "1", "--runs", "2"]


def same_run_ratio(a: dict, b: dict) -> float:
    """The median over runs of a's rate over b's in the same run (interleaved)."""
    return statistics.median(x / y for x, y in zip(a["ids_per_s_runs"], b["ids_per_s_runs"]))


def run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "report.json"
    assert main(["bench", *argv, "--warmup", "1", "--json", str(out)]) in (0, None)
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_step_reports_the_fixed_baselines_beside_it_and_drops_no_key(tmp_path, backend):
    report = run(tmp_path, "dynamic-step", *TINY)
    result = report["results"][backend]
    for kind in ("dynamic", "fixed", "fixed_scattered"):
        assert len(result[kind]["ids_per_s_runs"]) == 2
    assert result["dynamic_over_fixed"] == pytest.approx(same_run_ratio(result["dynamic"], result["fixed"]))
    assert result["dynamic_report"]["dropped_keys"] == 0 and result["dynamic_report"]["size"] > 0


def test_fused_step_reports_native_over_fbgemm_or_native_alone(tmp_path):
    report = run(tmp_path, "fused-step", *TINY)
    results = report["results"]
    assert len(results["native"]["ids_per_s_runs"]) == 2
    if "fbgemm" in results:
        assert results["native_over_fbgemm"] == pytest.approx(same_run_ratio(results["native"], results["fbgemm"]))
    assert 0 < results["unique_fraction"] <= 1


def test_data_stage_times_the_native_path_against_pyarrow_on_identical_batches(tmp_path):
    from dynarec.features import native

    report = run(tmp_path, "data-stage", "--data-batch", "64", "--steps", "2", "--runs", "2")
    result = report["results"]
    assert result["rows_per_batch"] == 64 and result["batches_per_run"] == 2
    assert len(result["pyarrow"]["rows_per_s_runs"]) == 2
    if native.available():
        assert result["identical_batches"] is True and len(result["native"]["rows_per_s_runs"]) == 2
        assert result["native_over_pyarrow"] > 0
