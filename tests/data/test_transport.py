import os
import pickle

import pytest
import torch

from dynarec.data.batch import Batch, DataError
from dynarec.data.shared_decode import PassAbandoned, write_batch
from dynarec.data.transport import narrowest_integer, pack, unpack
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


@pytest.mark.parametrize(
    "low,high,dtype",
    [
        (0, -1, torch.uint8),  # no values
        (0, 255, torch.uint8),
        (0, 256, torch.int16),
        (-1, 0, torch.int16),
        (-(2**15), 2**15 - 1, torch.int16),
        (0, 2**15, torch.int32),
        (-(2**31), 2**31 - 1, torch.int32),
        (0, 2**31, torch.int64),
        (-(2**63), 0, torch.int64),
    ],
)
def test_the_narrowest_integer_type_holds_the_range(low, high, dtype):
    assert narrowest_integer(low, high) == dtype


def test_integers_travel_narrow_and_come_back_widened_or_as_they_travelled():
    ids = torch.tensor([0, 7, 2**31 - 1, 5])
    lengths = torch.tensor([1, 0, 2, 1])
    dense = torch.rand(3)
    buffer, slots = pack([ids, lengths, dense], [torch.int32, torch.uint8])
    assert buffer.numel() == 3 * 64  # 16 + 4 + 12 bytes, each slot aligned
    wide = unpack(buffer, slots)
    assert [t.dtype for t in wide] == [torch.int64, torch.int64, torch.float32]
    assert torch.equal(wide[0], ids) and torch.equal(wide[1], lengths) and torch.equal(wide[2], dense)
    narrow = unpack(buffer, slots, widen=False)
    assert [t.dtype for t in narrow] == [torch.int32, torch.uint8, torch.float32]
    assert torch.equal(narrow[0].long(), ids) and torch.equal(narrow[1].long(), lengths)
    assert all(t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for t in narrow)
    with pytest.raises(ValueError, match=r"tensor 2 \(torch.float32\) cannot be stored as torch.int32"):
        pack([ids, lengths, dense], [None, None, torch.int32])


def criteo_shaped_batch(rows: int = 64, features: int = 26, hashed: bool = False) -> Batch:
    """One id a row and feature (some rows without), ids below 2^31 unless ``hashed``."""
    g = torch.Generator().manual_seed(0)
    lengths = (torch.rand(features * rows, generator=g) > 0.1).long()
    high = 2**62 if hashed else 2**31 - 1
    ids = torch.randint(-high if hashed else 0, high, (int(lengths.sum()),), generator=g)
    keys = [f"c{i}" for i in range(features)]
    sparse = JaggedBatch(keys, ids, lengths)
    per_key = ids.split(lengths.view(features, rows).sum(1).tolist())
    sparse = sparse.with_id_ranges([(int(v.min()), int(v.max())) if len(v) else (0, -1) for v in per_key])
    return Batch(sparse, {"d": torch.rand(rows, 13)}, torch.rand(rows, 1), None, rows)


@pytest.mark.parametrize("hashed", [False, True])
def test_a_batch_travels_in_its_narrowest_integer_types(tmp_path, hashed):
    """A Criteo-shaped batch's lengths (0 or 1) travel as uint8, its ids below 2^31 as int32
    (hashed ids, over the whole int64 range, as they are); read back, they are int64 again."""
    batch = criteo_shaped_batch(hashed=hashed)
    slots = batch.packed()[1]
    assert [s[1] for s in slots[:2]] == [torch.int64 if hashed else torch.int32, torch.uint8]
    ids_bytes = batch.sparse.values().numel() * (8 if hashed else 4)
    assert slots[2][0] <= -(-ids_bytes // 64) * 64 + -(-batch.sparse.lengths().numel() // 64) * 64
    back = write_batch(tmp_path, 0, batch).load()
    assert_same(batch, back)
    assert back.sparse.values().dtype == back.sparse.lengths().dtype == torch.int64


def test_ids_whose_ranges_are_unknown_travel_as_they_are():
    batch = every_field_batch()  # its maker worked out no id ranges
    slots = batch.packed()[1]
    assert [s[1] for s in slots[:2]] == [torch.int64, torch.uint8]
    assert_same(batch, pickle.loads(pickle.dumps(batch)))


def test_a_batch_kept_narrow_trains_the_tables_as_the_int64_batch_does(device):
    """A page-locked batch keeps its ids and lengths as they travelled (uint8, int32); the
    collection widens them on its device, and every output and table row is the int64 batch's."""
    from dynarec import DynamicTableOptions, EmbeddingCollection, FeatureConfig, TableConfig
    from dynarec.data.batch import _unpacked_batch
    from dynarec.optim import Adagrad

    def tables():
        specs = [
            TableConfig(name="dyn", dim=4, features=["a", "b"], dynamic=DynamicTableOptions(256)),
            TableConfig(name="seq", dim=4, num_embeddings=50, features=[FeatureConfig("s", pooling="none")]),
        ]
        return EmbeddingCollection(specs, Adagrad(lr=0.1), device=device)

    g = torch.Generator().manual_seed(0)

    def batch(rows=8):
        big = lambda: [[int(i)] for i in torch.randint(2**31 - 40, 2**31, (rows,), generator=g)]
        seq = [torch.randint(0, 50, (int(n),), generator=g).tolist() for n in torch.randint(0, 4, (rows,), generator=g)]
        sparse = JaggedBatch.from_lists({"a": big(), "b": big(), "s": seq})
        per_key = sparse.values().split(sparse.length_per_key())
        sparse = sparse.with_id_ranges([(int(v.min()), int(v.max())) if len(v) else (0, -1) for v in per_key])
        return Batch(sparse, {}, torch.rand(rows, 1), None, rows)

    wide, narrow = tables(), tables()
    for step in range(4):
        sent = batch()
        buffer, slots, layout = sent.packed()
        if device == "cuda":
            buffer = buffer.pin_memory()
        travelled = _unpacked_batch(buffer, slots, layout, widen=False)
        assert travelled.sparse.values().dtype == torch.int32 and travelled.sparse.lengths().dtype == torch.uint8
        if step % 2:
            narrow.prefetch(travelled.sparse)  # its input stage run ahead, as the training loop does
        outs = [wide(sent.sparse), narrow(travelled.sparse)]
        assert outs[0].keys() == outs[1].keys()
        for k in outs[0]:
            assert torch.equal(outs[0][k], outs[1][k]), k
        for out in outs:
            sum((v * v).sum() for v in out.values()).backward()
    for name in wide.tables:
        a, b = wide.tables[name].dump(), narrow.tables[name].dump()
        assert all(torch.equal(a[f], b[f]) for f in a), name


def test_a_field_replaced_on_a_packed_batch_leaves_it_unpacked():
    """A batch from a worker is views of one buffer; a field replaced since is not in it, so the
    batch no longer claims the buffer (a copy to a device, a replayed step would read the old)."""
    back = pickle.loads(pickle.dumps(every_field_batch()))
    assert back.packed_buffer() is not None
    back.ready = None  # (not a field of the data)
    assert back.packed_buffer() is not None
    back.labels = back.labels * 0.5
    assert back.packed_buffer() is None
    assert torch.equal(back.to(torch.device("cpu")).labels, back.labels)
