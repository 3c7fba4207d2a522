"""dynarec.devices: host memory locked for a GPU (its failure named, with its bytes and the table
whose rows it is), the device check, a device's start (its kernels' first uses, in a thread a
capture waits for)."""

import gc
import warnings

import pytest
import torch

from dynarec import devices
from dynarec.devices import HostMemoryError, page_lock
from dynarec.embedding import cached_store
from dynarec.embedding.hash_index import BucketedHashIndex
from dynarec.embedding.row_store import NativeRowStore, PackedRowStore
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
    for name in ("meta", "mps", "xpu"):  # devices torch knows and dynarec does not run on (raw tracebacks)
        with pytest.raises(ValueError, match=f"--device {name}: dynarec runs on cpu, cuda or cuda:N, not {name}"):
            devices.check_device(name)
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


def _packed_batch() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A buffer holding tensors of several dtypes and layouts, as a DataLoader worker's batch
    does, and the tensors: four near each other, one far off, one of its own storage."""
    buffer = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    ids = buffer[0:64].view(torch.int64)
    weights = buffer[64:96].view(torch.float32)
    matrix = buffer[96:144].view(torch.float32).view(3, 4).t()  # strided
    labels = buffer[160:176].view(torch.float32)  # a gap of 16 bytes before it
    far = buffer[8000:8016].view(torch.int32)
    return buffer, [matrix, ids, torch.ones(5), weights, far, labels]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph capture")
def test_a_capture_keeps_torchs_cached_memory_and_replays_what_it_captured():
    x = torch.randn(1 << 20, device="cuda")
    del x  # its block stays in torch's cache
    reserved = torch.cuda.memory_reserved()
    a = torch.randn(64, 64, device="cuda")
    out = a @ a  # eager first: cuBLAS's start stays out of the capture
    graph = torch.cuda.CUDAGraph()
    main = torch.cuda.current_stream()
    with devices.capture_graph(graph):
        assert torch.cuda.is_current_stream_capturing() and torch.cuda.current_stream() != main
        out = a @ a + 1
    assert torch.cuda.current_stream() == main
    assert torch.cuda.memory_reserved() >= reserved  # torch.cuda.graph empties the cache: this does not
    a.copy_(torch.eye(64, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, torch.eye(64, device="cuda") + 1, rtol=0, atol=0)
    # a block that fails ends the capture and leaves the stream it found
    with pytest.raises(RuntimeError):
        with devices.capture_graph(torch.cuda.CUDAGraph()):
            torch.cuda.synchronize()  # not allowed while capturing
    assert torch.cuda.current_stream() == main and not torch.cuda.is_current_stream_capturing()
    assert torch.equal(a @ a, torch.eye(64, device="cuda"))  # the device works on


def test_a_device_is_started_only_where_it_is_a_cuda_one():
    before = dict(devices._STARTING)
    devices.start_device(torch.device("cpu"))
    assert devices._STARTING == before  # no thread started


def test_the_first_uses_run_on_any_device_and_draw_no_random_number():
    # (on a GPU they run in a thread that swallows errors: a mistake in them shows here)
    cpu_rng = torch.get_rng_state()
    devices._first_uses(torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), cpu_rng)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_the_first_uses_run_on_a_gpu():
    # (the thread swallows errors: one only a GPU raises shows here)
    rng = torch.cuda.get_rng_state()
    devices._first_uses(torch.device("cuda"))
    torch.cuda.synchronize()
    assert torch.equal(torch.cuda.get_rng_state(), rng)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_a_started_device_is_awaited_by_a_capture_and_draws_no_random_number():
    devices.await_device_start()  # (a thread an earlier test started)
    rng = torch.cuda.get_rng_state()
    devices.start_device(torch.device("cuda"))
    assert devices._STARTING  # (until awaited)
    a = torch.eye(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with devices.capture_graph(graph):  # waits for the thread: none of its work runs inside
        out = a @ a
    assert not devices._STARTING
    graph.replay()
    assert torch.equal(out, a)
    assert torch.equal(torch.cuda.get_rng_state(), rng)


def test_tensors_lying_near_each_other_in_one_storage_form_one_span():
    _, tensors = _packed_batch()
    (span,) = devices.storage_spans(tensors)
    assert span.members == (1, 3, 0, 5) and (span.start, span.end) == (0, 176)
    assert span.offsets == (0, 64, 96, 160) and span.nbytes == 176
    # a run takes a tensor only across a gap no larger than the bytes it holds
    assert devices.storage_spans([tensors[1], tensors[4]]) == []
    # a tensor needing a gradient keeps its history: left out, unless asked for
    grad = torch.zeros(8, requires_grad=True)
    assert devices.storage_spans([grad[:4], grad[4:]]) == []
    assert devices.storage_spans([grad[:4], grad[4:]], with_grad=True)[0].members == (0, 1)


def test_a_spans_bytes_copied_once_give_every_member_back_as_it_lay():
    buffer, tensors = _packed_batch()
    (span,) = devices.storage_spans(tensors)
    copy = span.source(buffer.untyped_storage()).clone()  # what to_device moves in one piece
    assert copy.dtype == torch.uint8 and copy.numel() == span.nbytes
    views = span.views(copy, tensors)
    for i, view in zip(span.members, views):
        t = tensors[i]
        assert view.dtype == t.dtype and view.shape == t.shape and view.stride() == t.stride()
        assert torch.equal(view, t) and view.untyped_storage().data_ptr() == copy.untyped_storage().data_ptr()
    # on the device it already is on, a tensor stays itself
    assert all(a is b for a, b in zip(devices.to_device(tensors, torch.device("cpu")), tensors))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a copy to a GPU")
def test_a_packed_batch_moves_to_the_gpu_in_one_copy():
    buffer, tensors = _packed_batch()
    pinned = buffer.pin_memory()
    moved_from = [pinned.untyped_storage()]  # the tensors as views of the pinned buffer
    placed = [
        torch.empty(0, dtype=t.dtype).set_(moved_from[0], t.storage_offset(), t.shape, t.stride()) for t in tensors
    ]
    placed[2] = tensors[2]  # of its own storage
    moved = devices.to_device(placed, torch.device("cuda"))
    for t, m in zip(tensors, moved):
        assert m.is_cuda and m.dtype == t.dtype and m.shape == t.shape and torch.equal(m.cpu(), t)
    one = {moved[i].untyped_storage().data_ptr() for i in (0, 1, 3, 5)}
    assert len(one) == 1 and moved[4].untyped_storage().data_ptr() not in one


@pytest.mark.parametrize(
    "dtype, fill", [(torch.float32, 0.5), (torch.bfloat16, 0), (torch.int64, -1), (torch.uint8, 0)]
)
@pytest.mark.parametrize("numel", [0, 1000, 3 << 20])  # below and above the advice's 4 MiB
def test_a_table_tensor_holds_its_fill_in_its_shape_and_dtype(dtype, fill, numel):
    t = devices.table_tensor((numel, 2), fill, dtype)
    assert t.shape == (numel, 2) and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t, torch.full((numel, 2), fill, dtype=dtype))


def _record_advice(monkeypatch, page: int = 2 << 20) -> list[tuple[int, int, int]]:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(devices, "_huge_page_advice", lambda: (lambda *a: calls.append(a) or 0, page))
    return calls


def test_huge_pages_are_advised_for_the_whole_pages_inside_a_table_tensor(monkeypatch):
    calls = _record_advice(monkeypatch)
    page = 2 << 20
    t = devices.table_tensor((5 << 20,), 0, torch.uint8)  # 5 MiB: one whole page inside at least
    ((start, length, advice),) = calls
    begin, end = t.data_ptr(), t.data_ptr() + t.numel()
    assert advice == 14  # MADV_HUGEPAGE
    assert start % page == 0 and length % page == 0 and length >= page
    assert begin <= start < begin + page and end - page < start + length <= end
    calls.clear()
    devices.table_tensor(((4 << 20) - 1,), 0, torch.uint8)  # below two pages: none advised
    devices.table_tensor((8 << 20,), 0, torch.uint8, device="meta")  # not the CPU's memory
    assert calls == []


def test_a_tables_rows_states_and_index_are_advised_huge_pages(monkeypatch):
    calls = _record_advice(monkeypatch)
    store = NativeRowStore(1 << 15, 64, Adagrad(lr=0.1))  # 8 MiB of weights, 8 MiB of Adagrad's state
    index = BucketedHashIndex(1 << 16, 16)  # 1M slots: keys and scores 8 MiB, pins 4 MiB
    records = NativeRowStore(1 << 14, 64, Adagrad(lr=0.1), records=True)  # one 8 MiB allocation
    packed = PackedRowStore([(1 << 15, 64), (1 << 15, 32)], Adagrad(lr=0.1))  # 12 MiB flat, each
    arrays = [store.weight, store.states["momentum1"], index.keys, index.scores, index.storage.all_pins]
    arrays += [records._records, packed.weight, packed.states["momentum1"]]
    assert len(calls) == len(arrays)  # (the 1 MiB of tags: too small)
    for (start, length, _), t in zip(calls, arrays):
        assert t.data_ptr() <= start and start + length <= t.data_ptr() + t.numel() * t.element_size()


@pytest.mark.skipif(devices._huge_page_advice() is None, reason="the kernel offers no transparent huge pages")
def test_a_table_tensor_is_advised_huge_pages_where_the_kernel_offers_them():
    # The advice, not its outcome: how many huge pages the kernel gives depends on how fragmented
    # the host's memory is (the full suite on the VM: 22 of 64 MiB).
    t = devices.table_tensor((16 << 20,), 1.0, torch.float32)  # 64 MiB
    begin = t.data_ptr()
    assert _advised_bytes_in(begin, begin + t.numel() * 4) >= 60 << 20  # all but the ends
    assert torch.equal(t, torch.ones(16 << 20))


def _advised_bytes_in(begin: int, end: int) -> int:
    """How many bytes of ``[begin, end)`` lie in mappings of this process advised huge pages
    (``hg`` among their ``VmFlags``)."""
    total, overlap = 0, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                overlap = max(0, min(hi, end) - max(lo, begin))
            elif head == "VmFlags:" and "hg" in line.split()[1:]:
                total += overlap
    return total
