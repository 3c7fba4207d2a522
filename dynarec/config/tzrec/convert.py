"""``dynarec import-config``: a TorchEasyRec ``pipeline.config`` as a dynarec YAML config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dynarec.config.textproto import parse
from dynarec.config.tzrec.features import Mode, convert_features
from dynarec.config.tzrec.model import convert_model
from dynarec.config.tzrec.reader import Context, Reader
from dynarec.config.tzrec.train import convert_data_config, convert_train_config, data_source

__all__ = ["ConversionError", "ConversionResult", "convert_pipeline_config"]


class ConversionError(ValueError):
    """Fields the conversion cannot carry; the message lists each one's path."""


@dataclass
class ConversionResult:
    config: dict[str, Any]  # dynarec YAML, as a dict
    notes: list[str] = field(default_factory=list)  # mapped / ignored fields, for the user to read
    dropped: list[str] = field(default_factory=list)  # refused fields dropped under lenient


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
    ctx = Context(lenient)
    top = Reader(parse(text), "", ctx)
    replaced = train_input_path is not None
    train_path = data_source(top.scalar("train_input_path"), train_input_path, "train_input_path", ctx)
    eval_path = data_source(top.scalar("eval_input_path"), eval_input_path, "eval_input_path", ctx)
    if top.has("model_dir"):
        ctx.note("model_dir", f"pass it to dynarec as --model-dir {top.scalar('model_dir')}")
    top.scalar("model_dir")

    data: dict[str, Any] = {"train_input_path": train_path}
    if eval_path:
        data["eval_input_path"] = eval_path
    mode = Mode(encoded=False)
    if (d := top.message("data_config")) is not None:
        mode = convert_data_config(d, data, replaced)
    features = convert_features(top.messages("feature_configs"), mode)

    train: dict[str, Any] = {}
    if (t := top.message("train_config")) is not None:
        convert_train_config(t, train)
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
        model, model_eval = convert_model(m, features, ctx)
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
