"""Evaluation: eval-mode predictions over a model's input, in row order, and their metrics
(AUC, grouped AUC, log loss) over every rank's predictions."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from dynarec.config.schema import Config
from dynarec.data.batch import DataError
from dynarec.distributed.context import DistContext
from dynarec.metrics import auc, grouped_auc, log_loss
from dynarec.train.input import TrainInput
from dynarec.train.task import RankingTask

__all__ = ["Evaluator"]


class Evaluator:
    """Scores ``task`` on data read through ``input`` (its eval batch size and workers)."""

    def __init__(self, config: Config, task: RankingTask, input: TrainInput, ctx: DistContext):
        self.config, self.task, self.input, self.ctx = config, task, input, ctx

    @torch.no_grad()
    def predict(self, paths, with_labels: bool = True, max_steps: Optional[int] = None):
        """Eval-mode predictions over ``paths``, in row order: ``(probabilities, labels,
        groups)`` numpy arrays (labels/groups None without labels). In a multi-process run every
        rank scores its share of each global batch and every rank gets all predictions. A score
        that is not a finite number is a ValueError naming its file and row."""
        self.task.eval()
        dataset = self.input.dataset(paths, self.input.eval_batch_size, with_labels)
        probs, labels, groups = [], [], []
        steps = dataset.num_steps() if max_steps is None else min(max_steps, dataset.num_steps())
        batches = iter(self.input.loader(dataset))
        for _ in range(steps):
            batch = next(batches)
            probs.append(torch.sigmoid(self.task(batch)).cpu().numpy())
            labels.append(batch.labels.numpy())
            if batch.groups is not None:
                groups.append(batch.groups.numpy())
        self.task.train()
        if self.ctx.distributed:  # global batch s is rank 0's share, then rank 1's, ...
            parts = self.ctx.all_gather_objects((probs, labels, groups), "the eval predictions")
            probs = [p for s in range(steps) for part in parts for p in part[0][s : s + 1]]
            labels = [x for s in range(steps) for part in parts for x in part[1][s : s + 1]]
            groups = [x for s in range(steps) for part in parts for x in part[2][s : s + 1]]
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0)
        scores = cat(probs)
        dataset.check_scores(scores, "click probability")
        return scores, (cat(labels) if with_labels else None), (cat(groups) if groups else None)

    def evaluate(self, paths=None) -> dict[str, float]:
        """The config's eval metrics over ``paths`` (default: ``data.eval_input_path``), at most
        ``eval.max_steps`` batches; ``num_examples`` beside them."""
        paths = paths or self.config.data.eval_input_path
        if not paths:
            raise ValueError("no eval data: set data.eval_input_path")
        probs, labels, groups = self.predict(paths, max_steps=self.config.eval.max_steps)
        if probs.size == 0:
            raise DataError(f"nothing to evaluate: {paths} holds no rows")
        metrics: dict[str, float] = {"num_examples": float(probs.size)}
        for m in self.config.eval.metrics:
            if m == "auc":
                metrics["auc"] = auc(probs, labels)
            elif m == "log_loss":
                metrics["log_loss"] = log_loss(probs, labels)
            elif m == "grouped_auc" and groups is not None:
                metrics["grouped_auc"] = grouped_auc(probs, labels, groups)
        return metrics
