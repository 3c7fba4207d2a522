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
