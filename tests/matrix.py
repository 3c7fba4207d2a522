"""The backend / device matrix of the test suite, owned in one place.

A case that needs FBGEMM or a CUDA device is *skipped* (reported as such) where they are not
installed — never silently left out of a parameter list. Use ``BACKENDS`` / ``DEVICES`` in
``pytest.mark.parametrize``, or the ``backend`` / ``device`` fixtures of ``tests/conftest.py``.
"""

import pytest
import torch

from dynarec.embedding.fbgemm_store import fbgemm_available

needs_fbgemm = pytest.mark.skipif(not fbgemm_available(), reason="FBGEMM (fbgemm-gpu-cpu) is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

BACKENDS = [pytest.param("native", id="native"), pytest.param("fbgemm", id="fbgemm", marks=needs_fbgemm)]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=needs_cuda)]


def _cpu_kernels_available() -> bool:
    from dynarec.kernels import cpu

    return cpu.available()


needs_cpu_kernels = pytest.mark.skipif(not _cpu_kernels_available(), reason="dynarec's CPU extension did not build")


def _fg_kernels_available() -> bool:
    from dynarec.features import native

    return native.available()


needs_fg_kernels = pytest.mark.skipif(
    not _fg_kernels_available(), reason="dynarec's feature-generation C++ extension did not build"
)
