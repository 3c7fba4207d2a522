"""Losses, metrics and task towers (``tzrec/protos/loss.proto``, ``metric.proto``,
``tower.proto``), the multi-task models that hold the towers: simple_multi_task, mmoe, ple
and dbmtl (``multi_task_rank.proto``), and DlrmHSTU's fusion tower (``FusionMTLTower``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from dynarec.config.tzrec.reader import Reader

__all__ = ["MULTI_TASK", "convert_fusion_mtl_tower", "convert_loss", "convert_metric", "convert_multi_task"]

# TorchEasyRec's loss -> its fields and defaults, as dynarec takes them.
_LOSSES: dict[str, dict[str, float]] = {
    "binary_cross_entropy": {"label_smoothing": 0.0},
    "binary_focal_loss": {"gamma": 2.0, "alpha": 0.5},
    "softmax_cross_entropy": {"label_smoothing": 0.0},
    "l2_loss": {},
}
_METRICS = ("auc", "grouped_auc", "mean_squared_error", "mean_absolute_error", "accuracy")


def convert_loss(loss: Reader, column_of: Optional[Callable[[str], str]] = None) -> Optional[dict[str, Any]]:
    """One ``losses`` block as dynarec's ``{kind: {settings}}``; None (refused by path) for a loss
    dynarec lacks (the semantic-id losses). ``column_of``: a feature's column (JRC's session
    feature; without it jrc_loss is refused, as for a single-task model)."""
    kinds = loss.msg.names()
    known = [*_LOSSES, "jrc_loss"] if column_of is not None else list(_LOSSES)
    if len(kinds) != 1 or kinds[0] not in known:
        loss.ctx.refuse(loss.path, f"{kinds} is not supported ({', '.join(known)} are)", fatal=True)
        loss.taken.update(kinds)
        return None
    body = loss.message(kinds[0])
    assert body is not None
    if kinds[0] == "jrc_loss":
        assert column_of is not None
        session = str(body.scalar("session_name", ""))
        if not session:
            body.ctx.refuse(body.at("session_name"), "a session feature is needed", fatal=True)
        out: dict[str, Any] = {"session_name": column_of(session) if session else ""}
        if (alpha := body.number("alpha", 0.5)) != 0.5:
            out["alpha"] = alpha
        body.done()
        loss.done()
        return {"jrc_loss": out}
    settings = {k: body.number(k, default) for k, default in _LOSSES[kinds[0]].items()}
    body.done()
    loss.done()
    return {kinds[0]: {k: v for k, v in settings.items() if v != _LOSSES[kinds[0]][k]}}


def convert_metric(metric: Reader, grouping_column: Callable[[str], str], eval_out: dict[str, Any]) -> Optional[str]:
    """One ``metrics`` block as dynarec's metric name (a grouped AUC's key goes to
    ``eval_out['grouped_auc_field']``); None, refused by path, for a metric dynarec lacks."""
    kinds = metric.msg.names()
    if len(kinds) != 1 or kinds[0] not in _METRICS:
        metric.ctx.refuse(metric.path, f"{kinds} is not supported ({', '.join(_METRICS)} are)")
        metric.taken.update(kinds)
        return None
    kind = kinds[0]
    body = metric.message(kind)
    assert body is not None
    if kind == "auc":
        if body.has("thresholds"):
            body.ctx.note(body.at("thresholds"), "dynarec computes the exact AUC (TorchEasyRec bins scores)")
        body.scalar("thresholds")
    elif kind == "grouped_auc":
        column = grouping_column(str(body.scalar("grouping_key", "")))
        if eval_out.get("grouped_auc_field", column) != column:
            body.ctx.refuse(
                body.at("grouping_key"),
                f"dynarec groups every grouped AUC by one column; {eval_out['grouped_auc_field']!r} is taken already",
            )
        eval_out["grouped_auc_field"] = column
    elif kind == "accuracy":
        body.default_only("threshold", 0.5)
        body.default_only("top_k", 1)
    body.done()
    metric.done()
    return kind


# -- task towers -------------------------------------------------------------------------------

# An MLP block as (hidden_units, dropout ratios); its third argument: whether dynarec's field takes
# dropout (otherwise a ratio above 0 is refused).
_Mlp = Callable[[Optional[Reader], str, bool], tuple[list[int], list[float]]]


def _put(out: dict[str, Any], prefix: str, mlp: tuple[list[int], list[float]]) -> None:
    """``<prefix>hidden_units`` and, when any, ``<prefix>dropout_ratio`` into ``out``."""
    units, dropout = mlp
    out[f"{prefix}hidden_units"] = units
    if dropout:
        out[f"{prefix}dropout_ratio"] = dropout


def _task_tower(
    t: Reader,
    i: int,
    labels: list[str],
    mlp: _Mlp,
    grouping_column: Callable[[str], str],
    eval_out: dict[str, Any],
    bayes: bool,
) -> dict[str, Any]:
    """A TaskTower (a BayesTaskTower with ``bayes``: its label defaults to ``label_fields[i]``,
    relations to earlier towers) as dynarec's task tower."""
    ctx = t.ctx
    out: dict[str, Any] = {"tower_name": str(t.scalar("tower_name", f"task{i}"))}
    label = t.scalar("label_name")
    if label is None and bayes and i < len(labels):
        label = labels[i]
    if label is None:
        ctx.refuse(t.at("label_name"), "a task tower needs its label_name", fatal=True)
    out["label_name"] = str(label or "")
    if (m := t.message("mlp")) is not None:
        _put(out, "", mlp(m, t.at("mlp"), True))
    _task_fields(t, out, grouping_column, eval_out)
    if t.has("task_space_indicator_label"):
        out["task_space_indicator_label"] = str(t.scalar("task_space_indicator_label"))
        for key in ("in_task_space_weight", "out_task_space_weight"):
            out[key] = t.number(key, 1.0)
    else:
        for key in ("in_task_space_weight", "out_task_space_weight"):
            t.default_only(key, 1.0, "without a task_space_indicator_label it does nothing")
    t.refuse("sample_weight_name", why="per-sample weight columns are not supported")
    t.default_only("pareto_min_loss_weight", 0.0, "pareto loss weights are not supported")
    t.ignore("train_metrics", "metrics of the training batches, logged only")
    if bayes:
        relations = [str(x) for x in t.repeated("relation_tower_names")]
        relation_mlp = t.message("relation_mlp")
        if relations and relation_mlp is not None:
            out["relation_tower_names"] = relations
            _put(out, "relation_", mlp(relation_mlp, t.at("relation_mlp"), True))
        elif relations:
            ctx.note(t.at("relation_tower_names"), "ignored without a relation_mlp, as TorchEasyRec ignores them")
        elif relation_mlp is not None:
            ctx.note(t.at("relation_mlp"), "ignored without relation_tower_names, as TorchEasyRec ignores it")
    t.done()
    return out


def _task_fields(t: Reader, out: dict[str, Any], column: Callable[[str], str], eval_out: dict[str, Any]) -> None:
    """What a task tower and a fusion task config share, into ``out``: ``losses`` (binary
    cross-entropy where none is given), ``metrics`` (once each; a grouped AUC's key into
    ``eval_out``), ``num_class`` and ``weight`` where not their defaults."""
    losses = [convert_loss(loss, column) for loss in t.messages("losses")]
    if not losses:
        t.ctx.note(t.at("losses"), "none given: binary_cross_entropy (dynarec's default)")
    out["losses"] = [loss for loss in losses if loss is not None] or [{"binary_cross_entropy": {}}]
    metrics = [convert_metric(metric, column, eval_out) for metric in t.messages("metrics")]
    if kept := [m for m in dict.fromkeys(metrics) if m is not None]:
        out["metrics"] = kept
    if (num_class := t.integer("num_class", 1)) != 1:
        out["num_class"] = num_class
    if (weight := t.number("weight", 1.0)) != 1.0:
        out["weight"] = weight


def _towers(
    m: Reader,
    labels: list[str],
    mlp: _Mlp,
    grouping_column: Callable[[str], str],
    eval_out: dict[str, Any],
    bayes=False,
) -> list[dict[str, Any]]:
    towers = [
        _task_tower(t, i, labels, mlp, grouping_column, eval_out, bayes)
        for i, t in enumerate(m.messages("task_towers"))
    ]
    if not towers:
        m.ctx.refuse(m.at("task_towers"), "at least one task tower is needed", fatal=True)
    return towers


# -- the models ----------------------------------------------------------------------------------

MULTI_TASK = ("simple_multi_task", "mmoe", "ple", "dbmtl", "pepnet")


def convert_multi_task(
    name: str,
    m: Reader,
    labels: list[str],
    mlp: _Mlp,
    mask_net: Callable[[Reader], dict[str, Any]],
    grouping_column: Callable[[str], str],
    eval_out: dict[str, Any],
) -> dict[str, Any]:
    """A multi-task model block (``name`` one of :data:`MULTI_TASK`)."""
    out: dict[str, Any] = {}
    if name == "mmoe":
        _put(out, "expert_", mlp(m.message("expert_mlp"), m.at("expert_mlp"), True))
        if (gate := m.message("gate_mlp")) is not None:
            out["gate_hidden_units"] = mlp(gate, m.at("gate_mlp"), False)[0]
        out["num_expert"] = m.integer("num_expert", 3)
    elif name == "ple":
        out["extraction_networks"] = [_extraction_network(e, mlp) for e in m.messages("extraction_networks")]
        if not out["extraction_networks"]:
            m.ctx.refuse(m.at("extraction_networks"), "at least one extraction network is needed", fatal=True)
    elif name == "dbmtl":
        if (module := m.message("mask_net")) is not None:
            out["mask_net"] = mask_net(module)
        for key, prefix in (("bottom_mlp", "bottom_"), ("expert_mlp", "expert_")):
            if (block := m.message(key)) is not None:
                _put(out, prefix, mlp(block, m.at(key), True))
        if (gate := m.message("gate_mlp")) is not None:
            if "expert_hidden_units" in out:
                out["gate_hidden_units"] = mlp(gate, m.at("gate_mlp"), False)[0]
            else:
                m.ctx.note(m.at("gate_mlp"), "ignored without an expert_mlp, as TorchEasyRec ignores it")
        num_expert = m.integer("num_expert", 3)
        if "expert_hidden_units" in out:
            out["num_expert"] = num_expert
    elif name == "pepnet":  # its groups ('all', 'domain', 'uia') are set by the caller, which sees them
        if m.has("epnet_hidden_unit"):
            out["epnet_hidden_unit"] = m.integer("epnet_hidden_unit", 1)
        out["epnet_gamma"] = m.number("epnet_gamma", 2.0)
        out["ppnet_hidden_units"] = m.integers("ppnet_hidden_units")
        activation = str(m.scalar("ppnet_activation", "nn.ReLU"))
        if activation not in ("nn.ReLU", "Dice"):
            m.ctx.refuse(m.at("ppnet_activation"), f"{activation!r} is not supported (nn.ReLU, Dice are)")
        out["ppnet_activation"] = "dice" if activation == "Dice" else "relu"
        if ratios := [float(x) for x in m.numbers("ppnet_dropout_ratio")]:
            out["ppnet_dropout_ratio"] = ratios
        out["ppnet_gamma"] = m.number("ppnet_gamma", 2.0)
        if m.has("domain_input_name"):
            out["domain_label"] = str(m.scalar("domain_input_name"))
        out["task_domain_num"] = m.integer("task_domain_num", 1)
    out["task_towers"] = _towers(m, labels, mlp, grouping_column, eval_out, bayes=name == "dbmtl")
    m.done()
    return out


def _extraction_network(e: Reader, mlp: _Mlp) -> dict[str, Any]:
    out: dict[str, Any] = {"network_name": str(e.scalar("network_name", ""))}
    out["expert_num_per_task"] = e.integer("expert_num_per_task", 1)
    out["share_num"] = e.integer("share_num", 0)
    _put(out, "task_expert_", mlp(e.message("task_expert_net"), e.at("task_expert_net"), True))
    if out["share_num"] < 1:
        e.ctx.refuse(e.at("share_num"), "PLE needs shared experts (share_num >= 1)", fatal=True)
        out["share_num"] = 1
    _put(out, "share_expert_", mlp(e.message("share_expert_net"), e.at("share_expert_net"), True))
    e.done()
    return out


# -- DlrmHSTU's fusion tower ---------------------------------------------------------------------

# The fusion MLP's activations (TorchEasyRec's MLP ``activation``: "" is none) -> dynarec's.
_FUSION_ACTIVATIONS = {"nn.ReLU": "relu", "nn.SiLU": "silu", "": "none"}


def convert_fusion_mtl_tower(
    f: Reader, column: Callable[[str], str], eval_out: dict[str, Any], model: str = "dlrm_hstu"
) -> dict[str, Any]:
    """``fusion_mtl_tower {mlp, task_configs}`` as dynarec's ``fusion_hidden_units``,
    ``fusion_activation``, ``fusion_layer_norm`` and ``task_towers`` (one a task config).
    ``column``: a feature's column (JRC's session feature, a grouped AUC's key)."""
    ctx = f.ctx
    out: dict[str, Any] = {}
    if (mlp := f.message("mlp")) is not None:
        out["fusion_hidden_units"] = mlp.integers("hidden_units")
        if any(mlp.numbers("dropout_ratio")):
            ctx.refuse(mlp.at("dropout_ratio"), f"dropout is not supported in {model}'s fusion MLP", fatal=True)
        activation = str(mlp.scalar("activation", "nn.ReLU"))
        if activation not in _FUSION_ACTIVATIONS:
            allowed = ", ".join(repr(k) for k in _FUSION_ACTIVATIONS)
            ctx.refuse(mlp.at("activation"), f"{activation!r} is not supported ({allowed} are)", fatal=True)
        elif activation != "nn.ReLU" and out["fusion_hidden_units"]:
            shown = activation or "no activation"
            ctx.note(mlp.at("activation"), f"{shown} on every layer, as TorchEasyRec's")
        out["fusion_activation"] = _FUSION_ACTIVATIONS.get(activation, "relu")
        mlp.default_only("use_bn", False, f"batch normalization is not supported in {model}'s fusion MLP", fatal=True)
        mlp.default_only("bias", True, "linear layers without bias are not supported", fatal=True)
        out["fusion_layer_norm"] = bool(mlp.scalar("use_ln", False))
        mlp.done()
    towers = [_fusion_task(t, i, column, eval_out) for i, t in enumerate(f.messages("task_configs"))]
    if not towers:
        ctx.refuse(f.at("task_configs"), "at least one task is needed", fatal=True)
    out["task_towers"] = towers
    f.done()
    return out


def _fusion_task(t: Reader, i: int, column: Callable[[str], str], eval_out: dict[str, Any]) -> dict[str, Any]:
    """A FusionSubTaskConfig {task_name, label_name, task_bitmask, losses, metrics, num_class,
    weight, train_metrics} as dynarec's task tower (no MLP of its own: the fusion MLP is shared)."""
    ctx = t.ctx
    if not t.has("task_name"):
        ctx.refuse(t.at("task_name"), "a task needs its task_name", fatal=True)
    out: dict[str, Any] = {"tower_name": str(t.scalar("task_name", f"task{i}"))}
    label = t.scalar("label_name")
    if label is None:
        ctx.refuse(t.at("label_name"), "a task needs its label_name", fatal=True)
    out["label_name"] = str(label or "")
    if t.has("task_bitmask"):
        bitmask = t.integer("task_bitmask", 1)
        if bitmask < 1:
            ctx.refuse(t.at("task_bitmask"), f"{bitmask}: a bitmask of no bit makes every label 0", fatal=True)
        else:
            out["task_bitmask"] = bitmask
    _task_fields(t, out, column, eval_out)
    t.ignore("train_metrics", "metrics of the training batches, logged only")
    t.done()
    return out
