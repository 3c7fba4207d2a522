"""MLPs: linear layers with ReLU, Dice or PReLU, and dropout."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["MLP", "Dice"]


class Dice(nn.Module):
    """DIN's data-adaptive activation (TorchEasyRec's): ``p = sigmoid(batch_norm(x))``,
    ``p * x + (1 - p) * alpha * x`` with ``alpha`` learned per unit (starting at 0). Over
    ``[B, units]`` or ``[B, L, units]`` (the statistics per unit over every row and position; in
    eval the running statistics, so a row's output depends on that row alone)."""

    def __init__(self, units: int):
        super().__init__()
        self.bn = nn.BatchNorm1d(units, affine=False)
        self.alpha = nn.Parameter(torch.zeros(units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        p = torch.sigmoid(self.bn(flat)).reshape(x.shape)
        return p * x + (1 - p) * self.alpha * x


class BatchNorm(nn.BatchNorm1d):
    """Batch normalization per unit of the last dim over every other position: ``[..., units]``
    (TorchEasyRec's MLP over ``[B, L, units]`` normalizes over ``B`` and ``L`` alike)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.reshape(-1, x.shape[-1])).reshape(x.shape)


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
