"""The TDM tree (dynarec/data/tree.py): TorchEasyRec's initial tree (``TreeGenerator._init_tree``
and ``TreeBuilder.build``, written out below in plain Python as the reference), its tables
written and read back, graph-learn tables as TorchEasyRec's tools write them, balanced
clustering, and what a broken table is told."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest

from dynarec.data.tree import (
    TreeError,
    balanced_split,
    cluster_tree,
    init_tree,
    read_tree,
    tree_from_codes,
    write_tree,
)


def tzrec_init_tree(items: list[tuple[int, str]], n: int = 2) -> dict[int, int]:
    """TorchEasyRec's initial tree, item id -> tree code: ``_init_tree``'s gen_code over the
    items sorted by (category, id), then ``TreeBuilder.build``'s pull to ``n^ceil(log_n N) - 1``."""
    leaves = sorted(items, key=lambda x: (x[1], x[0]))
    codes = {}

    def gen_code(start, end, code):
        if end <= start:
            return
        if end == start + 1:
            codes[leaves[start][0]] = code
            return
        for i in range(n):
            left = int(start + i * (end - start) / n)
            right = int(start + (i + 1) * (end - start) / n)
            gen_code(left, right, n * code + n - i)

    gen_code(0, len(leaves), 0)
    min_code = n ** math.ceil(math.log(len(leaves), n)) - 1
    for item, code in codes.items():
        while code < min_code:
            code = code * n + 1
        codes[item] = code
    return codes


def test_one_item_is_a_leaf_under_a_root():
    """TorchEasyRec gives a single item the root's code: a tree of one level, which no sampler
    can train; dynarec puts it under a root."""
    tree = init_tree(np.array([7]), pa.array(["c"]), [])
    assert tree.num_levels == 2 and tree.ids.tolist() == [8, 7] and tree.parents.tolist() == [-1, 0]  # root: 7 + 0 + 1


@pytest.mark.parametrize("count", [2, 3, 5, 8, 37, 64])
def test_the_initial_tree_is_torcheasyrecs(count):
    rng = np.random.default_rng(count)
    ids = rng.choice(1000, count, replace=False)
    cats = [f"c{c}" for c in rng.integers(0, 4, count)]
    expected = tzrec_init_tree(list(zip(ids.tolist(), cats)))
    tree = init_tree(ids, pa.array(cats), [pa.array(cats)])
    assert tree.num_levels == math.ceil(math.log2(count)) + 1
    max_item = int(ids.max())
    # leaves: each item at its reference code, the codes' order the tree's
    first = tree.level_starts[-2]
    leaf_codes = [expected[int(i)] for i in tree.ids[first:]]
    assert leaf_codes == sorted(leaf_codes)
    # every inner node: id max item + code + 1, and its children's codes n c + 1, n c + 2
    inner_codes = {int(i) - max_item - 1 for i in tree.ids[:first]}
    ancestors = set()
    for code in expected.values():
        while code > 0:
            code = (code - 1) // 2
            ancestors.add(code)
    assert inner_codes == ancestors
    code = {int(i): int(i) - max_item - 1 for i in tree.ids[:first]} | {int(i): expected[int(i)] for i in ids}
    for node in range(1, len(tree.ids)):
        parent = int(tree.ids[tree.parents[node]])
        assert code[parent] == (code[int(tree.ids[node])] - 1) // 2
    assert tree.parents[0] == -1 and (tree.levels[tree.parents[1:]] == tree.levels[1:] - 1).all()


def test_inner_attributes_are_the_items_mode_and_raw_mean():
    ids = np.array([10, 11, 12, 13, 14])
    cats = pa.array(["b", "a", "a", "b", "c"])
    brand = pa.array([1, 2, 2, 3, None])
    price = pa.array([1.0, 2.0, 3.0, 4.0, 5.0])
    tree = init_tree(ids, cats, [cats, brand, price], raw=[2])
    by_id = {int(i): [a[k].as_py() for a in tree.attrs] for k, i in enumerate(tree.ids)}
    # TorchEasyRec's tree of these: root {14, 13, 10, 12, 11}; code 1 over {14, 13, 10}, code 2 over {12, 11}
    root, one, two = 15, 16, 17
    assert by_id[root] == ["a", "2", "3"]  # a/b tie: the smallest; brand 2 twice; mean price 3
    assert by_id[one] == ["b", "1", str(10 / 3)]  # {c, b, b}; brands {None, 3, 1}: a tie, the smallest
    assert by_id[two] == ["a", "2", "2.5"]
    assert by_id[14] == ["c", "", "5"]  # a leaf keeps its own; missing is ""


def test_a_raw_mean_skips_missing_values_and_none_is_written_0():
    tree = init_tree(np.arange(4), pa.array(["a", "a", "b", "b"]), [pa.array([1.0, 3.0, None, None])], raw=[0])
    by_id = {int(i): tree.attrs[0][k].as_py() for k, i in enumerate(tree.ids)}
    # inner ids 3 + code + 1: the root 4, {2, 3} (code 1) 5, {0, 1} (code 2) 6
    assert by_id[4] == "2" and by_id[6] == "2"  # the mean of 1 and 3, the missing ones not counted
    assert by_id[5] == "0" and by_id[2] == "0"  # no value below: written 0


def test_a_branching_factor_below_2_is_refused():
    with pytest.raises(ValueError, match="n_cluster: a tree's branching factor is at least 2, got 1"):
        init_tree(np.arange(4), pa.array(["a"] * 4), [], n_cluster=1)
    with pytest.raises(ValueError, match="at least 2, got 1"):
        cluster_tree(np.arange(4), np.zeros((4, 2)), [], n_cluster=1)


def test_an_integer_raw_attribute_is_averaged_and_rounded():
    ids = np.arange(4)
    tree = init_tree(ids, pa.array(["x"] * 4), [pa.array([1, 2, 2, 2])], raw=[0])
    assert tree.attrs[0][0].as_py() == "2"  # round(7 / 4)


def test_written_tables_read_back_as_the_same_tree(tmp_path):
    rng = np.random.default_rng(0)
    ids = rng.choice(10_000, 100, replace=False)
    cats = pa.array([f"c{c}" for c in rng.integers(0, 7, 100)])
    tree = init_tree(ids, cats, [cats, pa.array(rng.integers(0, 9, 100))], n_cluster=3)
    write_tree(tree, tmp_path)
    back = read_tree(str(tmp_path / "node_table.txt"), str(tmp_path / "edge_table.txt"), 2)
    assert back.num_levels == tree.num_levels
    assert np.array_equal(np.sort(back.ids), np.sort(tree.ids))
    parent = dict(zip(tree.ids.tolist(), np.where(tree.parents >= 0, tree.ids[tree.parents], -1).tolist()))
    assert parent == dict(zip(back.ids.tolist(), np.where(back.parents >= 0, back.ids[back.parents], -1).tolist()))
    attrs = {int(i): (tree.attrs[0][k].as_py(), tree.attrs[1][k].as_py()) for k, i in enumerate(tree.ids)}
    assert attrs == {int(i): (back.attrs[0][k].as_py(), back.attrs[1][k].as_py()) for k, i in enumerate(back.ids)}
    # every leaf on the last level, level by level
    assert (np.diff(back.levels) >= 0).all() and set(back.ids[back.level_starts[-2] :]) == set(ids.tolist())
    predict = (tmp_path / "predict_edge_table.txt").read_text().splitlines()
    assert predict[1] == f"-1\t{tree.ids[0]}\t1.0" and len(predict) == 2 + len(tree.ids) - 1


def test_every_item_is_on_the_last_level_with_any_branching():
    for n in (2, 3, 4):
        ids = np.arange(23)
        tree = init_tree(ids, pa.array(["a"] * 23), [], n_cluster=n)
        assert set(tree.ids[tree.level_starts[-2] :]) == set(range(23))
        assert tree.num_levels == math.ceil(math.log(23, n)) + 1
        assert np.diff(tree.children[0]).max() <= n


TZREC_NODES = """id:int64\tweight:float\tfeature:string
-1\t1.0\t-1,7,a
7\t1.0\t0,7,a
8\t1.0\t1,8,a
9\t1.0\t1,9,b
1\t1.0\t2,1,a
2\t1.0\t2,2,a
3\t1.0\t2,3,b
"""
TZREC_EDGES = """src_id:int64\tdst_id:int64\tweight:float
1\t8\t1.0
2\t8\t1.0
3\t9\t1.0
"""


def test_reads_torcheasyrecs_tables(tmp_path):
    (tmp_path / "n.txt").write_text(TZREC_NODES)
    (tmp_path / "e.txt").write_text(TZREC_EDGES)
    tree = read_tree(str(tmp_path / "n.txt"), str(tmp_path / "e.txt"), 1)
    assert tree.ids.tolist() == [7, 8, 9, 1, 2, 3] and tree.levels.tolist() == [0, 1, 1, 2, 2, 2]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert tree.attrs[0].to_pylist() == ["a", "a", "b", "a", "a", "b"]
    assert tree.leaf_nodes(np.array([3, 1, 5])).tolist() == [5, 3, -1]
    assert tree.paths[5].tolist() == [0, 2, 5]


@pytest.mark.parametrize(
    "nodes, edges, message",
    [
        (TZREC_NODES.replace("1,9,b", "1,9"), TZREC_EDGES, r"n\.txt, node 9: 2 value\(s\) in its feature, expected 3"),
        (TZREC_NODES, TZREC_EDGES.replace("3\t9", "3\t5"), r"e\.txt: edge target 5 is no node"),
        (TZREC_NODES, TZREC_EDGES.replace("3\t9\t1.0\n", ""), r"e\.txt: leaf 3 has no ancestor on level 1"),
        (TZREC_NODES, TZREC_EDGES + "1\t9\t1.0\n", r"leaf 1 has two ancestors on level 1"),
        (TZREC_NODES, TZREC_EDGES.replace("1\t8", "8\t1"), r"its source is on level 1, not the last level 2"),
        (TZREC_NODES.replace("0,7,a", "1,7,a"), TZREC_EDGES, r"one node on level 0 \(the root\), found 0"),
        (TZREC_NODES.replace("2\t1.0\t2,2,a", "2\t-1\t2,2,a"), TZREC_EDGES, r"weight is not a number >= 0"),
    ],
)
def test_a_broken_table_is_named(tmp_path, nodes, edges, message):
    (tmp_path / "n.txt").write_text(nodes)
    (tmp_path / "e.txt").write_text(edges)
    with pytest.raises(TreeError, match=message):
        read_tree(str(tmp_path / "n.txt"), str(tmp_path / "e.txt"), 1)


def test_two_parents_are_refused(tmp_path):
    """Node 5 (level 2) under 8 by leaf 1's edges and under 9 by leaf 2's."""
    (tmp_path / "n.txt").write_text(
        "id:int64\tweight:float\tfeature:string\n7\t1\t0,7,a\n8\t1\t1,8,a\n9\t1\t1,9,a\n5\t1\t2,5,a\n"
        "1\t1\t3,1,a\n2\t1\t3,2,a\n"
    )
    (tmp_path / "e.txt").write_text("src_id:int64\tdst_id:int64\tweight:float\n1\t5\t1\n1\t8\t1\n2\t5\t1\n2\t9\t1\n")
    with pytest.raises(TreeError, match=r"node 5 has two parents"):
        read_tree(str(tmp_path / "n.txt"), str(tmp_path / "e.txt"), 1)


def test_balanced_split_is_torcheasyrecs_rule():
    """k-means clusters cut to ``M // n`` each (their nearest rows), the rest filling the short
    clusters nearest first, what remains to the first."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 0.1, (30, 4)), rng.normal(5, 0.1, (10, 4))]).astype(np.float32)
    parts = balanced_split(x, 2)
    assert sorted(len(p) for p in parts) == [20, 20]
    assert sorted(np.concatenate(parts).tolist()) == list(range(40))
    big = next(p for p in parts if (p < 30).all())  # the 30-cluster keeps 20 of its own rows
    assert len(big) == 20
    x3 = rng.normal(0, 1, (11, 3)).astype(np.float32)
    parts = balanced_split(x3, 3)
    assert sorted(len(p) for p in parts) == [3, 3, 5]  # 11 // 3 each, the remaining two to the first


def test_a_clustered_tree_puts_similar_items_under_one_node():
    rng = np.random.default_rng(1)
    centers = rng.normal(0, 10, (4, 6))
    blob = np.repeat(np.arange(4), 16)
    x = centers[blob] + rng.normal(0, 0.3, (64, 6))
    ids = rng.permutation(1000)[:64]
    tree = cluster_tree(ids, x, [pa.array([f"b{b}" for b in blob])])
    assert tree.num_levels == 7
    paths = tree.paths[tree.leaf_nodes(ids)]
    for b in range(4):  # each blob's 16 items share their level-2 node, and it is theirs alone
        assert len(set(paths[blob == b, 2])) == 1
    assert len(set(paths[:, 2])) == 4
    # an inner node's attribute: its items' blob
    node = paths[blob == 0, 2][0]
    assert tree.attrs[0][node].as_py() == "b0"
    counts = Counter(tree.levels.tolist())
    assert counts[6] == 64


def test_codes_of_an_uneven_clustering_still_put_every_item_on_the_last_level():
    tree = tree_from_codes(np.array([5, 6, 7]), np.array([1, 5, 6]), [], 2)  # 1, and 2's children 5, 6
    assert tree.num_levels == 3
    assert sorted(tree.ids[tree.level_starts[-2] :].tolist()) == [5, 6, 7]
    with pytest.raises(ValueError, match="share a tree code"):
        tree_from_codes(np.array([5, 6]), np.array([1, 3]), [], 2)  # 1 pulled down onto 3
