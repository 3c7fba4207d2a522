"""Files written so that a crash never breaks what was there, and nothing a user made is lost.

- :func:`atomic_write_text` and :func:`fsync_dir`: a file is replaced whole or not at all.
- :func:`file_manifest` / :func:`verify_manifest`: each file's size and SHA-256, checked on load;
  a mismatch names the file.
- :func:`replace_dir`: a directory written under a temporary sibling name is renamed into
  place; an existing target is replaced only if it is dynarec's own (the caller says how to tell),
  never a user's directory.
- :class:`DirectoryLock`: one writer per directory, held with an OS file lock that the kernel
  releases when the process dies (no stale lock after SIGKILL).
- :func:`scratch_directory` / :func:`remove_scratch`: a process's own temporary directory, locked
  while it lives, so that one left by a killed process is removed by the next.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "DirectoryBusyError",
    "DirectoryLock",
    "atomic_path",
    "atomic_write_text",
    "check_replaceable",
    "describe_os_error",
    "file_manifest",
    "fsync_dir",
    "read_json",
    "remove_scratch",
    "replace_dir",
    "scratch_directory",
    "sha256",
    "swap_in",
    "verify_manifest",
    "write_bytes",
    "write_error",
]


_REASONS = {
    errno.ENOSPC: "no space left on the device (the disk is full)",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EFBIG: "the file size limit is reached (ulimit -f)",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.EISDIR: "it is a directory",
}


def describe_os_error(e: OSError) -> str:
    """``"<path>: <reason>"`` of an OSError, in words (the disk is full, read-only, ...)."""
    reason = _REASONS.get(e.errno or -1) or e.strerror or str(e)
    where = e.filename if e.filename is not None else None
    if e.filename2 is not None:
        where = f"{e.filename} -> {e.filename2}"
    return f"{where}: {reason}" if where is not None else reason


def write_error(path: Path, detail: str) -> OSError:
    """The OSError of a write of ``path`` that failed inside a library that reports no errno
    (torch's zip writer says "unexpected pos"): EFBIG when the file reached the process's file
    size limit, ENOSPC when its file system has (almost) no room left, else EIO with ``detail``."""
    import resource

    size = path.stat().st_size if path.exists() else 0
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and size + (1 << 16) >= limit:
        return OSError(errno.EFBIG, os.strerror(errno.EFBIG), str(path))
    try:
        full = shutil.disk_usage(path.parent).free < (1 << 20)
    except OSError:
        full = False
    if full:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return OSError(errno.EIO, f"the write failed ({detail})", str(path))


def write_bytes(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` and fsyncs it (an OSError if it cannot; a partial file is
    removed)."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsyncs every file and directory under ``root`` (and ``root``)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write; once the block ends without an error it is
    fsynced and renamed to ``path`` (replaced whole or not at all). On an error the temporary
    file is removed and ``path`` is untouched. An OSError names ``path`` (not the temporary
    file the user never gave)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename in (str(tmp), tmp) or e.filename2 in (str(path), path):
            reason = "it is a directory" if path.is_dir() else (_REASONS.get(e.errno or -1) or e.strerror or str(e))
            raise OSError(e.errno, reason, str(path)) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Replaces ``path`` by ``text`` atomically (a temporary sibling, fsync, rename)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def file_manifest(root: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": size, "sha256": hex}}`` of files under ``root``."""
    return {name: {"bytes": (root / name).stat().st_size, "sha256": sha256(root / name)} for name in names}


def verify_manifest(root: Path, manifest: Any, where: Path, error: Callable[[str], Exception]) -> None:
    """Checks every file a manifest lists (present, size, SHA-256); raises ``error(message)``
    naming the first file that does not match (``where`` is the manifest's own file)."""
    if not isinstance(manifest, dict) or not all(isinstance(v, dict) for v in manifest.values()):
        raise error(f"{where}: its file list is malformed")
    for name, entry in manifest.items():
        f = root / name
        if not f.is_file():
            raise error(f"{f} is missing (listed in {where})")
        size = f.stat().st_size
        if size != entry.get("bytes"):
            raise error(f"{f} has {size} bytes, {where} says {entry.get('bytes')} (truncated or overwritten?)")
        if sha256(f) != entry.get("sha256"):
            raise error(f"{f} does not match its SHA-256 in {where} (corrupt)")


def json_text(value: Any, indent: Optional[int] = 1) -> str:
    """``value`` as strict JSON: a number that is not finite (a metric undefined on the data: a
    grouped AUC whose every group holds one class) written as null, as JSON has no NaN (Python
    writes one, which other readers refuse)."""

    def strict(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: strict(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [strict(x) for x in v]
        return v

    return json.dumps(strict(value), indent=indent, allow_nan=False)


def read_json(path: Path, error: Callable[[str], Exception]) -> Any:
    """The JSON in ``path``; ``error(message)`` naming the file if it is missing or malformed."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path} is unreadable or not valid JSON ({e})") from None


def relative_files(directory: Path) -> list[str]:
    """Every file under ``directory``, as sorted POSIX paths relative to it."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def replace_dir(tmp: Path, target: Path, marker: str, what: str) -> None:
    """Moves the finished directory ``tmp`` to ``target``.

    An existing ``target`` is replaced only when :func:`check_replaceable` allows it (with the
    kinds of files ``tmp`` holds); else its FileExistsError is raised and ``tmp`` removed. The
    old directory is renamed aside before the new one takes its name, then deleted.
    """
    try:
        check_replaceable(target, marker, what, like=tmp)
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        swap_in(tmp, target, target.with_name(f".{target.name}.old-{socket.gethostname()}-{os.getpid()}"))
    else:
        os.replace(tmp, target)
        fsync_dir(target.parent)


# renameat2(2): its "current directory" file descriptor, and its flag that swaps two paths.
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swaps the paths ``a`` and ``b`` in one atomic step (Linux's ``renameat2`` with
    ``RENAME_EXCHANGE``); False where the C library or the file system has no such rename."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_in(tmp: Path, target: Path, aside: Path) -> None:
    """Puts the finished directory ``tmp`` in the place of the existing directory ``target``
    and deletes the old one. Where the file system can, the two are swapped in one atomic step:
    ``target`` names a complete directory at every instant, and a kill before the deletion ends
    leaves the old one under ``tmp``'s name. Elsewhere the old one is renamed to ``aside`` first
    (a kill between the two renames leaves no ``target``, the old one at ``aside``)."""
    if _exchange(tmp, target):
        fsync_dir(target.parent)
        shutil.rmtree(tmp)
        return
    os.replace(target, aside)
    os.replace(tmp, target)
    fsync_dir(target.parent)
    shutil.rmtree(aside)


def check_replaceable(target: Path, marker: str, what: str, like: Optional[Path] = None) -> None:
    """FileExistsError naming ``target`` unless it is absent, empty or a ``what`` dynarec wrote:
    a directory holding ``marker`` and no file dynarec would not write there
    (:func:`foreign_files`: the files its marker lists, an export's manifest or a data
    directory's ``meta.json``, else files of the kinds ``like`` holds: ``train/part-7.parquet``
    as ``train/part-0.parquet``). So a model directory (its checkpoints) or a user's file put in
    a data directory is never deleted by a rewrite."""
    if not target.exists():
        return
    if not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory; choose another {what} path")
    if not any(target.iterdir()):
        return
    foreign = foreign_files(target, marker, like)
    if foreign:
        held = f"no {marker}" if not (target / marker).is_file() else f"it holds {foreign}"
        raise FileExistsError(
            f"{target} is a non-empty directory that is not a dynarec {what} ({held}); dynarec replaces only "
            f"{'an' if what[0] in 'aeiou' else 'a'} {what} it wrote itself: choose an empty or new directory"
        )


def foreign_files(target: Path, marker: str, like: Optional[Path] = None) -> list[str]:
    """Up to 3 files under ``target`` (relative paths) that a rewrite of it must not delete (the
    marker's name where it is missing): those its JSON ``marker`` does not list under ``files``
    (a list, or a dict keyed by path); where it lists none (written before it did), those of no
    kind ``like`` holds (the same folder, the name with its numbers as any), or none without
    ``like``."""
    if not (target / marker).is_file():
        return [f"no {marker}"]
    try:
        names = json.loads((target / marker).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        names = None
    if isinstance(names, (list, dict)):
        foreign = [f for f in relative_files(target) if f not in {*names, marker}]
    elif like is not None:

        def kind(relative: str) -> str:
            return re.sub(r"\d+", "#", relative)

        ours = {kind(f) for f in relative_files(like)}
        foreign = [f for f in relative_files(target) if kind(f) not in ours]
    else:
        foreign = []
    return foreign[:3]


class DirectoryBusyError(RuntimeError):
    """Another process holds a directory's lock; the message names its PID and host."""


# The descriptors of the directory locks this process holds. A forked child (a DataLoader worker)
# closes its copies at once: a flock belongs to the open file, so a child keeping a copy kept a
# killed run's model directory locked until the child noticed and exited (seconds).
_HELD_LOCKS: set[int] = set()


def _close_held_locks_in_child() -> None:
    for fd in _HELD_LOCKS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_close_held_locks_in_child)


class DirectoryLock:
    """An exclusive ``flock`` on ``directory/.lock``, naming its holder (PID, host) in the file.

    The kernel releases it when the holding process dies, so a SIGKILLed run leaves no stale
    lock. :meth:`release` unlocks; if the lock created the directory and nothing else was written
    there (a run refused before writing anything), it removes both.
    """

    NAME = ".lock"

    def __init__(self, directory: Path, what: str = "model directory"):
        self.directory = Path(directory)
        self.what = what
        self._fd: Optional[int] = None
        self._created_dir = False

    def acquire(self) -> DirectoryLock:
        self._created_dir = not self.directory.exists()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / self.NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = path.read_text().strip() or "another process"
            raise DirectoryBusyError(
                f"{self.what} {self.directory} is in use by {holder} (lock {path}); wait for it to finish, "
                f"or use another {self.what}"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()} on host {socket.gethostname()}\n".encode())
        os.fsync(fd)
        self._fd = fd
        _HELD_LOCKS.add(fd)
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        # The lock file stays (unlinking it would let a waiter and a newcomer lock two different
        # files), unless this lock created the directory and nothing else was written there.
        try:
            if self._created_dir and [p.name for p in self.directory.iterdir()] == [self.NAME]:
                (self.directory / self.NAME).unlink()
                self.directory.rmdir()
        finally:
            _HELD_LOCKS.discard(self._fd)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


_SCRATCH_LOCK = ".lock"
# A hidden scratch directory lives microseconds before its rename; one this old was left by a
# process killed in between.
_HIDDEN_SCRATCH_STALE_S = 600.0


def scratch_directory(base: str, prefix: str) -> tuple[str, int]:
    """A fresh directory ``base/prefix*`` of this process's, and the descriptor of the lock it
    holds on it while it lives (:func:`remove_scratch` removes both). Directories of the same
    prefix whose lock nobody holds (their process was killed before it could remove them) are
    removed first, and hidden ones (``.prefix*``: a process killed while making its own) once
    they are 10 minutes old; a live one, of any process or container sharing ``base``, is never
    touched."""
    for left in Path(base).glob(f".{prefix}*"):
        with contextlib.suppress(OSError):  # gone meanwhile: removed by another process's scan
            if time.time() - left.stat().st_mtime > _HIDDEN_SCRATCH_STALE_S:
                shutil.rmtree(left, ignore_errors=True)
    for stale in Path(base).glob(f"{prefix}*"):
        try:
            fd = os.open(stale / _SCRATCH_LOCK, os.O_RDWR)
        except OSError:  # no lock file: being created, or not ours
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its process lives
            os.close(fd)
            continue
        shutil.rmtree(stale, ignore_errors=True)
        os.close(fd)
    # Made and locked under a hidden name, then renamed into sight: another process's scan never
    # sees it unlocked.
    hidden = tempfile.mkdtemp(prefix=f".{prefix}", dir=base)
    fd = -1
    try:
        fd = os.open(os.path.join(hidden, _SCRATCH_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        root = os.path.join(base, os.path.basename(hidden)[1:])
        os.rename(hidden, root)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        shutil.rmtree(hidden, ignore_errors=True)
        raise
    return root, fd


def remove_scratch(root: str, lock: int) -> None:
    """Removes a :func:`scratch_directory` and everything in it, then lets go of its lock."""
    shutil.rmtree(root, ignore_errors=True)
    os.close(lock)
