"""Fixtures shared by the whole suite: the backend and device matrix (tests/matrix.py)."""

import pytest

from tests.matrix import BACKENDS, DEVICES


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Every row-store backend; fbgemm is skipped where FBGEMM is not installed."""
    return request.param


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Every device; cuda is skipped where no GPU is present."""
    return request.param
