"""dynarec.files: what the commands write for users and tools to read."""

import json
import math

import pytest

from dynarec import files
from dynarec.files import json_text, swap_in


def test_json_text_is_strict_json_with_undefined_numbers_as_null():
    """metrics.json and the train / evaluate reports held a bare NaN where a metric is undefined on
    the data (a grouped AUC whose every group holds one class): Python reads it, JSON readers
    (jq, JavaScript, Go) refuse the file. Non-finite numbers are written as null."""
    report = {"eval": {"auc": 0.75, "grouped_auc": math.nan}, "losses": [[1, math.inf], [2, -math.inf]], "step": 3}
    text = json_text(report)

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    assert json.loads(text, parse_constant=refuse) == {
        "eval": {"auc": 0.75, "grouped_auc": None},
        "losses": [[1, None], [2, None]],
        "step": 3,
    }
    with pytest.raises(ValueError):
        json.loads(json.dumps(report), parse_constant=refuse)  # (what was written before)


def _directory(path, text):
    path.mkdir()
    (path / "f").write_text(text)
    return path


class _Killed(BaseException):
    pass


def test_swap_in_leaves_the_target_complete_at_every_instant(tmp_path, monkeypatch):
    """A directory replaced by its new version (a checkpoint re-saved, an export rewritten): a
    kill between renaming the old one aside and the new one in left no target at all. Swapped
    in one step, there is no such point; a kill before the old one is deleted leaves the target
    new and the old one under the temporary name."""
    target, tmp = _directory(tmp_path / "t", "old"), _directory(tmp_path / ".t.tmp", "new")
    renames = []
    real_replace = files.os.replace

    def replace(src, dst):  # killed at the second rename of a replacement, were there one
        renames.append(src)
        if len(renames) == 2:
            raise _Killed
        real_replace(src, dst)

    def rmtree(path, *args, **kwargs):
        raise _Killed

    monkeypatch.setattr(files.os, "replace", replace)
    monkeypatch.setattr(files.shutil, "rmtree", rmtree)
    with pytest.raises(_Killed):
        swap_in(tmp, target, tmp_path / ".t.old")
    assert (target / "f").read_text() == "new" and (tmp / "f").read_text() == "old"
    assert not (tmp_path / ".t.old").exists()


def test_swap_in_renames_aside_where_the_file_system_cannot_swap(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    target, tmp = _directory(tmp_path / "t", "old"), _directory(tmp_path / ".t.tmp", "new")
    swap_in(tmp, target, tmp_path / ".t.old")
    assert (target / "f").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def test_this_file_system_swaps_in_one_step(tmp_path):
    """Where the tests run (Linux, a local file system), the atomic swap is the one taken."""
    a, b = _directory(tmp_path / "a", "a"), _directory(tmp_path / "b", "b")
    assert files._exchange(a, b)
    assert (a / "f").read_text() == "b" and (b / "f").read_text() == "a"
