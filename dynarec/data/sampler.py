"""Sampled negative items of a retrieval model (``data.negative_sampler``).

TorchEasyRec's ``NegativeSampler`` (graph-learn's ``node_weight`` negative sampler): each batch
gets ``num_sample`` items drawn with probability proportional to their weight, none of them an
item of the batch. Their attributes become ``num_sample`` extra rows of the batch, holding the
item features only (dynarec.data.batch).

The item table's columns, in order: the item id (int64), its weight (float) and its attributes
(one string: the ``attr_fields`` columns' values, joined by ``attr_delimiter``; a list column's
values joined by ``\x1d``). Parquet, or a
CSV / text table split on ``field_delimiter`` (default a tab) whose header may be graph-learn's
``id:int64	weight:float	attrs:string``.

With ``hard_negatives`` (TorchEasyRec's ``hard_negative_sampler``), each row's user also gets
the items of its edges in the edge table (columns user id, item id, weight; Parquet or text as
the item table) — all of them (graph-learn's ``full`` neighbour strategy, TorchEasyRec's), or at
most ``num_hard_sample`` (more: that many drawn by edge weight without replacement) —
appended after the sampled items with the row each belongs to.

The draws of a batch depend on the seed and on where its rows start (the file's name under its
directory's name, and the row) alone, not on the DataLoader workers or where the data lies: a
run and its resume see the same negatives. A batch position draws the same items every epoch
(TorchEasyRec draws afresh).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from dynarec.config.schema import NegativeSamplerCfg

__all__ = [
    "MULTI_VALUE_SEPARATOR",
    "NegativeSampler",
    "SamplerError",
    "attribute_columns",
    "negative_sampler",
    "read_graph_table",
    "write_item_table",
]

# Between the values of an attribute whose data column is a list (TorchEasyRec's multival_sep).
MULTI_VALUE_SEPARATOR = "\x1d"

# Draws of an item already in the batch are drawn again, at most this many rounds; then the rest
# from the weights of the items outside the batch (a batch holding every item keeps its draws).
_ROUNDS = 8


class SamplerError(ValueError):
    """A bad item table; the message names the file and what is wrong."""


class NegativeSampler:
    """Draws a batch's negative items and gives their attribute columns."""

    def __init__(self, cfg: NegativeSamplerCfg, seed: int = 0):
        self.cfg = cfg
        self.seed = seed
        self.ids, weights, attrs = _read_items(cfg)
        self.cumulative = np.cumsum(weights)
        parts = pc.split_pattern(attrs, cfg.attr_delimiter)
        counts = pc.list_value_length(parts).to_numpy(zero_copy_only=False)
        bad = np.nonzero(counts != len(cfg.attr_fields))[0]
        if bad.size:
            i = int(bad[0])
            raise SamplerError(
                f"{cfg.input_path}, item {int(self.ids[i])}: {int(counts[i])} attribute(s) "
                f"{attrs[i].as_py()!r}, attr_fields has {len(cfg.attr_fields)} ({', '.join(cfg.attr_fields)}), "
                f"joined by {cfg.attr_delimiter!r}"
            )
        flat = parts.flatten()
        k = len(cfg.attr_fields)
        # [field][item]: each attribute column of the catalog, as strings
        self.attrs = [flat.take(pa.array(np.arange(j, len(flat), k))) for j in range(k)]
        self.edges = _read_edges(cfg, self.ids) if cfg.hard_negatives is not None else None

    @property
    def num_items(self) -> int:
        return len(self.ids)

    def draw(self, batch_items: np.ndarray, count: int, key: str) -> np.ndarray:
        """``count`` catalog indices drawn by weight (with replacement), none of whose ids is in
        ``batch_items``; ``key`` seeds the draws (the batch's position)."""
        digest = hashlib.blake2b(f"{self.seed}:{key}".encode(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        total = self.cumulative[-1]
        picks = np.searchsorted(self.cumulative, rng.random(count) * total, side="right")
        picks = np.minimum(picks, len(self.ids) - 1)
        taken = np.asarray(batch_items, dtype=np.int64)
        for _ in range(_ROUNDS):
            clash = np.isin(self.ids[picks], taken)
            if not clash.any():
                return picks
            again = rng.random(int(clash.sum())) * total
            picks[clash] = np.minimum(np.searchsorted(self.cumulative, again, side="right"), len(self.ids) - 1)
        clash = np.isin(self.ids[picks], taken)
        if clash.any():  # the batch's items hold most of the weight: draw the rest from the others
            cumulative = np.cumsum(np.diff(self.cumulative, prepend=0.0) * ~np.isin(self.ids, taken))
            if cumulative[-1] > 0:
                again = rng.random(int(clash.sum())) * cumulative[-1]
                picks[clash] = np.minimum(np.searchsorted(cumulative, again, side="right"), len(self.ids) - 1)
        return picks

    def hard(self, users: np.ndarray, key: str) -> tuple[np.ndarray, np.ndarray]:
        """``(picks, rows)``: catalog indices of the hard negatives of each of ``users`` (a batch's
        user ids, row by row) and the row each belongs to, rows ascending; ``key`` seeds the draws
        of a user with more edges than ``num_hard_sample`` (unset: every edge)."""
        assert self.edges is not None and self.cfg.hard_negatives is not None
        users_sorted, offsets, items, weights = self.edges
        limit = self.cfg.hard_negatives.num_hard_sample
        if not len(users_sorted):
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        at = np.searchsorted(users_sorted, users)
        at = np.minimum(at, len(users_sorted) - 1)
        known = users_sorted[at] == users
        starts = np.where(known, offsets[at], 0)
        counts = np.where(known, offsets[at + 1] - offsets[at], 0)
        rng = None
        picks, rows = [], []
        for row in np.nonzero(counts)[0]:
            first, n = int(starts[row]), int(counts[row])
            chosen = items[first : first + n]
            if limit is not None and n > limit:
                if rng is None:
                    digest = hashlib.blake2b(f"{self.seed}:hard:{key}".encode(), digest_size=8).digest()
                    rng = np.random.default_rng(int.from_bytes(digest, "little"))
                w = weights[first : first + n]
                chosen = chosen[rng.choice(n, limit, replace=False, p=w / w.sum() if w.sum() > 0 else None)]
            picks.append(chosen)
            rows.append(np.full(len(chosen), row, dtype=np.int64))
        if not picks:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        return np.concatenate(picks), np.concatenate(rows)

    def columns(self, picks: np.ndarray, types: dict[str, pa.DataType]) -> dict[str, pa.Array]:
        """The attribute columns of the catalog items ``picks``, cast to the batch's column
        ``types`` (strings where a column is not among them)."""
        index = pa.array(picks)
        return attribute_columns(
            self.cfg.attr_fields, [values.take(index) for values in self.attrs], types, self.cfg.input_path
        )


def attribute_columns(
    names: list[str], values: list[pa.Array], types: dict[str, pa.DataType], path: str
) -> dict[str, pa.Array]:
    """Attribute columns ``names`` of sampled items (``values``: strings, read from the table at
    ``path``) cast to the batch's column ``types`` (strings where a column is not among them): an
    empty value is missing (TorchEasyRec's), a list column's values split on
    :data:`MULTI_VALUE_SEPARATOR`; SamplerError where a value does not read as its column's."""
    out = {}
    for name, col in zip(names, values):
        t = types.get(name)
        if t is not None and t != col.type:
            try:
                if not (pa.types.is_string(t) or pa.types.is_large_string(t)):  # "" is missing, as TorchEasyRec's
                    col = pc.if_else(pc.equal(col, ""), pa.scalar(None, pa.string()), col)
                if pa.types.is_list(t) or pa.types.is_large_list(t):  # a list column: values joined
                    col = pc.split_pattern(col, MULTI_VALUE_SEPARATOR)
                col = col.cast(t)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise SamplerError(f"{path}: attribute '{name}' does not read as the data's {t} ({e})") from None
        out[name] = col
    return out


def negative_sampler(cfg: NegativeSamplerCfg, seed: int) -> NegativeSampler:
    """The sampler of ``cfg`` (its item table read once a process, for every dataset of a run)."""
    return _cached(cfg.model_dump_json(), seed)


@functools.lru_cache(maxsize=4)
def _cached(cfg_json: str, seed: int) -> NegativeSampler:
    return NegativeSampler(NegativeSamplerCfg.model_validate_json(cfg_json), seed)


def write_item_table(
    cfg: NegativeSamplerCfg,
    ids: np.ndarray,
    weights: np.ndarray,
    attrs: list[list[str]],
    path: Union[str, Path, None] = None,
) -> None:
    """Writes the item table at ``path`` (default ``cfg.input_path``) as :class:`NegativeSampler`
    reads it: each item's id, weight and attributes (one list of strings an item, in
    ``attr_fields`` order, joined by ``attr_delimiter``), in graph-learn's text layout (a header
    first), or as a Parquet table of those three columns where the path ends in ``.parquet``."""
    path = Path(cfg.input_path if path is None else path)
    path.parent.mkdir(parents=True, exist_ok=True)
    joined = [cfg.attr_delimiter.join(a) for a in attrs]
    if path.suffix == ".parquet":
        pq.write_table(
            pa.table(
                {
                    "id": pa.array(np.asarray(ids, dtype=np.int64)),
                    "weight": pa.array(np.asarray(weights, dtype=np.float64)),
                    "attrs": pa.array(joined, pa.string()),
                }
            ),
            path,
        )
        return
    delimiter = cfg.field_delimiter or "\t"
    lines = [delimiter.join(("id:int64", "weight:float", "attrs:string"))]
    lines += [delimiter.join((str(int(i)), f"{w:g}", a)) for i, w, a in zip(ids, weights, joined)]
    path.write_text("\n".join(lines) + "\n")


def write_edge_table(cfg: NegativeSamplerCfg, users: np.ndarray, items: np.ndarray, path: Union[str, Path]) -> None:
    """Writes a hard-negative edge table at ``path`` as :func:`_read_edges` reads it: user ``i``
    to item ``i``, weight 1, in graph-learn's text layout (a header first), or as a Parquet table
    of those three columns where the path ends in ``.parquet``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        users, items = np.asarray(users, dtype=np.int64), np.asarray(items, dtype=np.int64)
        pq.write_table(pa.table({"src_id": users, "dst_id": items, "weight": np.ones(len(users))}), path)
        return
    delimiter = cfg.field_delimiter or "\t"
    lines = [delimiter.join(("src_id:int64", "dst_id:int64", "weight:float"))]
    lines += [f"{u}{delimiter}{i}{delimiter}1" for u, i in zip(np.asarray(users).tolist(), np.asarray(items).tolist())]
    path.write_text("\n".join(lines) + "\n")


def read_graph_table(path_text: str, delimiter: str, types: tuple[pa.DataType, ...], field: str, noun: str) -> pa.Table:
    """A Parquet table, or a CSV / text table split on ``delimiter`` whose header may be
    graph-learn's (``name:type``; the names kept), its columns read as ``types``; SamplerError
    naming the config ``field`` of a missing file, or the ``noun`` table that cannot be read."""
    path = Path(path_text)
    if not path.exists():
        raise SamplerError(f"{field}: {path_text} does not exist")
    try:
        if path.suffix == ".parquet":
            return pq.read_table(path)
        with open(path, encoding="utf-8") as f:
            header = f.readline().rstrip("\r\n").split(delimiter)
        table = pacsv.read_csv(
            path,
            parse_options=pacsv.ParseOptions(delimiter=delimiter, quote_char=False),
            convert_options=pacsv.ConvertOptions(column_types=dict(zip(header, types)), strings_can_be_null=False),
        )
        return table.rename_columns([c.split(":")[0] for c in table.column_names])
    except (pa.ArrowInvalid, OSError) as e:
        raise SamplerError(f"{path_text}: cannot read the {noun} table ({e})") from None


def _read_items(cfg: NegativeSamplerCfg) -> tuple[np.ndarray, np.ndarray, pa.Array]:
    """``(ids int64, weights float64, attrs string)`` of the item table."""
    delimiter = cfg.field_delimiter or "\t"
    table = read_graph_table(
        cfg.input_path, delimiter, (pa.int64(), pa.float64(), pa.string()), "data.negative_sampler.input_path", "item"
    )
    if table.num_columns != 3 or table.num_rows == 0:
        raise SamplerError(
            f"{cfg.input_path}: an item table has 3 columns (id, weight, attributes) and rows; "
            f"found {table.num_columns} column(s) {table.column_names}, {table.num_rows} row(s)"
        )
    ids, weights, attrs = (table.column(i).combine_chunks() for i in range(3))
    try:
        id_values = ids.cast(pa.int64()).to_numpy(zero_copy_only=False)
        w = weights.cast(pa.float64()).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise SamplerError(f"{cfg.input_path}: ids must be integers and weights numbers ({e})") from None
    if ids.null_count or weights.null_count or attrs.null_count:
        raise SamplerError(f"{cfg.input_path}: an item has a missing id, weight or attributes")
    _check_weights(w, cfg.input_path, lambda i: f"item {int(id_values[i])}")
    if not w.sum() > 0:
        raise SamplerError(f"{cfg.input_path}: every weight is 0")
    return id_values, w, attrs.cast(pa.string())


def _check_weights(w: np.ndarray, path: str, name) -> None:
    bad = np.nonzero(~np.isfinite(w) | (w < 0))[0]
    if bad.size:
        i = int(bad[0])
        raise SamplerError(f"{path}, {name(i)}: weight {w[i]} is not a number >= 0")


def _read_edges(cfg: NegativeSamplerCfg, item_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The hard-negative edge table by user: ``(users sorted unique, offsets [U + 1], catalog
    indices of their items, edge weights)``, each user's edges in the table's order."""
    hard = cfg.hard_negatives
    assert hard is not None
    path = hard.edge_input_path
    delimiter = cfg.field_delimiter or "\t"
    table = read_graph_table(
        path,
        delimiter,
        (pa.int64(), pa.int64(), pa.float64()),
        "data.negative_sampler.hard_negatives.edge_input_path",
        "edge",
    )
    if table.num_columns != 3:
        raise SamplerError(
            f"{path}: an edge table has 3 columns (user id, item id, weight); found {table.num_columns} column(s) "
            f"{table.column_names}"
        )
    try:
        users, items, w = (
            table.column(i).combine_chunks().cast(t).to_numpy(zero_copy_only=False)
            for i, t in enumerate((pa.int64(), pa.int64(), pa.float64()))
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise SamplerError(f"{path}: user and item ids must be integers and weights numbers ({e})") from None
    if any(table.column(i).null_count for i in range(3)):
        raise SamplerError(f"{path}: an edge has a missing user id, item id or weight")
    _check_weights(w, path, lambda i: f"edge {int(users[i])} -> {int(items[i])}")
    order = np.argsort(item_ids, kind="stable")
    at = np.minimum(np.searchsorted(item_ids[order], items), len(order) - 1)
    unknown = np.nonzero(item_ids[order][at] != items)[0]
    if unknown.size:
        i = int(unknown[0])
        raise SamplerError(
            f"{path}: edge {int(users[i])} -> {int(items[i])}: item {int(items[i])} is not in the item table "
            f"{cfg.input_path} (a hard negative needs its attributes)"
        )
    by_user = np.argsort(users, kind="stable")
    users_sorted, counts = np.unique(users[by_user], return_counts=True)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return users_sorted, offsets, order[at][by_user], w[by_user]
