"""A stop asked of a training run from outside: SIGTERM (a scheduler's preemption, ``kill``)
lets the step in progress finish, then the trainer saves the steps trained and stops. A second
SIGTERM stops the process at once, as SIGTERM does by default."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, Optional

__all__ = ["StopSignal", "TrainingStopped"]


class TrainingStopped(RuntimeError):
    """The run stopped on a signal after saving its steps; ``signum``: that signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class StopSignal:
    """Records the first SIGTERM while :meth:`installed` is active (``requested``: its number)."""

    def __init__(self) -> None:
        self.requested: Optional[int] = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Handles SIGTERM inside the block (Python handles signals in the main thread only: in
        another thread nothing is installed and SIGTERM keeps its handler)."""
        self.requested = None
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.getsignal(signal.SIGTERM)

        def handle(signum: int, _frame: Any) -> None:
            if self.requested is not None:  # a second one: stop now
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            self.requested = signum
            print(
                f"{signal.Signals(signum).name}: stopping after this step, its checkpoint first "
                "(send it again to stop at once)",
                file=sys.stderr,
                flush=True,
            )

        signal.signal(signal.SIGTERM, handle)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
