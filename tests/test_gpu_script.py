"""benchmarks/gpu.sh, the GPU machines' test run, covers every test file with CUDA cases."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_sh_runs_every_test_file_with_cuda_cases():
    with_cuda = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"\bneeds_cuda\b|\bDEVICES\b", p.read_text())
    }
    listed = set(re.findall(r"tests/[\w/]+\.py", (ROOT / "benchmarks" / "gpu.sh").read_text()))
    assert len(with_cuda) >= 8
    assert not with_cuda - listed, sorted(with_cuda - listed)
    assert all((ROOT / f).is_file() for f in listed), sorted(f for f in listed if not (ROOT / f).is_file())
