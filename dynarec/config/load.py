"""Loading a YAML config into a validated :class:`Config`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import ValidationError

from dynarec.config.schema import Config

__all__ = ["ConfigError", "config_fingerprint", "config_from_dict", "load_config"]


class ConfigError(ValueError):
    """An invalid config; the message names the file and each offending field path."""


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


def _format(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        # Drop pydantic's internal union/function tags from the location.
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            msg = f"unknown key '{loc[-1]}'"
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif "input" in err and err["type"] not in ("value_error", "assertion_error"):
            msg = f"{msg} (got {err['input']!r})"
        lines.append(f"  {_path(loc)}: {msg}")
    return f"invalid config {source}:\n" + "\n".join(lines)


def config_from_dict(
    data: Mapping[str, Any], source: str = "<dict>", base_dir: Union[str, Path, None] = None
) -> Config:
    """Validates ``data``; relative data paths are resolved against ``base_dir``."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"invalid config {source}: expected a mapping at the top level")
    data = dict(data)
    if base_dir is not None and isinstance(data.get("data"), Mapping):
        d = dict(data["data"])
        for key in ("train_input_path", "eval_input_path"):
            v = d.get(key)
            if isinstance(v, str):
                d[key] = str(Path(base_dir) / v) if not Path(v).is_absolute() else v
            elif isinstance(v, list):
                d[key] = [str(Path(base_dir) / x) if isinstance(x, str) and not Path(x).is_absolute() else x for x in v]
        data["data"] = d
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(e, source)) from None


def load_config(path: Union[str, Path]) -> Config:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in {path}: {e}") from None
    return config_from_dict(data, source=str(path), base_dir=path.parent)


def config_fingerprint(config: Config) -> dict[str, str]:
    """Hashes of the sections that decide a checkpoint's layout (features and model): a model
    directory's checkpoint can only be resumed by a config with the same fingerprint."""
    out = {}
    for section in ("feature_configs", "model"):
        blob = json.dumps(config.model_dump(mode="json")[section], sort_keys=True)
        out[section] = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return out
