"""A TDM model's tree at work: retrieval by beam search down the tree (TorchEasyRec's
``tzrec/tools/tdm/retrieval.py``) and the items' embeddings a learnt tree clusters
(``TDMEmbedding`` + ``cluster_tree``).

Beam search, for each user row: the nodes of level ``ceil(log_n(2 n k))`` (the first level
with ``2 n k`` nodes in a full ``n``-ary tree; the leaves' level if the tree is shallower) are
scored, the ``2 k`` best kept, their children scored, and so on to the leaves, of which the ``k``
best are the row's retrieved items. A (user, node) row is scored by the served model
(:class:`~dynarec.serving.ExportedModel`): the user's columns, the node's id and attributes in
the item columns — the rows the model trained on. Ties go to the node first in the tree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from dynarec.config.schema import Config
from dynarec.data.batch import BatchBuilder, DataError, RowOrigin
from dynarec.data.tdm_sampler import config_tree as tdm_sampler_tree
from dynarec.data.tdm_sampler import node_columns, with_node_columns
from dynarec.data.tree import Tree

__all__ = ["BeamSearch", "Retrieved", "config_tree", "item_embeddings"]

# (user, node) rows scored a forward pass
SCORE_BATCH = 65536


def config_tree(config: Config) -> Tree:
    """The tree of a TDM config (``data.tdm_sampler``)."""
    cfg = config.data.tdm_sampler
    if cfg is None:
        raise ValueError(f"model '{config.model.name}' has no tree: beam search and clustering are TDM's (model.tdm)")
    return tdm_sampler_tree(cfg)


@dataclass(frozen=True)
class Retrieved:
    """Each user row's ``k`` retrieved items: ``items`` int64 ``[B, k]`` (item ids, best first)
    and ``scores`` float32 ``[B, k]`` (the model's probability)."""

    items: np.ndarray
    scores: np.ndarray


class BeamSearch:
    """Beam search of ``k`` items a user down ``tree`` by ``score``: ``(table of (user, node)
    rows) -> probabilities [rows]``."""

    def __init__(self, config: Config, tree: Tree, score, k: int):
        if k < 1:
            raise ValueError(f"recall_num: at least 1 item a user, got {k}")
        leaves = int(np.diff(tree.level_starts)[-1])
        if k > leaves:
            raise ValueError(f"recall_num {k}: the tree holds {leaves} items")
        assert config.data.tdm_sampler is not None
        self.cfg, self.tree, self.score, self.k = config.data.tdm_sampler, tree, score, k
        offsets, _ = tree.children
        n = max(2, int(np.diff(offsets).max()))  # the branching factor
        self.first_level = min(math.ceil(math.log(2 * n * k, n)), tree.num_levels - 1)

    def search(self, users: pa.Table) -> Retrieved:
        """The items of each row of ``users`` (its columns as the model's data has them)."""
        tree, b = self.tree, users.num_rows
        level = self.first_level
        nodes = np.arange(tree.level_starts[level], tree.level_starts[level + 1])
        rows = np.repeat(np.arange(b), len(nodes))
        nodes = np.tile(nodes, b)
        last = tree.num_levels - 1
        while True:
            scores = self._scores(users, rows, nodes)
            keep = self.k if level == last else 2 * self.k
            order = np.lexsort((nodes, -scores, rows))  # by row, best first, ties: tree order
            rows, nodes, scores = rows[order], nodes[order], scores[order]
            starts = np.searchsorted(rows, rows, side="left")
            best = np.arange(len(rows)) - starts < keep
            rows, nodes, scores = rows[best], nodes[best], scores[best]
            if level == last:
                break
            offsets, children = tree.children
            counts = offsets[nodes + 1] - offsets[nodes]
            firsts = np.repeat(offsets[nodes] - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
            rows, nodes = np.repeat(rows, counts), children[firsts]
            level += 1
        return Retrieved(tree.ids[nodes].reshape(b, self.k), scores.astype(np.float32).reshape(b, self.k))

    def _scores(self, users: pa.Table, rows: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        out = np.empty(len(rows), dtype=np.float32)
        types = {f.name: f.type for f in users.schema}
        for start in range(0, len(rows), SCORE_BATCH):
            part = slice(start, start + SCORE_BATCH)
            columns = node_columns(self.cfg, self.tree, nodes[part], types)
            out[part] = self.score(with_node_columns(users.take(pa.array(rows[part])), columns))
        return out


@torch.no_grad()
def item_embeddings(task, config: Config, tree: Tree, types: dict[str, pa.DataType], batch_size: int = 4096):
    """``[items, D]`` float32: each leaf's embedding, the query of the TDM model's sequence group
    (TorchEasyRec's ``TDMEmbedding``), from ``task`` (a trained RankingTask); ``types``: the
    data's column types. The query's features must read the item columns alone."""
    from dynarec.models.features import element_poolings, sequence_names
    from dynarec.models.inputs import model_inputs

    cfg = config.data.tdm_sampler
    assert cfg is not None
    model = task.dense
    query = model.seq.query
    outside = {n: [c for c in config.columns_read(n) if c not in cfg.item_columns] for n in query}
    outside = {n: cols for n, cols in outside.items() if cols}
    if outside:
        raise DataError(
            f"the item embedding reads feature(s) {sorted(outside)} whose column(s) "
            f"{sorted({c for cols in outside.values() for c in cols})} the tree's nodes lack "
            f"(data.tdm_sampler.attr_fields: {cfg.attr_fields})"
        )
    empty = frozenset(f.feature_name for f in config.features() if f.feature_name not in query)
    builder = BatchBuilder(config, with_labels=False, empty_features=empty)
    leaves = np.arange(tree.level_starts[-2], len(tree.ids))
    parts = []
    was_training = task.training
    task.eval()
    try:
        for start in range(0, len(leaves), batch_size):
            nodes = leaves[start : start + batch_size]
            table = pa.table(node_columns(cfg, tree, nodes, types))
            batch = builder.build(table, RowOrigin.of(f"{cfg.item_input_path} (its leaves)", len(nodes), start))
            inputs = model_inputs(task.embeddings, batch, sequence_names(config), task.device, element_poolings(config))
            parts.append(model.item_embedding(*inputs).float().cpu().numpy())
    finally:
        task.train(was_training)
    return np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)
