"""README.md's library example runs as printed (the README stays true to the code)."""

from pathlib import Path

import torch

from tests.matrix import needs_fbgemm

ROOT = Path(__file__).resolve().parents[1]


def _example(section: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("```python", text.index(section)) + len("```python")
    return text[start : text.index("```", start)]


@needs_fbgemm  # its 'cate' table is on the fbgemm backend
def test_the_library_example_runs():
    scope: dict = {}
    exec(compile(_example("## The library"), "README.md (The library)", "exec"), scope)
    coll, state = scope["coll"], scope["state"]
    assert coll.tables["user"].size == 3  # 2**60, -5, then 2**60 + 1: each given a row
    assert state["tables.cate.weight"].shape == (1000, 16) and state["tables.user.keys"].tolist() == [-5, 2**60]
    assert all(v.device == torch.device("cpu") for v in state.values())
