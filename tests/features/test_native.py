"""The feature-generation extension equals the pyarrow + pyfarmhash code it replaces, bit for bit:
FarmHash Fingerprint64 against the pyfarmhash package, hashing against TensorFlow's golden values,
the one-pass split-and-hash and split-and-parse against pyarrow's split."""

import random

import farmhash
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dynarec.features import DYNAMIC_KEY_BUCKETS, native, to_hash_bucket_fast
from dynarec.features.hashing import murmur2_64, to_hash_bucket_fast_reference
from tests.features.test_hashing import GOLDEN
from tests.matrix import needs_fg_kernels

pytestmark = needs_fg_kernels

STRING_TYPES = [pytest.param(pa.string(), id="string"), pytest.param(pa.large_string(), id="large")]


def strings_of_bytes(values: list[bytes], type_: pa.DataType = pa.string()) -> pa.Array:
    """A string array over arbitrary bytes (FarmHash hashes bytes; Arrow does not look)."""
    b = pa.array(values, pa.large_binary() if pa.types.is_large_string(type_) else pa.binary())
    return pa.Array.from_buffers(type_, len(b), b.buffers())


def random_unicode(rng: random.Random, n: int) -> str:
    alphabet = "abcXYZ09_|:- éßøΩжß中文字😀𝔘\u0000\u200b"
    return "".join(rng.choice(alphabet) for _ in range(n))


@pytest.mark.parametrize("type_", STRING_TYPES)
def test_fingerprint64_equals_pyfarmhash_at_every_length(type_):
    rng = random.Random(0)
    values = [bytes(rng.randrange(256) for _ in range(n)) for n in range(301) for _ in range(4)]
    values += [bytes([c]) * n for n in range(0, 301, 7) for c in (0, 255)]  # runs of one byte
    col = strings_of_bytes(values, type_)
    want = np.array([farmhash.fingerprint64(v) for v in values], dtype=np.uint64)
    assert np.array_equal(native.fingerprint64(col), want)
    assert np.array_equal(native.fingerprint64(col.slice(37, 500)), want[37:537])  # offsets not from 0


def test_fingerprint64_of_unicode_hashes_its_utf8_bytes():
    rng = random.Random(1)
    values = [random_unicode(rng, rng.randrange(0, 120)) for _ in range(3000)]
    want = np.array([farmhash.fingerprint64(v) for v in values], dtype=np.uint64)
    assert np.array_equal(native.fingerprint64(pa.array(values)), want)


def test_tensorflow_golden_values():
    col = pa.array(list(GOLDEN))
    assert native.hash_strings(col, DYNAMIC_KEY_BUCKETS).tolist() == [v[0] for v in GOLDEN.values()]
    assert native.hash_strings(col, 1000).tolist() == [v[1] for v in GOLDEN.values()]
    assert native.hash_strings(col.cast(pa.large_string()), 1000).tolist() == [v[1] for v in GOLDEN.values()]


MODULI = [1, 2, 3, 7, 1000, 5000, 10**6, 2**31 - 1, 2**32 - 1, 2**32 + 5, 2**40, 10**18 + 9, DYNAMIC_KEY_BUCKETS]
MODULI += [2**63 - 25, 2**63 - 1, *random.Random(5).sample(range(2, 2**63), 6)]


@pytest.mark.parametrize("num_buckets", MODULI)
def test_hash_strings_is_the_fingerprint_modulo_num_buckets(num_buckets):
    """Odd moduli take a direct remainder without a division (Lemire et al.), powers of two a
    mask: both must equal Python's %."""
    rng = random.Random(num_buckets)
    values = [random_unicode(rng, rng.randrange(0, 40)) for _ in range(2000)]
    got = native.hash_strings(pa.array(values), num_buckets)
    assert got.dtype == np.int64
    assert got.tolist() == [farmhash.fingerprint64(v) % num_buckets for v in values]
    assert np.array_equal(to_hash_bucket_fast(values, num_buckets), to_hash_bucket_fast_reference(values, num_buckets))


def test_what_the_extension_does_not_take_falls_back():
    assert native.hash_strings(pa.array(["a", None]), 7) is None  # nulls: the caller names the row
    assert native.hash_strings(pa.array([1, 2]), 7) is None
    assert native.hash_strings(pa.array([], pa.string()), 7) is None
    assert to_hash_bucket_fast([], 7).tolist() == []
    with native.python_path():
        assert native.ops() is None and native.hash_strings(pa.array(["a"]), 7) is None
    assert native.available()


def split_hash_reference(col: pa.Array, sep: str, num_buckets: int) -> tuple[np.ndarray, np.ndarray, int]:
    """pyarrow's path (BatchBuilder._split, then to_hash_bucket_fast_reference)."""
    parts = pc.split_pattern(col, sep)
    per_row = np.diff(parts.offsets.to_numpy()).astype(np.int64)
    empty = (pc.binary_length(col).to_numpy(zero_copy_only=False) == 0) & (per_row == 1)
    lengths = np.where(empty, 0, per_row)
    tokens = parts.flatten().filter(pa.array(np.repeat(~empty, per_row)))
    bad = pc.equal(pc.binary_length(tokens), 0).to_numpy(zero_copy_only=False)
    if bad.any():
        return np.empty(0, np.int64), lengths, int(np.searchsorted(np.cumsum(lengths), np.argmax(bad), side="right"))
    values = to_hash_bucket_fast_reference(tokens, num_buckets) if len(tokens) else np.empty(0, np.int64)
    return values, lengths, -1


@pytest.mark.parametrize("sep", ["|", "::", "\u0000", "中"])
@pytest.mark.parametrize("type_", STRING_TYPES)
@pytest.mark.parametrize("num_buckets", [1000, DYNAMIC_KEY_BUCKETS])
def test_split_hash_equals_pyarrows_split_then_hash(sep, type_, num_buckets):
    rng = random.Random(len(sep))
    rows = ["", "a", "文", "x" * 200, sep.join(["tok"] * 300), sep.join(["", "x"])[1:]]
    for _ in range(400):  # tokens without the separator's first character: no empty token
        tokens = [random_unicode(rng, rng.randrange(1, 12)).replace(sep[0], "_") for _ in range(rng.randrange(0, 35))]
        rows.append(sep.join(tokens))
    col = pa.array(rows, type_).slice(3)  # buffers start before the slice
    values, lengths, bad = native.split_hash(col, sep, num_buckets)
    want_values, want_lengths, want_bad = split_hash_reference(col, sep, num_buckets)
    assert bad == want_bad == -1
    assert np.array_equal(lengths, want_lengths) and np.array_equal(values, want_values)
    assert lengths.sum() == values.size


@pytest.mark.parametrize(
    "rows, sep, first_bad",
    [
        (["a|b", "|a", "a||b"], "|", 1),  # a leading separator
        (["a|b", "", "a||b", "c|"], "|", 2),  # a doubled one
        (["a", "b|c", "d|"], "|", 2),  # a trailing one
        (["|"], "|", 0),
        (["a::b", ":::"], "::", 1),  # '::' then ':': an empty first token, as pyarrow splits it
        (["a::b", "a:::b"], "::", -1),  # 'a', ':b'
        (["aaa"], "aa", 0),
        (["x", ":|:", "|:", ":|"], "|", 2),
        (["中文中", "文中"], "中", 0),
    ],
)
def test_split_hash_names_the_first_row_with_an_empty_token_as_pyarrow_does(rows, sep, first_bad):
    col = pa.array(rows)
    values, lengths, bad = native.split_hash(col, sep, 1000)
    want_values, want_lengths, want_bad = split_hash_reference(col, sep, 1000)
    assert bad == want_bad == first_bad
    if bad < 0:
        assert np.array_equal(values, want_values) and np.array_equal(lengths, want_lengths)


def _split_and_cast(col: pa.Array, sep: str) -> tuple[np.ndarray, np.ndarray]:
    """pyarrow's path: split, an empty field an empty list, cast."""
    lists = pa.array([[] if s == "" else s.split(sep) for s in col.to_pylist()], pa.list_(pa.string()))
    ids = pc.cast(lists.flatten(), pa.int64()).to_numpy(zero_copy_only=False)
    return ids, np.diff(lists.offsets.to_numpy()).astype(np.int64)


@pytest.mark.parametrize("sep", ["|", "::"])
@pytest.mark.parametrize("type_", STRING_TYPES)
def test_the_one_pass_id_list_parser_equals_split_and_cast(sep, type_):
    rng = np.random.default_rng(0)
    rows = ["", "007" + sep + "-0", str(2**63 - 1), str(-(2**63)), "5"]
    for _ in range(300):
        wide = rng.integers(-(2**63), 2**63 - 1, size=rng.integers(0, 5), dtype=np.int64)
        small = rng.integers(0, 100, size=rng.integers(0, 5))
        rows.append(sep.join(str(v) for v in [*wide, *small]))
    col = pa.array(rows, type_).slice(2)  # buffers start earlier
    ids, lengths = native.split_parse_int64(col, sep)
    want_ids, want_lengths = _split_and_cast(col, sep)
    assert np.array_equal(ids, want_ids) and np.array_equal(lengths, want_lengths)


@pytest.mark.parametrize(
    "field", [" 5", "5 ", "+5", "1||2", "1|", "|1", "-", "1|x", "9223372036854775808", "-9223372036854775809"]
)
def test_the_one_pass_parser_leaves_what_it_does_not_take_to_pyarrow(field):
    assert native.split_parse_int64(pa.array(["1|2", field]), "|") is None


def test_the_extension_is_built_in_a_directory_of_this_environment_and_source_tree(monkeypatch):
    here = native.build_directory()
    assert native.ops().__file__.startswith(here + "/")
    monkeypatch.setattr("sys.prefix", "/elsewhere/.venv")
    assert native.build_directory() != here


@pytest.mark.parametrize("type_", STRING_TYPES)
def test_murmur2_equals_the_python_reference_at_every_length(type_):
    """std::hash reads 8-byte words and a 1..7-byte tail: every length to 300 and every tail."""
    rng = random.Random(7)
    values = [bytes(rng.randrange(256) for _ in range(n)) for n in range(301) for _ in range(3)]
    col = strings_of_bytes(values, type_)
    want = np.array([murmur2_64(v) for v in values], dtype=np.uint64)
    assert np.array_equal(native.hash64(col, "murmur2"), want)
    assert np.array_equal(native.hash64(col.slice(11, 400), "murmur2"), want[11:411])
    assert native.hash_strings(col, 1000, "murmur2").tolist() == [int(w) % 1000 for w in want]


@pytest.mark.parametrize("num_buckets", [100, 10**6 + 3, DYNAMIC_KEY_BUCKETS])
def test_split_hash_with_murmur2_equals_split_then_murmur2(num_buckets):
    rng = random.Random(num_buckets % 1000)
    rows = ["|".join(random_unicode(rng, rng.randrange(1, 10)).replace("|", "_") for _ in range(rng.randrange(0, 9)))]
    rows += ["abc|efg|hij", "", "1"]
    for _ in range(300):
        rows.append(
            "|".join(random_unicode(rng, rng.randrange(1, 10)).replace("|", "_") for _ in range(rng.randrange(0, 9)))
        )
    values, lengths, bad = native.split_hash(pa.array(rows), "|", num_buckets, "murmur2")
    tokens = [t for r in rows for t in (r.split("|") if r else [])]
    assert bad == -1 and lengths.tolist() == [len(r.split("|")) if r else 0 for r in rows]
    assert values.tolist() == [murmur2_64(t) % num_buckets for t in tokens]


def levenshtein(x, y) -> int:
    """The textbook table, for sequences of characters or bytes."""
    table = [[i + j if i * j == 0 else 0 for j in range(len(y) + 1)] for i in range(len(x) + 1)]
    for i in range(1, len(x) + 1):
        for j in range(1, len(y) + 1):
            table[i][j] = min(table[i - 1][j] + 1, table[i][j - 1] + 1, table[i - 1][j - 1] + (x[i - 1] != y[j - 1]))
    return table[-1][-1]


def test_edit_distance_over_bytes_and_over_characters():
    a = pa.array(["裙子", "kitten", "", "abc", "flaw", "é"])
    b = pa.array(["连衣裙", "sitting", "xy", "abc", "lawn", "e"])
    assert native.edit_distance(a, b, True).tolist() == [3, 3, 2, 0, 2, 1]  # TorchEasyRec's test: 3 (utf-8)
    assert native.edit_distance(a, b, False).tolist() == [8, 3, 2, 0, 2, 2]  # latin: UTF-8 bytes
    rng = random.Random(3)
    xs = [random_unicode(rng, rng.randrange(0, 15)) for _ in range(300)]
    ys = [random_unicode(rng, rng.randrange(0, 15)) for _ in range(300)]
    for utf8 in (True, False):
        got = native.edit_distance(pa.array(xs), pa.array(ys), utf8).tolist()
        assert got == [levenshtein(x, y) if utf8 else levenshtein(x.encode(), y.encode()) for x, y in zip(xs, ys)]
