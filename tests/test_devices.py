"""dynarec.devices: host memory locked for a GPU (its failure named, with its bytes and the table
whose rows it is), the device check."""

import gc
import warnings

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


def test_capturing_pauses_the_collector_and_leaves_it_as_it_was():
    assert gc.isenabled()
    with devices.capturing():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with devices.capturing():
            assert not gc.isenabled()
        assert not gc.isenabled()  # paused by someone else: still paused
    finally:
        gc.enable()
    with pytest.raises(KeyError), devices.capturing():
        raise KeyError("a capture that fails")
    assert gc.isenabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph capture")
def test_no_collection_runs_inside_a_captured_update():
    """A collection inside a capture may free page-locked rows held in a reference cycle, whose
    unlock spoils the capture and leaves the freed memory registered (CUDA error 712 on the next
    lock). With the collector at its most eager, none runs while the update is captured."""
    from dynarec.kernels import gpu
    from dynarec.kernels.gpu import update as gpu_update
    from dynarec.optim import definition

    during: list[bool] = []
    callback = lambda phase, info: during.append(torch.cuda.is_current_stream_capturing()) if phase == "start" else None
    spec = Adagrad(lr=0.1)
    weight = torch.randn(100, 16, device="cuda")
    states = {s.name: torch.zeros(100, s.width(16), device="cuda") for s in spec.state_specs()}
    rows = torch.arange(0, 100, 3, device="cuda")
    offsets = torch.tensor([0, 10, rows.numel()], device="cuda")
    thresholds = gc.get_threshold()
    gpu_update._CAPTURED.clear()
    captures = gpu_update._CAPTURED.captures
    gc.callbacks.append(callback)
    gc.set_threshold(1, 1, 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a capture that fails warns
            for step in (1, 2, 3):
                gpu.bag_update(definition(spec).kernel(spec, step), lr=spec.lr, weight=weight, states=states,
                               rows=rows, offsets=offsets, per_sample_weights=None,
                               grad_out=torch.ones(2, 16, device="cuda"))  # fmt: skip
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(callback)
    assert gpu_update._CAPTURED.captures == captures + 1
    assert during and not any(during)  # collections ran, none of them inside the capture
    page_lock(torch.zeros(1000, 16))  # host memory locks as before
