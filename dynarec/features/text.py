"""Text -> token ids for ``tokenize_feature``: TorchEasyRec's text normalizer, then a tokenizer
file read by the maintained library that made it.

- ``bpe``: a HuggingFace ``tokenizer.json``, read by HuggingFace ``tokenizers`` (the library
  pyfg's tokenizers-cpp wraps); ids without special tokens, the table's rows its vocabulary size
  with added tokens (tokenizers-cpp's ``GetVocabSize``).
- ``sentencepiece``: a SentencePiece ``.model``, read by ``sentencepiece``; rows its piece count.

The normalizer (:class:`TextNormalizer`) applies TorchEasyRec's ``norm_options`` in a fixed
order: ``TEXT_SBC2DBC`` (full-width ASCII and the ideographic space to their half-width forms),
``TEXT_CHT2CHS`` (traditional to simplified Chinese, OpenCC's ``t2s``), ``TEXT_LOWER2UPPER`` /
``TEXT_UPPER2LOWER``, ``TEXT_FILTER`` (removes the stop characters), ``TEXT_SPLITCHRS`` (each CJK
character its own space-separated word), ``TEXT_REMOVE_SPACE``. pyfg's normalizer is closed
source: the order, ``max_length`` (the first ``max_length`` characters are kept, before
normalizing) and the default stop characters (its built-in list is not published; here every
Unicode punctuation, symbol and control character) are dynarec's reading of its documentation
(docs/features.md says so).

Tokenizers and stop-character files are read once per process (:func:`tokenizer`).
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, get_args

import numpy as np

__all__ = [
    "NORM_OPTIONS",
    "NormOption",
    "TextNormalizer",
    "Tokenizer",
    "TokenizerError",
    "TokenizerType",
    "tokenizer",
]

TokenizerType = Literal["bpe", "sentencepiece"]

# TorchEasyRec's TextNormalizeOption names, in the order dynarec applies them.
NormOption = Literal[
    "TEXT_SBC2DBC",
    "TEXT_CHT2CHS",
    "TEXT_LOWER2UPPER",
    "TEXT_UPPER2LOWER",
    "TEXT_FILTER",
    "TEXT_SPLITCHRS",
    "TEXT_REMOVE_SPACE",
]
NORM_OPTIONS: tuple[str, ...] = get_args(NormOption)
# pyfg's options when a text_normalizer gives none (TorchEasyRec's documentation).
DEFAULT_NORM_OPTIONS = ("TEXT_LOWER2UPPER", "TEXT_SBC2DBC", "TEXT_CHT2CHS", "TEXT_FILTER")

# Full-width ASCII (U+FF01..U+FF5E) -> ASCII, the ideographic space -> a space.
_SBC2DBC = {c: c - 0xFEE0 for c in range(0xFF01, 0xFF5F)} | {0x3000: 0x20}
_CJK = re.compile(r"([\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002ebef])")
_SPACES = re.compile(r"\s+")


class TokenizerError(ValueError):
    """A tokenizer or stop-character file that cannot be read (named)."""


@functools.lru_cache(maxsize=8)
def _default_stop_chars() -> frozenset[str]:
    return frozenset(
        ch
        for ch in map(chr, range(0x110000))
        if unicodedata.category(ch)[0] in "PS" or (unicodedata.category(ch) in ("Cc", "Cf") and not ch.isspace())
    )


@functools.lru_cache(maxsize=32)
def _stop_chars(path: Optional[str]) -> dict[int, None]:
    """The characters ``TEXT_FILTER`` removes, as a ``str.translate`` table: every character of
    ``path``'s lines (one or more a line), or the default set."""
    if path is None:
        chars: frozenset[str] = _default_stop_chars()
    else:
        try:
            with open(path, encoding="utf-8") as fh:
                chars = frozenset(ch for line in fh for ch in line.rstrip("\r\n"))
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"stop_char_file {path!r} cannot be read ({e})") from None
    return dict.fromkeys(map(ord, chars))


@functools.lru_cache(maxsize=1)
def _t2s() -> Any:
    import opencc

    return opencc.OpenCC("t2s")


@dataclass(frozen=True)
class TextNormalizer:
    """TorchEasyRec's text normalizer: ``options`` (names of :data:`NORM_OPTIONS`; TorchEasyRec's
    defaults when empty), ``stop_char_file`` (the characters ``TEXT_FILTER`` removes) and
    ``max_length`` (characters kept, None: all)."""

    options: tuple[str, ...] = ()
    stop_char_file: Optional[str] = None
    max_length: Optional[int] = None

    def __post_init__(self):
        unknown = sorted(set(self.options) - set(NORM_OPTIONS))
        if unknown:
            raise ValueError(f"norm_options: {unknown} unknown; one of {list(NORM_OPTIONS)}")
        if {"TEXT_LOWER2UPPER", "TEXT_UPPER2LOWER"} <= set(self.options):
            raise ValueError("norm_options: TEXT_LOWER2UPPER and TEXT_UPPER2LOWER contradict each other (give one)")

    @property
    def effective_options(self) -> tuple[str, ...]:
        """The options applied, in order."""
        given = set(self.options or DEFAULT_NORM_OPTIONS)
        return tuple(o for o in NORM_OPTIONS if o in given)

    def __call__(self, text: str) -> str:
        if self.max_length is not None:
            text = text[: self.max_length]
        for option in self.effective_options:
            if option == "TEXT_SBC2DBC":
                text = text.translate(_SBC2DBC)
            elif option == "TEXT_CHT2CHS":
                text = _t2s().convert(text)
            elif option == "TEXT_LOWER2UPPER":
                text = text.upper()
            elif option == "TEXT_UPPER2LOWER":
                text = text.lower()
            elif option == "TEXT_FILTER":
                text = text.translate(_stop_chars(self.stop_char_file))
            elif option == "TEXT_SPLITCHRS":
                text = _SPACES.sub(" ", _CJK.sub(r" \1 ", text)).strip()
            else:  # TEXT_REMOVE_SPACE
                text = _SPACES.sub("", text)
        return text


class Tokenizer:
    """One tokenizer file: :meth:`encode` turns texts into token ids; ``vocab_size`` is the
    table's rows."""

    def __init__(self, path: str, kind: TokenizerType):
        self.path, self.kind = path, kind
        try:
            if kind == "bpe":
                from tokenizers import Tokenizer as HFTokenizer

                self._hf = HFTokenizer.from_file(path)
                self.vocab_size = int(self._hf.get_vocab_size(with_added_tokens=True))
            else:
                import sentencepiece

                self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
                self.vocab_size = int(self._sp.get_piece_size())
        except Exception as e:  # each library raises its own types for a missing or malformed file
            what = "a HuggingFace tokenizer.json" if kind == "bpe" else "a SentencePiece model"
            raise TokenizerError(f"vocab_file {path!r} cannot be read as {what} (tokenizer_type {kind}): {e}") from None

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, lengths)``: every text's token ids (int64, concatenated in order) and their
        counts per text (int64)."""
        if self.kind == "bpe":
            encoded = [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]
        else:
            encoded = self._sp.encode(list(texts))
        lengths = np.fromiter((len(e) for e in encoded), np.int64, len(encoded))
        ids = np.fromiter((i for e in encoded for i in e), np.int64, int(lengths.sum()))
        return ids, lengths

    def __reduce__(self):  # DataLoader workers load the file themselves (once per process)
        return tokenizer, (self.path, self.kind)


@functools.lru_cache(maxsize=32)
def tokenizer(path: str, kind: TokenizerType = "bpe") -> Tokenizer:
    """The tokenizer of ``path`` (read once per process); TokenizerError naming the file."""
    return Tokenizer(path, kind)
