"""The Triton kernels' lane on machines without a GPU: test_gpu_kernels.py (and the collection's
packed lookup of tables of several dims, in test_grouped.py) in a pytest process of its own with
``TRITON_INTERPRET=1``, Triton's switch to interpret its kernels on CPU tensors. Triton
reads it when its kernels are defined, at import, so it cannot be set in this process (which
imported Triton at collection, and whose other tests run the compiled or the C++ kernels)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dynarec.kernels import gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(not gpu.HAVE_TRITON, reason="Triton is not installed")
@pytest.mark.skipif(gpu.INTERPRETED, reason="this process interprets the kernels already")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: test_gpu_kernels.py runs the compiled kernels")
def test_the_triton_kernels_pass_their_tests_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/test_gpu_kernels.py",
        "tests/embedding/test_grouped.py::test_fixed_tables_of_several_dims_share_one_packed_lookup",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-8000:]
    summary = out.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 60 and "skipped" not in summary, out[-8000:]
