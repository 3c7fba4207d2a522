"""``feature_configs``: TorchEasyRec's feature kinds as dynarec's (docs/features.md), with
TorchEasyRec's semantics (docs/tzrec_features_spec.md, whose section numbers the comments cite).

Each feature, and each sub-feature of a grouped ``sequence_feature``, becomes one
:class:`Converted`: its dynarec block, the path it came from, the refusals found in it (so that
``--lenient`` drops the feature whole, never half of it) and the features it reads through
``feature:`` inputs.

- ``FG_DAG`` / ``FG_NORMAL`` (raw input): a feature reads its inputs' columns and dynarec does
  the feature generation with TorchEasyRec's rules: ``hash_bucket_size`` hashes the value's
  string form with ``hash_function: murmur2`` (libstdc++'s ``std::hash``, TorchEasyRec's default;
  its FarmHash is chosen by an environment variable, never by the config), vocabularies map
  words to ids as pyfg does, boundaries bucketize, normalizers apply.
- ``FG_NONE`` (encoded input): a feature reads the column named after it (a sequence
  sub-feature ``<sequence_name>__<feature_name>``) holding its FG output: a sparse kind becomes
  an ``id_feature`` / ``sequence_feature`` over the ids ``[0, rows)`` of its table (several
  ids split on ``fg_encoded_multival_sep``), a dense kind a ``raw_feature`` /
  ``sequence_raw_feature``; normalizers are not applied (TorchEasyRec applies none there).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from dynarec.config.tzrec.reader import Context, Reader, one_of
from dynarec.config.tzrec.schema_fields import kind_fields

__all__ = ["Converted", "Mode", "convert_features", "default_sequence_lengths", "initializer"]


@dataclass
class Mode:
    encoded: bool  # FG_NONE: columns hold FG output, named after the features
    multival_sep: str = "\x03"  # FG_NONE: the separator of several values in a string column
    # vocab_file paths are relative to the pipeline config's directory (default: the current
    # one) and written relative to the output YAML's directory (default: absolute).
    config_dir: Optional[Path] = None
    output_dir: Optional[Path] = None
    # Between a sequence's name and its sub-features' names: "__", or "_" for a config written
    # for TorchEasyRec's USE_RTP=1 (the converter decides from the feature groups).
    sub_separator: str = "__"


@dataclass
class Converted:
    """One dynarec feature: ``{kind: body}``, from ``path`` of the pipeline.config."""

    kind: str
    body: dict[str, Any]
    path: str
    refused: list[str] = field(default_factory=list)  # refusals found in it
    reads: list[str] = field(default_factory=list)  # features it reads through `feature:` inputs

    @property
    def name(self) -> str:
        return str(self.body.get("feature_name", ""))

    @property
    def block(self) -> dict[str, Any]:
        return {self.kind: self.body}

    @property
    def sparse(self) -> bool:
        """Whether the feature is looked up in a table (its output is ids)."""
        return "embedding_dim" in self.body and not ("autodis" in self.body or "mlp" in self.body)

    @property
    def sequence(self) -> bool:
        return self.kind.startswith("sequence_")


# -- initializers ----------------------------------------------------------------------------------

_INIT_FN = re.compile(r"^\s*nn\.init\.(?P<fn>\w+)\s*(?:,(?P<args>.*))?$")


def initializer(text: str, path: str, ctx: Context) -> Optional[dict[str, Any]]:
    """``"nn.init.uniform_,a=-0.01,b=0.01"`` and friends -> a dynarec ``initializer``."""
    m = _INIT_FN.match(text)
    args: dict[str, float] = {}
    if m and m.group("args"):
        try:
            args = {k.strip(): float(v) for k, v in (kv.split("=") for kv in m.group("args").split(","))}
        except ValueError:
            m = None
    if m is None:
        ctx.refuse(path, f"init_fn {text!r} is not supported")
        return None
    fn = m.group("fn")
    if fn == "uniform_" and math.isclose(args.get("a", 0.0), -args.get("b", 1.0)):
        return {"kind": "uniform", "bound": args.get("b", 1.0)}
    if fn == "normal_" and set(args) <= {"mean", "std"}:
        return {"kind": "normal", "mean": args.get("mean", 0.0), "std": args.get("std", 1.0)}
    if fn == "zeros_" and not args:
        return {"kind": "constant", "value": 0.0}
    if fn == "constant_" and set(args) == {"val"}:
        return {"kind": "constant", "value": args["val"]}
    ctx.refuse(path, f"init_fn {text!r} is not supported (uniform_ with a=-b, normal_, zeros_, constant_ are)")
    return None


def _dynamic_initializer(r: Reader, dim: int) -> dict[str, Any]:
    """dynamicemb's ``initializer_args`` (spec §2.15): its defaults written out where dynarec's
    differ (NORMAL's std defaults to 1/sqrt(embedding_dim) there)."""
    mode = str(r.scalar("mode", "UNIFORM"))
    out: dict[str, Any]
    if mode == "UNIFORM":
        lower, upper = r.number("lower"), r.number("upper")
        out = {"kind": "uniform"}  # default bound: sqrt(1 / max_capacity), dynamicemb's too
        if lower is not None or upper is not None:
            if lower is None or upper is None or not math.isclose(float(lower), -float(upper)):
                r.ctx.refuse(r.path, "a uniform initializer needs lower = -upper")
            else:
                out["bound"] = float(upper)
    elif mode in ("NORMAL", "TRUNCATED_NORMAL"):
        out = {"kind": "normal" if mode == "NORMAL" else "truncated_normal", "mean": r.number("mean", 0.0)}
        out["std"] = r.number("std_dev") if r.has("std_dev") else 1.0 / math.sqrt(max(dim, 1))
    elif mode == "CONSTANT":
        out = {"kind": "constant", "value": r.number("value", 0.0)}
    else:
        r.ctx.refuse(r.at("mode"), f"unknown mode {mode!r}")
        out = {"kind": "uniform"}
    for name in ("mean", "std_dev", "lower", "upper", "value"):
        r.taken.add(name)  # fields of the other modes, at their defaults
    r.done()
    return out


_SCORES = {"STEP": "step", "TIMESTAMP": "timestamp", "LFU": "lfu", "NO_EVICTION": "none"}
_ZERO = {"kind": "constant", "value": 0.0}


def _dynamicemb(r: Reader, dim: int) -> tuple[dict[str, Any], dict[str, Any], Optional[float]]:
    """The ``dynamicemb`` block (spec §2.15) -> dynarec's, the table's initializer and its
    ``cache_load_factor`` (None: every row on the device)."""
    out: dict[str, Any] = {"max_capacity": r.integer("max_capacity", 0)}
    if r.has("init_capacity_per_rank"):
        out["init_capacity"] = r.integer("init_capacity_per_rank")
        r.ctx.note(r.at("init_capacity_per_rank"), "mapped to init_capacity (rows allocated at the start)")
    score = str(r.scalar("score_strategy", "STEP")).upper()
    if score in _SCORES:
        out["score_strategy"] = _SCORES[score]
    else:
        r.ctx.refuse(r.at("score_strategy"), f"{score!r} is not supported (STEP, TIMESTAMP, LFU, NO_EVICTION are)")
    if r.has("bucket_capacity"):
        out["bucket_size"] = r.integer("bucket_capacity")
    else:
        r.ctx.note(r.at("bucket_capacity"), "unset: dynarec's 16-slot buckets (dynamicemb's default is 128)")
    init: dict[str, Any] = {"kind": "uniform"}  # dynamicemb's default: U(+-1/sqrt(max_capacity)), dynarec's too
    if (i := r.message("initializer_args")) is not None:
        init = _dynamic_initializer(i, dim)
    # Rows read during eval before they exist: dynamicemb's default is CONSTANT 0, dynarec's too.
    if (e := r.message("eval_initializer_args")) is not None:
        out["eval_initializer"] = _dynamic_initializer(e, dim)
    if (a := r.message("frequency_admission_strategy")) is not None:
        adm: dict[str, Any] = {"threshold": a.integer("threshold", 1)}
        if a.has("counter_capacity"):
            adm["capacity"] = a.integer("counter_capacity")
            a.ctx.note(
                a.at("counter_capacity"),
                "the counter's keys (TorchEasyRec divides it among the ranks; dynarec's is the table's)",
            )
        # Keys not yet admitted read CONSTANT 0 in dynamicemb whatever the eval initializer.
        ai = a.message("initializer_args")
        adm["initializer"] = _dynamic_initializer(ai, dim) if ai is not None else dict(_ZERO)
        a.ignore("counter_bucket_capacity", "the counter's bucket size, a layout choice")
        a.done()
        out["admission"] = adm
    cache = None
    if r.has("cache_load_factor"):  # "percentage of embedding rows caching on gpu"
        cache = float(r.number("cache_load_factor"))
        r.ctx.note(
            r.at("cache_load_factor"),
            "the table's rows in host memory, this share of max_capacity cached on the device (dynarec's cache "
            "is an LRU cache of rows; dynamicemb's caching: false keeps a fixed share there instead)",
        )
    r.refuse("init_table", why="a table of initial rows is not supported (train, or resume a dynarec checkpoint)")
    r.done()
    return out, init, cache


def _zch(r: Reader) -> dict[str, Any]:
    """``zch`` (spec §2.16): a managed-collision table of ``zch_size`` rows, carried as dynarec's
    ``zch`` block (TorchEasyRec's fields; dynarec maps it onto a dynamic table of ``zch_size``
    keys, docs/import_config.md says what differs)."""
    out: dict[str, Any] = {"zch_size": r.integer("zch_size", 0)}
    if r.has("eviction_interval"):
        out["eviction_interval"] = r.integer("eviction_interval")
    policies = [p for p in ("lfu", "lru", "distance_lfu") if r.has(p)]
    r.taken.update(("lfu", "lru", "distance_lfu"))
    if len(policies) != 1:
        r.ctx.refuse(r.path, f"give one eviction policy of lfu, lru, distance_lfu (got {policies or 'none'})")
    else:
        pr = r.message(policies[0])
        assert pr is not None
        policy: dict[str, Any] = {}
        if policies[0] != "lfu" and pr.has("decay_exponent"):
            policy["decay_exponent"] = pr.number("decay_exponent")
        pr.done()
        out[policies[0]] = policy
    r.refuse(
        "threshold_filtering_func",
        why="a Python lambda TorchEasyRec eval()s; dynarec's admission is a count threshold (dynamicemb's "
        "frequency_admission_strategy)",
    )
    r.done()
    return out


# -- inputs ----------------------------------------------------------------------------------------

_DATA_SIDES = ("user", "item", "context")


@dataclass
class _Seq:
    """The sequence a feature belongs to: a grouped ``sequence_feature`` (``group`` = its
    ``sequence_name``) or a ``sequence_<kind>`` of its own (``group`` None)."""

    group: Optional[str]
    length: Optional[int]
    delim: str
    fields: Optional[list[str]] = None  # the sub-feature's sequence_fields


class _Build:
    """One feature being converted: its reader, the dynarec body written so far, and what
    it reads."""

    def __init__(self, r: Reader, kind: str, mode: Mode, seq: Optional[_Seq]):
        self.r, self.kind, self.mode, self.seq = r, kind, mode, seq
        self.ctx = r.ctx
        self.short = r.string("feature_name", "")
        if not self.short:
            self.ctx.refuse(r.at("feature_name"), "a feature_name is needed")
        prefix = f"{seq.group}{mode.sub_separator}" if seq is not None and seq.group is not None else ""
        self.name = prefix + self.short
        self.body: dict[str, Any] = {"feature_name": self.name}
        self.reads: list[str] = []
        self.rows: Optional[int] = None  # rows of the table in FG_NONE (None: dynamic or dense)
        self.bucketizer: Optional[str] = None
        self.hashed = False

    @property
    def grouped(self) -> bool:
        return self.seq is not None and self.seq.group is not None

    def single_input(self, name: str = "expression") -> None:
        """The column of a one-input kind (spec §1.1, §1.7)."""
        r, seq = self.r, self.seq
        expression = r.string(name)
        if self.mode.encoded:
            if self.grouped:
                self.body["input_name"] = self.name
            elif expression is not None:
                self.ctx.note(r.at(name), "FG_NONE: the column named after the feature is read")
            return
        if expression is None:
            self.ctx.refuse(r.at(name), "an input 'side:name' is needed")
            return
        side, _, column = expression.partition(":")
        if side not in (*_DATA_SIDES, "feature") or not column:
            self.ctx.refuse(r.at(name), f"{expression!r}: inputs are 'user:', 'item:', 'context:' or 'feature:' names")
            return
        if seq is not None and seq.group is not None:
            # A sub-feature's data inputs read <sequence_name>__<input>, unless sequence_fields
            # names others; a feature: input is broadcast over the elements.
            if side == "feature" or (seq.fields is not None and column not in seq.fields):
                self.ctx.refuse(
                    r.at(name),
                    f"{expression!r} is not a sequence input here (TorchEasyRec broadcasts it over the elements); "
                    "dynarec's flattened sub-features read sequence columns only",
                )
                return
            self.body["input_name"] = f"{seq.group}{self.mode.sub_separator}{column}"
            return
        if side == "feature":
            self.reads.append(column)
        self.body["expression"] = expression

    def inputs(self, name: str, *, count: Optional[int] = None, allow_all: bool = False) -> Optional[Any]:
        """An input (``count`` None) or the inputs (a list) of a multi-input kind, as written
        (``side:name``); FG_NONE reads its column instead, so they are taken unread."""
        r = self.r
        values = r.strings(name)
        if self.mode.encoded:
            return None
        if self.grouped:
            self.ctx.refuse(r.path, f"a {self.kind} inside a sequence_feature is not supported (id and raw are)")
            return None
        if not values:
            self.ctx.refuse(r.at(name), "an input is needed")
            return None
        for i, v in enumerate(values):
            side, _, column = v.partition(":")
            where = r.at(name) + (f"[{i}]" if len(values) > 1 else "")
            if allow_all and v == "ALL":
                continue
            if side not in (*_DATA_SIDES, "feature") or not column:
                self.ctx.refuse(where, f"{v!r}: inputs are 'user:', 'item:', 'context:' or 'feature:' names")
            elif side == "feature":
                self.reads.append(column)
        if count is None:
            if len(values) > 1:
                self.ctx.refuse(r.at(name), "expected one value")
            return values[0]
        if len(values) < count:
            self.ctx.refuse(r.at(name), f"at least {count} inputs are needed")
        return values

    # -- the table ---------------------------------------------------------------------------

    def embedding(self, *, needed: bool) -> None:
        """``embedding_dim``, ``embedding_name``, ``init_fn``, ``trainable``, ``data_type``: the
        settings of the feature's table (``needed``: it has one)."""
        r = self.r
        if not needed:
            for key in ("embedding_dim", "embedding_name", "init_fn"):
                if r.has(key):
                    self.ctx.note(r.at(key), "ignored (the feature has no table: TorchEasyRec ignores it too)")
                r.scalar(key)
            self._precision(table=False)
            if r.scalar("trainable", True) is False:
                self.ctx.note(r.at("trainable"), "ignored (the feature has no table to freeze)")
            return
        self.body["embedding_dim"] = r.integer("embedding_dim", 0)
        if not self.body["embedding_dim"]:
            self.ctx.refuse(r.at("embedding_dim"), "an embedding_dim is needed for the feature's table")
        if r.has("embedding_name"):
            self.body["embedding_name"] = r.string("embedding_name")
        if r.has("init_fn"):
            init = initializer(r.string("init_fn"), r.at("init_fn"), self.ctx)
            if init is not None:
                self.body["initializer"] = init
        if r.scalar("trainable", True) is False:
            self.body["trainable"] = False
            self.ctx.note(r.at("trainable"), "mapped: the table keeps its initial (or loaded) rows, never updated")
        self._precision(table=True)

    def _precision(self, *, table: bool) -> None:
        r = self.r
        data_type = str(r.scalar("data_type", "FP32")).upper()
        if data_type == "FP32":
            return
        if data_type not in ("FP16", "BF16"):
            self.ctx.refuse(
                r.at("data_type"), f"{data_type!r} is not a data type TorchEasyRec takes (FP32, FP16, BF16)"
            )
        elif not table:
            self.ctx.note(r.at("data_type"), "ignored (the feature has no table)")
        else:
            self.body["data_type"] = data_type.lower()
            self.ctx.note(
                r.at("data_type"),
                f"{data_type} rows, updated in fp32 and stored by stochastic rounding (FBGEMM's), states fp32",
            )

    def table(self, allowed: tuple[str, ...], *, needed: bool) -> Optional[str]:
        """The bucketizer (spec §1.4): one of ``allowed`` (in TorchEasyRec's table-size
        priority), carried (FG modes) or turned into the table's rows (FG_NONE). Returns the
        one given, or None (then the feature is dense; ``needed``: it must have one)."""
        r = self.r
        given = [k for k in allowed if r.has(k)]
        if not given:
            for k in allowed:
                r.taken.add(k)
            if needed:
                self.ctx.refuse(r.path, f"give one of {list(allowed)}: the feature's ids need a table")
            return None
        which = given[0]
        for extra in given[1:]:
            self.ctx.refuse(
                r.at(extra),
                f"a second bucketizer ({which} is set): give one (TorchEasyRec's documentation allows one; its "
                "feature generation and its table size follow different priorities when several are set)",
            )
        r.taken.update(allowed)  # the chosen one is read below; a second one is refused above
        self.bucketizer = which
        dbv = r.integer("default_bucketize_value") if r.has("default_bucketize_value") else None
        r.taken.add("default_bucketize_value")
        if dbv is not None and which not in ("vocab_list", "vocab_dict", "vocab_file"):
            self.ctx.note(r.at("default_bucketize_value"), f"ignored (it belongs to vocabularies; {which} is set)")
            dbv = None
        encoded = self.mode.encoded
        if which == "dynamicemb":
            d = r.message("dynamicemb")
            assert d is not None
            if r.has("init_fn"):
                self.ctx.note(
                    r.at("init_fn"), "ignored: TorchEasyRec initializes dynamicemb tables from initializer_args"
                )
                self.body.pop("initializer", None)
            dim = int(self.body.get("embedding_dim", 1))
            self.body["dynamicemb"], self.body["initializer"], cache = _dynamicemb(d, dim)
            if cache is not None:
                self.body["cache_load_factor"] = cache
            if not encoded:  # FG hashes the value's string form into the key (value_type "string")
                self.body["value_type"] = "string"
                self._hash()
        elif which == "zch":
            z = r.message("zch")
            assert z is not None
            self.body["zch"] = _zch(z)
            self.ctx.note(
                r.at("zch"),
                "mapped onto a dynamic table of zch_size keys: a new key gets its own row at once (TorchEasyRec maps "
                "it to the last row until the next eviction round admits it); docs/import_config.md",
            )
            if not encoded:
                self.body["value_type"] = "string"
                self._hash()
        elif which == "hash_bucket_size":
            size = r.integer("hash_bucket_size", 0)
            if encoded:
                self.rows = size
                self.ctx.note(
                    r.at("hash_bucket_size"), "FG_NONE: the input holds bucket ids, a fixed table of that many rows"
                )
            else:
                self.body["hash_bucket_size"] = size
                self._hash()
        elif which == "num_buckets":
            self.rows = r.integer("num_buckets", 0)
            self.body["num_buckets"] = self.rows
        elif which == "boundaries":
            bounds = r.numbers("boundaries")
            self.rows = len(bounds) + 1
            if not encoded:
                self.body["boundaries"] = bounds
        elif which == "vocab_list":
            words = r.strings("vocab_list")
            if dbv is not None and not 0 <= dbv < len(words):
                self.ctx.refuse(r.at("default_bucketize_value"), f"must be < len(vocab_list) = {len(words)}")
            # without default_bucketize_value: [default_value, "<OOV>"] + words (spec §1.4)
            self.rows = len(words) if dbv is not None else len(words) + 2
            if self.kind == "match_feature":
                self.rows += 1  # TorchEasyRec sizes a match feature's vocabulary table one row larger
            if not encoded:
                self.body["vocab_list"] = words
        elif which == "vocab_dict":
            vocab = self._vocab_dict()
            self.rows = (max(vocab.values()) if vocab else 0) + 1
            if not encoded:
                self.body["vocab_dict"] = vocab
        elif which == "vocab_file":
            self._vocab_file(dbv)
        if dbv is not None and not encoded:
            self.body["default_bucketize_value"] = dbv
        if encoded and self.rows is not None:
            self.body["num_buckets"] = self.rows
        return which

    def _hash(self) -> None:
        """Values hashed as TorchEasyRec hashes them: libstdc++'s std::hash (MurmurHash2), its
        default; its FarmHash is chosen by an environment variable, never by the config."""
        self.hashed = True
        if "hash_function" in kind_fields("id_feature"):
            self.body["hash_function"] = "murmur2"
            if self.bucketizer == "hash_bucket_size":
                self.ctx.note(
                    self.r.at("hash_bucket_size"),
                    "hash_function: murmur2 (TorchEasyRec's default std::hash; it uses FarmHash only with "
                    "USE_FARM_HASH_TO_BUCKETIZE=true, which no config field sets)",
                )
        elif self.bucketizer == "hash_bucket_size":
            self.ctx.note(
                self.r.at("hash_bucket_size"),
                "values hashed with FarmHash Fingerprint64 (TorchEasyRec with USE_FARM_HASH_TO_BUCKETIZE=true; its "
                "default std::hash puts ids in other buckets)",
            )

    def _vocab_dict(self) -> dict[str, int]:
        vocab: dict[str, int] = {}
        for entry in self.r.messages("vocab_dict"):
            key, value = entry.string("key", ""), entry.integer("value", 0)
            entry.done()
            vocab[key] = value
        return vocab

    def _vocab_file(self, dbv: Optional[int]) -> None:
        """``vocab_file`` (+ ``asset_dir``): resolved, checked, and its table's rows counted."""
        r = self.r
        if dbv is None:
            self.ctx.refuse(r.at("vocab_file"), "needs default_bucketize_value (TorchEasyRec refuses it without)")
        found = self.asset(r, "vocab_file")
        if found is None:
            return
        full, written = found
        try:
            self.rows = _vocab_file_rows(full)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            self.ctx.refuse(r.at("vocab_file"), f"{full} cannot be read as a vocabulary ({e})")
            return
        if not self.mode.encoded:
            self.body["vocab_file"] = written

    def asset(self, r: Reader, key: str) -> Optional[tuple[Path, str]]:
        """A file field of ``r`` (joined to the feature's ``asset_dir``), resolved against the
        pipeline config's directory: ``(the file, the path the YAML gives)``, relative to the
        output YAML where it was relative; None (refused) where it does not exist."""
        mode = self.mode
        name = r.string(key, "")
        asset_dir = self.r.string("asset_dir")
        path = Path(os.path.join(asset_dir, name) if asset_dir else name)
        base = mode.config_dir if mode.config_dir is not None else Path.cwd()
        full = Path(os.path.normpath(base / path)) if not path.is_absolute() else path
        if not full.is_file():
            self.ctx.refuse(
                r.at(key), f"{full} does not exist (a relative {key} is relative to the pipeline config's directory)"
            )
            return None
        written = str(full)
        if mode.output_dir is not None and not path.is_absolute():
            written = os.path.relpath(full, os.path.abspath(mode.output_dir))
        if not path.is_absolute() and not mode.encoded:
            self.ctx.note(
                r.at(key),
                f"{name!r} resolved against the pipeline config's directory (TorchEasyRec: the current "
                f"directory{' and asset_dir' if asset_dir else ''}), written as {written!r}",
            )
        return full, written

    # -- values ------------------------------------------------------------------------------

    def values(self, *, value_dim_default: int, several_default: bool) -> int:
        """``value_dim``, ``separator``, ``pooling``, ``default_value`` of a sparse feature.
        ``several_default``: an unset value_dim means several values (id, combo)."""
        r, mode = self.r, self.mode
        explicit = r.has("value_dim")
        value_dim = r.integer("value_dim", value_dim_default)
        separator = r.string("separator", "\x1d")
        pooling = str(r.scalar("pooling", "sum")).lower()
        if pooling not in ("sum", "mean"):
            self.ctx.refuse(r.at("pooling"), f"{pooling!r} is not supported (sum, mean are)")
        several = value_dim == 0 or (value_dim > 1)
        if self.seq is not None:
            self.body.update(self._sequence_fields())
            if value_dim == 0 and "value_dim" not in kind_fields("sequence_feature"):
                self.ctx.refuse(
                    r.at("value_dim"),
                    "0: several ids a sequence element (pooled per element in TorchEasyRec); dynarec's "
                    "sequence_feature takes one id an element",
                )
            elif value_dim == 0:
                self.body["value_dim"] = 0
                self.body["value_separator"] = mode.multival_sep if mode.encoded else separator
                self.body["pooling"] = pooling  # several ids of one element are pooled
            elif value_dim != 1:
                self.ctx.refuse(r.at("value_dim"), "a sequence element takes one value (1) or several (0)")
        else:
            self.body["pooling"] = pooling
            # FG_NONE splits a string on its multi-value separator whatever value_dim says; pyfg
            # (the other modes) keeps a row's first value_dim values of an id feature.
            truncates = explicit and value_dim >= 1 and self.kind == "id_feature" and not mode.encoded
            if several or (several_default and not explicit) or truncates or (mode.encoded and explicit):
                self.body["separator"] = mode.multival_sep if mode.encoded else separator
            if truncates:
                self.body["max_values"] = value_dim
            elif explicit and value_dim > 1 and self.kind == "combo_feature":
                self.body["value_dim"] = value_dim
        self._default_value("")
        return value_dim

    def _sequence_fields(self) -> dict[str, Any]:
        seq = self.seq
        assert seq is not None
        out: dict[str, Any] = {}
        if seq.length:
            out["sequence_length"] = seq.length
            if self.mode.encoded:
                self.ctx.note(
                    self.r.path,
                    f"FG_NONE: TorchEasyRec reads the whole sequence (only pyfg truncates by sequence_length); "
                    f"dynarec keeps its last {seq.length} elements",
                )
        out["separator"] = seq.delim
        return out

    def _default_value(self, default: str) -> None:
        """``default_value``: the value of a missing input, before bucketizing (spec §1.3),
        written out even at TorchEasyRec's default (dynarec's own default is an error naming the
        row). A sequence's empty default is ``"0"``: an empty sequence becomes one element
        holding it. FG_NONE reads FG output: missing ids are no ids there (a null sequence of
        ids an empty one, as TorchEasyRec's id_feature_test reads FG_NONE sequences)."""
        r = self.r
        value = r.string("default_value", default)
        if self.mode.encoded:
            if r.has("default_value") and value != default:
                self.ctx.note(r.at("default_value"), "ignored (FG_NONE: the input is already FG output)")
            if self.bucketizer is not None:
                self.body["default_value"] = ""
            return
        if self.seq is not None and value == "":
            value = "0"
        self.body["default_value"] = value

    def normalizer(self) -> None:
        r = self.r
        if not r.has("normalizer"):
            r.taken.add("normalizer")
            return
        text = r.string("normalizer")
        if self.mode.encoded:
            self.ctx.note(
                r.at("normalizer"), "FG_NONE: TorchEasyRec applies no normalizer to encoded input; neither does this"
            )
            return
        out = _normalizer(text, r.at("normalizer"), self.ctx)
        if out is not None:
            self.body["normalizer"] = out

    def dense_embedding(self) -> Optional[str]:
        """``autodis`` / ``mlp`` (spec §2.2): an embedding of the feature's numbers."""
        r = self.r
        given = [k for k in ("autodis", "mlp") if r.has(k)]
        r.taken.update(("autodis", "mlp"))
        if not given:
            return None
        if self.seq is not None:
            self.ctx.note(r.at(given[0]), "ignored: TorchEasyRec ignores a dense embedding in a sequence")
            return None
        if len(given) > 1:
            self.ctx.refuse(r.path, "give one of autodis, mlp")
        m = r.message(given[0])
        assert m is not None
        if given[0] == "autodis":
            self.body["autodis"] = {
                "num_channels": m.integer("num_channels", 0),
                "temperature": m.number("temperature", 0.1),
                "keep_prob": m.number("keep_prob", 0.8),
            }
            if not self.body["autodis"]["num_channels"]:
                self.ctx.refuse(m.at("num_channels"), "AutoDis needs num_channels")
        else:
            self.body["mlp"] = {}
        m.done()
        return given[0]

    def common(self) -> None:
        """The fields every kind has that change nothing here or are refused unless default."""
        r, mode = self.r, self.mode
        r.default_only("use_mask", False, "masking inputs (data_config.sample_mask_prob) is not supported")
        r.default_only("stub_type", False, "an FG-only intermediate feature is not supported")
        if r.has("fg_encoded_default_value"):
            if mode.encoded:
                self.ctx.refuse(r.at("fg_encoded_default_value"), "filling missing encoded values is not supported")
            else:
                self.ctx.note(r.at("fg_encoded_default_value"), "ignored (used only with FG_NONE)")
        r.taken.add("fg_encoded_default_value")
        r.refuse("fg_value_type", why="an FG output type override is not supported")
        r.ignore("embedding_constraints", "sharding constraints; dynarec's planner shards tables")
        if self.seq is None:
            r.refuse("sequence_length", "sequence_delim", "sequence_fields", why="belongs to sequence features")
        elif self.seq.group is not None:
            r.refuse("sequence_length", "sequence_delim", why="a sub-feature takes its sequence's")
            r.taken.add("sequence_fields")  # read by the caller
        else:
            r.taken.update(("sequence_length", "sequence_delim"))
            r.ignore("sequence_fields", "which inputs are sequences: the feature's column is")
        r.taken.add("asset_dir")
        if r.has("asset_dir") and self.bucketizer not in ("vocab_file", "tokenizer"):
            self.ctx.note(r.at("asset_dir"), "ignored (used only with vocab_file and a tokenizer)")
        r.done()


def _vocab_file_rows(path: Path) -> int:
    """TorchEasyRec's table size of a vocab file (spec §1.4): ``max(id) + 1`` when lines give
    ``word id``, else the number of distinct words."""
    vocab: dict[str, int] = {}
    has_value = False
    for line in path.read_text().splitlines():
        tokens = line.strip().split(maxsplit=1)
        if not tokens:
            continue
        if len(tokens) > 1:
            vocab[tokens[0]] = int(tokens[1])
            has_value = True
        else:
            vocab[tokens[0]] = 0
    return max(vocab.values()) + 1 if has_value else len(vocab)


def _normalizer(text: str, path: str, ctx: Context) -> Optional[dict[str, Any]]:
    """``"method=expression,expr=log(x+3)"`` / ``zscore`` / ``minmax`` -> dynarec's normalizer.
    TorchEasyRec's power is ``^`` (``**`` does not exist there)."""
    from dynarec.features.expression import Expression

    method = dict(kv.split("=", 1) for kv in (p.strip() for p in text.split(",")) if "=" in kv).get("method")
    try:
        if method == "expression" and "expr=" in text:
            expr = text.split("expr=", 1)[1]
            try:
                Expression(expr)
            except ValueError:
                if "^" not in expr:
                    raise
                Expression(expr.replace("^", "**"))
                ctx.note(path, "TorchEasyRec's power '^' written as '**'")
                expr = expr.replace("^", "**")
            return {"expression": expr}
        parts = dict(kv.split("=", 1) for kv in (p.strip() for p in text.split(",")) if "=" in kv)
        if method == "zscore":
            return {"mean": float(parts.get("mean", 0.0)), "std": float(parts.get("standard_deviation", 1.0))}
        if method == "minmax":
            lo, hi = float(parts["min"]), float(parts["max"])
            return {"mean": lo, "std": hi - lo}
    except (KeyError, ValueError) as e:
        ctx.refuse(path, f"normalizer {text!r} is not supported ({e})")
        return None
    ctx.refuse(path, f"normalizer {text!r} is not supported (method=expression, zscore and minmax are)")
    return None


# -- the kinds -------------------------------------------------------------------------------------

# Bucketizers of each kind, in TorchEasyRec's table-size priority (spec §1.4).
_ID_TABLES = ("zch", "dynamicemb", "hash_bucket_size", "num_buckets", "vocab_list", "vocab_dict", "vocab_file")
_COMBO_TABLES = ("zch", "dynamicemb", "hash_bucket_size", "vocab_list", "vocab_dict", "vocab_file")
_LOOKUP_TABLES = (*_ID_TABLES, "boundaries")


def _raw_kind_has_boundaries() -> bool:
    """Whether dynarec's raw_feature takes ``boundaries`` (else a bucketized number is an
    id_feature with boundaries)."""
    return "boundaries" in kind_fields("raw_feature")


def _id(b: _Build) -> str:
    b.single_input()
    b.embedding(needed=True)
    b.table(_ID_TABLES, needed=True)
    b.values(value_dim_default=1 if b.seq is not None else 0, several_default=True)
    if b.r.scalar("weighted", False):
        b.body["weighted"] = True
        b.ctx.note(
            b.r.at("weighted"), "mapped: values are id:weight pairs, the weights scale the rows in the pooled sum"
        )
    b.common()
    return "sequence_feature" if b.seq is not None else "id_feature"


def _raw(b: _Build) -> str:
    """raw_feature (spec §2.2): dense numbers, or ids with ``boundaries``."""
    r, mode = b.r, b.mode
    b.single_input()
    sparse = r.has("boundaries")
    dense_emb = None if sparse else b.dense_embedding()
    if sparse:
        r.taken.update(("autodis", "mlp"))
        if r.has("autodis") or r.has("mlp"):
            b.ctx.refuse(r.path, "boundaries and autodis/mlp: give one (TorchEasyRec's raw feature embeds one way)")
    b.embedding(needed=sparse or dense_emb is not None)
    if sparse:
        b.table(("boundaries",), needed=True)
    value_dim = r.integer("value_dim", 1)
    separator = r.string("separator", "\x1d")
    if value_dim < 1:
        b.ctx.refuse(r.at("value_dim"), "a raw feature has at least one value")
    b.normalizer()
    if b.seq is not None:
        b.body.update(b._sequence_fields())
        if value_dim != 1:
            b.body["value_dim"] = value_dim
            b.body["value_separator"] = mode.multival_sep if mode.encoded else separator
    elif value_dim != 1:
        b.body["value_dim"] = value_dim
        b.body["separator"] = mode.multival_sep if mode.encoded else separator
    pooling = str(r.scalar("pooling", "sum")).lower()
    if sparse:
        if pooling not in ("sum", "mean"):
            b.ctx.refuse(r.at("pooling"), f"{pooling!r} is not supported (sum, mean are)")
        if b.seq is None:
            b.body["pooling"] = pooling
    b._default_value("0")
    b.common()
    if b.seq is not None:
        if sparse and mode.encoded:  # the column holds bucket ids, value_dim of them an element
            if value_dim != 1:
                b.body["value_dim"] = 0
            return "sequence_feature"
        return "sequence_raw_feature"
    # One number bucketized is an id_feature with boundaries (the same ids); several need
    # dynarec's raw_feature with boundaries (one id per number, pooled).
    if sparse and (mode.encoded or value_dim == 1 or not _raw_kind_has_boundaries()):
        if not mode.encoded and value_dim != 1:
            b.ctx.refuse(r.at("value_dim"), "several numbers bucketized need dynarec's raw_feature with boundaries")
        b.body.pop("value_dim", None)
        return "id_feature"
    return "raw_feature"


def _combo(b: _Build) -> str:
    """combo_feature (spec §2.3): the cartesian product of its inputs' values, bucketized."""
    return _ids_of_inputs(b, "combo_feature", _COMBO_TABLES)


def _ids_of_inputs(b: _Build, kind: str, tables: tuple[str, ...]) -> str:
    """A kind of ids computed from its ``expression``'s two (or more) inputs (combo, bool_mask)."""
    b.body["expression"] = b.inputs("expression", count=2)
    b.embedding(needed=True)
    b.table(tables, needed=True)
    b.values(value_dim_default=0, several_default=True)
    b.common()
    return _sparse_or_dense(b, sparse=True, kind=kind)


def _numeric_common(b: _Build, *, value_dim_default: int = 1) -> int:
    """value_dim, separator, pooling, default_value of the kinds whose output is numbers unless
    bucketized (lookup, match, expr, custom)."""
    r, mode = b.r, b.mode
    explicit = r.has("value_dim")
    value_dim = r.integer("value_dim", value_dim_default)
    separator = r.string("separator", "\x1d")
    pooling = str(r.scalar("pooling", "sum")).lower()
    sparse = b.bucketizer is not None
    if sparse:
        if pooling not in ("sum", "mean"):
            b.ctx.refuse(r.at("pooling"), f"{pooling!r} is not supported (sum, mean are)")
        b.body["pooling"] = pooling
    if explicit and value_dim != 1:
        b.body["value_dim"] = value_dim
    if separator != "\x1d" and not mode.encoded:
        b.body["separator"] = separator
    if mode.encoded and (sparse or value_dim > 1):
        b.body["separator"] = mode.multival_sep
    b._default_value("0")
    return value_dim


def _sparse_or_dense(b: _Build, *, sparse: bool, kind: str) -> str:
    """The dynarec kind: TorchEasyRec's own in FG modes; in FG_NONE an id_feature (ids) or
    raw_feature (numbers) over the feature's column."""
    if not b.mode.encoded:
        return kind
    for key in ("expression", "map", "key", "nested_map", "pkey", "skey", "variables", "operator_name", "query"):
        b.body.pop(key, None)
    for key in ("title", "document", "method", "kv_delimiter"):
        b.body.pop(key, None)
    for key in ("operator_params", "combiner", "normalizer", "value_separator"):
        b.body.pop(key, None)
    if sparse:
        b.body.pop("value_dim", None)
    return "id_feature" if sparse else "raw_feature"


def _lookup(b: _Build) -> str:
    """lookup_feature (spec §2.4): the values of the keys found in a map."""
    r = b.r
    b.body["map"] = b.inputs("map")
    b.body["key"] = b.inputs("key")
    which = b.table(_LOOKUP_TABLES, needed=False)
    dense_emb = b.dense_embedding() if which is None else None
    b.embedding(needed=which is not None or dense_emb is not None)
    combiner = str(r.scalar("combiner", "sum")).lower()
    if which is None or which == "boundaries":
        if combiner not in ("sum", "mean", "max", "min", "count", ""):
            b.ctx.refuse(r.at("combiner"), f"{combiner!r} is not supported (sum, mean, max, min, count are)")
        if combiner != "sum":
            b.body["combiner"] = combiner
    elif r.has("combiner"):
        b.ctx.note(r.at("combiner"), "ignored: each value found is one id (TorchEasyRec clears the combiner)")
    r.default_only("need_discrete", False, "discrete lookups without a bucketizer are not supported")
    r.default_only("need_key", False, "key-prefixed values are not supported")
    value_dim = _numeric_common(b)
    if value_dim > 1:
        b.body["value_separator"] = r.string("value_separator", ",")
    else:
        r.taken.add("value_separator")
    b.normalizer()
    b.common()
    return _sparse_or_dense(b, sparse=which is not None, kind="lookup_feature")


def _match(b: _Build) -> str:
    """match_feature (spec §2.5): the value at ``nested_map[pkey][skey]``."""
    r = b.r
    b.body["nested_map"] = b.inputs("nested_map")
    b.body["pkey"] = b.inputs("pkey", allow_all=True)
    b.body["skey"] = b.inputs("skey", allow_all=True)
    which = b.table(_LOOKUP_TABLES, needed=False)
    dense_emb = b.dense_embedding() if which is None else None
    b.embedding(needed=which is not None or dense_emb is not None)
    if which == "hash_bucket_size" and not b.mode.encoded:
        b.ctx.note(
            r.at("hash_bucket_size"),
            "the matched value's string form is hashed; pyfg's match feature may hash another string (spec §2.5, "
            "unverified)",
        )
    for key in ("need_discrete", "show_pkey", "show_skey"):
        r.default_only(key, False)
    value_dim = _numeric_common(b)
    if value_dim != 1:
        b.ctx.refuse(r.at("value_dim"), "a match feature gives one value")
    b.normalizer()
    b.common()
    return _sparse_or_dense(b, sparse=which is not None, kind="match_feature")


def _expr(b: _Build) -> str:
    """expr_feature (spec §2.6): a formula over its variables."""
    r = b.r
    formula = r.string("expression")
    if formula is None:
        b.ctx.refuse(r.at("expression"), "a formula is needed")
    variables = b.inputs("variables", count=1)
    if not b.mode.encoded:
        b.body["variables"] = variables
        b.body["expression"] = formula
    which = b.table(("boundaries",), needed=False)
    dense_emb = b.dense_embedding() if which is None else None
    b.embedding(needed=which is not None or dense_emb is not None)
    if r.has("fill_missing"):
        b.ctx.refuse(r.at("fill_missing"), "filling vectors of unequal length is not supported")
    r.taken.add("fill_missing")
    _numeric_common(b)
    b.common()
    return _sparse_or_dense(b, sparse=which is not None, kind="expr_feature")


# pyfg's built-in operators (spec §2.10): operator_lib_file names their library in the wheel.
_OPERATOR_LIBS = {
    "EditDistance": "libedit_distance.so",
    "RegexReplace": "libregex_replace.so",
    "SeqExpr": "libseq_expr.so",
}


def _custom_operators() -> list[str]:
    """The custom operators dynarec implements (its schema's ``CUSTOM_OPERATORS``)."""
    import importlib

    try:
        module = importlib.import_module("dynarec.config.features")
    except ImportError:
        return []
    return sorted(getattr(module, "CUSTOM_OPERATORS", {}))


def _custom(b: _Build) -> str:
    """custom_feature (spec §2.10): one of pyfg's built-in operators that dynarec implements."""
    r = b.r
    built_in = _custom_operators()
    operator = r.string("operator_name", "")
    lib = r.string("operator_lib_file", "")
    if operator not in built_in:
        b.ctx.refuse(
            r.at("operator_name"),
            f"{operator!r} is not an operator dynarec implements ({', '.join(built_in) or 'none'}); a custom .so "
            "cannot run in dynarec",
        )
    elif os.path.basename(lib) != _OPERATOR_LIBS.get(operator) or not lib.startswith("pyfg/lib/"):
        b.ctx.refuse(
            r.at("operator_lib_file"), f"{lib!r} is not pyfg's own {operator} ({_OPERATOR_LIBS.get(operator)})"
        )
    else:
        b.ctx.note(r.at("operator_lib_file"), f"pyfg's {operator}: dynarec's own implementation of it runs")
    r.ignore("is_op_thread_safe", "a threading hint to pyfg")
    inputs = b.inputs("expression", count=1)
    params = r.message("operator_params")
    if not b.mode.encoded:
        b.body["operator_name"] = operator
        b.body["expression"] = inputs
        if params is not None:
            b.body["operator_params"] = _struct(params)
    elif params is not None:
        params.taken.update(params.msg.names())
    which = b.table(_LOOKUP_TABLES, needed=False)
    dense_emb = b.dense_embedding() if which is None else None
    b.embedding(needed=which is not None or dense_emb is not None)
    if operator == "RegexReplace" and which in (None, "boundaries"):
        b.ctx.refuse(r.path, "RegexReplace gives strings: a bucketizer that makes ids of them is needed")
    _numeric_common(b)
    b.normalizer()
    b.common()
    return _sparse_or_dense(b, sparse=which is not None, kind="custom_feature")


def _struct(r: Reader) -> dict[str, Any]:
    """A ``google.protobuf.Struct`` in text format -> a dict."""
    out: dict[str, Any] = {}
    for f in r.messages("fields"):
        key = f.string("key", "")
        v = f.message("value")
        out[key] = _struct_value(v) if v is not None else None
        f.done()
    r.done()
    return out


def _struct_value(r: Reader) -> Any:
    kinds = r.msg.names()
    if len(kinds) != 1:
        r.ctx.refuse(r.path, "expected one of string_value, number_value, bool_value, list_value, struct_value")
        r.taken.update(kinds)
        return None
    kind = kinds[0]
    if kind == "struct_value":
        s = r.message(kind)
        value: Any = _struct(s) if s is not None else None
    elif kind == "list_value":
        lst = r.message(kind)
        value = [_struct_value(x) for x in lst.messages("values")] if lst is not None else []
        if lst is not None:
            lst.done()
    elif kind == "null_value":
        r.scalar(kind)
        value = None
    elif kind in ("string_value", "number_value", "bool_value"):
        value = r.scalar(kind)
    else:
        r.ctx.refuse(r.at(kind))
        r.taken.add(kind)
        value = None
    r.done()
    return value


_OVERLAP_METHODS = ("query_common_ratio", "title_common_ratio", "is_contain", "is_equal", "index_of")


def _overlap(b: _Build) -> str:
    """overlap_feature (spec §2.7): how much a query's and a title's terms overlap."""
    r = b.r
    b.body["query"] = b.inputs("query")
    b.body["title"] = b.inputs("title")
    method = str(r.scalar("method", ""))
    if method not in _OVERLAP_METHODS:
        b.ctx.refuse(
            r.at("method"),
            f"{method!r}: dynarec's methods are {list(_OVERLAP_METHODS)} (the proximity_* ones are not offered)",
        )
    b.body["method"] = method
    return _dense_kind(b, "overlap_feature", default_value=False)


def _kv_dot_product(b: _Build) -> str:
    """kv_dot_product (spec §2.8): the dot product of two weighted key sets."""
    r = b.r
    b.body["query"] = b.inputs("query")
    b.body["document"] = b.inputs("document")
    if r.has("kv_delimiter"):
        b.body["kv_delimiter"] = str(r.scalar("kv_delimiter"))
    r.taken.add("kv_delimiter")
    if r.has("normalizer"):
        b.ctx.note(r.at("normalizer"), "ignored: TorchEasyRec sends kv_dot_product's normalizer to no one")
    r.taken.add("normalizer")
    return _dense_kind(b, "kv_dot_product", default_value=True)


def _dense_kind(b: _Build, kind: str, *, default_value: bool) -> str:
    """The fields of a kind of one number a row: boundaries, or autodis / mlp, or dense."""
    r = b.r
    which = b.table(("boundaries",), needed=False)
    dense_emb = b.dense_embedding() if which is None else None
    b.embedding(needed=which is not None or dense_emb is not None)
    if _numeric_common(b) != 1:
        b.ctx.refuse(r.at("value_dim"), f"{kind} gives one number a row")
    b.body.pop("value_dim", None)
    if not default_value:
        b.body.pop("default_value", None)
    if kind == "overlap_feature":
        b.normalizer()
    b.common()
    return _sparse_or_dense(b, sparse=which is not None, kind=kind)


def _bool_mask(b: _Build) -> str:
    """bool_mask_feature (spec §2.11): the values a mask keeps, bucketized as ids."""
    return _ids_of_inputs(b, "bool_mask_feature", _ID_TABLES)


_NORM_OPTIONS = (
    "TEXT_LOWER2UPPER",
    "TEXT_UPPER2LOWER",
    "TEXT_SBC2DBC",
    "TEXT_CHT2CHS",
    "TEXT_FILTER",
    "TEXT_SPLITCHRS",
    "TEXT_REMOVE_SPACE",
)


def _tokenize(b: _Build) -> str:
    """tokenize_feature (spec §2.9): a text's token ids (a tokenizer file), pooled. FG_NONE: the
    column holds the ids, a fixed table of the tokenizer's vocabulary size."""
    r, mode = b.r, b.mode
    b.single_input()
    b.embedding(needed=True)
    r.default_only("tokens_as_sequence", False, "tokens as a sequence of embeddings is not supported (pooled are)")
    kind = str(r.scalar("tokenizer_type", "bpe"))
    if kind not in ("bpe", "sentencepiece"):
        b.ctx.refuse(r.at("tokenizer_type"), f"{kind!r}: TorchEasyRec's tokenizer types are bpe and sentencepiece")
    found = b.asset(r, "vocab_file")
    b.bucketizer = "tokenizer"
    pooling = str(r.scalar("pooling", "sum")).lower()
    if pooling not in ("sum", "mean"):
        b.ctx.refuse(r.at("pooling"), f"{pooling!r} is not supported (sum, mean are)")
    b.body["pooling"] = pooling
    norm = r.message("text_normalizer")
    if mode.encoded:
        if found is not None and kind in ("bpe", "sentencepiece"):
            from dynarec.features.text import TokenizerError, tokenizer

            try:
                b.rows = b.body["num_buckets"] = tokenizer(str(found[0]), kind).vocab_size
            except TokenizerError as e:
                b.ctx.refuse(r.at("vocab_file"), str(e))
        b.body["separator"] = mode.multival_sep
        if norm is not None:
            b.ctx.note(norm.path, "FG_NONE: the column holds token ids, normalized already")
            norm.taken.update(norm.msg.names())
            norm.done()
        b._default_value("")
        b.common()
        return "id_feature"
    if found is not None:
        b.body["vocab_file"] = found[1]
    if kind != "bpe":
        b.body["tokenizer_type"] = kind
    if norm is not None:
        b.body["text_normalizer"] = _text_normalizer(b, norm)
    b._default_value("")
    b.common()
    return "tokenize_feature"


def _text_normalizer(b: _Build, norm: Reader) -> dict[str, Any]:
    out: dict[str, Any] = {}
    options = [str(o) for o in norm.msg.values("norm_options")]
    norm.taken.add("norm_options")
    bad = [o for o in options if o not in _NORM_OPTIONS]
    if bad:
        b.ctx.refuse(norm.at("norm_options"), f"{bad}: TorchEasyRec's options are {list(_NORM_OPTIONS)}")
    if options:
        out["norm_options"] = options
    if norm.has("max_length"):
        out["max_length"] = norm.integer("max_length")
    if norm.has("stop_char_file"):
        found = b.asset(norm, "stop_char_file")
        if found is not None:
            out["stop_char_file"] = found[1]
    elif "TEXT_FILTER" in (options or ["TEXT_FILTER"]):
        b.ctx.note(
            norm.path,
            "TEXT_FILTER without stop_char_file: dynarec removes Unicode punctuation, symbols and controls (pyfg's "
            "built-in list is not published; texts holding other characters it lists tokenize differently)",
        )
    if not options:
        b.ctx.note(
            norm.path,
            "no norm_options: TorchEasyRec's default TEXT_LOWER2UPPER, TEXT_SBC2DBC, TEXT_CHT2CHS, TEXT_FILTER "
            "(upper-cased before the tokenizer)",
        )
    norm.done()
    return out


_KINDS: dict[str, Callable[[_Build], str]] = {
    "id_feature": _id,
    "raw_feature": _raw,
    "combo_feature": _combo,
    "lookup_feature": _lookup,
    "match_feature": _match,
    "expr_feature": _expr,
    "custom_feature": _custom,
    "tokenize_feature": _tokenize,
    "overlap_feature": _overlap,
    "kv_dot_product": _kv_dot_product,
    "bool_mask_feature": _bool_mask,
}

_FEATURE_KINDS = (
    "id_feature",
    "raw_feature",
    "sequence_feature",
    "sequence_id_feature",
    "combo_feature",
    "lookup_feature",
    "match_feature",
    "expr_feature",
    "overlap_feature",
    "tokenize_feature",
    "custom_feature",
    "kv_dot_product",
    "bool_mask_feature",
    "combine_feature",
    "sequence_raw_feature",
    "sequence_combo_feature",
    "sequence_lookup_feature",
    "sequence_match_feature",
    "sequence_expr_feature",
    "sequence_overlap_feature",
    "sequence_tokenize_feature",
    "sequence_custom_feature",
    "sequence_kv_dot_product",
    "sequence_bool_mask_feature",
    "sequence_combine_feature",
)
_SUB_KINDS = {"id_feature": _id, "raw_feature": _raw}
_SIMPLE_SEQUENCES = {"sequence_id_feature": _id, "sequence_raw_feature": _raw}


def _one(r: Reader, kind: str, convert: Callable[[_Build], str], mode: Mode, seq: Optional[_Seq]) -> Converted:
    """One feature, its refusals collected."""
    start = len(r.ctx.refused)
    b = _Build(r, kind, mode, seq)
    out_kind = convert(b)
    return Converted(out_kind, b.body, r.path, r.ctx.refused[start:], b.reads)


def convert_features(readers: list[Reader], mode: Mode) -> list[Converted]:
    out: list[Converted] = []
    for r in readers:
        start = len(r.ctx.refused)
        found = one_of(r, _FEATURE_KINDS)
        r.done()
        if found is None:
            out.append(Converted("id_feature", {"feature_name": ""}, r.path, r.ctx.refused[start:]))
            continue
        kind, f = found
        if kind in _KINDS:
            out.append(_one(f, kind, _KINDS[kind], mode, None))
        elif kind in _SIMPLE_SEQUENCES:
            seq = _Seq(None, f.integer("sequence_length"), f.string("sequence_delim", ";"))
            out.append(_one(f, kind.removeprefix("sequence_"), _SIMPLE_SEQUENCES[kind], mode, seq))
        elif kind == "sequence_feature":
            out.extend(_grouped_sequence(f, mode))
        else:
            f.ctx.refuse(f.path, f"dynarec has no {kind} (docs/features.md lists the kinds it has)")
            f.taken.update(f.msg.names())
            name = str((f.msg.values("feature_name") or [""])[0])
            out.append(Converted("id_feature", {"feature_name": name}, f.path, r.ctx.refused[start:]))
    return out


def _grouped_sequence(f: Reader, mode: Mode) -> list[Converted]:
    """A grouped ``sequence_feature`` (spec §1.7, §2.12): one dynarec sequence feature per
    sub-feature, named ``<sequence_name>__<feature_name>``. A refusal of the sequence itself
    belongs to every sub-feature."""
    start = len(f.ctx.refused)
    name = f.string("sequence_name", "")
    if not name:
        f.ctx.refuse(f.at("sequence_name"), "a sequence_name is needed")
    length = f.integer("sequence_length")
    if not length:
        f.ctx.refuse(f.at("sequence_length"), "a sequence_length is needed")
    delim = f.string("sequence_delim", ";")
    f.ignore("sequence_pk", "the serving key of the sequence")
    subs = f.messages("features")
    f.done()
    shared = f.ctx.refused[start:]
    out: list[Converted] = []
    for sub in subs:
        start = len(f.ctx.refused)
        found = one_of(sub, tuple(_FEATURE_KINDS))
        sub.done()
        if found is None:
            out.append(Converted("sequence_feature", {"feature_name": ""}, sub.path, shared + f.ctx.refused[start:]))
            continue
        kind, s = found
        fields = s.strings("sequence_fields") if s.has("sequence_fields") else None
        if kind not in _SUB_KINDS:
            s.ctx.refuse(
                s.path, f"a {kind} inside a sequence_feature is not supported (id_feature and raw_feature are)"
            )
            s.taken.update(s.msg.names())
            sub_name = f"{name}{mode.sub_separator}{(s.msg.values('feature_name') or [''])[0]}"
            out.append(
                Converted("sequence_feature", {"feature_name": sub_name}, s.path, shared + f.ctx.refused[start:])
            )
            continue
        c = _one(s, kind, _SUB_KINDS[kind], mode, _Seq(name, length, delim, fields))
        c.refused = shared + c.refused
        out.append(c)
    return out


def default_sequence_lengths(features: list[Converted], names: set[str], length: int, ctx: Context) -> None:
    """FG_NONE ``sequence_id_feature`` / ``sequence_raw_feature`` of ``names`` (those a generative
    ranker reads) without ``sequence_length`` (optional in TorchEasyRec, used only by pyfg's
    truncation): ``length``, the model's ``max_seq_len``, with a note. Elsewhere dynarec's schema
    refuses a sequence feature without one."""
    for f in features:
        # (a grouped sequence_feature without one is refused already: TorchEasyRec requires it there)
        if f.name not in names or not f.sequence or "sequence_length" in f.body or f.refused:
            continue
        f.body["sequence_length"] = length
        ctx.note(
            f"{f.path}.sequence_length",
            f"not given: {length}. TorchEasyRec does not truncate FG_NONE sequences; dynarec keeps each row's last "
            f"{length} elements, the model's max_seq_len",
        )
