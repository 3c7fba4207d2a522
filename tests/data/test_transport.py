import os
import pickle

import pytest
import torch

from dynarec.data.batch import Batch, DataError
from dynarec.data.shared_decode import PassAbandoned, write_batch
from dynarec.data.transport import pack, unpack
from dynarec.embedding.jagged import JaggedBatch


def test_pack_gives_back_every_tensor_as_an_aligned_view_of_one_buffer():
    tensors = [
        torch.arange(7, dtype=torch.int64),
        torch.rand(3, 5),
        torch.rand(4, 6)[:, ::2],  # not contiguous
        torch.empty(0, dtype=torch.int32),
        torch.tensor([True, False, True]),
        torch.rand(2, 3, 2, dtype=torch.float64),
    ]
    buffer, slots = pack(tensors)
    out = unpack(buffer, slots)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    for t, o in zip(tensors, out):
        assert o.dtype == t.dtype and o.shape == t.shape and torch.equal(o, t)
        assert o.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert (o.data_ptr() - buffer.data_ptr()) % 64 == 0


def every_field_batch() -> Batch:
    sparse = JaggedBatch(["a", "b"], torch.arange(5), torch.tensor([1, 1, 2, 1]), torch.rand(5))
    return Batch(
        sparse,
        {"x": torch.rand(2), "seq": torch.rand(2, 3, 4)},
        torch.rand(2, 2),
        torch.tensor([7, 8]),
        2,
        dense_lengths={"seq": torch.tensor([3, 1])},
        element_lengths={"e": torch.tensor([[1, 2], [3, 0]])},
        sessions=torch.tensor([5, 5]),
    )


def assert_same(a: Batch, b: Batch) -> None:
    assert a.sparse.keys() == b.sparse.keys() and a.num_rows == b.num_rows
    assert a.sparse.host_stats() == b.sparse.host_stats()
    for x, y in [
        (a.sparse.values(), b.sparse.values()),
        (a.sparse.lengths(), b.sparse.lengths()),
        (a.sparse.weights_or_none(), b.sparse.weights_or_none()),
        (a.labels, b.labels),
        (a.groups, b.groups),
        (a.sessions, b.sessions),
    ]:
        assert (x is None and y is None) or torch.equal(x, y)
    for d, e in [(a.dense, b.dense), (a.dense_lengths, b.dense_lengths), (a.element_lengths, b.element_lengths)]:
        assert d.keys() == e.keys() and all(torch.equal(d[k], e[k]) for k in d)


@pytest.mark.parametrize("optional", [True, False])
def test_a_batch_pickles_as_one_buffer_and_comes_back_whole(optional):
    batch = every_field_batch()
    if not optional:
        batch = Batch(JaggedBatch(["a"], torch.arange(3), torch.tensor([2, 1])), {}, torch.rand(2, 1), None, 2)
    back = pickle.loads(pickle.dumps(batch))
    assert_same(batch, back)
    buffer = back._packed[0]
    assert back.labels.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_a_packed_batch_is_pinned_in_one_copy():
    back = pickle.loads(pickle.dumps(every_field_batch()))
    pinned = back.pin_memory()
    assert_same(back, pinned)
    assert pinned.sparse.values().is_pinned() and pinned.dense["seq"].is_pinned()
    assert pinned.labels.untyped_storage().data_ptr() == pinned.sparse.values().untyped_storage().data_ptr()


def test_a_batch_file_comes_back_whole_and_is_deleted_once_read(tmp_path):
    batch = every_field_batch()
    sent = write_batch(tmp_path, 3, batch)
    assert sent.path == str(tmp_path / "batch-3.bin") and os.path.getsize(sent.path) == sent.nbytes
    assert len(pickle.dumps(sent)) < 2048  # a path and a layout travel, not the tensors
    back = pickle.loads(pickle.dumps(sent)).load()
    assert_same(batch, back)
    assert not os.path.exists(sent.path) and list(tmp_path.iterdir()) == []


def test_a_batch_file_that_cannot_be_read_is_a_named_error(tmp_path):
    sent = write_batch(tmp_path, 0, every_field_batch())
    with open(sent.path, "ab") as f:
        f.write(b"x")
    with pytest.raises(DataError, match=r"batch file .*batch-0.bin could not be read .*more than the \d+ bytes"):
        sent.load()
    os.unlink(sent.path)
    with pytest.raises(DataError, match=r"batch-0.bin could not be read"):
        sent.load()


def test_a_batch_file_gone_is_an_error_value_from_the_pinning_thread(tmp_path):
    """torch's pinning thread would wrap a raised error in its own traceback: the error comes as
    a value, raised where the training loop takes the batch."""
    sent = write_batch(tmp_path, 0, every_field_batch())
    os.unlink(sent.path)
    got = sent.pin_memory()
    assert isinstance(got, DataError) and "batch-0.bin" in str(got)


def test_a_batch_file_is_not_written_into_a_pass_abandoned(tmp_path):
    with pytest.raises(PassAbandoned):
        write_batch(tmp_path / "gone", 0, every_field_batch())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_a_batch_file_is_read_straight_into_page_locked_memory(tmp_path):
    batch = every_field_batch()
    pinned = write_batch(tmp_path, 1, batch).pin_memory()
    assert_same(batch, pinned)
    assert pinned.sparse.values().is_pinned() and pinned.dense["seq"].is_pinned()


def test_a_batch_file_whose_pass_is_gone_says_so(tmp_path):
    (tmp_path / "pass").mkdir()
    sent = write_batch(tmp_path / "pass", 0, every_field_batch())
    (tmp_path / "pass").rename(tmp_path / "retired")
    with pytest.raises(DataError, match=r"batch-0.bin could not be read \(No such file or directory; its pass's dir"):
        sent.load()
