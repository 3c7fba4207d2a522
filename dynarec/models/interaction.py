"""Explicit feature-interaction layers (TorchEasyRec's ``tzrec/modules/interaction.py``
formulas): DCN's cross layers (v1 and the low-rank v2), xDeepFM's compressed interaction
network, WuKong's linear-compress and factorization-machine blocks, and MaskNet's mask blocks."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dynarec.models.blocks import MLP

__all__ = ["CIN", "Cross", "CrossV2", "MaskBlock", "MaskNetModule", "WuKongLayer"]


class Cross(nn.Module):
    """DCN v1 (Wang et al., 2017): ``x_{l+1} = x_0 * (w_l . x_l) + b_l + x_l``: ``[B, d] -> [B, d]``."""

    def __init__(self, dim: int, cross_num: int = 3):
        super().__init__()
        ws = [nn.Linear(dim, 1, bias=False) for _ in range(cross_num)]
        for w in ws:
            nn.init.xavier_uniform_(w.weight)
        self.w = nn.ModuleList(ws)
        self.b = nn.ParameterList(nn.Parameter(torch.zeros(dim)) for _ in range(cross_num))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for w, b in zip(self.w, self.b):
            x = w(x) * x0 + b + x
        return x


class CrossV2(nn.Module):
    """DCN v2 with low-rank matrices (Wang et al., 2021): ``x_{l+1} = x_0 * (V_l (U_l x_l) + c_l)
    + x_l``: ``[B, d] -> [B, d]``."""

    def __init__(self, dim: int, cross_num: int = 3, low_rank: int = 32):
        super().__init__()
        self.u = nn.ModuleList(nn.Linear(dim, low_rank, bias=False) for _ in range(cross_num))
        self.v = nn.ModuleList(nn.Linear(low_rank, dim) for _ in range(cross_num))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for u, v in zip(self.u, self.v):
            x = x0 * v(u(x)) + x
        return x


class CIN(nn.Module):
    """xDeepFM's compressed interaction network (Lian et al., 2018): layer ``k`` forms every
    product of its input's rows with the fields' rows and compresses them to
    ``cin_layer_size[k]`` rows (a 1x1 convolution); each layer's rows, summed over the
    embedding dim, are the output: ``[B, F, D] -> [B, sum(cin_layer_size)]``."""

    def __init__(self, num_fields: int, cin_layer_size: Sequence[int]):
        super().__init__()
        sizes = [num_fields, *cin_layer_size]
        self.layers = nn.ModuleList(
            nn.Conv1d(num_fields * sizes[i], sizes[i + 1], kernel_size=1) for i in range(len(cin_layer_size))
        )
        self.out_dim = sum(cin_layer_size)

    def forward(self, fields: torch.Tensor) -> torch.Tensor:
        b, _, d = fields.shape
        x, out = fields, []
        for layer in self.layers:
            z = torch.einsum("bhd,bfd->bhfd", x, fields).reshape(b, -1, d)
            x = layer(z)
            out.append(x.sum(dim=2))
        return torch.cat(out, dim=1)


class _LinearCompress(nn.Module):
    """``[B, F_in, D] -> [B, F_out, D]``: each output field a learned mix of the input fields."""

    def __init__(self, fields_in: int, fields_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(fields_in, fields_out))
        nn.init.kaiming_uniform_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.transpose(1, 2) @ self.weight).transpose(1, 2)


class _FactorizationMachineBlock(nn.Module):
    """WuKong's optimized FM block: the fields' dot products with ``compressed`` learned mixes of
    them, layer-normalized, through an MLP to ``fields_out`` new fields of dim ``D``."""

    def __init__(self, dim: int, fields_in: int, fields_out: int, compressed: int, hidden_units: Sequence[int]):
        super().__init__()
        self.fields_out, self.dim = fields_out, dim
        self.weight = nn.Parameter(torch.empty(fields_in, compressed))
        nn.init.kaiming_uniform_(self.weight)
        self.norm = nn.LayerNorm(fields_in * compressed)
        self.mlp = MLP(fields_in * compressed, hidden_units)
        self.out = nn.Linear(self.mlp.out_dim, fields_out * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x @ (x.transpose(1, 2) @ self.weight)  # [B, F_in, compressed]
        z = self.out(self.mlp(self.norm(z.flatten(1))))
        return z.view(-1, self.fields_out, self.dim)


class WuKongLayer(nn.Module):
    """One WuKong layer (Zhang et al., 2024): ``fmb`` factorization-machine fields and ``lcb``
    linearly compressed fields, concatenated, plus the (projected) input, layer-normalized:
    ``[B, F, D] -> [B, fmb + lcb, D]``."""

    def __init__(self, dim: int, fields: int, lcb: int, fmb: int, compressed: int, hidden_units: Sequence[int]):
        super().__init__()
        self.lcb = _LinearCompress(fields, lcb)
        self.fmb = _FactorizationMachineBlock(dim, fields, fmb, compressed, hidden_units)
        self.norm = nn.LayerNorm(dim)
        self.residual: nn.Module = _LinearCompress(fields, lcb + fmb) if fields != lcb + fmb else nn.Identity()
        self.out_fields = lcb + fmb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.cat([self.fmb(x), self.lcb(x)], dim=1) + self.residual(x))


class MaskBlock(nn.Module):
    """MaskNet's mask block (Wang et al., 2021): an instance-guided mask (``mask_input -> agg ->
    in_dim``) multiplies ``x``, then a layer-normalized feed-forward layer: ``[B, in_dim] ->
    [B, hidden_dim]``."""

    def __init__(self, in_dim: int, mask_dim: int, hidden_dim: int, aggregation_dim: int):
        super().__init__()
        self.mask = nn.Sequential(nn.Linear(mask_dim, aggregation_dim), nn.ReLU(), nn.Linear(aggregation_dim, in_dim))
        self.ffn = nn.Sequential(nn.Linear(in_dim, hidden_dim), nn.LayerNorm(hidden_dim), nn.ReLU())

    def forward(self, x: torch.Tensor, mask_input: torch.Tensor) -> torch.Tensor:
        return self.ffn(x * self.mask(mask_input))


class MaskNetModule(nn.Module):
    """``n`` mask blocks over the layer-normalized features, in parallel (outputs concatenated)
    or in series (each masking the previous one's output), then an optional top MLP."""

    def __init__(
        self,
        dim: int,
        n_mask_blocks: int,
        hidden_dim: int,
        aggregation_dim: int,
        top_hidden_units: Sequence[int],
        parallel: bool = True,
    ):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.parallel = parallel
        width = dim
        blocks = []
        for _ in range(n_mask_blocks):
            blocks.append(MaskBlock(dim if parallel else width, dim, hidden_dim, aggregation_dim))
            width = hidden_dim
        self.blocks = nn.ModuleList(blocks)
        width = hidden_dim * n_mask_blocks if parallel else hidden_dim
        self.top = MLP(width, top_hidden_units)
        self.out_dim = self.top.out_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = self.norm(x)
        if self.parallel:
            hidden = torch.cat([block(normed, x) for block in self.blocks], dim=-1)
        else:
            hidden = normed
            for block in self.blocks:
                hidden = block(hidden, x)
        return self.top(hidden)
