"""The column operations of feature generation against hand-computed values."""

import numpy as np
import pyarrow as pa
import pytest

from dynarec.features.values import (
    Jagged,
    RowError,
    as_strings,
    combine,
    edit_distance,
    edit_distance_reference,
    fill_missing,
    jagged,
    join_keys,
    keep_last,
    product,
)
from dynarec.features.vocab import Vocabulary


def test_jagged_splits_lists_strings_and_scalars():
    j = jagged(pa.array(["a|b", "", None, "c"]), "|")
    assert j.values.to_pylist() == ["a", "b", "c"] and j.lengths.tolist() == [2, 0, 0, 1]
    assert j.missing.tolist() == [False, True, True, False]
    j = jagged(pa.array([[1, 2], None, []]), None)
    assert j.values.to_pylist() == [1, 2] and j.lengths.tolist() == [2, 0, 0] and j.missing.tolist() == [0, 1, 0]
    with pytest.raises(RowError, match="empty token") as e:
        jagged(pa.array(["a", "b||c"]), "|")
    assert e.value.row == 1
    assert jagged(pa.array(["b||c|"]), "|", empty_token="").values.to_pylist() == ["b", "c"]
    assert jagged(pa.array(["b||c"]), "|", empty_token="0").values.to_pylist() == ["b", "0", "c"]


def test_fill_missing_puts_the_default_where_rows_hold_nothing():
    j = fill_missing(jagged(pa.array(["a|b", None, "", "c"]), "|"), "d")
    assert j.values.to_pylist() == ["a", "b", "d", "d", "c"] and j.lengths.tolist() == [2, 1, 1, 1]
    j = fill_missing(jagged(pa.array(["a", None]), "|"), "")
    assert j.values.to_pylist() == ["a"] and j.lengths.tolist() == [1, 0]


def test_product_joins_the_cartesian_product_first_input_outermost():
    a = jagged(pa.array(["ua|ub", "x", ""]), "|")
    b = jagged(pa.array(["ia|ib", "1|2|3", "y"]), "|")
    strings, lengths = product([a, b])
    assert strings.to_pylist() == ["ua_ia", "ua_ib", "ub_ia", "ub_ib", "x_1", "x_2", "x_3"]
    assert lengths.tolist() == [4, 3, 0]
    c = Jagged(pa.array([1, 2]), np.array([1, 1, 0]), np.array([False, False, True]))
    assert product([a, b, c])[0].to_pylist() == ["ua_ia_1", "ua_ib_1", "ub_ia_1", "ub_ib_1", "x_1_2", "x_2_2", "x_3_2"]


def test_join_keys_finds_each_rows_key_the_last_entry_wins():
    found, entry = join_keys(
        np.array([0, 0, 1, 1]),
        [pa.array(["a", "b", "a", "a"])],
        np.array([0, 0, 1, 2]),
        [pa.array(["b", "z", "a", "a"])],
    )
    assert found.tolist() == [0, 2] and entry.tolist() == [1, 3]
    found, entry = join_keys(
        np.array([0, 0]),
        [pa.array(["p", "p"]), pa.array([1, 2])],
        np.array([0, 0]),
        [pa.array(["p", "q"]), pa.array(["2", "1"])],
    )
    assert found.tolist() == [0] and entry.tolist() == [1]  # keys compare by their string form


def test_combine_per_row():
    x, rows = np.array([1.0, 2.0, 5.0]), np.array([0, 0, 2])
    assert combine(x, rows, 3, "sum")[0].tolist() == [3.0, 0.0, 5.0]
    assert combine(x, rows, 3, "mean")[0].tolist() == [1.5, 0.0, 5.0]
    assert combine(x, rows, 3, "min")[0].tolist() == [1.0, 0.0, 5.0]
    assert combine(x, rows, 3, "max")[0].tolist() == [2.0, 0.0, 5.0]
    out, has = combine(x, rows, 3, "count")
    assert out.tolist() == [2.0, 0.0, 1.0] and has.tolist() == [True, False, True]
    assert combine(np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([1, 1]), 2, "sum")[0].tolist() == [[0, 0], [4, 6]]


def test_keep_last_and_string_forms():
    values, lengths = keep_last(np.arange(6), np.array([4, 0, 2]), 2)
    assert values.tolist() == [2, 3, 4, 5] and lengths.tolist() == [2, 0, 2]
    assert as_strings(pa.array([3.0, 0.1, 1e20])).to_pylist() == ["3", "0.1", "1e+20"]
    assert as_strings(pa.array([7, -1])).to_pylist() == ["7", "-1"]


def test_edit_distance_reference_and_column():
    assert edit_distance_reference("裙子", "连衣裙", True) == 3
    assert edit_distance_reference("kitten", "sitting", False) == 3
    assert edit_distance(pa.array(["裙子"]), pa.array(["连衣裙"]), True).tolist() == [3]


def test_vocabularies():
    v = Vocabulary.from_list(["abc", "efg", "abc"], "", None)  # a word twice: its later index
    assert v.lookup(pa.array(["abc", "efg", "x", ""])).tolist() == [4, 3, 1, 0] and v.rows == 5
    v = Vocabulary.from_dict({"abc": 2, "efg": 5}, "dflt", None)
    assert v.lookup(pa.array(["efg", "dflt", "x"])).tolist() == [5, 0, 1] and v.rows == 6
    v = Vocabulary.from_dict({"abc": 2}, None, 9)
    assert v.lookup(pa.array(["abc", "x"])).tolist() == [2, 9] and v.rows == 10
