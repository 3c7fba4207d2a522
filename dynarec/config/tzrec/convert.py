"""``dynarec import-config``: a TorchEasyRec ``pipeline.config`` as a dynarec YAML config.

The message families are converted by their modules (:mod:`.features`, :mod:`.model`,
:mod:`.train`); this one puts them together, checks every feature against dynarec's schema
(a feature dynarec cannot load is refused by its path, not left to a schema error), and, with
``lenient``, drops refused features consistently: a dropped feature takes its group entries,
the features that read it, and groups left empty with their towers where the model allows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from pydantic import ValidationError

from dynarec.config.textproto import Message, parse
from dynarec.config.tzrec.features import Converted, Mode, convert_features, default_sequence_lengths
from dynarec.config.tzrec.model import GENERATIVE, ModelResult, convert_model, model_name, prune_model
from dynarec.config.tzrec.reader import Context, Reader
from dynarec.config.tzrec.tasks import MULTI_TASK
from dynarec.config.tzrec.train import convert_data_config, convert_train_config, data_source

__all__ = ["ConversionError", "ConversionResult", "convert_pipeline_config"]


class ConversionError(ValueError):
    """Fields the conversion cannot carry; the message lists each one's path."""


@dataclass
class ConversionResult:
    config: dict[str, Any]  # dynarec YAML, as a dict
    notes: list[str] = field(default_factory=list)  # mapped / ignored fields, for the user to read
    dropped: list[str] = field(default_factory=list)  # refused fields dropped under lenient, and what went with them


def convert_pipeline_config(
    text: str,
    *,
    train_input_path: Optional[str] = None,
    eval_input_path: Optional[str] = None,
    sampler_input_path: Optional[str] = None,
    hard_negative_edge_path: Optional[str] = None,
    tree_dir: Optional[str] = None,
    lenient: bool = False,
    config_dir: Union[str, Path, None] = None,
    output_dir: Union[str, Path, None] = None,
) -> ConversionResult:
    """A ``pipeline.config``'s text -> a dynarec config (a dict ready for YAML and
    ``config_from_dict``). ``train_input_path`` / ``eval_input_path`` replace the data source
    (required for ``odps://`` tables), ``sampler_input_path`` the negative sampler's item table,
    ``hard_negative_edge_path`` a hard_negative_sampler's edge table, ``tree_dir`` a TDM
    sampler's tree (its node_table.txt and edge_table.txt).
    ``config_dir``: the pipeline config's directory (relative ``vocab_file`` paths are relative
    to it; default the current directory); ``output_dir``: the YAML's directory (paths are
    written relative to it; default absolute). ConversionError lists every refused field unless
    ``lenient``; with ``lenient`` it lists what cannot be dropped consistently."""
    ctx = Context(lenient, Path(output_dir) if output_dir is not None else None)
    message = parse(text)
    top = Reader(message, "", ctx)
    replaced = train_input_path is not None
    data: dict[str, Any] = {}
    train_path = data_source(top.scalar("train_input_path"), train_input_path, "train_input_path", ctx)
    eval_path = data_source(top.scalar("eval_input_path"), eval_input_path, "eval_input_path", ctx)
    # A path left empty: TorchEasyRec takes it on its command line. [] reads nothing, so
    # training stops naming it until it is set.
    data["train_input_path"] = train_path if train_path is not None else []
    if train_path is None and not top.scalar("train_input_path"):
        ctx.note(
            "train_input_path",
            "empty (TorchEasyRec takes it on its command line): written as []; pass --train-input-path to "
            "import-config, or set data.train_input_path",
        )
    if eval_path:
        data["eval_input_path"] = eval_path
    elif not top.scalar("eval_input_path") and eval_input_path is None:
        ctx.note("eval_input_path", "empty: no evaluation data; pass --eval-input-path, or set data.eval_input_path")
    if top.has("model_dir"):
        ctx.note("model_dir", f"pass it to dynarec as --model-dir {top.scalar('model_dir')}")
    top.scalar("model_dir")

    d = top.message("data_config")
    labels = [str(x) for x in d.msg.values("label_fields")] if d is not None else []
    mode = (
        convert_data_config(d, data, replaced, sampler_input_path, hard_negative_edge_path, tree_dir)
        if d is not None
        else None
    )
    if mode is None:
        mode = Mode(encoded=True)  # TorchEasyRec's default fg_mode, FG_NONE
    mode.config_dir = Path(config_dir) if config_dir is not None else None
    mode.output_dir = Path(output_dir) if output_dir is not None else None
    mode.sub_separator = _sub_separator(message, ctx)
    features = convert_features(top.messages("feature_configs"), mode)

    train: dict[str, Any] = {}
    if (t := top.message("train_config")) is not None:
        convert_train_config(t, train)
    else:
        ctx.refuse("train_config", "a train_config with a sparse_optimizer is needed", fatal=True)
    eval_cfg: dict[str, Any] = {}
    if (e := top.message("eval_config")) is not None:
        if e.scalar("num_steps"):
            eval_cfg["max_steps"] = e.integer("num_steps")
        e.ignore("log_step_count_steps", "eval progress logging")
        e.default_only("use_dense_ema", False)
        e.done()
    if (m := top.message("model_config")) is not None:
        model = convert_model(m, features, ctx, labels)
    else:
        ctx.refuse("model_config", "a model_config is needed", fatal=True)
        model = ModelResult({"feature_groups": [], "dlrm": {}}, {})
    eval_cfg.update(model.eval)
    name = model_name(model.model)
    if name in GENERATIVE and mode.encoded:
        read = {n for g in model.model["feature_groups"] for n in g["feature_names"]}
        default_sequence_lengths(features, read, int(model.model[name].get("max_seq_len", 1)), ctx)
    if name in (*MULTI_TASK, *GENERATIVE):  # the labels its task towers name
        data.pop("label_field", None)
        _note_unread_labels(labels, model.model, d.at("label_fields") if d is not None else "", ctx)
    elif name == "hstu_match":  # TorchEasyRec's match models read their first label (whose values no loss reads)
        _hstu_match_data(data, labels, d.at("label_fields") if d is not None else "data_config.label_fields", ctx)
    elif name in ("sid_rqvae", "sid_rqkmeans"):  # reads no label
        data.pop("label_field", None)
        if labels:
            ctx.note(d.at("label_fields") if d is not None else "", f"{labels}: a semantic-ID model reads no label")
    elif len(labels) != 1:
        where = d.at("label_fields") if d is not None else "data_config.label_fields"
        ctx.refuse(where, f"a single-task model reads one label field, got {labels}", fatal=True)
    if (x := top.message("export_config")) is not None:
        x.default_only("exporter_type", "latest")
        for key in ("best_exporter_metric", "metric_larger_is_better", "cudnn_allow_tf32", "cuda_matmul_allow_tf32"):
            x.ignore(key, "export settings of TorchEasyRec's exporter")
        if x.has("mixed_precision"):
            x.ignore("mixed_precision", "the exporter's precision; dynarec exports FP32 weights")
        x.default_only("use_dense_ema", False)
        x.done()
    top.done()

    features = _leave_out_unused(features, model, ctx)
    _check_features(features, ctx)
    if ctx.refused and not lenient:
        raise ConversionError(_refusal(ctx.refused, ctx.fatal))
    dropped: list[str] = []
    if lenient and ctx.refused:
        features, dropped = _drop(features, model, ctx)
        if ctx.fatal:
            raise ConversionError(
                f"{len(ctx.fatal)} field(s) of the pipeline.config cannot be carried, and --lenient cannot drop "
                "them (the model would not be the same model):\n  " + "\n  ".join(ctx.fatal)
            )
    config = {
        "feature_configs": [f.block for f in features],
        "model": model.model,
        "data": data,
        "train": train,
    }
    if eval_cfg:
        config["eval"] = eval_cfg
    _check_config(config, output_dir)
    return ConversionResult(config, ctx.notes, dropped)


def _hstu_match_data(data: dict[str, Any], labels: list[str], where: str, ctx: Context) -> None:
    """hstu_match's data: its label (the first, a list a row: one value a positive, read for its
    count); the sampler's attr_fields named as the candidates' sub-features are (TorchEasyRec
    writes them without the sequence's prefix)."""
    if not labels:
        ctx.refuse(where, "hstu_match reads a label (a list a row, one value a candidate)", fatal=True)
        return
    data["label_field"] = labels[0]
    if len(labels) > 1:
        ctx.note(where, f"{labels[1:]}: not read (a match model reads its first label, and not its values)")
    sampler = data.get("negative_sampler")
    if sampler is None:
        return
    prefix, sep, _ = sampler["item_id_field"].partition("__")
    if sep:
        renamed = [a if a.startswith(prefix + "__") else f"{prefix}__{a}" for a in sampler["attr_fields"]]
        if renamed != sampler["attr_fields"]:
            ctx.note(
                "data_config.negative_sampler.attr_fields",
                f"{sampler['attr_fields']} -> {renamed}: the candidates' sub-features ({prefix}'s), which the sampled "
                "items' attributes become, in order",
            )
            sampler["attr_fields"] = renamed


def _note_unread_labels(labels: list[str], model: dict[str, Any], where: str, ctx: Context) -> None:
    """A label field no task tower reads (nor a task space indicator, nor PEPNet's domain label)
    trains nothing: noted, and not read."""
    block = model.get(model_name(model), {})
    read = {t.get(k) for t in block.get("task_towers", []) for k in ("label_name", "task_space_indicator_label")}
    read.add(block.get("domain_label"))
    unread = [n for n in labels if n not in read]
    if unread:
        ctx.note(where, f"{unread}: read by no task tower, so not read (a task tower's label_name is what it reads)")


def _sub_separator(message: Message, ctx: Context) -> str:
    """``"__"`` between a sequence's name and its sub-features' (TorchEasyRec's), or ``"_"``
    when the feature groups name them so (a config written for TorchEasyRec's ``USE_RTP=1``)."""
    subs: list[tuple[str, str]] = []
    for fc in message.values("feature_configs"):
        for seq in fc.values("sequence_feature") if isinstance(fc, Message) else []:
            if not isinstance(seq, Message):
                continue
            name = str((seq.values("sequence_name") or [""])[0])
            for sub in seq.values("features"):
                for body in sub.fields if isinstance(sub, Message) else []:
                    if isinstance(body[1], Message):
                        subs.append((name, str((body[1].values("feature_name") or [""])[0])))
    grouped: set[str] = set()
    for mc in message.values("model_config"):
        for g in mc.values("feature_groups") if isinstance(mc, Message) else []:
            if isinstance(g, Message):
                grouped.update(str(n) for n in g.values("feature_names"))
                for sg in g.values("sequence_groups"):
                    if isinstance(sg, Message):
                        grouped.update(str(n) for n in sg.values("feature_names"))
    plain = [f"{s}__{n}" for s, n in subs if f"{s}__{n}" in grouped]
    rtp = [f"{s}_{n}" for s, n in subs if f"{s}_{n}" in grouped]
    if rtp and not plain:
        ctx.note(
            "feature_configs",
            "sequence sub-features named <sequence_name>_<feature_name>, as this config's feature groups name "
            "them (TorchEasyRec with USE_RTP=1)",
        )
        return "_"
    return "__"


def _refusal(refused: list[str], fatal: list[str]) -> str:
    """The error of fields that cannot be carried, saying which of them ``--lenient`` would drop
    (not those whose loss would change the model: ``fatal``)."""
    if not fatal:
        how, lines = "--lenient drops them", refused
    elif len(fatal) == len(refused):
        how, lines = "--lenient cannot drop them: the model would not be the same model", refused
    else:
        how = "--lenient drops all but those the model needs"
        lines = [f"{r} (the model needs it: --lenient cannot drop it)" if r in fatal else r for r in refused]
    return f"{len(refused)} field(s) of the pipeline.config cannot be carried ({how}):\n  " + "\n  ".join(lines)


def _leave_out_unused(features: list[Converted], model: ModelResult, ctx: Context) -> list[Converted]:
    """A feature in no group that no feature reads trains nothing in TorchEasyRec: it is left
    out, with a note (its refusals, if any, go with it)."""
    by_name = {f.name: f for f in features}
    used: set[str] = set()
    groups = model.model.get("feature_groups", [])
    todo = [n for g in groups for n in g["feature_names"]]
    todo += [n for g in groups for sg in g.get("sequence_groups", []) for n in sg["feature_names"]]
    while todo:
        n = todo.pop()
        if n in used:
            continue
        used.add(n)
        if n in by_name:
            todo.extend(by_name[n].reads)
    if not model.model.get("feature_groups"):
        return features  # no model to tell: keep everything (the model is refused anyway)
    kept = []
    for f in features:
        if f.name in used:
            kept.append(f)
            continue
        ctx.refused = [r for r in ctx.refused if r not in f.refused]
        ctx.fatal = [r for r in ctx.fatal if r not in f.refused]
        ctx.note(f.path, f"{f.name!r} is in no feature group and read by no feature: it trains nothing; left out")
    return kept


def _schema_errors(kind: str, e: ValidationError) -> list[str]:
    """dynarec's schema errors of one feature block, as refusal reasons."""
    out = []
    for err in e.errors():
        loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-")))]
        inner = ".".join(loc[1:]) if loc and loc[0] == kind else ".".join(loc)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            out.append(
                f"dynarec's {kind} has no field {inner!r}" if inner else f"dynarec has no {kind} (docs/features.md)"
            )
        elif err["type"] == "missing":
            out.append(f"dynarec's {kind} needs {inner!r}")
        else:
            out.append(f"{inner}: {msg}" if inner else msg)
    return list(dict.fromkeys(out))


def _check_features(features: list[Converted], ctx: Context) -> None:
    """Every feature as dynarec's schema loads it, and the features sharing a table with the
    same table settings; a refusal names the feature's path (and ``--lenient`` drops it)."""
    from dynarec.config import schema

    settings = getattr(schema, "TABLE_SETTINGS", ())
    tables: dict[str, tuple[Converted, Any]] = {}
    for f in features:
        if f.refused:
            continue
        try:
            loaded = schema.FeatureCfg.model_validate(f.block).feature
        except ValidationError as e:
            for why in _schema_errors(f.kind, e):
                _refuse(f, ctx, why)
            continue
        if not getattr(loaded, "embedded", True) or not hasattr(loaded, "table_name"):
            continue
        other, other_loaded = tables.setdefault(loaded.table_name, (f, loaded))
        for key in settings:
            a, b = getattr(other_loaded, key, None), getattr(loaded, key, None)
            if other is not f and a != b:
                _refuse(
                    f,
                    ctx,
                    f"shares table {loaded.table_name!r} with {other.name!r} ({other.path}) but its {key} differs "
                    f"({a!r} there, {b!r} here)",
                )
                break


def _refuse(f: Converted, ctx: Context, why: str) -> None:
    line = f"{f.path}: {why}"
    ctx.refused.append(line)
    f.refused.append(line)


def _drop(features: list[Converted], model: ModelResult, ctx: Context) -> tuple[list[Converted], list[str]]:
    """``--lenient``: the refused features go, with the features that read them; their group
    entries, and groups left empty with their towers where the model allows."""
    in_features = {r for f in features for r in f.refused}
    dropped = [r for r in ctx.refused if r not in in_features]
    bad = {f.name: f"{'; '.join(f.refused)}" for f in features if f.refused}
    changed = True
    while changed:  # a feature reading a dropped one goes too
        changed = False
        for f in features:
            if f.name not in bad and any(r in bad for r in f.reads):
                bad[f.name] = f"reads the dropped feature {next(r for r in f.reads if r in bad)!r}"
                changed = True
    kept = []
    for f in features:
        if f.name in bad:
            dropped.append(f"{f.path}: feature {f.name!r} dropped ({bad[f.name]})")
        else:
            kept.append(f)
    dropped += prune_model(model, {f.name: f for f in kept}, ctx)
    return kept, dropped


def _check_config(config: dict[str, Any], output_dir: Union[str, Path, None]) -> None:
    """The converted config as dynarec loads it; what it refuses is a ConversionError naming
    dynarec's field paths."""
    from dynarec.config.load import ConfigError, config_from_dict

    try:
        config_from_dict(config, source="(the converted config)", base_dir=output_dir)
    except ConfigError as e:
        raise ConversionError(str(e)) from None
