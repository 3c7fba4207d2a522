"""``model_config``: feature groups, the model and its MLPs, losses and metrics."""

from __future__ import annotations

from typing import Any, Optional

from dynarec.config.textproto import Message
from dynarec.config.tzrec.features import initializer
from dynarec.config.tzrec.reader import Context, Reader

__all__ = ["column_of", "convert_model", "feature_body"]

# -- model -----------------------------------------------------------------------------------------

_GROUP_TYPES = {"DEEP": "deep", "WIDE": "wide", "SEQUENCE": "sequence", "JAGGED_SEQUENCE": "sequence"}


def _mlp(r: Optional[Reader], path: str, ctx: Context) -> list[int]:
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


def _groups(r: Reader, wide_rename: dict[str, str]) -> list[dict[str, Any]]:
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


def convert_model(r: Reader, features: list[dict[str, Any]], ctx: Context) -> tuple[dict[str, Any], dict[str, Any]]:
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
        dims = {feature_body(features, n).get("embedding_dim") for n in (sparse or {}).get("feature_names", [])}
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
            eval_cfg["grouped_auc_field"] = column_of(features, key)
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


def feature_body(features: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for f in features:
        body = next(iter(f.values()))
        if body["feature_name"] == name:
            return body
    return {}


def column_of(features: list[dict[str, Any]], name: str) -> str:
    body = feature_body(features, name)
    if "expression" in body:
        return str(body["expression"]).partition(":")[2]
    return str(body.get("input_name", name))


def _add_wide_features(
    r: Reader, features: list[dict[str, Any]], dim: int, init_fn: Optional[str], ctx: Context
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
            body = feature_body(features, n)
            if kind != "id_feature":
                ctx.refuse(f"{r.at('feature_groups')}", f"a WIDE group takes id features; {n!r} is not one")
                continue
            twin = dict(body, feature_name=f"{n}_wide", embedding_dim=dim)
            if "expression" not in body and "input_name" not in body:
                twin["input_name"] = n  # the column the feature itself reads
            twin["embedding_name"] = f"{body.get('embedding_name', n)}_wide"
            twin.pop("initializer", None)
            if init_fn is not None:
                init = initializer(str(init_fn), f"{r.at('wide_init_fn')}", ctx)
                if init is not None:
                    twin["initializer"] = init
            if n not in rename:
                features.append({"id_feature": twin})
                rename[n] = twin["feature_name"]
    return rename
