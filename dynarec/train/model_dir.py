"""The config record of a model directory: ``model_dir/config.yaml``.

``dynarec train`` records the config it trains with, so that ``evaluate``, ``export`` and
``--resume`` find it by the model directory alone. The record is written like a checkpoint
(temporary file, fsync, rename) and only when it changes; it starts with :data:`HEADER`, which
tells dynarec's record from a file the user put there. A user's file is never written over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml

from dynarec.config.load import ConfigError, load_config
from dynarec.config.schema import Config
from dynarec.files import atomic_write_text

__all__ = ["CONFIG", "HEADER", "check_not_another_kind", "config_record", "write_config_record"]

CONFIG = "config.yaml"
HEADER = "# Written by dynarec train: the config this model directory is trained with.\n"


# Directories dynarec writes whole and replaces whole (export, make-data): a model directory
# inside one would be deleted by the next export or make-data to it.
EXPORT_KIND = "an export (dynarec export)"
_OTHER_KINDS = {
    ("export.json", "dense.pt2"): EXPORT_KIND,
    ("meta.json", "train"): "a data directory (dynarec make-data)",
}


def other_kind(directory: Path) -> Optional[tuple[str, str]]:
    """``(kind, marker)`` where ``directory`` is a directory dynarec writes and replaces whole, not
    a model directory (an export: ``export.json`` and ``dense.pt2``; a generated data directory:
    ``meta.json`` and ``train/``); None otherwise."""
    for (marker, beside), kind in _OTHER_KINDS.items():
        if (Path(directory) / marker).is_file() and (Path(directory) / beside).exists():
            return kind, marker
    return None


def check_not_another_kind(model_dir: Path) -> None:
    """FileExistsError where ``model_dir`` is :func:`other_kind`: checkpoints there would go with
    its next rewrite."""
    other = other_kind(model_dir)
    if other is not None:
        kind, marker = other
        raise FileExistsError(
            f"{model_dir} is {kind} ({marker}): its next rewrite would delete a model's checkpoints; "
            "choose another model_dir"
        )


def config_record(model_dir: Path, config: Config) -> Optional[str]:
    """The text :func:`write_config_record` must write to record ``config`` in ``model_dir``, or
    None when the record is already there (or ``config.yaml`` is the user's own file describing
    ``config``: the same settings, data paths resolved). Writes nothing.

    Raises ConfigError when ``config.yaml`` is a file dynarec did not write (no :data:`HEADER`:
    the user's own, often the very ``--config`` of this run) that describes another config:
    dynarec does not write over it."""
    path = Path(model_dir) / CONFIG
    text = HEADER + yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
    try:
        existing: Optional[str] = path.read_text()
    except FileNotFoundError:
        existing = None
    except (OSError, UnicodeDecodeError):
        existing = ""  # unreadable: not dynarec's record
    if existing == text:
        return None
    if existing is None or existing.startswith(HEADER):
        return text
    try:
        same = load_config(path).model_dump(mode="json") == config.model_dump(mode="json")
    except ConfigError:
        same = False
    if not same:
        raise ConfigError(
            f"{path} is not dynarec's record of this model directory (the user's own file?) and differs from "
            "the config being trained; dynarec does not write over it: move it away, or train with "
            f"--config {path}"
        )
    return None


def write_config_record(model_dir: Path, text: str) -> None:
    """Writes :func:`config_record`'s ``text`` as ``model_dir/config.yaml``, atomically (a
    crash or a full disk never leaves it cut short)."""
    atomic_write_text(Path(model_dir) / CONFIG, text)
