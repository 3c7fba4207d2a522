"""Evaluation: eval-mode predictions over a model's input, in row order, and each task's metrics
(dynarec.models.tasks) over every rank's predictions."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

import numpy as np
import torch

from dynarec.config.schema import Config
from dynarec.data.batch import Batch, DataError
from dynarec.distributed.context import DistContext
from dynarec.models.tasks import check_predictions, no_logits, tasks_of
from dynarec.train.input import EVAL_PATH, TrainInput
from dynarec.train.stop import EvaluationStopped
from dynarec.train.task import RankingTask, check_servable

__all__ = ["Evaluator"]


class Evaluator:
    """Scores ``task`` on data read through ``input`` (its eval batch size and workers)."""

    def __init__(self, config: Config, task: RankingTask, input: TrainInput, ctx: DistContext):
        self.config, self.task, self.input, self.ctx = config, task, input, ctx
        self.tasks = tasks_of(config, ctx.world_size)

    @torch.no_grad()
    def predict(
        self,
        paths,
        with_labels: bool = True,
        max_steps: Optional[int] = None,
        per_row: bool = False,
        what: str = "input path",
    ):
        """Eval-mode predictions over ``paths``, in row order: ``(outputs, labels, groups)``:
        ``{output name: [N] or [N, C]}`` (``Tasks.predictions``: ``probability`` for a
        single-task model), labels ``[N, L]`` (``Config.label_fields()``) and grouped-AUC ids
        ``[N]`` (None without labels). In a multi-process run every rank scores its share of
        each global batch and every rank gets all predictions. A prediction that is not a finite
        number is a ValueError naming its file and row.

        A model scoring each row's candidates (``Config.candidate_feature()``) gives them over
        the candidates, ``N`` theirs, row after row; with ``per_row`` each output is then an
        object array of one entry a row, its candidates' predictions (what ``predict`` writes)."""
        check_servable(self.task)
        dataset = self.input.dataset(paths, self.input.eval_batch_size, with_labels, what=what)
        outputs, labels, groups, counts, sources = [], [], [], [], []
        candidate = self.config.candidate_feature()
        steps = dataset.num_steps() if max_steps is None else min(max_steps, dataset.num_steps())
        batches = iter(self.input.loader(dataset))
        self.task.eval()
        try:
            for step in range(steps):
                batch = self._next_batch(batches, step, steps)
                # (the rows scored: a retrieval model's users, or the queries of hstu_match's positives)
                predicted = self.tasks.predictions(self.task(batch), batch.labels.shape[0], batch.hard_negative_rows)
                outputs.append({k: v.cpu().numpy() for k, v in predicted.items()})
                labels.append(batch.labels.numpy())
                if batch.groups is not None:
                    groups.append(batch.groups.numpy())
                if candidate is not None:
                    counts.append(batch.sequence_lengths([candidate])[candidate][: batch.num_rows].long().numpy())
                if batch.source_rows is not None:  # a TDM batch: its rows and its sampled nodes' rows
                    sources.append(batch.source_rows.numpy())
        finally:
            self.task.train()
        if self.ctx.distributed:  # global batch s is rank 0's share, then rank 1's, ...
            gathered = (outputs, labels, groups, counts, sources)
            parts = self.ctx.all_gather_objects(gathered, "the eval predictions")
            outputs = [p for s in range(steps) for part in parts for p in part[0][s : s + 1]]
            labels = [x for s in range(steps) for part in parts for x in part[1][s : s + 1]]
            groups = [x for s in range(steps) for part in parts for x in part[2][s : s + 1]]
            counts = [x for s in range(steps) for part in parts for x in part[3][s : s + 1]]
            sources = [x for s in range(steps) for part in parts for x in part[4][s : s + 1]]
        if not outputs:  # no rows: each output's no rows, of its own shape and type
            outputs = [{k: v.numpy() for k, v in self.tasks.predictions(no_logits(self.tasks), 0).items()}]
        predictions = {name: np.concatenate([o[name] for o in outputs]) for name in self.tasks.output_names()}
        rows = np.concatenate(counts) if counts else np.zeros(0, np.int64)  # a candidate model's a row
        row_of, data_rows = np.repeat(np.arange(len(rows)), rows), len(rows)
        if sources:  # a TDM model's rows: each one's data row, over the whole evaluation
            starts = np.cumsum([0] + [int(s.max()) + 1 if len(s) else 0 for s in sources])
            row_of = np.concatenate([start + s for start, s in zip(starts, sources)])
            data_rows = int(starts[-1])

        def check(scores: np.ndarray, what: str) -> None:
            if candidate is not None or sources:  # a bad score is named by its data row: their sum
                scores = np.bincount(row_of, weights=scores, minlength=data_rows)
            dataset.check_scores(scores, what)

        check_predictions(predictions, check)
        if candidate is not None and per_row:
            splits = np.cumsum(rows)[:-1]
            for name, x in predictions.items():
                column = np.empty(len(rows), dtype=object)
                column[:] = np.split(x, splits) if len(rows) else []
                predictions[name] = column
        width = len(self.config.label_fields())
        return (
            predictions,
            (np.concatenate(labels) if labels else np.zeros((0, width), np.float32)) if with_labels else None,
            np.concatenate(groups) if groups else None,
        )

    def _next_batch(self, batches: Iterator[Batch], step: int, steps: int) -> Batch:
        """Batch ``step`` of ``steps``, once every rank has read its own. EvaluationStopped where a
        stop was asked of the run (of any rank: every rank then stops at the same batch; a rank
        that was asked reads no more); else, where a rank could not read its batch (a bad row),
        every rank raises StepFailedError naming it, before any collective of the forward. One
        collective a batch for both."""
        asked = self.input.stop_signal.requested is not None
        batch: Optional[Batch] = None
        error: Optional[DataError] = None
        if not asked:
            try:
                batch = next(batches)
            except DataError as e:
                if not self.ctx.distributed:
                    raise
                error = e
        if self.ctx.distributed:
            asked, failed = self.ctx.any_each([asked, error is not None], f"eval batch {step + 1}")
            if failed and not asked:
                self.ctx.agree(error, f"reading eval batch {step + 1}")
        if asked:
            raise EvaluationStopped(f"the evaluation stopped after {step} of its {steps} batches")
        assert batch is not None
        return batch

    def evaluate(self, paths=None) -> dict[str, float]:
        """Every task's metrics over ``paths`` (default: ``data.eval_input_path``), at most
        ``eval.max_steps`` batches; ``num_examples`` beside them."""
        paths = paths or self.config.data.eval_input_path
        if not paths:
            raise ValueError("no eval data: set data.eval_input_path")
        what = "input path" if paths != self.config.data.eval_input_path else EVAL_PATH
        predictions, labels, groups = self.predict(paths, max_steps=self.config.eval.max_steps, what=what)
        rows = len(labels)
        if rows == 0:
            raise DataError(f"nothing to evaluate: {paths} holds no rows")
        return {"num_examples": float(rows), **self.tasks.metrics(predictions, labels, groups)}
