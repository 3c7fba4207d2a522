"""Planning an insert into a :class:`~dynarec.embedding.hash_index.BucketedHashIndex`: which slot
each new key takes, which residents move to their other bucket to make room, which are evicted.
A plan writes nothing; the index's ``commit`` writes it.

Keys are ranked (by descending priority when given, then ascending key) and claim slots in rounds,
in that order: the plan follows from the keys and the index alone. The planner is the
``dynarec::plan_insert`` op (its three steps: ``dynarec.kernels.reference.plan``), whose C++,
Triton and plain-torch implementations give the same plan, bit for bit;
:func:`plan_insert_reference` runs the plain-torch one, which the tests hold the others to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

import dynarec.kernels.ops  # noqa: F401  (registers torch.ops.dynarec)
from dynarec.kernels import reference
from dynarec.kernels.layout import NO_SLOT

__all__ = ["PIN_WRAP", "IndexArrays", "InsertPlan", "plan_insert", "plan_insert_reference"]

PIN_WRAP = (1 << 31) - 1  # step ids are stored modulo this in the int32 pins


class IndexArrays(Protocol):
    """What a planner reads of an index: its arrays (one entry a slot) and its shape."""

    @property
    def keys(self) -> torch.Tensor: ...
    @property
    def tags(self) -> torch.Tensor: ...
    @property
    def scores(self) -> torch.Tensor: ...
    @property
    def pins(self) -> torch.Tensor: ...
    @property
    def num_buckets(self) -> int: ...
    @property
    def bucket_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def capacity(self) -> int: ...
    @property
    def size(self) -> int: ...


@dataclass
class InsertPlan:
    """Where each new key goes, and what moves to make room.

    ``slots[i] == NO_SLOT``: key ``i`` found no slot (overflow). ``evicted_slots``: occupied slots
    whose key is evicted (the new key takes the slot). ``moved_from`` / ``moved_to``: residents
    moved to their other bucket (one cuckoo step); a new key takes each ``moved_from`` slot.
    ``num_placed``: how many keys got a slot, when the planner knows it on the host (else
    :attr:`placed` reads it once).
    """

    keys: torch.Tensor
    slots: torch.Tensor
    evicted_slots: torch.Tensor
    moved_from: torch.Tensor
    moved_to: torch.Tensor
    num_placed: Optional[int] = None

    @property
    def placed(self) -> int:
        """Keys that got a slot (a host read only if the planner did not count them)."""
        if self.num_placed is None:
            self.num_placed = int((self.slots != NO_SLOT).sum())
        return self.num_placed

    @property
    def dropped(self) -> int:
        """Keys left without a slot."""
        return self.keys.numel() - self.placed

    @property
    def only_adds(self) -> bool:
        """Whether the plan only places new keys in free slots (no resident evicted or moved)."""
        return not (self.evicted_slots.numel() or self.moved_from.numel())

    @property
    def overwritten_slots(self) -> torch.Tensor:
        """Slots whose previous contents a commit replaces (evicted and moved residents' rows)."""
        return torch.cat([self.evicted_slots, self.moved_from])


def plan_insert(
    index: IndexArrays,
    keys: torch.Tensor,
    pinned_by: Optional[torch.Tensor] = None,
    allow_evict: bool = True,
    priority: Optional[torch.Tensor] = None,
    movable_pins: Optional[torch.Tensor] = None,
    keys_ascending: bool = False,
    key_parts: Optional[torch.Tensor] = None,
) -> InsertPlan:
    """Plans inserting ``keys`` (unique, absent from ``index``), writing nothing
    (``BucketedHashIndex.plan_insert`` says what a plan is): the ``dynarec::plan_insert`` op.
    ``key_parts``: each key's partition of a partitioned index (``index.part_starts``:
    ``IndexStorage``)."""
    return _plan_insert(torch.ops.dynarec.plan_insert, index, keys, pinned_by, allow_evict, priority, movable_pins,
                        keys_ascending, key_parts)  # fmt: skip


def plan_insert_reference(
    index: IndexArrays,
    keys: torch.Tensor,
    pinned_by: Optional[torch.Tensor] = None,
    allow_evict: bool = True,
    priority: Optional[torch.Tensor] = None,
    movable_pins: Optional[torch.Tensor] = None,
    keys_ascending: bool = False,
) -> InsertPlan:
    """:func:`plan_insert` by the plain-torch planner (any device): the reference the C++ and
    Triton planners are tested against."""
    return _plan_insert(reference.plan_insert, index, keys, pinned_by, allow_evict, priority, movable_pins,
                        keys_ascending)  # fmt: skip


def _plan_insert(
    planner,
    index: IndexArrays,
    keys: torch.Tensor,
    pinned_by: Optional[torch.Tensor],
    allow_evict: bool,
    priority: Optional[torch.Tensor],
    movable_pins: Optional[torch.Tensor],
    keys_ascending: bool,
    key_parts: Optional[torch.Tensor] = None,
) -> InsertPlan:
    n = keys.numel()
    if n == 0:
        empty = torch.empty(0, dtype=torch.int64, device=index.device)
        return InsertPlan(keys, empty, empty, empty, empty, 0)
    order = _rank_order(keys, priority, keys_ascending)
    # The callers' step ids may be on the host: each planner moves them to the device only when
    # its steps 2-3 need them.
    move_pins = _wrapped(_move_pins(pinned_by, movable_pins))
    slots, left, moved_from, moved_to, evicted = planner(
        index.tags, index.keys, index.scores, index.pins, index.num_buckets, index.bucket_size, keys, order,
        move_pins, _wrapped(pinned_by), allow_evict, index.capacity - index.size,
        *(() if key_parts is None else (index.part_starts, key_parts)),  # type: ignore[attr-defined]
    )  # fmt: skip
    # every key left after step 2 that got a slot took an evicted one
    return InsertPlan(keys, slots, evicted, moved_from, moved_to, n - left.numel() + evicted.numel())


def _rank_order(keys: torch.Tensor, priority: Optional[torch.Tensor], keys_ascending: bool) -> torch.Tensor:
    """The keys' indices in rank order: descending ``priority`` (when given), then ascending key
    (``keys_ascending``: the keys are in ascending order already, so no sort)."""
    if keys_ascending:
        order = torch.arange(keys.numel(), device=keys.device)
    else:
        order = torch.argsort(keys, stable=True)
    if priority is not None:
        order = order[torch.argsort(-priority[order], stable=True)]
    return order


def _wrapped(step_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Step ids as the pins hold them (modulo :data:`PIN_WRAP`)."""
    return None if step_ids is None else step_ids % PIN_WRAP


def _move_pins(pinned_by: Optional[torch.Tensor], movable_pins: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The steps whose rows a plan may not move: ``pinned_by`` but ``movable_pins`` (on
    ``pinned_by``'s device)."""
    if pinned_by is None or movable_pins is None:
        return pinned_by
    return pinned_by[~torch.isin(pinned_by, movable_pins.to(pinned_by.device))]
