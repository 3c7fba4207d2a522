"""``dynarec make-data``: a synthetic click log with a hidden ground truth.

Users and items are Zipf-popular; every item has a category; every user has a few interest
categories, a bias, and a behaviour history drawn mostly from those interests. The click
probability rewards history-candidate affinity — the fraction of the history in the candidate's
category, and the candidate itself appearing in the history — plus user and item biases and a
price effect, so AUC is meaningful and DIN's attention has something to learn. The true click
probabilities give the Bayes-optimal AUC of the held-out split, written to ``meta.json``.

A second label, ``buy``, makes it a multi-task log: a purchase follows a click (``buy <= clk``,
a few percent of the rows) with its own probability, which leans on the click's history affinity
even more (learnable from the many clicks, hard from the few purchases alone) and has a per-user
propensity of its own. Its draws come from their own
random stream, so the other columns are the same with or without it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dynarec.files import fsync_tree, relative_files, replace_dir
from dynarec.metrics import auc

__all__ = ["SyntheticSpec", "make_click_log"]


@dataclass
class SyntheticSpec:
    train_rows: int = 200_000
    eval_rows: int = 40_000
    train_files: int = 4
    num_users: int = 20_000
    num_items: int = 5_000
    num_cates: int = 50
    interests_per_user: int = 2
    max_hist_len: int = 30
    min_hist_len: int = 3
    zipf_a: float = 1.1
    seed: int = 0
    string_ids: bool = False
    """Items and categories as strings (``i42``, ``c7``), in the candidate columns and the
    histories alike, as in Taobao's logs; by default they are integers (the demo's ``num_buckets``
    tables take them as rows). The same draws either way: only the ids' spelling differs."""


def _zipf_probs(n: int, a: float, rng: np.random.Generator) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1) ** a
    p = p[rng.permutation(n)]  # popular ids are not the small ones
    return p / p.sum()


def _spelled(ids: np.ndarray, prefix: str) -> pa.Array:
    """``ids`` as strings: ``prefix`` and the decimal digits."""
    digits = pc.cast(pa.array(ids), pa.string())
    return pc.binary_join_element_wise(prefix, digits, "") if prefix else digits


class _World:
    def __init__(self, s: SyntheticSpec, rng: np.random.Generator):
        self.s = s
        self.item_cate = rng.integers(0, s.num_cates, s.num_items)
        self.item_pop = _zipf_probs(s.num_items, s.zipf_a, rng)
        self.user_pop = _zipf_probs(s.num_users, s.zipf_a, rng)
        self.user_interest = rng.integers(0, s.num_cates, (s.num_users, s.interests_per_user))
        self.user_bias = rng.normal(0, 0.4, s.num_users)
        self.user_age = rng.integers(0, 8, s.num_users)
        self.item_bias = rng.normal(0, 0.4, s.num_items)
        self.item_price = np.exp(rng.normal(3.0, 0.8, s.num_items))
        # Sampling an item of a given category by popularity: one global CDF, category-major.
        order = np.lexsort((np.arange(s.num_items), self.item_cate))
        self.items_by_cate = order
        cate_sorted = self.item_cate[order]
        p = self.item_pop[order]
        totals = np.bincount(cate_sorted, weights=p, minlength=s.num_cates)
        within = np.cumsum(p) - np.concatenate([[0], np.cumsum(totals)[:-1]])[cate_sorted]
        self.cdf = cate_sorted + within / totals[cate_sorted]
        # The purchase's own draws (a separate stream: the click log's draws are unchanged).
        self.buy_rng = np.random.default_rng([s.seed, 1])
        self.user_buy_bias = self.buy_rng.normal(0, 0.6, s.num_users)

    def items_in(self, cates: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        u = cates + rng.random(cates.size) * (1 - 1e-12)
        idx = np.minimum(np.searchsorted(self.cdf, u), self.s.num_items - 1)
        return self.items_by_cate[idx]

    def rows(self, n: int, rng: np.random.Generator) -> tuple[pa.Table, np.ndarray]:
        s = self.s
        users = rng.choice(s.num_users, n, p=self.user_pop)
        lengths = rng.integers(s.min_hist_len, s.max_hist_len + 1, n)
        owner = np.repeat(users, lengths)
        from_interest = rng.random(owner.size) < 0.8
        cates = np.where(
            from_interest,
            self.user_interest[owner, rng.integers(0, s.interests_per_user, owner.size)],
            rng.integers(0, s.num_cates, owner.size),
        )
        hist = self.items_in(cates, rng)
        hist_cate = self.item_cate[hist]
        cand_interest = rng.random(n) < 0.5
        cand_cate = np.where(
            cand_interest,
            self.user_interest[users, rng.integers(0, s.interests_per_user, n)],
            rng.integers(0, s.num_cates, n),
        )
        cand = self.items_in(cand_cate, rng)
        cand_cate = self.item_cate[cand]
        row = np.repeat(np.arange(n), lengths)
        same_cate = np.bincount(row, weights=(hist_cate == cand_cate[row]), minlength=n) / lengths
        in_hist = np.bincount(row, weights=(hist == cand[row]), minlength=n) > 0
        price = self.item_price[cand] * np.exp(rng.normal(0, 0.1, n))
        logit = (
            -1.6
            + 3.5 * same_cate
            + 1.0 * in_hist
            + self.user_bias[users]
            + self.item_bias[cand]
            - 0.4 * (np.log(price) - 3.0)
        )
        p = 1.0 / (1.0 + np.exp(-logit))
        clk = (rng.random(n) < p).astype(np.int64)
        buy_logit = -3.3 + 3.0 * same_cate + 1.0 * in_hist + self.user_buy_bias[users] - 0.6 * (np.log(price) - 3.0)
        p_buy = p / (1.0 + np.exp(-buy_logit))  # P(click) * P(buy | click)
        buy = clk * (self.buy_rng.random(n) * p < p_buy)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        item, cate = ("i", "c") if s.string_ids else ("", "")

        def history(ids: np.ndarray, prefix: str) -> pa.Array:
            return pc.binary_join(pa.ListArray.from_arrays(offsets, _spelled(ids, prefix)), "|")

        table = pa.table(
            {
                "user_id": _spelled(users, "u"),
                "age": pa.array(self.user_age[users]),
                "item_id": _spelled(cand, item) if s.string_ids else pa.array(cand),
                "cate_id": _spelled(cand_cate, cate) if s.string_ids else pa.array(cand_cate),
                "hist_item_id": history(hist, item),
                "hist_cate_id": history(hist_cate, cate),
                "price": pa.array(price.round(2)),
                "clk": pa.array(clk),
                "buy": pa.array(buy.astype(np.int64)),
            }
        )
        return table, np.stack([p, p_buy], axis=1)


def make_click_log(out_dir: str | Path, spec: SyntheticSpec = SyntheticSpec()) -> dict:
    """Writes ``train/part-*.parquet``, ``eval/part-0.parquet`` and ``meta.json`` under
    ``out_dir``; returns the metadata (rows, click rate, Bayes-optimal eval AUC).

    The directory is written under a temporary sibling name and renamed into place (a full
    disk or a kill leaves nothing half-written); an existing ``out_dir`` is replaced only when
    it is empty or a previous data directory of dynarec's (its ``meta.json`` lists its files, and
    it holds no other), never a user's directory or file."""
    target = Path(out_dir)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} is a file; make-data writes a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    out = target.with_name(f".{target.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(out, ignore_errors=True)
    try:
        meta = _write_click_log(out, spec)
        fsync_tree(out)
        replace_dir(out, target, "meta.json", "synthetic data directory")
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return meta


def _write_click_log(out: Path, spec: SyntheticSpec) -> dict:
    (out / "train").mkdir(parents=True, exist_ok=True)
    (out / "eval").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    world = _World(spec, rng)
    train, _ = world.rows(spec.train_rows, rng)
    per_file = -(-spec.train_rows // spec.train_files)
    for i in range(spec.train_files):
        pq.write_table(train.slice(i * per_file, per_file), out / "train" / f"part-{i}.parquet")
    eval_table, p_eval = world.rows(spec.eval_rows, rng)
    pq.write_table(eval_table, out / "eval" / "part-0.parquet")
    labels = eval_table.column("clk").to_numpy()
    buys = eval_table.column("buy").to_numpy()
    meta = {
        "spec": asdict(spec),
        "train_rows": spec.train_rows,
        "eval_rows": spec.eval_rows,
        "train_click_rate": float(np.mean(train.column("clk").to_numpy())),
        "eval_click_rate": float(np.mean(labels)),
        "bayes_optimal_eval_auc": auc(p_eval[:, 0], labels),
        "train_buy_rate": float(np.mean(train.column("buy").to_numpy())),
        "eval_buy_rate": float(np.mean(buys)),
        "bayes_optimal_eval_buy_auc": auc(p_eval[:, 1], buys),
    }
    meta["files"] = relative_files(out)  # what a later make-data may replace
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta
