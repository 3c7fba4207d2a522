"""``dynarec make-data --config C``: synthetic Parquet matching any config's input columns.

Every column a config's features, label and grouped-AUC field read is written with the type
the feature expects: integer ids below a fixed table's rows (Zipf-popular), strings for hashed
features, separator-joined lists for multi-value and sequence features, positive numbers for
dense and bucketized features. The label is drawn from a hidden logistic model — a random effect
per (column, id) and a slope per dense column — so a converted config can be smoke-trained and
its AUC means something (the Bayes-optimal AUC of the eval split is written to ``meta.json``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dynarec.config.schema import Config, IdFeatureCfg, RawFeatureCfg, SequenceFeatureCfg
from dynarec.files import fsync_tree, replace_dir
from dynarec.metrics import auc

__all__ = ["GenerateSpec", "make_config_data"]

Feature = Union[IdFeatureCfg, SequenceFeatureCfg, RawFeatureCfg]


@dataclass(frozen=True)
class GenerateSpec:
    train_rows: int = 100_000
    eval_rows: int = 20_000
    train_files: int = 4
    vocabulary: int = 100_000  # at most this many distinct ids per column (a fixed table's rows if fewer)
    zipf_a: float = 1.1
    seed: int = 0


def _zipf_ids(rng: np.random.Generator, vocabulary: int, n: int, a: float) -> np.ndarray:
    """``n`` ids in ``[0, vocabulary)``, id ``k`` drawn with weight ``1 / (k + 1) ** a``."""
    p = 1.0 / np.arange(1, vocabulary + 1) ** a
    return rng.choice(vocabulary, size=n, p=p / p.sum())


def _effect(column: str, ids: np.ndarray, seed: int) -> np.ndarray:
    """A fixed random effect per (column, id): the hidden model's weight of that id."""
    salt = np.uint64(zlib.crc32(f"{column}/{seed}".encode()))
    x = (ids.astype(np.uint64) ^ salt) * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(31)
    return (x % np.uint64(1 << 20)).astype(np.float64) / float(1 << 20) * 2.0 - 1.0


class _Column:
    """One input column: its values for ``n`` rows and its share of each row's logit."""

    def __init__(self, name: str, features: list[Feature], spec: GenerateSpec, rng: np.random.Generator):
        self.name = name
        self.features = features
        self.spec = spec
        self.rng = rng
        embedded = [f for f in features if not isinstance(f, RawFeatureCfg)]
        self.numeric = not embedded or all(isinstance(f, IdFeatureCfg) and f.boundaries is not None for f in embedded)
        self.sequence = next((f for f in embedded if isinstance(f, SequenceFeatureCfg)), None)
        multi = next((f for f in embedded if isinstance(f, IdFeatureCfg) and f.separator), None)
        self.separator = self.sequence.separator if self.sequence else (multi.separator if multi else None)
        self.hashed = any(f.hashed for f in embedded)
        rows = [f.table_rows for f in embedded if f.table_rows is not None and not getattr(f, "boundaries", None)]
        self.vocabulary = min([spec.vocabulary, *rows])

    def draw(self, n: int, lengths_by_max: dict[int, np.ndarray]) -> tuple[pa.Array, np.ndarray]:
        """``(values, logit share)`` of ``n`` rows. Sequences of one ``sequence_length`` share their
        lengths (``lengths_by_max``, filled by the first): the sequences of one sequence group
        must have one length per row."""
        if self.numeric:
            x = np.round(np.exp(self.rng.normal(1.0, 1.0, n)), 3)
            return pa.array(x, pa.float64()), 0.4 * (np.log1p(x) - 1.3)
        if self.separator is None:
            ids = _zipf_ids(self.rng, self.vocabulary, n, self.spec.zipf_a)
            return self._ids(ids), _effect(self.name, ids, self.spec.seed)
        if self.sequence is not None:
            longest = self.sequence.sequence_length
            lengths = lengths_by_max.setdefault(longest, self.rng.integers(1, longest + 1, n))
        else:  # a multi-value field (a separator given) with one value a row, as most are
            lengths = np.ones(n, dtype=np.int64)
        ids = _zipf_ids(self.rng, self.vocabulary, int(lengths.sum()), self.spec.zipf_a)
        row = np.repeat(np.arange(n), lengths)
        effect = np.bincount(row, weights=_effect(self.name, ids, self.spec.seed), minlength=n) / np.maximum(lengths, 1)
        tokens = self._tokens(ids)
        starts = np.r_[0, np.cumsum(lengths)]
        joined = [self.separator.join(tokens[starts[i] : starts[i + 1]]) for i in range(n)]
        return pa.array(joined, pa.string()), effect

    def _tokens(self, ids: np.ndarray) -> list[str]:
        return [f"{self.name}_{i}" for i in ids] if self.hashed else [str(i) for i in ids]

    def _ids(self, ids: np.ndarray) -> pa.Array:
        return pa.array(self._tokens(ids), pa.string()) if self.hashed else pa.array(ids, pa.int64())


def _columns(config: Config, spec: GenerateSpec, rng: np.random.Generator) -> list[_Column]:
    by_column: dict[str, list[Feature]] = {}
    for f in config.features():
        by_column.setdefault(f.column, []).append(f)
    return [_Column(name, features, spec, rng) for name, features in by_column.items()]


def _table(columns: list[_Column], config: Config, n: int, rng: np.random.Generator) -> tuple[pa.Table, np.ndarray]:
    data: dict[str, pa.Array] = {}
    logit = np.full(n, -1.0)
    lengths: dict[int, np.ndarray] = {}
    for c in columns:
        values, share = c.draw(n, lengths)
        data[c.name] = values
        logit += share
    p = 1.0 / (1.0 + np.exp(-logit))
    data[config.data.label_field] = pa.array((rng.random(n) < p).astype(np.int64))
    group = config.eval.grouped_auc_field
    if group and group not in data:
        data[group] = pa.array(rng.integers(0, max(n // 20, 1), n))
    return pa.table(data), p


def make_config_data(config: Config, out_dir: Union[str, Path], spec: GenerateSpec = GenerateSpec()) -> dict:
    """Writes ``train/part-*.parquet``, ``eval/part-0.parquet`` and ``meta.json`` under
    ``out_dir`` with every column ``config`` reads; returns the metadata (rows, click rate,
    Bayes-optimal eval AUC). Written under a temporary name and renamed into place; an existing
    ``out_dir`` is replaced only when empty or generated data (it holds ``meta.json``)."""
    target = Path(out_dir)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} is a file; make-data writes a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        rng = np.random.default_rng(spec.seed)
        columns = _columns(config, spec, rng)
        (tmp / "train").mkdir(parents=True)
        (tmp / "eval").mkdir()
        per_file = -(-spec.train_rows // spec.train_files)
        clicks = 0
        for i in range(spec.train_files):
            rows = min(per_file, spec.train_rows - i * per_file)
            if rows <= 0:
                break
            table, _ = _table(columns, config, rows, rng)
            clicks += int(np.sum(table.column(config.data.label_field).to_numpy()))
            pq.write_table(table, tmp / "train" / f"part-{i}.parquet")
        table, p = _table(columns, config, spec.eval_rows, rng)
        pq.write_table(table, tmp / "eval" / "part-0.parquet")
        labels = table.column(config.data.label_field).to_numpy()
        meta = {
            "generator": "config",
            "columns": [c.name for c in columns],
            "train_rows": spec.train_rows,
            "eval_rows": spec.eval_rows,
            "train_click_rate": clicks / max(spec.train_rows, 1),
            "eval_click_rate": float(np.mean(labels)),
            "bayes_optimal_eval_auc": auc(p, labels),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        fsync_tree(tmp)
        replace_dir(tmp, target, is_ours=lambda d: (d / "meta.json").is_file(), what="synthetic data directory")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta
