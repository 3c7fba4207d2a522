"""Metrics over a whole evaluation set: AUC, grouped AUC, log loss (binary tasks), accuracy
(classifiers), mean squared and mean absolute error (regression).

Exact (no binning): AUC is the Mann-Whitney statistic with average ranks for ties.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NULL_GROUP", "accuracy", "auc", "grouped_auc", "log_loss", "mean_absolute_error", "mean_squared_error"]

#: The group of the rows whose grouping value (grouped AUC's user, JRC's session) is null: an
#: int64 no hashed string takes (they are in [0, 2**62)), nor, in practice, an integer id.
#: Grouped AUC leaves it out: rows without a user have no user's AUC.
NULL_GROUP = -(1 << 63)


def _average_ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    ranks = np.empty(x.size, dtype=np.float64)
    # Tie groups get the mean of their 1-based positions.
    boundaries = np.concatenate([[0], np.nonzero(np.diff(sorted_x))[0] + 1, [x.size]])
    for_each = (boundaries[:-1] + boundaries[1:] + 1) / 2.0
    ranks[order] = np.repeat(for_each, np.diff(boundaries))
    return ranks


def auc(scores, labels) -> float:
    """Area under the ROC curve; NaN when only one class is present."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    ranks = _average_ranks(scores)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def grouped_auc(scores, labels, groups) -> float:
    """Impression-weighted mean of per-group AUC over groups that hold both classes (GAUC), but
    :data:`NULL_GROUP`'s."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    groups = np.asarray(groups)
    order = np.lexsort((scores, groups))
    g, s, y = groups[order], scores[order], labels[order]
    starts = np.concatenate([[0], np.nonzero(g[1:] != g[:-1])[0] + 1])
    ends = np.concatenate([starts[1:], [g.size]])
    total, weight = 0.0, 0
    for a, b in zip(starts, ends):
        yy = y[a:b]
        if yy.all() or not yy.any() or g[a] == NULL_GROUP:
            continue
        total += auc(s[a:b], yy) * (b - a)
        weight += b - a
    return total / weight if weight else float("nan")


def log_loss(probs, labels, eps: float = 1e-7) -> float:
    p = np.clip(np.asarray(probs, dtype=np.float64), eps, 1 - eps)
    y = np.asarray(labels, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def accuracy(probs, labels) -> float:
    """The share of rows whose most probable class (``probs [N, C]``) is the label ``[N]``."""
    predicted = np.argmax(np.asarray(probs, dtype=np.float64), axis=1)
    return float(np.mean(predicted == np.asarray(labels, dtype=np.float64).astype(np.int64)))


def mean_squared_error(predictions, labels) -> float:
    d = np.asarray(predictions, dtype=np.float64) - np.asarray(labels, dtype=np.float64)
    return float(np.mean(d * d))


def mean_absolute_error(predictions, labels) -> float:
    d = np.asarray(predictions, dtype=np.float64) - np.asarray(labels, dtype=np.float64)
    return float(np.mean(np.abs(d)))
