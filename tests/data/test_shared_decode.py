"""Row groups decoded once for all of a loader's workers (dynarec.data.shared_decode): the
batches are those of one process whatever the workers, row groups, chunks, seek position and
rank; each row group is read by one worker; an abandoned pass and the loader leave nothing in
shared memory; a decoding error reaches the training process as the one-line error; the
batches travel as files of the pass's directory."""

import os
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dynarec.data import ArrowBatchDataset, BatchBuilder, DataError, make_loader, shared_decode
from dynarec.data.reader import leaf_fields
from dynarec.data.shared_decode import pass_directory
from tests.data.test_reader import builder, prices, rows_table

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


@pytest.fixture
def parquet_files(tmp_path):
    """61 rows in three Parquet files of row groups of 3, 4 and 7 rows (an empty file between)."""
    pq.write_table(rows_table(10), tmp_path / "a.parquet", row_group_size=3)
    pq.write_table(rows_table(0), tmp_path / "b.parquet")
    pq.write_table(rows_table(23, 10), tmp_path / "c.parquet", row_group_size=4)
    pq.write_table(rows_table(28, 33), tmp_path / "d.parquet", row_group_size=7)
    return [str(tmp_path / n) for n in ("a.parquet", "b.parquet", "c.parquet", "d.parquet")]


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 2 rows: a row group is published in several (the loader gives its workers the size)."""
    monkeypatch.setattr(shared_decode, "CHUNK_ROWS", 2)


def batches_of(loader):
    return [(b.dense["price"].tolist(), b.labels.tolist(), b.sparse.values().tolist()) for b in loader]


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("start_row", [0, 5, 13, 44])
@pytest.mark.parametrize("rank", [0, 1])
def test_workers_decoding_for_each_other_give_the_batches_of_one_process(
    parquet_files, small_chunks, workers, start_row, rank
):
    def dataset():
        return ArrowBatchDataset(parquet_files, builder(), 3, start_row=start_row, rank=rank, world_size=2)

    one = batches_of(make_loader(dataset(), 0))
    loader = make_loader(dataset(), workers)
    assert loader.shared_root is not None
    assert batches_of(loader) == one
    assert not pass_directory(loader.shared_root, 1).exists()  # the pass's directory went with the pass ...
    deadline = time.monotonic() + 10
    while os.listdir(loader.shared_root) != [".lock"] and time.monotonic() < deadline:
        time.sleep(0.01)  # ... and its files, deleted on the loader's thread
    assert os.listdir(loader.shared_root) == [".lock"]


def test_each_part_of_each_row_group_is_read_once_by_the_worker_it_belongs_to(parquet_files, small_chunks, tmp_path):
    """Three workers' generators run side by side (threads): every row group's columns are read
    once, in parts of about equal bytes each read by the worker it belongs to, and together they
    give every step once, as one process does."""
    reads: list[tuple[int, int, tuple[str, ...]]] = []
    workers = 3
    one = prices(make_loader(ArrowBatchDataset(parquet_files, builder(), 4, start_row=2), 0))
    ds = ArrowBatchDataset(parquet_files, builder(), 4, start_row=2)
    units = ds.units()
    real = ds._read_unit

    def counting(unit, columns):
        reads.append((threading.get_ident(), units.index(unit), columns))
        return real(unit, columns)

    ds._read_unit = counting
    directory = tmp_path / "pass"
    directory.mkdir()
    got: dict[int, list] = {}
    idents: dict[int, int] = {}

    def run(w):
        idents[w] = threading.get_ident()
        got[w] = [b.load().dense["price"].tolist() for b in ds._shared_batches(w, workers, directory)]

    threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    steps = [got[s % workers][s // workers] for s in range(len(one))]
    assert steps == one
    worker_of = {ident: w for w, ident in idents.items()}
    for u, unit in enumerate(units):
        parts = shared_decode.column_parts(unit, workers)
        assert len(parts) == workers  # (8 columns)
        read = sorted((worker_of[ident], columns) for ident, v, columns in reads if v == u)
        assert read == sorted((shared_decode.part_owner(u, p, workers, workers), parts[p]) for p in range(workers))
        assert sorted(c for _, columns in read for c in columns) == sorted(ds.builder.columns())


def test_column_parts_balance_bytes_and_keep_the_columns_order():
    unit = shared_decode.Unit("f", 0, 0, 0, 0, 10, columns=(("a", 5), ("b", 50), ("c", 20), ("d", 20), ("e", 5)))
    assert shared_decode.column_parts(unit, 3) == [("b",), ("a", "c"), ("d", "e")]  # 50, 25, 25 bytes
    assert shared_decode.column_parts(unit, 8) == [("b",), ("c",), ("d",), ("a",), ("e",)]
    assert shared_decode.column_parts(unit, 1) == [("a", "b", "c", "d", "e")]


def test_an_abandoned_pass_lets_the_next_one_start_and_the_loader_leaves_nothing(parquet_files, small_chunks):
    """A persistent loader's pass left after two batches (a run stopping at num_steps): its
    workers stop waiting, the next pass gives every batch, and the loader's directory goes with
    the loader."""
    one = batches_of(make_loader(ArrowBatchDataset(parquet_files, builder(), 3), 0))
    loader = make_loader(ArrowBatchDataset(parquet_files, builder(), 3), 3, persistent=True)
    root = Path(loader.shared_root)
    first = iter(loader)
    assert batches_of([next(first), next(first)]) == one[:2]
    del first
    assert batches_of(loader) == one
    assert batches_of(loader) == one
    assert not pass_directory(str(root), 1).exists()
    del loader
    assert not root.exists()


def test_a_row_group_that_cannot_be_decoded_is_the_one_line_error(tmp_path, small_chunks):
    good = tmp_path / "a.parquet"
    pq.write_table(rows_table(12), good, row_group_size=4)
    bad = tmp_path / "b.parquet"
    data = bytearray(good.read_bytes())
    data[200:260] = b"\xff" * 60  # inside the first row group's column chunks
    bad.write_bytes(bytes(data))
    files = [str(good), str(bad)]
    with pytest.raises(DataError, match=r"b\.parquet: cannot be read"):
        list(make_loader(ArrowBatchDataset(files, builder(), 3), 2))


def test_csv_files_are_decoded_by_every_worker_as_before(tmp_path):
    """A CSV file has no row groups to share: the loader keeps no directory for it."""
    import pyarrow.csv as pacsv

    pacsv.write_csv(rows_table(9), tmp_path / "a.csv")
    ds = ArrowBatchDataset([str(tmp_path / "a.csv")], builder(), 3)
    assert ds.units() is None
    loader = make_loader(ds, 2)
    assert loader.shared_root is None
    assert batches_of(loader) == batches_of(make_loader(ArrowBatchDataset([str(tmp_path / "a.csv")], builder(), 3), 0))


def test_a_single_worker_or_none_shares_nothing(parquet_files):
    assert make_loader(ArrowBatchDataset(parquet_files, builder(), 3), 1).shared_root is None
    assert make_loader(ArrowBatchDataset(parquet_files, builder(), 3), 0).shared_root is None
    assert torch.get_num_threads() >= 1


def test_row_groups_smaller_than_a_chunk_and_empty_ones_give_the_batches_of_one_process(tmp_path):
    """Row groups of 3 rows (a chunk each, at the real chunk size) and empty row groups between
    them (a writer given an empty table writes one): the batches of one process."""
    empty = rows_table(3).slice(0, 0)
    writer = pq.ParquetWriter(tmp_path / "a.parquet", empty.schema)
    for start in range(0, 30, 3):
        writer.write_table(rows_table(3, start))
        writer.write_table(empty)
    writer.close()
    assert pq.ParquetFile(tmp_path / "a.parquet").metadata.num_row_groups == 20
    files = [str(tmp_path / "a.parquet")]
    ds = ArrowBatchDataset(files, builder(), 4, start_row=1)
    assert [u.rows for u in ds.units()] == [2] + [3] * 9
    one = batches_of(make_loader(ArrowBatchDataset(files, builder(), 4, start_row=1), 0))
    assert batches_of(make_loader(ds, 3)) == one


def test_a_worker_failing_lets_the_workers_waiting_for_its_rows_fail_with_its_error(
    parquet_files, small_chunks, monkeypatch
):
    """The owner of a row group cannot write its chunks (a full /dev/shm): the error reaches
    the training process, and no worker waits for the rows it never wrote."""
    import errno

    if torch.cuda.is_initialized():  # workers then start from a fork server, which the patch below does not reach
        pytest.skip("the failing write is patched into this process: it reaches forked workers only")
    monkeypatch.setattr(shared_decode, "WAIT_TIMEOUT_S", 20.0)  # a wait would surface as a TimeoutError
    real = shared_decode.write_atomic

    def full(path, write):
        if path.name.startswith("2."):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, write)

    monkeypatch.setattr(shared_decode, "write_atomic", full)
    loader = make_loader(ArrowBatchDataset(parquet_files, builder(), 3), 2)
    if loader.shared_root is None:  # shared memory too small for the chunks: each worker decodes on its own
        pytest.skip("this machine's shared memory cannot hold the chunks: the workers do not share decoding")
    with pytest.raises(OSError, match="No space left on device"):
        list(loader)


def test_workers_from_a_fork_server_share_the_decoding_too(parquet_files, small_chunks, monkeypatch):
    """A CUDA run's workers start from a fork server (nothing inherited: the dataset, its shared
    directory and chunk size travel pickled): the batches of one process."""
    from dynarec.data import reader

    monkeypatch.setattr(reader, "worker_context", lambda n: "forkserver" if n else None)
    one = batches_of(make_loader(ArrowBatchDataset(parquet_files, builder(), 3, start_row=5), 0))
    loader = make_loader(ArrowBatchDataset(parquet_files, builder(), 3, start_row=5), 2)
    assert loader.dataset.chunk_rows == 2
    assert batches_of(loader) == one


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_batches_for_a_gpu_arrive_as_files_read_into_page_locked_memory(parquet_files):
    """With CUDA initialized (workers from the fork server), each worker's batch is read by the
    DataLoader's pinning thread straight into page-locked memory."""
    torch.zeros(1, device="cuda")
    one = batches_of(make_loader(ArrowBatchDataset(parquet_files, builder(), 3, start_row=5), 0))
    loader = make_loader(ArrowBatchDataset(parquet_files, builder(), 3, start_row=5), 2, pin_memory=True)
    got = list(loader)
    assert all(b.labels.is_pinned() and b.sparse.values().is_pinned() for b in got)
    assert batches_of(got) == one


def test_shared_memory_must_hold_the_row_groups_and_the_batches_on_their_way(monkeypatch):
    """4 workers, row groups of 1,000 rows and 100 kB: 2 x 6 row groups (1.2 MB) and 2 batches a
    worker of 512 rows at 4 times their 100 bytes a row (1,638,400 bytes): 2,838,400 in all."""
    from dynarec.data import reader

    units = [shared_decode.Unit("a", g, 0, 0, 1000 * g, 1000, 100_000) for g in range(3)]

    def free(nbytes):
        monkeypatch.setattr(reader.os, "statvfs", lambda _: os.statvfs_result((4096, 1, 0, 0, nbytes, 0, 0, 0, 0, 255)))

    free(2_838_400)
    assert reader._shared_memory_holds(units, 4, 512)
    free(2_838_399)
    assert not reader._shared_memory_holds(units, 4, 512)


def test_workers_send_their_batches_as_files_read_and_deleted_as_they_arrive(parquet_files, monkeypatch):
    from dynarec.data import reader
    from dynarec.data.batch import BatchFile

    arrived = []
    delivered = reader._delivered

    def recording(item):
        arrived.append(item)
        return delivered(item)

    one = batches_of(make_loader(ArrowBatchDataset(parquet_files, builder(), 3), 0))
    monkeypatch.setattr(reader, "_delivered", recording)
    assert batches_of(make_loader(ArrowBatchDataset(parquet_files, builder(), 3), 2)) == one
    assert len(arrived) == len(one) and all(isinstance(b, BatchFile) for b in arrived)
    assert not any(os.path.exists(b.path) for b in arrived)


def test_a_column_name_with_a_dot_is_read_by_workers(tmp_path):
    """Workers sized a row group's columns by their leaves' paths cut at the first dot: column
    'user.id' became 'user', and with 2 workers every batch failed with "missing column
    'user.id'". A nested column's leaves still count for it."""
    from tests.data.test_kinds import config

    f = {"id_feature": {"feature_name": "f", "expression": "user:user.id", "embedding_dim": 4, "hash_bucket_size": 10}}
    n = 2_000
    table = pa.table(
        {
            "user.id": [f"u{i % 10}" for i in range(n)],
            "s": [{"a": i, "b": "x"} for i in range(n)],
            "clk": [i % 2 for i in range(n)],
        }
    )
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, row_group_size=1_000)
    b = BatchBuilder(config(f))
    one = [batch.sparse.values().tolist() for batch in make_loader(ArrowBatchDataset([str(path)], b, 500), 0)]
    assert [batch.sparse.values().tolist() for batch in make_loader(ArrowBatchDataset([str(path)], b, 500), 2)] == one
    assert leaf_fields(pq.ParquetFile(path).metadata) == ["user.id", "s", "s", "clk"]
