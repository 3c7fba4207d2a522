"""``feature_configs``: TorchEasyRec's feature kinds as dynarec feature blocks."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional

from dynarec.config.tzrec.reader import Context, Reader, one_of

__all__ = ["Mode", "convert_features", "initializer"]


@dataclass
class Mode:
    encoded: bool  # FG_NONE: columns hold ids, named after the features
    multival_sep: str = "\x03"  # FG_NONE: the separator of several ids in a string column


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


def _dynamic_initializer(r: Reader) -> dict[str, Any]:
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


def _dynamicemb(r: Reader, init: Optional[dict[str, Any]]) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
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


def _split_expression(expression: str, path: str, ctx: Context) -> str:
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
    r: Reader, mode: Mode, *, name_prefix: str = "", sequence: Optional[dict[str, Any]] = None
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
    init = initializer(str(r.scalar("init_fn")), r.at("init_fn"), r.ctx) if r.has("init_fn") else None
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


def _normalizer(text: str, path: str, ctx: Context) -> Optional[dict[str, Any]]:
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


def _raw_feature(r: Reader, mode: Mode) -> dict[str, Any]:
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
            init = initializer(str(r.scalar("init_fn")), r.at("init_fn"), r.ctx)
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


def convert_features(readers: list[Reader], mode: Mode) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in readers:
        found = one_of(r, _FEATURE_KINDS)
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
                found_sub = one_of(sub, _FEATURE_KINDS)
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
