"""The feature kinds of the YAML config (``feature_configs``): one typed block per kind, with
TorchEasyRec's fields and meanings (docs/features.md; TorchEasyRec's semantics with citations in
docs/tzrec_features_spec.md). Unknown keys are errors by path, as everywhere in the config.

Every feature class exposes one interface, which the planner, the batch builder and the models
rely on:

- ``feature_name``; ``KIND`` (its YAML key, e.g. ``"lookup_feature"``);
- ``inputs``: what it reads, as :class:`Input` (a column, or ``feature:<name>``: another feature's
  output after its bucketizer); ``columns``: the input columns; ``feature_inputs``: the features;
- ``embedded``: True when it feeds ids to a table (then ``table_name``, ``table_rows`` (None for
  a dynamic table), ``dynamic_table`` (the dynamic table's options: ``dynamicemb``, or ``zch``
  mapped onto one), ``pooling``, ``trainable``, ``initializer``, ``backend``, ``sharding``);
- ``is_sequence``; ``value_dim`` (numbers per row, or per sequence element; 1 by default);
  ``embedding_dim``; ``dense_embedding`` (``"autodis"``, ``"mlp"`` or None).

A feature's table comes from its **bucketizer**, exactly one of ``num_buckets``,
``hash_bucket_size``, ``vocab_list``, ``vocab_dict``, ``vocab_file``, ``boundaries``,
``dynamicemb``, ``zch`` (each kind takes the ones TorchEasyRec's does); a kind that can also be
dense (raw, lookup, match, expr, custom, sequence_raw) is dense without one.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BeforeValidator, Field, StrictInt, model_validator

from dynarec.config.base import Count, DynamicEmbField, InitializerField, NotBoolean, Strict, exactly_one
from dynarec.embedding.config import Backend, DynamicTableOptions, RowDtype, ShardingType
from dynarec.features.expression import Expression
from dynarec.features.hashing import HashFunction
from dynarec.features.text import NormOption, TextNormalizer, Tokenizer, TokenizerType, tokenizer
from dynarec.features.vocab import Vocabulary, read_vocab_file

__all__ = [
    "BUCKETIZERS",
    "CUSTOM_OPERATORS",
    "FEATURE_KINDS",
    "TABLE_SETTINGS",
    "AutoDisCfg",
    "BoolMaskFeatureCfg",
    "ComboFeatureCfg",
    "CustomFeatureCfg",
    "ExprFeatureCfg",
    "Feature",
    "FeatureCfg",
    "IdFeatureCfg",
    "Input",
    "KvDotProductCfg",
    "LookupFeatureCfg",
    "MatchFeatureCfg",
    "MlpCfg",
    "NormalizerCfg",
    "OverlapFeatureCfg",
    "RawFeatureCfg",
    "SequenceFeatureCfg",
    "SequenceRawFeatureCfg",
    "TextNormalizerCfg",
    "TokenizeFeatureCfg",
    "ValueType",
    "ZchCfg",
    "check_features",
    "dependency_order",
]

ValueType = Literal["int", "string"]

# Every bucketizer, in TorchEasyRec's priority order (a kind takes a subset).
BUCKETIZERS = (
    "zch",
    "dynamicemb",
    "hash_bucket_size",
    "num_buckets",
    "vocab_list",
    "vocab_dict",
    "vocab_file",
    "boundaries",
)

SIDES = ("user", "item", "context")
TZREC_SEPARATOR = "\x1d"  # TorchEasyRec's multi-value separator


@dataclass(frozen=True)
class Input:
    """One input of a feature: a column of the data, or (``feature``) another feature's output
    after its bucketizer."""

    name: str
    feature: bool = False

    def __str__(self) -> str:
        return f"feature:{self.name}" if self.feature else self.name


def parse_input(text: str) -> Input:
    """``"side:column"`` (side user, item or context: the column), ``"feature:name"`` (a
    feature's output) or a bare column name -> :class:`Input`; ValueError naming the form."""
    side, sep, name = text.partition(":")
    if not sep:
        if not text:
            raise ValueError("an input must name a column ('side:column') or a feature ('feature:name'), got ''")
        return Input(text)
    if side == "feature" and name:
        return Input(name, feature=True)
    if side in SIDES and name:
        return Input(name)
    raise ValueError(
        f"an input must be 'side:column' with side one of {list(SIDES)} (a column of the input), 'feature:name' "
        f"(another feature's output) or a column name, got {text!r}"
    )


def _word(value: Any) -> Any:
    """A vocabulary word: YAML's integers become their decimal string (TorchEasyRec's words are
    strings); bools and floats are left for pydantic to refuse."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


Word = Annotated[str, BeforeValidator(_word)]
NonNegative = Annotated[StrictInt, Field(ge=0)]


class NormalizerCfg(Strict):
    """``x -> expression(x)`` (e.g. ``"log(x+3)"``, :mod:`dynarec.features.expression`: one variable
    ``x``) or ``log1p(x)`` (when ``log1p``), then ``(x - mean) / std``."""

    expression: Optional[str] = None
    log1p: bool = False
    mean: float = 0.0
    std: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _valid_expression(self):
        if self.expression is not None:
            if self.log1p:
                raise ValueError("give expression or log1p, not both")
            Expression(self.expression)
        return self


class AutoDisCfg(Strict):
    """TorchEasyRec's AutoDis embedding of one number a row (the model applies it)."""

    num_channels: Count
    temperature: float = Field(0.1, gt=0)
    keep_prob: float = Field(0.8, ge=0, le=1)


class MlpCfg(Strict):
    """TorchEasyRec's ``mlp {}``: a linear map of the numbers to ``embedding_dim`` (the model
    applies it)."""


class ZchDecayCfg(Strict):
    decay_exponent: float = Field(1.0, gt=0)


class ZchEmpty(Strict):
    pass


ZCH_MIN_SIZE = 16  # a dynamic table's smallest capacity: one bucket of 16 slots


class ZchCfg(Strict):
    """TorchEasyRec's managed-collision table, accepted and mapped onto a dynamic table of
    ``zch_size`` rows (``max_capacity``): ``lfu`` and ``distance_lfu`` evict the least frequent
    rows (score ``lfu``), ``lru`` the least recently used (score ``step``). What differs from
    TorchEasyRec is in docs/features.md: every key gets a row at once (no last-row bucket for
    keys not yet admitted), eviction happens on insert when the table is full (not every
    ``eviction_interval`` steps), ``decay_exponent`` is not used."""

    zch_size: Count
    eviction_interval: Count = 5
    lfu: Optional[ZchEmpty] = None
    lru: Optional[ZchDecayCfg] = None
    distance_lfu: Optional[ZchDecayCfg] = None
    threshold_filtering_func: Optional[str] = None

    @model_validator(mode="after")
    def _one_policy(self):
        exactly_one(self, ("lfu", "lru", "distance_lfu"))
        if self.threshold_filtering_func is not None:
            raise ValueError(
                "threshold_filtering_func (a Python lambda TorchEasyRec evaluates) is not supported; a dynamic "
                "table's admission threshold does the same: give dynamicemb {admission: {threshold: N}} instead of zch"
            )
        if self.zch_size < ZCH_MIN_SIZE:
            raise ValueError(
                f"zch_size must be at least {ZCH_MIN_SIZE} (a dynamic table's bucket), got {self.zch_size}"
            )
        return self

    def dynamic_table(self) -> DynamicTableOptions:
        return DynamicTableOptions(max_capacity=self.zch_size, score_strategy="step" if self.lru else "lfu")


class _Feature(Strict):
    """What every kind has: its name, and the interface of the module doc."""

    feature_name: str
    embedding_dim: Optional[Count] = None

    KIND: ClassVar[str] = ""
    is_sequence: ClassVar[bool] = False
    # The bucketizers this kind takes (TorchEasyRec's priority order), and whether it needs one.
    TABLE_KINDS: ClassVar[tuple[str, ...]] = ()
    NEEDS_TABLE: ClassVar[bool] = False

    # -- inputs ----------------------------------------------------------------------------

    @property
    def inputs(self) -> tuple[Input, ...]:
        raise NotImplementedError

    @property
    def columns(self) -> tuple[str, ...]:
        """The input columns it reads (each once, in order)."""
        return tuple(dict.fromkeys(i.name for i in self.inputs if not i.feature))

    @property
    def feature_inputs(self) -> tuple[str, ...]:
        """The features whose outputs it reads (``feature:<name>`` inputs)."""
        return tuple(dict.fromkeys(i.name for i in self.inputs if i.feature))

    # -- table -----------------------------------------------------------------------------

    @property
    def bucketizer(self) -> Optional[str]:
        """The bucketizer field it gives (None: a dense feature)."""
        return next((k for k in self.TABLE_KINDS if getattr(self, k, None) is not None), None)

    @property
    def embedded(self) -> bool:
        """Whether it feeds ids to a table."""
        return self.bucketizer is not None

    @property
    def dense_embedding(self) -> Optional[str]:
        if getattr(self, "autodis", None) is not None:
            return "autodis"
        return "mlp" if getattr(self, "mlp", None) is not None else None

    @property
    def table_name(self) -> str:
        return getattr(self, "embedding_name", None) or self.feature_name

    @property
    def dynamic_table(self) -> Optional[DynamicTableOptions]:
        """A dynamic table's options: ``dynamicemb``, or ``zch`` mapped onto one (None for a
        fixed table or a dense feature)."""
        dynamic = getattr(self, "dynamicemb", None)
        if dynamic is not None:
            return dynamic
        zch = getattr(self, "zch", None)
        return zch.dynamic_table() if zch is not None else None

    @property
    def dynamic(self) -> bool:
        return self.dynamic_table is not None

    @property
    def table_rows(self) -> Optional[int]:
        """Rows of the feature's fixed table (None for a dynamic table or a dense feature). A
        ``vocab_file`` is read for it (once; a VocabularyError names an unreadable file)."""
        kind = self.bucketizer
        if kind in (None, "dynamicemb", "zch"):
            return None
        if kind in ("num_buckets", "hash_bucket_size"):
            return getattr(self, kind)
        if kind == "boundaries":
            return len(getattr(self, "boundaries")) + 1  # noqa: B009 - a field of the kinds that have it
        return self.vocabulary().rows

    @property
    def key_space(self) -> Optional[str]:
        """How values become a dynamic table's keys: ``"int"`` (integers as they are) or the hash
        of their string form (``"farmhash"`` / ``"murmur2"``); None for a fixed table."""
        if not self.dynamic:
            return None
        return getattr(self, "hash_function", "farmhash") if self.hashed else "int"

    @property
    def hashed(self) -> bool:
        """Whether values are hashed (their string form, with ``hash_function``): always with
        ``hash_bucket_size``; into a dynamic table unless the values are integer keys
        (``value_type: int``); into ``num_buckets`` with ``value_type: string``."""
        kind = self.bucketizer
        if kind == "hash_bucket_size":
            return True
        if kind in ("dynamicemb", "zch"):
            return self._string_keys
        return kind == "num_buckets" and getattr(self, "value_type", "int") == "string"

    @property
    def _string_keys(self) -> bool:
        return True  # kinds with a value_type say otherwise

    def vocabulary(self) -> Vocabulary:
        """The vocabulary of a ``vocab_list`` / ``vocab_dict`` / ``vocab_file`` feature (built
        once per process)."""
        dv: Optional[str] = getattr(self, "default_value", None)
        dbv: Optional[int] = getattr(self, "default_bucketize_value", None)
        kind = self.bucketizer
        if kind == "vocab_list":
            return _list_vocabulary(tuple(getattr(self, "vocab_list")), dv, dbv)  # noqa: B009
        if kind == "vocab_dict":
            return _dict_vocabulary(tuple(getattr(self, "vocab_dict").items()), dv, dbv)  # noqa: B009
        if kind == "vocab_file":
            assert dbv is not None
            return read_vocab_file(getattr(self, "vocab_file"), dbv)  # noqa: B009
        raise ValueError(f"feature '{self.feature_name}' has no vocabulary (its bucketizer: {kind})")

    # -- validation ------------------------------------------------------------------------

    @model_validator(mode="after")
    def _check(self):
        self._check_inputs()
        self._check_table()
        self._check_kind()
        return self

    def _check_inputs(self) -> None:
        self.inputs  # noqa: B018 - parses every input (ValueError naming a malformed one)

    def _check_table(self) -> None:
        given = [k for k in self.TABLE_KINDS if getattr(self, k, None) is not None]
        if len(given) > 1 or (self.NEEDS_TABLE and not given):
            raise ValueError(
                f"give {'exactly' if self.NEEDS_TABLE else 'at most'} one of {list(self.TABLE_KINDS)}"
                f" ({self._table_help()}), got {given or 'none'}"
            )

    def _table_help(self) -> str:
        return "the bucketizer: how values become ids of its table"

    def _check_kind(self) -> None:
        pass


@functools.lru_cache(maxsize=256)
def _list_vocabulary(words: tuple[str, ...], dv: Optional[str], dbv: Optional[int]) -> Vocabulary:
    return Vocabulary.from_list(words, dv, dbv)


@functools.lru_cache(maxsize=256)
def _dict_vocabulary(items: tuple[tuple[str, int], ...], dv: Optional[str], dbv: Optional[int]) -> Vocabulary:
    return Vocabulary.from_dict(dict(items), dv, dbv)


def _increasing(b: Optional[list[float]]) -> None:
    if b is not None and any(b[i] >= b[i + 1] for i in range(len(b) - 1)):
        raise ValueError(f"boundaries must be strictly increasing, got {b}")


# Fields that belong to a table, and their defaults: refused on a feature that has none (a value
# other than the default; a config dumped with its defaults loads back).
_TABLE_ONLY = {
    "embedding_name": None,
    "initializer": None,
    "backend": None,
    "sharding": None,
    "trainable": True,
    "pooling": "sum",
    "hash_function": "farmhash",
    "default_bucketize_value": None,
    "cache_load_factor": None,
    "data_type": "fp32",
}


class _Embeddable(_Feature):
    """The table fields and every bucketizer; each kind removes the bucketizers it does not take
    (a ``ClassVar`` of the same name: an unknown key)."""

    embedding_name: Optional[str] = None  # the table; features with the same name share it
    num_buckets: Optional[Count] = None  # a fixed table of this many rows, ids used as they are
    hash_bucket_size: Optional[Count] = None  # values hashed into this many rows
    vocab_list: Optional[list[Word]] = Field(None, min_length=1)
    vocab_dict: Optional[dict[str, NonNegative]] = Field(None, min_length=1)
    vocab_file: Optional[str] = None
    default_bucketize_value: Optional[NonNegative] = None  # the id of a word not in the vocabulary
    boundaries: Optional[list[float]] = Field(None, min_length=1)  # numbers -> bucket ids
    dynamicemb: Optional[DynamicEmbField] = None  # a dynamic table (the core's own type)
    zch: Optional[ZchCfg] = None  # TorchEasyRec's managed-collision table -> a dynamic table
    hash_function: HashFunction = "farmhash"
    pooling: Literal["sum", "mean"] = "sum"
    initializer: Optional[InitializerField] = None
    backend: Optional[Backend] = None  # default: train.sparse_backend
    sharding: Optional[ShardingType] = None  # default: the planner decides (multi-process runs)
    trainable: bool = True  # false: the table keeps its initial (or loaded) rows
    data_type: RowDtype = "fp32"  # fp16 / bf16: half-precision rows, stochastically rounded
    # A table's rows in host memory, this share of them cached on the device (None: all there)
    cache_load_factor: Annotated[Optional[float], NotBoolean] = Field(None, gt=0, le=1)

    def _check_table(self) -> None:
        super()._check_table()
        kind = self.bucketizer
        _increasing(getattr(self, "boundaries", None))
        if kind is None:
            fields = type(self).model_fields
            given = sorted(k for k, default in _TABLE_ONLY.items() if k in fields and getattr(self, k) != default)
            if given:
                raise ValueError(
                    f"{', '.join(given)}: belong(s) to a feature with a table; give one of {list(self.TABLE_KINDS)}"
                )
            return
        if self.embedding_dim is None:
            raise ValueError(f"embedding_dim: a feature with a table ({kind}) needs it")
        dbv = self.default_bucketize_value
        if dbv is not None and kind not in ("vocab_list", "vocab_dict", "vocab_file"):
            raise ValueError(f"default_bucketize_value belongs to vocab_list, vocab_dict and vocab_file, not {kind}")
        if kind == "vocab_file" and dbv is None:
            raise ValueError("vocab_file needs default_bucketize_value (the id of a word not in the file)")
        if kind == "vocab_list" and dbv is not None and dbv >= len(self.vocab_list or ()):
            raise ValueError(
                f"default_bucketize_value {dbv} must be below the vocab_list's length {len(self.vocab_list or ())} "
                "(with it, the words take ids 0..len-1 and the table has len rows)"
            )


class _Numbers(_Embeddable):
    """A kind whose values are numbers: ``boundaries`` is its one bucketizer (the others are
    unknown keys)."""

    TABLE_KINDS: ClassVar[tuple[str, ...]] = ("boundaries",)
    num_buckets: ClassVar[None] = None  # type: ignore[misc]
    hash_bucket_size: ClassVar[None] = None  # type: ignore[misc]
    vocab_list: ClassVar[None] = None  # type: ignore[misc]
    vocab_dict: ClassVar[None] = None  # type: ignore[misc]
    vocab_file: ClassVar[None] = None  # type: ignore[misc]
    default_bucketize_value: ClassVar[None] = None  # type: ignore[misc]
    dynamicemb: ClassVar[None] = None  # type: ignore[misc]
    zch: ClassVar[None] = None  # type: ignore[misc]
    hash_function: ClassVar[HashFunction] = "farmhash"  # type: ignore[misc]


class _SingleInput(_Feature):
    """A feature of one input: ``input_name`` (a column; default ``feature_name``), or
    TorchEasyRec's ``expression: "side:column"`` (e.g. ``"user:user_id"``) or ``"feature:name"``."""

    input_name: Optional[str] = None
    expression: Optional[str] = None

    def _check_inputs(self) -> None:
        if self.expression is not None and self.input_name is not None:
            raise ValueError("give input_name or expression, not both")
        super()._check_inputs()

    @property
    def input(self) -> Input:
        if self.expression is not None:
            return parse_input(self.expression)
        return Input(self.input_name or self.feature_name)

    @property
    def inputs(self) -> tuple[Input, ...]:
        return (self.input,)

    @property
    def column(self) -> str:
        """The column it reads (for a ``feature:`` input, the text ``feature:<name>``)."""
        return str(self.input)


# -- the kinds -------------------------------------------------------------------------------


class IdFeatureCfg(_SingleInput, _Embeddable):
    """Ids, pooled: one value per row (several with ``separator``; a list column), each turned
    into an id by the bucketizer. With ``boundaries`` the column holds numbers, bucketized into
    ``len(boundaries) + 1`` rows: bucket ``i`` holds ``boundaries[i-1] <= x < boundaries[i]``
    (TorchEasyRec's raw_feature with boundaries)."""

    KIND: ClassVar[str] = "id_feature"
    TABLE_KINDS: ClassVar[tuple[str, ...]] = (
        "num_buckets",
        "hash_bucket_size",
        "vocab_list",
        "vocab_dict",
        "vocab_file",
        "boundaries",
        "dynamicemb",
        "zch",
    )
    NEEDS_TABLE: ClassVar[bool] = True
    value_dim: ClassVar[int] = 1

    embedding_dim: Count
    separator: Optional[str] = None
    # "int": values are integer ids (integer columns, or string tokens that must be decimal
    # integers); "string": values are strings hashed with hash_function. A hash_bucket_size
    # feature always hashes (the string form of integers too); a vocabulary looks the string
    # form up.
    value_type: ValueType = "int"
    # The value of a missing input (null, or an empty string), before bucketizing: "" = no id.
    # Unset: a missing value is an error naming the row.
    default_value: Optional[str] = None
    weighted: bool = False  # values are "id:weight" pairs (or a map column id -> weight)
    # Keep a row's first max_values values (of a separator-joined string or a list column), as
    # TorchEasyRec's value_dim k truncates what its feature generation outputs.
    max_values: Optional[Count] = None

    def _table_help(self) -> str:
        return (
            "num_buckets: ids as they are; hash_bucket_size: values hashed into it; vocab_list / vocab_dict / "
            "vocab_file: words looked up; boundaries: numbers bucketized; dynamicemb / zch: a dynamic table"
        )

    @property
    def _string_keys(self) -> bool:
        return self.value_type == "string"

    def _check_kind(self) -> None:
        if self.boundaries is not None and self.separator is not None:
            raise ValueError("boundaries bucketize one number per sample; remove separator")
        if self.boundaries is not None and self.max_values is not None:
            raise ValueError("boundaries bucketize one number per sample; remove max_values")
        if self.weighted and self.boundaries is not None:
            raise ValueError("weighted takes 'id:weight' pairs; boundaries bucketize numbers (give one of them)")
        if self.weighted and self.default_value and ":" not in self.default_value:
            raise ValueError(f"default_value of a weighted feature is an 'id:weight' pair, got {self.default_value!r}")
        if self.separator == "":
            raise ValueError("separator must not be empty")
        _check_default_ids(self, [self.separator] if self.separator else [], self.weighted)


class SequenceFeatureCfg(_SingleInput, _Embeddable):
    """A behaviour history of ids: elements joined by ``separator`` (or a list column), the
    last ``sequence_length`` kept, one embedding each. ``value_dim: 1``: one id an element (an
    element of a string column holding several, joined by ``value_separator``, keeps its first,
    as TorchEasyRec's value_dim 1 truncates). ``value_dim: 0`` (TorchEasyRec's): several ids an
    element, joined by ``value_separator``, their embeddings pooled per element by ``pooling``
    (``sum`` or ``mean``; an element without ids reads zeros)."""

    KIND: ClassVar[str] = "sequence_feature"
    TABLE_KINDS: ClassVar[tuple[str, ...]] = (
        "num_buckets",
        "hash_bucket_size",
        "vocab_list",
        "vocab_dict",
        "vocab_file",
        "dynamicemb",
        "zch",
    )
    NEEDS_TABLE: ClassVar[bool] = True
    is_sequence: ClassVar[bool] = True
    boundaries: ClassVar[None] = None  # type: ignore[misc]

    embedding_dim: Count
    sequence_length: Count
    separator: str = Field("|", min_length=1)
    value_dim: Literal[0, 1] = 1
    value_separator: str = Field(TZREC_SEPARATOR, min_length=1)  # between an element's ids (value_dim 0)
    value_type: ValueType = "int"
    # A missing row (null or "") and an empty element: this value (unset: a null row is an
    # error, "" is an empty sequence, an empty element is an error).
    default_value: Optional[str] = None

    @property
    def _string_keys(self) -> bool:
        return self.value_type == "string"

    @property
    def several_ids_an_element(self) -> bool:
        return self.value_dim == 0

    def _check_kind(self) -> None:
        if self.value_dim == 0 and self.value_separator == self.separator:
            raise ValueError(
                f"value_separator {self.value_separator!r} (between an element's ids) must differ from separator "
                "(between elements)"
            )
        _check_default_ids(self, [self.separator, *([self.value_separator] if self.value_dim == 0 else [])], False)


def _check_default_ids(f: Any, separators: list[str], weighted: bool) -> None:
    """A ``num_buckets`` feature of integer ids: each id of its ``default_value`` (split by
    ``separators``; ``id:weight`` pairs where ``weighted``) is a whole number below
    ``num_buckets``, checked when the config loads (a bad one was reported as the data's, at the
    first row missing a value)."""
    default = f.default_value
    if not default or f.bucketizer != "num_buckets" or f.value_type != "int":
        return
    tokens = re.split("|".join(re.escape(s) for s in separators), default) if separators else [default]
    for token in filter(None, tokens):
        text = token.split(":", 1)[0] if weighted else token
        try:
            value = int(text)
        except ValueError:
            raise ValueError(
                f"default_value {default!r}: {text!r} is not an integer id (num_buckets: ids as they are; "
                "value_type: string with hash_bucket_size hashes words)"
            ) from None
        if not 0 <= value < f.num_buckets:
            raise ValueError(f"default_value {default!r}: id {value} is out of range [0, {f.num_buckets})")


class RawFeatureCfg(_Numbers, _SingleInput):
    """Numbers: ``value_dim`` a row (a list column, or ``separator``-joined), normalized; dense
    ``[B]`` / ``[B, value_dim]``, or ids with ``boundaries`` (one per number, pooled), or the input
    of a dense embedding (``autodis`` / ``mlp``) that the model applies."""

    KIND: ClassVar[str] = "raw_feature"

    normalizer: Optional[NormalizerCfg] = None
    value_dim: Count = 1
    separator: str = Field(TZREC_SEPARATOR, min_length=1)  # between the value_dim numbers of a string
    # The number(s) of a missing row, not normalized (TorchEasyRec's rule): one number (repeated
    # value_dim times) or value_dim numbers joined by separator; "" with boundaries: no id.
    # Unset: a missing value is an error naming the row.
    default_value: Optional[str] = None
    autodis: Optional[AutoDisCfg] = None
    mlp: Optional[MlpCfg] = None

    def _check_kind(self) -> None:
        _check_dense(self)


class ComboFeatureCfg(_Embeddable):
    """The cartesian product of its inputs' values (``expression: [a, b, ...]``, first input
    outermost) joined by ``_``, each bucketized; a missing input makes the whole output
    ``default_value`` (``""``: no id)."""

    KIND: ClassVar[str] = "combo_feature"
    TABLE_KINDS: ClassVar[tuple[str, ...]] = (
        "hash_bucket_size",
        "vocab_list",
        "vocab_dict",
        "vocab_file",
        "dynamicemb",
        "zch",
    )
    NEEDS_TABLE: ClassVar[bool] = True
    value_dim: ClassVar[int] = 1
    num_buckets: ClassVar[None] = None  # type: ignore[misc]
    boundaries: ClassVar[None] = None  # type: ignore[misc]

    expression: list[str] = Field(min_length=2)
    embedding_dim: Count
    default_value: str = ""
    separator: str = Field(TZREC_SEPARATOR, min_length=1)

    @property
    def inputs(self) -> tuple[Input, ...]:
        return tuple(parse_input(e) for e in self.expression)


Combiner = Literal["sum", "mean", "max", "min", "count"]


class _Mapped(_Embeddable):
    """What lookup and match share: values found in a map are numbers (combined by
    ``combiner``, then ``normalizer`` and ``boundaries``) or, with a discrete bucketizer (or
    ``need_discrete``), each one an id."""

    TABLE_KINDS: ClassVar[tuple[str, ...]] = (
        "zch",
        "dynamicemb",
        "hash_bucket_size",
        "num_buckets",
        "vocab_list",
        "vocab_dict",
        "vocab_file",
        "boundaries",
    )

    combiner: Combiner = "sum"
    default_value: str = "0"  # what a row with nothing found takes ("" with a table: no id)
    separator: str = Field(TZREC_SEPARATOR, min_length=1)  # between keys, and between a string map's pairs
    need_discrete: bool = False  # each value found its own id (boundaries bucketize each)
    normalizer: Optional[NormalizerCfg] = None
    autodis: Optional[AutoDisCfg] = None
    mlp: Optional[MlpCfg] = None

    @property
    def discrete(self) -> bool:
        """Whether each value found becomes its own id (a bucketizer other than boundaries, or
        ``need_discrete``), rather than the values combining into numbers."""
        kind = self.bucketizer
        return kind is not None and (kind != "boundaries" or self.need_discrete)

    def _check_kind(self) -> None:
        if self.need_discrete and self.bucketizer is None:
            raise ValueError("need_discrete: the values found become ids, which needs a bucketizer")
        if self.discrete and self.normalizer is not None and self.bucketizer != "boundaries":
            raise ValueError("normalizer applies to numbers; with a discrete bucketizer the values found are words")
        _check_dense(self)


class LookupFeatureCfg(_Mapped):
    """The values of ``key`` in ``map`` (a map column, or ``k:v`` pairs joined by ``separator``):
    one number a row combined by ``combiner`` (or ``value_dim`` numbers a value, joined by
    ``value_separator``, combined element by element), or ids."""

    KIND: ClassVar[str] = "lookup_feature"

    map: str
    key: str
    value_dim: Count = 1
    value_separator: str = Field(",", min_length=1)

    @property
    def inputs(self) -> tuple[Input, ...]:
        return (parse_input(self.map), parse_input(self.key))

    def _check_kind(self) -> None:
        super()._check_kind()
        if self.value_dim > 1 and self.discrete:
            raise ValueError("value_dim > 1 takes numbers (dense, or boundaries); a discrete bucketizer takes words")
        if self.value_dim > 1 and self.combiner == "count":
            raise ValueError("combiner count gives one number; it cannot have value_dim > 1")


class MatchFeatureCfg(_Mapped):
    """The values at ``[pkey][skey]`` of ``nested_map`` (``"pk^sk:v,sk:v|pk^..."``, a map column of
    such ``sk:v,...`` strings, or a map of maps); ``pkey`` / ``skey`` ``ALL``: every key."""

    KIND: ClassVar[str] = "match_feature"
    value_dim: ClassVar[int] = 1

    nested_map: str
    pkey: str
    skey: str

    @property
    def inputs(self) -> tuple[Input, ...]:
        return tuple(parse_input(x) for x in (self.nested_map, self.pkey, self.skey) if x != "ALL")

    def _check_inputs(self) -> None:
        if self.nested_map == "ALL":
            raise ValueError("nested_map must name a column, not ALL")
        super()._check_inputs()


class ExprFeatureCfg(_Numbers):
    """One number a row: ``expression`` over ``variables`` (each ``side:name`` or
    ``feature:name``, named ``name`` in the formula); dense, or ids with ``boundaries``, or an
    ``autodis`` / ``mlp`` embedding."""

    KIND: ClassVar[str] = "expr_feature"
    value_dim: ClassVar[int] = 1

    expression: str
    variables: list[str] = Field(min_length=1)
    default_value: str = "0"  # the output of a row where a variable is missing
    separator: str = Field(TZREC_SEPARATOR, min_length=1)  # between the numbers of a multi-valued variable
    autodis: Optional[AutoDisCfg] = None
    mlp: Optional[MlpCfg] = None

    @property
    def inputs(self) -> tuple[Input, ...]:
        return tuple(parse_input(v) for v in self.variables)

    @property
    def variable_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)

    def formula(self) -> Expression:
        return Expression(self.expression, self.variable_names)

    def _check_kind(self) -> None:
        names = self.variable_names
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"variables: {twice} named twice")
        self.formula()
        _check_dense(self)


# custom_feature operators built into dynarec: name -> {parameter: allowed values (None: any string)}
CUSTOM_OPERATORS: dict[str, dict[str, Optional[tuple[str, ...]]]] = {
    "EditDistance": {"encoding": ("latin", "utf-8")},
    "RegexReplace": {"regex_patten": None, "replacement": None},  # TorchEasyRec's spelling
}


class CustomFeatureCfg(_Embeddable):
    """TorchEasyRec's custom operators, built in (``CUSTOM_OPERATORS``):

    - ``EditDistance`` of its two inputs' strings (``encoding``: ``latin``, bytes, the default;
      ``utf-8``, characters): one number a row; dense, or ids by any bucketizer, or an
      ``autodis`` / ``mlp`` embedding;
    - ``RegexReplace`` of its one input's strings: every match of ``regex_patten`` (RE2 syntax)
      replaced by ``replacement`` (``$1`` or ``\\1``: a group); the string bucketized into ids (a
      bucketizer other than boundaries)."""

    KIND: ClassVar[str] = "custom_feature"
    TABLE_KINDS: ClassVar[tuple[str, ...]] = _Mapped.TABLE_KINDS
    value_dim: ClassVar[int] = 1

    operator_name: str
    operator_lib_file: Optional[str] = None  # TorchEasyRec's plugin; dynarec runs its own operator
    operator_params: dict[str, Any] = Field(default_factory=dict)
    is_op_thread_safe: Optional[bool] = None  # accepted; dynarec's operators are
    expression: list[str] = Field(min_length=1)
    default_value: str = "0"
    separator: str = Field(TZREC_SEPARATOR, min_length=1)
    normalizer: Optional[NormalizerCfg] = None
    autodis: Optional[AutoDisCfg] = None
    mlp: Optional[MlpCfg] = None

    @property
    def inputs(self) -> tuple[Input, ...]:
        return tuple(parse_input(e) for e in self.expression)

    @property
    def encoding(self) -> str:
        return str(self.operator_params.get("encoding", "latin"))

    @property
    def replacement(self) -> tuple[str, str]:
        """RegexReplace's ``(pattern, replacement)``, the replacement's ``$n`` written RE2's ``\\n``."""
        text = str(self.operator_params.get("replacement", ""))
        return str(self.operator_params["regex_patten"]), re.sub(r"\$(\d)", r"\\\1", text)

    def _check_kind(self) -> None:
        params = CUSTOM_OPERATORS.get(self.operator_name)
        if params is None:
            raise ValueError(
                f"operator_name: the custom operator '{self.operator_name}' is not built into dynarec (it runs "
                f"no TorchEasyRec plugin .so); built in: {sorted(CUSTOM_OPERATORS)}"
            )
        for key, value in self.operator_params.items():
            if key not in params:
                raise ValueError(f"operator_params: {self.operator_name} takes {sorted(params)}, not '{key}'")
            allowed = params[key]
            if allowed is not None and value not in allowed:
                raise ValueError(f"operator_params.{key}: one of {list(allowed)}, got {value!r}")
            if allowed is None and not isinstance(value, str):
                raise ValueError(f"operator_params.{key}: a string, got {value!r}")
        if self.operator_name == "EditDistance" and len(self.expression) != 2:
            raise ValueError(f"EditDistance takes two inputs (expression: [a, b]), got {len(self.expression)}")
        if self.operator_name == "RegexReplace":
            self._check_regex()
            return
        _check_dense(self)

    def _check_regex(self) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        if len(self.expression) != 1:
            raise ValueError(f"RegexReplace takes one input (expression: [a]), got {len(self.expression)}")
        if "regex_patten" not in self.operator_params:
            raise ValueError("operator_params.regex_patten: RegexReplace needs the pattern to replace")
        if self.bucketizer in (None, "boundaries"):
            raise ValueError(
                "RegexReplace gives strings: give a bucketizer that makes ids of them (hash_bucket_size, a vocabulary, "
                "dynamicemb, zch)"
            )
        pattern, replacement = self.replacement
        try:
            pc.replace_substring_regex(pa.array([""]), pattern, replacement)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise ValueError(
                f"operator_params.regex_patten: {pattern!r} is not a regular expression RE2 takes ({e})"
            ) from None


class _Dense(_Numbers):
    """A kind of one number a row that may be dense: only ``boundaries`` makes ids."""

    value_dim: ClassVar[int] = 1

    separator: str = Field(TZREC_SEPARATOR, min_length=1)  # between the terms of a string input
    normalizer: Optional[NormalizerCfg] = None
    autodis: Optional[AutoDisCfg] = None
    mlp: Optional[MlpCfg] = None

    def _check_kind(self) -> None:
        _check_dense(self)


OverlapMethod = Literal["query_common_ratio", "title_common_ratio", "is_contain", "is_equal", "index_of"]


class OverlapFeatureCfg(_Dense):
    """How much the terms of ``query`` and ``title`` (each split on ``separator``, or a list
    column) overlap, one number a row by ``method``: ``query_common_ratio`` (the query's terms
    found in the title, over the query's), ``title_common_ratio`` (the title's found in the query,
    over the title's), ``is_contain`` (1 when the query's terms appear in the title in their order),
    ``is_equal`` (1 when the terms are the same), ``index_of`` (the first term position where the
    query appears whole in the title, -1 where it does not). An empty or missing input: 0 (-1 for
    index_of)."""

    KIND: ClassVar[str] = "overlap_feature"

    query: str
    title: str
    method: OverlapMethod

    @property
    def inputs(self) -> tuple[Input, ...]:
        return (parse_input(self.query), parse_input(self.title))


class KvDotProductCfg(_Dense):
    """The dot product of two weighted key sets, one number a row: ``query`` and ``document``
    each a string of ``key:weight`` terms (a key alone weighs 1) joined by ``separator``, a list of
    them, or a map column ``key -> weight``; the sum over their common keys of the products of
    weights (a key given twice in one input: its last weight). A missing or empty document (or
    query): ``default_value``."""

    KIND: ClassVar[str] = "kv_dot_product"

    query: str
    document: str
    kv_delimiter: str = Field(":", min_length=1, max_length=1)
    default_value: str = "0"
    normalizer: ClassVar[None] = None  # type: ignore[misc]  # TorchEasyRec sends none to pyfg

    @property
    def inputs(self) -> tuple[Input, ...]:
        return (parse_input(self.query), parse_input(self.document))


class BoolMaskFeatureCfg(_Embeddable):
    """Ids kept by a mask: ``expression: [values, mask]``, both split on ``separator`` (or list
    columns) to the same count a row; the values whose mask is true (``true`` / ``1``; ``false``
    / ``0``) are bucketized as id_feature's and pooled. A row without values kept holds
    ``default_value`` (``""``: no id)."""

    KIND: ClassVar[str] = "bool_mask_feature"
    TABLE_KINDS: ClassVar[tuple[str, ...]] = (*IdFeatureCfg.TABLE_KINDS[:5], "dynamicemb", "zch")
    NEEDS_TABLE: ClassVar[bool] = True
    value_dim: ClassVar[int] = 1
    boundaries: ClassVar[None] = None  # type: ignore[misc]

    expression: list[str] = Field(min_length=2, max_length=2)
    embedding_dim: Count
    separator: str = Field(TZREC_SEPARATOR, min_length=1)
    value_type: ValueType = "int"
    default_value: str = ""

    @property
    def inputs(self) -> tuple[Input, ...]:
        return tuple(parse_input(e) for e in self.expression)

    @property
    def _string_keys(self) -> bool:
        return self.value_type == "string"


class SequenceRawFeatureCfg(_Numbers, _SingleInput):
    """A sequence of numbers: elements joined by ``separator`` (or a list column), each
    ``value_dim`` numbers joined by ``value_separator`` (or a list of lists); the last
    ``sequence_length`` kept. Dense ``[B, L, value_dim]`` (normalized, zero-padded to the batch's
    longest, lengths in ``Batch.dense_lengths``), or, with ``boundaries``, a sequence of ids."""

    KIND: ClassVar[str] = "sequence_raw_feature"
    is_sequence: ClassVar[bool] = True
    pooling: ClassVar[str] = "none"  # type: ignore[misc]  # one embedding per element

    sequence_length: Count
    separator: str = Field("|", min_length=1)
    value_dim: Count = 1
    value_separator: str = Field(",", min_length=1)
    normalizer: Optional[NormalizerCfg] = None
    # A missing row (null or "") and an empty element: this element (one number, repeated
    # value_dim times, or value_dim numbers). Unset: a null row is an error, "" is an empty
    # sequence, an empty element is an error.
    default_value: Optional[str] = None

    def _check_kind(self) -> None:
        if self.boundaries is not None and self.value_dim != 1:
            raise ValueError(
                "boundaries in a sequence take one number an element (value_dim 1): a sequence of ids has one id a "
                "position"
            )
        _check_default_numbers(self)
        if self.bucketizer is None and self.embedding_dim is not None:
            raise ValueError("embedding_dim: a dense sequence has no table (give boundaries for ids)")


class TextNormalizerCfg(Strict):
    """TorchEasyRec's ``text_normalizer`` (:class:`dynarec.features.text.TextNormalizer`):
    ``norm_options`` (none given: ``TEXT_LOWER2UPPER``, ``TEXT_SBC2DBC``, ``TEXT_CHT2CHS``,
    ``TEXT_FILTER``, TorchEasyRec's default), ``stop_char_file`` (the characters ``TEXT_FILTER``
    removes; default: Unicode punctuation, symbols and controls), ``max_length`` (characters
    kept)."""

    norm_options: list[NormOption] = Field(default_factory=list)
    stop_char_file: Optional[str] = None
    max_length: Optional[Count] = None

    @model_validator(mode="after")
    def _valid(self):
        self.normalizer()
        return self

    def normalizer(self) -> TextNormalizer:
        return TextNormalizer(tuple(self.norm_options), self.stop_char_file, self.max_length)


class TokenizeFeatureCfg(_SingleInput, _Embeddable):
    """Text -> token ids, pooled: a string column (or a list of strings, their tokens in order)
    normalized by ``text_normalizer`` (if given) and tokenized by ``vocab_file``, a tokenizer file
    (``tokenizer_type``: ``bpe``, a HuggingFace ``tokenizer.json``; ``sentencepiece``, a
    ``.model``). The table has the tokenizer's vocabulary size rows, ids as the tokenizer gives
    them. A missing or empty text is ``default_value`` (``""``: no ids)."""

    KIND: ClassVar[str] = "tokenize_feature"
    TABLE_KINDS: ClassVar[tuple[str, ...]] = ()
    value_dim: ClassVar[int] = 0
    num_buckets: ClassVar[None] = None  # type: ignore[misc]
    hash_bucket_size: ClassVar[None] = None  # type: ignore[misc]
    vocab_list: ClassVar[None] = None  # type: ignore[misc]
    vocab_dict: ClassVar[None] = None  # type: ignore[misc]
    default_bucketize_value: ClassVar[None] = None  # type: ignore[misc]
    boundaries: ClassVar[None] = None  # type: ignore[misc]
    dynamicemb: ClassVar[None] = None  # type: ignore[misc]
    zch: ClassVar[None] = None  # type: ignore[misc]
    hash_function: ClassVar[HashFunction] = "farmhash"  # type: ignore[misc]

    embedding_dim: Count
    vocab_file: str  # the tokenizer file (a vocabulary in the other kinds)
    tokenizer_type: TokenizerType = "bpe"
    text_normalizer: Optional[TextNormalizerCfg] = None
    default_value: str = ""

    @property
    def bucketizer(self) -> Optional[str]:
        return "tokenizer"

    @property
    def table_rows(self) -> Optional[int]:
        return self.tokenizer().vocab_size

    @property
    def hashed(self) -> bool:
        return False

    def tokenizer(self) -> Tokenizer:
        """The tokenizer (read once per process; a TokenizerError names an unreadable file)."""
        return tokenizer(self.vocab_file, self.tokenizer_type)

    def normalize(self, text: str) -> str:
        return self.text_normalizer.normalizer()(text) if self.text_normalizer is not None else text


def _check_default_numbers(f) -> None:
    """A numeric kind's ``default_value``: numbers (one, or ``value_dim``)."""
    dv = getattr(f, "default_value", None)
    if dv is None or dv == "":
        return
    sep = getattr(f, "value_separator", None) if f.KIND in ("lookup_feature", "sequence_raw_feature") else None
    sep = sep or getattr(f, "separator", None)
    parts = dv.split(sep) if sep and f.value_dim > 1 else [dv]
    try:
        [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"default_value must be a number (or {f.value_dim} numbers), got {dv!r}") from None
    if len(parts) not in (1, f.value_dim):
        raise ValueError(f"default_value: 1 or {f.value_dim} numbers (value_dim), got {len(parts)}")


def _check_dense(f) -> None:
    """The dense side of a kind that may be dense: an embedding needs embedding_dim, autodis one
    number a row; embedding_dim without an embedding is refused."""
    if f.autodis is not None and f.mlp is not None:
        raise ValueError("give autodis or mlp, not both")
    emb = f.dense_embedding
    kind = f.bucketizer
    if emb is not None and kind is not None:
        raise ValueError(f"{emb} embeds the numbers; {kind} makes ids: give one of them")
    if emb is not None and f.embedding_dim is None:
        raise ValueError(f"{emb}: needs embedding_dim (the width of the embedding)")
    if emb == "autodis" and f.value_dim != 1:
        raise ValueError(f"autodis embeds one number a row; value_dim is {f.value_dim}")
    if emb is None and kind is None and f.embedding_dim is not None:
        raise ValueError(
            f"embedding_dim: a dense {f.KIND} has no embedding (give boundaries for ids, or autodis / mlp)"
        )
    if not getattr(f, "discrete", False):
        _check_default_numbers(f)


Feature = Union[
    IdFeatureCfg,
    SequenceFeatureCfg,
    RawFeatureCfg,
    ComboFeatureCfg,
    LookupFeatureCfg,
    MatchFeatureCfg,
    ExprFeatureCfg,
    CustomFeatureCfg,
    SequenceRawFeatureCfg,
    TokenizeFeatureCfg,
    OverlapFeatureCfg,
    KvDotProductCfg,
    BoolMaskFeatureCfg,
]

FEATURE_KINDS: tuple[str, ...] = (
    "id_feature",
    "sequence_feature",
    "raw_feature",
    "combo_feature",
    "lookup_feature",
    "match_feature",
    "expr_feature",
    "custom_feature",
    "sequence_raw_feature",
    "tokenize_feature",
    "overlap_feature",
    "kv_dot_product",
    "bool_mask_feature",
)


class FeatureCfg(Strict):
    """One entry of ``feature_configs``: exactly one kind."""

    id_feature: Optional[IdFeatureCfg] = None
    sequence_feature: Optional[SequenceFeatureCfg] = None
    raw_feature: Optional[RawFeatureCfg] = None
    combo_feature: Optional[ComboFeatureCfg] = None
    lookup_feature: Optional[LookupFeatureCfg] = None
    match_feature: Optional[MatchFeatureCfg] = None
    expr_feature: Optional[ExprFeatureCfg] = None
    custom_feature: Optional[CustomFeatureCfg] = None
    sequence_raw_feature: Optional[SequenceRawFeatureCfg] = None
    tokenize_feature: Optional[TokenizeFeatureCfg] = None
    overlap_feature: Optional[OverlapFeatureCfg] = None
    kv_dot_product: Optional[KvDotProductCfg] = None
    bool_mask_feature: Optional[BoolMaskFeatureCfg] = None

    @model_validator(mode="after")
    def _one_kind(self):
        exactly_one(self, FEATURE_KINDS)
        return self

    @property
    def kind(self) -> str:
        return next(k for k in FEATURE_KINDS if getattr(self, k) is not None)

    @property
    def feature(self) -> Feature:
        return getattr(self, self.kind)


# The settings of a feature that belong to its table (YAML fields, and ``key_space``: how values
# become a dynamic table's keys): every feature of one table must give the same values (else the
# config is refused, naming both features).
TABLE_SETTINGS = (
    "embedding_dim",
    "num_buckets",
    "hash_bucket_size",
    "vocab_list",
    "vocab_dict",
    "vocab_file",
    "default_bucketize_value",
    "boundaries",
    "dynamicemb",
    "zch",
    "initializer",
    "backend",
    "sharding",
    "trainable",
    "data_type",
    "cache_load_factor",
    "hash_function",
    "tokenizer_type",
    "key_space",
)


def dependency_order(features: Sequence[Feature]) -> list[Feature]:
    """``features`` with every feature after the features it reads (``feature:<name>``
    inputs), otherwise in their order; ValueError naming an unknown feature or a cycle."""
    by_name = {f.feature_name: f for f in features}
    done: dict[str, Feature] = {}
    visiting: list[str] = []

    def visit(f: Feature) -> None:
        if f.feature_name in done:
            return
        if f.feature_name in visiting:
            cycle = [*visiting[visiting.index(f.feature_name) :], f.feature_name]
            raise ValueError(f"features read each other in a cycle: {' -> '.join(cycle)}")
        visiting.append(f.feature_name)
        for name in f.feature_inputs:
            if name not in by_name:
                raise ValueError(f"feature '{f.feature_name}' reads feature:{name}, which no feature defines")
            visit(by_name[name])
        visiting.pop()
        done[f.feature_name] = f

    for f in features:
        visit(f)
    return list(done.values())


def check_features(entries: Sequence[FeatureCfg]) -> dict[str, Feature]:
    """The features' cross-checks (unique names, ``feature:`` inputs, shared tables); returns
    ``{table name: first feature}`` of every table. ValueError naming the entry."""
    seen: dict[str, int] = {}
    for i, e in enumerate(entries):
        name = e.feature.feature_name
        if name in seen:
            raise ValueError(f"feature_configs[{i}]: feature_name '{name}' is defined twice")
        seen[name] = i
    features = [e.feature for e in entries]
    for i, f in enumerate(features):
        for name in f.feature_inputs:
            if name not in seen:
                raise ValueError(
                    f"feature_configs[{i}].{entries[i].kind}: feature:{name} names no feature; features: {sorted(seen)}"
                )
            if features[seen[name]].is_sequence:
                raise ValueError(
                    f"feature_configs[{i}].{entries[i].kind}: feature:{name} is a sequence; a feature: input reads "
                    "a feature of one value (or value_dim values) a row"
                )
    dependency_order(features)
    tables: dict[str, Feature] = {}
    for i, f in enumerate(features):
        if not f.embedded:
            continue
        other = tables.setdefault(f.table_name, f)
        if other is f:
            continue
        for attr in TABLE_SETTINGS:
            a, b = getattr(other, attr, None), getattr(f, attr, None)
            if a != b:
                hint = _SAME.get(attr, f"give both features the same {attr}")
                raise ValueError(
                    f"feature_configs[{i}] ({f.feature_name}): shares table '{f.table_name}' with "
                    f"'{other.feature_name}' but its {attr} differs ({other.feature_name}: {a!r}, "
                    f"{f.feature_name}: {b!r}); {hint}"
                )
    return tables


_SAME = {
    "key_space": "give both features the same value_type / hash_function (keys of one table must mean one thing)",
}
