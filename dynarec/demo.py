"""The built-in demo: a small click model over a fixed and a dynamic table, trained on
generated data with fused Adagrad (``initial_accumulator_value=0.1``), then evaluated."""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from dynarec.embedding import EmbeddingCollection, JaggedBatch, TableConfig
from dynarec.optim import Adagrad

__all__ = ["main"]


def _make_data(n: int, num_users: int, num_cates: int, gen: torch.Generator):
    users = torch.randint(0, num_users, (n,), generator=gen) * 7919 + (1 << 40)  # raw int64 ids
    cates = torch.randint(0, num_cates, (n,), generator=gen)
    user_bias = torch.randn(num_users, generator=gen)
    cate_bias = torch.randn(num_cates, generator=gen)
    logit = user_bias[(users - (1 << 40)) // 7919] + cate_bias[cates]
    labels = (torch.rand(n, generator=gen) < torch.sigmoid(logit)).float()
    return users, cates, labels


def _auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    order = torch.argsort(scores)
    ranks = torch.empty_like(order, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)


def main(args) -> None:
    gen = torch.Generator().manual_seed(args.seed)
    users, cates, labels = _make_data(args.steps * args.batch_size + 20_000, 2_000, 50, gen)
    coll = EmbeddingCollection(
        [TableConfig(name="cate", dim=8, num_embeddings=50, features=["cate_id"]),
         TableConfig(name="user", dim=8, kind="dynamic", max_capacity=4096, init_capacity=1024, features=["user_id"])],
        optimizer=Adagrad(lr=0.1, initial_accumulator_value=0.1),
    )
    head = nn.Linear(16, 1)
    dense_opt = torch.optim.Adam(head.parameters(), lr=0.01)

    def batch(lo: int, hi: int) -> JaggedBatch:
        n = hi - lo
        return JaggedBatch(["cate_id", "user_id"], torch.cat([cates[lo:hi], users[lo:hi]]),
                           torch.ones(2 * n, dtype=torch.int64))

    start = time.perf_counter()
    for step in range(args.steps):
        lo = step * args.batch_size
        out = coll(batch(lo, lo + args.batch_size))
        logit = head(torch.cat([out["cate_id"], out["user_id"]], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logit, labels[lo : lo + args.batch_size])
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
    coll.eval()
    lo = args.steps * args.batch_size
    with torch.no_grad():
        out = coll(batch(lo, lo + 20_000))
        scores = head(torch.cat([out["cate_id"], out["user_id"]], dim=1)).squeeze(1)
    print(f"trained {args.steps} steps x {args.batch_size} in {time.perf_counter() - start:.1f}s; "
          f"last train loss {loss.item():.4f}; held-out AUC {_auc(scores, labels[lo:lo + 20_000]):.4f}")
    for row in coll.describe():
        print("  table", row)
