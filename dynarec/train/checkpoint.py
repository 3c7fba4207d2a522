"""Checkpoints, written atomically.

A checkpoint is a directory ``checkpoints/ckpt-<step>/`` holding ``state.pt`` (dense model,
dense optimizer, step, data position, config fingerprint) and ``tables.pt`` (every table's dump:
weights, optimizer states, step counter; dynamic tables with keys, scores, slots and admission
counters), plus ``manifest.json`` with each file's size and SHA-256. It is written under a
temporary name, fsynced, and renamed into place; only then does ``checkpoints/latest`` (itself
replaced atomically) point at it. A crash at any moment leaves the previous checkpoint intact and
``latest`` pointing at it. On load, a checkpoint whose files do not match its manifest is
reported as corrupt, naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]

STATE, TABLES, MANIFEST, LATEST = "state.pt", "tables.pt", "manifest.json", "latest"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and why."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Committed checkpoint directories, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("ckpt-") and "." not in p.name)


def save_checkpoint(
    ckpt_dir: Path, step: int, state: dict[str, Any], tables: dict[str, dict[str, torch.Tensor]], keep: int = 3
) -> Path:
    """Writes ``ckpt-<step>`` atomically, points ``latest`` at it, keeps the newest ``keep``."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"ckpt-{step:010d}"
    tmp = ckpt_dir / f".ckpt-{step:010d}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    _write_file(tmp / STATE, state)
    _write_file(tmp / TABLES, tables)
    manifest: dict[str, Any] = {
        name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)} for name in (STATE, TABLES)
    }
    manifest["step"] = step
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync_dir(tmp)
    if final.exists():  # a checkpoint of this step exists (e.g. re-saved at the end): replace it
        old = ckpt_dir / f".ckpt-{step:010d}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(ckpt_dir)
    _atomic_write_text(ckpt_dir / LATEST, final.name + "\n")
    for stale in list_checkpoints(ckpt_dir)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    for leftover in ckpt_dir.glob(".ckpt-*.tmp-*"):  # debris of crashed saves
        if leftover != tmp:
            shutil.rmtree(leftover, ignore_errors=True)
    return final


def latest_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    """The checkpoint ``latest`` names (None when there is none)."""
    ckpt_dir = Path(ckpt_dir)
    pointer = ckpt_dir / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = ckpt_dir / name
    if not name.startswith("ckpt-") or not path.is_dir():
        raise CheckpointError(f"{pointer} names '{name}', which is not a checkpoint directory")
    return path


def load_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """Verifies ``path`` against its manifest and loads ``(state, tables)``."""
    path = Path(path)
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"corrupt checkpoint: {manifest_path} is unreadable ({e})") from None
    loaded = []
    for name in (STATE, TABLES):
        f = path / name
        entry = manifest.get(name)
        if entry is None or not f.is_file():
            raise CheckpointError(f"corrupt checkpoint: {f} is missing")
        size = f.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"corrupt checkpoint: {f} has {size} bytes, its manifest says {entry['bytes']} (truncated?)"
            )
        if _sha256(f) != entry["sha256"]:
            raise CheckpointError(f"corrupt checkpoint: {f} does not match its SHA-256 in {manifest_path}")
        try:
            loaded.append(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:
            raise CheckpointError(f"corrupt checkpoint: {f} cannot be loaded ({e})") from None
    return loaded[0], loaded[1]


class CheckpointManager:
    """The checkpoints of one model directory (``model_dir/checkpoints``): atomic saves that keep
    the newest ``keep``, the latest one, verified loads."""

    def __init__(self, model_dir: Path, keep: int = 3):
        self.dir = Path(model_dir) / "checkpoints"
        self.keep = keep

    def list(self) -> list[Path]:
        return list_checkpoints(self.dir)

    def latest(self) -> Optional[Path]:
        return latest_checkpoint(self.dir)

    def save(self, step: int, state: dict[str, Any], tables: dict[str, dict[str, torch.Tensor]]) -> Path:
        return save_checkpoint(self.dir, step, state, tables, keep=self.keep)

    def load(self, path: Optional[Path] = None) -> tuple[Path, dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
        """``(path, state, tables)`` of ``path`` (default: the latest checkpoint)."""
        path = path or self.latest()
        if path is None:
            raise CheckpointError(f"no checkpoint in {self.dir}")
        state, tables = load_checkpoint(path)
        return path, state, tables
