"""``model_config``: feature groups, the model and its MLPs, losses and metrics; and, for
``--lenient``, the groups and towers a dropped feature takes with it (:func:`prune_model`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from dynarec.config.textproto import Message
from dynarec.config.tzrec.features import Converted, initializer
from dynarec.config.tzrec.reader import Context, Reader
from dynarec.config.tzrec.schema_fields import field_values
from dynarec.config.tzrec.tasks import (
    MULTI_TASK,
    convert_fusion_mtl_tower,
    convert_loss,
    convert_metric,
    convert_multi_task,
)

__all__ = ["GENERATIVE", "ModelResult", "column_of", "convert_model", "prune_model", "tzrec_models"]

_GROUP_TYPES = {"DEEP": "deep", "WIDE": "wide", "SEQUENCE": "sequence", "JAGGED_SEQUENCE": "sequence"}


def _activations(cls_name: str, name: str) -> set[str]:
    """The activations dynarec's ``cls_name.name`` takes (``relu``, ``dice``; none: the field
    does not exist, ReLU only)."""
    from dynarec.config import schema

    cls = getattr(schema, cls_name, None)
    return {str(v) for v in field_values(cls, name)} if cls is not None else set()


_TORCH_ACTIVATIONS = {"nn.ReLU": "relu", "Dice": "dice", "nn.PReLU": "prelu", "": "none"}


@dataclass
class _MLP:
    units: list[int]
    activation: str = "relu"
    dropout: list[float] = field(default_factory=list)
    bias: bool = True


def _mlp(
    r: Optional[Reader],
    path: str,
    ctx: Context,
    activations: frozenset[str] | set[str] = frozenset(),
    dropout: bool = False,
    batch_norm: bool = False,
    bias: bool = False,
) -> _MLP:
    """An MLP: hidden_units, and its activation where dynarec's block takes one
    (``activations``: the values it allows; empty: ReLU only), its dropout ratios where it
    takes them (``dropout``), its ``bias`` where it takes it (``bias``; else only true)."""
    if r is None:
        ctx.refuse(path, "an MLP with hidden_units is needed", fatal=True)
        return _MLP([1])
    units = r.integers("hidden_units")
    if not units:
        ctx.refuse(r.at("hidden_units"), "at least one layer is needed", fatal=True)
    ratios = [float(x) for x in r.numbers("dropout_ratio")]
    if any(ratios) and not dropout:
        ctx.refuse(r.at("dropout_ratio"), "dropout is not supported in this MLP")
    activation = str(r.scalar("activation", "nn.ReLU"))
    mapped = _TORCH_ACTIVATIONS.get(activation)
    allowed = activations or {"relu"}
    if mapped not in allowed:
        names = [k for k, v in _TORCH_ACTIVATIONS.items() if v in allowed]
        ctx.refuse(r.at("activation"), f"{activation!r} is not supported here ({', '.join(names)} on every layer are)")
    elif mapped != "relu":
        ctx.note(r.at("activation"), f"{activation or 'none (linear layers)'} on every layer, as TorchEasyRec's")
    if batch_norm:  # the caller reads use_bn
        r.scalar("use_bn")
    else:
        r.default_only("use_bn", False)
    r.default_only("use_ln", False)
    with_bias = True
    if bias:
        with_bias = bool(r.scalar("bias", True))
    else:
        r.default_only("bias", True)
    r.done()
    return _MLP(
        units or [1],
        mapped if mapped is not None and mapped in allowed else "relu",
        ratios if any(ratios) else [],
        with_bias,
    )


def _units_and_dropout(mlp: _MLP) -> tuple[list[int], list[float]]:
    return mlp.units, mlp.dropout


def _groups(r: Reader, wide_rename: dict[str, str], known: set[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The feature groups, and their paths. A name that is no feature is refused by its path
    (``--lenient`` takes it out of the group)."""
    out, paths = [], []
    for g in r.messages("feature_groups"):
        kind = str(g.scalar("group_type", "DEEP"))
        if kind not in _GROUP_TYPES:
            g.ctx.refuse(g.at("group_type"), f"{kind!r} is not supported", fatal=True)
        if kind == "JAGGED_SEQUENCE":
            g.ctx.note(g.at("group_type"), "JAGGED_SEQUENCE mapped to sequence (padded; the same results)")
        names = [str(n) for n in g.repeated("feature_names")]
        if kind == "WIDE":
            names = [wide_rename.get(n, n) for n in names]
        for i, n in enumerate(names):
            if n not in known:
                g.ctx.refuse(f"{g.at('feature_names')}[{i}]", f"unknown feature {n!r}")
        g.refuse("embedding_name_suffix", why="not supported", fatal=True)
        group: dict[str, Any] = {
            "group_name": str(g.scalar("group_name", "")),
            "feature_names": names,
            "group_type": _GROUP_TYPES.get(kind, "deep"),
        }
        nested = [_sequence_group(s, known) for s in g.messages("sequence_groups")]
        encoders = [e for e in (_sequence_encoder(e, nested) for e in g.messages("sequence_encoders")) if e]
        if nested or encoders:
            group["sequence_groups"], group["sequence_encoders"] = nested, encoders
        out.append(group)
        paths.append(g.path)
        g.done()
    return out, paths


def _sequence_group(s: Reader, known: set[str]) -> dict[str, Any]:
    """A deep group's ``sequence_groups`` entry (unknown names refused by path, as in a group)."""
    names = [str(n) for n in s.repeated("feature_names")]
    for i, n in enumerate(names):
        if n not in known:
            s.ctx.refuse(f"{s.at('feature_names')}[{i}]", f"unknown feature {n!r}")
    out = {"group_name": str(s.scalar("group_name", "")), "feature_names": names}
    s.done()
    return out


_ENCODERS = ("din_encoder", "simple_attention", "pooling_encoder")


def _sequence_encoder(e: Reader, groups: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """A ``sequence_encoders`` entry: DIN, simple attention or pooling (others refused)."""
    ctx = e.ctx
    kinds = e.msg.names()
    kind = next((k for k in kinds if k in _ENCODERS), None)
    if kind is None:
        e.refuse(*kinds, why=f"not supported (dynarec's encoders: {list(_ENCODERS)})", fatal=True)
        return None
    body = e.message(kind)
    assert body is not None
    out: dict[str, Any] = {}
    if body.has("input"):
        out["input"] = str(body.scalar("input"))
    elif len(groups) == 1:
        ctx.note(body.at("input"), f"not given: the group's only sequence group {groups[0]['group_name']!r}")
    body.ignore("name", "an encoder's name, used for nothing here")
    body.default_only("max_seq_length", 0, "cutting the sequence is not supported (sequence_length does)")
    if kind == "din_encoder":
        attn = _mlp(body.message("attn_mlp"), body.at("attn_mlp"), ctx, _activations("DINEncoderCfg", "activation"))
        out["attn_hidden_units"], out["activation"] = attn.units, attn.activation
    elif kind == "pooling_encoder":
        out["pooling_type"] = str(body.scalar("pooling_type", "mean"))
    body.done()
    e.done()
    return {kind: out}


@dataclass
class ModelResult:
    model: dict[str, Any]
    eval: dict[str, Any]
    group_paths: list[str] = field(default_factory=list)  # the pipeline.config path of each group
    tower_paths: dict[str, list[str]] = field(default_factory=dict)  # "towers" / "din_towers" -> paths


# TorchEasyRec's model -> dynarec's (model.proto's oneof names; dcn_v1 is dynarec's dcn).
_TARGETS = {
    "multi_tower_din": "multi_tower_din",
    "multi_tower": "multi_tower_din",
    "deepfm": "deepfm",
    "wide_and_deep": "wide_and_deep",
    "dlrm": "dlrm",
    "mask_net": "mask_net",
    "wukong": "wukong",
    "dcn_v1": "dcn",
    "dcn_v2": "dcn_v2",
    "xdeepfm": "xdeepfm",
    "rocket_launching": "rocket_launching",
    "dssm": "dssm",
    "dssm_v2": "dssm",
    "dat": "dat",
    "mind": "mind",
    **{name: name for name in MULTI_TASK},
    "dlrm_hstu": "dlrm_hstu",
    "ultra_hstu": "ultra_hstu",
    "sid_rqvae": "sid_rqvae",
    "sid_rqkmeans": "sid_rqkmeans",
    "hstu_match": "hstu_match",
    "tdm": "tdm",
}
# The generative rankers (dynarec/config/hstu.py): DlrmHSTU, and UltraHSTU (several channels).
GENERATIVE = ("dlrm_hstu", "ultra_hstu")
# TorchEasyRec's models dynarec does not have yet, with what they need.
_NOT_YET: dict[str, str] = {}
_RETRIEVAL = ("dssm", "dssm_v2", "dat", "mind")
_SID = ("sid_rqvae", "sid_rqkmeans")
_WIDE_DIM = {"deepfm": 4, "wide_and_deep": 4, "xdeepfm": 16}  # wide_embedding_dim's default


def tzrec_models() -> tuple[str, ...]:
    """TorchEasyRec's models dynarec has (its schema's model keys)."""
    from dynarec.config.schema import MODEL_KEYS

    return tuple(k for k, v in _TARGETS.items() if v in MODEL_KEYS)


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


def convert_model(r: Reader, features: list[Converted], ctx: Context, labels: list[str]) -> ModelResult:
    """model_config -> the dynarec model block and the eval settings its metrics give.
    ``features`` gains the twins a WIDE group needs; ``labels`` (data_config.label_fields) are
    the default labels of DBMTL's towers, in order."""
    models = tzrec_models()
    others = [n for n in r.msg.names() if n not in models and n not in _MODEL_FIELDS]
    model_names = [n for n in models if r.has(n)]
    if len(model_names) != 1:
        for n in others:
            r.taken.add(n)
            if n in _NOT_YET:
                why = f"this model is not supported yet: {_NOT_YET[n]} (issue 30)"
            else:
                why = f"this model is not supported ({', '.join(models)} are; issue 30: the model zoo)"
            ctx.refuse(r.at(n), why, fatal=True)
        if not others:
            ctx.refuse(r.path, f"give one of {list(models)}", fatal=True)
        r.taken.update(r.msg.names())
        return ModelResult({"feature_groups": [], "dlrm": {}}, {})
    name = model_names[0]
    m = r.message(name)
    assert m is not None
    # WIDE groups: each sparse feature gets a table of wide_embedding_dim of its own (TorchEasyRec).
    wide_dim = m.integer("wide_embedding_dim", _WIDE_DIM[name]) if name in _WIDE_DIM else 4
    wide_init = m.scalar("wide_init_fn") if name in _WIDE_DIM else None
    wide_rename = _add_wide_features(r, features, wide_dim, wide_init, ctx)
    groups_out, group_paths = _groups(r, wide_rename, {f.name for f in features})
    out: dict[str, Any] = {"feature_groups": groups_out}
    variational_dropout = None
    if (vd := r.message("variational_dropout")) is not None:
        variational_dropout = {"regularization_lambda": vd.number("regularization_lambda", 0.01)}
        vd.done()
    result = ModelResult(out, {}, group_paths)
    groups = {g["group_name"]: g for g in groups_out}
    block: dict[str, Any]
    if name in ("multi_tower_din", "multi_tower"):
        towers = []
        tower_act = _activations("TowerCfg", "activation")
        for t in m.messages("towers"):
            mlp = _mlp(t.message("mlp"), t.at("mlp"), ctx, tower_act)
            tower: dict[str, Any] = {"input": str(t.scalar("input", "")), "hidden_units": mlp.units}
            if mlp.activation != "relu":
                tower["activation"] = mlp.activation
            towers.append(tower)
            result.tower_paths.setdefault("towers", []).append(t.path)
            t.done()
        din = []
        din_act = _activations("DinTowerCfg", "activation")
        for t in m.messages("din_towers") if name == "multi_tower_din" else []:
            mlp = _mlp(t.message("attn_mlp"), t.at("attn_mlp"), ctx, din_act)
            tower = {"input": str(t.scalar("input", "")), "attn_hidden_units": mlp.units}
            if mlp.activation != "relu":
                tower["activation"] = mlp.activation
            din.append(tower)
            result.tower_paths.setdefault("din_towers", []).append(t.path)
            t.done()
        final = m.message("final")
        block = {"towers": towers, "din_towers": din, "final_hidden_units": []}
        if final is not None:
            mlp = _mlp(final, m.at("final"), ctx, _activations("MultiTowerDINCfg", "final_activation"))
            block["final_hidden_units"] = mlp.units
            if mlp.activation != "relu":
                block["final_activation"] = mlp.activation
        out["multi_tower_din"] = block
        if name == "multi_tower":
            ctx.note(r.at("multi_tower"), "mapped to multi_tower_din without DIN towers")
    elif name in ("deepfm", "wide_and_deep"):
        allowed = {"wide", "deep"} | ({"fm"} if name == "deepfm" else set())
        for g in groups:
            if g not in allowed:
                ctx.refuse(
                    f"{r.at('feature_groups')}",
                    f"{name} reads the groups {sorted(allowed)}; group {g!r} would be ignored by TorchEasyRec",
                    fatal=True,
                )
        for g in ("wide", "deep"):
            if g not in groups:
                ctx.refuse(r.at("feature_groups"), f"{name} needs a group named {g!r}", fatal=True)
        block = {"deep_hidden_units": _mlp(m.message("deep"), m.at("deep"), ctx).units}
        final = m.message("final")
        block["final_hidden_units"] = _mlp(final, m.at("final"), ctx).units if final else []
        if name == "deepfm" and "fm" in groups:
            block["fm_group"] = "fm"
        out[name] = block
    elif name in GENERATIVE:
        out[name] = _generative_ranker(name, m, ctx, groups_out, lambda key: column_of(features, key), result.eval)
        _check_hstu_groups(r, groups_out, name, out[name], ctx)
        for key in ("losses", "metrics"):
            if r.has(key):
                ctx.refuse(r.at(key), f"{name}'s {key} belong in its fusion_mtl_tower.task_configs", fatal=True)
    elif name in MULTI_TASK:
        out[name] = convert_multi_task(
            name,
            m,
            labels,
            lambda mlp, path, dropout: _units_and_dropout(_mlp(mlp, path, ctx, dropout=dropout)),
            lambda module: _mask_net_module(module, ctx),
            lambda key: column_of(features, key),
            result.eval,
        )
        for key in ("losses", "metrics"):
            if r.has(key):
                ctx.refuse(r.at(key), f"a multi-task model's {key} belong in its task_towers", fatal=True)
        if name == "pepnet":  # TorchEasyRec's PEPNet reads its groups by name
            if "all" not in groups:
                ctx.refuse(r.at("feature_groups"), "pepnet needs a group named 'all'", fatal=True)
            block = out[name]
            block["main_input"] = "all"
            for group, key in (("domain", "domain_input"), ("uia", "uia_input")):
                if group in groups:
                    block[key] = group
            if "uia_input" not in block and block.get("ppnet_hidden_units"):
                ctx.note(
                    r.at("pepnet"), "ppnet_hidden_units ignored without a 'uia' group, as TorchEasyRec ignores them"
                )
                del block["ppnet_hidden_units"]
            if not block.get("ppnet_hidden_units"):
                block.pop("ppnet_hidden_units", None)
    elif name in _RETRIEVAL:
        out[_TARGETS[name]] = _two_tower(r, m, ctx, name)
        if name == "dssm_v2":
            ctx.note(r.at(name), "dssm_v2's towers share the embedding lookups, as every dynarec model's do: dssm")
        m.done()
        if variational_dropout is not None:
            out["variational_dropout"] = variational_dropout
        r.done()
        return result
    elif name == "hstu_match":
        out[name] = _hstu_match(r, m, ctx, groups_out)
        m.done()
        r.done()
        return result
    elif name in _SID:
        out[name] = _sid(r, m, ctx, name, groups_out)
        m.done()
        r.done()
        return result
    elif name == "tdm":
        out[name] = _tdm(m, ctx)
    elif name in _ZOO:
        out[_TARGETS[name]] = _ZOO[name](m, ctx)
        if name == "wukong":
            _check_wukong_widths(m, out[_TARGETS[name]], groups, {f.name: f.body for f in features}, ctx)
        if name == "xdeepfm":
            for g in ("wide", "deep"):
                if g not in groups:
                    ctx.refuse(r.at("feature_groups"), f"xdeepfm needs a group named {g!r}", fatal=True)
    else:  # dlrm
        dense_mlp = m.message("dense_mlp")
        final = m.message("final")
        sparse = groups.get("sparse") or (next(iter(groups.values())) if len(groups) == 1 else None)
        if sparse is None or "dense" not in groups:
            ctx.refuse(
                r.at("feature_groups"),
                "dlrm needs the groups 'dense' and 'sparse' (dynarec's DLRM needs dense features)",
                fatal=True,
            )
        units = _mlp(dense_mlp, m.at("dense_mlp"), ctx).units
        by_name = {f.name: f for f in features}
        dims = {by_name[n].body.get("embedding_dim") for n in (sparse or {}).get("feature_names", []) if n in by_name}
        if len(dims) == 1 and units[-1] != next(iter(dims)):
            ctx.refuse(
                m.at("dense_mlp.hidden_units"),
                f"the last layer must equal the embedding dim {next(iter(dims))}",
                fatal=True,
            )
        out["dlrm"] = {
            "bottom_hidden_units": units[:-1],
            "top_hidden_units": _mlp(final, m.at("final"), ctx).units,
            "arch_with_sparse": bool(m.scalar("arch_with_sparse", True)),
        }
    m.done()
    num_class = r.scalar("num_class", 1)
    if num_class not in (1, 2):
        ctx.refuse(r.at("num_class"), "only binary classification (num_class 1, or 2) is supported", fatal=True)
    # Two classes under softmax cross-entropy are one logit under binary cross-entropy: the
    # softmax of two logits is the sigmoid of their difference, the same likelihood.
    two_classes: dict[str, Any] = {"softmax_cross_entropy": {}}
    for loss in r.messages("losses"):  # a single-task model: binary cross-entropy, as dynarec's
        converted = convert_loss(loss)
        if converted is not None and num_class == 2 and converted == two_classes:
            ctx.note(
                loss.path,
                "num_class 2 under softmax_cross_entropy: one logit under binary cross-entropy (the softmax of two "
                "logits is the sigmoid of their difference: the same model and likelihood, one output)",
            )
        elif converted is not None and converted != {"binary_cross_entropy": {}}:
            ctx.refuse(
                loss.path,
                f"{next(iter(converted))} is not supported for a single-task model (binary_cross_entropy without "
                "label smoothing is; a multi-task model's task towers take every loss)",
                fatal=True,
            )
    metrics = []
    for metric in r.messages("metrics"):
        kind = convert_metric(metric, lambda key: column_of(features, key), result.eval)
        if kind in ("auc", "grouped_auc", "accuracy"):
            metrics.append(kind)
        elif kind is not None:
            ctx.refuse(metric.path, f"{kind} is not supported for a single-task model (auc, grouped_auc, accuracy are)")
    if metrics:
        result.eval["metrics"] = list(dict.fromkeys(metrics))
    if name in GENERATIVE:
        _hstu_kernel(r, ctx, semi_local=any(_semi_local(c) for c in _channels(out)))
    else:
        r.default_only("kernel", "PYTORCH")
    r.default_only("use_pareto_loss_weight", False)
    r.ignore(
        "train_metrics",
        "metrics of the training batches, logged only; dynarec logs the training loss and computes its metrics on "
        "the eval data",
    )
    if variational_dropout is not None:  # after the model block: the block is the model's first key
        out["variational_dropout"] = variational_dropout
    r.done()
    return result


def _tdm(m: Reader, ctx: Context) -> dict[str, Any]:
    """tdm {multiwindow_din {windows_len, attn_mlp}, final} -> dynarec's tdm."""
    activations = _activations("TDMCfg", "final_activation")
    out: dict[str, Any] = {}
    if (w := m.message("multiwindow_din")) is not None:
        windows = w.integers("windows_len")
        if not windows:
            ctx.refuse(w.at("windows_len"), "at least one window is needed", fatal=True)
        attn = _mlp(w.message("attn_mlp"), w.at("attn_mlp"), ctx, activations)
        out["multiwindow_din"] = {
            "windows_len": windows or [1],
            "attn_hidden_units": attn.units,
            "attn_activation": attn.activation,
        }
        w.done()
    else:
        _required(m, "multiwindow_din", "a multiwindow_din block")
    final = m.message("final")
    use_bn = bool(final.scalar("use_bn", False)) if final is not None else False
    mlp = _mlp(final, m.at("final"), ctx, activations, batch_norm=True)
    out["final_hidden_units"] = mlp.units
    if mlp.activation != "relu":
        out["final_activation"] = mlp.activation
    if use_bn:
        out["final_batch_norm"] = True
    return out


def _hstu_match(r: Reader, m: Reader, ctx: Context, groups: list[dict[str, Any]]) -> dict[str, Any]:
    """hstu_match {user_tower {input, hstu, max_seq_len}, item_tower {input, mlp}, output_dim,
    similarity, temperature} -> dynarec's hstu_match: its user tower's hstu as dlrm_hstu's (its
    preprocessor the uih_preprocessor's fields); the match models' loss and metrics."""
    out: dict[str, Any] = {}
    contextual = next((len(g["feature_names"]) for g in groups if g["group_name"] == "contextual"), 0)
    if (ut := m.message("user_tower")) is not None:
        user: dict[str, Any] = {"input": str(ut.scalar("input", "uih"))}
        _required(ut, "max_seq_len")
        user["max_seq_len"] = ut.integer("max_seq_len", 1)
        if (h := ut.message("hstu")) is not None:
            user["hstu"] = _hstu(h, ctx, contextual, "hstu_match")
        else:
            _required(ut, "hstu", "an hstu block")
        ut.done()
        out["user_tower"] = user
    else:
        _required(m, "user_tower", "a user tower")
    if (it := m.message("item_tower")) is not None:
        if not it.has("mlp"):
            ctx.refuse(
                it.at("mlp"), "an item tower without an MLP is not supported (give mlp {hidden_units})", fatal=True
            )
        out["item_tower"] = {"input": str(it.scalar("input", "candidate")), **_match_mlp(it, "mlp", ctx)}
        it.done()
    else:
        _required(m, "item_tower", "an item tower")
    out["output_dim"] = m.integer("output_dim", 0)
    out["similarity"] = _similarity(m, ctx, "INNER_PRODUCT")
    out["temperature"] = m.number("temperature", 1.0)
    if m.has("sequence_timestamp_is_ascending"):
        out["sequence_timestamp_is_ascending"] = bool(m.scalar("sequence_timestamp_is_ascending"))
    m.default_only("in_batch_negative", False, "several positives a row: TorchEasyRec refuses it too")
    out["recall_at_k"] = _match_losses_and_metrics(r, ctx)
    _hstu_kernel(r, ctx, semi_local=False)
    for key, default in (("use_pareto_loss_weight", False), ("num_class", 1)):
        r.default_only(key, default)
    return out


def _similarity(m: Reader, ctx: Context, default: str) -> str:
    """A match model's ``similarity`` (INNER_PRODUCT, COSINE) as dynarec's; another is refused
    (``--lenient`` drops it: the model's default)."""
    similarity = str(m.scalar("similarity", default))
    if similarity not in ("INNER_PRODUCT", "COSINE"):
        ctx.refuse(m.at("similarity"), f"{similarity} is not supported (INNER_PRODUCT, COSINE are)")
        similarity = default
    return similarity.lower()


def _hstu_kernel(r: Reader, ctx: Context, semi_local: bool) -> None:
    """An HSTU model's ``kernel``: dynarec computes TorchEasyRec's PyTorch reference formulas
    whatever it says (noted); TRITON with semi-local attention refused, as TorchEasyRec refuses it."""
    kernel = str(r.scalar("kernel", "PYTORCH"))
    if kernel not in ("PYTORCH", "TRITON", "CUTLASS"):
        ctx.refuse(r.at("kernel"), f"{kernel!r} is not supported (PYTORCH, TRITON, CUTLASS are)")
    elif kernel == "TRITON" and semi_local:
        ctx.refuse(
            r.at("kernel"),
            "TRITON with semi-local attention (sla_k1 / sla_k2): TorchEasyRec refuses it (its Triton kernel has "
            "no semi-local mask; CUTLASS and PYTORCH have)",
            fatal=True,
        )
    elif kernel != "PYTORCH":
        ctx.note(
            r.at("kernel"),
            f"{kernel}: dynarec computes TorchEasyRec's PyTorch reference formulas (its own kernels) whatever the "
            "kernel; the same model, numbers equal up to rounding",
        )


def _match_losses_and_metrics(r: Reader, ctx: Context) -> list[int]:
    """A match model's ``losses`` (softmax_cross_entropy only) and ``metrics`` / ``train_metrics``
    (recall_at_k only): the recall@k's ``top_k``s (default [5])."""
    for loss in r.messages("losses"):
        kinds = loss.msg.names()
        if kinds != ["softmax_cross_entropy"]:
            ctx.refuse(loss.path, f"{kinds}: a match model trains by softmax_cross_entropy only", fatal=True)
            loss.taken.update(kinds)
            continue
        body = loss.message("softmax_cross_entropy")
        assert body is not None
        body.default_only("label_smoothing", 0.0)
        body.done()
        loss.done()
    top_k = []
    for key in ("metrics", "train_metrics"):
        for metric in r.messages(key):
            if key == "train_metrics":
                metric.ignore("decay_step", "the smoothing of a metric of the training batches")
            kinds = [k for k in metric.msg.names() if key == "metrics" or k != "decay_step"]
            if kinds != ["recall_at_k"]:
                ctx.refuse(metric.path, f"{kinds}: a match model is scored by recall_at_k only")
                metric.taken.update(kinds)
                continue
            body = metric.message("recall_at_k")
            assert body is not None
            k = body.integer("top_k", 5)
            body.done()
            metric.done()
            if key == "metrics":
                top_k.append(k)
            else:
                ctx.note(metric.path, "metrics of the training batches: dynarec computes recall@k on the eval data")
    return list(dict.fromkeys(top_k)) or [5]


def _two_tower(r: Reader, m: Reader, ctx: Context, name: str) -> dict[str, Any]:
    """dssm / dssm_v2 -> dynarec's dssm, dat -> dat, with the model's softmax cross-entropy loss
    and its recall_at_k metrics (TorchEasyRec's match models take no other)."""
    out: dict[str, Any] = {}
    for key in ("user_tower", "item_tower"):
        t = m.message(key)
        if t is None:
            ctx.refuse(m.at(key), "a tower is needed", fatal=True)
            continue
        if name == "mind" and key == "user_tower":
            out[key] = _mind_user_tower(t, ctx)
        else:
            out[key] = {"input": str(t.scalar("input", "")), **_match_mlp(t, "mlp", ctx)}
        if name == "dat":
            out[key]["augment_input"] = str(t.scalar("augment_input", ""))
        t.done()
    out["output_dim"] = m.integer("output_dim", 0)
    if name == "mind":
        out["simi_pow"] = m.number("simi_pow", 10.0)
    # TorchEasyRec's MIND is cosine by default, its other match models inner product
    out["similarity"] = _similarity(m, ctx, "COSINE" if name == "mind" else "INNER_PRODUCT")
    out["temperature"] = m.number("temperature", 1.0)
    out["in_batch_negative"] = bool(m.scalar("in_batch_negative", False))
    if name == "dat":
        out["amm_u_weight"] = m.number("amm_u_weight", 0.5)
        out["amm_i_weight"] = m.number("amm_i_weight", 0.5)
    out["recall_at_k"] = _match_losses_and_metrics(r, ctx)
    for key, default in (("kernel", "PYTORCH"), ("use_pareto_loss_weight", False), ("num_class", 1)):
        r.default_only(key, default)
    return out


def _sid(r: Reader, m: Reader, ctx: Context, name: str, groups: list[dict[str, Any]]) -> dict[str, Any]:
    """sid_rqvae / sid_rqkmeans -> dynarec's (dynarec/config/sid.py), with the model's losses
    (``sid_loss``: recon_loss, commitment_loss, contrastive_loss; the contrastive structure and
    objective are one setting in dynarec). Their input is the first feature group, as TorchEasyRec's."""
    out: dict[str, Any] = {"codebook": m.integers("codebook")}
    if not out["codebook"]:
        ctx.refuse(m.at("codebook"), "codebook: each layer's number of codes is needed", fatal=True)
    out["normalize_residuals"] = bool(m.scalar("normalize_residuals", False))
    if (c := m.message("candidate_output_config")) is not None:
        if bool(c.scalar("enabled", False)):
            out["candidate_output"] = {"top_k": c.integer("topk", 1)}
            c.default_only("strategy", "last_layer_knn", "only the last layer's nearest codes are candidates")
        else:
            c.ignore("topk", "candidate output is disabled")
            c.ignore("strategy", "candidate output is disabled")
        c.done()
    for key in ("metrics", "train_metrics"):
        if r.has(key):
            r.ignore(key, "a semantic-ID model reports mse, rel_l1 and unique_sid_ratio")
    r.default_only("kernel", "PYTORCH")
    r.default_only("use_pareto_loss_weight", False)
    r.default_only("num_class", 1)
    if name == "sid_rqkmeans":
        if (k := m.message("faiss_kmeans_kwargs")) is not None:
            kmeans: dict[str, Any] = {}
            for key in ("niter", "nredo", "seed", "max_points_per_centroid", "min_points_per_centroid"):
                if k.has(key):
                    kmeans[key] = k.integer(key)
            for key in ("spherical", "verbose"):
                if k.has(key):
                    kmeans[key] = bool(k.scalar(key))
            k.done()
            out["kmeans"] = kmeans
        if m.integer("train_sample_size", 0):
            out["train_sample_size"] = m.integer("train_sample_size")
        for loss in r.messages("losses"):
            ctx.refuse(loss.path, "sid_rqkmeans trains by k-means: it takes no loss", fatal=True)
            loss.taken.update(loss.msg.names())
        return out
    out["embed_dim"] = m.integer("embed_dim", 64)
    if m.has("hidden_dims"):
        out["hidden_dims"] = m.integers("hidden_dims")
    for key, default in (("forward_mode", "ste"), ("distance_type", "l2")):
        value = str(m.scalar(key, default))
        allowed = ("ste", "gumbel_softmax") if key == "forward_mode" else ("l2", "cosine")
        if value not in allowed:
            ctx.refuse(m.at(key), f"{value!r} is not supported ({', '.join(allowed)} are)", fatal=True)
        out[key] = value
    out["rotation_trick"] = bool(m.scalar("rotation_trick", False))
    out["kmeans_init"] = bool(m.scalar("kmeans_init", False))
    sinkhorn = m.message("sinkhorn_config")
    enabled = bool(sinkhorn.scalar("enabled", True)) if sinkhorn is not None else True
    if sinkhorn is not None:
        out["sinkhorn"] = {
            "iters": sinkhorn.integer("iters", 5),
            "epsilon": sinkhorn.number("epsilon", 10.0),
            "enabled": enabled,
        }
        sinkhorn.done()
    if out["forward_mode"] == "gumbel_softmax":
        if enabled:  # TorchEasyRec turns it off, with a warning
            ctx.note(m.at("forward_mode"), "gumbel_softmax: Sinkhorn is turned off, as TorchEasyRec turns it off")
            out["sinkhorn"] = {**out.get("sinkhorn", {}), "enabled": False}
        if out["rotation_trick"]:
            ctx.note(m.at("rotation_trick"), "no effect with gumbel_softmax (TorchEasyRec ignores it): dropped")
            out["rotation_trick"] = False
    structure = m.message("contrastive_config")
    objective = False
    out["recon_loss"] = out["commitment_loss"] = None
    for loss in r.messages("losses"):
        kinds = loss.msg.names()
        kind = kinds[0] if len(kinds) == 1 else None
        body = loss.message(kind) if kind in ("recon_loss", "commitment_loss", "contrastive_loss") else None
        if body is None:
            ctx.refuse(loss.path, f"{kinds}: a semantic-ID model trains by recon, commitment and contrastive losses")
            loss.taken.update(kinds)
            continue
        if kind == "recon_loss":
            out["recon_loss"] = {"type": str(body.scalar("recon_type", "l2"))}
        elif kind == "commitment_loss":
            weights = body.numbers("latent_weight") or [1.0, 0.5]
            out["commitment_loss"] = {"latent_weight": weights, "type": str(body.scalar("commitment_type", "l2"))}
        else:
            objective = True
        body.done()
        loss.done()
    if structure is not None:
        out["contrastive"] = {
            "pair_group": str(structure.scalar("pair_feature_group", "")),
            "pair_flag_group": str(structure.scalar("pair_flag_feature_group", "")),
        }
        structure.done()
    if (structure is not None) != objective:
        ctx.refuse(
            m.at("contrastive_config"),
            "contrastive_config and a contrastive_loss must be set together (TorchEasyRec refuses one alone)",
            fatal=True,
        )
    if groups:
        out["input"] = groups[0]["group_name"]
    return out


def _match_mlp(t: Reader, key: str, ctx: Context, bias: bool = False) -> dict[str, Any]:
    """A match tower's MLP ``key`` as MatchTowerCfg's fields (hidden_units, activation, use_bn,
    dropout_ratio), and MLPCfg's ``bias`` where ``bias`` says it is read."""
    body = t.message(key)
    use_bn = bool(body.scalar("use_bn", False)) if body is not None else False
    activations = _activations("MatchTowerCfg", "activation")
    mlp = _mlp(body, t.at(key), ctx, activations, dropout=True, batch_norm=True, bias=bias)
    out: dict[str, Any] = {"hidden_units": mlp.units}
    if not mlp.bias:
        out["bias"] = False
    if mlp.activation != "relu":
        out["activation"] = mlp.activation
    if use_bn:
        out["use_bn"] = True
    if mlp.dropout:
        out["dropout_ratio"] = mlp.dropout
    return out


def _mind_user_tower(t: Reader, ctx: Context) -> dict[str, Any]:
    """MINDUserTower {input, history_input, user_mlp, hist_seq_mlp, capsule_config, concat_mlp}."""
    tower: dict[str, Any] = {
        "input": str(t.scalar("input", "")),
        "history_input": str(t.scalar("history_input", "")),
        **_match_mlp(t, "user_mlp", ctx),
    }
    if t.has("hist_seq_mlp"):
        tower["hist_seq_mlp"] = _match_mlp(t, "hist_seq_mlp", ctx, bias=True)
    tower["concat_mlp"] = _match_mlp(t, "concat_mlp", ctx, bias=True)
    # TorchEasyRec's MIND reads no user_seq_combine (its interests always join the user vector)
    if t.has("user_seq_combine"):
        ctx.note(t.at("user_seq_combine"), "not read by TorchEasyRec's MIND; each interest joins the user vector")
    t.scalar("user_seq_combine")
    c = t.message("capsule_config")
    if c is None:
        ctx.refuse(t.at("capsule_config"), "a capsule_config is needed", fatal=True)
        return tower
    capsule: dict[str, Any] = {"max_seq_len": c.integer("max_seq_len", 0), "high_dim": c.integer("high_dim", 0)}
    for key, count in (("max_k", 5), ("num_iters", 3)):
        capsule[key] = c.integer(key, count)
    for key, number in (("routing_logits_scale", 20.0), ("routing_logits_stddev", 1.0), ("squash_pow", 1.0)):
        capsule[key] = c.number(key, number)
    capsule["const_caps_num"] = bool(c.scalar("const_caps_num", False))
    capsule["routing_init_method"] = str(c.scalar("routing_init_method", "normal"))
    c.done()
    tower["capsule"] = capsule
    return tower


def _mask_net(m: Reader, ctx: Context) -> dict[str, Any]:
    """mask_net {mask_net_module {...}}: MaskNet over the first group (TorchEasyRec's too)."""
    module = m.message("mask_net_module")
    if module is None:
        ctx.refuse(m.at("mask_net_module"), "a mask_net_module is needed", fatal=True)
        return {}
    return _mask_net_module(module, ctx)


def _mask_net_module(module: Reader, ctx: Context) -> dict[str, Any]:
    """A MaskNetModule: mask blocks and the top MLP."""
    out: dict[str, Any] = {"n_mask_blocks": module.integer("n_mask_blocks", 1)}
    block = module.message("mask_block")
    if block is None:
        ctx.refuse(module.at("mask_block"), "a mask_block is needed", fatal=True)
    else:
        out["mask_block"] = {"hidden_dim": block.integer("hidden_dim", 1)}
        out["mask_block"]["reduction_ratio"] = block.number("reduction_ratio", 1.0)
        if block.has("aggregation_dim"):
            out["mask_block"]["aggregation_dim"] = block.integer("aggregation_dim")
        block.done()
    out["top_hidden_units"] = _mlp(module.message("top_mlp"), module.at("top_mlp"), ctx).units
    out["use_parallel"] = bool(module.scalar("use_parallel", True))
    module.done()
    return out


def _wukong(m: Reader, ctx: Context) -> dict[str, Any]:
    """wukong: its layers over the group "sparse" (the only group when there is one) and the
    dense MLP over the group "dense" (TorchEasyRec's group names, dynarec's defaults)."""
    out: dict[str, Any] = {"wukong_layers": []}
    for layer in m.messages("wukong_layers"):
        out["wukong_layers"].append(
            {
                "lcb_feature_num": layer.integer("lcb_feature_num", 1),
                "fmb_feature_num": layer.integer("fmb_feature_num", 1),
                "compressed_feature_num": layer.integer("compressed_feature_num", 16),
                "feature_num_hidden_units": _mlp(
                    layer.message("feature_num_mlp"), layer.at("feature_num_mlp"), ctx
                ).units,
            }
        )
        layer.done()
    if not out["wukong_layers"]:
        ctx.refuse(m.at("wukong_layers"), "at least one layer is needed", fatal=True)
    if (dense := m.message("dense_mlp")) is not None:
        out["dense_hidden_units"] = _mlp(dense, m.at("dense_mlp"), ctx).units
    out["final_hidden_units"] = _mlp(m.message("final"), m.at("final"), ctx).units
    return out


def _check_wukong_widths(
    m: Reader, block: dict[str, Any], groups: dict[str, Any], bodies: dict[str, dict[str, Any]], ctx: Context
) -> None:
    """TorchEasyRec's WuKong checks (and raises) what dynarec's checks when the model is built: the
    sparse group's fields of one width, and the dense MLP's output one more field of it."""
    sparse = groups.get("sparse") or (next(iter(groups.values())) if len(groups) == 1 else None)
    if sparse is None:
        return
    dims = {bodies.get(n, {}).get("embedding_dim") for n in sparse["feature_names"]}
    if len(dims) > 1:
        ctx.refuse(m.path, f"the group 'sparse' holds fields of several widths {sorted(map(str, dims))}", fatal=True)
    units = block.get("dense_hidden_units")
    if units and "dense" in groups and len(dims) == 1 and units[-1] != next(iter(dims)):
        ctx.refuse(
            m.at("dense_mlp"),
            f"its last hidden unit ({units[-1]}) must equal the sparse features' embedding_dim "
            f"({next(iter(dims))}): the dense MLP's output is one more field (TorchEasyRec raises 'dense mlp last "
            "hidden_unit must be the same sparse feature dim' on this config too)",
            fatal=True,
        )


def _dcn(m: Reader, ctx: Context) -> dict[str, Any]:
    """dcn_v1 -> dynarec's dcn: cross layers and a deep MLP over the first group."""
    cross = m.message("cross")
    out: dict[str, Any] = {"cross_num": cross.integer("cross_num", 3) if cross is not None else 3}
    if cross is not None:
        cross.done()
    out["deep_hidden_units"] = _mlp(m.message("deep"), m.at("deep"), ctx).units
    out["final_hidden_units"] = _mlp(m.message("final"), m.at("final"), ctx).units
    return out


def _dcn_v2(m: Reader, ctx: Context) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if (backbone := m.message("backbone")) is not None:
        out["backbone_hidden_units"] = _mlp(backbone, m.at("backbone"), ctx).units
    cross = m.message("cross")
    if cross is not None:
        out["cross_num"] = cross.integer("cross_num", 3)
        out["low_rank"] = cross.integer("low_rank", 32)
        cross.done()
    if (deep := m.message("deep")) is not None:
        out["deep_hidden_units"] = _mlp(deep, m.at("deep"), ctx).units
    out["final_hidden_units"] = _mlp(m.message("final"), m.at("final"), ctx).units
    return out


def _xdeepfm(m: Reader, ctx: Context) -> dict[str, Any]:
    """xdeepfm: a CIN over the group "wide" (its features' own tables of wide_embedding_dim,
    default 16) and an MLP over "deep"."""
    cin = m.message("cin")
    layers = cin.integers("cin_layer_size") if cin is not None else []
    if cin is not None:
        cin.done()
    if not layers:
        ctx.refuse(m.at("cin.cin_layer_size"), "at least one CIN layer is needed", fatal=True)
    return {
        "cin_layer_size": layers or [1],
        "deep_hidden_units": _mlp(m.message("deep"), m.at("deep"), ctx).units,
        "final_hidden_units": _mlp(m.message("final"), m.at("final"), ctx).units,
    }


def _rocket_launching(m: Reader, ctx: Context) -> dict[str, Any]:
    """rocket_launching {share_mlp, booster_mlp, light_mlp, feature_based_distillation,
    feature_distillation_function}: over the first group (TorchEasyRec's too)."""
    out: dict[str, Any] = {}
    if (share := m.message("share_mlp")) is not None:
        out["share_hidden_units"] = _mlp(share, m.at("share_mlp"), ctx).units
    out["booster_hidden_units"] = _mlp(m.message("booster_mlp"), m.at("booster_mlp"), ctx).units
    out["light_hidden_units"] = _mlp(m.message("light_mlp"), m.at("light_mlp"), ctx).units
    if m.scalar("feature_based_distillation", False) in (True, "true"):
        out["feature_based_distillation"] = True
    function = str(m.scalar("feature_distillation_function", "COSINE"))
    if function == "INNER_PRODUCT":
        out["feature_distillation_function"] = "l2"
        ctx.note(
            m.at("feature_distillation_function"),
            "INNER_PRODUCT: TorchEasyRec's non-cosine distance, sqrt(sum((b - l)^2)): dynarec's l2",
        )
    elif function != "COSINE":
        ctx.refuse(m.at("feature_distillation_function"), f"{function!r} is not supported (COSINE, INNER_PRODUCT are)")
    m.done()
    return out


# -- dlrm_hstu, ultra_hstu -------------------------------------------------------------------------


def _required(r: Reader, name: str, what: str = "") -> None:
    """A field TorchEasyRec requires: refused (fatal) when absent."""
    if not r.has(name):
        r.ctx.refuse(r.at(name), f"{what or name} is needed", fatal=True)


def _generative_ranker(
    name: str,
    m: Reader,
    ctx: Context,
    groups: list[dict[str, Any]],
    column: Callable[[str], str],
    eval_out: dict[str, Any],
) -> dict[str, Any]:
    """dlrm_hstu / ultra_hstu {hstu, fusion_mtl_tower, max_seq_len, item_embedding_hidden_dim, ...}
    -> dynarec's block of that name (dynarec/config/hstu.py): the transducer (ultra_hstu: one a
    channel, ``hstu`` repeated), the item MLP's width, the fusion tower and its tasks
    (``fusion_mtl_tower.task_configs``)."""
    contextual = next((len(g["feature_names"]) for g in groups if g["group_name"] == "contextual"), 0)
    out: dict[str, Any] = {}
    if name == "dlrm_hstu":
        if (h := m.message("hstu")) is not None:
            out["hstu"] = _hstu(h, ctx, contextual, name)
        else:
            _required(m, "hstu", "an hstu block")
    else:
        channels = m.messages("hstu")
        if not channels:
            ctx.refuse(m.at("hstu"), "at least one hstu channel is needed", fatal=True)
        out["hstu"] = [_hstu(h, ctx, contextual, name) for h in channels]
        _check_channel_names(channels, out["hstu"], ctx)
    _required(m, "max_seq_len")
    out["max_seq_len"] = m.integer("max_seq_len", 1)
    out["item_embedding_hidden_dim"] = m.integer("item_embedding_hidden_dim", 512)
    m.default_only(
        "enable_global_average_loss",
        True,
        "dynarec's loss is the mean over every rank's candidates; a mean over each rank's own is not supported",
        fatal=True,
    )
    if m.has("sequence_timestamp_is_ascending"):
        out["sequence_timestamp_is_ascending"] = bool(m.scalar("sequence_timestamp_is_ascending"))
    m.default_only(
        "concat_contextual_features",
        False,
        "dynarec makes one token of each contextual feature; one token of them all is not supported",
        fatal=True,
    )
    if (f := m.message("fusion_mtl_tower")) is not None:
        out.update(convert_fusion_mtl_tower(f, column, eval_out, name))
    else:
        _required(m, "fusion_mtl_tower", "a fusion_mtl_tower with its task_configs")
        out["task_towers"] = []
    m.done()
    return out


def _check_channel_names(channels: list[Reader], blocks: list[dict[str, Any]], ctx: Context) -> None:
    """UltraHSTU's channels: with two or more, each names itself, no two alike (TorchEasyRec
    asserts it); one may go unnamed (its groups: ``uih``, ...)."""
    names = [str(b.get("name", "")) for b in blocks]
    if len(names) < 2:
        return
    for i, (h, n) in enumerate(zip(channels, names)):
        if not n:
            ctx.refuse(h.at("name"), "with two or more hstu channels each needs a name (TorchEasyRec's)", fatal=True)
        elif n in names[:i]:
            ctx.refuse(h.at("name"), f"{n!r}: another channel has this name; each needs its own", fatal=True)


def _channels(model: dict[str, Any]) -> list[dict[str, Any]]:
    """A converted generative ranker's channels (dlrm_hstu: its one hstu block)."""
    name = next((k for k in GENERATIVE if k in model), "")
    hstu = model.get(name, {}).get("hstu", {} if name == "dlrm_hstu" else [])
    return hstu if isinstance(hstu, list) else [hstu]


def _semi_local(channel: dict[str, Any]) -> bool:
    stu = channel.get("stu", {})
    return bool(stu.get("sla_k1") or stu.get("sla_k2"))


def _hstu(h: Reader, ctx: Context, contextual: int, model: str) -> dict[str, Any]:
    """HSTU {stu, input_dropout_ratio, attn_num_layers, positional_encoder, input_preprocessor,
    output_postprocessor, attn_truncation_*, name} -> dynarec's ``hstu`` block (a channel; its
    input preprocessor's fields flattened: content_mlp_hidden_dim, action_encoder,
    action_mlp_hidden_dim)."""
    out: dict[str, Any] = {}
    name = str(h.scalar("name", ""))
    if model == "hstu_match":
        h.default_only("name", "", "hstu_match's user tower reads the groups of its input")
        h.default_only("attn_truncation_split_layer", 0, "not supported in hstu_match's user tower yet")
        h.default_only("attn_truncation_tail_len", 0, "not supported in hstu_match's user tower yet")
    elif name and model == "dlrm_hstu":
        ctx.refuse(
            h.at("name"),
            f"{name!r}: a named channel is ultra_hstu's (TorchEasyRec's DlrmHSTU would size its transducer by the "
            "group 'uih' and read the named groups); dlrm_hstu reads uih, uih_action, uih_watchtime, uih_timestamp",
            fatal=True,
        )
    elif name:
        out["name"] = name
    if (stu := h.message("stu")) is not None:
        out["stu"] = _stu(stu, ctx, contextual)
    else:
        _required(h, "stu", "an stu block")
    out["attn_num_layers"] = h.integer("attn_num_layers", 3)
    out["input_dropout_ratio"] = h.number("input_dropout_ratio", 0.2)
    split = h.integer("attn_truncation_split_layer", 0)
    tail = h.integer("attn_truncation_tail_len", 0)
    if split < 0 or tail < 0 or (split > 0) != (tail > 0) or split >= out["attn_num_layers"]:
        ctx.refuse(
            h.at("attn_truncation_tail_len" if split == 0 and tail > 0 else "attn_truncation_split_layer"),
            f"attn_truncation_split_layer {split}, attn_truncation_tail_len {tail}: both 0 (no truncation), or "
            f"both above 0 with the split below attn_num_layers ({out['attn_num_layers']}), as TorchEasyRec requires",
            fatal=True,
        )
    elif split > 0:
        out["attn_truncation_split_layer"], out["attn_truncation_tail_len"] = split, tail
    if (p := h.message("positional_encoder")) is not None:
        out["positional_encoder"] = _positional_encoder(p, ctx)
    else:
        _required(h, "positional_encoder", "a positional_encoder")
    if (ip := h.message("input_preprocessor")) is not None:
        out.update(_uih_preprocessor(ip, ctx) if model == "hstu_match" else _input_preprocessor(ip, ctx))
    else:
        _required(h, "input_preprocessor", "an input_preprocessor")
    if (op := h.message("output_postprocessor")) is not None:
        out["postprocessor"] = _postprocessor(op, ctx)
    else:
        _required(h, "output_postprocessor", "an output_postprocessor")
    h.done()
    return out


def _stu(s: Reader, ctx: Context, contextual: int) -> dict[str, Any]:
    """STU's sizes; the recomputation and scheduling switches (no effect on the numbers) noted."""
    out: dict[str, Any] = {}
    for key in ("embedding_dim", "num_heads", "hidden_dim", "attention_dim"):
        _required(s, key)
        out[key] = s.integer(key, 1)
    out["output_dropout_ratio"] = s.number("output_dropout_ratio", 0.3)
    out["max_attn_len"] = s.integer("max_attn_len", 0)
    alpha = s.number("attn_alpha", 0.0)
    if alpha > 0:
        out["attn_alpha"] = alpha
    elif alpha < 0:
        ctx.refuse(s.at("attn_alpha"), f"{alpha}: must be above 0 (0 or unset: 1 / sqrt(attention_dim))", fatal=True)
    elif s.has("attn_alpha"):
        ctx.note(s.at("attn_alpha"), "0: unset, 1 / sqrt(attention_dim) (TorchEasyRec's)")
    out["use_group_norm"] = bool(s.scalar("use_group_norm", False))
    for key in ("recompute_normed_x", "recompute_uvqk", "recompute_y"):
        s.ignore(key, "activation recomputation in backward: memory against time, the same numbers")
    s.ignore("sort_by_length", "the kernels' scheduling of sequences by length, the same numbers")
    seq_len = s.integer("contextual_seq_len", -1)
    if seq_len >= 0 and seq_len != contextual:
        ctx.refuse(
            s.at("contextual_seq_len"),
            f"{seq_len}: only a value < 0 (the default: the contextual group's feature count) or that count "
            f"({contextual}) is supported",
            fatal=True,
        )
    elif seq_len >= 0:
        ctx.note(s.at("contextual_seq_len"), f"{seq_len}: the contextual group's feature count, as when unset")
    scaling = s.integer("scaling_seqlen", -1)
    if scaling >= 0:
        ctx.refuse(
            s.at("scaling_seqlen"),
            f"{scaling}: only values < 0 (the default: attention scaled by max_seq_len) are supported",
            fatal=True,
        )
    for key in ("sla_k1", "sla_k2"):  # semi-local attention: 0, 0 is off
        value = s.integer(key, 0)
        if value < 0:
            ctx.refuse(s.at(key), f"{value}: must be 0 or above", fatal=True)
        elif value:
            out[key] = value
    s.done()
    return out


def _positional_encoder(p: Reader, ctx: Context) -> dict[str, Any]:
    """GRPositionalEncoder: the same fields."""
    _required(p, "num_position_buckets")
    out: dict[str, Any] = {
        "num_position_buckets": p.integer("num_position_buckets", 1),
        "num_time_buckets": p.integer("num_time_buckets", 0),
        "use_time_encoding": bool(p.scalar("use_time_encoding", False)),
    }
    if out["use_time_encoding"] and out["num_time_buckets"] < 1:
        ctx.refuse(p.at("num_time_buckets"), "use_time_encoding needs num_time_buckets >= 1", fatal=True)
    fn = str(p.scalar("time_bucket_fn", "sqrt"))
    if fn not in ("sqrt", "log"):
        ctx.refuse(p.at("time_bucket_fn"), f"{fn!r} is not supported (sqrt, log are)", fatal=True)
    out["time_bucket_fn"] = fn if fn in ("sqrt", "log") else "sqrt"
    out["time_bucket_increments"] = p.number("time_bucket_increments", 60.0)
    p.done()
    return out


def _input_preprocessor(ip: Reader, ctx: Context) -> dict[str, Any]:
    """input_preprocessor {contextual_preprocessor {action_encoder, action_mlp, content_encoder,
    content_mlp}} -> content_mlp_hidden_dim, action_encoder, action_mlp_hidden_dim."""
    ip.refuse(
        "contextual_interleave_preprocessor",
        why="interleaved targets are not supported (contextual_preprocessor is)",
        fatal=True,
    )
    ip.refuse("uih_preprocessor", why="hstu_match's preprocessor; dlrm_hstu's is contextual_preprocessor", fatal=True)
    cp = ip.message("contextual_preprocessor")
    if cp is None:
        if not ip.has("contextual_interleave_preprocessor") and not ip.has("uih_preprocessor"):
            _required(ip, "contextual_preprocessor", "a contextual_preprocessor")
        ip.done()
        return {}
    out: dict[str, Any] = {}
    if (ce := cp.message("content_encoder")) is not None:
        ce.refuse(
            "pad_content_encoder", "mlp_content_encoder", why="not supported (slice_content_encoder is)", fatal=True
        )
        if (sl := ce.message("slice_content_encoder")) is not None:
            sl.done()
        elif not ce.has("pad_content_encoder") and not ce.has("mlp_content_encoder"):
            _required(ce, "slice_content_encoder", "a content encoder (slice_content_encoder)")
        ce.done()
    else:
        _required(cp, "content_encoder", "a content_encoder (slice_content_encoder)")
    content = _contextualized_mlp(cp, "content_mlp", ctx)
    if content is not None:
        out["content_mlp_hidden_dim"] = content
    elif not cp.has("content_mlp"):
        _required(cp, "content_mlp", "a content_mlp (simple_mlp)")
    out.update(_actions(cp, ctx))
    cp.done()
    ip.done()
    return out


def _uih_preprocessor(ip: Reader, ctx: Context) -> dict[str, Any]:
    """input_preprocessor {uih_preprocessor {action_encoder, action_mlp}} (hstu_match's) ->
    action_encoder, action_mlp_hidden_dim."""
    ip.refuse(
        "contextual_preprocessor",
        "contextual_interleave_preprocessor",
        why="hstu_match's user tower reads the history alone (uih_preprocessor)",
        fatal=True,
    )
    up = ip.message("uih_preprocessor")
    out: dict[str, Any] = {}
    if up is None:
        if not ip.has("contextual_preprocessor") and not ip.has("contextual_interleave_preprocessor"):
            _required(ip, "uih_preprocessor", "a uih_preprocessor")
        ip.done()
        return out
    out.update(_actions(up, ctx))
    up.done()
    ip.done()
    return out


def _actions(p: Reader, ctx: Context) -> dict[str, Any]:
    """A preprocessor's ``action_encoder`` and ``action_mlp`` (both, or neither) -> action_encoder,
    action_mlp_hidden_dim."""
    encoder = _action_encoder(ae, ctx) if (ae := p.message("action_encoder")) is not None else None
    action_mlp = _contextualized_mlp(p, "action_mlp", ctx)
    if p.has("action_encoder") != p.has("action_mlp"):
        pair = ["action_encoder", "action_mlp"]
        given, missing = pair if p.has("action_encoder") else pair[::-1]
        ctx.refuse(p.at(missing), f"{given} and {missing} go together", fatal=True)
    elif encoder is not None and action_mlp is not None:
        return {"action_encoder": encoder, "action_mlp_hidden_dim": action_mlp}
    return {}


def _contextualized_mlp(cp: Reader, key: str, ctx: Context) -> Optional[int]:
    """``key {simple_mlp {hidden_dim}}``: the hidden dim (parameterized_mlp refused)."""
    body = cp.message(key)
    if body is None:
        return None
    body.refuse(
        "parameterized_mlp",
        why="not supported (simple_mlp is: the contextual embeddings do not parameterize the MLP)",
        fatal=True,
    )
    simple = body.message("simple_mlp")
    dim = None
    if simple is not None:
        _required(simple, "hidden_dim")
        dim = simple.integer("hidden_dim", 1)
        simple.done()
    elif not body.has("parameterized_mlp"):
        _required(body, "simple_mlp", "a simple_mlp")
    body.done()
    return dim


def _action_encoder(ae: Reader, ctx: Context) -> Optional[dict[str, Any]]:
    """action_encoder {simple_action_encoder {action_embedding_dim, action_weights, ...}}."""
    simple = ae.message("simple_action_encoder")
    if simple is None:
        _required(ae, "simple_action_encoder", "a simple_action_encoder")
        ae.done()
        return None
    _required(simple, "action_embedding_dim")
    out: dict[str, Any] = {
        "action_embedding_dim": simple.integer("action_embedding_dim", 1),
        "action_weights": simple.integers("action_weights"),
    }
    if not out["action_weights"]:
        ctx.refuse(simple.at("action_weights"), "at least one action bitmask is needed", fatal=True)
    for key in ("watchtime_to_action_thresholds", "watchtime_to_action_weights"):
        if simple.integers(key):
            ctx.refuse(simple.at(key), "watch-time actions are not supported (only an empty list is)", fatal=True)
    simple.ignore(
        "embedding_init_std", "TorchEasyRec's action encoder initializes its embeddings with std 0.1 whatever it says"
    )
    simple.done()
    ae.done()
    return out


_POSTPROCESSORS = {
    "timestamp_layernorm_postprocessor": "timestamp_layernorm",
    "layernorm_postprocessor": "layernorm",
    "l2norm_postprocessor": "l2norm",
}


def _postprocessor(op: Reader, ctx: Context) -> dict[str, Any]:
    """output_postprocessor {timestamp_layernorm_postprocessor {time_duration_period_units,
    time_duration_units_per_period} | layernorm_postprocessor | l2norm_postprocessor}."""
    given = [k for k in _POSTPROCESSORS if op.has(k)]
    if len(given) != 1:
        ctx.refuse(op.path, f"give exactly one of {list(_POSTPROCESSORS)} (got {given or 'none'})", fatal=True)
        op.taken.update(_POSTPROCESSORS)
        op.done()
        return {}
    body = op.message(given[0])
    assert body is not None
    out: dict[str, Any] = {"kind": _POSTPROCESSORS[given[0]]}
    if given[0] == "timestamp_layernorm_postprocessor":
        units = body.integers("time_duration_period_units")
        per = body.integers("time_duration_units_per_period")
        if not units or len(units) != len(per):
            ctx.refuse(
                body.path,
                "time_duration_period_units and time_duration_units_per_period must be given, of one length "
                f"(got {len(units)} and {len(per)})",
                fatal=True,
            )
        out["time_duration_period_units"] = units
        out["time_duration_units_per_period"] = per
    body.done()
    op.done()
    return out


def _check_hstu_groups(r: Reader, groups: list[dict[str, Any]], name: str, block: dict[str, Any], ctx: Context) -> None:
    """TorchEasyRec's DlrmHSTU and UltraHSTU read their groups by name — the shared ones
    (``contextual``, ``candidate``, ``candidate_timestamp``) and each channel's ``<name>``,
    ``<name>_action``, ``<name>_watchtime``, ``<name>_timestamp`` (unnamed: ``uih``): refused
    by path when one is missing, unknown (TorchEasyRec would ignore it) or of the other kind."""
    from dynarec.config.hstu import CHANNEL_SUFFIXES, HSTU_GROUPS

    kinds = {g["group_name"]: g["group_type"] for g in groups}
    known = dict(HSTU_GROUPS)
    needed = ["candidate", "candidate_timestamp"]
    for channel in _channels({name: block}):
        base = str(channel.get("name") or "uih")
        known.update({base + suffix: True for suffix in CHANNEL_SUFFIXES})
        needed += [base, base + "_timestamp"] + ([base + "_action"] if "action_encoder" in channel else [])
    for g in dict.fromkeys(needed):
        if g not in kinds:
            ctx.refuse(r.at("feature_groups"), f"{name} needs a group named {g!r}", fatal=True)
    for g, kind in kinds.items():
        if g not in known:
            ctx.refuse(
                r.at("feature_groups"),
                f"{name} reads the groups {list(known)}; group {g!r} would be ignored by TorchEasyRec",
                fatal=True,
            )
        elif (kind == "sequence") != known[g]:
            want = "a SEQUENCE or JAGGED_SEQUENCE group" if known[g] else "a DEEP group"
            ctx.refuse(r.at("feature_groups"), f"{name}'s group {g!r} must be {want}", fatal=True)


_ZOO = {
    "mask_net": _mask_net,
    "wukong": _wukong,
    "dcn_v1": _dcn,
    "dcn_v2": _dcn_v2,
    "xdeepfm": _xdeepfm,
    "rocket_launching": _rocket_launching,
}


def column_of(features: list[Converted], name: str) -> str:
    """The data column a feature reads (its first input's)."""
    body = next((f.body for f in features if f.name == name), {})
    if isinstance(body.get("expression"), str):
        return str(body["expression"]).partition(":")[2]
    return str(body.get("input_name", name))


def _add_wide_features(
    r: Reader, features: list[Converted], dim: int, init_fn: Optional[str], ctx: Context
) -> dict[str, str]:
    """For every sparse feature of a WIDE group, a twin ``<name>_wide`` with its own table
    ``<table>_wide`` of ``dim`` (TorchEasyRec, spec §1.5); returns ``{name: twin name}``."""
    rename: dict[str, str] = {}
    by_name = {f.name: f for f in features}
    for g in r.msg.values("feature_groups"):
        if not isinstance(g, Message) or "WIDE" not in [str(v) for v in g.values("group_type")]:
            continue
        for n in g.values("feature_names"):
            n = str(n)
            base = by_name.get(n)
            if base is None or n in rename:
                continue
            if not base.sparse or base.sequence:
                ctx.refuse(f"{r.at('feature_groups')}", f"a WIDE group takes features with a table; {n!r} has none")
                continue
            twin = dict(base.body, feature_name=f"{n}_wide", embedding_dim=dim)
            if "expression" not in base.body and "input_name" not in base.body and base.kind == "id_feature":
                twin["input_name"] = n  # the column the feature itself reads
            twin["embedding_name"] = f"{base.body.get('embedding_name', n)}_wide"
            twin.pop("initializer", None)
            if init_fn is not None:
                init = initializer(str(init_fn), f"{r.at('wide_init_fn')}", ctx)
                if init is not None:
                    twin["initializer"] = init
            features.append(Converted(base.kind, twin, base.path, [], [n, *base.reads]))
            rename[n] = twin["feature_name"]
    return rename


# -- --lenient: what a dropped feature takes with it -----------------------------------------------


def prune_model(result: ModelResult, features: dict[str, Converted], ctx: Context) -> list[str]:
    """Takes every name that is no longer a feature out of the groups; a group left empty (a
    sequence group: without sequence features, or without the query features its DIN tower
    compares them with) goes, with the towers that read it, where the model allows; elsewhere
    that is refused (fatal). Returns what was dropped, one line each."""
    model = result.model
    dropped: list[str] = []
    gone: list[int] = []
    # Sequence groups with no query features (read as sequences alone): MIND's history (its
    # capsules), every group of an HSTU model (its transducer, HSTUMatch's towers)
    history = model.get("mind", {}).get("user_tower", {}).get("history_input")
    hstu = model_name(model) in (*GENERATIVE, "hstu_match")
    for i, g in enumerate(model["feature_groups"]):
        path = result.group_paths[i] if i < len(result.group_paths) else f"model_config.feature_groups[{i}]"
        removed = [n for n in g["feature_names"] if n not in features]
        if removed:
            g["feature_names"] = [n for n in g["feature_names"] if n in features]
            dropped.append(f"{path}: {', '.join(removed)} taken out of group {g['group_name']!r}")
        dropped += _prune_sequence_groups(g, path, features)
        kept = [features[n] for n in g["feature_names"]]
        empty = not kept
        if g["group_type"] == "sequence" and kept:
            alone = hstu or g["group_name"] == history
            empty = not any(f.sequence for f in kept) or (all(f.sequence for f in kept) and not alone)
        if empty:
            gone.append(i)
            why = "left empty" if not kept else "left without sequence features or without query features"
            name = model_name(model)
            if name != "multi_tower_din":
                ctx.refuse(
                    path, f"group {g['group_name']!r} {why} by the dropped features; {name} needs it", fatal=True
                )
                continue
            dropped.append(f"{path}: group {g['group_name']!r} {why}, dropped")
    if not gone:
        return dropped
    names = {model["feature_groups"][i]["group_name"] for i in gone}
    model["feature_groups"] = [g for i, g in enumerate(model["feature_groups"]) if i not in gone]
    block = model.get("multi_tower_din")
    if block is not None:
        for key in ("towers", "din_towers"):
            paths = result.tower_paths.get(key, [])
            kept_towers = []
            for j, t in enumerate(block[key]):
                if t["input"] in names:
                    dropped.append(
                        f"{paths[j] if j < len(paths) else key}: reads dropped group {t['input']!r}, dropped"
                    )
                else:
                    kept_towers.append(t)
            block[key] = kept_towers
        if not block["towers"] and not block["din_towers"]:
            ctx.refuse("model_config.multi_tower_din", "no tower is left after the dropped features", fatal=True)
    return dropped


def _prune_sequence_groups(group: dict[str, Any], path: str, features: dict[str, Converted]) -> list[str]:
    """Takes the names that are no longer features out of ``group``'s sequence groups; a
    sequence group left without sequence features (or, read by an attention, without query
    features) goes with its encoders. Returns what was dropped."""
    dropped: list[str] = []
    encoders = group.get("sequence_encoders", [])
    gone = set()
    for sg in group.get("sequence_groups", []):
        removed = [n for n in sg["feature_names"] if n not in features]
        if not removed:
            continue
        sg["feature_names"] = [n for n in sg["feature_names"] if n in features]
        dropped.append(f"{path}: {', '.join(removed)} taken out of sequence group {sg['group_name']!r}")
        kept = [features[n] for n in sg["feature_names"]]
        readers = [e for e in encoders if next(iter(e.values())).get("input", sg["group_name"]) == sg["group_name"]]
        needs_query = any("pooling_encoder" not in e for e in readers)
        if not any(f.sequence for f in kept) or (needs_query and all(f.sequence for f in kept)):
            gone.add(sg["group_name"])
            dropped.append(f"{path}: sequence group {sg['group_name']!r} left incomplete, dropped with its encoders")
    if gone:
        group["sequence_groups"] = [sg for sg in group["sequence_groups"] if sg["group_name"] not in gone]
        group["sequence_encoders"] = [
            e for e in encoders if next(iter(e.values())).get("input", next(iter(gone))) not in gone
        ]
        if not group["sequence_groups"]:
            del group["sequence_groups"], group["sequence_encoders"]
    return dropped


def model_name(model: dict[str, Any]) -> str:
    return next((k for k in model if k not in ("feature_groups", "variational_dropout")), "")
