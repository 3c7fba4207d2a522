"""Checkpoints, written atomically.

A checkpoint is a directory ``checkpoints/ckpt-<step>/`` holding ``state.pt`` (dense model,
dense optimizer, step, data position, config fingerprint, the plan) and ``tables.pt`` (every
table's dump: weights, optimizer states, step counter; dynamic tables with keys, scores, slots
and admission counters) — or, written by N ranks, ``tables-rank<r>.pt`` per rank — plus
``manifest.json`` with each file's size and SHA-256, written last: a checkpoint
without its manifest is incomplete and never used. It is written under a temporary name,
fsynced, and renamed into place; only then does ``checkpoints/latest`` (itself replaced
atomically) point at it. A crash at any moment — a kill, a full disk — leaves the previous
checkpoint intact and ``latest`` pointing at it. On load, a checkpoint whose files do not match
its manifest is reported as corrupt, naming the file. When ``latest`` is missing or names no
checkpoint, the newest complete checkpoint (by its manifest) is used.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from dynarec.distributed.context import DistContext, StepFailedError
from dynarec.files import (
    atomic_write_text,
    describe_os_error,
    file_manifest,
    fsync_dir,
    read_json,
    swap_in,
    verify_manifest,
    write_error,
)

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
    """A checkpoint cannot be used (or written); the message names the file and why."""


def _write_file(path: Path, obj: Any) -> None:
    # torch.save is given the path, not an open file: with a Python file it writes through a
    # Python callback, and a Ctrl-C landing in one comes out as a RuntimeError of the zip
    # writer ("unexpected pos"), not as KeyboardInterrupt. Given the path it writes in C++, and
    # the interrupt is raised once it returns.
    try:
        torch.save(obj, str(path))
    except RuntimeError as e:  # the zip writer's failed write (a full disk) names no errno
        raise write_error(path, str(e).splitlines()[0]) from None
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoint directories (with a manifest), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(
        p
        for p in ckpt_dir.iterdir()
        if p.is_dir() and p.name.startswith("ckpt-") and "." not in p.name and (p / MANIFEST).is_file()
    )


def save_checkpoint(
    ckpt_dir: Path,
    step: int,
    state: dict[str, Any],
    tables: dict[str, dict[str, torch.Tensor]],
    keep: int = 3,
    ctx: Optional[DistContext] = None,
) -> Path:
    """Writes ``ckpt-<step>`` atomically, points ``latest`` at it, keeps the newest ``keep``.

    In a multi-process run every rank calls it with its own ``tables`` (rank 0 also with
    ``state``): each rank writes ``tables-rank<r>.pt``; once every rank's files are fsynced
    (a barrier), rank 0 writes the manifest and commits. A rank that dies on the way leaves the
    checkpoint uncommitted and the previous one ``latest``."""
    ckpt_dir = Path(ckpt_dir)
    world = ctx.world_size if ctx is not None else 1
    main = ctx is None or ctx.is_main
    final = ckpt_dir / f"ckpt-{step:010d}"
    # Every rank of a multi-process run writes into one temporary directory: a name they agree on.
    tmp = ckpt_dir / (f".ckpt-{step:010d}.tmp" + ("" if world > 1 else f"-{os.getpid()}"))
    table_file = TABLES if ctx is None or world == 1 else f"tables-rank{ctx.rank}.pt"
    error: Optional[BaseException] = None
    try:
        if main:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
    except OSError as e:
        error = e
    _agree(ctx, error, f"creating checkpoint {final}", tmp)
    try:
        _write_file(tmp / table_file, tables)
        if main:
            _write_file(tmp / STATE, state)
    except OSError as e:
        error = e
    _agree(ctx, error, f"writing the files of checkpoint {final}", tmp)
    try:
        if main:
            files = [STATE, TABLES] if world == 1 else [STATE, *(f"tables-rank{r}.pt" for r in range(world))]
            manifest: dict[str, Any] = {"files": file_manifest(tmp, files), "step": step, "world_size": world}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            fsync_dir(tmp)
            if final.exists():  # a checkpoint of this step exists (re-saved at another world size): replace it
                swap_in(tmp, final, ckpt_dir / f".ckpt-{step:010d}.old-{os.getpid()}")
            else:
                os.replace(tmp, final)
            fsync_dir(ckpt_dir)
            atomic_write_text(ckpt_dir / LATEST, final.name + "\n")
    except OSError as e:
        error = e
    _agree(ctx, error, f"committing checkpoint {final}", tmp)
    if main:
        # A rotated checkpoint leaves its name before it is deleted: a kill mid-delete leaves a
        # hidden `.old` directory the next save removes, never a `ckpt-*` without its manifest
        # that no listing would find again (such debris of earlier versions goes too).
        debris = [*ckpt_dir.glob(".ckpt-*.tmp*"), *ckpt_dir.glob(".ckpt-*.old*")]  # of crashed saves and deletes
        debris += [p for p in ckpt_dir.glob("ckpt-*") if p.is_dir() and not (p / MANIFEST).is_file()]
        for leftover in debris:
            shutil.rmtree(leftover, ignore_errors=True)
        for pointer in ckpt_dir.glob(f".{LATEST}.tmp-*"):  # a kill between writing `latest` and its rename
            pointer.unlink(missing_ok=True)
        for stale in list_checkpoints(ckpt_dir)[:-keep]:
            old = ckpt_dir / f".{stale.name}.old-{os.getpid()}"
            try:  # committed already: a rotation that fails leaves debris for the next save, no error
                os.replace(stale, old)
            except OSError:
                old = stale
            shutil.rmtree(old, ignore_errors=True)
    return final


def _agree(ctx: Optional[DistContext], error: Optional[BaseException], what: str, tmp: Path) -> None:
    """Every rank learns whether ``what`` failed anywhere. A failure removes the unfinished
    ``tmp`` and is a CheckpointError (a full disk named as such) saying that the previous
    checkpoint stays in use."""
    if error is None and (ctx is None or not ctx.distributed):
        return
    try:
        if ctx is not None:
            ctx.agree(error, what)
        elif error is not None:
            raise error
    except (OSError, StepFailedError) as e:
        if ctx is None or ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        reason = describe_os_error(e) if isinstance(e, OSError) else str(e)
        previous = latest_checkpoint(tmp.parent)
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointError(f"{what} failed: {reason}; {kept}") from None


def latest_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    """The checkpoint ``latest`` names; where ``latest`` is missing or names no complete
    checkpoint, the newest complete one (with a warning); None when there is none."""
    ckpt_dir = Path(ckpt_dir)
    complete = list_checkpoints(ckpt_dir)
    pointer = ckpt_dir / LATEST
    name = ""
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        pass
    if name.startswith("ckpt-") and "/" not in name and (ckpt_dir / name / MANIFEST).is_file():
        return ckpt_dir / name
    if complete and (pointer.exists() or ckpt_dir.is_dir()):
        problem = f"names '{name[:40]}', which is not a complete checkpoint" if pointer.exists() else "is missing"
        warnings.warn(
            f"{pointer} {problem}; using the newest complete checkpoint {complete[-1].name} (by its manifest)",
            stacklevel=2,
        )
        return complete[-1]
    return None


def load_checkpoint(path: Path) -> tuple[dict[str, Any], list[dict[str, dict[str, torch.Tensor]]]]:
    """Verifies ``path`` against its manifest and loads ``(state, shards)``: ``shards[r]`` holds
    the tables rank ``r`` wrote (one entry for a single-process checkpoint)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory (it does not exist or is a file)")
    manifest_path = path / MANIFEST
    manifest = read_json(manifest_path, lambda m: CheckpointError(f"corrupt checkpoint: {m}"))
    files = manifest.get("files") if isinstance(manifest, dict) else None
    world = manifest.get("world_size", 1) if isinstance(manifest, dict) else 1
    expected = {STATE, TABLES} if world == 1 else {STATE, *(f"tables-rank{r}.pt" for r in range(world))}
    if not isinstance(files, dict):
        raise CheckpointError(f"corrupt checkpoint: {manifest_path} does not list {', '.join(sorted(expected))}")
    if set(files) != expected:
        missing, extra = sorted(expected - set(files)), sorted(set(files) - expected)
        wrong = [f"does not list {', '.join(missing)}"] if missing else []
        wrong += [f"lists {', '.join(extra)}, which a checkpoint of {world} rank(s) does not hold"] if extra else []
        raise CheckpointError(f"corrupt checkpoint: {manifest_path} {' and '.join(wrong)}")
    verify_manifest(path, files, manifest_path, lambda m: CheckpointError(f"corrupt checkpoint: {m}"))
    names = [STATE, TABLES] if world == 1 else [STATE, *(f"tables-rank{r}.pt" for r in range(world))]
    loaded = []
    for name in names:
        f = path / name
        try:
            loaded.append(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:
            raise CheckpointError(f"corrupt checkpoint: {f} cannot be loaded ({e})") from None
    return loaded[0], loaded[1:]


def _earlier(ckpt_dir: Path, latest: Path) -> str:
    """What to say of the complete checkpoints before a corrupt ``latest``: the newest of them,
    and how to use it (its files are not verified here: that reads them whole)."""
    earlier = [p for p in list_checkpoints(ckpt_dir) if p.name < latest.name]
    if not earlier:
        return ""
    return (
        f"; the earlier checkpoint {earlier[-1].name} is listed as complete: to go on from it, write its name "
        f"into {ckpt_dir / LATEST}"
    )


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

    def save(
        self,
        step: int,
        state: dict[str, Any],
        tables: dict[str, dict[str, torch.Tensor]],
        ctx: Optional[DistContext] = None,
    ) -> Path:
        return save_checkpoint(self.dir, step, state, tables, keep=self.keep, ctx=ctx)

    def load(self, path: Optional[Path] = None):
        """``(path, state, shards)`` of ``path`` (default: the latest checkpoint).

        The latest checkpoint may be rotated away by a training run while it is read (an
        export beside a run): a read that fails because ``latest`` moved on meanwhile is
        retried on the new latest checkpoint, with a warning saying so; a checkpoint that fails
        while still the latest is corrupt."""
        if path is not None:
            return (path, *load_checkpoint(path))
        for _ in range(5):
            latest = self.latest()
            if latest is None:
                raise CheckpointError(f"no complete checkpoint in {self.dir}")
            try:
                return (latest, *load_checkpoint(latest))
            except (CheckpointError, OSError) as e:  # files vanishing mid-read raise either
                now = self.latest()
                if now == latest:
                    raise CheckpointError(f"{e}{_earlier(self.dir, latest)}") from None
                warnings.warn(
                    f"{latest} was removed while being read (a training run rotated its checkpoints); "
                    f"reading the newer {now}",
                    stacklevel=2,
                )
        raise CheckpointError(f"{self.dir}: the latest checkpoint was replaced five times while being read; retry")
