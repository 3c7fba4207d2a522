"""Half-precision rows: the stochastic rounding of an updated fp32 row to its storage type.

A table may keep its weights in ``fp16`` or ``bf16`` (its optimizer states stay fp32). Its update
runs in fp32 on the rows it touches, and each new weight ``x`` is stored as one of the two
storage values around it, ``lo <= |x| < hi`` in magnitude, ``hi`` with probability
``(|x| - |lo|) / (|hi| - |lo|)``: unbiased (``E[stored] = x``), as FBGEMM's stochastic rounding
is. (FBGEMM adds 16 random bits below a bf16's mantissa and truncates, which is the same
distribution; for fp16 the rule above also covers subnormals.) A value the storage type holds
exactly is stored as it is.

The uniform draws are a counter-based hash of ``(seed, step, key, column)`` (murmur3's 32-bit
finalizer, in int64 tensor arithmetic), not a generator's state: the same table, step and key get
the same draw on any device, in any order, wherever the key's row lives (a fixed table's key is
its global row id, a dynamic table's its int64 key, so growth, relocation and sharding do not
change a draw); a run is reproducible bit for bit and a reference can recompute every draw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "ROUNDING_CODES",
    "ROW_DTYPES",
    "RowKeys",
    "rounded_match",
    "rounding_base",
    "rounding_noise",
    "stochastic_round",
]

# A table's row storage types (TableConfig.data_type) and their torch dtypes.
ROW_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# The Triton update's code for each storage type (its ``ROUND`` constexpr): 0 stores float32.
ROUNDING_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class RowKeys:
    """The keys of a row store's rows, which its rounding draws are keyed by: ``keys()[row]``
    (a dynamic table: its index's key array, read when the update runs) or ``row + offset`` (a
    fixed table: its global row ids)."""

    keys: Optional[Callable[[], torch.Tensor]] = None
    offset: int = 0

    def of(self, rows: torch.Tensor) -> torch.Tensor:
        return self.keys()[rows] if self.keys is not None else rows + self.offset


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer of ``h``'s low 32 bits (int64 in, int64 in ``[0, 2**32)`` out)."""
    h = h & _M32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def rounding_base(seed: int, step: int) -> int:
    """The hash of ``(seed, step)`` every draw of a table's step starts from, in ``[0, 2**32)``
    (the Triton update takes it as an argument)."""
    return int(_fmix32(torch.tensor((seed * 0x9E3779B1 + step * 0x7FEB352D) & _M32)))


def rounding_noise(seed: int, step: int, keys: torch.Tensor, dim: int) -> torch.Tensor:
    """``[U, dim]`` float32 uniform draws in ``[0, 1)`` (24 bits) for the rows of ``keys``
    (``[U]`` int64, any values) of a table seeded ``seed`` at step ``step``. The Triton update
    (``dynarec/kernels/gpu/update.py``) draws the same numbers in uint32 arithmetic."""
    base = rounding_base(seed, step)
    keys = keys.to(torch.int64)
    high = _fmix32(((keys >> 32) & _M32) ^ base)
    r = _fmix32(((keys & _M32) * 0x27D4EB2F) ^ high)
    cols = torch.arange(dim, dtype=torch.int64, device=keys.device)
    h = _fmix32(r[:, None] * 0x165667B1 + cols[None, :])
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) in ``dtype`` (float16 or bfloat16), rounded up in magnitude where
    ``noise`` (uniform ``[0, 1)``, ``x``'s shape) is below the fraction of the way from the
    storage value below ``|x|`` to the one above (module doc). NaN and infinities stay as
    they are; a value past the type's range saturates at its largest finite value."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"stochastic rounding stores float16 or bfloat16, not {dtype}")
    lo_bits, hi_bits = _neighbour_bits(x, dtype)
    lo, hi = lo_bits.view(dtype).float(), hi_bits.view(dtype).float()
    up = noise < (x - lo) / (hi - lo)  # False where x is lo exactly, or NaN, or infinite
    return torch.where(up, hi_bits, lo_bits).view(dtype)


def _neighbour_bits(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The int16 bits of the ``dtype`` values just below and just above ``|x|`` in magnitude
    (``x`` itself below where ``dtype`` holds it exactly)."""
    nearest = x.to(dtype)
    bits = nearest.view(torch.int16)
    # Sign-magnitude: for either sign, one less in the int16 view is one step toward zero.
    lo_bits = torch.where(nearest.float().abs() > x.abs(), bits - 1, bits)
    return lo_bits, lo_bits + 1


def rounded_match(
    stored: torch.Tensor, x: torch.Tensor, dtype: torch.dtype, noise: torch.Tensor, rtol: float, atol: float
) -> torch.Tensor:
    """Elementwise: ``stored`` (the table's half-precision values, as float32) is the rounding
    of a reference's float32 update ``x`` with ``noise``, allowing for the update itself being
    equal only to ``atol + rtol * |x|``: where the draw lies within that much of the threshold
    between the two neighbours of ``x``, either neighbour is a match (two float32 results that
    differ in their last bits may round apart there); elsewhere only the rounding of ``x``."""
    lo_bits, hi_bits = _neighbour_bits(x, dtype)
    lo, hi = lo_bits.view(dtype).float(), hi_bits.view(dtype).float()
    exact = stored == stochastic_round(x, dtype, noise).float()
    step = (hi - lo).abs()
    p = (x - lo) / (hi - lo)
    close = (noise - p).abs() * step <= atol + rtol * x.abs()
    return exact | (close & ((stored == lo) | (stored == hi)))
