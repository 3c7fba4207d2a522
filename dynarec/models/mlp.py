"""MLPs: linear layers with ReLU, Dice or PReLU, and dropout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.nn.functional as collective
from torch import nn

__all__ = ["MLP", "BatchNorm", "Dice", "normalize_over_ranks"]


class BatchNorm(nn.BatchNorm1d):
    """Batch normalization per unit of the last dim over every other position: ``[..., units]``
    (TorchEasyRec's MLP over ``[B, L, units]`` normalizes over ``B`` and ``L`` alike).

    In training in a multi-process run (``process_group`` set, by :func:`normalize_over_ranks`)
    the statistics are the global batch's, every rank's rows together, and so are the running
    statistics: N ranks at batch B normalize as one process at batch N * B does (torch's
    ``SyncBatchNorm`` does this on GPUs only; this runs over gloo too)."""

    process_group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.training and self.process_group is not None:
            return self._over_ranks(flat).reshape(x.shape)
        return super().forward(flat).reshape(x.shape)

    def _over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """``x [n, units]`` normalized by the mean and (biased) variance of every rank's rows,
        two passes as one process's batch norm takes them; the sums are autograd's all-reduces,
        so the gradient flows through the global statistics as through one process's."""
        group = self.process_group
        count = torch.full((1,), float(x.shape[0]), dtype=x.dtype, device=x.device)
        sums = collective.all_reduce(torch.cat([x.sum(0), count]), group=group)
        rows = sums[-1]
        mean = sums[:-1] / rows
        centred = x - mean
        var = collective.all_reduce(centred.square().sum(0), group=group) / rows
        y = centred * torch.rsqrt(var + self.eps)
        if self.affine:
            y = y * self.weight + self.bias
        tracked = self.num_batches_tracked
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            assert tracked is not None
            with torch.no_grad():
                tracked.add_(1)
                momentum = 1.0 / float(tracked) if self.momentum is None else self.momentum
                # (on the device, no host read: a step's layers wait for nothing)
                unbiased = torch.where(rows > 1, var * rows / (rows - 1).clamp_min(1), var)
                self.running_mean.lerp_(mean.detach(), momentum)
                self.running_var.lerp_(unbiased.detach(), momentum)
        return y


def normalize_over_ranks(module: nn.Module, process_group: Any) -> None:
    """Every :class:`BatchNorm` in ``module`` takes its training statistics over the rows of all
    ranks of ``process_group`` (one collective more a layer, forward and backward)."""
    for m in module.modules():
        if isinstance(m, BatchNorm):
            m.process_group = process_group


class Dice(nn.Module):
    """DIN's data-adaptive activation (TorchEasyRec's): ``p = sigmoid(batch_norm(x))``,
    ``p * x + (1 - p) * alpha * x`` with ``alpha`` learned per unit (starting at 0). Over
    ``[B, units]`` or ``[B, L, units]`` (the statistics per unit over every row and position; in
    eval the running statistics, so a row's output depends on that row alone)."""

    def __init__(self, units: int):
        super().__init__()
        self.bn = BatchNorm(units, affine=False)
        self.alpha = nn.Parameter(torch.zeros(units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        p = torch.sigmoid(self.bn(flat)).reshape(x.shape)
        return p * x + (1 - p) * self.alpha * x


_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "dice": Dice,
    "prelu": nn.PReLU,  # one slope a layer, from 0.25 (TorchEasyRec's nn.PReLU())
    "silu": nn.SiLU,
    "none": nn.Identity,
}


class MLP(nn.Sequential):
    """Linear layers (``bias``: with biases), each followed by batch normalization
    (``batch_norm``, per unit over every row and position), layer normalization (``layer_norm``:
    TorchEasyRec's ``use_ln``), ``activation`` (``relu``, ``dice``, ``prelu``, ``silu`` or ``none``) and,
    where ``dropout`` gives a ratio above 0, dropout: ``[..., in_dim] -> [..., hidden_units[-1]]``.

    ``dropout``: no ratio (none), one ratio for every layer, or one per layer (TorchEasyRec's
    ``dropout_ratio``). Dropout draws from torch's global generator in training only; in eval the
    MLP is deterministic.
    """

    out_dim: int

    def __init__(
        self,
        in_dim: int,
        hidden_units: Sequence[int],
        activation: str = "relu",
        dropout: Sequence[float] = (),
        batch_norm: bool = False,
        bias: bool = True,
        layer_norm: bool = False,
    ):
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: one of {sorted(_ACTIVATIONS)}")
        ratios = list(dropout) * len(hidden_units) if len(dropout) == 1 else list(dropout)
        if ratios and len(ratios) != len(hidden_units):
            raise ValueError(f"dropout ratios {list(dropout)}: give one, or one per layer of {list(hidden_units)}")
        layers: list[nn.Module] = []
        for i, units in enumerate(hidden_units):
            layers.append(nn.Linear(in_dim, units, bias=bias))
            if batch_norm:
                layers.append(BatchNorm(units))
            if layer_norm:
                layers.append(nn.LayerNorm(units))
            if activation != "none":
                layers.append(Dice(units) if activation == "dice" else _ACTIVATIONS[activation]())
            if ratios and ratios[i] > 0:
                layers.append(nn.Dropout(ratios[i]))
            in_dim = units
        super().__init__(*layers)
        self.out_dim = in_dim
