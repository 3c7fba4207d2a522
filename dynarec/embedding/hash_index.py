"""A two-choice bucketed hash index: int64 key -> slot, with an int64 score and a pin per slot.

``capacity = num_buckets * bucket_size`` slots. A key has two candidate buckets, from the low
and the high 32 bits of ``mix64(key)``; it lives in one of them, so a lookup gathers two buckets
and compares. Placing a key in the emptier of its two buckets, and moving one resident to its
other bucket when both are full (one cuckoo step), keeps keys from being evicted while the table
is far from full: at 90% load, none of 1M keys (one-choice buckets of 16 evicted 5.9%).

Every operation is a batched tensor op with no Python loop per key, identical on CPU and CUDA,
and deterministic: the keys of one insert are ranked (priority descending, then key ascending)
and claim slots in rounds in that order, never raced with atomics.

The whole int64 range is a valid key: occupancy is a separate byte per slot, its *tag*: 0 for an
empty slot, else a nonzero byte of the key's hash (:func:`key_tags`). A lookup compares a lane's
tag before its key, so a bucket costs 16 bytes of tags plus the one key whose tag matches (on a
GPU, one 32-byte sector instead of the 128-byte line of keys; an absent key rarely reads a key).
A free slot holds key 0 and score 0 as well (``remove`` clears them), so undoing a commit of new
keys into free slots needs nothing read before it.

The index owns its arrays; callers change them only through its methods (``commit``, ``remove``,
``touch``, ``add``, ``pin``, ``install``, ``rehashed``). Each mutating method takes an optional
:class:`Journal` and records how to undo itself, so a failed training step can be rolled back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from dynarec.embedding.initializers import mix64
from dynarec.embedding.step import Journal
from dynarec.embedding.streams import current_stream
from dynarec.kernels import cpu as cpu_kernels
from dynarec.kernels import gpu as gpu_kernels

__all__ = ["LAYOUT_VERSION", "PIN_WRAP", "BucketedHashIndex", "InsertPlan", "candidate_buckets", "key_tags"]

PIN_WRAP = (1 << 31) - 1  # step ids are stored modulo this in the int32 pins
LAYOUT_VERSION = 2  # 1: one bucket per key; 2: two candidate buckets (dumps record it)
_LOW32 = (1 << 32) - 1
_SERIALS = itertools.count()  # of index objects: a stamp never matches another index's
_NONE = -1


def candidate_buckets(keys: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two candidate buckets of each key: the low and the high 32 bits of ``mix64(key)``,
    each modulo ``num_buckets`` (they may coincide). Sharding uses other hash bits."""
    kernels = cpu_kernels.ops() if keys.device.type == "cpu" else None
    if kernels is not None:
        b1, b2 = kernels.candidate_buckets(keys.contiguous(), num_buckets)
        return b1, b2
    if gpu_kernels.available(keys.device):
        return gpu_kernels.candidate_buckets(keys, num_buckets)
    return candidate_buckets_reference(keys, num_buckets)


def key_tags(keys: torch.Tensor) -> torch.Tensor:
    """The tag of each key: the top byte of ``mix64(key)``, 1 where that byte is 0 (0 marks an
    empty slot). ``[n]`` uint8. Bucket choice uses ``mix64``'s two 32-bit halves modulo the
    bucket count, so for up to 2^24 buckets (a power of two) the tag bits are independent of it."""
    tag = (mix64(keys) >> 56) & 0xFF
    return torch.where(tag == 0, 1, tag).to(torch.uint8)


def candidate_buckets_reference(keys: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch :func:`candidate_buckets` (any device)."""
    h = mix64(keys)
    return (h & _LOW32) % num_buckets, ((h >> 32) & _LOW32) % num_buckets


@dataclass
class InsertPlan:
    """Where each new key goes, and what moves to make room.

    ``slots[i] == -1``: key ``i`` found no slot (overflow). ``evicted_slots``: occupied slots
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
            self.num_placed = int((self.slots >= 0).sum())
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


class _Buckets:
    """A working copy of some buckets' occupancy during one insert plan (nothing is written to the
    index until commit). ``claimed`` marks slots this plan gives away (to a new key or a moved
    resident): they are neither free, nor movable, nor evictable again."""

    def __init__(self, index: BucketedHashIndex, buckets: torch.Tensor):
        self.index = index
        self.ids = torch.empty(0, dtype=torch.int64, device=index.device)
        self.occupied = torch.empty(0, index.bucket_size, dtype=torch.bool, device=index.device)
        self.claimed = torch.empty(0, index.bucket_size, dtype=torch.bool, device=index.device)
        self.add(buckets)

    def add(self, buckets: torch.Tensor) -> None:
        """Brings ``buckets`` into the working set (those already in it keep their state)."""
        new = torch.unique(buckets)
        new = new[~torch.isin(new, self.ids)]
        if not new.numel():
            return
        bs = self.index.bucket_size
        occupied = self.index.tags.view(-1, bs).index_select(0, new) != 0
        claimed = torch.zeros_like(occupied)
        ids = torch.cat([self.ids, new])
        order = torch.argsort(ids)
        self.ids = ids[order]
        self.occupied = torch.cat([self.occupied, occupied])[order]
        self.claimed = torch.cat([self.claimed, claimed])[order]

    def rows(self, buckets: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.ids, buckets)

    def free(self, buckets: torch.Tensor) -> torch.Tensor:
        """Free (unoccupied, unclaimed) slots of each bucket."""
        r = self.rows(buckets)
        return (~(self.occupied[r] | self.claimed[r])).sum(1)

    def claim_free(self, buckets: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
        """The ``rank``-th free lane (ascending) of each bucket, claimed; returns its slot."""
        bs = self.index.bucket_size
        r = self.rows(buckets)
        taken = (self.occupied[r] | self.claimed[r]).to(torch.int8)
        lane = torch.argsort(taken, dim=1, stable=True).gather(1, rank[:, None]).squeeze(1)
        self.claimed[r, lane] = True
        return buckets * bs + lane

    def claim(self, slots: torch.Tensor) -> None:
        bs = self.index.bucket_size
        self.claimed[self.rows(slots // bs), slots % bs] = True

    def is_claimed(self, slots: torch.Tensor) -> torch.Tensor:
        bs = self.index.bucket_size
        return self.claimed[self.rows(slots // bs), slots % bs]


def _wrapped(step_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Step ids as the pins hold them (modulo :data:`PIN_WRAP`)."""
    return None if step_ids is None else step_ids % PIN_WRAP


def _move_pins(pinned_by: Optional[torch.Tensor], movable_pins: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The steps whose rows a plan may not move: ``pinned_by`` but ``movable_pins`` (on
    ``pinned_by``'s device)."""
    if pinned_by is None or movable_pins is None:
        return pinned_by
    return pinned_by[~torch.isin(pinned_by, movable_pins.to(pinned_by.device))]


def _rank_within(groups: torch.Tensor) -> torch.Tensor:
    """Position of each element among the elements of its group, in input order."""
    order = torch.argsort(groups, stable=True)
    sorted_groups = groups[order]
    _, inverse, counts = torch.unique_consecutive(sorted_groups, return_inverse=True, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(groups)
    rank[order] = torch.arange(groups.numel(), device=groups.device) - starts[inverse]
    return rank


def _first_per_group(groups: torch.Tensor) -> torch.Tensor:
    """Mask of the first element (in input order) of each group."""
    return _rank_within(groups) == 0


class BucketedHashIndex:
    def __init__(self, num_buckets: int, bucket_size: int, device: torch.device | str = "cpu"):
        if num_buckets < 1 or bucket_size < 1:
            raise ValueError(f"num_buckets and bucket_size must be >= 1, got {num_buckets}, {bucket_size}")
        self.num_buckets = num_buckets
        self.bucket_size = bucket_size
        self.device = torch.device(device)
        cap = num_buckets * bucket_size
        self.keys = torch.zeros(cap, dtype=torch.int64, device=self.device)
        self.scores = torch.zeros(cap, dtype=torch.int64, device=self.device)
        self.tags = torch.zeros(cap, dtype=torch.uint8, device=self.device)  # 0: empty (key_tags)
        # The id of the last training step that pinned the slot (-1: never); a slot is pinned while
        # that step is pending (StepLifecycle). Step ids are never reused (int32: they wrap after
        # 2^31 steps, when a row untouched that long could look pinned for one step), so the pin
        # of an aborted step pins nothing and needs no undo.
        self._pins = torch.full((cap + 1,), -1, dtype=torch.int32, device=self.device)  # the last: pin()'s -1s
        self.pins = self._pins[:cap]
        self._size = 0
        self._lanes = torch.arange(bucket_size, dtype=torch.int64, device=self.device)
        # The last write's event and its stream's id, and the last find's event on each stream (CUDA)
        self._written = torch.cuda.Event() if self.device.type == "cuda" else None
        self._written_on: Optional[int] = None
        self._finds: dict[int, torch.cuda.Event] = {}
        self._serial = next(_SERIALS)
        self._writes = 0
        self._displacements = 0
        self._wrote()

    def _wrote(self, only_added: bool = False, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Marks the keys and tags as written by the work queued so far on the current stream
        (``stream``: the current one, already known; each ask costs a host call): a later
        :meth:`find` on another stream waits for it (a collection runs its finds on its input
        stream, ahead of the main stream's work: :mod:`.streams`), and :attr:`stamp` changes.
        ``only_added``: the write only placed keys in free slots (every key present before is
        still in its slot)."""
        self._writes += 1
        if not only_added:
            self._displacements += 1
        if self._written is not None:  # CUDA
            stream = stream or current_stream(self.device)
            # One event, recorded again: a wait queued earlier keeps the record it was queued after
            self._written.record(stream)
            self._written_on = stream.stream_id

    def _after_writes(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Makes the current stream (or ``stream``: the current one, already known) wait for the
        last write, queued on another stream (a find reads what it wrote; on the same stream,
        the order is the stream's)."""
        if self._written is None or self._written_on is None:
            return
        stream = stream or current_stream(self.device)
        if self._written_on != stream.stream_id:
            stream.wait_event(self._written)

    def _before_write(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Makes the current stream (or ``stream``: the current one, already known) wait for
        every find queued so far on another stream: a write never changes keys or tags a find
        is still reading (a find made two steps ahead, on the input stream, may still run when
        the next step inserts)."""
        if self._finds:
            stream = stream or current_stream(self.device)
            for stream_id, done in self._finds.items():
                if stream_id != stream.stream_id:
                    stream.wait_event(done)

    @property
    def stamp(self) -> tuple[int, int, int]:
        """The state of the keys: ``(this index's serial number, writes that moved or removed
        keys, all writes)``. Equal stamps: equal keys in equal slots (a find made at one stamp
        holds at the other). Equal but for the last: keys were only added, so a key found then
        is still in its slot (a key absent then may be present now)."""
        return self._serial, self._displacements, self._writes

    @property
    def capacity(self) -> int:
        return self.num_buckets * self.bucket_size

    @property
    def occupied(self) -> torch.Tensor:
        """``[capacity]`` bool, a new tensor: whether each slot holds a key."""
        return self.tags != 0

    @property
    def size(self) -> int:
        """Occupied slots."""
        return self._size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.scores, self.tags, self.pins))

    # -- reads -------------------------------------------------------------------------------

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slot of each key, ``-1`` where absent. ``keys``: ``[n]`` int64. On a GPU, on any
        stream: it waits for the writes queued before it, and the writes queued after it wait
        for it."""
        return self._find(keys, flag=False)[0]

    def find_flagged(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`find`, and whether any key is absent: a ``[]`` tensor on the device, nonzero if
        one is (the GPU kernel sets it in the same pass: no second read of the slots)."""
        slots, absent = self._find(keys, flag=True)
        return slots, (slots < 0).any() if absent is None else absent

    def _find(self, keys: torch.Tensor, flag: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        kernels = cpu_kernels.ops() if self.device.type == "cpu" else None
        if kernels is not None:
            slots = kernels.find_two_choice(self.keys, self.tags, self.num_buckets, self.bucket_size, keys.contiguous())
            return slots, None
        if self.device.type != "cuda":
            return self.find_reference(keys), None
        stream = current_stream(self.device)
        self._after_writes(stream)
        absent = None
        if gpu_kernels.available(self.device):
            absent = torch.zeros((), dtype=torch.int32, device=self.device) if flag else None
            slots = gpu_kernels.find_two_choice(self.keys, self.tags, self.num_buckets, self.bucket_size, keys, absent)
        else:
            slots = self.find_reference(keys)
        done = self._finds.get(stream.stream_id)
        if done is None:
            done = self._finds[stream.stream_id] = torch.cuda.Event()
        done.record(stream)  # one event a stream, recorded again (as _wrote's)
        return slots, absent

    def find_reference(self, keys: torch.Tensor) -> torch.Tensor:
        """Plain-torch :meth:`find` (any device): gathers both buckets of every key and compares."""
        n, bs = keys.numel(), self.bucket_size
        b1, b2 = candidate_buckets_reference(keys, self.num_buckets)
        buckets = torch.cat([b1, b2])
        # Gather both buckets of every key as contiguous rows (one index_select each array).
        bucket_keys = self.keys.view(-1, bs).index_select(0, buckets)
        bucket_occ = self.tags.view(-1, bs).index_select(0, buckets) != 0
        match = (bucket_keys == torch.cat([keys, keys])[:, None]) & bucket_occ
        hit, lane = match.view(torch.uint8).max(dim=1)  # one pass: whether and where
        slots = buckets * bs + lane
        return torch.where(hit[:n].bool(), slots[:n], torch.where(hit[n:].bool(), slots[n:], -torch.ones_like(keys)))

    def entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(slots, keys, scores)`` of every occupied slot, ordered by key."""
        slots = torch.nonzero(self.tags).flatten()
        keys = self.keys[slots]
        order = torch.argsort(keys)
        slots = slots[order]
        return slots, keys[order], self.scores[slots]

    # -- planning an insert ------------------------------------------------------------------

    def plan_insert(
        self,
        keys: torch.Tensor,
        pinned_by: Optional[torch.Tensor] = None,
        allow_evict: bool = True,
        priority: Optional[torch.Tensor] = None,
        movable_pins: Optional[torch.Tensor] = None,
        keys_ascending: bool = False,
        kernels: bool = True,
    ) -> InsertPlan:
        """Plans inserting ``keys`` (unique, absent), writing nothing. ``keys_ascending``: the
        caller's keys are in ascending order (``torch.unique``'s output), so ranking them by
        key needs no sort.

        Keys are ranked by descending ``priority`` (when given), then ascending key, and claim
        slots in rounds, in that order:

        1. a free slot of the emptier of its two buckets (ties: the first bucket), lanes in
           ascending order;
        2. when both are full: the slot of a resident of one of its buckets (first bucket's lanes
           first) that moves to a free slot of its own other bucket (one cuckoo step);
        3. when ``allow_evict`` and that fails too: the slot of the lowest-score row among its two
           buckets (ties to the smaller slot) that no earlier key claimed.

        Rows pinned by one of the steps ``pinned_by`` are neither moved nor evicted, and neither
        is a slot this plan already gave away; rows pinned by one of ``movable_pins`` (a subset
        of ``pinned_by``: the step inserting, which finds its keys' slots again after the
        commit) may move but not be evicted. A key left without a slot gets ``-1``. The two step-id
        tensors may be on the host: only steps 2-3 need them on the device.

        ``kernels=False``: plain-torch ops alone (any device), the reference the CPU extension's
        planner and the GPU kernels are tested against.
        """
        n = keys.numel()
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        out = torch.full((n,), _NONE, dtype=torch.int64, device=self.device)
        if n == 0:
            return InsertPlan(keys, out, empty, empty, empty, 0)
        if keys_ascending:
            order = torch.arange(n, device=self.device)
        else:
            order = torch.argsort(keys, stable=True)
        if priority is not None:
            order = order[torch.argsort(-priority[order], stable=True)]
        gpu_steps = kernels and self.bucket_size <= 64 and gpu_kernels.available(self.device)
        if gpu_steps:  # the three steps by the GPU kernels, which hash the keys themselves
            return self._plan_on_gpu(keys, order, out, pinned_by, allow_evict, movable_pins)
        b1, b2 = (
            candidate_buckets(keys, self.num_buckets)
            if kernels
            else candidate_buckets_reference(keys, self.num_buckets)
        )
        if pinned_by is not None:  # the callers' step ids may be on the host: moved only now
            pinned_by = pinned_by.to(self.device)
        move_pins = _move_pins(pinned_by, movable_pins)
        cpu_ops = None
        if kernels and self.device.type == "cpu" and self.bucket_size <= 64:
            cpu_ops = cpu_kernels.ops()
        if cpu_ops is not None:  # the three steps in one C++ call
            left, moved_from, moved_to, evicted = cpu_ops.plan_insert(
                self.tags, self.keys, self.scores, self.pins, self.num_buckets, self.bucket_size, b1, b2, order, out,
                empty if move_pins is None else (move_pins % PIN_WRAP).long(),
                empty if pinned_by is None else (pinned_by % PIN_WRAP).long(),
                allow_evict,
            )  # fmt: skip
            return InsertPlan(keys, out, evicted, moved_from, moved_to, n - left.numel() + evicted.numel())
        work = _Buckets(self, torch.cat([b1, b2]))
        todo = self._claim_free_slots(work, order, b1, b2, out)
        moved_from, moved_to = empty, empty
        if todo.numel():
            todo, moved_from, moved_to = self._claim_by_moving(work, todo, b1, b2, out, move_pins, kernels)
        evicted = empty
        if todo.numel() and allow_evict:
            evicted = self._claim_by_evicting(work, todo, b1, b2, out, pinned_by)
        # every key left after step 2 that got a slot took an evicted one
        return InsertPlan(keys, out, evicted, moved_from, moved_to, n - todo.numel() + evicted.numel())

    def _plan_on_gpu(
        self,
        keys: torch.Tensor,
        order: torch.Tensor,
        out: torch.Tensor,
        pinned_by: Optional[torch.Tensor],
        allow_evict: bool,
        movable_pins: Optional[torch.Tensor],
    ) -> InsertPlan:
        """:meth:`plan_insert`'s three steps by the GPU kernels (the plain-torch rounds exactly),
        the plan's claims kept as one bit mask a bucket."""
        keys = keys.contiguous()  # the kernels read it by index
        n, nb, bs = keys.numel(), self.num_buckets, self.bucket_size
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        masks = torch.zeros(nb, dtype=torch.int64, device=self.device)  # the plan's claims, none yet
        todo = gpu_kernels.claim_free_slots(self.tags, nb, bs, keys, order, out, masks)
        moved_from, moved_to, evicted = empty, empty, empty
        state = gpu_kernels.PlanState(self.keys, self.tags, self.scores, self.pins, masks, nb, bs)
        if todo.numel():  # the step ids, maybe on the host, go to the device only now
            move_pins = _wrapped(_move_pins(pinned_by, movable_pins))
            todo, moved_from, moved_to = gpu_kernels.claim_by_moving(state, keys, todo, out, move_pins)
        if todo.numel() and allow_evict:
            evicted = gpu_kernels.claim_by_evicting(state, keys, todo, out, _wrapped(pinned_by))
        # every key left after step 2 that got a slot took an evicted one
        return InsertPlan(keys, out, evicted, moved_from, moved_to, n - todo.numel() + evicted.numel())

    def _claim_free_slots(
        self, work: _Buckets, todo: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """Step 1; returns the keys (indices, in rank order) whose two buckets are full. (On a CPU
        the extension's ``claim_free_slots`` runs the same rounds; the tests hold them equal.)"""
        while todo.numel():
            f1, f2 = work.free(b1[todo]), work.free(b2[todo])
            live = (f1 > 0) | (f2 > 0)
            if not bool(live.any()):
                break
            keys, f1, f2 = todo[live], f1[live], f2[live]
            choice = torch.where(f2 > f1, b2[keys], b1[keys])
            rank = _rank_within(choice)  # keys are in rank order: better-ranked keys go first
            ok = rank < torch.maximum(f1, f2)  # every round places at least each bucket's first key
            out[keys[ok]] = work.claim_free(choice[ok], rank[ok])
            todo = todo[out[todo] < 0]
        return todo

    def _movable(self, slots: torch.Tensor, work: _Buckets, pinned_by: Optional[torch.Tensor]) -> torch.Tensor:
        """Occupied slots holding a resident that may be moved or evicted (not pinned, not claimed)."""
        ok = (self.tags[slots] != 0) & ~work.is_claimed(slots)
        if pinned_by is not None and pinned_by.numel():
            ok &= ~torch.isin(self.pins[slots], pinned_by % PIN_WRAP)
        return ok

    def _candidates(self, todo: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
        """``[m, 2 * bucket_size]`` slots of each key's two buckets (first bucket's lanes first)."""
        bs = self.bucket_size
        return torch.cat([b1[todo, None] * bs + self._lanes, b2[todo, None] * bs + self._lanes], dim=1)

    def _claim_by_moving(
        self,
        work: _Buckets,
        todo: torch.Tensor,
        b1: torch.Tensor,
        b2: torch.Tensor,
        out: torch.Tensor,
        pinned_by: Optional[torch.Tensor],
        kernels: bool = True,
    ):
        """Step 2; returns the keys left, and the moves ``(from, to)``."""
        bs = self.bucket_size
        froms, tos = [], []
        while todo.numel():
            cand = self._candidates(todo, b1, b2)  # [m, 2bs]
            flat = cand.flatten()
            residents = self.keys[flat]
            if kernels:
                r1, r2 = candidate_buckets(residents, self.num_buckets)
            else:
                r1, r2 = candidate_buckets_reference(residents, self.num_buckets)
            own = flat // bs
            alt = torch.where(r1 == own, r2, r1)
            work.add(alt)
            ok = self._movable(flat, work, pinned_by) & (alt != own) & (work.free(alt) > 0)
            ok = ok.view(cand.shape)
            has = ok.any(dim=1)
            if not bool(has.any()):
                break
            pick = ok.to(torch.int8).argmax(dim=1)  # the first movable resident with room elsewhere
            keys_idx, src = todo[has], cand[has, pick[has]]
            dst_bucket = alt.view(cand.shape)[has, pick[has]]
            # One mover per resident slot (the best-ranked key), then as many per target bucket as
            # it has free slots.
            first = _first_per_group(src)
            keys_idx, src, dst_bucket = keys_idx[first], src[first], dst_bucket[first]
            rank = _rank_within(dst_bucket)
            fits = rank < work.free(dst_bucket)
            keys_idx, src, dst_bucket, rank = keys_idx[fits], src[fits], dst_bucket[fits], rank[fits]
            if not keys_idx.numel():
                break
            dst = work.claim_free(dst_bucket, rank)
            work.claim(src)
            out[keys_idx] = src
            froms.append(src)
            tos.append(dst)
            todo = todo[out[todo] < 0]
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        return todo, (torch.cat(froms) if froms else empty), (torch.cat(tos) if tos else empty)

    def _claim_by_evicting(
        self,
        work: _Buckets,
        todo: torch.Tensor,
        b1: torch.Tensor,
        b2: torch.Tensor,
        out: torch.Tensor,
        pinned_by: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """Step 3; returns the evicted slots."""
        evicted = []
        while todo.numel():
            cand = self._candidates(todo, b1, b2)
            ok = self._movable(cand.flatten(), work, pinned_by).view(cand.shape)
            has = ok.any(dim=1)
            if not bool(has.any()):
                break
            # The lowest (score, slot) among the allowed candidates of each key.
            scores = torch.where(ok, self.scores[cand], torch.iinfo(torch.int64).max)
            best_score = scores.min(dim=1, keepdim=True).values
            tie = ok & (scores == best_score)
            slot = torch.where(tie, cand, torch.iinfo(torch.int64).max).min(dim=1).values
            keys_idx, slot = todo[has], slot[has]
            first = _first_per_group(slot)  # two keys want one slot: the better-ranked one wins
            work.claim(slot[first])
            out[keys_idx[first]] = slot[first]
            evicted.append(slot[first])
            todo = keys_idx[~first]  # the others try their next-lowest; keys with no candidate give up
        return torch.cat(evicted) if evicted else torch.empty(0, dtype=torch.int64, device=self.device)

    # -- writes ------------------------------------------------------------------------------

    def _record(self, journal: Optional[Journal], slots: torch.Tensor) -> None:
        """Records how to restore ``slots`` (keys, scores, tags, pins) and the size as now."""
        if journal is None:
            return
        saved = (self.keys[slots], self.scores[slots], self.tags[slots], self.pins[slots])
        slots, size = slots.clone(), self._size

        def undo() -> None:
            self._before_write()
            self.keys[slots], self.scores[slots], self.tags[slots], self.pins[slots] = saved
            self._size = size
            self._wrote()

        journal.record(undo)

    def _record_adds(self, journal: Optional[Journal], slots: torch.Tensor, some_none: bool = False) -> None:
        """Records how to empty again the free ``slots`` a commit fills, and the size as now. Free
        slots hold key 0 and score 0 (what ``remove`` leaves), so the undo restores them exactly
        without having read them; their pins are not written by a commit. ``some_none``: some
        slots are -1, which the undo skips (then with a host read; else it reads nothing)."""
        if journal is None:
            return
        slots, size = slots.clone(), self._size

        def undo() -> None:
            self._before_write()
            self._clear(slots[slots >= 0] if some_none else slots)
            self._size = size
            self._wrote()

        journal.record(undo)

    def _clear(self, slots: torch.Tensor) -> None:
        """Empties ``slots``: tag, key and score 0 (``index_fill_``: a scalar fill, where an indexed
        assignment of a Python number would copy it to the GPU and wait for the stream)."""
        for t in (self.keys, self.scores, self.tags):
            t.index_fill_(0, slots, 0)

    def commit(self, plan: InsertPlan, scores: torch.Tensor, journal: Optional[Journal] = None) -> torch.Tensor:
        """Writes a plan: moves residents, then places its keys with their ``scores``; returns
        the evicted keys."""
        self._before_write()
        if gpu_kernels.available(self.device) and plan.only_adds:
            # Only new keys into free slots: one kernel places them, and the undo empties the slots
            # again (a free slot holds key 0 and score 0): nothing to read first.
            gpu_kernels.place_keys(self.keys, self.scores, self.tags, plan.slots, plan.keys, scores)
            self._record_adds(journal, plan.slots, some_none=plan.placed < plan.slots.numel())
            self._size += plan.placed  # the planner's count: no host read
            self._wrote(only_added=True)
            return plan.evicted_slots.clone()
        ok = plan.slots >= 0
        slots = plan.slots[ok]
        if plan.only_adds:
            self._record_adds(journal, slots)
        else:
            self._record(journal, torch.cat([slots, plan.moved_to]))
        evicted = self.keys[plan.evicted_slots]
        src, dst = plan.moved_from, plan.moved_to
        self.keys[dst], self.scores[dst], self.pins[dst] = self.keys[src], self.scores[src], self.pins[src]
        self.tags[dst] = self.tags[src]
        self.keys[slots] = plan.keys[ok]
        self.scores[slots] = scores[ok]
        self.tags[slots] = key_tags(plan.keys[ok])
        self._size += slots.numel() - evicted.numel()
        self._wrote(only_added=plan.only_adds)
        return evicted

    def remove(self, slots: torch.Tensor, journal: Optional[Journal] = None) -> None:
        """Frees ``slots`` (each occupied, no duplicates): tag, key and score 0, as in a fresh
        index (a commit into free slots relies on it to undo without reading)."""
        self._before_write()
        self._record(journal, slots)
        self._clear(slots)
        self._size -= slots.numel()
        self._wrote()

    def touch(self, slots: torch.Tensor, score: int) -> None:
        """Sets the score of ``slots`` (duplicates allowed)."""
        kernels = cpu_kernels.ops() if self.device.type == "cpu" else None
        if kernels is None:
            self.scores.scatter_(0, slots, score)  # half the time of index_put on a CPU
            return
        bad = kernels.fill_at(self.scores, slots.contiguous(), int(score))
        if bad >= 0:
            raise IndexError(f"touch: slot {int(slots[bad])} at position {bad} is outside [0, {self.capacity})")

    def add(self, slots: torch.Tensor, amounts: torch.Tensor, journal: Optional[Journal] = None) -> None:
        """Adds ``amounts`` to the scores of ``slots`` (duplicates accumulate)."""
        self._record(journal, slots)
        self.scores.index_add_(0, slots, amounts)

    def pin(self, slots: torch.Tensor, step_id: int) -> None:
        """Pins ``slots`` for the step ``step_id`` (duplicates allowed; -1: skipped, with no host
        read: they pin a spare entry past the last slot)."""
        self._pins.scatter_(0, torch.where(slots < 0, self.capacity, slots), step_id % PIN_WRAP)

    def fill(
        self,
        keys: torch.Tensor,
        scores: torch.Tensor,
        priority: Optional[torch.Tensor] = None,
        keys_ascending: bool = False,
    ) -> torch.Tensor:
        """Inserts ``keys`` (unique, absent) with their ``scores``, evicting nothing and pinning
        nothing (a fresh index being filled: a rehash, a load); returns each key's slot, ``-1``
        where none was found.

        One plan's keys cannot make room for each other (step 2 moves residents only, and an
        index being filled has few or none), so the keys a plan leaves are planned again once it
        is committed, where the keys just placed are residents that can move to their other
        bucket: again while that places some. Keys are ranked as in :meth:`plan_insert` (by
        descending ``priority``, then ascending key; ``keys_ascending`` as there)."""
        plan = self.plan_insert(keys, allow_evict=False, priority=priority, keys_ascending=keys_ascending)
        self.commit(plan, scores)
        if not plan.dropped:
            return plan.slots
        left = torch.nonzero(plan.slots < 0).squeeze(1)
        while left.numel():
            again = self.plan_insert(
                keys[left],
                allow_evict=False,
                priority=None if priority is None else priority[left],
                keys_ascending=keys_ascending,
            )
            if not again.placed:
                break
            self.commit(again, scores[left])
            left = left[again.slots < 0]
        return self.find(keys)  # moves changed some of the first plan's slots

    def rehashed(self, num_buckets: int) -> tuple[BucketedHashIndex, torch.Tensor, torch.Tensor]:
        """A new index of ``num_buckets`` holding every key with its score and pin, and the
        ``(old slots, new slots)`` of the keys placed. Keys are placed by :meth:`fill`, by
        descending score (ties to the smaller key); a key that still finds no slot (its buckets
        and its buckets' residents' other buckets full: very rare with 16-slot buckets) is left
        out (``len(old slots) < size``)."""
        slots, keys, scores = self.entries()
        index = BucketedHashIndex(num_buckets, self.bucket_size, self.device)
        new = index.fill(keys, scores, priority=scores, keys_ascending=True)
        ok = new >= 0
        slots, new = slots[ok], new[ok]
        index.pins[new] = self.pins[slots]
        return index, slots, new

    def install(self, slots: torch.Tensor, keys: torch.Tensor, scores: torch.Tensor) -> None:
        """Places ``keys`` at the given ``slots`` (a fresh index restoring a dump's layout)."""
        self._before_write()
        self.keys[slots] = keys
        self.scores[slots] = scores
        self.tags[slots] = key_tags(keys)
        self._size = int(torch.count_nonzero(self.tags))
        self._wrote()
