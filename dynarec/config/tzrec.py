"""``dynarec import-config``: a TorchEasyRec ``pipeline.config`` as a dynarec YAML config.

Every field of the input is either carried (same name and meaning), mapped (to a named dynarec
setting; the note says how), ignored with a printed note (settings with no effect on what is
trained: ODPS connection details once the data source is replaced, thread counts, tensorboard
switches), or refused: an error naming its path (``model_config.multi_tower_din.towers[1].mlp.
use_bn: not supported``). Nothing is dropped silently; ``lenient=True`` turns refusals into a
list of dropped fields. docs/import_config.md has the table of every field.

The semantics are TorchEasyRec's (``tzrec/protos``, ``tzrec/features``, ``tzrec/models``):

- ``fg_mode: FG_NONE``: the input holds encoded ids: a feature reads the column named after
  it, ``hash_bucket_size`` and ``boundaries`` tables take their ids as they are, normalizers
  do not apply. ``FG_DAG`` / ``FG_NORMAL``: a feature reads its ``expression``'s column and
  dynarec does the feature generation (hashing, bucketizing, normalizing).
- Sub-features of a ``sequence_feature`` are named ``<sequence_name>__<feature_name>`` and
  read the column ``<sequence_name>__<input_name>`` (``FG_NONE``: ``__<feature_name>``).
- Features of a ``WIDE`` group get their own tables (``<table>_wide``) of
  ``wide_embedding_dim`` (default 4), as TorchEasyRec builds them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from dynarec.config.textproto import Message, Scalar, parse

__all__ = ["ConversionError", "ConversionResult", "convert_pipeline_config"]


class ConversionError(ValueError):
    """Fields the conversion cannot carry; the message lists each one's path."""


@dataclass
class ConversionResult:
    config: dict[str, Any]  # dynarec YAML, as a dict
    notes: list[str] = field(default_factory=list)  # mapped / ignored fields, for the user to read
    dropped: list[str] = field(default_factory=list)  # refused fields dropped under lenient


class _Context:
    def __init__(self, lenient: bool):
        self.lenient = lenient
        self.notes: list[str] = []
        self.refused: list[str] = []

    def refuse(self, path: str, why: str = "not supported") -> None:
        self.refused.append(f"{path}: {why}")

    def note(self, path: str, text: str) -> None:
        self.notes.append(f"{path}: {text}")


def _integer(value: Any) -> int:
    """``value`` if it is an int64 integer; ValueError saying why not."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {_shown(value)}")
    if not -(2**63) <= value < 2**63:
        raise ValueError(f"{_shown(value)} does not fit int64")
    return value


def _number(value: Any) -> float:
    """``value`` as a finite float; ValueError saying why not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {_shown(value)}")
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x):
        raise ValueError(f"{_shown(value)} is not a finite number")
    return x


def _shown(value: Any) -> str:
    """A value as an error message quotes it (at most 40 characters)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]} ({len(text)} characters)"


class _Reader:
    """One message being converted: every field must be taken by a handler, else it is
    refused when :meth:`done` runs (so a field nobody handles can never pass silently)."""

    def __init__(self, msg: Message, path: str, ctx: _Context):
        self.msg, self.path, self.ctx = msg, path, ctx
        self.taken: set[str] = set()

    def at(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def has(self, name: str) -> bool:
        return bool(self.msg.values(name))

    def scalar(self, name: str, default: Any = None) -> Any:
        self.taken.add(name)
        values = self.msg.values(name)
        if not values:
            return default
        if len(values) > 1 or isinstance(values[0], Message):
            self.ctx.refuse(self.at(name), "expected one value")
            return default
        return values[0]

    def integer(self, name: str, default: Any = None) -> Any:
        """An integer field (``16.5``, ``"16"``, ``true`` or a number past int64 are refused by
        path; the default, or 0, is returned in their place so conversion lists every refusal)."""
        value = self.scalar(name, default)
        return default if value is default else self._checked(_integer, value, self.at(name), default, 0)

    def number(self, name: str, default: Any = None) -> Any:
        """A finite number field (an integer is taken as one; ``1e999``, ``nan`` and strings are
        refused by path)."""
        value = self.scalar(name, default)
        return default if value is default else self._checked(_number, value, self.at(name), default, 0.0)

    def integers(self, name: str) -> list[int]:
        """A repeated integer field; a value that is not one is refused by its path."""
        return [self._checked(_integer, v, f"{self.at(name)}[{i}]", 0, 0) for i, v in enumerate(self.repeated(name))]

    def numbers(self, name: str) -> list[float]:
        """A repeated finite-number field; a value that is not one is refused by its path."""
        return [self._checked(_number, v, f"{self.at(name)}[{i}]", 0.0, 0.0) for i, v in enumerate(self.repeated(name))]

    def _checked(self, convert, value: Any, path: str, default: Any, fallback: Any) -> Any:
        try:
            return convert(value)
        except ValueError as e:
            self.ctx.refuse(path, str(e))
            return fallback if default is None else default

    def repeated(self, name: str) -> list[Scalar]:
        self.taken.add(name)
        values = self.msg.values(name)
        if any(isinstance(v, Message) for v in values):
            self.ctx.refuse(self.at(name), "expected values, got a block")
            return []
        return values  # type: ignore[return-value]

    def message(self, name: str) -> Optional[_Reader]:
        found = self.messages(name)
        if len(found) > 1:
            self.ctx.refuse(self.at(name), "given more than once")
        return found[0] if found else None

    def messages(self, name: str) -> list[_Reader]:
        self.taken.add(name)
        out = []
        values = self.msg.values(name)
        for i, v in enumerate(values):
            if not isinstance(v, Message):
                self.ctx.refuse(self.at(name), "expected a block")
                continue
            out.append(_Reader(v, self.at(name) + (f"[{i}]" if len(values) > 1 else ""), self.ctx))
        return out

    def default_only(self, name: str, default: Any, why: str = "not supported") -> None:
        """A field dynarec has no setting for: accepted at TorchEasyRec's default, else refused."""
        value = self.scalar(name, default)
        if value != default:
            self.ctx.refuse(self.at(name), f"{why} (only {default!r}, its default, is)")

    def refuse(self, *names: str, why: str = "not supported") -> None:
        """Fields dynarec has nothing for: taken, and refused when given."""
        for name in names:
            self.taken.add(name)
            if self.msg.values(name):
                self.ctx.refuse(self.at(name), why)

    def ignore(self, name: str, why: str) -> None:
        """A field with no effect on what is trained here: taken, with a note when given."""
        self.taken.add(name)
        if self.msg.values(name):
            self.ctx.note(self.at(name), f"ignored ({why})")

    def done(self) -> None:
        for name in self.msg.names():
            if name not in self.taken:
                self.ctx.refuse(self.at(name))


# -- learning rates and optimizers ------------------------------------------------------------------

_LR_FIELDS = (
    "constant_learning_rate",
    "exponential_decay_learning_rate",
    "manual_step_learning_rate",
    "cosine_annealing_learning_rate",
    "cosine_annealing_warm_restarts_learning_rate",
)


def _lr_schedule(r: _Reader) -> dict[str, Any]:
    """The optimizer's learning_rate oneof -> a dynarec ``*_lr_schedule``."""
    given = [n for n in _LR_FIELDS if r.has(n)]
    for n in _LR_FIELDS:
        r.taken.add(n)
    if not given:
        return {"kind": "constant"}
    if len(given) > 1:
        r.ctx.refuse(r.at(given[1]), "a second learning rate schedule")
    name = given[0]
    s = r.message(name)
    assert s is not None
    out: dict[str, Any]
    if name == "constant_learning_rate":
        out = {"kind": "constant"}
    elif name == "exponential_decay_learning_rate":
        decay = s.integer("decay_size")
        if not decay:
            r.ctx.refuse(s.at("decay_size"), "must be > 0 (TorchEasyRec divides by it)")
            decay = 1
        out = {
            "kind": "exponential_decay",
            "decay_steps": decay,
            "decay_rate": s.number("decay_factor", 0.95),
            "staircase": bool(s.scalar("staircase", True)),
            "warmup_steps": s.integer("warmup_size", 0),
            "warmup_learning_rate": s.number("warmup_learning_rate", 0.0),
            "min_learning_rate": s.number("min_learning_rate", 0.0),
        }
        s.default_only("by_epoch", False, "a schedule stepped per epoch is not supported")
    elif name == "manual_step_learning_rate":
        out = {
            "kind": "manual_step",
            "schedule_steps": s.integers("schedule_sizes"),
            "learning_rates": s.numbers("learning_rates"),
            "warmup": bool(s.scalar("warmup", False)),
        }
        s.default_only("by_epoch", False, "a schedule stepped per epoch is not supported")
    else:
        r.ctx.refuse(r.at(name))
        out = {"kind": "constant"}
        s.taken.update(s.msg.names())
    s.done()
    return out


_SPARSE_OPTIMIZERS = (
    "sgd_optimizer",
    "adagrad_optimizer",
    "adam_optimizer",
    "lars_sgd_optimizer",
    "lamb_optimizer",
    "partial_rowwise_lamb_optimizer",
    "partial_rowwise_adam_optimizer",
    "rowwise_adagrad_optimizer",
    "adadelta_optimizer",
    "rmsprop_optimizer",
)
_DENSE_OPTIMIZERS = (
    "sgd_optimizer",
    "adagrad_optimizer",
    "adam_optimizer",
    "adamw_optimizer",
    "adadelta_optimizer",
    "rmsprop_optimizer",
)
_WEIGHT_DECAY_MODES = {"NONE": "none", "L2": "l2", "DECOUPLE": "decoupled"}


def _one_of(r: _Reader, names: tuple[str, ...]) -> Optional[tuple[str, _Reader]]:
    given = [n for n in names if r.has(n)]
    for n in names:
        r.taken.add(n)
    if len(given) != 1:
        r.ctx.refuse(r.path, f"give exactly one of {list(names)} (got {given or 'none'})")
        return None
    sub = r.message(given[0])
    assert sub is not None
    return given[0], sub


def _sparse_optimizer(r: _Reader) -> tuple[dict[str, Any], dict[str, Any]]:
    found = _one_of(r, _SPARSE_OPTIMIZERS)
    schedule = _lr_schedule(r)
    r.done()
    if found is None:
        return {"sgd_optimizer": {"lr": 0.002}}, schedule
    name, o = found
    fields: dict[str, Any] = {"lr": o.number("lr", 0.002)}
    o.default_only("gradient_clipping", False, "gradient clipping of sparse updates is not supported")
    o.scalar("max_gradient")  # used only with gradient_clipping
    if name == "adagrad_optimizer":
        fields["initial_accumulator_value"] = o.number("initial_accumulator_value", 0.0)
    elif name == "adam_optimizer":
        fields.update(
            beta1=o.number("beta1", 0.9),
            beta2=o.number("beta2", 0.999),
            weight_decay=o.number("weight_decay", 0.0),
        )
    elif name == "rowwise_adagrad_optimizer":
        fields["weight_decay"] = o.number("weight_decay", 0.0)
        mode = str(o.scalar("weight_decay_mode", "NONE"))
        fields["weight_decay_mode"] = _WEIGHT_DECAY_MODES.get(mode, "none")
        if mode not in _WEIGHT_DECAY_MODES:
            r.ctx.refuse(o.at("weight_decay_mode"), f"unknown mode {mode!r}")
    elif name != "sgd_optimizer":
        r.ctx.refuse(r.at(name))
        o.taken.update(o.msg.names())
    o.done()
    return {name: fields}, schedule


def _dense_optimizer(r: _Reader) -> tuple[dict[str, Any], dict[str, Any]]:
    found = _one_of(r, _DENSE_OPTIMIZERS)
    schedule = _lr_schedule(r)
    r.refuse("part_optimizers", "ema")
    r.done()
    if found is None:
        return {"adam_optimizer": {"lr": 0.002}}, schedule
    name, o = found
    fields: dict[str, Any] = {"lr": o.number("lr", 0.002), "weight_decay": o.number("weight_decay", 0.0)}
    o.ignore("fused", "a torch kernel choice; the update is the same")
    if name == "sgd_optimizer":
        fields["momentum"] = o.number("momentum", 0.9)  # TorchEasyRec's default, not torch's 0
        o.default_only("dampening", 0.0)
        o.default_only("nesterov", False)
    elif name == "adagrad_optimizer":
        fields.update(
            initial_accumulator_value=o.number("initial_accumulator_value", 0.0),
            eps=o.number("eps", 1e-10),
        )
    elif name in ("adam_optimizer", "adamw_optimizer"):
        fields.update(beta1=o.number("beta1", 0.9), beta2=o.number("beta2", 0.999), eps=o.number("eps", 1e-8))
        o.default_only("amsgrad", False)
    else:
        r.ctx.refuse(r.at(name))
        o.taken.update(o.msg.names())
    o.done()
    return {name: fields}, schedule


# -- features --------------------------------------------------------------------------------------


@dataclass
class _Mode:
    encoded: bool  # FG_NONE: columns hold ids, named after the features
    multival_sep: str = "\x03"  # FG_NONE: the separator of several ids in a string column


_INIT_FN = re.compile(r"^\s*nn\.init\.(?P<fn>\w+)\s*(?:,(?P<args>.*))?$")


def _initializer(text: str, path: str, ctx: _Context) -> Optional[dict[str, Any]]:
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


def _dynamic_initializer(r: _Reader) -> dict[str, Any]:
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
        if r.has("std_dev"):
            out["std"] = r.number("std_dev")
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


def _dynamicemb(r: _Reader, init: Optional[dict[str, Any]]) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """The ``dynamicemb`` block -> dynarec's (and the table initializer it carries)."""
    out: dict[str, Any] = {"max_capacity": r.integer("max_capacity", 0)}
    if r.has("init_capacity_per_rank"):
        out["init_capacity"] = r.integer("init_capacity_per_rank")
        r.ctx.note(r.at("init_capacity_per_rank"), "mapped to init_capacity (the table's, on one process)")
    score = str(r.scalar("score_strategy", "STEP")).upper()
    if score in _SCORES:
        out["score_strategy"] = _SCORES[score]
    else:
        r.ctx.refuse(r.at("score_strategy"), f"{score!r} is not supported (STEP, TIMESTAMP, LFU, NO_EVICTION are)")
    if r.has("bucket_capacity"):
        out["bucket_size"] = r.integer("bucket_capacity")
    else:
        r.ctx.note(r.at("bucket_capacity"), "unset: dynarec's 16-slot buckets (dynamicemb's default is 128)")
    if (i := r.message("initializer_args")) is not None:
        init = _dynamic_initializer(i)
    if (e := r.message("eval_initializer_args")) is not None:
        out["eval_initializer"] = _dynamic_initializer(e)
    if (a := r.message("frequency_admission_strategy")) is not None:
        adm: dict[str, Any] = {"threshold": a.integer("threshold", 1)}
        if a.has("counter_capacity"):
            adm["capacity"] = a.integer("counter_capacity")
        if (ai := a.message("initializer_args")) is not None:
            adm["initializer"] = _dynamic_initializer(ai)
        a.ignore("counter_bucket_capacity", "the counter's bucket size, a layout choice")
        a.done()
        out["admission"] = adm
    r.ignore("cache_load_factor", "dynamicemb's HBM cache sizing; dynarec keeps the table on the device")
    r.done()
    return out, init


def _split_expression(expression: str, path: str, ctx: _Context) -> str:
    side, _, column = expression.partition(":")
    if side not in ("user", "item", "context") or not column:
        ctx.refuse(path, f"{expression!r}: only 'user:', 'item:' and 'context:' inputs (data columns) are supported")
    return column or expression


_COMMON_DEFAULTS: tuple[tuple[str, Any], ...] = (
    ("use_mask", False),
    ("trainable", True),
    ("stub_type", False),
    ("data_type", "FP32"),
    ("weighted", False),
)


def _id_feature(
    r: _Reader, mode: _Mode, *, name_prefix: str = "", sequence: Optional[dict[str, Any]] = None
) -> dict[str, Any]:
    """An ``id_feature`` (or ``sequence_id_feature`` / a sequence sub-feature) -> its dynarec
    feature block ``{"id_feature" | "sequence_feature": {...}}``."""
    name = str(r.scalar("feature_name", ""))
    out: dict[str, Any] = {"feature_name": name_prefix + name}
    expression = r.scalar("expression")
    if mode.encoded:
        if name_prefix:
            out["input_name"] = name_prefix + name
        elif expression is not None:
            r.ctx.note(r.at("expression"), "FG_NONE: the column named after the feature is read")
    elif expression is not None:
        column = _split_expression(str(expression), r.at("expression"), r.ctx)
        if name_prefix:
            out["input_name"] = name_prefix + column
        else:
            out["expression"] = str(expression)
    out["embedding_dim"] = r.integer("embedding_dim", 0)
    if r.has("embedding_name"):
        out["embedding_name"] = str(r.scalar("embedding_name"))
    init = _initializer(str(r.scalar("init_fn")), r.at("init_fn"), r.ctx) if r.has("init_fn") else None
    kinds = [k for k in ("num_buckets", "hash_bucket_size", "dynamicemb") if r.has(k)]
    for k in ("vocab_list", "vocab_dict", "vocab_file", "zch"):
        if r.has(k):
            kinds.append(k)
            r.taken.add(k)
            r.ctx.refuse(r.at(k))
    if len(kinds) != 1:
        r.ctx.refuse(r.path, f"give exactly one of num_buckets, hash_bucket_size, dynamicemb (got {kinds or 'none'})")
    if r.has("num_buckets"):
        out["num_buckets"] = r.integer("num_buckets")
    if r.has("hash_bucket_size"):
        size = r.integer("hash_bucket_size")
        if mode.encoded:
            out["num_buckets"] = size
            r.ctx.note(r.at("hash_bucket_size"), "FG_NONE: the input holds bucket ids, a fixed table of that many rows")
        else:
            out["hash_bucket_size"] = size
            r.ctx.note(
                r.at("hash_bucket_size"),
                "values hashed with FarmHash Fingerprint64 (TorchEasyRec with USE_FARM_HASH_TO_BUCKETIZE=true; its "
                "default std::hash puts ids in other buckets)",
            )
    if (d := r.message("dynamicemb")) is not None:
        out["dynamicemb"], init = _dynamicemb(d, init)
        if not mode.encoded:
            out["value_type"] = "string"  # TorchEasyRec hashes a dynamicemb feature's string form too
    if init is not None:
        out["initializer"] = init
    pooling = str(r.scalar("pooling", "sum"))
    separator = r.scalar("separator", "\x1d")
    value_dim = r.integer("value_dim", 1 if sequence is not None else 0)
    if sequence is not None:
        out.update(sequence)
        if value_dim != 1:
            r.ctx.refuse(r.at("value_dim"), "a sequence takes one value per position")
    else:
        if pooling not in ("sum", "mean"):
            r.ctx.refuse(r.at("pooling"), f"{pooling!r} is not supported (sum, mean are)")
        out["pooling"] = pooling
        if value_dim == 0:  # several values per sample in a string column
            out["separator"] = mode.multival_sep if mode.encoded else separator
        elif value_dim != 1:
            r.ctx.refuse(r.at("value_dim"), "only 0 (several values) and 1 are supported")
    default = r.scalar("default_value", "")
    if default not in ("", "0" if sequence is not None else ""):
        r.ctx.refuse(r.at("default_value"), "filling missing values is not supported (dynarec refuses a null id)")
    for key, value in _COMMON_DEFAULTS:
        r.default_only(key, value)
    r.refuse("fg_encoded_default_value", "default_bucketize_value", "fg_value_type", "asset_dir")
    r.ignore("embedding_constraints", "sharding constraints; dynarec's planner shards tables")
    if sequence is None:
        r.refuse("sequence_length", "sequence_delim", "sequence_fields", why="belongs to sequence features")
    r.done()
    return {"sequence_feature" if sequence is not None else "id_feature": out}


def _normalizer(text: str, path: str, ctx: _Context) -> Optional[dict[str, Any]]:
    """``"method=expression,expr=log(x+3)"`` / ``zscore`` / ``minmax`` -> dynarec's normalizer."""
    parts = dict(kv.split("=", 1) for kv in (p.strip() for p in text.split(",")) if "=" in kv)
    method = parts.get("method")
    try:
        if method == "expression" and "expr" in parts:
            return {"expression": text.split("expr=", 1)[1]}
        if method == "zscore":
            return {"mean": float(parts.get("mean", 0.0)), "std": float(parts.get("standard_deviation", 1.0))}
        if method == "minmax":
            lo, hi = float(parts["min"]), float(parts["max"])
            return {"mean": lo, "std": hi - lo}
    except (KeyError, ValueError):
        pass
    ctx.refuse(path, f"normalizer {text!r} is not supported (method=expression, zscore and minmax are)")
    return None


def _raw_feature(r: _Reader, mode: _Mode) -> dict[str, Any]:
    name = str(r.scalar("feature_name", ""))
    expression = r.scalar("expression")
    column: dict[str, Any] = {}
    if not mode.encoded and expression is not None:
        _split_expression(str(expression), r.at("expression"), r.ctx)
        column = {"expression": str(expression)}
    elif mode.encoded and expression is not None:
        r.ctx.note(r.at("expression"), "FG_NONE: the column named after the feature is read")
    boundaries = r.numbers("boundaries")
    normalizer = _normalizer(str(r.scalar("normalizer")), r.at("normalizer"), r.ctx) if r.has("normalizer") else None
    if normalizer is not None and mode.encoded:
        r.ctx.note(
            r.at("normalizer"), "FG_NONE: TorchEasyRec applies no normalizer to encoded input; neither does this"
        )
        normalizer = None
    r.default_only("value_dim", 1, "only one value per sample is supported")
    r.scalar("separator")
    default = r.scalar("default_value", "0")
    if default != "0":
        r.ctx.refuse(r.at("default_value"), "filling missing values is not supported (dynarec refuses a NaN)")
    for key, value in _COMMON_DEFAULTS[:4]:
        r.default_only(key, value)
    r.refuse("autodis", "mlp", "fg_encoded_default_value", "sequence_length", "sequence_delim", "sequence_fields")
    r.ignore("embedding_constraints", "sharding constraints; dynarec's planner shards tables")
    r.scalar("pooling")
    if boundaries:
        out: dict[str, Any] = {"feature_name": name, **column, "embedding_dim": r.integer("embedding_dim", 0)}
        if r.has("embedding_name"):
            out["embedding_name"] = str(r.scalar("embedding_name"))
        if r.has("init_fn"):
            init = _initializer(str(r.scalar("init_fn")), r.at("init_fn"), r.ctx)
            if init is not None:
                out["initializer"] = init
        if normalizer is not None:
            r.ctx.refuse(r.at("normalizer"), "a normalizer before boundaries is not supported")
        if mode.encoded:
            out["num_buckets"] = len(boundaries) + 1
        else:
            out["boundaries"] = boundaries
        r.done()
        return {"id_feature": out}
    r.refuse("embedding_dim", "embedding_name", "init_fn", why="an embedding of a raw feature needs boundaries")
    r.done()
    raw: dict[str, Any] = {"feature_name": name, **column}
    if normalizer is not None:
        raw["normalizer"] = normalizer
    return {"raw_feature": raw}


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


def _features(readers: list[_Reader], mode: _Mode) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in readers:
        found = _one_of(r, _FEATURE_KINDS)
        r.done()
        if found is None:
            continue
        kind, f = found
        if kind == "id_feature":
            out.append(_id_feature(f, mode))
        elif kind == "raw_feature":
            out.append(_raw_feature(f, mode))
        elif kind == "sequence_id_feature":
            seq = {
                "sequence_length": f.integer("sequence_length", 0),
                "separator": str(f.scalar("sequence_delim", ";")),
            }
            if not seq["sequence_length"]:
                r.ctx.refuse(f.at("sequence_length"), "dynarec needs the sequence length")
            f.ignore("sequence_fields", "which inputs are sequences: the feature's column is")
            out.append(_id_feature(f, mode, sequence=seq))
        elif kind == "sequence_feature":
            prefix = str(f.scalar("sequence_name", "")) + "__"
            seq = {
                "sequence_length": f.integer("sequence_length", 0),
                "separator": str(f.scalar("sequence_delim", ";")),
            }
            f.ignore("sequence_pk", "the serving key of the sequence")
            for sub in f.messages("features"):
                found_sub = _one_of(sub, _FEATURE_KINDS)
                sub.done()
                if found_sub is None:
                    continue
                sub_kind, s = found_sub
                if sub_kind != "id_feature":
                    r.ctx.refuse(s.path, "only id_feature is supported inside a sequence_feature")
                    s.taken.update(s.msg.names())
                    continue
                s.ignore("sequence_fields", "which inputs are sequences: all of them here")
                out.append(_id_feature(s, mode, name_prefix=prefix, sequence=seq))
            f.done()
        else:
            r.ctx.refuse(f.path)
            f.taken.update(f.msg.names())
    return out


# -- model -----------------------------------------------------------------------------------------

_GROUP_TYPES = {"DEEP": "deep", "WIDE": "wide", "SEQUENCE": "sequence", "JAGGED_SEQUENCE": "sequence"}


def _mlp(r: Optional[_Reader], path: str, ctx: _Context) -> list[int]:
    if r is None:
        ctx.refuse(path, "an MLP with hidden_units is needed")
        return [1]
    units = r.integers("hidden_units")
    if not units:
        ctx.refuse(r.at("hidden_units"), "at least one layer is needed")
    dropout = r.numbers("dropout_ratio")
    if any(dropout):
        ctx.refuse(r.at("dropout_ratio"), "dropout is not supported")
    activation = str(r.scalar("activation", "nn.ReLU"))
    if activation != "nn.ReLU":
        ctx.refuse(r.at("activation"), f"{activation!r} is not supported (nn.ReLU, on every layer, is)")
    r.default_only("use_bn", False)
    r.default_only("use_ln", False)
    r.default_only("bias", True)
    r.done()
    return units or [1]


def _groups(r: _Reader, wide_rename: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for g in r.messages("feature_groups"):
        kind = str(g.scalar("group_type", "DEEP"))
        if kind not in _GROUP_TYPES:
            g.ctx.refuse(g.at("group_type"), f"{kind!r} is not supported")
        if kind == "JAGGED_SEQUENCE":
            g.ctx.note(g.at("group_type"), "JAGGED_SEQUENCE mapped to sequence (padded; the same results)")
        names = [str(n) for n in g.repeated("feature_names")]
        if kind == "WIDE":
            names = [wide_rename.get(n, n) for n in names]
        g.refuse("sequence_groups", "sequence_encoders", "embedding_name_suffix")
        out.append(
            {
                "group_name": str(g.scalar("group_name", "")),
                "feature_names": names,
                "group_type": _GROUP_TYPES.get(kind, "deep"),
            }
        )
        g.done()
    return out


def _model(r: _Reader, features: list[dict[str, Any]], ctx: _Context) -> tuple[dict[str, Any], dict[str, Any]]:
    """model_config -> (dynarec model block, eval settings from its metrics)."""
    models = ("multi_tower_din", "multi_tower", "deepfm", "wide_and_deep", "dlrm")
    others = [n for n in r.msg.names() if n not in models and n not in _MODEL_FIELDS]
    model_names = [n for n in models if r.has(n)]
    if len(model_names) != 1:
        for n in others:
            r.taken.add(n)
            ctx.refuse(
                r.at(n), "this model is not supported (multi_tower_din, multi_tower, deepfm, wide_and_deep, dlrm are)"
            )
        if not others:
            ctx.refuse(r.path, f"give one of {list(models)}")
        return {"feature_groups": [], "dlrm": {}}, {}
    name = model_names[0]
    m = r.message(name)
    assert m is not None
    # WIDE groups: each id feature gets a table of wide_embedding_dim of its own (TorchEasyRec).
    wide_dim = m.integer("wide_embedding_dim", 4) if name in ("deepfm", "wide_and_deep") else 4
    wide_init = m.scalar("wide_init_fn") if name in ("deepfm", "wide_and_deep") else None
    wide_rename = _add_wide_features(r, features, wide_dim, wide_init, ctx)
    out: dict[str, Any] = {"feature_groups": _groups(r, wide_rename)}
    groups = {g["group_name"]: g for g in out["feature_groups"]}
    if name in ("multi_tower_din", "multi_tower"):
        towers = []
        for t in m.messages("towers"):
            towers.append(
                {"input": str(t.scalar("input", "")), "hidden_units": _mlp(t.message("mlp"), t.at("mlp"), ctx)}
            )
            t.done()
        din = []
        for t in m.messages("din_towers") if name == "multi_tower_din" else []:
            din.append(
                {
                    "input": str(t.scalar("input", "")),
                    "attn_hidden_units": _mlp(t.message("attn_mlp"), t.at("attn_mlp"), ctx),
                }
            )
            t.done()
        final = m.message("final")
        out["multi_tower_din"] = {
            "towers": towers,
            "din_towers": din,
            "final_hidden_units": _mlp(final, m.at("final"), ctx) if final else [],
        }
        if name == "multi_tower":
            ctx.note(r.at("multi_tower"), "mapped to multi_tower_din without DIN towers")
    elif name in ("deepfm", "wide_and_deep"):
        allowed = {"wide", "deep"} | ({"fm"} if name == "deepfm" else set())
        for g in groups:
            if g not in allowed:
                ctx.refuse(
                    f"{r.at('feature_groups')}",
                    f"{name} reads the groups {sorted(allowed)}; group {g!r} would be ignored by TorchEasyRec",
                )
        for g in ("wide", "deep"):
            if g not in groups:
                ctx.refuse(r.at("feature_groups"), f"{name} needs a group named {g!r}")
        block: dict[str, Any] = {"deep_hidden_units": _mlp(m.message("deep"), m.at("deep"), ctx)}
        final = m.message("final")
        block["final_hidden_units"] = _mlp(final, m.at("final"), ctx) if final else []
        if name == "deepfm" and "fm" in groups:
            block["fm_group"] = "fm"
        out[name] = block
    else:  # dlrm
        dense_mlp = m.message("dense_mlp")
        final = m.message("final")
        sparse = groups.get("sparse") or (next(iter(groups.values())) if len(groups) == 1 else None)
        if sparse is None or "dense" not in groups:
            ctx.refuse(
                r.at("feature_groups"),
                "dlrm needs the groups 'dense' and 'sparse' (dynarec's DLRM needs dense features)",
            )
        units = _mlp(dense_mlp, m.at("dense_mlp"), ctx)
        dims = {_feature(features, n).get("embedding_dim") for n in (sparse or {}).get("feature_names", [])}
        if len(dims) == 1 and units[-1] != next(iter(dims)):
            ctx.refuse(
                m.at("dense_mlp.hidden_units"), f"the last layer must equal the embedding dim {next(iter(dims))}"
            )
        out["dlrm"] = {
            "bottom_hidden_units": units[:-1],
            "top_hidden_units": _mlp(final, m.at("final"), ctx),
            "arch_with_sparse": bool(m.scalar("arch_with_sparse", True)),
        }
    m.done()
    if (n := r.scalar("num_class", 1)) != 1:
        ctx.refuse(r.at("num_class"), "only binary classification (num_class 1) is supported")
    losses = r.messages("losses")
    for loss in losses:
        kinds = loss.msg.names()
        if kinds != ["binary_cross_entropy"]:
            ctx.refuse(loss.path, f"{kinds} is not supported (binary_cross_entropy is)")
            loss.taken.update(kinds)
        else:
            bce = loss.message("binary_cross_entropy")
            assert bce is not None
            bce.default_only("label_smoothing", 0.0)
            bce.done()
        loss.done()
    eval_cfg: dict[str, Any] = {}
    metrics = []
    for metric in r.messages("metrics"):
        kinds = metric.msg.names()
        if kinds == ["auc"]:
            a = metric.message("auc")
            assert a is not None
            if a.has("thresholds"):
                ctx.note(a.at("thresholds"), "dynarec computes the exact AUC (TorchEasyRec bins scores)")
            a.scalar("thresholds")
            a.done()
            metrics.append("auc")
        elif kinds == ["grouped_auc"]:
            g = metric.message("grouped_auc")
            assert g is not None
            key = str(g.scalar("grouping_key", ""))
            eval_cfg["grouped_auc_field"] = _column_of(features, key)
            g.done()
            metrics.append("grouped_auc")
        else:
            ctx.refuse(metric.path, f"{kinds} is not supported (auc, grouped_auc are)")
            metric.taken.update(kinds)
        metric.done()
    if metrics:
        eval_cfg["metrics"] = list(dict.fromkeys(metrics))
    for key, default in (("kernel", "PYTORCH"), ("use_pareto_loss_weight", False)):
        r.default_only(key, default)
    r.refuse("variational_dropout", "train_metrics")
    r.done()
    return out, eval_cfg


_MODEL_FIELDS = (
    "feature_groups",
    "num_class",
    "losses",
    "metrics",
    "train_metrics",
    "variational_dropout",
    "kernel",
    "use_pareto_loss_weight",
)


def _feature(features: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for f in features:
        body = next(iter(f.values()))
        if body["feature_name"] == name:
            return body
    return {}


def _column_of(features: list[dict[str, Any]], name: str) -> str:
    body = _feature(features, name)
    if "expression" in body:
        return str(body["expression"]).partition(":")[2]
    return str(body.get("input_name", name))


def _add_wide_features(
    r: _Reader, features: list[dict[str, Any]], dim: int, init_fn: Optional[str], ctx: _Context
) -> dict[str, str]:
    """For every id feature of a WIDE group, a twin ``<name>_wide`` with its own table
    ``<table>_wide`` of ``dim``; returns ``{name: twin name}``."""
    rename: dict[str, str] = {}
    for g in r.msg.values("feature_groups"):
        if not isinstance(g, Message) or "WIDE" not in [str(v) for v in g.values("group_type")]:
            continue
        for n in g.values("feature_names"):
            n = str(n)
            kind = next((k for f in features for k, v in f.items() if v.get("feature_name") == n), None)
            body = _feature(features, n)
            if kind != "id_feature":
                ctx.refuse(f"{r.at('feature_groups')}", f"a WIDE group takes id features; {n!r} is not one")
                continue
            twin = dict(body, feature_name=f"{n}_wide", embedding_dim=dim)
            if "expression" not in body and "input_name" not in body:
                twin["input_name"] = n  # the column the feature itself reads
            twin["embedding_name"] = f"{body.get('embedding_name', n)}_wide"
            twin.pop("initializer", None)
            if init_fn is not None:
                init = _initializer(str(init_fn), f"{r.at('wide_init_fn')}", ctx)
                if init is not None:
                    twin["initializer"] = init
            if n not in rename:
                features.append({"id_feature": twin})
                rename[n] = twin["feature_name"]
    return rename


# -- the whole config ------------------------------------------------------------------------------

_FG_MODES = {"FG_NONE": True, "FG_NORMAL": False, "FG_DAG": False}


def _data_source(path: Any, override: Optional[str], field_name: str, ctx: _Context) -> Optional[str]:
    if override is not None:
        if path:
            ctx.note(field_name, f"{path!r} replaced by {override!r}")
        return override
    if not path:
        return None
    if str(path).startswith(("odps://", "kafka://")):
        ctx.refuse(
            field_name,
            f"{path!r} is a table service; dynarec reads Parquet/CSV files: give --{field_name.replace('_', '-')}",
        )
        return None
    return str(path)


def convert_pipeline_config(
    text: str,
    *,
    train_input_path: Optional[str] = None,
    eval_input_path: Optional[str] = None,
    lenient: bool = False,
) -> ConversionResult:
    """A ``pipeline.config``'s text -> a dynarec config (a dict ready for YAML and
    ``config_from_dict``). ``train_input_path`` / ``eval_input_path`` replace the data source
    (required for ``odps://`` tables). ConversionError lists every refused field unless
    ``lenient``."""
    ctx = _Context(lenient)
    top = _Reader(parse(text), "", ctx)
    replaced = train_input_path is not None
    train_path = _data_source(top.scalar("train_input_path"), train_input_path, "train_input_path", ctx)
    eval_path = _data_source(top.scalar("eval_input_path"), eval_input_path, "eval_input_path", ctx)
    if top.has("model_dir"):
        ctx.note("model_dir", f"pass it to dynarec as --model-dir {top.scalar('model_dir')}")
    top.scalar("model_dir")

    data: dict[str, Any] = {"train_input_path": train_path}
    if eval_path:
        data["eval_input_path"] = eval_path
    mode = _Mode(encoded=False)
    if (d := top.message("data_config")) is not None:
        mode = _data_config(d, data, replaced)
    features = _features(top.messages("feature_configs"), mode)

    train: dict[str, Any] = {}
    if (t := top.message("train_config")) is not None:
        _train_config(t, train)
    else:
        ctx.refuse("train_config", "a train_config with a sparse_optimizer is needed")
    eval_cfg: dict[str, Any] = {}
    if (e := top.message("eval_config")) is not None:
        if e.scalar("num_steps"):
            eval_cfg["max_steps"] = e.integer("num_steps")
        e.ignore("log_step_count_steps", "eval progress logging")
        e.default_only("use_dense_ema", False)
        e.done()
    model: dict[str, Any] = {}
    if (m := top.message("model_config")) is not None:
        model, model_eval = _model(m, features, ctx)
        eval_cfg.update(model_eval)
    else:
        ctx.refuse("model_config", "a model_config is needed")
    if (x := top.message("export_config")) is not None:
        x.default_only("exporter_type", "latest")
        for key in ("best_exporter_metric", "metric_larger_is_better", "cudnn_allow_tf32", "cuda_matmul_allow_tf32"):
            x.ignore(key, "export settings of TorchEasyRec's exporter")
        x.default_only("mixed_precision", "")
        x.default_only("use_dense_ema", False)
        x.done()
    top.done()
    config = {"feature_configs": features, "model": model, "data": data, "train": train}
    if eval_cfg:
        config["eval"] = eval_cfg
    if ctx.refused and not lenient:
        raise ConversionError(
            f"{len(ctx.refused)} field(s) of the pipeline.config cannot be carried (--lenient drops them):\n  "
            + "\n  ".join(ctx.refused)
        )
    return ConversionResult(config, ctx.notes, ctx.refused)


def _data_config(d: _Reader, data: dict[str, Any], replaced: bool) -> _Mode:
    ctx = d.ctx
    data["batch_size"] = d.integer("batch_size", 1024)
    if d.has("eval_batch_size"):
        data["eval_batch_size"] = d.integer("eval_batch_size")
    if d.has("num_workers"):  # else dynarec's automatic count (TorchEasyRec's default, 8, suits few machines)
        data["num_workers"] = d.integer("num_workers")
    labels = [str(x) for x in d.repeated("label_fields")]
    if len(labels) != 1:
        ctx.refuse(d.at("label_fields"), f"one label field is supported, got {labels}")
    if labels:
        data["label_field"] = labels[0]
    dataset = str(d.scalar("dataset_type", "OdpsDataset"))
    if dataset == "ParquetDataset":
        data["input_type"] = "parquet"
    elif dataset == "CsvDataset":
        data["input_type"] = "csv"
        d.default_only("delimiter", ",")
        if not d.scalar("with_header", False):
            ctx.refuse(d.at("with_header"), "CSV input needs a header row naming the columns")
    elif dataset in ("OdpsDataset", "OdpsDatasetV1") and replaced:
        ctx.note(d.at("dataset_type"), f"{dataset}: the replaced data source's file type is used")
    elif dataset not in ("OdpsDataset", "OdpsDatasetV1"):
        ctx.refuse(d.at("dataset_type"), f"{dataset} is not supported")
    for key in ("is_orderby_partition", "odps_data_quota_name", "odps_data_compression"):
        d.ignore(key, "a MaxCompute reading setting")
    d.refuse("input_fields", why="column types come from the files (Parquet schema, CSV header)")
    mode_name = str(d.scalar("fg_mode", "")) or None
    if mode_name is None and d.has("fg_encoded"):
        mode_name = "FG_NONE" if d.scalar("fg_encoded") else "FG_NORMAL"
    d.taken.add("fg_encoded")
    mode_name = mode_name or "FG_NONE"
    if mode_name not in _FG_MODES:
        ctx.refuse(d.at("fg_mode"), f"{mode_name} is not supported (FG_NONE, FG_NORMAL, FG_DAG are)")
    encoded = _FG_MODES.get(mode_name, True)
    d.ignore("fg_threads", "feature generation threads")
    d.ignore("pin_memory", "dynarec pins batches for the device on its own")
    multival_sep = str(d.scalar("fg_encoded_multival_sep", "\x03"))
    d.default_only("drop_remainder", False, "dynarec trains the last partial batch")
    d.default_only("shuffle", False, "dynarec reads files in a fixed order")
    d.ignore("shuffle_buffer_size", "used only with shuffle")
    d.default_only("in_order", True)
    for key in ("sample_mask_prob", "negative_sample_mask_prob"):
        d.default_only(key, 0.0)
    d.default_only("force_base_data_group", False)
    d.refuse(
        "sample_weight_fields",
        "sample_cost_field",
        "batch_cost_size",
        "input_fields_str",
        "negative_sampler",
        "negative_sampler_v2",
        "hard_negative_sampler",
        "hard_negative_sampler_v2",
        "tdm_sampler",
    )
    d.done()
    return _Mode(encoded=encoded, multival_sep=multival_sep)


def _train_config(t: _Reader, train: dict[str, Any]) -> None:
    ctx = t.ctx
    if (s := t.message("sparse_optimizer")) is not None:
        train["sparse_optimizer"], train["sparse_lr_schedule"] = _sparse_optimizer(s)
    else:
        ctx.refuse(t.at("sparse_optimizer"), "a sparse optimizer is needed")
    if (dn := t.message("dense_optimizer")) is not None:
        train["dense_optimizer"], train["dense_lr_schedule"] = _dense_optimizer(dn)
    steps, epochs = t.integer("num_steps"), t.integer("num_epochs")
    if steps:
        train["num_steps"] = steps
    if epochs:
        train["num_epochs"] = epochs
    save = t.integer("save_checkpoints_steps", 1000)
    train["save_checkpoints_steps"] = save
    train["eval_every_steps"] = save  # TorchEasyRec evaluates after every checkpoint
    ctx.note(t.at("save_checkpoints_steps"), f"every {save} steps, with an evaluation after each (TorchEasyRec's rule)")
    train["log_step_count_steps"] = t.integer("log_step_count_steps", 100)
    keep = t.integer("keep_checkpoint_max", 0)
    train["keep_checkpoints"] = keep if keep > 0 else 1_000_000
    t.ignore("use_tensorboard", "dynarec always writes TensorBoard logs")
    t.ignore("tensorboard_summaries", "dynarec logs loss, learning rates and metrics")
    t.default_only("is_profiling", False)
    t.default_only("cudnn_allow_tf32", True)
    t.default_only("cuda_matmul_allow_tf32", False)
    t.default_only("save_checkpoints_epochs", 0)
    t.default_only("mixed_precision", "")
    gas = t.integer("gradient_accumulation_steps", 0)
    if gas > 1:
        ctx.refuse(t.at("gradient_accumulation_steps"), "gradient accumulation is not supported")
    if (g := t.message("grad_clipping")) is not None:
        g.default_only("clipping_type", "none", "gradient clipping is not supported")
        for key in ("max_gradient", "norm_type", "enable_global_grad_clip"):
            g.scalar(key)
        g.done()
    t.ignore("global_embedding_constraints", "sharding constraints; dynarec's planner shards tables")
    t.refuse(
        "fine_tune_checkpoint",
        "fine_tune_ckpt_param_map",
        "grad_scaler",
        "save_checkpoints_timestamp_interval",
        "save_checkpoints_timestamps",
        "save_checkpoints_timestamp_quorum",
        "delta_embedding_dump_config",
    )
    t.done()
