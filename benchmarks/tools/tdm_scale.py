"""TDM at a larger scale than the tests: a generated log of users with tastes over many items,
the user's path (init-tree, train, export, beam-search retrieve) and two references: the same
exported model scoring every item (exhaustive top-k: how much of the model's own top-k the beam
search finds) and the most popular training items (what a model must beat).

    python benchmarks/tools/tdm_scale.py --items 4096 --tastes 64 --train-rows 60000 --device cpu

Prints one JSON line: recall@k of beam search, of the exhaustive top-k and of popularity, the
beam search's overlap with the exhaustive top-k, training samples/s and retrieval users/s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dynarec.config import config_from_dict
from dynarec.data.batch import BatchBuilder
from dynarec.data.tree import init_tree, write_tree
from dynarec.serving import ExportedModel
from dynarec.tdm import BeamSearch, config_tree
from dynarec.train.export import export_model
from dynarec.train.trainer import Trainer


def write_log(path: Path, n: int, items: int, tastes: int, seed: int) -> None:
    """Users of ``tastes`` tastes (consecutive item ranges); a history of 1-20 items of the taste;
    the clicked item of the taste, Zipf-popular within it."""
    rng = np.random.default_rng(seed)
    per = items // tastes
    taste = rng.integers(0, tastes, n)
    within = np.minimum(rng.zipf(1.3, n) - 1, per - 1)
    item = taste * per + within
    hist = [
        "|".join(str(int(t * per + x)) for x in np.minimum(rng.zipf(1.3, k) - 1, per - 1))
        for t, k in zip(taste, rng.integers(1, 21, n))
    ]
    cates = (item // max(per // 4, 1)).astype(str)
    pq.write_table(pa.table({"item_id": item, "cate": cates, "hist": hist, "clk": np.ones(n, np.int64)}), path)


def config(root: Path, items: int, levels: int, batch: int) -> dict:
    rows = 4 * items  # the items and the tree's inner nodes (up to the largest item id + 2 items)
    samples = [0] + [min(2**i - 1, 16) for i in range(1, levels)]
    return {
        "feature_configs": [
            {
                "id_feature": {
                    "feature_name": "item_id",
                    "embedding_dim": 16,
                    "num_buckets": rows,
                    "embedding_name": "item",
                }
            },
            {"id_feature": {"feature_name": "cate", "embedding_dim": 8, "hash_bucket_size": 1000}},
            {
                "sequence_feature": {
                    "feature_name": "hist",
                    "sequence_length": 20,
                    "embedding_dim": 16,
                    "num_buckets": rows,
                    "embedding_name": "item",
                }
            },
        ],
        "model": {
            "feature_groups": [
                {"group_name": "seq", "group_type": "sequence", "feature_names": ["item_id", "hist"]},
                {"group_name": "item", "feature_names": ["cate"]},
            ],
            "tdm": {
                "multiwindow_din": {"windows_len": [1, 1, 2, 4, 4, 8]},
                "final_hidden_units": [128, 64, 32],
                "final_batch_norm": True,
            },
        },
        "data": {
            "train_input_path": str(root / "train.parquet"),
            "eval_input_path": str(root / "eval.parquet"),
            "label_field": "clk",
            "batch_size": batch,
            "tdm_sampler": {
                "item_input_path": str(root / "tree" / "node_table.txt"),
                "edge_input_path": str(root / "tree" / "edge_table.txt"),
                "item_id_field": "item_id",
                "attr_fields": ["cate"],
                "layer_num_sample": samples,
            },
        },
        "train": {
            "sparse_optimizer": {"adagrad_optimizer": {"lr": 0.1}},
            "dense_optimizer": {"adam_optimizer": {"lr": 0.002}},
            "num_epochs": 1,
        },
        "eval": {"max_steps": 20},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--items", type=int, default=4096)
    p.add_argument("--tastes", type=int, default=64)
    p.add_argument("--train-rows", type=int, default=60_000)
    p.add_argument("--users", type=int, default=500, help="eval rows retrieved for")
    p.add_argument("--exhaustive-users", type=int, default=200, help="of them, scored against every item too")
    p.add_argument("--k", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tdm-scale-"))
    write_log(root / "train.parquet", args.train_rows, args.items, args.tastes, 0)
    write_log(root / "eval.parquet", args.users, args.items, args.tastes, 1)
    ids = np.arange(args.items)
    cates = pa.array((ids // max(args.items // args.tastes // 4, 1)).astype(str))
    tree = init_tree(ids, cates, [cates])
    write_tree(tree, root / "tree")
    raw = config(root, args.items, tree.num_levels, args.batch_size)
    raw["train"]["num_epochs"] = args.epochs
    cfg = config_from_dict(raw)
    trainer = Trainer(cfg, root / "m", args.device, progress=False)
    start = time.perf_counter()
    report = trainer.fit()
    train_s = time.perf_counter() - start
    model = ExportedModel(export_model(trainer.task, trainer.example_batch(), root / "export"), device=args.device)
    builder = BatchBuilder(model.config, with_labels=False)

    def score(table: pa.Table) -> np.ndarray:
        return model.predict_batch(builder.build(table, "rows"))["probability"].float().cpu().numpy()

    users = pq.read_table(root / "eval.parquet")
    truth = users.column("item_id").to_numpy()
    search = BeamSearch(model.config, config_tree(model.config), score, args.k)
    start = time.perf_counter()
    found = np.concatenate([search.search(users.slice(s, 100)).items for s in range(0, users.num_rows, 100)])
    retrieve_s = time.perf_counter() - start
    # exhaustive: every item scored for every user, by the same model
    catalog = pa.table({"item_id": ids, "cate": cates})
    exhaustive = []
    for u in range(min(users.num_rows, args.exhaustive_users)):
        user = users.slice(u, 1).drop_columns(["item_id", "cate"])
        repeated = {c: user.column(c).take(pa.array(np.zeros(args.items, np.int64))) for c in user.column_names}
        rows = pa.table({**repeated, "item_id": catalog.column("item_id"), "cate": catalog.column("cate")})
        exhaustive.append(ids[np.argsort(-score(rows), kind="stable")[: args.k]])
    best = np.stack(exhaustive)
    clicks = np.bincount(pq.read_table(root / "train.parquet").column("item_id").to_numpy(), minlength=args.items)
    popular = np.argsort(-clicks, kind="stable")[: args.k]
    overlap = np.mean([len(set(a) & set(b)) / args.k for a, b in zip(found, best)])
    head = truth[: len(best)]
    print(
        json.dumps(
            {
                "items": args.items,
                "tree_levels": tree.num_levels,
                "train_rows": args.train_rows,
                "sampled_rows_a_row": 1 + (tree.num_levels - 2) + sum(cfg.data.tdm_sampler.layer_num_sample),
                "eval_auc_sampled_rows": round(report["eval"]["auc"], 4),
                f"recall@{args.k}_beam": float((found == truth[:, None]).any(1).mean()),
                f"recall@{args.k}_beam_same_rows": float((found[: len(best)] == head[:, None]).any(1).mean()),
                f"recall@{args.k}_exhaustive": float((best == head[:, None]).any(1).mean()),
                f"recall@{args.k}_popularity": float(np.isin(truth, popular).mean()),
                "beam_overlap_with_exhaustive_topk": round(float(overlap), 4),
                "train_rows_per_s": round(args.epochs * args.train_rows / train_s, 1),
                "retrieve_users_per_s": round(users.num_rows / retrieve_s, 1),
                "device": args.device,
            }
        )
    )


if __name__ == "__main__":
    main()
