"""``train_config``, ``data_config``, ``eval_config``, ``export_config`` and the data sources:
optimizers, learning-rate schedules, checkpoints, batches and how features read columns."""

from __future__ import annotations

import os
from typing import Any, Optional

from dynarec.config.schema import TrainCfg
from dynarec.config.tzrec.features import Mode
from dynarec.config.tzrec.reader import Context, Reader, one_of
from dynarec.config.tzrec.schema_fields import field_values
from dynarec.data.tree import EDGE_TABLE, NODE_TABLE

__all__ = ["convert_data_config", "convert_train_config", "data_source"]

# -- learning rates and optimizers ------------------------------------------------------------------

_LR_FIELDS = (
    "constant_learning_rate",
    "exponential_decay_learning_rate",
    "manual_step_learning_rate",
    "cosine_annealing_learning_rate",
    "cosine_annealing_warm_restarts_learning_rate",
)


def _lr_schedule(r: Reader) -> dict[str, Any]:
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


def _sparse_optimizer(r: Reader) -> tuple[dict[str, Any], dict[str, Any]]:
    found = one_of(r, _SPARSE_OPTIMIZERS)
    schedule = _lr_schedule(r)
    r.done()
    if found is None:
        return {"sgd_optimizer": {"lr": 0.002}}, schedule
    name, o = found
    fields: dict[str, Any] = {"lr": o.number("lr", 0.002)}
    # FBGEMM's clipping (each element of a bag's output gradient, before aggregation), as TorchEasyRec's.
    if o.scalar("gradient_clipping", False):
        fields["gradient_clipping"] = True
        fields["max_gradient"] = o.number("max_gradient", 1.0)
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
        weight_decay = o.number("weight_decay", 0.0)
        mode = str(o.scalar("weight_decay_mode", "NONE"))
        fields["weight_decay_mode"] = _WEIGHT_DECAY_MODES.get(mode, "none")
        if mode not in _WEIGHT_DECAY_MODES:
            r.ctx.refuse(o.at("weight_decay_mode"), f"unknown mode {mode!r}")
        elif fields["weight_decay_mode"] == "none" and weight_decay:
            # FBGEMM (and so TorchEasyRec) applies no decay under WeightDecayMode.NONE.
            r.ctx.note(o.at("weight_decay"), f"{weight_decay} decays nothing under weight_decay_mode NONE: not carried")
            weight_decay = 0.0
        fields["weight_decay"] = weight_decay
    elif name != "sgd_optimizer":
        r.ctx.refuse(r.at(name), "not supported (dynarec's: sgd, adagrad, rowwise_adagrad, adam)", fatal=True)
        o.taken.update(o.msg.names())
    o.done()
    return {name: fields}, schedule


def _dense_optimizer(r: Reader) -> tuple[dict[str, Any], dict[str, Any]]:
    found = one_of(r, _DENSE_OPTIMIZERS)
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
        r.ctx.refuse(r.at(name), "not supported (dynarec's: sgd, adagrad, adam, adamw)", fatal=True)
        o.taken.update(o.msg.names())
    o.done()
    return {name: fields}, schedule


_FG_MODES = {"FG_NONE": True, "FG_NORMAL": False, "FG_DAG": False}


def data_source(
    path: Any, override: Optional[str], field_name: str, ctx: Context, flag: Optional[str] = None, fatal: bool = False
) -> Optional[str]:
    """``path`` as dynarec reads it: ``override`` where given (noted), None where empty; a table
    service refused (``fatal``: --lenient cannot drop it), naming ``flag`` (default the field's
    own: ``--train-input-path``) to give a file instead. Either, where relative, is relative to
    the current directory (TorchEasyRec's) and written relative to the YAML (:func:`_as_written`)."""
    if override is not None:
        written = _as_written(override, ctx)
        as_written = f" (written {written!r}: relative to the YAML)" if written != override else ""
        ctx.note(field_name, f"{path!r} replaced by {override!r}{as_written}" if path else f"{override!r}{as_written}")
        return written
    if not path:
        return None
    if str(path).startswith(("odps://", "kafka://")):
        flag = flag or f"--{field_name.replace('_', '-')}"
        ctx.refuse(
            field_name, f"{path!r} is a table service; dynarec reads Parquet/CSV files: give {flag}", fatal=fatal
        )
        return None
    path = str(path)
    written = _as_written(path, ctx)
    if written != path:
        ctx.note(field_name, f"{path!r} is relative to the current directory (TorchEasyRec's): written {written!r}")
    return written


def _as_written(path: str, ctx: Context) -> str:
    """A local ``path`` relative to the current directory as the YAML in ``ctx.output_dir`` must
    say it: relative to that directory, where dynarec resolves it. Absolute paths, URLs
    (``odps://``) and any path without an output directory stay as they are."""
    if ctx.output_dir is None or "://" in path or os.path.isabs(path):
        return path
    return os.path.relpath(os.path.abspath(path), os.path.abspath(ctx.output_dir))


def _negative_sampler(
    n: Reader, override: Optional[str], edge_override: Optional[str] = None, hard: bool = False
) -> Optional[dict[str, Any]]:
    """negative_sampler (``hard``: hard_negative_sampler, its edge table in ``hard_negatives``)
    -> data.negative_sampler; the item (and edge) tables files: ``override`` / ``edge_override``
    replace a table service or an empty path."""
    key = "item_input_path" if hard else "input_path"
    given = n.scalar(key)
    path = data_source(given, override, n.at(key), n.ctx, "--sampler-input-path", fatal=True)
    if path is None and not given:
        n.ctx.refuse(n.at(key), "an item table is needed: give --sampler-input-path", fatal=True)
    out: dict[str, Any] = {
        "input_path": path or "",
        "num_sample": n.integer("num_sample", 1),
        "attr_fields": [str(x) for x in n.repeated("attr_fields")],
        "item_id_field": str(n.scalar("item_id_field", "")),
        "attr_delimiter": str(n.scalar("attr_delimiter", ":")),
        "num_eval_sample": n.integer("num_eval_sample", 0),
    }
    if n.has("field_delimiter"):
        out["field_delimiter"] = str(n.scalar("field_delimiter"))
    edges = None
    if hard:
        given = n.scalar("hard_neg_edge_input_path")
        where = n.at("hard_neg_edge_input_path")
        edges = data_source(given, edge_override, where, n.ctx, "--hard-negative-edge-path", fatal=True)
        if edges is None and not given:
            n.ctx.refuse(where, "a user -> item edge table is needed: give --hard-negative-edge-path", fatal=True)
        out["hard_negatives"] = {"edge_input_path": edges or "", "user_id_field": str(n.scalar("user_id_field", ""))}
        n.ignore("user_input_path", "the users come from the data's user_id_field; their edges from the edge table")
        if n.has("num_hard_sample"):
            out["hard_negatives"]["num_hard_sample"] = n.integer("num_hard_sample")
            n.ctx.note(
                n.at("num_hard_sample"),
                "a user with more edges gets that many drawn by edge weight (TorchEasyRec's graph-learn 'full' "
                "strategy returns every edge)",
            )
        n.taken.add("num_hard_sample")
    else:
        n.default_only("item_id_delim", ";")
    n.done()
    return out if path and (edges or not hard) else None


def _tdm_sampler(n: Reader, tree_dir: Optional[str]) -> Optional[dict[str, Any]]:
    """tdm_sampler -> data.tdm_sampler; ``tree_dir`` (``dynarec tdm init-tree``'s output)
    replaces the node and edge tables' paths (a table service's, an empty one)."""
    out: dict[str, Any] = {}
    for key, name in (("item_input_path", NODE_TABLE), ("edge_input_path", EDGE_TABLE)):
        given = n.scalar(key)
        override = os.path.join(tree_dir, name) if tree_dir is not None else None
        path = data_source(given, override, n.at(key), n.ctx, "--tree-dir", fatal=True)
        if path is None and not given:
            n.ctx.refuse(
                n.at(key),
                "the tree's tables are needed: give --tree-dir (dynarec tdm init-tree writes them)",
                fatal=True,
            )
        out[key] = path or ""
    n.ignore("predict_edge_input_path", "dynarec's beam search reads the tree from the node and edge tables")
    item_id_field = str(n.scalar("item_id_field", ""))
    attrs = [str(x) for x in n.repeated("attr_fields")]
    # TorchEasyRec puts these two first where they are not; dynarec's attr_fields are the rest
    for first in ("tree_level", item_id_field):
        if attrs[:1] == [first]:
            attrs = attrs[1:]
    out.update(item_id_field=item_id_field, attr_fields=attrs, layer_num_sample=n.integers("layer_num_sample"))
    out["attr_delimiter"] = str(n.scalar("attr_delimiter", ":"))
    if not n.has("attr_delimiter"):
        n.ctx.note(
            n.at("attr_delimiter"),
            "unset: TorchEasyRec's default ':'; its tree tools (and dynarec tdm init-tree) write ',' unless given "
            "--attr-delimiter ':'",
        )
    if n.has("field_delimiter"):
        out["field_delimiter"] = str(n.scalar("field_delimiter"))
    if n.has("remain_ratio"):
        out["remain_ratio"] = n.number("remain_ratio", 1.0)
    if n.has("probability_type"):
        out["probability_type"] = str(n.scalar("probability_type"))
    n.ignore("num_eval_sample", "TorchEasyRec's TDM sampler does not read it (eval rows are sampled as training's)")
    n.done()
    return out if out["item_input_path"] and out["edge_input_path"] else None


def convert_data_config(
    d: Reader,
    data: dict[str, Any],
    replaced: bool,
    sampler_input_path: Optional[str] = None,
    hard_negative_edge_path: Optional[str] = None,
    tree_dir: Optional[str] = None,
) -> Mode:
    ctx = d.ctx
    samples = False  # (negatives: whether or not their config converts)
    for key in ("negative_sampler", "hard_negative_sampler"):
        if (n := d.message(key)) is not None:
            samples = True
            hard = key == "hard_negative_sampler"
            sampler = _negative_sampler(n, sampler_input_path, hard_negative_edge_path, hard)
            if sampler is not None:
                data["negative_sampler"] = sampler
    if (n := d.message("tdm_sampler")) is not None and (tdm := _tdm_sampler(n, tree_dir)) is not None:
        data["tdm_sampler"] = tdm
    data["batch_size"] = d.integer("batch_size", 1024)
    if d.has("eval_batch_size"):
        data["eval_batch_size"] = d.integer("eval_batch_size")
    if d.has("num_workers"):  # else dynarec's automatic count (TorchEasyRec's default, 8, suits few machines)
        data["num_workers"] = d.integer("num_workers")
    labels = [str(x) for x in d.repeated("label_fields")]
    if len(labels) == 1:  # several: a multi-task model's towers name theirs (checked with the model)
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
        ctx.refuse(d.at("fg_mode"), f"{mode_name} is not supported (FG_NONE, FG_NORMAL, FG_DAG are)", fatal=True)
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
    if samples and d.scalar("force_base_data_group", False):
        ctx.note(
            d.at("force_base_data_group"),
            "dynarec's batches hold every feature over all rows, the sampled items' too (their user features empty)",
        )
    else:
        d.default_only("force_base_data_group", False)
    d.refuse(
        "sample_weight_fields",
        "sample_cost_field",
        "batch_cost_size",
        "input_fields_str",
    )
    # A retrieval model's negatives: without them it has nothing to train against.
    d.refuse(
        "negative_sampler_v2",
        "hard_negative_sampler_v2",
        why="not supported (dynarec's negative_sampler draws items by weight, hard_negative_sampler's edges too)",
        fatal=True,
    )
    d.done()
    return Mode(encoded=encoded, multival_sep=multival_sep)


def convert_train_config(t: Reader, train: dict[str, Any]) -> None:
    ctx = t.ctx
    if (s := t.message("sparse_optimizer")) is not None:
        train["sparse_optimizer"], train["sparse_lr_schedule"] = _sparse_optimizer(s)
    else:
        ctx.refuse(t.at("sparse_optimizer"), "a sparse optimizer is needed", fatal=True)
    if (dn := t.message("dense_optimizer")) is not None:
        train["dense_optimizer"], train["dense_lr_schedule"] = _dense_optimizer(dn)
    steps, epochs = t.integer("num_steps"), t.integer("num_epochs")
    if steps:
        train["num_steps"] = steps
    if epochs:
        train["num_epochs"] = epochs
    _checkpoints(t, train)
    train["log_step_count_steps"] = t.integer("log_step_count_steps", 100)
    keep = t.integer("keep_checkpoint_max", 0)
    train["keep_checkpoints"] = keep if keep > 0 else 1_000_000
    t.ignore("use_tensorboard", "dynarec always writes TensorBoard logs")
    t.ignore("tensorboard_summaries", "dynarec logs loss, learning rates and metrics")
    t.default_only("is_profiling", False)
    t.default_only("cudnn_allow_tf32", True)
    t.default_only("cuda_matmul_allow_tf32", False)
    _precision(t, train)
    gas = t.integer("gradient_accumulation_steps", 0)
    if gas > 1:
        if "gradient_accumulation_steps" in TrainCfg.model_fields:
            train["gradient_accumulation_steps"] = gas
            ctx.note(
                t.at("gradient_accumulation_steps"),
                f"the dense optimizer steps every {gas} steps on their summed gradients; the tables' fused updates "
                "run every step (as TorchEasyRec's fused sparse optimizers)",
            )
        else:
            ctx.refuse(t.at("gradient_accumulation_steps"), "dynarec has no gradient accumulation (train schema)")
    if (g := t.message("grad_clipping")) is not None:
        _grad_clipping(g, train)
    t.ignore("global_embedding_constraints", "sharding constraints; dynarec's planner shards tables")
    t.refuse(
        "fine_tune_checkpoint",
        "fine_tune_ckpt_param_map",
        "save_checkpoints_timestamp_interval",
        "save_checkpoints_timestamps",
        "save_checkpoints_timestamp_quorum",
        "delta_embedding_dump_config",
    )
    t.done()


def _checkpoints(t: Reader, train: dict[str, Any]) -> None:
    """``save_checkpoints_steps`` / ``save_checkpoints_epochs``: TorchEasyRec saves by epochs
    when ``save_checkpoints_epochs > 0`` (its steps are then ignored), else every
    ``save_checkpoints_steps`` (0: no periodic saves), and evaluates after each save
    (tzrec/main.py:380-384)."""
    ctx = t.ctx
    steps = t.integer("save_checkpoints_steps", 1000)
    epochs = t.integer("save_checkpoints_epochs", 0)
    if epochs > 0:
        if "save_checkpoints_epochs" not in TrainCfg.model_fields:
            ctx.refuse(t.at("save_checkpoints_epochs"), "dynarec has no per-epoch checkpoints (train schema)")
            return
        train["save_checkpoints_epochs"] = epochs
        ctx.note(
            t.at("save_checkpoints_epochs"),
            f"a checkpoint every {epochs} epoch(s), none by steps (TorchEasyRec's rule); dynarec evaluates at the "
            "end of training, TorchEasyRec after every checkpoint",
        )
        if t.has("save_checkpoints_steps"):
            ctx.note(t.at("save_checkpoints_steps"), "ignored: save_checkpoints_epochs is set (TorchEasyRec's rule)")
    elif steps > 0:
        train["save_checkpoints_steps"] = steps
        train["eval_every_steps"] = steps  # TorchEasyRec evaluates after every checkpoint
        ctx.note(
            t.at("save_checkpoints_steps"), f"every {steps} steps, with an evaluation after each (TorchEasyRec's rule)"
        )
    else:
        ctx.note(
            t.at("save_checkpoints_steps"),
            "0: no periodic checkpoints or evaluations; one checkpoint and evaluation at the end of training",
        )


_PRECISIONS = {"BF16": "bf16", "FP16": "fp16"}


def _precision(t: Reader, train: dict[str, Any]) -> None:
    """``mixed_precision`` (the dense model's autocast dtype) and ``grad_scaler`` (FP16's loss
    scaling)."""
    ctx = t.ctx
    value = str(t.scalar("mixed_precision", "")).upper()
    if value:
        mapped = _PRECISIONS.get(value)
        if mapped is None:
            ctx.refuse(t.at("mixed_precision"), f"{value!r} is not a mixed precision TorchEasyRec takes (BF16, FP16)")
        elif mapped not in field_values(TrainCfg, "mixed_precision"):
            offered = sorted(str(v) for v in field_values(TrainCfg, "mixed_precision"))
            ctx.refuse(
                t.at("mixed_precision"),
                f"{value}: dynarec's train.mixed_precision takes {offered or 'nothing'}",
            )
        else:
            train["mixed_precision"] = mapped
            ctx.note(
                t.at("mixed_precision"),
                f"the dense model's forward in {value} (autocast); the tables' rows keep their own data_type (FP32 "
                "unless a feature sets FP16 or BF16)",
            )
    if t.has("grad_scaler"):
        gs = t.message("grad_scaler")
        assert gs is not None
        scaler: dict[str, Any] = {}
        for key in ("init_scale", "growth_factor", "backoff_factor"):
            if gs.has(key):
                scaler[key] = gs.number(key)
        if gs.has("growth_interval"):
            scaler["growth_interval"] = gs.integer("growth_interval")
        gs.done()
        if train.get("mixed_precision") != "fp16":
            ctx.note(t.at("grad_scaler"), "ignored: loss scaling is for mixed_precision FP16")
            t.taken.add("grad_scaler")
            return
        train["grad_scaler"] = scaler
        ctx.note(
            t.at("grad_scaler"),
            "dynamic loss scaling whose skipped steps skip the tables' updates too, and whose tables see unscaled "
            "gradients (TorchEasyRec's fused table updates take the scaled ones); docs/optimizers.md",
        )
    t.taken.add("grad_scaler")


def _grad_clipping(g: Reader, train: dict[str, Any]) -> None:
    """``grad_clipping``: TorchEasyRec clips the dense parameters' gradients (its sparse ones
    are applied inside backward, before any clipping)."""
    ctx = g.ctx
    kind = str(g.scalar("clipping_type", "none")).lower()
    max_gradient = g.number("max_gradient", 1.0)
    norm_type = g.number("norm_type", 2.0)
    if g.scalar("enable_global_grad_clip", False):
        ctx.note(g.at("enable_global_grad_clip"), "dynarec's dense gradients are all-reduced: the norm is global")
    g.done()
    if kind == "none":
        return
    if kind != "norm":
        ctx.refuse(g.at("clipping_type"), f"{kind!r} is not supported (norm, none are)")
    elif "gradient_clipping" not in TrainCfg.model_fields:
        ctx.refuse(g.path, "dynarec has no gradient clipping (train schema)")
    else:
        train["gradient_clipping"] = {"max_norm": max_gradient, "norm_type": norm_type}
        ctx.note(g.path, f"the dense parameters' gradient {norm_type:g}-norm clipped to {max_gradient:g}")
