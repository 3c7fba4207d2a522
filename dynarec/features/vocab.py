"""Vocabularies: words -> ids for ``vocab_list``, ``vocab_dict`` and ``vocab_file`` features, with
TorchEasyRec's conventions (docs/features.md, docs/tzrec_features_spec.md §1.4).

A :class:`Vocabulary` looks a whole column of words up at once in C++ (pyarrow's ``index_in``).
A vocabulary file is read once per process (and again when it changes on disk).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["OOV", "Vocabulary", "VocabularyError", "read_vocab_file"]

OOV = "<OOV>"


class VocabularyError(ValueError):
    """A vocabulary file that cannot be read, or a malformed line of it (named)."""


@dataclass(frozen=True)
class Vocabulary:
    """``words`` (unique) have ``ids``; any other word gets ``unknown``; the table has ``rows``."""

    words: pa.Array
    ids: np.ndarray
    unknown: int
    rows: int

    @classmethod
    def _of(cls, mapping: Mapping[str, int], unknown: int, rows: int) -> Vocabulary:
        return cls(
            pa.array(list(mapping), pa.string()), np.fromiter(mapping.values(), np.int64, len(mapping)), unknown, rows
        )

    @classmethod
    def from_list(cls, words: Sequence[str], default_value: Optional[str], default_bucketize_value: Optional[int]):
        """TorchEasyRec's ``vocab_list``: without ``default_bucketize_value`` the list becomes
        ``[default_value, "<OOV>", *words]`` (word ``i`` -> ``i + 2``, unknown -> 1, the default
        -> 0; a word given twice takes its later index); with it, word ``i`` -> ``i`` and unknown
        -> ``default_bucketize_value``."""
        if default_bucketize_value is None:
            full = [default_value or "", OOV, *words]
            return cls._of({w: i for i, w in enumerate(full)}, 1, len(words) + 2)
        return cls._of({w: i for i, w in enumerate(words)}, default_bucketize_value, len(words))

    @classmethod
    def from_dict(
        cls, words: Mapping[str, int], default_value: Optional[str], default_bucketize_value: Optional[int]
    ) -> Vocabulary:
        """TorchEasyRec's ``vocab_dict``: the word's id; unknown -> ``default_bucketize_value``,
        else 1 (and a non-empty ``default_value`` -> 0). Rows: the largest id (or the unknown id)
        plus one."""
        mapping = dict(words)
        if default_bucketize_value is None:
            if default_value:
                mapping[default_value] = 0
            return cls._of(mapping, 1, max(max(mapping.values()) + 1, 2))
        return cls._of(mapping, default_bucketize_value, max(max(mapping.values()), default_bucketize_value) + 1)

    def lookup(self, tokens: pa.Array) -> np.ndarray:
        """The id of every word of a string array (no nulls), int64."""
        if len(tokens) == 0:
            return np.empty(0, dtype=np.int64)
        index = pc.fill_null(pc.index_in(tokens, value_set=self.words), -1).to_numpy(zero_copy_only=False)
        return np.where(index >= 0, self.ids[np.maximum(index, 0)], self.unknown).astype(np.int64)


_cache: dict[tuple, Vocabulary] = {}
_lock = threading.Lock()


def read_vocab_file(path: str, default_bucketize_value: int) -> Vocabulary:
    """TorchEasyRec's ``vocab_file``: one word a line (its id: the line's index among the
    non-blank lines, from 0) or ``word id`` (whitespace between); unknown ->
    ``default_bucketize_value``. Rows: the largest id (or the unknown id) plus one. Read once per
    process while the file is unchanged; VocabularyError naming the path (and line) otherwise."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise VocabularyError(f"vocab_file '{path}' cannot be read: {e.strerror or e}") from None
    key = (os.path.abspath(path), st.st_mtime_ns, st.st_size, default_bucketize_value)
    with _lock:
        if key in _cache:
            return _cache[key]
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise VocabularyError(f"vocab_file '{path}' cannot be read: {e}") from None
    mapping: dict[str, int] = {}
    index = 0
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) == 1:
            mapping[fields[0]] = index
        elif len(fields) == 2 and _is_id(fields[1]):
            mapping[fields[0]] = int(fields[1])
        else:
            raise VocabularyError(
                f"vocab_file '{path}', line {number}: {line!r} is neither a word nor 'word id' (a non-negative integer)"
            )
        index += 1
    if not mapping:
        raise VocabularyError(f"vocab_file '{path}' holds no words")
    vocab = Vocabulary._of(mapping, default_bucketize_value, max(max(mapping.values()), default_bucketize_value) + 1)
    with _lock:
        _cache[key] = vocab
    return vocab


def _is_id(s: str) -> bool:
    return s.isdigit() and s.isascii()
