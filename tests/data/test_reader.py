"""The reader: batches by row position, seeking without reading earlier rows, ranks and workers."""

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from dynarec.config import config_from_dict
from dynarec.data import ArrowBatchDataset, BatchBuilder, make_loader
from dynarec.data import reader as reader_module
from tests.pipeline_fixtures import config_dict

COLUMNS = ("user_id", "age", "item_id", "cate_id", "hist_item_id", "hist_cate_id", "price", "clk")


def rows_table(n: int, start: int = 0) -> pa.Table:
    ids = list(range(start, start + n))
    return pa.table(
        {
            "user_id": [f"u{i}" for i in ids],
            "age": [i % 8 for i in ids],
            "item_id": [i % 200 for i in ids],
            "cate_id": [i % 10 for i in ids],
            "hist_item_id": [f"{i % 200}|{(i + 1) % 200}" for i in ids],
            "hist_cate_id": [f"{i % 10}|1" for i in ids],
            "price": [float(i) for i in ids],
            "clk": [i % 2 for i in ids],
        }
    )


class CountingBuilder(BatchBuilder):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.built = 0

    def build(self, table, origin):
        self.built += 1
        return super().build(table, origin)


def builder():
    return CountingBuilder(config_from_dict(config_dict()))


@pytest.fixture
def files(tmp_path):
    """37 rows in three files (Parquet with small row groups, and a CSV)."""
    pq.write_table(rows_table(10), tmp_path / "a.parquet", row_group_size=3)
    pq.write_table(rows_table(15, 10), tmp_path / "b.parquet", row_group_size=4)
    pacsv.write_csv(rows_table(12, 25), tmp_path / "c.csv")
    return [str(tmp_path / n) for n in ("a.parquet", "b.parquet", "c.csv")]


def prices(batches):
    return [b.dense["price"].tolist() for b in batches]


@pytest.mark.parametrize("start_row", [0, 4, 9, 10, 25, 31, 36])
def test_seek_yields_exactly_the_batches_after_the_position(files, start_row):
    full = ArrowBatchDataset(files, builder(), 4, start_row=0)
    every_row = [p for batch in prices(make_loader(full, 0)) for p in batch]
    b = builder()
    ds = ArrowBatchDataset(files, b, 4, start_row=start_row)
    got = prices(make_loader(ds, 0))
    assert [p for batch in got for p in batch] == every_row[start_row:]
    assert [len(x) for x in got[:-1]] == [4] * (len(got) - 1)
    assert b.built == len(got) == ds.num_steps()


def test_seek_reads_no_parquet_row_group_before_the_position(files, monkeypatch):
    read_groups = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *a, row_groups=None, **kw):
        read_groups.append(list(row_groups) if row_groups is not None else "all")
        return real(self, *a, row_groups=row_groups, **kw)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    list(make_loader(ArrowBatchDataset(files, builder(), 4, start_row=17), 0))
    assert read_groups == [[1, 2, 3]]  # a.parquet skipped whole; b.parquet from the group holding row 7


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_do_not_depend_on_the_number_of_workers(files, workers):
    one = prices(make_loader(ArrowBatchDataset(files, builder(), 5), 0))
    assert prices(make_loader(ArrowBatchDataset(files, builder(), 5), workers)) == one


def test_ranks_take_contiguous_shares_of_each_global_batch(files):
    every_row = [p for batch in prices(make_loader(ArrowBatchDataset(files, builder(), 8), 0)) for p in batch]
    shares = [prices(make_loader(ArrowBatchDataset(files, builder(), 4, rank=r, world_size=2), 0)) for r in (0, 1)]
    # Global batches of 8: rank 0 takes rows 0-3, rank 1 rows 4-7; the last global batch of 5 rows
    # splits 2 / 3.
    assert [len(x) for x in shares[0]] == [4, 4, 4, 4, 2] and [len(x) for x in shares[1]] == [4, 4, 4, 4, 3]
    merged = [p for a, b in zip(*shares) for p in a + b]
    assert merged == every_row


def test_a_last_global_batch_of_fewer_rows_than_ranks_leaves_a_rank_an_empty_share(files):
    """37 rows in global batches of 12 (3 ranks of 4): the last global batch holds 1 row, rank 0
    takes it, ranks 1 and 2 an empty batch each (they take part in the step all the same)."""
    shares = [prices(make_loader(ArrowBatchDataset(files, builder(), 4, rank=r, world_size=3), 0)) for r in range(3)]
    assert [len(s[-1]) for s in shares] == [0, 0, 1]
    assert [len(s) for s in shares] == [4, 4, 4]


def test_num_rows_of_parquet_and_csv(files):
    assert [reader_module.num_rows(f) for f in files] == [10, 15, 12]


def test_a_csv_files_rows_are_counted_once_while_it_stays_as_it_is(tmp_path, monkeypatch):
    """Counting a CSV file's rows reads it whole; every epoch's dataset and every evaluation's
    asked again. The count is kept while the file keeps its size and modification time; a file
    rewritten is counted anew."""
    import os

    path = tmp_path / "t.csv"
    pacsv.write_csv(pa.table({"x": list(range(7))}), path)
    opened = []
    open_csv = pacsv.open_csv
    monkeypatch.setattr(reader_module.pacsv, "open_csv", lambda *a, **k: opened.append(a[0]) or open_csv(*a, **k))
    assert [reader_module.num_rows(str(path)) for _ in range(3)] == [7, 7, 7] and len(opened) == 1
    stat = path.stat()
    pacsv.write_csv(pa.table({"x": list(range(9))}), path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # (a later write, whatever the clock's grain)
    assert reader_module.num_rows(str(path)) == 9 and len(opened) == 2


def test_a_files_schema_is_read_once_while_it_stays_as_it_is(tmp_path, monkeypatch):
    """Every epoch's training dataset and every evaluation's checked every file's schema again: a
    Parquet footer read a file (a round trip on a network file system) or a CSV file's first
    block parsed. The schema is kept while the file keeps its size and modification time; a
    file rewritten is read anew, and a CSV file's schema is kept by the column types asked."""
    import os

    parquet, csv = tmp_path / "t.parquet", tmp_path / "t.csv"
    pq.write_table(pa.table({"x": [1, 2]}), parquet)
    pacsv.write_csv(pa.table({"x": [1, 2]}), csv)
    reads = []
    read_schema, open_csv = pq.read_schema, pacsv.open_csv
    monkeypatch.setattr(reader_module.pq, "read_schema", lambda *a, **k: reads.append(a[0]) or read_schema(*a, **k))
    monkeypatch.setattr(reader_module.pacsv, "open_csv", lambda *a, **k: reads.append(a[0]) or open_csv(*a, **k))
    for _ in range(3):
        assert reader_module.file_schema(str(parquet)).field("x").type == pa.int64()
        assert reader_module.file_schema(str(csv)).field("x").type == pa.int64()
    assert reads == [str(parquet), str(csv)]
    assert reader_module.file_schema(str(csv), csv_types={"x": pa.string()}).field("x").type == pa.string()
    assert len(reads) == 3
    stat = parquet.stat()
    pq.write_table(pa.table({"x": [1.5, 2.5]}), parquet)
    os.utime(
        parquet, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000)
    )  # (a later write, whatever the clock's grain)
    assert reader_module.file_schema(str(parquet)).field("x").type == pa.float64() and len(reads) == 4


def test_a_header_only_csv_among_csv_files_reads_as_no_rows(tmp_path):
    """Spark and Hive write empty part files: a header-only CSV's columns infer as Arrow's null
    type, which was refused as 'typed differently' against every other file (an advice a CSV
    cannot follow). Its columns hold no value: any type fits, and the batches are those of the
    other files."""
    from tests.data.test_transport import assert_same

    both = tmp_path / "both"
    both.mkdir()
    pacsv.write_csv(rows_table(6), both / "part-1.csv")
    (both / "part-0.csv").write_text((both / "part-1.csv").read_text().splitlines()[0] + "\n")
    (both / "part-2.csv").write_text((both / "part-1.csv").read_text().splitlines()[0] + "\n")
    files = [str(both / f"part-{i}.csv") for i in range(3)]
    ds = ArrowBatchDataset(files, builder(), 4)
    ds.check_files()
    assert ds.row_counts() == [0, 6, 0]
    alone = list(make_loader(ArrowBatchDataset([files[1]], builder(), 4), 0))
    got = list(make_loader(ds, 0))
    assert [b.num_rows for b in got] == [4, 2]
    for a, b in zip(alone, got):
        assert_same(a, b)


def test_a_column_typed_differently_in_two_files_names_both(tmp_path):
    pq.write_table(rows_table(4), tmp_path / "a.parquet")
    t = rows_table(4, 4)
    t = t.set_column(t.schema.get_field_index("item_id"), "item_id", pa.array([str(x) for x in range(4)]))
    pq.write_table(t, tmp_path / "b.parquet")
    ds = ArrowBatchDataset([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], builder(), 4)
    from dynarec.data import DataError

    with pytest.raises(DataError, match=r"column 'item_id' has type int64 in .*a.parquet but string in .*b.parquet"):
        ds.check_files()


def test_integers_in_one_file_and_floats_in_another_mix_in_a_dense_column_and_not_in_an_id_column(tmp_path):
    # A dense column: to the nearest float, a batch across both files too. An id column: 12345678901
    # and 1.2345678901e+10 would hash apart, so the files are refused by name before anything is read.
    from dynarec.data import DataError

    def write(name, column, values):
        t = rows_table(4)
        pq.write_table(t.set_column(t.schema.get_field_index(column), column, values), tmp_path / name)

    paths = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    write("a.parquet", "price", pa.array([2**62 + 1, 2, 3, 4], pa.int64()))
    write("b.parquet", "price", pa.array([1.5, 2.5, 3.5, 4.5]))
    ds = ArrowBatchDataset(paths, builder(), 6)  # a batch across both files
    ds.check_files()
    assert [b.num_rows for b in make_loader(ds, 0)] == [6, 2]
    write("a.parquet", "item_id", pa.array([1, 2, 3, 4], pa.int64()))
    write("b.parquet", "item_id", pa.array([1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(DataError, match=r"column 'item_id' has type int64 in .*a.parquet but double in .*b.parquet"):
        ArrowBatchDataset(paths, builder(), 6).check_files()


def test_a_dictionary_encoded_column_in_one_file_and_plain_strings_in_another_read_alike(tmp_path):
    t = rows_table(4)
    pq.write_table(t, tmp_path / "a.parquet")
    i = t.schema.get_field_index("user_id")
    pq.write_table(t.set_column(i, "user_id", t.column("user_id").dictionary_encode()), tmp_path / "b.parquet")
    paths = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    ds = ArrowBatchDataset(paths, builder(), 6)  # a batch across both files
    ds.check_files()
    first, second = make_loader(ds, 0)
    assert (
        first.sparse.values()[:4].tolist() == first.sparse.values()[4:6].tolist() + second.sparse.values()[:2].tolist()
    )


def test_usable_workers_are_at_most_the_cpus():
    from dynarec.data.reader import usable_workers

    assert usable_workers(2, cpus=2) == (2, None)
    assert usable_workers(0, cpus=1) == (0, None)
    workers, note = usable_workers(8, cpus=2)
    assert workers == 2 and note == (
        "data.num_workers is 8, but this process may use 2 CPU(s): 2 DataLoader worker(s) build the batches"
    )
