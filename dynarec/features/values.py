"""Column operations of feature generation, on whole Arrow columns and NumPy arrays: splitting
multi-value strings, filling missing rows, the cartesian product of combo features, looking keys
up in per-row maps (lookup and match features), combining the values found, keeping a sequence's
last elements, and TorchEasyRec's EditDistance.

Every function works on a batch at once (pyarrow's C++ kernels and NumPy); the only per-row
Python is where named (the Python reference of EditDistance, used where the C++ extension is not
built). A bad value raises :class:`RowError` with the batch row; the batch builder names its file,
row and feature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dynarec.features import native

__all__ = [
    "Jagged",
    "RowError",
    "as_strings",
    "combine",
    "edit_distance",
    "edit_distance_reference",
    "fill_missing",
    "jagged",
    "join_keys",
    "keep_last",
    "kv_dot",
    "map_entries",
    "mask_values",
    "numbers",
    "offsets_of",
    "overlap",
    "product",
    "row_of",
    "split",
    "vectors",
]


class RowError(Exception):
    """A bad value at batch row ``row``."""

    def __init__(self, row: int, message: str):
        super().__init__(message)
        self.row = row
        self.message = message


def row_of(lengths: np.ndarray, i: int) -> int:
    """The batch row of element ``i`` of rows of ``lengths`` elements."""
    return int(np.searchsorted(np.cumsum(lengths), i, side="right"))


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def as_strings(values: pa.Array) -> pa.Array:
    """The string form of every value: strings as they are, numbers by Arrow's cast (integers in
    decimal; floats in the shortest form that reads back the same, an integral float without
    ``.0``: ``3.0`` -> ``"3"``, ``0.1`` -> ``"0.1"``)."""
    if is_string(values.type):
        return values
    if pa.types.is_dictionary(values.type):
        return as_strings(values.dictionary_decode())
    return pc.cast(values, pa.string())


@dataclass
class Jagged:
    """Values of ``B`` rows: ``values`` (no nulls) of rows of ``lengths``; ``missing`` marks the
    rows that hold no value (null, or an empty string), their length 0."""

    values: pa.Array
    lengths: np.ndarray
    missing: np.ndarray

    @property
    def rows(self) -> np.ndarray:
        """The row of every value."""
        return np.repeat(np.arange(len(self.lengths)), self.lengths)


def map_entries(col: pa.Array) -> tuple[np.ndarray, pa.Array, pa.Array]:
    """A map column's ``(lengths, keys, values)``: each row's entries (a null map has none)."""
    t = col.type
    as_list = col.cast(pa.list_(pa.struct([("key", t.key_type), ("value", t.item_type)])))
    lengths = pc.list_value_length(as_list).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = as_list.flatten()
    return lengths, flat.field(0), flat.field(1)


def split(col: pa.Array, separator: str) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """``(tokens, lengths, empty)`` of a separator-joined string column: a null or empty row
    has no tokens (``empty`` marks the empty strings); empty tokens (a doubled, leading or
    trailing separator) are kept, as empty strings."""
    parts = pc.split_pattern(col, separator)
    per_row = np.diff(parts.offsets.to_numpy()).astype(np.int64)
    empty = np.asarray(pc.fill_null(pc.equal(pc.utf8_length(col), 0), False).to_numpy(zero_copy_only=False))
    empty &= per_row == 1
    lengths = np.where(empty, 0, per_row)
    tokens = parts.flatten()
    if empty.any():
        tokens = tokens.filter(pa.array(np.repeat(~empty, per_row)))
    return tokens, lengths, empty


def empty_tokens(
    tokens: pa.Array, lengths: np.ndarray, empty_token: Optional[str], error: str
) -> tuple[pa.Array, np.ndarray]:
    """``(tokens, lengths)`` of rows of ``lengths`` string tokens with each empty one dropped
    (``empty_token`` ``""``) or replaced by ``empty_token``; None: RowError ``error`` at the
    first one's row."""
    bad = pc.equal(pc.utf8_length(tokens), 0)
    if not bad.true_count:
        return tokens, lengths
    if empty_token is None:
        raise RowError(row_of(lengths, int(pc.index(bad, True).as_py())), error)
    if empty_token != "":
        return pc.if_else(bad, pa.scalar(empty_token, tokens.type), tokens), lengths
    dropped = np.bincount(
        np.repeat(np.arange(len(lengths)), lengths)[bad.to_numpy(zero_copy_only=False)], minlength=len(lengths)
    )
    return tokens.filter(pc.invert(bad)), lengths - dropped


def jagged(
    col: pa.Array,
    separator: Optional[str],
    empty_token: Optional[str] = None,
    what: str = "multi-value field",
) -> Jagged:
    """A column's values per row: a list column's elements, a string column split on
    ``separator`` (when given), else one value a row. Null rows and empty strings (split) are
    missing. An empty token is replaced by ``empty_token`` (``""``: dropped); None: RowError."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    null = col.is_null().to_numpy(zero_copy_only=False)
    if is_list(col.type):
        lengths = np.where(null, 0, pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False))
        values = pc.list_flatten(col)
        if values.null_count:
            i = int(pc.index(values.is_null(), True).as_py())
            raise RowError(row_of(lengths, i), f"a null element in the list of the {what}")
        return Jagged(values, lengths.astype(np.int64), null.copy())
    if separator is not None and is_string(col.type):
        tokens, lengths, empty = split(col, separator)
        tokens, lengths = empty_tokens(
            tokens, lengths, empty_token, f"malformed {what} (empty token between '{separator}' separators)"
        )
        return Jagged(tokens, lengths, null | empty)
    valid = ~null
    return Jagged(col.filter(pa.array(valid)) if null.any() else col, valid.astype(np.int64), null)


def fill_missing(j: Jagged, default: Optional[str], also: Optional[np.ndarray] = None) -> Jagged:
    """``j`` with every missing row (and every row of ``also``, its values dropped) holding
    the one value ``default`` (nothing when ``default`` is ``""`` or None)."""
    rows = j.missing if also is None else (j.missing | also)
    if not rows.any():
        return j
    n = len(j.lengths)
    kept = np.where(rows, 0, j.lengths)
    if also is not None and also.any():
        keep_value = np.repeat(~rows, j.lengths)
        values = j.values.filter(pa.array(keep_value))
    else:
        values = j.values
    if not default:
        return Jagged(values, kept, rows)
    lengths = np.where(rows, 1, kept)
    # Every output position takes a value of `values`, or the default appended at its end.
    starts = offsets_of(kept)[:-1]
    out_row = np.repeat(np.arange(n), lengths)
    pos = np.arange(int(lengths.sum())) - offsets_of(lengths)[:-1][out_row]
    index = np.where(rows[out_row], len(values), starts[out_row] + pos)
    strings = as_strings(values)
    extended = pa.concat_arrays([strings, pa.array([default], strings.type)])  # (string or large_string)
    return Jagged(extended.take(pa.array(index)), lengths, rows)


def numbers(values: pa.Array, lengths: np.ndarray, what: str = "value") -> np.ndarray:
    """Values as float64 (strings parsed); RowError naming the row and the value that is not a
    number."""
    if len(values) == 0:
        return np.empty(0, dtype=np.float64)
    try:  # (an integer beyond 2**53, a nanosecond timestamp, rounds to the nearest float64, as raw_feature's)
        safe = not pa.types.is_integer(values.type)
        return pc.cast(values, pa.float64(), safe=safe).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    if is_string(values.type):
        try:
            return pc.cast(pc.utf8_trim_whitespace(values), pa.float64()).to_numpy(zero_copy_only=False)
        except pa.ArrowInvalid:
            pass
    for i, v in enumerate(values.to_pylist()):
        try:
            float(v)
        except (TypeError, ValueError):
            raise RowError(row_of(lengths, i), f"{what} {v!r} is not a number") from None
    raise RowError(0, f"values of type {values.type} are not numbers")


def vectors(x: np.ndarray, lengths: np.ndarray, k: int, rows: Optional[np.ndarray] = None, what: str = "row"):
    """``x`` (the numbers of rows of ``lengths``) as ``[rows, k]``; RowError naming a row that
    does not hold ``k`` numbers. ``rows``: the batch row of each entry of ``lengths`` (default:
    entry ``i`` is row ``i``)."""
    bad = np.nonzero(lengths != k)[0]
    if bad.size:
        i = int(bad[0])
        row = int(rows[i]) if rows is not None else i
        raise RowError(row, f"{what} holds {int(lengths[i])} numbers; value_dim is {k}")
    return x.reshape(len(lengths), k)


def keep_last(values, lengths: np.ndarray, max_len: int):
    """A sequence's last ``max_len`` elements of each row (histories end with the most recent):
    ``(values, lengths)``; ``values`` an array (or ``[N, k]``) indexed by element."""
    if not (lengths > max_len).any():
        return values, lengths
    ends = np.cumsum(lengths)
    starts = ends - lengths
    n = int(ends[-1]) if len(ends) else 0
    row = np.repeat(np.arange(lengths.size), lengths)
    pos = np.arange(n) - starts[row]
    keep = pos >= (lengths - max_len)[row]
    return values[keep], np.minimum(lengths, max_len)


def product(parts: Sequence[Jagged], joiner: str = "_") -> tuple[pa.Array, np.ndarray]:
    """The cartesian product of each row's values of ``parts`` (the first part outermost), each
    combination's string forms joined by ``joiner``: ``(strings, lengths)``. A row where a part
    has no value has none."""
    n = len(parts[0].lengths)
    lens = np.stack([p.lengths for p in parts])  # [P, B]
    total = lens.prod(axis=0)
    out_row = np.repeat(np.arange(n), total)
    j = np.arange(int(total.sum())) - offsets_of(total)[:-1][out_row]
    columns = []
    stride = np.ones(n, dtype=np.int64)
    for p, length in reversed(list(zip(parts, lens))):
        index = offsets_of(p.lengths)[:-1][out_row] + (j // stride[out_row]) % np.maximum(length[out_row], 1)
        columns.append(as_strings(p.values).take(pa.array(index)))
        stride = stride * length
    columns.reverse()
    joined = pc.binary_join_element_wise(*columns, joiner) if len(columns) > 1 else columns[0]
    return joined, total.astype(np.int64)


def _codes(*arrays: pa.Array) -> list[np.ndarray]:
    """One dictionary over the string forms of ``arrays``: each array's codes (int64)."""
    sizes = [len(a) for a in arrays]
    encoded = pc.dictionary_encode(pa.concat_arrays([as_strings(a) for a in arrays]))
    codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    return list(np.split(codes, np.cumsum(sizes)[:-1]))


def join_keys(
    table_rows: np.ndarray,
    table_keys: Sequence[pa.Array],
    query_rows: np.ndarray,
    query_keys: Sequence[pa.Array],
) -> tuple[np.ndarray, np.ndarray]:
    """For every query ``(row, keys...)``, the entry of the table with the same row and keys (the
    last one where several match): ``(query indices found, their table entries)``. Keys are
    compared by their string form."""
    composite_t = table_rows.astype(np.int64)
    composite_q = query_rows.astype(np.int64)
    for t, q in zip(table_keys, query_keys):
        ct, cq = _codes(t, q)
        size = int(max(ct.max(initial=-1), cq.max(initial=-1))) + 1
        # Renumber (row, key so far) pairs densely before adding the next key: no overflow.
        pairs_t = composite_t * size + ct
        pairs_q = composite_q * size + cq
        _, inverse = np.unique(np.concatenate([pairs_t, pairs_q]), return_inverse=True)
        composite_t, composite_q = inverse[: len(pairs_t)], inverse[len(pairs_t) :]
    order = np.argsort(composite_t, kind="stable")
    ordered = composite_t[order]
    pos = np.searchsorted(ordered, composite_q, side="right") - 1
    ok = pos >= 0
    ok[ok] = ordered[pos[ok]] == composite_q[ok]
    found = np.nonzero(ok)[0]
    return found, order[pos[found]]


def combine(x: np.ndarray, rows: np.ndarray, num_rows: int, combiner: str) -> tuple[np.ndarray, np.ndarray]:
    """Values ``x`` (``[N]`` or ``[N, k]``) of batch ``rows`` combined per row: ``(out [B] or
    [B, k], has [B])``; a row without values is 0 (``has`` False)."""
    counts = np.bincount(rows, minlength=num_rows)
    has = counts > 0
    shape = (num_rows, *x.shape[1:])
    if combiner == "count":
        return counts.astype(np.float64), has
    out = np.zeros(shape, dtype=np.float64)
    if combiner in ("sum", "mean"):
        np.add.at(out, rows, x)
        if combiner == "mean":
            out /= np.maximum(counts, 1).reshape(-1, *([1] * (x.ndim - 1)))
        return out, has
    fill = np.inf if combiner == "min" else -np.inf
    out = np.full(shape, fill)
    (np.minimum if combiner == "min" else np.maximum).at(out, rows, x)
    out[~has] = 0.0
    return out, has


def edit_distance(a: pa.Array, b: pa.Array, utf8: bool) -> np.ndarray:
    """TorchEasyRec's EditDistance of ``a[i]`` and ``b[i]`` (string arrays without nulls), int64:
    in C++ where the extension is built, else :func:`edit_distance_reference`."""
    out = native.edit_distance(a, b, utf8)
    if out is not None:
        return out
    return np.array([edit_distance_reference(x, y, utf8) for x, y in zip(a.to_pylist(), b.to_pylist())], dtype=np.int64)


def edit_distance_reference(a: str, b: str, utf8: bool) -> int:
    """The Levenshtein distance of ``a`` and ``b``: over code points (``utf8``) or over their
    UTF-8 bytes (TorchEasyRec's ``latin``). Per-row Python: the fallback and the reference."""
    x: Sequence = a if utf8 else a.encode()
    y: Sequence = b if utf8 else b.encode()
    row = list(range(len(y) + 1))
    for i in range(1, len(x) + 1):
        diagonal, row[0] = row[0], i
        for j in range(1, len(y) + 1):
            up = row[j]
            row[j] = min(up + 1, row[j - 1] + 1, diagonal + (x[i - 1] != y[j - 1]))
            diagonal = up
    return row[-1]


def _rows(j: Jagged) -> list[list]:
    values = j.values.to_pylist()
    ends = np.cumsum(j.lengths)
    return [values[e - n : e] for e, n in zip(ends.tolist(), j.lengths.tolist())]


def overlap(query: Jagged, title: Jagged, method: str) -> np.ndarray:
    """TorchEasyRec's overlap_feature, ``[B]`` float64 a row (the terms of each row of
    ``query`` and ``title``): ``query_common_ratio`` (the query's terms found in the title over
    the query's), ``title_common_ratio`` (the title's found in the query over the title's),
    ``is_contain`` (1 when the query's terms appear in the title in their order), ``is_equal``
    (1 when the terms are the same), ``index_of`` (the first position where the query appears
    whole in the title; -1 where it does not). An empty side gives 0 (-1 for index_of). One pass
    in Python a row: a text-matching kind, rare beside the id kinds."""
    out = np.zeros(len(query.lengths))
    for i, (q, t) in enumerate(zip(_rows(query), _rows(title))):
        if method == "index_of":
            n = len(q)
            out[i] = next((k for k in range(len(t) - n + 1) if n and t[k : k + n] == q), -1)
        elif not q or not t:
            continue
        elif method == "query_common_ratio":
            found = set(t)
            out[i] = sum(w in found for w in q) / len(q)
        elif method == "title_common_ratio":
            found = set(q)
            out[i] = sum(w in found for w in t) / len(t)
        elif method == "is_contain":
            terms = iter(t)
            out[i] = float(all(any(w == x for x in terms) for w in q))
        else:  # is_equal
            out[i] = float(q == t)
    return out


def kv_dot(query: tuple[pa.Array, pa.Array, np.ndarray], document: tuple[pa.Array, pa.Array, np.ndarray]):
    """TorchEasyRec's kv_dot_product: ``(dots [B] float64, empty [B] bool)`` of two inputs given
    as ``(keys, weights float64, lengths)``: each row's sum over the keys both hold of the products
    of their weights (a key given twice in one input: its last weight); ``empty`` marks the rows
    where either input holds nothing."""
    qk, qw, ql = query
    dk, dw, dl = document
    q_rows = _rows(Jagged(qk, ql, ql == 0))
    d_rows = _rows(Jagged(dk, dl, dl == 0))
    q_w = np.split(np.asarray(qw, dtype=np.float64), np.cumsum(ql)[:-1])
    d_w = np.split(np.asarray(dw, dtype=np.float64), np.cumsum(dl)[:-1])
    out = np.zeros(len(ql))
    for i in range(len(ql)):
        weights = dict(zip(d_rows[i], d_w[i].tolist()))
        out[i] = sum(w * weights[k] for k, w in dict(zip(q_rows[i], q_w[i].tolist())).items() if k in weights)
    return out, (ql == 0) | (dl == 0)


_TRUE = {"true": True, "1": True, "false": False, "0": False}


def mask_values(values: Jagged, mask: Jagged) -> tuple[pa.Array, np.ndarray]:
    """TorchEasyRec's bool_mask_feature: ``(kept values, kept a row)``, the values whose mask is
    true (``true`` / ``1``, ``false`` / ``0``, or booleans / integers); a row missing its values or
    its mask keeps none (as TorchEasyRec's); RowError naming a row whose counts differ or a mask
    that is not a boolean."""
    gone = values.missing | mask.missing
    if gone.any():
        values, mask = fill_missing(values, None, also=gone), fill_missing(mask, None, also=gone)
    bad = np.nonzero(values.lengths != mask.lengths)[0]
    if bad.size:
        i = int(bad[0])
        raise RowError(i, f"{int(values.lengths[i])} value(s) but {int(mask.lengths[i])} mask value(s)")
    flags = mask.values
    if pa.types.is_boolean(flags.type):
        keep = np.asarray(flags.to_numpy(zero_copy_only=False), dtype=bool)
    else:
        words = [str(x).strip().lower() for x in flags.to_pylist()]
        unknown = next((k for k, w in enumerate(words) if w not in _TRUE), None)
        if unknown is not None:
            raise RowError(row_of(mask.lengths, unknown), f"mask value {words[unknown]!r} is not true/false or 1/0")
        keep = np.fromiter((_TRUE[w] for w in words), bool, len(words))
    counts = np.bincount(
        np.repeat(np.arange(len(values.lengths)), values.lengths), weights=keep, minlength=len(values.lengths)
    )
    return values.values.filter(pa.array(keep)), counts.astype(np.int64)
