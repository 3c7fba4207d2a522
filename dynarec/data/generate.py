"""``dynarec make-data --config C``: synthetic Parquet matching any config's input columns.

Every column a config's features, label and grouped-AUC field read is written with the type the
feature expects (docs/features.md):

- ids: integers below a fixed table's rows (Zipf-popular), strings for hashed features, the words
  of a vocabulary (and a few words not in it) for ``vocab_*`` features, ``id:weight`` pairs for
  weighted ones; several a row joined by the feature's separator; a sequence ``|``-joined;
- numbers: positive floats; a list column of ``value_dim`` floats (a vector column); a dense
  sequence as a list of lists (``value_dim`` > 1) or a list of floats;
- a lookup's map as a map column (``key -> number``, ``key -> word``, or ``key -> "1,2,..."``
  for ``value_dim`` > 1) over the keys its key column draws from; a match's nested map as a map
  column ``pkey -> "skey:value,..."``; EditDistance's inputs as short strings; a tokenize
  feature's text as 1 to 6 words of a made-up lexicon joined by spaces.

A ``vocab_file`` that does not exist is written where the config names it (``<feature>_w<i>``
words, one a line; a tokenize feature's: a tokenizer of its type trained on the lexicon after the
feature's normalizer) and reported in the metadata (``vocab_files_written``), so that the config
trains on the data as it is.

The label is drawn from a hidden logistic model — a random effect per (column, id or word) and a
slope per numeric column — so a converted config can be smoke-trained and its AUC means something
(the Bayes-optimal AUC of the eval split is written to ``meta.json``).

A model that scores each row's candidates (``Config.candidate_feature()``, ``dlrm_hstu``) gets
label columns of lists, one value a candidate of the row (aligned with the candidate sequence's
elements): each candidate's logit is the row's plus the effect of the candidate's id; a bitmask
label (``task_bitmask``) sets bit ``k`` with probability ``sigmoid(logit - k)``. The features of
its ``uih_timestamp`` group hold seconds, ascending (oldest first) up to 1.6e9; those of its
``candidate_timestamp`` group the row's query time, one value (after the history) for every
candidate. Generated sequences hold at most ``GenerateSpec.max_sequence_length`` elements, whatever
a feature's ``sequence_length`` (TorchEasyRec's HSTU configs keep 8000).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dynarec.config.features import (
    BoolMaskFeatureCfg,
    ComboFeatureCfg,
    CustomFeatureCfg,
    ExprFeatureCfg,
    Feature,
    IdFeatureCfg,
    Input,
    KvDotProductCfg,
    LookupFeatureCfg,
    MatchFeatureCfg,
    OverlapFeatureCfg,
    RawFeatureCfg,
    SequenceFeatureCfg,
    SequenceRawFeatureCfg,
    TokenizeFeatureCfg,
    parse_input,
)
from dynarec.config.schema import Config
from dynarec.config.tasks import label_rules
from dynarec.data.batch import sequence_elements
from dynarec.data.reader import lists_as_data
from dynarec.data.sampler import MULTI_VALUE_SEPARATOR, write_edge_table, write_item_table
from dynarec.data.tree import init_tree, node_attribute, write_tree_tables
from dynarec.files import fsync_tree, relative_files, replace_dir
from dynarec.metrics import auc

__all__ = ["GenerateSpec", "make_config_data"]

KEYS = 12  # distinct keys of a lookup or match key column
VOCAB_FILE_WORDS = 100
NOW = 1_600_000_000  # seconds: a history's last time; its candidates' query time a little later
# What the features of a generative ranker's groups hold, by the group name's ending: a channel's
# history's times, its actions (bitmasks); candidate_timestamp's: the candidates' query times.
GROUP_KINDS = {"_timestamp": "history_times", "_action": "actions"}
# A TDM config's item ids: a 1/8 of the item table's rows, so that the tree's inner nodes
# (ids above the items', up to about four times as many) fit in the table too.
TDM_ID_SHARE = 8
ACTION_BITS = 8  # a history element's bitmask: bit k set with probability 1 / (k + 2)
_SYLLABLES = ("ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "de", "gu")
LEXICON = [a + b + c for a in _SYLLABLES for b in _SYLLABLES for c in ("", "n", "s")]  # a text's words
TEXT_WORDS = 6  # a generated text holds 1 to this many words
TERMS = 4  # an overlap / kv_dot_product input holds 1 to this many terms of a few
MASKED = 5  # a bool_mask_feature's values and mask hold 1 to this many, as many each


@dataclass(frozen=True)
class GenerateSpec:
    train_rows: int = 100_000
    eval_rows: int = 20_000
    train_files: int = 4
    vocabulary: int = 100_000  # at most this many distinct ids per column (a fixed table's rows if fewer)
    zipf_a: float = 1.1
    seed: int = 0
    # A generated sequence draws 1 to this many elements a row (fewer where the feature's
    # sequence_length is smaller), whatever its sequence_length.
    max_sequence_length: int = 50

    def __post_init__(self):
        if self.max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be at least 1, got {self.max_sequence_length}")


def _group_kind(config: Config, group: str) -> Optional[str]:
    """What the features of ``group`` hold where the model gives its group names a meaning (a
    generative ranker: candidate_times, history_times, actions), else None."""
    if config.candidate_feature() is None:
        return None
    if group == "candidate_timestamp":
        return "candidate_times"
    return next((kind for end, kind in GROUP_KINDS.items() if group.endswith(end)), None)


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


def _join(tokens: list[str], lengths: np.ndarray, separator: str) -> pa.Array:
    starts = np.r_[0, np.cumsum(lengths)]
    return pa.array([separator.join(tokens[starts[i] : starts[i + 1]]) for i in range(len(lengths))], pa.string())


@dataclass
class _Column:
    """One input column: what it holds (``kind``) and how; its values for ``n`` rows and its
    share of each row's logit (:meth:`draw`)."""

    name: str
    # ids | strings | words | weighted | number | vector | dense_sequence | history_times | candidate_times |
    # actions | map | nested_map | keys | text | sentence | mask
    kind: str
    separator: Optional[str] = None
    sequence_length: Optional[int] = None
    vocabulary: int = 1000
    words: list[str] = field(default_factory=list)
    value_dim: int = 1
    value_separator: str = ","
    element_separator: Optional[str] = None  # a sequence of several ids an element: between them
    map_value: str = "number"  # number | vector | words | ids | strings
    keys: list[str] = field(default_factory=lambda: [f"k{i}" for i in range(KEYS)])
    key_sources: list[Input] = field(default_factory=list)  # a map's keys: what these inputs hold
    candidates: bool = False  # the elements are each row's candidates (Config.candidate_feature())

    def domain(self) -> list[str]:
        """The most frequent values this column holds, as strings (a map keyed by them hits)."""
        if self.kind == "keys":
            return self.keys
        if self.kind == "words":
            return self.words[:KEYS]
        if self.kind == "strings":
            return [f"{self.name}_{i}" for i in range(KEYS)]
        if self.kind == "ids":
            return [str(i) for i in range(min(self.vocabulary, KEYS))]
        return [f"k{i}" for i in range(KEYS)]

    def draw(self, n: int, spec: GenerateSpec, rng: np.random.Generator, lengths_by_max: dict[int, np.ndarray]):
        """``(values, logit share)`` of ``n`` rows (the candidates' column: the share of each
        element, each candidate's own). Sequences of one ``sequence_length`` share their lengths
        (``lengths_by_max``, filled by the first): the sequences of one sequence group must have
        one length per row."""
        lengths = np.ones(n, dtype=np.int64)
        if self.sequence_length is not None:
            longest = min(self.sequence_length, spec.max_sequence_length)
            lengths = lengths_by_max.setdefault(self.sequence_length, rng.integers(1, longest + 1, n))
        k = self.value_dim
        if self.kind == "number":
            x = np.round(np.exp(rng.normal(1.0, 1.0, n)), 3)
            return pa.array(x, pa.float64()), 0.4 * (np.log1p(x) - 1.3)
        if self.kind in ("vector", "dense_sequence"):
            total = int(lengths.sum()) * k
            x = np.round(rng.random(total), 3)
            share = 0.5 * (np.bincount(np.repeat(np.arange(n), lengths * k), x, n) / np.maximum(lengths * k, 1) - 0.5)
            flat = pa.array(x, pa.float64())
            if self.kind == "vector":
                return pa.FixedSizeListArray.from_arrays(flat, k).cast(pa.list_(pa.float64())), share
            offsets = np.r_[0, np.cumsum(lengths)].astype(np.int32)
            if k == 1:
                return pa.ListArray.from_arrays(pa.array(offsets), flat), share
            inner = pa.FixedSizeListArray.from_arrays(flat, k).cast(pa.list_(pa.float64()))
            return pa.ListArray.from_arrays(pa.array(offsets), inner), share
        if self.kind in ("history_times", "candidate_times"):
            return self._times(lengths, rng), np.zeros(n)
        if self.kind == "actions":
            total = int(lengths.sum())
            bits = rng.random((total, ACTION_BITS)) < 1.0 / (np.arange(ACTION_BITS) + 2)
            x = (bits * (1 << np.arange(ACTION_BITS))).sum(1).astype(np.float64)
            offsets = np.r_[0, np.cumsum(lengths)].astype(np.int32)
            return pa.ListArray.from_arrays(pa.array(offsets), pa.array(x, pa.float64())), np.zeros(n)
        if self.kind == "text":
            letters = np.array(list("abcdefgh"))
            words = ["".join(rng.choice(letters, rng.integers(1, 8))) for _ in range(n)]
            return pa.array(words, pa.string()), np.zeros(n)
        if self.kind == "map":
            return self._map(n, spec, rng)
        if self.kind == "nested_map":
            return self._nested_map(n, spec, rng)
        if self.kind == "keys":
            ids = rng.integers(0, len(self.keys), n)
            return pa.array([self.keys[i] for i in ids], pa.string()), 0.3 * _effect(self.name, ids, spec.seed)
        # id-like: ids, strings, words, weighted, sentence (words of the lexicon)
        vocabulary = len(self.words) if self.kind in ("words", "sentence") else self.vocabulary
        total = int(lengths.sum())
        ids = _zipf_ids(rng, vocabulary, total, spec.zipf_a)
        row = np.repeat(np.arange(n), lengths)
        effect = _effect(self.name, ids, spec.seed)
        if self.candidates:  # each candidate's own share: the scored items' signal the strongest
            effect = 2.0 * effect
        else:  # the row's share: the mean of its elements'
            effect = np.bincount(row, weights=effect, minlength=n) / np.maximum(lengths, 1)
        if self.kind == "ids" and self.separator is None and self.sequence_length is None:
            return pa.array(ids, pa.int64()), effect
        tokens = self._tokens(ids, rng)
        if self.element_separator is not None:  # a third of the elements hold a second id
            more = self._tokens(_zipf_ids(rng, vocabulary, total, spec.zipf_a), rng)
            two = rng.random(total) < 1 / 3
            tokens = [f"{t}{self.element_separator}{m}" if b else t for t, m, b in zip(tokens, more, two)]
        if self.separator is None:
            return pa.array(tokens, pa.string()), effect
        return _join(tokens, lengths, self.separator), effect

    def _times(self, lengths: np.ndarray, rng: np.random.Generator) -> pa.Array:
        """Seconds, a list a row: a history's ascending (oldest first, the last ``NOW``), a row's
        candidates' its query time (one for them all, at or after ``NOW``)."""
        n = len(lengths)
        if self.kind == "candidate_times":
            x = np.repeat(NOW + rng.integers(0, 3600, n), lengths).astype(np.float64)
        else:  # each element the sum of the gaps after it before NOW
            gaps = np.round(rng.exponential(3600.0, int(lengths.sum())))
            ends = np.cumsum(gaps)
            x = NOW - (np.repeat(ends[np.cumsum(lengths) - 1], lengths) - ends)
        offsets = np.r_[0, np.cumsum(lengths)].astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(x, pa.float64()))

    def _tokens(self, ids: np.ndarray, rng: np.random.Generator) -> list[str]:
        if self.kind == "sentence":
            return [self.words[i] for i in ids]
        if self.kind == "mask":
            return ["true" if i % 2 == 0 else "false" for i in ids]
        if self.kind == "words":
            out = [self.words[i] for i in ids]
            for i in np.nonzero(rng.random(len(ids)) < 0.05)[0]:  # a few words not in the vocabulary
                out[i] = f"{self.name}_oov{i % 3}"
            return out
        if self.kind == "strings":
            return [f"{self.name}_{i}" for i in ids]
        if self.kind == "weighted":
            weights = np.round(rng.random(len(ids)) * 2, 2)
            return [f"{i}:{w}" for i, w in zip(ids, weights)]
        return [str(i) for i in ids]

    def _values(self, count: int, spec: GenerateSpec, rng: np.random.Generator) -> pa.Array:
        """``count`` map values of the kind the lookup reads."""
        if self.map_value == "vector":
            x = np.round(rng.random((count, self.value_dim)), 3)
            return pa.array([self.value_separator.join(str(v) for v in row) for row in x], pa.string())
        if self.map_value in ("words", "ids", "strings"):
            vocabulary = len(self.words) if self.map_value == "words" else self.vocabulary
            ids = _zipf_ids(rng, vocabulary, count, spec.zipf_a)
            if self.map_value == "words":
                return pa.array([self.words[i] for i in ids], pa.string())
            return pa.array([f"{self.name}_{i}" if self.map_value == "strings" else str(i) for i in ids], pa.string())
        return pa.array(np.round(rng.random(count) * 3, 3), pa.float64())

    def _map(self, n: int, spec: GenerateSpec, rng: np.random.Generator):
        """A map column over ``keys``: each row a few of them, each with a value."""
        counts = rng.integers(0, min(len(self.keys), 5) + 1, n)
        keys = [self.keys[i] for c in counts for i in rng.choice(len(self.keys), c, replace=False)]
        values = self._values(len(keys), spec, rng)
        offsets = pa.array(np.r_[0, np.cumsum(counts)].astype(np.int32))
        return pa.MapArray.from_arrays(offsets, pa.array(keys, pa.string()), values), 0.1 * (counts - 2.5) / 2.5

    def _nested_map(self, n: int, spec: GenerateSpec, rng: np.random.Generator):
        """``pkey -> "skey:value,..."`` over ``keys`` (both levels)."""
        counts = rng.integers(0, 4, n)
        pkeys, inner = [], []
        for c in counts:
            for p in rng.choice(len(self.keys), c, replace=False):
                pkeys.append(self.keys[p])
                picked = rng.choice(len(self.keys), rng.integers(1, 4), replace=False)
                values = self._values(len(picked), spec, rng).to_pylist()
                inner.append(",".join(f"{self.keys[s]}:{v}" for s, v in zip(picked, values)))
        offsets = pa.array(np.r_[0, np.cumsum(counts)].astype(np.int32))
        return pa.MapArray.from_arrays(offsets, pa.array(pkeys, pa.string()), pa.array(inner, pa.string())), np.zeros(n)


class _Planner:
    """Works out every column's :class:`_Column` from the features that read it (the first
    feature to ask for a column decides its kind)."""

    def __init__(self, config: Config, spec: GenerateSpec):
        self.config = config
        self.spec = spec
        self.columns: dict[str, _Column] = {}
        self.by_name = {f.feature_name: f for f in config.features()}
        self.vocab_files_written: list[str] = []
        self._group_kinds = {
            n: kind
            for g in config.model.feature_groups
            if (kind := _group_kind(config, g.group_name))
            for n in g.feature_names
        }

    def add(self, name: str, **kw) -> None:
        if name not in self.columns:
            self.columns[name] = _Column(name, **kw)

    def plan(self) -> list[_Column]:
        for f in self.config.features():
            self.feature(f)
        for c in self.columns.values():  # a map is keyed by what its key inputs hold
            if c.key_sources:
                c.keys = list(dict.fromkeys(k for inp in c.key_sources for k in self._domain(inp)))
        sampler = self.config.data.negative_sampler
        if sampler is not None:  # the sampler's tables key items (and users) by integer ids
            fields = [sampler.item_id_field]
            if sampler.hard_negatives is not None:
                fields.append(sampler.hard_negatives.user_id_field)
            for name in fields:
                self.add(name, kind="ids")
                if self.columns[name].kind == "strings":
                    self.columns[name].kind = "ids"
        tdm = self.config.data.tdm_sampler
        if tdm is not None:  # the tree's leaves are integer ids, its inner nodes' ids above them
            self.add(tdm.item_id_field, kind="ids")
            items = self.columns[tdm.item_id_field]
            items.kind = "ids"
            # the inner nodes' ids (the largest item id + a code + 1) stay in the item's table
            items.vocabulary = max(2, items.vocabulary // TDM_ID_SHARE)
        candidate = self.config.candidate_feature()
        if candidate is not None:
            f = self.by_name[candidate]
            column = None
            if isinstance(f, SequenceFeatureCfg) and not f.input.feature:
                column = self.columns.get(f.input.name)
            if column is None or column.sequence_length is None or column.kind not in ("ids", "strings", "words"):
                raise ValueError(
                    f"make-data: the candidates' feature '{candidate}' must read a column of id sequences (its labels "
                    "are lists, one value an element)"
                )
            column.candidates = True
        return list(self.columns.values())

    def _domain(self, inp: Input) -> list[str]:
        if inp.feature:  # a feature's outputs: ids below its table's rows, in decimal
            ref = self.by_name[inp.name]
            rows = ref.table_rows if ref.embedded and not ref.dynamic else None
            return [str(i) for i in range(min(rows or KEYS, KEYS))]
        return self.columns[inp.name].domain()

    def _rows(self, f: Feature) -> int:
        rows = f.table_rows if f.embedded and not f.dynamic else None
        return min(self.spec.vocabulary, rows) if rows else self.spec.vocabulary

    def _ids(self, f: Feature, name: str, separator: Optional[str], sequence_length: Optional[int] = None) -> None:
        """The column of an id-like feature (``f``'s bucketizer decides what it holds)."""
        kind = f.bucketizer
        common: dict[str, Any] = {"separator": separator, "sequence_length": sequence_length}
        if isinstance(f, SequenceFeatureCfg) and f.several_ids_an_element:
            common["element_separator"] = f.value_separator
        if kind in ("vocab_list", "vocab_dict", "vocab_file"):
            self.add(name, kind="words", words=self._words(f), **common)
        elif isinstance(f, IdFeatureCfg) and f.weighted:
            self.add(name, kind="weighted", separator=f.separator or "\x1d", vocabulary=self._rows(f))
        elif f.hashed:
            self.add(name, kind="strings", **common)
        else:
            self.add(name, kind="ids", vocabulary=self._rows(f), **common)

    def _words(self, f: Feature) -> list[str]:
        """The words of a vocabulary feature (a vocab_file that does not exist is written)."""
        if f.bucketizer == "vocab_list":
            return list(getattr(f, "vocab_list"))  # noqa: B009
        if f.bucketizer == "vocab_dict":
            return list(getattr(f, "vocab_dict"))  # noqa: B009
        path = Path(getattr(f, "vocab_file"))  # noqa: B009
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(f"{f.feature_name}_w{i}\n" for i in range(VOCAB_FILE_WORDS)))
            self.vocab_files_written.append(str(path))
        words = [line.split()[0] for line in path.read_text(encoding="utf-8").splitlines() if line.split()]
        return words or [f"{f.feature_name}_w0"]

    def _column_of(self, inp: Input) -> Optional[str]:
        return None if inp.feature else inp.name

    def feature(self, f: Feature) -> None:
        if isinstance(f, (IdFeatureCfg, SequenceFeatureCfg)):
            name = self._column_of(f.input)
            if name is None:
                return
            if isinstance(f, IdFeatureCfg) and f.boundaries is not None:
                self.add(name, kind="number")
            elif isinstance(f, SequenceFeatureCfg):
                self._ids(f, name, f.separator, f.sequence_length)
            else:
                self._ids(f, name, f.separator)
        elif isinstance(f, RawFeatureCfg):
            name = self._column_of(f.input)
            if name is not None:
                self.add(name, kind="vector" if f.value_dim > 1 else "number", value_dim=f.value_dim)
        elif isinstance(f, SequenceRawFeatureCfg):
            name = self._column_of(f.input)
            if name is not None:
                held = self._group_kinds.get(f.feature_name)
                kind = held if held is not None and f.value_dim == 1 else "dense_sequence"
                self.add(name, kind=kind, value_dim=f.value_dim, sequence_length=f.sequence_length)
        elif isinstance(f, ComboFeatureCfg):
            for inp in f.inputs:
                if not inp.feature:
                    self.add(inp.name, kind="strings")
        elif isinstance(f, LookupFeatureCfg):
            key_input, map_input = parse_input(f.key), parse_input(f.map)
            if not key_input.feature:
                self.add(key_input.name, kind="keys")
            if not map_input.feature:
                self.add(map_input.name, kind="map", key_sources=[key_input], **self._map_values(f))
        elif isinstance(f, MatchFeatureCfg):
            refs = [parse_input(r) for r in (f.pkey, f.skey) if r != "ALL"]
            for inp in refs:
                if not inp.feature:
                    self.add(inp.name, kind="keys")
            nested = parse_input(f.nested_map)
            if not nested.feature:
                self.add(nested.name, kind="nested_map", key_sources=refs, **self._map_values(f))
        elif isinstance(f, ExprFeatureCfg):
            for inp in f.inputs:
                if not inp.feature:
                    self.add(inp.name, kind="number")
        elif isinstance(f, CustomFeatureCfg):
            for inp in f.inputs:
                if not inp.feature:
                    self.add(inp.name, kind="text")
        elif isinstance(f, OverlapFeatureCfg):
            for inp in f.inputs:
                if not inp.feature:
                    self.add(
                        inp.name, kind="sentence", words=LEXICON[:10], separator=f.separator, sequence_length=TERMS
                    )
        elif isinstance(f, KvDotProductCfg):
            terms = [f"k{i}{f.kv_delimiter}{(i % 4 + 1) / 4}" for i in range(10)]
            for inp in f.inputs:
                if not inp.feature:
                    self.add(inp.name, kind="sentence", words=terms, separator=f.separator, sequence_length=TERMS)
        elif isinstance(f, BoolMaskFeatureCfg):
            values, mask = f.inputs
            if not values.feature:
                self._ids(f, values.name, f.separator, MASKED)
            if not mask.feature:
                self.add(mask.name, kind="mask", separator=f.separator, sequence_length=MASKED)
        elif isinstance(f, TokenizeFeatureCfg):
            name = self._column_of(f.input)
            if name is not None:
                self._tokenizer_file(f)
                self.add(name, kind="sentence", words=LEXICON, separator=" ", sequence_length=TEXT_WORDS)

    def _tokenizer_file(self, f: TokenizeFeatureCfg) -> None:
        """A tokenize feature's tokenizer, trained on the lexicon (after the feature's
        normalizer) and written where the config names it, when it does not exist."""
        path = Path(f.vocab_file)
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        words = sorted({f.normalize(w) for w in LEXICON} - {""})
        if f.tokenizer_type == "bpe":
            from tokenizers import Tokenizer, models, pre_tokenizers, trainers

            tok = Tokenizer(models.BPE(unk_token="[UNK]"))
            tok.pre_tokenizer = pre_tokenizers.Whitespace()
            tok.train_from_iterator(words, trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"]))
            tok.save(str(path))
        else:
            import io

            import sentencepiece

            model = io.BytesIO()
            sentencepiece.SentencePieceTrainer.train(
                sentence_iterator=iter(words), model_writer=model, vocab_size=200, hard_vocab_limit=False,
                minloglevel=2,
            )  # fmt: skip
            path.write_bytes(model.getvalue())
        self.vocab_files_written.append(str(path))

    def _map_values(self, f: Union[LookupFeatureCfg, MatchFeatureCfg]) -> dict:
        if not f.discrete:
            if f.value_dim > 1:
                sep = getattr(f, "value_separator")  # noqa: B009 - a lookup's (value_dim > 1)
                return {"map_value": "vector", "value_dim": f.value_dim, "value_separator": sep}
            return {"map_value": "number"}
        if f.bucketizer in ("vocab_list", "vocab_dict", "vocab_file"):
            return {"map_value": "words", "words": self._words(f)}
        if f.bucketizer == "num_buckets":
            return {"map_value": "ids", "vocabulary": self._rows(f)}
        return {"map_value": "strings"}


def _table(
    columns: list[_Column], config: Config, n: int, spec: GenerateSpec, rng: np.random.Generator
) -> tuple[pa.Table, np.ndarray]:
    """``n`` rows of ``columns`` and their labels; and the labels' click probabilities (one a
    candidate for a model that scores each row's candidates, whose labels are lists)."""
    data: dict[str, pa.Array] = {}
    logit = np.full(n, -1.0)
    lengths: dict[int, np.ndarray] = {}
    counts, candidate_share = None, np.zeros(0)  # each row's candidates, each candidate's share
    for c in columns:
        values, share = c.draw(n, spec, rng, lengths)
        data[c.name] = values
        if c.candidates:  # a logit a candidate: its row's and its own share
            assert c.sequence_length is not None
            counts, candidate_share = lengths[c.sequence_length], share
        else:
            logit += share
    if counts is not None:
        logit = np.repeat(logit, counts) + candidate_share
    p = 1.0 / (1.0 + np.exp(-logit))
    for name, values in _labels(config, logit, p, rng).items():
        data[name] = pa.array(values)
        if counts is not None:  # a list a row, one value a candidate
            data[name] = pa.ListArray.from_arrays(pa.array(np.r_[0, np.cumsum(counts)].astype(np.int32)), data[name])
    group = config.eval.grouped_auc_field
    if group and group not in data:
        data[group] = pa.array(rng.integers(0, max(n // 20, 1), n))
    return pa.table(data), p


def _labels(config: Config, logit: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Every label column of ``config``: the first a click drawn with probability ``p``; a later
    binary label a rarer event that needs the click (a purchase: ``sigmoid(logit - k)`` of its
    own, ``k`` its position); a bitmask label (``task_bitmask``) bit ``b`` of its tasks' masks
    set with probability ``sigmoid(logit - b)``; a class label the quantile bucket of a noisy
    ``logit``; any other (a regression target, an indicator) ``logit`` plus noise; PEPNet's domain
    label a domain drawn uniformly (its column is often a feature's too, which then reads the
    domain)."""
    rules = label_rules(config.tasks())
    bits: dict[str, int] = {}  # a bitmask label's: up to its tasks' highest bit
    for t in config.tasks():
        if t.task_bitmask:
            bits[t.label_name] = max(bits.get(t.label_name, 1), t.task_bitmask.bit_length())
    pepnet = config.model.pepnet
    out: dict[str, np.ndarray] = {}
    for k, name in enumerate(config.label_fields()):
        classes = rules.get(name, (None, ""))[0]
        if pepnet is not None and name == pepnet.domain_label and name not in rules:
            out[name] = rng.integers(0, pepnet.task_domain_num, p.size)
        elif k == 0 and classes == 2:
            out[name] = (rng.random(p.size) < p).astype(np.int64)
        elif classes == 2:
            own = 1.0 / (1.0 + np.exp(-(logit - k)))
            out[name] = ((rng.random(p.size) < own) & (next(iter(out.values())) > 0)).astype(np.int64)
        elif classes == 0:  # a bitmask: the first bit the most frequent
            set_bit = rng.random((bits[name], p.size)) < 1.0 / (1.0 + np.exp(-(logit - np.arange(bits[name])[:, None])))
            out[name] = (set_bit.astype(np.int64) << np.arange(bits[name])[:, None]).sum(axis=0)
        elif classes is not None:
            noisy = logit + rng.normal(0.0, 0.5, p.size)
            edges = np.quantile(noisy, np.linspace(0, 1, classes + 1)[1:-1]) if p.size else np.zeros(classes - 1)
            out[name] = np.searchsorted(edges, noisy).astype(np.int64)
        else:
            out[name] = logit + rng.normal(0.0, 0.5, p.size)
    return out


def make_config_data(config: Config, out_dir: Union[str, Path], spec: GenerateSpec = GenerateSpec()) -> dict:
    """Writes ``train/part-*.parquet``, ``eval/part-0.parquet`` and ``meta.json`` under
    ``out_dir`` with every column ``config`` reads; returns the metadata (rows, click rate,
    Bayes-optimal eval AUC, the vocabulary files it wrote). Written under a temporary name and
    renamed into place; an existing ``out_dir`` is replaced only when empty or generated data (its
    ``meta.json`` lists its files, and it holds no other)."""
    target = Path(out_dir)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} is a file; make-data writes a directory")
    _check_side_tables_apart(config)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        rng = np.random.default_rng(spec.seed)
        planner = _Planner(config, spec)
        columns = planner.plan()
        (tmp / "train").mkdir(parents=True)
        (tmp / "eval").mkdir()
        per_file = -(-spec.train_rows // spec.train_files)
        # the click: its rate and Bayes AUC go in meta.json (a semantic-ID model reads no label)
        first_label = next(iter(config.label_fields()), None)
        bitmask = first_label is not None and label_rules(config.tasks()).get(first_label, (None, ""))[0] == 0
        clicks = examples = 0
        sampler = config.data.negative_sampler
        item_columns = []
        if sampler is not None:
            item_columns = [sampler.item_id_field, *sampler.attr_fields]
        elif config.data.tdm_sampler is not None:
            item_columns = config.data.tdm_sampler.item_columns
        tables: list[pa.Table] = []
        users: list[pa.ChunkedArray] = []
        for i in range(spec.train_files):
            rows = min(per_file, spec.train_rows - i * per_file)
            if rows <= 0:
                break
            table, _ = _table(columns, config, rows, spec, rng)
            if first_label is not None:
                click = _clicks(table.column(first_label), bitmask)
                clicks, examples = clicks + int(np.sum(click)), examples + click.size
            pq.write_table(table, tmp / "train" / f"part-{i}.parquet")
            if item_columns:  # the items' columns, for the sampler's item table or tree
                tables.append(table.select(item_columns))
            if sampler is not None:
                if sampler.hard_negatives is not None:
                    users.append(table.column(sampler.hard_negatives.user_id_field))
        table, p = _table(columns, config, spec.eval_rows, spec, rng)
        pq.write_table(table, tmp / "eval" / "part-0.parquet")
        if item_columns:
            tables.append(table.select(item_columns))
        items_written = _write_item_table(config, tables, target, tmp)
        tree_written = _write_tree(config, tables, target, tmp)
        edges_written = _write_edge_table(config, users, tables, target, tmp, rng)
        meta: dict[str, Any] = {
            "generator": "config",
            "columns": [c.name for c in columns],
            "train_rows": spec.train_rows,
            "eval_rows": spec.eval_rows,
        }
        if first_label is not None:
            labels = _clicks(table.column(first_label), bitmask)
            meta["train_click_rate"] = clicks / max(examples, 1)
            meta["eval_click_rate"] = float(np.mean(labels))
            meta["bayes_optimal_eval_auc"] = auc(p, labels)
        meta.update(
            {
                "vocab_files_written": planner.vocab_files_written,
                "item_table_written": items_written,
                "tree_written": tree_written,
                "edge_table_written": edges_written,
            }
        )
        meta["files"] = relative_files(tmp)  # what a later make-data may replace
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        fsync_tree(tmp)
        replace_dir(tmp, target, "meta.json", "synthetic data directory")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _check_side_tables_apart(config: Config) -> None:
    """ValueError, before anything is written, where a sampler's table lies where the config's
    training or eval data is read: training would read it as a data file."""
    data = config.data
    inputs = [("data.train_input_path", data.train_input_path), ("data.eval_input_path", data.eval_input_path)]
    for side, path in data.side_tables():
        for name, given in inputs:
            for p in [given] if isinstance(given, str) else given or []:
                if lists_as_data(p, path):
                    raise ValueError(
                        f"{side} {path} lies where {name} ({p}) reads data: training would read the sampler's table "
                        "as a data file; give it a path outside the data directories"
                    )


def _clicks(column: pa.ChunkedArray, bitmask: bool) -> np.ndarray:
    """A label's values, one an example (a candidate's, for a list a row); a bitmask's bit 0 (the
    one set with probability ``sigmoid(logit)``)."""
    if pa.types.is_list(column.type):
        column = pc.list_flatten(column)
    x = column.to_numpy()
    return x & 1 if bitmask else x


def _write_item_table(config: Config, tables: list[pa.Table], target: Path, tmp: Path) -> Optional[str]:
    """A retrieval config's item table (``data.negative_sampler.input_path``), where it does not
    exist or lies inside the data directory ``target`` (written into ``tmp``, which replaces it):
    every item of ``tables``, weight 1, its attributes as first seen, in graph-learn's text layout
    (dynarec.data.sampler). Returns its path, or None when nothing was written."""
    sampler = config.data.negative_sampler
    if sampler is None:
        return None
    path = Path(sampler.input_path).absolute()
    inside = path.is_relative_to(target.absolute())
    if path.exists() and not inside:
        return None
    rows = pa.concat_tables(tables)
    columns = [rows.column(j) for j in range(rows.num_columns)]
    candidate = config.candidate_feature()
    if candidate is not None:  # hstu_match: each row holds several items (its positives)
        separator = config.feature(candidate).separator
        columns = [sequence_elements(c, separator) for c in columns]
    ids = columns[0].combine_chunks().cast(pa.int64()).to_numpy(zero_copy_only=False)
    _, first = np.unique(ids, return_index=True)
    attrs = []
    for j in range(len(sampler.attr_fields)):
        col = columns[1 + j].combine_chunks().take(pa.array(first))
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            col = pc.binary_join(col.cast(pa.list_(pa.string())), MULTI_VALUE_SEPARATOR)
        values = col.cast(pa.string())
        if values.null_count or pc.any(pc.match_substring(values, sampler.attr_delimiter)).as_py():
            raise ValueError(
                f"data.negative_sampler.attr_fields: column '{sampler.attr_fields[j]}' holds a missing value or one "
                f"with the attr_delimiter {sampler.attr_delimiter!r}; the item table cannot carry it (choose "
                "another attr_delimiter)"
            )
        attrs.append(values.to_pylist())
    destination = tmp / path.relative_to(target.absolute()) if inside else path
    write_item_table(sampler, ids[first], np.ones(len(first)), [list(a) for a in zip(*attrs)], destination)
    return sampler.input_path


def _write_tree(config: Config, tables: list[pa.Table], target: Path, tmp: Path) -> Optional[dict[str, Any]]:
    """A TDM config's tree (``data.tdm_sampler``'s node and edge tables), where they do not exist
    or lie inside the data directory ``target``: TorchEasyRec's initial tree (binary, the items
    sorted by their first attribute, then id) over every item of ``tables``, its attributes as
    first seen. Returns ``{path, items, levels}``, or None when nothing was written."""
    tdm = config.data.tdm_sampler
    if tdm is None:
        return None
    paths = [Path(tdm.item_input_path).absolute(), Path(tdm.edge_input_path).absolute()]
    inside = [p.is_relative_to(target.absolute()) for p in paths]
    kept = [p.exists() and not i for p, i in zip(paths, inside)]
    if all(kept):
        return None
    if any(kept):  # one table of a tree without the other: writing it would not match
        have, lack = ("item", "edge") if kept[0] else ("edge", "item")
        raise ValueError(
            f"data.tdm_sampler: {have}_input_path exists outside the data directory but {lack}_input_path does "
            "not; give both tables of one tree (dynarec tdm init-tree), or neither for make-data to write them"
        )
    rows = pa.concat_tables(tables)
    ids = rows.column(0).combine_chunks().cast(pa.int64()).to_numpy(zero_copy_only=False)
    _, first = np.unique(ids, return_index=True)
    index = pa.array(first)
    attrs = [node_attribute(rows.column(j).combine_chunks().take(index)) for j in range(1, rows.num_columns)]
    categories = attrs[0] if attrs else pa.array([""] * len(first))
    tree = init_tree(ids[first], categories, attrs, n_cluster=2)
    node, edge = (tmp / p.relative_to(target.absolute()) if i else p for p, i in zip(paths, inside))
    write_tree_tables(tree, node, edge, attr_delimiter=tdm.attr_delimiter)
    return {"path": tdm.item_input_path, "items": len(first), "levels": tree.num_levels}


EDGES_PER_USER = 3  # a user's hard negatives in a generated edge table


def _write_edge_table(
    config: Config, users: list[pa.ChunkedArray], tables: list[pa.Table], target: Path, tmp: Path, rng
) -> Optional[str]:
    """A hard-negative sampler's edge table (``data.negative_sampler.hard_negatives``), where it
    does not exist or lies inside ``target``: every user of the training data gets
    ``EDGES_PER_USER`` items of the catalog (drawn uniformly, weight 1), as ``write_edge_table``
    writes it (Parquet where the path ends in ``.parquet``). Returns its path, or None when
    nothing was written."""
    sampler = config.data.negative_sampler
    if sampler is None or sampler.hard_negatives is None:
        return None
    path = Path(sampler.hard_negatives.edge_input_path).absolute()
    inside = path.is_relative_to(target.absolute())
    if path.exists() and not inside:
        return None
    user_ids = np.unique(np.concatenate([u.cast(pa.int64()).to_numpy() for u in users]))
    item_ids = np.unique(np.concatenate([t.column(0).cast(pa.int64()).to_numpy() for t in tables]))
    src = np.repeat(user_ids, EDGES_PER_USER)
    dst = item_ids[rng.integers(0, len(item_ids), len(src))]
    destination = tmp / path.relative_to(target.absolute()) if inside else path
    write_edge_table(sampler, src, dst, destination)
    return sampler.hard_negatives.edge_input_path
