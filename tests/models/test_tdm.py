"""TDM (dynarec/models/tdm.py, dynarec/tdm.py): the multi-window DIN against TorchEasyRec's
``MultiWindowDINEncoder`` (written out below with ``segment_reduce``, as its source); beam search
exact where node scores are their best leaf's; and the user's path end to end through the CLI —
train on the tree's samples, export, retrieve by beam search (recall far above chance on a log
whose users have tastes), cluster a learnt tree from the trained model and train on it."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
import yaml

from dynarec.cli import main
from dynarec.config import config_from_dict
from dynarec.data.tree import init_tree, read_tree, write_tree
from dynarec.models.tdm import MultiWindowDIN
from dynarec.serving import ExportedModel
from dynarec.tdm import BeamSearch, config_tree

ITEMS, TASTES = 256, 8


def tzrec_multiwindow(m: MultiWindowDIN, query, sequence, lengths, windows):
    """TorchEasyRec's MultiWindowDINEncoder.forward with ``m``'s layers."""
    d = sequence.shape[2]
    query = F.pad(query, (0, d - query.shape[1]))
    t = sequence.size(1)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    queries = query.unsqueeze(1).expand(-1, t, -1)
    attn = m.active(m.linear(m.mlp(torch.cat([sequence, queries * sequence, queries], dim=-1))))
    att_sequences = attn * mask.unsqueeze(2) * sequence
    padded = F.pad(att_sequences, (0, 0, 0, sum(windows) - t)).transpose(0, 1)
    result = torch.segment_reduce(padded, reduce="sum", lengths=torch.tensor(windows), axis=0).transpose(0, 1)
    cumsum = torch.tensor(np.cumsum([0, *list(windows)[:-1]]))
    segment = torch.min(lengths.unsqueeze(1) - cumsum.unsqueeze(0), torch.tensor(windows))
    result = result / torch.max(segment, torch.ones_like(segment)).unsqueeze(2)
    return torch.cat([result, query.unsqueeze(1)], dim=1).reshape(result.shape[0], -1)


@pytest.mark.parametrize("length", [3, 6, 9])  # shorter than the windows, as long, longer (cut)
@pytest.mark.parametrize("activation", ["prelu", "relu"])
def test_multiwindow_din_is_torcheasyrecs(length, activation):
    torch.manual_seed(0)
    windows = [1, 2, 3]
    m = MultiWindowDIN(4, windows, [5, 3], activation)
    query, sequence = torch.randn(5, 3), torch.randn(5, length, 4)
    lengths = torch.tensor([0, 1, 3, length, max(length - 2, 0)])
    expected = tzrec_multiwindow(m, query, sequence, lengths, windows)
    got = m(query, sequence, lengths)
    assert got.shape == (5, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_beam_search_is_exact_where_a_node_scores_as_its_best_leaf(tmp_path):
    """Each leaf a random score per user; an inner node the best of its leaves: the beam holds
    the true top-k at every level, so the result is the top-k leaves."""
    rng = np.random.default_rng(0)
    ids = rng.permutation(5000)[:300]
    write_tree(init_tree(ids, pa.array(["c"] * 300), [pa.array(["c"] * 300)], n_cluster=3), tmp_path)
    tree = read_tree(str(tmp_path / "node_table.txt"), str(tmp_path / "edge_table.txt"), 1)
    users = 6
    leaf_scores = rng.random((users, 300))
    first = tree.level_starts[-2]
    best = np.full((users, len(tree.ids)), -np.inf)
    best[:, first:] = leaf_scores
    for level in range(tree.num_levels - 1, 0, -1):
        nodes = np.arange(tree.level_starts[level], tree.level_starts[level + 1])
        for u in range(users):
            np.maximum.at(best[u], tree.parents[nodes], best[u, nodes])
    node_of = {int(i): k for k, i in enumerate(tree.ids)}
    scored = []

    def score(table: pa.Table) -> np.ndarray:
        u = table.column("user").to_numpy()
        nodes = [node_of[int(i)] for i in table.column("item_id").to_pylist()]
        scored.append(len(u))
        return best[u, nodes].astype(np.float32)

    c = config_dict(tmp_path)
    search = BeamSearch(config_from_dict(c), tree, score, k=7)
    found = search.search(pa.table({"user": np.arange(users)}))
    for u in range(users):
        top = np.argsort(-leaf_scores[u])[:7]
        assert found.items[u].tolist() == tree.ids[first + top].tolist()
        np.testing.assert_allclose(found.scores[u], leaf_scores[u][top], rtol=1e-6)
    # level ceil(log3(42)) = 4 of 7: its 81 nodes, then the 14 best's 3 children, then the leaves
    # under the 14 best (300 items of 729 places: fewer)
    assert search.first_level == 4 and scored[:2] == [users * 81, users * 3 * 14] and scored[2] < users * 42


def config_dict(root) -> dict:
    return {
        "feature_configs": [
            {
                "id_feature": {
                    "feature_name": "item_id",
                    "embedding_dim": 8,
                    "num_buckets": 1024,
                    "embedding_name": "item",
                }
            },
            {"id_feature": {"feature_name": "cate", "embedding_dim": 8, "hash_bucket_size": 100}},
            {
                "sequence_feature": {
                    "feature_name": "hist",
                    "sequence_length": 10,
                    "embedding_dim": 8,
                    "num_buckets": 1024,
                    "embedding_name": "item",
                }
            },
            {"id_feature": {"feature_name": "user", "embedding_dim": 4, "num_buckets": 1000}},
        ],
        "model": {
            "feature_groups": [
                {"group_name": "seq", "group_type": "sequence", "feature_names": ["item_id", "hist"]},
                {"group_name": "user", "feature_names": ["user"]},
                {"group_name": "item", "feature_names": ["cate"]},
            ],
            "tdm": {
                "multiwindow_din": {"windows_len": [1, 2, 3, 4]},
                "final_hidden_units": [32, 16],
                "final_batch_norm": True,
            },
        },
        "data": {
            "train_input_path": str(root / "train.parquet"),
            "eval_input_path": str(root / "eval.parquet"),
            "label_field": "clk",
            "batch_size": 64,
            "num_workers": 0,
            "tdm_sampler": {
                "item_input_path": str(root / "tree" / "node_table.txt"),
                "edge_input_path": str(root / "tree" / "edge_table.txt"),
                "item_id_field": "item_id",
                "attr_fields": ["cate"],
                "layer_num_sample": [0, 1, 2, 3, 4, 5, 6, 7, 8],
            },
        },
        "train": {
            "sparse_optimizer": {"adagrad_optimizer": {"lr": 0.1}},
            "dense_optimizer": {"adam_optimizer": {"lr": 0.003}},
            "num_epochs": 2,
        },
    }


def write_log(root, n: int, name: str, seed: int) -> None:
    """Users of 8 tastes (32 items each): a history of 1-10 items of the taste, the clicked
    item one of the taste; the item table: each item's category (16 items a category)."""
    rng = np.random.default_rng(seed)
    taste = rng.integers(0, TASTES, n)
    per = ITEMS // TASTES
    item = taste * per + rng.integers(0, per, n)
    hist = [
        "|".join(str(int(t * per + x)) for x in rng.integers(0, per, k)) for t, k in zip(taste, rng.integers(1, 11, n))
    ]
    table = pa.table(
        {
            "item_id": item,
            "cate": (item // 16).astype(str),
            "hist": hist,
            "user": rng.integers(0, 1000, n),
            "clk": np.ones(n, np.int64),
        }
    )
    pq.write_table(table, root / name)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("tdm")
    write_log(root, 3000, "train.parquet", 0)
    write_log(root, 300, "eval.parquet", 1)
    ids = np.arange(ITEMS)
    pq.write_table(pa.table({"item_id": ids, "cate": (ids // 16).astype(str)}), root / "items.parquet")
    rc = main([
        "tdm", "init-tree", "--items", str(root / "items.parquet"), "--item-id-field", "item_id",
        "--cate-id-field", "cate", "--attr-fields", "cate", "--output-dir", str(root / "tree"),
    ])  # fmt: skip
    assert rc == 0
    (root / "cfg.yaml").write_text(yaml.safe_dump(config_dict(root)))
    assert main(["train", "--config", str(root / "cfg.yaml"), "--model-dir", str(root / "m"), "--no-progress"]) == 0
    assert main(["export", "--model-dir", str(root / "m"), "--export-dir", str(root / "export")]) == 0
    return root


def test_training_rows_are_the_trees_samples_and_learn_them(trained):
    final = json.loads((trained / "m" / "metrics.json").read_text())["final"]
    # each eval row: itself, its 7 ancestors below the root, 36 negatives
    assert final["eval"]["num_examples"] == 300 * (1 + 7 + 36)
    assert final["eval"]["auc"] > 0.9


def test_beam_search_retrieves_the_users_taste(trained, capsys):
    """recall@10: the clicked item among the 10 retrieved. Chance is 10 / 256 = 0.04; knowing the
    taste alone (32 equally likely items) gives 10 / 32 = 0.31 (measured: 0.27 of 300 rows)."""
    out = trained / "recall.parquet"
    rc = main([
        "tdm", "retrieve", "--export-dir", str(trained / "export"), "--input", str(trained / "eval.parquet"),
        "--output", str(out), "--recall-num", "10", "--batch-size", "100",
    ])  # fmt: skip
    assert rc == 0
    line = capsys.readouterr().out
    recall = float(line.rsplit(":", 1)[1])
    assert recall > 0.2, line
    table = pq.read_table(out)
    ids = np.array(table.column("recall_ids").to_pylist())
    scores = np.array(table.column("recall_scores").to_pylist())
    assert ids.shape == (300, 10) and (np.diff(scores, axis=1) <= 0).all()
    assert np.isin(ids, np.arange(ITEMS)).all() and all(len(set(r)) == 10 for r in ids)
    truth = table.column("item_id").to_numpy()
    assert recall == pytest.approx((ids == truth[:, None]).any(axis=1).mean(), abs=1e-4)
    # the retrieved items are mostly of the row's taste
    assert ((ids // (ITEMS // TASTES)) == (truth // (ITEMS // TASTES))[:, None]).mean() > 0.6


def test_beam_search_scores_are_the_exported_models(trained):
    model = ExportedModel(trained / "export")
    tree = config_tree(model.config)
    users = pq.read_table(trained / "eval.parquet").slice(0, 5)
    from dynarec.data.batch import BatchBuilder

    builder = BatchBuilder(model.config, with_labels=False)

    def score(table):
        return model.predict_batch(builder.build(table, "rows"))["probability"].numpy()

    found = BeamSearch(model.config, tree, score, 4).search(users)
    rows = users.take(pa.array(np.repeat(np.arange(5), 4)))
    rows = rows.set_column(0, "item_id", pa.array(found.items.reshape(-1)))
    cate = pa.array((found.items.reshape(-1) // 16).astype(str))  # a leaf's attribute: its own category
    rows = rows.set_column(rows.schema.get_field_index("cate"), "cate", cate)
    np.testing.assert_allclose(score(rows), found.scores.reshape(-1), rtol=1e-6)


def test_a_learnt_tree_clusters_the_trained_items_and_trains(trained, capsys):
    rc = main([
        "tdm", "cluster-tree", "--model-dir", str(trained / "m"), "--config", str(trained / "cfg.yaml"),
        "--output-dir", str(trained / "learnt"),
    ])  # fmt: skip
    assert rc == 0
    assert "clustered the 256 items' 8-wide embeddings" in capsys.readouterr().out
    learnt = read_tree(str(trained / "learnt" / "node_table.txt"), str(trained / "learnt" / "edge_table.txt"), 1)
    assert learnt.num_levels == 9 and sorted(learnt.ids[learnt.level_starts[-2] :].tolist()) == list(range(ITEMS))
    # items of a taste lie close in the learnt tree: a level-3 node's 32 items are mostly of one
    # taste (by chance about a fifth would be)
    paths = learnt.paths[learnt.leaf_nodes(np.arange(ITEMS))]
    majority = [np.bincount(np.nonzero(paths[:, 3] == n)[0] // 32).max() / 32 for n in set(paths[:, 3].tolist())]
    assert np.mean(majority) > 0.5, majority
    c = config_dict(trained)
    c["data"]["tdm_sampler"]["item_input_path"] = str(trained / "learnt" / "node_table.txt")
    c["data"]["tdm_sampler"]["edge_input_path"] = str(trained / "learnt" / "edge_table.txt")
    c["train"]["num_epochs"] = 1
    (trained / "learnt.yaml").write_text(yaml.safe_dump(c))
    assert (
        main(["train", "--config", str(trained / "learnt.yaml"), "--model-dir", str(trained / "m2"), "--no-progress"])
        == 0
    )


def test_a_tdm_model_needs_its_sampler_and_one_sequence_group(tmp_path):
    c = config_dict(tmp_path)
    del c["data"]["tdm_sampler"]
    with pytest.raises(
        ValueError, match=r"model\.tdm: trains on its tree's layer-wise samples: give data\.tdm_sampler"
    ):
        config_from_dict(c)
    c = config_dict(tmp_path)
    c["model"]["feature_groups"][1]["group_type"] = "sequence"
    with pytest.raises(ValueError, match=r"tdm: reads one sequence group"):
        config_from_dict(c)


def test_the_training_loss_is_the_mean_over_the_batchs_and_its_samples_rows(tmp_path):
    """A batch of 64 rows trains on 64 x 44 (the rows, 7 ancestors, 36 negatives): the loss is
    the binary cross-entropy's mean over all of them (TorchEasyRec's, over the expanded batch),
    not their sum over the 64."""
    from dynarec.train.trainer import Trainer

    write_log(tmp_path, 64, "train.parquet", 0)
    ids = np.arange(ITEMS)
    cats = pa.array((ids // 16).astype(str))
    write_tree(init_tree(ids, cats, [cats]), tmp_path / "tree")
    trainer = Trainer(config_from_dict(config_dict(tmp_path)), tmp_path / "m", progress=False)
    dataset = trainer.input.dataset(str(tmp_path / "train.parquet"), 64, training=True)
    batch = next(iter(trainer.input.loader(dataset)))
    assert batch.num_rows == 64 * 44
    seen = []
    trainer.task.dense.register_forward_hook(lambda module, args, out: seen.append(out.detach()))
    loss = trainer.train_step(batch, 64)
    expected = F.binary_cross_entropy_with_logits(seen[0], batch.labels[:, 0])
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)


def test_init_tree_reads_csv_ids_and_attributes_as_strings_and_joins_list_attributes(tmp_path, capsys):
    (tmp_path / "items.csv").write_text("item_id,cate,brand\n1,007,10\n2,007,11\n3,010,1e3\n")
    rc = main([
        "tdm", "init-tree", "--items", str(tmp_path / "items.csv"), "--item-id-field", "item_id",
        "--cate-id-field", "cate", "--attr-fields", "cate,brand", "--output-dir", str(tmp_path / "t"),
    ])  # fmt: skip
    assert rc == 0 and "wrote the tree of 3 items" in capsys.readouterr().out
    tree = read_tree(str(tmp_path / "t" / "node_table.txt"), str(tmp_path / "t" / "edge_table.txt"), 2)
    leaves = {int(i): (tree.attrs[0][k].as_py(), tree.attrs[1][k].as_py()) for k, i in enumerate(tree.ids)}
    assert leaves[1] == ("007", "10") and leaves[3] == ("010", "1e3")  # as the data's strings
    pq.write_table(
        pa.table({"item_id": [1, 2], "cate": ["a", "b"], "tags": [["x", "y"], ["z"]]}), tmp_path / "i.parquet"
    )
    rc = main([
        "tdm", "init-tree", "--items", str(tmp_path / "i.parquet"), "--item-id-field", "item_id",
        "--cate-id-field", "cate", "--attr-fields", "tags", "--output-dir", str(tmp_path / "t2"),
    ])  # fmt: skip
    assert rc == 0
    tree = read_tree(str(tmp_path / "t2" / "node_table.txt"), str(tmp_path / "t2" / "edge_table.txt"), 1)
    assert tree.attrs[0][tree.leaf_nodes(np.array([1]))[0]].as_py() == "x\x1dy"  # TorchEasyRec's multival_sep


def test_tdm_commands_name_bad_arguments(trained, tmp_path, capsys):
    args = ["tdm", "retrieve", "--export-dir", str(trained / "export"), "--input", str(trained / "eval.parquet")]
    assert main([*args, "--output", str(tmp_path / "r.parquet"), "--recall-num", "10", "--batch-size", "0"]) == 2
    assert "--batch-size: at least 1 user row, got 0" in capsys.readouterr().err
    assert main([*args, "--output", str(tmp_path / "r.parquet"), "--recall-num", "300"]) == 2
    assert "recall_num 300: the tree holds 256 items" in capsys.readouterr().err
    rc = main([
        "tdm", "init-tree", "--items", str(trained / "items.parquet"), "--item-id-field", "item_id",
        "--cate-id-field", "cate", "--n-cluster", "1", "--output-dir", str(tmp_path / "t"),
    ])  # fmt: skip
    assert rc == 2 and "branching factor is at least 2, got 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "ids, message",
    [
        ([3, -1, 4], "row 1: column 'item_id' (--item-id-field): item id -1 is negative; item ids are 0 or more"),
        ([3, 4, -5], "row 2: column 'item_id' (--item-id-field): item id -5 is negative"),
        ([3, None, 4], "row 1: column 'item_id' (--item-id-field): the item id is empty"),
        (["3", "x", "4"], "row 1: column 'item_id' (--item-id-field): 'x' is not a whole number"),
    ],
)
def test_init_tree_names_the_row_of_an_item_id_it_cannot_take(tmp_path, capsys, ids, message):
    """An id of -1 (graph-learn's handle of the root) made a tree no training could read; a
    null id was numpy's 'cannot convert float NaN to integer'. Each is named by file and row."""
    items = tmp_path / "items.parquet"
    pq.write_table(pa.table({"item_id": ids, "cate": ["a", "b", "c"]}), items)
    rc = main([
        "tdm", "init-tree", "--items", str(items), "--item-id-field", "item_id", "--cate-id-field", "cate",
        "--output-dir", str(tmp_path / "t"),
    ])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and f"{items}, {message}" in err, err
    assert not (tmp_path / "t").exists()


def test_make_data_will_not_write_half_of_a_users_tree(tmp_path):
    from dynarec.data.generate import GenerateSpec, make_config_data

    c = config_dict(tmp_path)
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "node_table.txt").write_text("a user's node table\n")
    with pytest.raises(ValueError, match="item_input_path exists outside the data directory but edge_input_path"):
        make_config_data(config_from_dict(c), tmp_path / "d", GenerateSpec(train_rows=50, eval_rows=20))
    assert (tmp_path / "tree" / "node_table.txt").read_text() == "a user's node table\n"


def test_a_score_that_is_not_a_number_on_a_sampled_row_names_the_row_it_was_sampled_for(tmp_path):
    from dynarec.train.trainer import Trainer

    write_log(tmp_path, 64, "train.parquet", 0)
    write_log(tmp_path, 20, "eval.parquet", 1)
    ids = np.arange(ITEMS)
    cats = pa.array((ids // 16).astype(str))
    write_tree(init_tree(ids, cats, [cats]), tmp_path / "tree")
    trainer = Trainer(config_from_dict(config_dict(tmp_path)), tmp_path / "m", progress=False)
    forward = trainer.task.forward

    def nan_on_a_sampled_row_of_row_13(batch, *args, **kwargs):
        out = forward(batch, *args, **kwargs).clone()
        sampled = torch.nonzero(batch.source_rows == 13).flatten()
        out[sampled[1]] = float("nan")  # (sampled[0] is row 13 itself)
        return out

    trainer.task.forward = nan_on_a_sampled_row_of_row_13
    with pytest.raises(ValueError, match=r"eval\.parquet, row 13: the model's .* is nan \(1 of 20 rows"):
        trainer.evaluate(str(tmp_path / "eval.parquet"))


def test_a_tdm_model_keeps_its_tree_when_another_is_written_where_it_was(trained, tmp_path, capsys):
    """A TDM model's node ids mean the nodes of the tree it was trained on. Its export read the
    tree where the config points, so another tree written there (a learnt one, `init-tree` again)
    silently changed what `tdm retrieve` returned (never-trained node rows), and checkpoints
    evaluated or resumed on it. The export keeps a copy of the tree; a checkpoint records the
    tree's SHA-256 and refuses another; cluster-tree will not write over the model's tree."""

    def retrieve(out):
        argv = ["tdm", "retrieve", "--export-dir", str(trained / "export"), "--input", str(trained / "eval.parquet")]
        assert main([*argv, "--output", str(out), "--recall-num", "10"]) == 0
        return pq.read_table(out)

    tree_dir = trained / "tree"
    kept = {name: (tree_dir / name).read_bytes() for name in ("node_table.txt", "edge_table.txt")}
    before = retrieve(tmp_path / "before.parquet")
    capsys.readouterr()
    cluster = ["tdm", "cluster-tree", "--model-dir", str(trained / "m"), "--config", str(trained / "cfg.yaml")]
    assert main([*cluster, "--output-dir", str(tree_dir)]) == 2
    assert (
        "holds the tree" in capsys.readouterr().err
        and (tree_dir / "node_table.txt").read_bytes() == kept["node_table.txt"]
    )
    try:
        rc = main([
            "tdm", "init-tree", "--items", str(trained / "items.parquet"), "--item-id-field", "item_id",
            "--cate-id-field", "cate", "--attr-fields", "cate", "--n-cluster", "4", "--output-dir", str(tree_dir),
        ])  # fmt: skip
        assert rc == 0 and (tree_dir / "node_table.txt").read_bytes() != kept["node_table.txt"]
        after = retrieve(tmp_path / "after.parquet")
        assert after.column("recall_ids").to_pylist() == before.column("recall_ids").to_pylist()
        assert after.column("recall_scores").to_pylist() == before.column("recall_scores").to_pylist()
        capsys.readouterr()
        assert main(["evaluate", "--model-dir", str(trained / "m"), "--config", str(trained / "cfg.yaml")]) == 2
        err = capsys.readouterr().err
        assert "was trained on the TDM tree" in err and "give it that tree again, or train a new model" in err, err
    finally:
        for name, data in kept.items():
            (tree_dir / name).write_bytes(data)
