"""Variational dropout over a deep group's parts (TorchEasyRec's ``VariationalDropout``, after
EasyRec's feature selection by variational dropout).

Each part ``k`` of the group (a feature, or a sequence encoder's output) has a learned logit
``p_k``; ``sigmoid(p_k)`` is its dropout rate. In training a concrete (relaxed Bernoulli) sample
``z = sigmoid((logit(q) + logit(u)) / 0.1)``, ``q = sigmoid(p)``, ``u ~ U(0, 1)`` per row and part,
scales the part by ``1 - z``; in eval the part is scaled by ``1 - q``. The penalty
``lambda * sum_k (1 - q_k)`` (per batch, TorchEasyRec divides it by the batch's rows) pushes
parts that do not pay for themselves toward being dropped: the learned rates rank the features.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch
from torch import nn

__all__ = ["VariationalDropout", "penalties"]

_EPS = torch.finfo(torch.float32).eps
_TEMPERATURE = 0.1


class VariationalDropout(nn.Module):
    """Over ``[B, sum(widths)]``, the concatenation of parts of ``widths``: ``forward`` returns
    the scaled input and leaves ``self.penalty`` (``lambda * sum(1 - q)``, a scalar) for the
    step's loss (:func:`penalties`)."""

    # self.penalty lives outside the outputs: a CUDA graph's replay would not set it
    # (dynarec.train.graphs).
    capturable = False

    widths: torch.Tensor

    def __init__(self, widths: Sequence[int], regularization_lambda: float):
        super().__init__()
        self.register_buffer("widths", torch.tensor(list(widths), dtype=torch.long), persistent=False)
        self.logit_p = nn.Parameter(torch.randn(len(widths)))  # TorchEasyRec's initialization
        self.regularization_lambda = regularization_lambda
        self.penalty: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.sigmoid(self.logit_p)
        if self.training:
            u = torch.rand(x.shape[0], q.shape[0], device=x.device, dtype=x.dtype)
            relaxed = torch.log(q + _EPS) - torch.log(1 - q + _EPS) + torch.log(u + _EPS) - torch.log(1 - u + _EPS)
            drop = torch.sigmoid(relaxed / _TEMPERATURE)  # [B, parts]
            self.penalty = self.regularization_lambda * (1 - q).sum()
        else:
            drop = q.expand(x.shape[0], -1)
            self.penalty = None
        return x * (1 - torch.repeat_interleave(drop, self.widths, dim=1))


def penalties(
    dropouts: Sequence[VariationalDropout], local_rows: int, global_rows: Union[int, torch.Tensor]
) -> Optional[torch.Tensor]:
    """This rank's share of the penalties ``dropouts`` (a model's) left in this training forward
    (None without any): ``sum(penalty) / global_rows`` over the global batch, TorchEasyRec's
    ``lambda / batch_size * sum(1 - q)``, each rank taking ``local_rows / global_rows`` of it (the
    ranks' gradients are summed)."""
    found = [m.penalty for m in dropouts if m.penalty is not None]
    if not found:
        return None
    return torch.stack(found).sum() * (local_rows / global_rows**2)
