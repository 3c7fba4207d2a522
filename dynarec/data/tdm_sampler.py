"""A TDM model's training rows from its tree (``data.tdm_sampler``; TorchEasyRec's ``TDMSampler``
and ``expand_tdm_sample``).

Each row's item is a leaf of the tree. The row keeps its label; its item's ancestors between
the root and the leaf become rows labelled 1 (of the levels kept, see ``remain_ratio``) and, at
each kept level and the leaves' level ``i``, ``layer_num_sample[i]`` nodes of that level drawn by
weight without replacement, none the row's own node there, rows labelled 0. A sampled row holds
the node's id and attributes in the item columns (``item_id_field``, ``attr_fields``) and the
row's own values in every other column. Rows come as TorchEasyRec lays them out: the batch's
rows, then each row's positives, then each row's negatives level by level.

The draws of a batch depend on the seed and on where its rows start alone (as the negative
sampler's, dynarec.data.sampler): a run and its resume train on the same rows.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from dynarec.config.tdm import TDMSamplerCfg
from dynarec.data.sampler import attribute_columns
from dynarec.data.tree import Tree, TreeError, read_tree
from dynarec.files import sha256

__all__ = ["TDMSampler", "TreeSamples", "config_tree", "node_columns", "tdm_sampler", "with_node_columns"]

# Rounds of draws before a row's missing negatives are taken from what its level has left.
_ROUNDS = 4


@dataclass(frozen=True)
class TreeSamples:
    """The sampled rows of a batch: for each, the batch row it copies (``rows`` int64 ``[S]``),
    the tree node it holds (``nodes`` int64 ``[S]``, indices into the tree) and its label
    (``labels`` float32 ``[S]``: 1 a positive, 0 a negative)."""

    rows: np.ndarray
    nodes: np.ndarray
    labels: np.ndarray


def config_tree(cfg: TDMSamplerCfg) -> Tree:
    """The tree of ``cfg``'s node and edge tables."""
    return read_tree(
        cfg.item_input_path, cfg.edge_input_path, len(cfg.attr_fields), cfg.attr_delimiter, cfg.field_delimiter
    )


def tree_files(cfg: TDMSamplerCfg) -> dict[str, str]:
    """The files of ``cfg``'s tree, by role (``node_table``, ``edge_table``)."""
    return {"node_table": cfg.item_input_path, "edge_table": cfg.edge_input_path}


def tree_digest(cfg: TDMSamplerCfg) -> str:
    """SHA-256 of ``cfg``'s tree files, in order: a TDM model's node ids mean the nodes of the
    tree it was trained on, so its checkpoints record this and its exports copy the files."""
    h = hashlib.sha256()
    for path in tree_files(cfg).values():
        h.update(sha256(Path(path)).encode())
    return h.hexdigest()


def node_columns(
    cfg: TDMSamplerCfg, tree: Tree, nodes: np.ndarray, types: dict[str, pa.DataType]
) -> dict[str, pa.Array]:
    """The item columns (``item_id_field``, ``attr_fields``) of tree ``nodes``, cast to the data's
    column ``types`` (strings where a column is not among them)."""
    strings = [pa.array(tree.ids[nodes]).cast(pa.string()), *tree.attribute_strings(nodes)]
    return attribute_columns(cfg.item_columns, strings, types, cfg.item_input_path)


def with_node_columns(table: pa.Table, columns: dict[str, pa.Array]) -> pa.Table:
    """``table`` (rows copied for tree nodes) with its item columns replaced by the nodes'
    ``columns`` (:func:`node_columns`; a column it lacks appended)."""
    for name, column in columns.items():
        at = table.schema.get_field_index(name)
        table = table.set_column(at, name, column) if at >= 0 else table.append_column(name, column)
    return table


class TDMSampler:
    """The tree of ``cfg`` and the layer-wise draws over it."""

    def __init__(self, cfg: TDMSamplerCfg, seed: int = 0):
        self.cfg = cfg
        self.seed = seed
        self.tree: Tree = config_tree(cfg)
        tree, samples = self.tree, cfg.layer_num_sample
        if len(samples) != tree.num_levels:
            raise TreeError(
                f"data.tdm_sampler.layer_num_sample: {len(samples)} entries, but the tree of "
                f"{cfg.item_input_path} has {tree.num_levels} levels (give one count a level, the root's 0)"
            )
        sizes = np.diff(tree.level_starts)
        for level, k in enumerate(samples):
            if k > sizes[level] - 1:
                raise TreeError(
                    f"data.tdm_sampler.layer_num_sample[{level}]: {k} negatives, but level {level} of the tree "
                    f"of {cfg.item_input_path} has {sizes[level]} node(s), {sizes[level] - 1} besides a row's own"
                )
        # each leaf's ancestor at every level, [leaves, L]
        self.leaf_paths = tree.paths[tree.level_starts[-2] :]
        weights = [tree.weights[tree.level_starts[i] : tree.level_starts[i + 1]] for i in range(tree.num_levels)]
        self.cumulative = [np.cumsum(w) for w in weights]
        self.uniform = [bool((w == w[0]).all()) for w in weights]  # (TorchEasyRec's tools weigh every node 1)
        inner = tree.num_levels - 2  # the levels between the root and the leaves
        if cfg.probability_type == "UNIFORM":
            p = np.full(inner, 1.0 / max(inner, 1))
        elif cfg.probability_type == "ARITHMETIC":
            p = np.arange(1, inner + 1) / max(np.arange(1, inner + 1).sum(), 1)
        else:  # RECIPROCAL: level l kept with probability proportional to 1 / (L - 1 - l)
            p = 1.0 / np.arange(inner, 0, -1)
            p = p / p.sum() if inner else p
        self.keep_probability = p

    def rng(self, key: str) -> np.random.Generator:
        digest = hashlib.blake2b(f"{self.seed}:tdm:{key}".encode(), digest_size=8).digest()
        return np.random.default_rng(int.from_bytes(digest, "little"))

    def levels_kept(self, rng: np.random.Generator) -> np.ndarray:
        """The levels between the root and the leaves a batch trains (all, or ``remain_ratio``
        of them drawn without replacement by ``probability_type``), ascending."""
        inner = self.tree.num_levels - 2
        if self.cfg.remain_ratio >= 1.0 or inner == 0:
            return np.arange(1, inner + 1)
        count = round(self.cfg.remain_ratio * inner)
        return np.sort(rng.choice(np.arange(1, inner + 1), count, replace=False, p=self.keep_probability))

    def sample(self, leaves: np.ndarray, key: str) -> TreeSamples:
        """The sampled rows of a batch whose items are the leaf nodes ``leaves`` ``[B]``; ``key``
        seeds the draws (the batch's position)."""
        rng = self.rng(key)
        b = len(leaves)
        paths = self.leaf_paths[leaves - self.tree.level_starts[-2]]  # [B, L]
        kept = self.levels_kept(rng)
        positives = paths[:, kept].reshape(-1)
        drawn = []
        for level in [*kept.tolist(), self.tree.num_levels - 1]:
            k = self.cfg.layer_num_sample[level]
            if k:
                drawn.append(self._draw(level, paths[:, level], k, rng))
        negatives = np.concatenate(drawn, axis=1).reshape(-1) if drawn else np.empty(0, np.int64)
        per_row = len(negatives) // max(b, 1)
        rows = np.concatenate([np.repeat(np.arange(b), len(kept)), np.repeat(np.arange(b), per_row)])
        labels = np.concatenate([np.ones(len(positives), np.float32), np.zeros(len(negatives), np.float32)])
        return TreeSamples(rows.astype(np.int64), np.concatenate([positives, negatives]).astype(np.int64), labels)

    def _draw(self, level: int, own: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
        """``[B, k]`` node indices of ``level``, each row's distinct and none its ``own`` node,
        drawn by weight without replacement (successive draws, repeats and the own node
        rejected: graph-learn's ``node_weight`` sampler with ``samplewise_unique``)."""
        start = int(self.tree.level_starts[level])
        cumulative = self.cumulative[level]
        b, size = len(own), len(cumulative)
        own = own - start
        out = np.full((b, k), -1, dtype=np.int64)
        filled = np.zeros(b, dtype=np.int64)
        todo = np.arange(b)
        for _ in range(_ROUNDS):
            width = 2 * k + 8
            if self.uniform[level]:
                draws = rng.integers(0, size, (len(todo), width))
            else:
                draws = np.searchsorted(cumulative, rng.random((len(todo), width)) * cumulative[-1], side="right")
                draws = np.minimum(draws, size - 1)
            # previously taken nodes of the row first, so that a repeat of them is rejected too
            taken = out[todo]
            seq = np.concatenate([taken, draws], axis=1)
            valid = np.concatenate([taken >= 0, draws != own[todo, None]], axis=1)
            order = np.argsort(seq, axis=1, kind="stable")
            sorted_seq = np.take_along_axis(seq, order, axis=1)
            sorted_valid = np.take_along_axis(valid, order, axis=1)
            repeat = np.zeros_like(sorted_valid)
            repeat[:, 1:] = sorted_seq[:, 1:] == sorted_seq[:, :-1]
            keep = np.zeros_like(valid)
            np.put_along_axis(keep, order, sorted_valid & ~repeat, axis=1)
            keep[:, : taken.shape[1]] = False  # (already placed)
            # the first new nodes of each row, in draw order, up to what the row still needs
            new_rank = np.cumsum(keep, axis=1) + filled[todo, None]
            place = keep & (new_rank <= k)
            r, c = np.nonzero(place)
            out[todo[r], new_rank[r, c] - 1] = seq[r, c]
            filled[todo] = np.minimum(new_rank[:, -1], k)
            todo = todo[filled[todo] < k]
            if not len(todo):
                return out + start
        for row in todo:  # heavy weights on few nodes: the rest from what the level has left, by weight
            left = np.setdiff1d(np.arange(size), np.concatenate([out[row, : filled[row]], [own[row]]]))
            w = np.diff(cumulative, prepend=0.0)[left]
            need = k - filled[row]
            if w.sum() > 0 and np.count_nonzero(w) >= need:
                pick = rng.choice(left, need, replace=False, p=w / w.sum())
            else:
                pick = rng.choice(left, need, replace=False)
            out[row, filled[row] :] = pick
        return out + start


def tdm_sampler(cfg: TDMSamplerCfg, seed: int) -> TDMSampler:
    """The sampler of ``cfg`` (its tree read once a process, for every dataset of a run)."""
    return _cached(cfg.model_dump_json(), seed)


@functools.lru_cache(maxsize=2)
def _cached(cfg_json: str, seed: int) -> TDMSampler:
    return TDMSampler(TDMSamplerCfg.model_validate_json(cfg_json), seed)
