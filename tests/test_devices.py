"""dynarec.devices: host memory locked for a GPU (its failure named, with its bytes and the table
whose rows it is), the device check."""

import pytest
import torch

from dynarec import devices
from dynarec.devices import HostMemoryError, page_lock
from dynarec.embedding import cached_store
from dynarec.optim import Adagrad


class _RefusingRuntime:
    """A CUDA runtime whose cudaHostRegister fails as on a host out of lockable memory."""

    def cudaHostRegister(self, ptr, nbytes, flags):
        return 2  # cudaErrorMemoryAllocation

    def cudaHostUnregister(self, ptr):
        return 0


def test_host_memory_that_cannot_be_locked_is_a_named_error_with_its_bytes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", _RefusingRuntime)
    with pytest.raises(HostMemoryError, match=r"0\.04 GB of host memory could not be locked for the GPU .*error 2"):
        page_lock(torch.zeros(1_000_000, 10))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        page_lock(torch.zeros(10, 10).t())


def test_a_cached_table_whose_host_rows_cannot_be_locked_is_named(monkeypatch):
    def refused(*args, **kwargs):
        raise HostMemoryError("1.00 GB of host memory could not be locked for the GPU")

    monkeypatch.setattr(cached_store, "NativeRowStore", refused)
    with pytest.raises(HostMemoryError, match=r"table 'items': 1\.00 GB of host memory could not be locked"):
        cached_store.CachedRowStore(1000, 8, Adagrad(lr=0.1), "cpu", cache_rows=10, name="items")


def test_the_device_check_names_a_device_this_build_cannot_use():
    with pytest.raises(ValueError, match="not a device"):
        devices.check_device("gpu0")
    assert devices.check_device("cpu") == torch.device("cpu")
