"""Key-seeded initializers: a row's initial values are a function of ``(seed, key)`` only.

That makes a dynamic table independent of insertion order and sharding, and lets a fixed table
(keys ``0..N-1``) start from exactly the weights a dynamic table gives the same keys. Every value
comes from a counter-based integer hash (SplitMix64, ``mix64``) of the key (the
``dynarec::uniform01`` and ``dynarec::uniform_rows`` ops: C++ on CPUs, Triton kernels on GPUs,
int64 tensor ops elsewhere), so CPU and CUDA produce the same bits for uniform and constant
initializers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal, Optional, get_args

import torch

import dynarec.kernels.ops  # noqa: F401  (registers torch.ops.dynarec)
from dynarec.kernels.reference import mix64, uniform_values

__all__ = ["INITIALIZER_KINDS", "Initializer", "InitializerKind", "mix64"]

InitializerKind = Literal["uniform", "normal", "truncated_normal", "constant"]
INITIALIZER_KINDS: tuple[str, ...] = get_args(InitializerKind)


@dataclass(frozen=True)
class Initializer:
    """How a row's initial weights are drawn.

    ``uniform``: U(-bound, bound); ``normal``: N(mean, std); ``truncated_normal``: N(mean, std)
    cut at two std; ``constant``: ``value``. ``bound``/``std`` default to the table's default
    bound (``sqrt(1/num_embeddings)`` for fixed tables, ``sqrt(1/max_capacity)`` for dynamic
    ones) when left None.
    """

    kind: InitializerKind = "uniform"
    bound: Optional[float] = None
    mean: float = 0.0
    std: Optional[float] = None
    value: float = 0.0

    # Validated straight from YAML by pydantic; unknown keys are errors.
    __pydantic_config__: ClassVar[dict] = {"extra": "forbid"}

    def __post_init__(self) -> None:
        if self.kind not in INITIALIZER_KINDS:
            raise ValueError(f"initializer kind must be one of {INITIALIZER_KINDS}, got {self.kind!r}")
        for field in ("bound", "std", "mean", "value"):
            v = getattr(self, field)
            if v is None and field in ("bound", "std"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"initializer {field} must be a finite number, got {v!r}")
            if field in ("bound", "std") and v < 0:
                raise ValueError(f"initializer {field} must be >= 0, got {v!r}")

    @property
    def is_zero(self) -> bool:
        return self.kind == "constant" and self.value == 0.0

    def values(
        self, keys: torch.Tensor, dim: int, seed: int, default_bound: float, chunk_elements: int = 1 << 24
    ) -> torch.Tensor:
        """Initial weights ``[len(keys), dim]`` float32 for int64 ``keys``, on their device. The
        draws are float64, made ``chunk_elements`` at a time (bounding the float64 temporaries;
        the values do not depend on it)."""
        keys = keys.long()
        if self.kind == "constant":
            return torch.full((keys.numel(), dim), self.value, dtype=torch.float32, device=keys.device)
        chunk_rows = max(1, chunk_elements // max(dim, 1))
        chunks = [
            self._draw(keys[i : i + chunk_rows], dim, seed, default_bound) for i in range(0, keys.numel(), chunk_rows)
        ]
        if not chunks:
            return torch.empty(0, dim, dtype=torch.float32, device=keys.device)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    @torch.no_grad()
    def write_rows(
        self, out: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, seed: int, default_bound: float
    ) -> None:
        """``out[rows[i]] = values(keys)[i]`` in ``out``'s dtype (rounded to nearest); ``out``:
        ``[num_rows, dim]``, ``rows`` distinct. Uniform draws are written in place by one op
        (``dynarec::uniform_rows``: the same bits, no ``[n, dim]`` float64 temporaries); the rest
        through :meth:`values`."""
        if self.kind == "uniform":
            bound = default_bound if self.bound is None else self.bound
            torch.ops.dynarec.uniform_rows(out, rows, keys.long(), seed, 0, float(bound))
            return
        out.index_copy_(0, rows, self.values(keys, out.shape[1], seed, default_bound).to(out.dtype))

    def _draw(self, keys: torch.Tensor, dim: int, seed: int, default_bound: float) -> torch.Tensor:
        u = torch.ops.dynarec.uniform01(keys, dim, seed, 0)
        if self.kind == "uniform":
            return uniform_values(u, default_bound if self.bound is None else self.bound)
        std = default_bound if self.std is None else self.std
        if self.kind == "normal":
            u2 = torch.ops.dynarec.uniform01(keys, dim, seed, 1)
            z = torch.sqrt(-2.0 * torch.log(u)) * torch.cos(2.0 * math.pi * u2)
        else:  # truncated_normal: inverse CDF restricted to [-2, 2]
            lo = 0.5 * (1.0 + math.erf(-2.0 / math.sqrt(2.0)))
            p = lo + u * (1.0 - 2.0 * lo)
            z = math.sqrt(2.0) * torch.erfinv(2.0 * p - 1.0)
        return (self.mean + std * z).float()
