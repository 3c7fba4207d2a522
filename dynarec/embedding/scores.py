"""A dynamic table's eviction scores: which value the score of a row a training step touched
takes when the step commits, and who writes it.

``step``: the step's counter ``t``; ``timestamp``: the forward's wall clock (us); ``lfu``: the
score grows by the row's occurrences; ``none``: no score, no eviction. The index is the only
writer of its scores: on a native row store the fused update sets ``step`` / ``timestamp``
scores in its own pass, once per unique row, through the writer the index hands out
(``BucketedHashIndex.scores_writer``); a step committed before its backward ran (a later step's
backward settled it, or none will come), ``lfu``, the FBGEMM store and a grouped table (whose
rows share one update with other tables') write through the index at commit, one write per
occurrence.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional

import torch

from dynarec.embedding.config import ScoreStrategy
from dynarec.embedding.hash_index import IndexWrites
from dynarec.embedding.step import Step
from dynarec.optim.fused import RowScores

__all__ = ["ScorePolicy"]


class ScorePolicy:
    """The score writes of ``strategy`` into the table's current index (``index()``: the index
    the table holds when the write happens; a growth replaces it)."""

    def __init__(self, strategy: ScoreStrategy, index: Callable[[], IndexWrites]):
        self.strategy = strategy
        self._index = index

    @property
    def evicts(self) -> bool:
        """Whether a full table evicts (the lowest score) to place a new key."""
        return self.strategy != "none"

    def schedule(self, touched: torch.Tensor, step: Step, fused: bool) -> Optional[RowScores]:
        """Schedules the score change of ``step``'s touched slots (one entry per occurrence) for
        when the step commits (no growth can move them before: growth waits for every other
        pending step). ``fused``: the row store's fused update can write the scores (a native
        store, in a step with a backward); returns the writer it takes, or None where the commit
        writes them."""
        if self.strategy == "lfu":
            step.on_commit.append(lambda: self._index().add(touched, torch.ones_like(touched)))
            return None
        if self.strategy not in ("step", "timestamp"):
            return None
        value = step.t if self.strategy == "step" else time.time_ns() // 1000
        writer = self._index().scores_writer(value, step.journal) if fused else None

        def on_commit() -> None:
            # Committed by its own backward: the update writes the scores, next. Committed before
            # it (a later step's backward settled it, or no backward will come): written here, in
            # commit order, and a backward of this step that still runs writes none (it would
            # overwrite a later step's scores of shared rows).
            if writer is not None and step.backward_ran:
                return
            self._index().touch(touched, value, replaces=writer)

        step.on_commit.append(on_commit)
        return writer
