"""Real faults of the environment, for tests: a full disk, a file size limit, a read-only
directory. No mocks: the kernel refuses the writes.

- :func:`file_size_limit`: ``RLIMIT_FSIZE`` for this process (``ulimit -f``): a write past it
  fails with EFBIG (Python ignores SIGXFSZ). Works for any user.
- :func:`small_disk`: a tmpfs of a few KiB mounted on a directory: writes fail with ENOSPC.
  Needs root with mount privileges (skips otherwise).
- :func:`read_only`: a directory made read-only — remounted read-only (root) or ``chmod a-w``
  (any other user, for whom that is enough).
"""

from __future__ import annotations

import contextlib
import os
import resource
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Within the block, no file of this process may grow past ``nbytes`` bytes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _mount(*args: str) -> bool:
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@contextlib.contextmanager
def small_disk(directory: Path, size: str = "64k") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on ``directory`` (created) for the block."""
    directory.mkdir(parents=True, exist_ok=True)
    if not _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)):
        pytest.skip("mounting a small tmpfs needs root with mount privileges")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def fill(directory: Path, leave: int) -> None:
    """Fills ``directory``'s file system until at most about ``leave`` bytes are free."""
    free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
    with open(directory / ".filler", "wb") as f:
        with contextlib.suppress(OSError):
            f.write(b"\0" * max(free - leave, 0))


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[Path]:
    """``directory`` (and everything under it) cannot be written within the block."""
    if os.geteuid() == 0:
        if not (_mount("--bind", str(directory), str(directory))):
            pytest.skip("a read-only bind mount needs root with mount privileges")
        if not _mount("-o", "remount,ro,bind", str(directory)):
            subprocess.run(["umount", str(directory)], check=True)
            pytest.skip("remounting read-only needs root with mount privileges")
        try:
            yield directory
        finally:
            subprocess.run(["umount", "-l", str(directory)], check=True)
        return
    modes = {}
    for root, dirs, files in os.walk(directory):
        for name in [*dirs, *files, "."]:
            p = Path(root) / name
            modes[p] = p.stat().st_mode
            p.chmod(modes[p] & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        yield directory
    finally:
        for p, mode in modes.items():
            p.chmod(mode)
