"""Loading a YAML config into a validated :class:`Config`."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import ValidationError

from dynarec.config.schema import Config

__all__ = ["ConfigError", "config_fingerprint", "config_from_dict", "load_config", "parse_yaml", "without_placement"]


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


def _location(err: Any) -> tuple:
    """A pydantic error's location without pydantic's internal union and function tags."""
    return tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))


def error_path(err: Any) -> str:
    """The config path of one pydantic error (``model.foo``, ``feature_configs[2].id_feature.x``)."""
    return _path(_location(err))


def _format(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        loc = _location(err)
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
    """Validates ``data``; relative data paths (the negative sampler's item table and features'
    ``vocab_file`` too) are resolved against ``base_dir``."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"invalid config {source}: expected a mapping at the top level")
    data = dict(data)
    if base_dir is not None and isinstance(data.get("data"), Mapping):
        d = dict(data["data"])
        resolve = lambda v: os.path.normpath(os.path.join(base_dir, v)) if isinstance(v, str) and "://" not in v else v
        for key in ("train_input_path", "eval_input_path"):
            v = d.get(key)
            d[key] = [resolve(x) for x in v] if isinstance(v, list) else resolve(v)
        sampler = d.get("negative_sampler")
        if isinstance(sampler, Mapping) and "input_path" in sampler:
            sampler = d["negative_sampler"] = {**sampler, "input_path": resolve(sampler["input_path"])}
            hard = sampler.get("hard_negatives")
            if isinstance(hard, Mapping) and "edge_input_path" in hard:
                sampler["hard_negatives"] = {**hard, "edge_input_path": resolve(hard["edge_input_path"])}
        tdm = d.get("tdm_sampler")
        if isinstance(tdm, Mapping):
            d["tdm_sampler"] = {k: resolve(v) if k.endswith("_path") else v for k, v in tdm.items()}
        data["data"] = d
    if base_dir is not None and isinstance(data.get("feature_configs"), list):
        data["feature_configs"] = [_resolve_vocab_file(entry, base_dir) for entry in data["feature_configs"]]
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(e, source)) from None


def _resolve_vocab_file(entry: Any, base_dir: Union[str, Path]) -> Any:
    """A feature entry with its relative ``vocab_file`` made relative to ``base_dir``."""
    if not isinstance(entry, Mapping):
        return entry
    out = dict(entry)
    for kind, body in entry.items():
        if isinstance(body, Mapping) and isinstance(body.get("vocab_file"), str):
            path = body["vocab_file"]
            if "://" not in path and not os.path.isabs(path):
                out[kind] = {**body, "vocab_file": os.path.normpath(os.path.join(base_dir, path))}
    return out


# Longer integers than Python converts by default (sys.int_info.default_max_str_digits).
_MAX_DIGITS = 4300


def _check_nodes(node: yaml.Node, path: str, source: str) -> None:
    """ConfigError naming the field path and line of a key given twice in one mapping (YAML
    would keep the last silently) or of an integer too long to convert."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            here = f"{path}.{key}" if path else str(key)
            line = key_node.start_mark.line + 1
            if key is not None and key in seen:
                raise ConfigError(f"invalid config {source}: {here} is given twice (lines {seen[key]} and {line})")
            if key is not None:
                seen[key] = line
            _check_nodes(value_node, here, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_nodes(item, f"{path}[{i}]", source)
    elif node.tag == "tag:yaml.org,2002:int" and len(node.value) > _MAX_DIGITS:
        raise ConfigError(
            f"invalid config {source}: {path or '<root>'} (line {node.start_mark.line + 1}) is a "
            f"{len(node.value)}-digit number"
        )


def parse_yaml(text: str, source: str) -> Any:
    """The YAML document in ``text`` (``source`` names it in errors), refusing what PyYAML
    would let through silently: a key given twice in one mapping."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(node, "", source)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML in {source}: {e}") from None
    finally:
        loader.dispose()


def load_config(path: Union[str, Path]) -> Config:
    """The validated config in the YAML file ``path``; relative data paths in it are relative
    to the file's directory (and become absolute, so they mean the same from anywhere)."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {path} {what}")
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}: a binary file?)") from None
    if _PIPELINE_CONFIG.search(text):
        raise ConfigError(
            f"{path} is a TorchEasyRec pipeline.config, not a dynarec config: convert it first, "
            f"`dynarec import-config {path} -o config.yaml`"
        )
    data = parse_yaml(text, str(path))
    return config_from_dict(data, source=str(path), base_dir=Path(os.path.abspath(path.parent)))


# A protobuf text message's top-level section of a TorchEasyRec pipeline.config ("data_config {")
_PIPELINE_CONFIG = re.compile(r"^(train_config|eval_config|data_config|feature_configs|model_config)\s*\{", re.M)


def config_sections(config: Config) -> dict[str, Any]:
    """The sections that decide a checkpoint's layout (features and model), as JSON values (a
    checkpoint keeps them, so that a config that cannot resume it is told what differs)."""
    dumped = config.model_dump(mode="json")
    return {section: dumped[section] for section in ("feature_configs", "model")}


def sections_as_today(config: Config, saved: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's :func:`config_sections` (``saved``, written by any dynarec) as this
    dynarec writes them: validated again beside ``config``'s other sections, so that a field
    added to the schema since (absent in the checkpoint's, at its default now) is no difference.
    ``saved`` as it is where it no longer validates (a field removed since differs)."""
    sections = {k: v for k, v in saved.items() if k in ("feature_configs", "model")}
    try:
        again = Config.model_validate({**config.model_dump(mode="json"), **sections})
    except (ValidationError, ValueError, TypeError):
        return dict(saved)
    return {**saved, **config_sections(again)}


# Feature fields that only say where a table's rows live: a checkpoint holds the same rows
# either way, so a run may resume with them changed (a cache made larger or turned off).
PLACEMENT_ONLY = ("cache_load_factor", "sharding")


def without_placement(section: str, value: Any) -> Any:
    """Section ``section`` of :func:`config_sections` without the :data:`PLACEMENT_ONLY` fields."""
    if section != "feature_configs" or not isinstance(value, list):
        return value
    return [
        {
            kind: {k: v for k, v in body.items() if k not in PLACEMENT_ONLY} if isinstance(body, dict) else body
            for kind, body in f.items()
        }
        if isinstance(f, dict)
        else f
        for f in value
    ]


def config_fingerprint(config: Config) -> dict[str, str]:
    """Hashes of :func:`config_sections`: a model directory's checkpoint can only be resumed by
    a config with the same fingerprint."""
    return {
        section: hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]
        for section, value in config_sections(config).items()
    }


def config_differences(saved: Any, current: Any, limit: int = 5) -> list[str]:
    """Where two JSON values (:func:`config_sections`) differ, by config path, the first
    ``limit``: ``"path: <saved> in the checkpoint's, <current> in this one"``."""
    out: list[str] = []

    def shown(value: Any) -> str:
        text = json.dumps(value)
        return text if len(text) <= 60 else text[:57] + "..."

    def walk(a: Any, b: Any, path: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for key in [*a, *(k for k in b if k not in a)]:
                at = f"{path}.{key}" if path else str(key)
                if key not in a or key not in b:
                    there = "absent" if key not in a else shown(a[key])
                    here = "absent" if key not in b else shown(b[key])
                    out.append(f"{at}: {there} in the checkpoint's, {here} in this one")
                else:
                    walk(a[key], b[key], at)
                if len(out) >= limit:
                    return
        elif isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b) and not any(isinstance(v, (dict, list)) for v in (*a, *b)):  # numbers, names
                out.append(f"{path}: {shown(a)} in the checkpoint's, {shown(b)} in this one")
                return
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path}[{i}]")
            if len(a) != len(b) and len(out) < limit:
                out.append(f"{path}: {len(a)} in the checkpoint's, {len(b)} in this one")
        elif a != b:
            out.append(f"{path}: {shown(a)} in the checkpoint's, {shown(b)} in this one")

    walk(saved, current, "")
    return out[:limit]
