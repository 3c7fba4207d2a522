"""TDM's layer-wise samples (dynarec/data/tdm_sampler.py) and the batches they make: each row's
ancestors and per-level negatives laid out as TorchEasyRec's ``TDMSampler.get``, drawn by weight
without replacement; the built batch equals TorchEasyRec's ``expand_tdm_sample`` (written out
below) of the same draws, featurized; what a bad tree or row is told."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dynarec.config import config_from_dict
from dynarec.data.batch import BatchBuilder, DataError, _draw_key
from dynarec.data.tdm_sampler import TDMSampler
from dynarec.data.tree import TreeError, init_tree, write_tree

ITEMS = 64  # a binary tree of 7 levels


def tree_dir(root, weights=None):
    ids = np.arange(ITEMS)
    cats = pa.array([f"c{i // 8}" for i in ids])
    tree = init_tree(ids, cats, [cats])
    if weights is not None:
        tree = type(tree)(tree.ids, tree.levels, tree.parents, weights(tree), tree.attrs)
    write_tree(tree, root / "tree")
    return tree


def sampler_cfg(root, **kw) -> dict:
    return {
        "item_input_path": str(root / "tree" / "node_table.txt"),
        "edge_input_path": str(root / "tree" / "edge_table.txt"),
        "item_id_field": "item_id",
        "attr_fields": ["cate"],
        "layer_num_sample": [0, 1, 1, 2, 3, 4, 5],
        **kw,
    }


def config(root, **sampler) -> dict:
    return {
        "feature_configs": [
            {"id_feature": {"feature_name": "item_id", "embedding_dim": 4, "num_buckets": 256}},
            {"id_feature": {"feature_name": "cate", "embedding_dim": 4, "hash_bucket_size": 50}},
            {
                "sequence_feature": {
                    "feature_name": "hist",
                    "sequence_length": 5,
                    "embedding_dim": 4,
                    "num_buckets": 256,
                }
            },
            {"id_feature": {"feature_name": "user", "embedding_dim": 4, "num_buckets": 100}},
            # a feature of a user column and an item column: computed over each sampled row
            {
                "combo_feature": {
                    "feature_name": "user_cate",
                    "expression": ["user:user", "item:cate"],
                    "hash_bucket_size": 97,
                    "embedding_dim": 4,
                }
            },
            {  # and one reading a row-side feature's output with an item column
                "combo_feature": {
                    "feature_name": "uid_cate",
                    "expression": ["feature:user", "item:cate"],
                    "hash_bucket_size": 97,
                    "embedding_dim": 4,
                }
            },
        ],
        "model": {
            "feature_groups": [
                {"group_name": "seq", "group_type": "sequence", "feature_names": ["item_id", "hist"]},
                {"group_name": "other", "feature_names": ["user", "cate", "user_cate", "uid_cate"]},
            ],
            "tdm": {"multiwindow_din": {"windows_len": [2, 3]}, "final_hidden_units": [8]},
        },
        "data": {
            "train_input_path": str(root / "train.parquet"),
            "label_field": "clk",
            "batch_size": 8,
            "num_workers": 0,
            "tdm_sampler": sampler_cfg(root, **sampler),
        },
        "train": {"sparse_optimizer": {"adagrad_optimizer": {"lr": 0.1}}, "num_epochs": 1},
    }


def rows(n=8, seed=0) -> pa.Table:
    rng = np.random.default_rng(seed)
    items = rng.integers(0, ITEMS, n)
    return pa.table(
        {
            "item_id": items,
            "cate": [f"c{i // 8}" for i in items],
            "hist": ["|".join(map(str, rng.integers(0, ITEMS, k))) for k in rng.integers(1, 6, n)],
            "user": rng.integers(0, 100, n),
            "clk": np.ones(n, np.int64),
        }
    )


def test_a_row_gets_its_ancestors_and_per_level_negatives_in_torcheasyrecs_layout(tmp_path):
    tree_dir(tmp_path)
    cfg = config_from_dict(config(tmp_path)).data.tdm_sampler
    sampler = TDMSampler(cfg)
    tree = sampler.tree  # (as read: each level's nodes by id)
    items = np.array([5, 63, 5])
    leaves = tree.leaf_nodes(items)
    s = sampler.sample(leaves, "k")
    b, inner = 3, tree.num_levels - 2
    per_row = sum(cfg.layer_num_sample[1:])
    assert len(s.rows) == b * inner + b * per_row
    # positives: each row's ancestors on levels 1 .. L-2, in level order, rows in batch order
    pos = s.nodes[: b * inner].reshape(b, inner)
    assert np.array_equal(pos, tree.paths[leaves][:, 1:-1])
    assert np.array_equal(s.rows[: b * inner], np.repeat(np.arange(b), inner))
    assert (s.labels[: b * inner] == 1).all() and (s.labels[b * inner :] == 0).all()
    # negatives: a row's, level after level, each of its level, distinct, not the row's own node
    neg = s.nodes[b * inner :].reshape(b, per_row)
    assert np.array_equal(s.rows[b * inner :], np.repeat(np.arange(b), per_row))
    start = 0
    for level in range(1, tree.num_levels):
        k = cfg.layer_num_sample[level]
        block = neg[:, start : start + k]
        start += k
        assert (tree.levels[block] == level).all()
        for r in range(b):
            assert len(set(block[r])) == k and tree.paths[leaves[r], level] not in block[r]


def test_draws_are_by_weight_without_replacement(tmp_path):
    """Level 2's four nodes weighted 1, 2, 3, 4: two negatives of a row whose own node is the
    first. Successive draws by weight without replacement give each pair {a, b} probability
    w_a / W (w_b / (W - w_a)) + w_b / W (w_a / (W - w_b)) over the three others (W their sum)."""

    def weights(tree):
        w = np.ones(len(tree.ids))
        w[tree.level_starts[2] : tree.level_starts[3]] = [1.0, 2.0, 3.0, 4.0]
        return w

    tree_dir(tmp_path, weights)
    cfg = config_from_dict(config(tmp_path, layer_num_sample=[0, 1, 2, 0, 0, 0, 0])).data.tdm_sampler
    sampler = TDMSampler(cfg)
    tree = sampler.tree
    first = tree.level_starts[2]
    own_leaf = next(i for i in range(tree.level_starts[-2], len(tree.ids)) if tree.paths[i, 2] == first)
    n = 20_000
    s = sampler.sample(np.full(n, own_leaf), "w")
    level2 = s.nodes[s.labels == 0].reshape(n, -1)[:, 1:3] - first
    assert (level2 != 0).all() and (level2[:, 0] != level2[:, 1]).all()
    got = {pair: 0 for pair in itertools.combinations([1, 2, 3], 2)}
    for a, b in np.sort(level2, axis=1):
        got[(int(a), int(b))] += 1
    w = {1: 2.0, 2: 3.0, 3: 4.0}
    total = sum(w.values())
    for (a, b), count in got.items():
        p = w[a] / total * w[b] / (total - w[a]) + w[b] / total * w[a] / (total - w[b])
        assert abs(count / n - p) < 4 * np.sqrt(p * (1 - p) / n), ((a, b), count / n, p)


def test_draws_depend_on_the_key_alone(tmp_path):
    tree_dir(tmp_path)
    sampler = TDMSampler(config_from_dict(config(tmp_path)).data.tdm_sampler, seed=3)
    leaves = np.arange(sampler.tree.level_starts[-2], sampler.tree.level_starts[-2] + 4)
    a, b = sampler.sample(leaves, "f:0"), sampler.sample(leaves, "f:0")
    assert np.array_equal(a.nodes, b.nodes)
    assert not np.array_equal(a.nodes, sampler.sample(leaves, "f:8").nodes)


@pytest.mark.parametrize("kind", ["UNIFORM", "ARITHMETIC", "RECIPROCAL"])
def test_remain_ratio_keeps_that_share_of_the_inner_levels_and_always_the_leaves(tmp_path, kind):
    tree_dir(tmp_path)
    cfg = config_from_dict(config(tmp_path, remain_ratio=0.4, probability_type=kind)).data.tdm_sampler
    sampler = TDMSampler(cfg)
    tree = sampler.tree
    leaves = tree.leaf_nodes(np.array([1, 2]))
    seen = np.zeros(tree.num_levels)
    for key in range(300):
        s = sampler.sample(leaves, str(key))
        levels = tree.levels[s.nodes[s.labels == 1]].reshape(2, -1)[0]
        assert len(levels) == round(0.4 * 5) and (np.diff(levels) > 0).all()
        seen[levels] += 1
        negatives = tree.levels[s.nodes[s.labels == 0]]
        assert set(negatives[negatives < tree.num_levels - 1]) <= set(levels)
        assert (negatives == tree.num_levels - 1).sum() == 2 * cfg.layer_num_sample[-1]
    kept = seen[1:-1] / seen[1:-1].sum()
    if kind == "UNIFORM":
        assert np.allclose(kept, 0.2, atol=0.06)
    else:  # deeper levels kept more often
        assert kept[-1] > kept[0] + 0.1


def expand_tdm_sample(table: pa.Table, samples, tree, cfg) -> pa.Table:
    """TorchEasyRec's ``expand_tdm_sample`` of the same draws: the item columns of the sampled
    rows from the node table, the others copied from their rows, labels 1 and 0 after the batch's."""
    take = pa.array(samples.rows)
    out = {}
    for name in table.schema.names:
        column = table.column(name).combine_chunks()
        if name == cfg.item_id_field:
            extra = pa.array(tree.ids[samples.nodes])
        elif name in cfg.attr_fields:
            extra = tree.attrs[cfg.attr_fields.index(name)].take(pa.array(samples.nodes))
        elif name == "clk":
            extra = pa.array(samples.labels.astype(np.int64))
        else:
            extra = column.take(take)
        out[name] = pa.concat_arrays([column, extra.cast(column.type)])
    return pa.table(out)


def test_the_batch_is_torcheasyrecs_expansion_of_the_draws_featurized(tmp_path):
    tree_dir(tmp_path)
    config_obj = config_from_dict(config(tmp_path))
    table = rows(8)
    pq.write_table(table, tmp_path / "train.parquet")
    builder = BatchBuilder(config_obj, tree_samples=True)
    tree = builder.tdm.tree
    batch = builder.build(table, str(tmp_path / "train.parquet"))
    key = f"{_draw_key(str(tmp_path / 'train.parquet'))}:0"  # the batch's position
    samples = builder.tdm.sample(tree.leaf_nodes(table.column("item_id").to_numpy()), key)
    expanded = expand_tdm_sample(table, samples, tree, config_obj.data.tdm_sampler)
    plain = BatchBuilder(config_obj).build(expanded, "expanded")
    assert batch.num_rows == plain.num_rows == 8 + len(samples.rows)
    assert batch.sparse.keys() == plain.sparse.keys()
    assert np.array_equal(batch.sparse.lengths().numpy(), plain.sparse.lengths().numpy())
    assert np.array_equal(batch.sparse.values().numpy(), plain.sparse.values().numpy())
    assert np.array_equal(batch.labels.numpy(), plain.labels.numpy())


def test_no_samples_without_labels_or_outside_training_data(tmp_path):
    tree_dir(tmp_path)
    config_obj = config_from_dict(config(tmp_path))
    table = rows(8)
    assert BatchBuilder(config_obj, with_labels=False, tree_samples=True).build(table, "x").num_rows == 8
    assert BatchBuilder(config_obj).build(table, "x").num_rows == 8


def test_an_item_outside_the_tree_is_named_by_its_row(tmp_path):
    tree_dir(tmp_path)
    table = rows(8).set_column(0, "item_id", pa.array([1, 2, 3, 99, 4, 5, 6, 7]))
    builder = BatchBuilder(config_from_dict(config(tmp_path)), tree_samples=True)
    with pytest.raises(DataError, match=r"f\.parquet, row 3: item 99 \(column 'item_id'\) is no leaf of the tree"):
        builder.build(table, "f.parquet")


def test_layer_num_sample_must_fit_the_tree(tmp_path):
    tree_dir(tmp_path)
    with pytest.raises(TreeError, match=r"layer_num_sample: 6 entries, but the tree of .* has 7 levels"):
        TDMSampler(config_from_dict(config(tmp_path, layer_num_sample=[0, 1, 1, 1, 1, 1])).data.tdm_sampler)
    with pytest.raises(TreeError, match=r"layer_num_sample\[2\]: 4 negatives, but level 2 .* has 4 node\(s\), 3"):
        TDMSampler(config_from_dict(config(tmp_path, layer_num_sample=[0, 1, 4, 1, 1, 1, 1])).data.tdm_sampler)
    with pytest.raises(ValueError, match=r"layer_num_sample\[0\]: the root level has no negatives"):
        config_from_dict(config(tmp_path, layer_num_sample=[1, 1, 1, 1, 1, 1, 1]))


def test_a_fixed_item_table_must_hold_the_inner_nodes_ids(tmp_path):
    tree_dir(tmp_path)  # 64 items 0..63: inner nodes 64 + code, up to 64 + 62
    c = config(tmp_path)
    c["feature_configs"][0]["id_feature"]["num_buckets"] = 100
    with pytest.raises(
        ValueError, match=r"feature 'item_id': num_buckets 100, but the tree of .* has node ids up to 126"
    ):
        BatchBuilder(config_from_dict(c), tree_samples=True)
