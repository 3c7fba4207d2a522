"""The tree index of a TDM model (``data.tdm_sampler``): every item a leaf on the last level,
every other node the items below it.

Built as TorchEasyRec's tools build it (``tzrec/tools/tdm``): each item gets a code of the
complete ``n_cluster``-ary tree (the root 0, the children of ``c`` ``n c + 1 .. n c + n``),
pulled down to the last level by first children where it ends above it; a node's parent is
``(c - 1) // n``. :func:`init_tree` codes the items sorted by (category, id) by splitting the
list into ``n`` equal parts recursively (TorchEasyRec's ``init_tree``); :func:`cluster_tree` by
splitting their embeddings with balanced k-means recursively (``cluster_tree``; faiss's k-means
where TorchEasyRec calls scikit-learn's). An inner node's id is the largest item id + its code +
1, its attributes the most common value of each attribute over the items below it (ties: the
smallest, where TorchEasyRec's take the first in its leaves' order) and the mean of each raw
attribute (rounded for integers).

On disk, graph-learn's text tables TorchEasyRec reads and writes (:func:`write_tree`,
:func:`read_tree`): ``node_table.txt`` (``id  weight  level,id,attributes...``, after a virtual
node ``-1`` TorchEasyRec's graph-learn uses to find the root), ``edge_table.txt`` (each leaf to
each of its ancestors below the root) and ``predict_edge_table.txt`` (each node to its
children, TorchEasyRec's retrieval table; dynarec reads the tree from the first two).

Differences: with ``n_cluster`` > 2 TorchEasyRec pulls codes below ``n^depth - 1``, which is
not where the last level starts (``(n^depth - 1) / (n - 1)``), and leaves some items a level
above the others; dynarec puts every item on the last level (the same tree for ``n_cluster``
2). A single item is a leaf under a root (TorchEasyRec's is the root itself: a tree of one
level no sampler trains).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dynarec.files import atomic_path

__all__ = [
    "Tree",
    "TreeError",
    "cluster_tree",
    "init_tree",
    "node_attribute",
    "read_tree",
    "tree_from_codes",
    "write_tree",
    "write_tree_tables",
]

NODE_TABLE = "node_table.txt"
EDGE_TABLE = "edge_table.txt"
PREDICT_EDGE_TABLE = "predict_edge_table.txt"


class TreeError(ValueError):
    """A tree table that cannot be read as a TDM tree; the message names the file."""


@dataclass(frozen=True)
class Tree:
    """A tree of ``N`` nodes, level by level from the root (level 0), every leaf on the last level.

    ``ids`` int64 ``[N]`` (a leaf's: its item id); ``levels`` int64 ``[N]`` non-decreasing;
    ``parents`` int64 ``[N]``, the index of each node's parent (-1: the root, and a node no leaf
    reaches); ``weights`` float64 ``[N]`` (a negative's draw weight); ``attrs``: one string
    column ``[N]`` per attribute (``""``: missing)."""

    ids: np.ndarray
    levels: np.ndarray
    parents: np.ndarray
    weights: np.ndarray
    attrs: tuple[pa.Array, ...]

    @property
    def num_levels(self) -> int:
        return int(self.levels[-1]) + 1

    @cached_property
    def level_starts(self) -> np.ndarray:
        """``[num_levels + 1]``: level ``l``'s nodes are ``level_starts[l]:level_starts[l + 1]``."""
        return np.searchsorted(self.levels, np.arange(self.num_levels + 1)).astype(np.int64)

    @cached_property
    def children(self) -> tuple[np.ndarray, np.ndarray]:
        """``(offsets [N + 1], child indices)``: node ``i``'s children are
        ``indices[offsets[i]:offsets[i + 1]]``, in node order."""
        has = np.nonzero(self.parents >= 0)[0]
        order = has[np.argsort(self.parents[has], kind="stable")]
        counts = np.bincount(self.parents[has], minlength=len(self.ids))
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), order

    @cached_property
    def _leaves(self) -> tuple[np.ndarray, np.ndarray]:
        first = self.level_starts[-2]
        order = np.argsort(self.ids[first:], kind="stable")
        return self.ids[first:][order], (first + order).astype(np.int64)

    def leaf_nodes(self, item_ids: np.ndarray) -> np.ndarray:
        """The node index of each item id ``[B]``; -1 where an id is no leaf."""
        ids, nodes = self._leaves
        at = np.minimum(np.searchsorted(ids, item_ids), len(ids) - 1)
        return np.where(ids[at] == item_ids, nodes[at], -1)

    @cached_property
    def paths(self) -> np.ndarray:
        """``[N, num_levels]``: for each node, its ancestor at every level (itself at its own
        level; -1 below it)."""
        n, depth = len(self.ids), self.num_levels
        out = np.full((n, depth), -1, dtype=np.int64)
        out[np.arange(n), self.levels] = np.arange(n)
        for level in range(depth - 1, 0, -1):  # each node's ancestor at level - 1: its level's node's parent
            rows = np.nonzero(out[:, level] >= 0)[0]
            out[rows, level - 1] = self.parents[out[rows, level]]
        return out

    def attribute_strings(self, nodes: np.ndarray) -> list[pa.Array]:
        """The attribute columns of ``nodes`` (strings)."""
        index = pa.array(nodes)
        return [a.take(index) for a in self.attrs]


# -- building -----------------------------------------------------------------------------------


def _first_code(level: int, n: int) -> int:
    """The code of the first node of ``level`` in the complete ``n``-ary tree."""
    return (n**level - 1) // (n - 1)


def _level_of(codes: np.ndarray, n: int) -> np.ndarray:
    levels = np.zeros(len(codes), dtype=np.int64)
    level = 1
    while (codes >= _first_code(level, n)).any():
        levels += codes >= _first_code(level, n)
        level += 1
    return levels


def tree_from_codes(
    item_ids: np.ndarray,
    codes: np.ndarray,
    attrs: list[pa.Array],
    n_cluster: int,
    raw: Collection[int] = (),
) -> Tree:
    """The tree of items ``item_ids`` (int64 ``[M]``, distinct) at ``codes`` (int64 ``[M]``,
    distinct, none an ancestor of another) and their ``attrs`` (a column ``[M]`` per attribute;
    those at the positions ``raw`` numbers, averaged, the others voted); each code pulled down to
    the last level by first children."""
    _check_branching(n_cluster)
    m = len(item_ids)
    if m == 0:
        raise ValueError("a tree needs at least one item")
    if len(np.unique(item_ids)) != m:
        raise ValueError("the items' ids must be distinct (a leaf an item)")
    codes = np.asarray(codes, dtype=np.int64).copy()
    if (codes < 0).any():
        raise ValueError("tree codes are >= 0")
    depth = 1  # (one item: the root and its leaf)
    while n_cluster**depth < m:
        depth += 1
    depth = max(depth, int(_level_of(codes[codes.argmax() : codes.argmax() + 1], n_cluster)[0]))
    last = _first_code(depth, n_cluster)
    while (codes < last).any():
        up = codes < last
        codes[up] = codes[up] * n_cluster + 1
    if len(np.unique(codes)) != m:
        raise ValueError("two items share a tree code")
    # Every leaf's ancestor at each level: [M, depth + 1].
    ancestors = np.empty((m, depth + 1), dtype=np.int64)
    ancestors[:, depth] = codes
    for level in range(depth - 1, -1, -1):
        ancestors[:, level] = (ancestors[:, level + 1] - 1) // n_cluster
    inner = np.unique(ancestors[:, :depth])
    all_codes = np.concatenate([inner, np.sort(codes)])
    leaf_order = np.argsort(codes)
    max_item = int(np.max(item_ids))
    ids = np.concatenate([max_item + inner + 1, np.asarray(item_ids, dtype=np.int64)[leaf_order]])
    levels = np.concatenate([_level_of(inner, n_cluster), np.full(m, depth, dtype=np.int64)])
    # all_codes ascends (inner codes lie above the last level's): a parent's index by search
    parents = np.searchsorted(all_codes, (all_codes - 1) // n_cluster).astype(np.int64)
    parents[all_codes == 0] = -1
    columns = []
    for j, column in enumerate(attrs):
        column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        values = [_inner_values(column, ancestors[:, level], j in raw) for level in range(depth)]
        leaf = _strings(column.take(pa.array(leaf_order)), j in raw)
        columns.append(pa.concat_arrays([*values, leaf]).cast(pa.string()))
    # inner nodes per level, in code order (np.unique sorted them; levels ascend with codes)
    return Tree(ids, levels, parents, np.ones(len(ids)), tuple(columns))


def _check_branching(n_cluster: int) -> None:
    if n_cluster < 2:
        raise ValueError(f"n_cluster: a tree's branching factor is at least 2, got {n_cluster}")


def node_attribute(column: Union[pa.Array, pa.ChunkedArray]) -> pa.Array:
    """An item column as a node attribute: a list column's values joined by
    :data:`~dynarec.data.sampler.MULTI_VALUE_SEPARATOR` (TorchEasyRec's multival_sep)."""
    from dynarec.data.sampler import MULTI_VALUE_SEPARATOR

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        return pc.binary_join(column.cast(pa.list_(pa.string())), MULTI_VALUE_SEPARATOR)
    return column


def _strings(column: pa.Array, raw: bool) -> pa.Array:
    """Attribute values as the node table writes them: a missing one "" (a raw one "0")."""
    return column.cast(pa.string()).fill_null("0" if raw else "")


def _inner_values(column: pa.Array, groups: np.ndarray, raw: bool) -> pa.Array:
    """The value of each inner node of one level (the codes in ``groups``, each item's, in code
    order) for one attribute: the most common of its items' values (ties: the smallest; missing
    and empty values not counted; none: missing), or for a raw attribute the mean of its items'
    values (missing ones not counted; rounded to an integer column's integers)."""
    nodes = np.unique(groups)
    slot = np.searchsorted(nodes, groups)
    if raw:
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):  # (a node table's)
            column = pc.if_else(pc.equal(column, ""), pa.scalar(None, pa.string()), column)
            try:
                column = column.cast(pa.int64())
            except pa.ArrowInvalid:
                column = column.cast(pa.float64())
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        x = pc.fill_null(column.cast(pa.float64()), 0.0).to_numpy(zero_copy_only=False)
        counts = np.bincount(slot[valid], minlength=len(nodes))
        mean = np.bincount(slot[valid], weights=x[valid], minlength=len(nodes)) / np.maximum(counts, 1)
        if pa.types.is_integer(column.type):
            values = pa.array(np.round(mean).astype(np.int64))
        else:
            values = pa.array(mean).cast(column.type, safe=False)
        # no value below a node: missing, written as 0 (TorchEasyRec's)
        return _strings(pc.if_else(pa.array(counts > 0), values, pa.scalar(None, values.type)), raw=True)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        valid &= pc.not_equal(column, "").fill_null(False).to_numpy(zero_copy_only=False)
    values = column.filter(pa.array(valid)).to_numpy(zero_copy_only=False)
    out = np.full(len(nodes), None, dtype=object)
    if valid.any():
        distinct, code = np.unique(values, return_inverse=True)
        pairs, counts = np.unique(slot[valid] * len(distinct) + code, return_counts=True)
        group, value = pairs // len(distinct), pairs % len(distinct)
        order = np.lexsort((value, -counts, group))  # per group: most common, then smallest
        first = order[np.concatenate([[True], group[order][1:] != group[order][:-1]])]
        out[group[first]] = distinct[value[first]]
    return _strings(pa.array(out.tolist(), type=column.type), raw=False)


def init_tree(
    item_ids: np.ndarray, categories: pa.Array, attrs: list[pa.Array], n_cluster: int = 2, raw: Collection[int] = ()
) -> Tree:
    """TorchEasyRec's initial tree: the items sorted by (category as a string, id), coded by
    splitting the sorted list into ``n_cluster`` near-equal parts recursively (part ``i`` of a
    node coded ``c`` gets ``n c + n - i``)."""
    _check_branching(n_cluster)
    cats = _strings(categories.combine_chunks() if isinstance(categories, pa.ChunkedArray) else categories, False)
    _, rank = np.unique(np.asarray(cats.to_pylist(), dtype=object), return_inverse=True)
    order = np.lexsort((np.asarray(item_ids), rank))
    codes = np.zeros(len(item_ids), dtype=np.int64)
    stack = [(0, len(order), 0)]
    while stack:
        start, end, code = stack.pop()
        if end - start == 1:
            codes[order[start]] = code
            continue
        for i in range(n_cluster):
            left = start + i * (end - start) // n_cluster
            right = start + (i + 1) * (end - start) // n_cluster
            if right > left:
                stack.append((left, right, n_cluster * code + n_cluster - i))
    return tree_from_codes(item_ids, codes, attrs, n_cluster, raw)


def cluster_tree(
    item_ids: np.ndarray,
    embeddings: np.ndarray,
    attrs: list[pa.Array],
    n_cluster: int = 2,
    raw: Collection[int] = (),
    seed: int = 0,
) -> Tree:
    """TorchEasyRec's learnt tree: the items split by their ``embeddings`` (float ``[M, D]``)
    into ``n_cluster`` balanced clusters recursively (:func:`balanced_split`); a set of at most
    ``n_cluster`` items gives each a child of its node."""
    _check_branching(n_cluster)
    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    if x.ndim != 2 or len(x) != len(item_ids):
        raise ValueError(f"embeddings: one row per item ({len(item_ids)}), got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("embeddings: a value is NaN or infinite")
    codes = np.zeros(len(item_ids), dtype=np.int64)
    queue = [(0, np.arange(len(item_ids)))]
    while queue:
        parent, index = queue.pop()
        if len(index) <= n_cluster:
            codes[index] = n_cluster * parent + np.arange(1, len(index) + 1)
            continue
        for i, part in enumerate(balanced_split(x[index], n_cluster, seed)):
            code = n_cluster * parent + i + 1
            if len(part) > 1:
                queue.append((code, index[part]))
            elif len(part) == 1:
                codes[index[part[0]]] = code
    return tree_from_codes(item_ids, codes, attrs, n_cluster, raw)


def balanced_split(x: np.ndarray, n: int, seed: int = 0) -> list[np.ndarray]:
    """Rows of ``x`` ``[M, D]`` (M > n) in ``n`` parts by k-means, balanced as TorchEasyRec's
    ``TreeCluster._cluster``: a cluster larger than ``M // n`` keeps its ``M // n`` rows nearest
    its centroid; the rest fill the smaller clusters in order, nearest first; what remains joins
    the first."""
    import faiss

    km = faiss.Kmeans(x.shape[1], n, niter=20, seed=seed, verbose=False)
    km.cp.min_points_per_centroid = 1
    km.train(x)
    centroids = km.centroids
    distances = ((x[:, None, :] - centroids[None, :, :]) ** 2).sum(-1)  # [M, n]
    labels = distances.argmin(1)
    ave = len(x) // n
    parts, remain = [], []
    for i in range(n):
        members = np.nonzero(labels == i)[0]
        if len(members) <= ave:
            parts.append(members)
        else:
            ranked = members[np.argsort(distances[members, i], kind="stable")]
            parts.append(ranked[:ave])
            remain.extend(ranked[ave:].tolist())
    rest = np.array(remain, dtype=np.int64)
    for i in range(n):
        if not len(rest):
            break
        if len(parts[i]) >= ave:
            continue
        ranked = rest[np.argsort(distances[rest, i], kind="stable")]
        take = ave - len(parts[i])
        parts[i] = np.concatenate([parts[i], ranked[:take]])
        rest = ranked[take:]
    if len(rest):
        parts[0] = np.concatenate([parts[0], rest])
    return [p.astype(np.int64) for p in parts]


# -- tables -------------------------------------------------------------------------------------


def write_tree(tree: Tree, out_dir: Union[str, Path], attr_delimiter: str = ",") -> Path:
    """Writes ``node_table.txt``, ``edge_table.txt`` and ``predict_edge_table.txt`` under
    ``out_dir`` (each atomically); returns the directory."""
    out = Path(out_dir)
    write_tree_tables(tree, out / NODE_TABLE, out / EDGE_TABLE, out / PREDICT_EDGE_TABLE, attr_delimiter)
    return out


def write_tree_tables(
    tree: Tree,
    node_path: Union[str, Path],
    edge_path: Union[str, Path],
    predict_edge_path: Union[str, Path, None] = None,
    attr_delimiter: str = ",",
) -> None:
    """Writes the node table, the edge table and (where given) the predict edge table of
    ``tree`` at those paths, each atomically, their directories made."""
    for p in (node_path, edge_path, predict_edge_path):
        if p is not None:
            Path(p).parent.mkdir(parents=True, exist_ok=True)
    for column in tree.attrs:
        if pc.any(pc.match_substring(column, attr_delimiter)).as_py():
            raise ValueError(
                f"an attribute value holds the attr_delimiter {attr_delimiter!r}; choose another attr_delimiter"
            )
    ids = pa.array(tree.ids).cast(pa.string())
    columns = [pa.array(tree.levels).cast(pa.string()), ids, *tree.attrs]
    features = pc.binary_join_element_wise(*columns, attr_delimiter)
    root = pc.binary_join_element_wise(pa.array(["-1"]), *(c[:1] for c in columns[1:]), attr_delimiter)
    weights = pa.array(tree.weights).cast(pa.string())
    header = ["id:int64\tweight:float\tfeature:string", f"-1\t1.0\t{root[0].as_py()}"]
    _write_lines(Path(node_path), header, pc.binary_join_element_wise(ids, weights, features, "\t"))
    # each leaf to its parent first, up to the root's child
    ancestors = tree.paths[tree.level_starts[-2] :, -2:0:-1]
    leaves = np.repeat(tree.ids[tree.level_starts[-2] :], ancestors.shape[1])
    _write_edges(Path(edge_path), [], leaves, tree.ids[ancestors.reshape(-1)])
    if predict_edge_path is not None:
        has = np.nonzero(tree.parents >= 0)[0]
        first = [f"-1\t{tree.ids[0]}\t1.0"]
        _write_edges(Path(predict_edge_path), first, tree.ids[tree.parents[has]], tree.ids[has])


def _write_edges(path: Path, first: list[str], src: np.ndarray, dst: np.ndarray) -> None:
    header = ["src_id:int64\tdst_id:int64\tweight:float", *first]
    ones = pa.array(np.full(len(src), "1.0", dtype=object), pa.string())
    _write_lines(
        path,
        header,
        pc.binary_join_element_wise(pa.array(src).cast(pa.string()), pa.array(dst).cast(pa.string()), ones, "\t"),
    )


def _write_lines(path: Path, header: list[str], rows: pa.Array) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(header) + "\n")
        if len(rows):
            f.write("\n".join(rows.to_pylist()) + "\n")


def read_tree(
    node_path: str,
    edge_path: str,
    num_attrs: int,
    attr_delimiter: str = ",",
    field_delimiter: Optional[str] = None,
) -> Tree:
    """The tree of a node table and an edge table (graph-learn's text layout or Parquet, as
    :func:`write_tree` and TorchEasyRec's tools write them), each node holding ``num_attrs``
    attributes after its level and id. TreeError names the file and the node where they do not
    make a tree with every leaf on its last level."""
    from dynarec.data.sampler import read_graph_table

    delimiter = field_delimiter or "\t"
    nodes = read_graph_table(
        node_path, delimiter, (pa.int64(), pa.float64(), pa.string()), "data.tdm_sampler.item_input_path", "node"
    )
    if nodes.num_columns != 3:
        raise TreeError(f"{node_path}: a node table has 3 columns (id, weight, feature); found {nodes.column_names}")
    try:
        ids = nodes.column(0).cast(pa.int64()).to_numpy()
        weights = nodes.column(1).cast(pa.float64()).to_numpy()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise TreeError(f"{node_path}: ids must be integers and weights numbers ({e})") from None
    keep = ids != -1  # graph-learn's virtual node before the root
    parts = pc.split_pattern(nodes.column(2).combine_chunks().filter(pa.array(keep)), attr_delimiter)
    ids, weights = ids[keep], weights[keep]
    counts = pc.list_value_length(parts).to_numpy(zero_copy_only=False)
    bad = np.nonzero(counts != 2 + num_attrs)[0]
    if bad.size:
        i = int(bad[0])
        raise TreeError(
            f"{node_path}, node {ids[i]}: {counts[i]} value(s) in its feature, expected {2 + num_attrs} (its level, "
            f"its id and the {num_attrs} attr_fields, joined by {attr_delimiter!r})"
        )
    flat = parts.flatten()
    k = 2 + num_attrs
    try:
        levels = flat.take(pa.array(np.arange(0, len(flat), k))).cast(pa.int64()).to_numpy()
    except pa.ArrowInvalid:
        raise TreeError(f"{node_path}: a node's first feature value, its level, is not an integer") from None
    if len(ids) == 0 or (levels < 0).any():
        raise TreeError(f"{node_path}: holds no node, or a negative level")
    if len(np.unique(ids)) != len(ids):
        raise TreeError(f"{node_path}: node id {_first_duplicate(ids)} appears twice")
    order = np.lexsort((ids, levels))
    ids, weights, levels = ids[order], weights[order], levels[order]
    attrs = tuple(flat.take(pa.array(np.arange(2 + j, len(flat), k)[order])) for j in range(num_attrs))
    if (levels == 0).sum() != 1:
        raise TreeError(f"{node_path}: a tree has one node on level 0 (the root), found {(levels == 0).sum()}")
    if not (np.isfinite(weights).all() and (weights >= 0).all()):
        raise TreeError(f"{node_path}: a node's weight is not a number >= 0")
    depth = int(levels[-1]) + 1
    if depth < 2:
        raise TreeError(f"{node_path}: a tree has at least two levels (the root and the items)")
    if not (np.diff(np.unique(levels)) == 1).all():
        raise TreeError(f"{node_path}: a level between 0 and {depth - 1} holds no node")
    parents = _parents_of_edges(edge_path, ids, levels, depth, delimiter)
    return Tree(ids, levels, parents, weights, attrs)


def _first_duplicate(ids: np.ndarray) -> int:
    u, c = np.unique(ids, return_counts=True)
    return int(u[c > 1][0])


def _parents_of_edges(path: str, ids: np.ndarray, levels: np.ndarray, depth: int, delimiter: str) -> np.ndarray:
    """Each node's parent (index; -1: the root, a node no leaf reaches) from the edge table of
    each leaf to each of its ancestors below the root."""
    from dynarec.data.sampler import read_graph_table

    edges = read_graph_table(
        path, delimiter, (pa.int64(), pa.int64(), pa.float64()), "data.tdm_sampler.edge_input_path", "edge"
    )
    try:
        src, dst = (edges.column(i).cast(pa.int64()).to_numpy() for i in range(2))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, IndexError) as e:
        raise TreeError(f"{path}: an edge table's first two columns are node ids ({e})") from None
    order = np.argsort(ids)
    sorted_ids = ids[order]

    def index(x: np.ndarray, what: str) -> np.ndarray:
        at = np.minimum(np.searchsorted(sorted_ids, x), len(ids) - 1)
        unknown = np.nonzero(sorted_ids[at] != x)[0]
        if unknown.size:
            raise TreeError(f"{path}: {what} {x[unknown[0]]} is no node of the node table")
        return order[at]

    s, d = index(src, "edge source"), index(dst, "edge target")
    first_leaf = int(np.searchsorted(levels, depth - 1))
    if (s < first_leaf).any():
        i = int(np.nonzero(s < first_leaf)[0][0])
        raise TreeError(
            f"{path}: edge {src[i]} -> {dst[i]}: its source is on level {levels[s[i]]}, not the last level "
            f"{depth - 1} (every edge goes from an item, a leaf, up)"
        )
    d_levels = levels[d]
    keep = d_levels > 0  # an edge to the root says nothing more
    s, d, d_levels = s[keep], d[keep], d_levels[keep]
    paths = np.full((len(ids) - first_leaf, depth), -1, dtype=np.int64)
    paths[:, 0] = 0
    paths[:, depth - 1] = np.arange(first_leaf, len(ids))
    rows = s - first_leaf
    counts = np.bincount(rows * depth + d_levels, minlength=paths.size)
    if (counts > 1).any():
        cell = int(np.nonzero(counts > 1)[0][0])
        raise TreeError(f"{path}: leaf {ids[first_leaf + cell // depth]} has two ancestors on level {cell % depth}")
    if (d_levels >= depth - 1).any():
        i = int(np.nonzero(d_levels >= depth - 1)[0][0])
        raise TreeError(f"{path}: edge {ids[s[i]]} -> {ids[d[i]]} joins two leaves")
    paths[rows, d_levels] = d
    missing = np.nonzero((paths < 0).any(axis=1))[0]
    if missing.size:
        leaf = first_leaf + int(missing[0])
        level = int(np.nonzero(paths[missing[0]] < 0)[0][0])
        raise TreeError(f"{path}: leaf {ids[leaf]} has no ancestor on level {level}")
    parents = np.full(len(ids), -1, dtype=np.int64)
    for level in range(1, depth):
        child, parent = paths[:, level], paths[:, level - 1]
        pairs = np.unique(np.stack([child, parent], axis=1), axis=0)
        twice = np.nonzero(np.diff(pairs[:, 0]) == 0)[0]
        if twice.size:
            node = pairs[twice[0], 0]
            raise TreeError(f"{path}: node {ids[node]} has two parents (the leaves below it disagree)")
        parents[pairs[:, 0]] = pairs[:, 1]
    return parents
