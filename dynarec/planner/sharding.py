"""How a table is spread over the ranks of a multi-process run, and where each id lives.

- ``data_parallel``: every rank holds the whole table (small fixed tables); the row gradients
  of a step are summed over the ranks before the fused update, so the replicas stay
  bit-identical.
- ``table_wise``: one rank holds the whole table.
- ``row_wise`` (fixed tables): rank ``r`` holds the contiguous rows ``[bounds[r], bounds[r+1])``.
- ``key_hash`` (dynamic tables): a key lives on rank ``mix64(key ^ SALT) mod world``: hash bits
  independent of the two that pick its buckets, so every shard uses all of its buckets.

A :class:`TableSharding` answers, for ids or keys, which rank owns them and what they are called
there (a row-wise shard numbers its rows from 0); sharded lookups route by it and checkpoints
are re-split by it when the world size changes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from dynarec.embedding.config import SHARDING_TYPES, ShardingType
from dynarec.embedding.initializers import mix64

__all__ = ["SHARDING_TYPES", "ShardingType", "TableSharding", "key_owner"]


_OWNER_SALT = 0x2545F4914F6CDD1D  # makes the owner's hash independent of the buckets' mix64(key)
_POSITIVE = (1 << 63) - 1


def key_owner(keys: torch.Tensor, world_size: int) -> torch.Tensor:
    """The rank that owns each key of a key-hash sharded table."""
    return (mix64(keys ^ _OWNER_SALT) & _POSITIVE) % world_size


@dataclass(frozen=True)
class TableSharding:
    """The sharding of one table over ``world_size`` ranks.

    ``ranks``: the ranks holding a part (table_wise: the one owner); ``row_bounds``: row_wise's
    ``world_size + 1`` boundaries; ``capacity_per_rank``: key_hash's per-shard max_capacity.
    """

    kind: ShardingType
    world_size: int
    ranks: tuple[int, ...]
    row_bounds: Optional[tuple[int, ...]] = None
    capacity_per_rank: Optional[int] = None

    @property
    def routed(self) -> bool:
        """Whether lookups go to other ranks (everything but data_parallel)."""
        return self.kind != "data_parallel"

    def holds(self, rank: int) -> bool:
        return rank in self._rank_set

    @functools.cached_property
    def _rank_set(self) -> frozenset[int]:  # (a plan asks of every rank: a tuple's scan made it quadratic)
        return frozenset(self.ranks)

    def owner(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rank, id on that rank)`` of each id or key."""
        if self.kind == "table_wise":
            return torch.full_like(ids, self.ranks[0]), ids
        if self.kind == "row_wise":
            assert self.row_bounds is not None
            bounds = torch.tensor(self.row_bounds, dtype=torch.int64, device=ids.device)
            rank = torch.searchsorted(bounds[1:-1], ids, right=True)
            return rank, ids - bounds[rank]
        if self.kind == "key_hash":
            return key_owner(ids, self.world_size), ids
        raise ValueError(f"{self.kind} tables are not routed")

    def rows_of(self, rank: int) -> tuple[int, int]:
        """row_wise: the ``[start, end)`` rows rank ``rank`` holds."""
        assert self.row_bounds is not None
        return self.row_bounds[rank], self.row_bounds[rank + 1]

    def describe_ranks(self) -> str:
        if len(self.ranks) == self.world_size and self.world_size > 1:
            return f"0..{self.world_size - 1}"
        return ",".join(map(str, self.ranks))

    @staticmethod
    def row_wise(num_rows: int, world_size: int) -> TableSharding:
        """Contiguous, near-equal row ranges (the first ranks take one more row)."""
        base, extra = divmod(num_rows, world_size)
        bounds = [0]
        for r in range(world_size):
            bounds.append(bounds[-1] + base + (1 if r < extra else 0))
        return TableSharding("row_wise", world_size, tuple(range(world_size)), row_bounds=tuple(bounds))
