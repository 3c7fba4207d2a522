"""A table's training steps: begin (forward) -> commit (its backward ran) or abort (no backward).

The step counter ``t`` (Adam's bias-correction step, FBGEMM's ``iter``) moves only here: ``begin``
advances it, ``abort`` takes it back. Everything a training forward changes before its backward
— rows it created, keys it evicted with their rows, admission counts, a growth of the table —
is recorded in the step's :class:`Journal`, so ``abort`` leaves no trace at all. Effects that only
matter after the step (eviction scores of the touched rows) are deferred to ``commit``.

Several forwards may be pending at once (a model that looks a table up twice before one
backward); the backward of step k commits every pending step up to k — an earlier one whose
backward never came was abandoned, and keeping its rows is what a no-grad forward does too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["Journal", "Step", "StepLifecycle", "StepPendingError"]


class StepPendingError(RuntimeError):
    """An operation that needs no training step in flight was called while one was."""


class Journal:
    """Undo records of one step, replayed newest first by :meth:`undo`."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def record(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __len__(self) -> int:
        return len(self._undo)


@dataclass
class Step:
    """One training step of one table.

    ``id`` is unique and increasing for the table's lifetime (never reused, also after an abort:
    row pins compare against it); ``t`` is the table's step counter for this step.
    """

    id: int
    t: int
    journal: Journal = field(default_factory=Journal)
    on_commit: list[Callable[[], None]] = field(default_factory=list)
    backward_ran: bool = False
    # "pending", then "committed" (its backward, or a later step's, ran) or "aborted"
    state: str = "pending"


class StepLifecycle:
    """The step counter and the pending steps of one table."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.t = 0
        self._next_id = 0
        self.pending: list[Step] = []

    @property
    def current(self) -> Step:
        """The latest pending step (the one a lookup in progress belongs to)."""
        if not self.pending:
            raise StepPendingError(f"{self.where}: no training step is open (begin_step() first)")
        return self.pending[-1]

    @property
    def last_id(self) -> int:
        """The id of the latest step begun or write made (0: none)."""
        return self._next_id

    def begin(self, step_id: Optional[int] = None) -> Step:
        """Opens a step, of id ``step_id`` where given (past :attr:`last_id`: tables looked up
        together open their steps with one id), else the next id."""
        if step_id is not None and step_id <= self._next_id:
            raise ValueError(f"{self.where}: step id {step_id} is not past the last one, {self._next_id}")
        self.t += 1
        self._next_id = self._next_id + 1 if step_id is None else step_id
        step = Step(self._next_id, self.t)
        self.pending.append(step)
        return step

    def new_id(self) -> int:
        """An id no step has or will have: a write outside training pins its own rows with it
        while it inserts (it pins nothing once the write returns: it is never pending)."""
        self._next_id += 1
        return self._next_id

    def commit(self, through: Step) -> None:
        """Commits every pending step up to ``through`` (no-op if it was committed already)."""
        while self.pending and self.pending[0].id <= through.id:
            step = self.pending.pop(0)
            step.state = "committed"
            for effect in step.on_commit:
                effect()

    def abort(self) -> None:
        """Undoes the latest pending step: its journal, newest first, and its step count."""
        step = self.current
        step.journal.undo()
        self.pending.pop()
        step.state = "aborted"
        self.t -= 1

    @contextmanager
    def dry_run(self) -> Iterator[None]:
        """Around code that runs a step's Python but none of its device work (a training step
        captured in a CUDA graph): the steps it begins and commits are forgotten after it, the
        step counter put back (ids stay used: an id is never given twice). Refused while a step
        is pending."""
        self.check_idle("a dry run of a step")
        t = self.t
        try:
            yield
        finally:
            self.t, self.pending = t, []

    def reset(self, t: int) -> None:
        """Sets the step counter (a load); refused while a step is pending."""
        self.check_idle("load")
        self.t = t

    def check_idle(self, what: str) -> None:
        if self.pending:
            raise StepPendingError(
                f"{self.where}: {what} while a training step is pending (a training forward whose backward has "
                f"not run); run its backward, or abort_step(), first"
            )
