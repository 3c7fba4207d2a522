"""A stop asked of a training run from outside: SIGTERM (a scheduler's preemption, ``kill``)
lets the step in progress finish, then the trainer saves the steps trained and stops. A second
SIGTERM, :data:`REPEAT_SECONDS` or more after the first, stops the process at once, as SIGTERM
does by default; one sooner is the same request arriving twice (a scheduler signals every
process of a job, and torchrun passes its own on to the ranks)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, Optional

__all__ = ["REPEAT_SECONDS", "EvaluationStopped", "StopSignal", "TrainingStopped"]

#: A second SIGTERM this soon after the first is taken for the same request.
REPEAT_SECONDS = 5.0


class TrainingStopped(RuntimeError):
    """The run stopped on a signal after saving its steps; ``signum``: that signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class EvaluationStopped(Exception):
    """An evaluation given up at a batch because a stop was asked (SIGTERM) while it ran: a
    scheduler's grace period is seconds, an evaluation can take minutes, and the steps trained
    since the last checkpoint are saved only once it ends."""


class StopSignal:
    """Records the first SIGTERM while :meth:`installed` is active (``requested``: its number;
    None again once the block ends: the request was that block's)."""

    def __init__(self) -> None:
        self.requested: Optional[int] = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Handles SIGTERM inside the block (Python handles signals in the main thread only: in
        another thread nothing is installed and SIGTERM keeps its handler; an ignored SIGTERM
        stays ignored)."""
        self.requested = None
        previous = signal.getsignal(signal.SIGTERM)
        if threading.current_thread() is not threading.main_thread() or previous == signal.SIG_IGN:
            yield
            return
        restore = previous if previous is not None else signal.SIG_DFL  # (None: a handler not set from Python)
        first_at = 0.0

        def handle(signum: int, _frame: Any) -> None:
            nonlocal first_at
            if self.requested is not None:
                if time.monotonic() - first_at < REPEAT_SECONDS:
                    return  # the same request, delivered twice
                signal.signal(signum, restore)
                os.kill(os.getpid(), signum)  # a second one: stop now
                return
            self.requested, first_at = signum, time.monotonic()
            # os.write, not print: a handler that runs inside an interrupted write to stderr
            # must not write through the same buffered stream
            message = (
                f"{signal.Signals(signum).name}: stopping after this step, its checkpoint first "
                f"(send it again, {REPEAT_SECONDS:.0f} s or more from now, to stop at once)\n"
            )
            try:
                os.write(sys.stderr.fileno(), message.encode())
            except (OSError, ValueError):
                pass

        signal.signal(signal.SIGTERM, handle)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, restore)
            self.requested = None  # (answered: an evaluation after the run is not stopped by it)
