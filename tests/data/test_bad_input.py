"""Bad data is an error naming the file, the row, the feature and the value — never silently read."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynarec.config import config_from_dict
from dynarec.data import ArrowBatchDataset, BatchBuilder, DataError, make_loader
from tests.data.test_batch import ROWS
from tests.pipeline_fixtures import config_dict


def builder():
    return BatchBuilder(config_from_dict(config_dict()))


def read(path):
    return list(make_loader(ArrowBatchDataset([str(path)], builder(), 100), 0))


def test_sequences_of_one_group_with_different_lengths_in_a_row():
    rows = {**ROWS, "hist_cate_id": ["1|1|1|1|1|1|1|2", "", "3|4"]}  # row 2: 1 item, 2 categories
    with pytest.raises(
        DataError,
        match=r"t.parquet, row 2: sequence features 'hist_item_id' and 'hist_cate_id' "
        r"of one sequence group have 1 and 2 elements",
    ):
        builder().build(pa.table(rows), "t.parquet")


def test_a_null_inside_a_list_of_ids(tmp_path):
    rows = {**ROWS, "hist_item_id": pa.array([[1, 2], [3, None], [4]], pa.list_(pa.int64()))}
    with pytest.raises(DataError, match=r"t.parquet, row 1: feature 'hist_item_id' .*a null element"):
        builder().build(pa.table(rows), "t.parquet")


def test_uint64_ids_past_int64_are_refused():
    rows = {**ROWS, "item_id": pa.array([5, 2**63 + 7, 7], pa.uint64())}
    c = config_dict()
    c["feature_configs"][2]["id_feature"]["dynamicemb"] = {"max_capacity": 64}
    del c["feature_configs"][2]["id_feature"]["num_buckets"]
    del c["feature_configs"][2]["id_feature"]["embedding_name"]
    b = BatchBuilder(config_from_dict(c))
    with pytest.raises(
        DataError,
        match=r"t.parquet, row 1: feature 'item_id' .*id 9223372036854775815 does "
        r"not fit int64",
    ):
        b.build(pa.table(rows), "t.parquet")


def test_a_23_digit_id_in_an_integer_sequence():
    rows = {**ROWS, "hist_item_id": ["1|2", "12345678901234567890123", "5"]}
    with pytest.raises(
        DataError,
        match=r"t.parquet, row 1: feature 'hist_item_id' .*malformed value "
        r"'12345678901234567890123' \(does not fit int64\)",
    ):
        builder().build(pa.table(rows), "t.parquet")


def test_a_label_that_is_not_a_number_in_csv(tmp_path):
    path = tmp_path / "t.csv"
    rows = {**ROWS, "clk": ["1", "yes", "0"]}
    import pyarrow.csv as pacsv

    pacsv.write_csv(pa.table(rows), path)
    with pytest.raises(DataError, match=r"t.csv, row 1: label column 'clk': 'yes' is not a number"):
        read(path)


def test_a_dense_value_that_is_not_a_number():
    rows = {**ROWS, "price": ["1.5", "abc", "2"]}
    with pytest.raises(DataError, match=r"t.parquet, row 1: feature 'price' \(column 'price'\): 'abc' is not a number"):
        builder().build(pa.table(rows), "t.parquet")


def test_a_csv_row_with_too_many_fields_names_file_and_row(tmp_path):
    import pyarrow.csv as pacsv

    path = tmp_path / "t.csv"
    pacsv.write_csv(pa.table(ROWS), path)
    lines = path.read_text().splitlines()
    lines[2] += ",extra"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"t.csv, row 1: cannot be read \(CSV parse error: Expected 8 columns, got 9"):
        read(path)


def test_a_corrupt_parquet_page_names_the_file(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.concat_tables([pa.table(ROWS)] * 50), path, compression="snappy")
    data = bytearray(path.read_bytes())
    data[200:600] = bytes(range(256)) + bytes(144)  # inside the first column chunk
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"t.parquet: cannot be read"):
        read(path)


def test_a_dense_value_finite_in_float64_but_not_in_float32_is_named():
    """``1e39`` became NaN probabilities in predict and "the loss is nan" naming no row in train."""
    rows = {**ROWS, "price": [10.0, 1e39, 30.0]}
    c = config_dict()
    c["feature_configs"][6]["raw_feature"]["normalizer"] = {"mean": 0.0, "std": 1.0}
    b = BatchBuilder(config_from_dict(c))
    with pytest.raises(
        DataError, match=r"t.parquet, row 1: feature 'price' \(column 'price'\): value 1e\+39 is beyond float32's range"
    ):
        b.build(pa.table(rows), "t.parquet")


def test_string_ids_in_csv_are_read_as_strings_whatever_they_look_like(tmp_path):
    """CSV inference made ``'001001'`` the number 1001 and ``'1e3'`` the float 1000.0 before
    hashing, so they collided with ``'1001'`` and ``'1000'`` and differed from the same rows read
    from Parquet."""
    users = ["1001", "001001", "1e3", "1000"]
    rows = {k: (v * 2)[:4] for k, v in ROWS.items()}
    rows["user_id"] = users
    rows["hist_item_id"] = ["1|2", "3", "", "007"]
    rows["hist_cate_id"] = ["1|1", "2", "", "3"]
    rows["age"] = ["1", "2", "3", "4"]  # integer ids given as digits stay exact
    table = pa.table(rows)
    (tmp_path / "t.csv").write_text(
        ",".join(table.column_names)
        + "\n"
        + "\n".join(",".join(str(table.column(c)[i].as_py()) for c in table.column_names) for i in range(4))
        + "\n"
    )
    pq.write_table(table, tmp_path / "t.parquet")
    (csv,) = read(tmp_path / "t.csv")
    (parquet,) = read(tmp_path / "t.parquet")
    keys = csv.sparse.values()[:4].tolist()
    assert len(set(keys)) == 4, keys
    from dynarec.features import DYNAMIC_KEY_BUCKETS, to_hash_bucket_fast

    assert keys == to_hash_bucket_fast(users, DYNAMIC_KEY_BUCKETS).tolist()
    assert csv.sparse.values().tolist() == parquet.sparse.values().tolist()
    assert csv.sparse.lengths().tolist() == parquet.sparse.lengths().tolist()


def test_a_parquet_file_with_a_duplicated_column_name_is_named(tmp_path):
    table = pa.Table.from_arrays([pa.array(v) for v in ROWS.values()] + [pa.array([1, 2, 3])], [*ROWS, "age"])
    pq.write_table(table, tmp_path / "dup.parquet")
    with pytest.raises(DataError, match=r"dup.parquet: column 'age' appears 2 times"):
        ArrowBatchDataset([str(tmp_path / "dup.parquet")], builder(), 100).check_files()


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_in_a_dataloader_worker_is_the_same_one_line_error(tmp_path, workers):
    """With workers it came wrapped in torch's 24 lines ("Caught DataError in DataLoader worker
    process 0 ... Original Traceback")."""
    good = pa.table(ROWS)
    bad = pa.table({**ROWS, "age": [1, -4, 2]})
    for i, t in enumerate([good, good, bad, good]):
        pq.write_table(t, tmp_path / f"part-{i}.parquet")
    files = sorted(str(p) for p in tmp_path.glob("*.parquet"))
    with pytest.raises(DataError) as e:
        list(make_loader(ArrowBatchDataset(files, builder(), 3), workers))
    where = f"{tmp_path / 'part-2.parquet'}, row 1: feature 'age' (column 'age')"
    assert str(e.value) == f"{where}: id -4 is out of range [0, 8) (num_buckets)"


def test_a_null_label_is_named_as_no_value_and_a_nan_label_as_nan():
    for value, said in ((None, "no value \\(null\\)"), (float("nan"), "nan")):
        rows = {**ROWS, "clk": pa.array([1.0, value, 0.0], pa.float64())}
        with pytest.raises(DataError, match=rf"t.parquet, row 1: label column 'clk' holds {said}; "):
            builder().build(pa.table(rows), "t.parquet")


def test_train_with_workers_ends_at_a_bad_row(tmp_path):
    """An error in a batch ended `dynarec train` with workers kept by their persistent
    DataLoader: at the interpreter's exit multiprocessing's terminate() could not end them (they
    ignore SIGTERM) and its join waited forever, after the error line was printed."""
    import subprocess
    import sys

    import yaml

    (tmp_path / "data" / "train").mkdir(parents=True)
    pq.write_table(pa.table({**ROWS, "age": [1, -4, 2]}), tmp_path / "data" / "train" / "part-0.parquet")
    cfg = config_dict(data__num_workers=1, data__eval_input_path=None)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    argv = [sys.executable, "-m", "dynarec", "train", "--config", "c.yaml", "--model-dir", "m", "--no-progress"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2, done.stderr
    assert "row 1: feature 'age' (column 'age'): id -4 is out of range [0, 8) (num_buckets)" in done.stderr


def test_a_csv_file_not_in_utf8_is_named(tmp_path):
    """A GBK-encoded value: the error's own search for the bad row read the file as UTF-8 and
    failed, so the user saw Python's "'utf-8' codec can't decode byte ..." naming no file."""
    import pyarrow.csv as pacsv

    pacsv.write_csv(pa.table(ROWS), tmp_path / "x.csv")
    text = (tmp_path / "x.csv").read_bytes().replace(b"u2", "中".encode("gbk"))
    (tmp_path / "gbk.csv").write_bytes(text)
    with pytest.raises(DataError, match=r"gbk.csv: cannot be read \(.*invalid UTF8"):
        list(make_loader(ArrowBatchDataset([str(tmp_path / "gbk.csv")], builder(), 100), 0))


def test_a_parquet_file_under_input_type_csv_is_named(tmp_path):
    """make-data writes Parquet; a config saying input_type: csv read it as CSV and failed with
    "'utf-8' codec can't decode byte 0xf4", naming nothing."""
    pq.write_table(pa.table(ROWS), tmp_path / "part-0.parquet")
    b = BatchBuilder(config_from_dict(config_dict(data__input_type="csv")))
    with pytest.raises(DataError, match=r"part-0.parquet: a .parquet file, but data.input_type is 'csv'"):
        list(make_loader(ArrowBatchDataset([str(tmp_path / "part-0.parquet")], b, 100, "csv"), 0))
