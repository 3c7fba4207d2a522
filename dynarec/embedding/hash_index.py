"""A two-choice bucketed hash index: int64 key -> slot, with an int64 score and a pin per slot.

``capacity = num_buckets * bucket_size`` slots. A key has two candidate buckets, from the low
and the high 32 bits of ``mix64(key)``; it lives in one of them, so a lookup gathers two buckets
and compares. Placing a key in the emptier of its two buckets, and moving one resident to its
other bucket when both are full (one cuckoo step), keeps keys from being evicted while the table
is far from full: at 90% load, none of 1M keys (one-choice buckets of 16 evicted 5.9%).

Every operation is a batched tensor op (the ``torch.ops.dynarec`` kernels: ``find``,
``plan_insert``, ``place_keys``, ``fill_at``) with no Python loop per key, identical on CPU and
CUDA, and deterministic: the keys of one insert are ranked (priority descending, then key
ascending) and claim slots in rounds in that order (:mod:`.insert_plan`); no round's outcome
depends on the order its work runs in.

The whole int64 range is a valid key: occupancy is a separate byte per slot, its *tag*: 0 for an
empty slot, else a nonzero byte of the key's hash (:func:`key_tags`). A lookup compares a lane's
tag before its key, so a bucket costs 16 bytes of tags plus the one key whose tag matches (on a
GPU, one 32-byte sector instead of the 128-byte line of keys; an absent key rarely reads a key).
A free slot holds key 0 and score 0 as well (``remove`` clears them), so undoing a commit of new
keys into free slots needs nothing read before it.

The index owns its arrays (in its :class:`IndexStorage`); callers change them only through its
methods (``commit``, ``remove``, ``touch``, ``add``, ``pin``, ``pin_later``, ``install``,
``rehashed``), its storage's (``commit``, ``pin``, ``pin_later``, ``adopt``) and the one writer
they hand out: ``scores_writer``, the scores a fused update sets in its own pass. Each mutating
method takes an optional :class:`Journal` and records how to undo itself, so a failed training
step can be rolled back.

Several indexes of one bucket size can share one storage, each a *partition* of it
(:meth:`IndexStorage.partitions`: a group of dynamic tables' indexes): each is an index as any
other, and the storage finds, plans and commits keys of every partition at once (a key of
partition ``p`` hashes into ``p``'s buckets only: ``dynarec.kernels.ops``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch

from dynarec.devices import table_tensor
from dynarec.embedding import insert_plan
from dynarec.embedding.insert_plan import PIN_WRAP, InsertPlan
from dynarec.embedding.key_hash import candidate_buckets, key_tags
from dynarec.embedding.step import Journal
from dynarec.embedding.streams import current_stream
from dynarec.kernels.reference import slot_positions
from dynarec.optim.fused import RowScores

__all__ = [
    "LAYOUT_VERSION",
    "PIN_WRAP",
    "BucketedHashIndex",
    "IndexStamp",
    "IndexStorage",
    "InsertPlan",
    "candidate_buckets",
    "key_tags",
]

LAYOUT_VERSION = 2  # 1: one bucket per key; 2: two candidate buckets (dumps record it)
_SERIALS = itertools.count()  # of index objects: a stamp never matches another index's


class IndexStamp(NamedTuple):
    """The state of an index's keys: ``serial``, the index object's number (never another
    index's); ``moved`` and ``removed``, how many writes moved keys to other slots and removed keys
    (evicted, freed, undone); ``writes``, all writes of keys."""

    serial: int
    moved: int
    removed: int
    writes: int

    def keys_kept_since(self, then: IndexStamp) -> bool:
        """Whether every key present at ``then`` is still present now, in its slot (a key absent
        then may be present now, where some write came since)."""
        return (self.serial, self.moved, self.removed) == (then.serial, then.moved, then.removed)


class IndexWrites:
    """The journaled writes of an index's arrays (keys, scores, tags, pins): an index's, and a
    partitioned index's storage's (a group's insert writes every partition at once). A subclass
    says what its size is (``_sizes``, ``_set_sizes``: restored by an undo), what a write marks
    (``_wrote``) and waits for (``_before_write``)."""

    keys: torch.Tensor
    scores: torch.Tensor
    tags: torch.Tensor

    @property
    def pins(self) -> torch.Tensor:
        raise NotImplementedError

    def _sizes(self) -> Any:
        raise NotImplementedError

    def _set_sizes(self, sizes: Any) -> None:
        raise NotImplementedError

    def _wrote(self, moved: bool = True, removed: bool = True) -> None:
        raise NotImplementedError

    def _before_write(self) -> None:
        raise NotImplementedError

    def _record(self, journal: Optional[Journal], slots: torch.Tensor) -> None:
        """Records how to restore ``slots`` (keys, scores, tags, pins) and the size as now."""
        if journal is None:
            return
        saved = (self.keys[slots], self.scores[slots], self.tags[slots], self.pins[slots])
        slots, size = slots.clone(), self._sizes()

        def undo() -> None:
            self._before_write()
            self.keys[slots], self.scores[slots], self.tags[slots], self.pins[slots] = saved
            self._set_sizes(size)
            self._wrote()

        journal.record(undo)

    def _record_adds(self, journal: Optional[Journal], slots: torch.Tensor, some_none: bool = False) -> None:
        """Records how to empty again the free ``slots`` a commit fills, and the size as now. Free
        slots hold key 0 and score 0 (what ``remove`` leaves), so the undo restores them exactly
        without having read them; their pins are not written by a commit. ``some_none``: some
        slots are ``NO_SLOT``, which the undo skips (then with a host read; else it reads
        nothing)."""
        if journal is None:
            return
        slots, size = slots.clone(), self._sizes()

        def undo() -> None:
            self._before_write()
            self._clear(slots[slots >= 0] if some_none else slots)
            self._set_sizes(size)
            self._wrote()

        journal.record(undo)

    def _clear(self, slots: torch.Tensor) -> None:
        """Empties ``slots``: tag, key and score 0 (``index_fill_``: a scalar fill, where an indexed
        assignment of a Python number would copy it to the GPU and wait for the stream)."""
        for t in (self.keys, self.scores, self.tags):
            t.index_fill_(0, slots, 0)

    def _write_plan(self, plan: InsertPlan, scores: torch.Tensor, journal: Optional[Journal]) -> torch.Tensor:
        """The array writes of a commit: moves residents, then places the plan's keys with their
        ``scores``, journaled (the caller counts the keys and marks the write); returns the
        evicted keys."""
        self._before_write()
        if plan.only_adds:
            # Only new keys into free slots: one op places them, and the undo empties the slots
            # again (a free slot holds key 0 and score 0): nothing to read first.
            torch.ops.dynarec.place_keys(self.keys, self.scores, self.tags, plan.slots, plan.keys, scores)
            self._record_adds(journal, plan.slots, some_none=plan.placed < plan.slots.numel())
            return plan.evicted_slots.clone()
        # the slots written (a host read only when some key got none: rare)
        slots = plan.slots if plan.placed == plan.slots.numel() else plan.slots[plan.slots >= 0]
        self._record(journal, torch.cat([slots, plan.moved_to]))
        evicted = self.keys[plan.evicted_slots]
        src, dst = plan.moved_from, plan.moved_to
        pins = self.pins
        self.keys[dst], self.scores[dst], pins[dst] = self.keys[src], self.scores[src], pins[src]
        self.tags[dst] = self.tags[src]
        # The slots a new key takes from a resident get score 0, as a free slot holds, so that
        # place_keys writes every new key as into free slots (NO_SLOT skipped).
        self.scores.index_fill_(0, plan.overwritten_slots, 0)
        torch.ops.dynarec.place_keys(self.keys, self.scores, self.tags, plan.slots, plan.keys, scores)
        return evicted

    def touch(self, slots: torch.Tensor, score: int, replaces: Optional[RowScores] = None) -> None:
        """Sets the score of ``slots`` (duplicates allowed). ``replaces``: a writer of
        :meth:`scores_writer` this write takes the place of (withdrawn: it writes nothing)."""
        torch.ops.dynarec.fill_at(self.scores, slots, int(score))
        if replaces is not None:
            replaces.live = False

    def scores_writer(self, value: int, journal: Optional[Journal] = None) -> RowScores:
        """The scores as the target of a fused update (``fused_bag_update``): the update
        sets ``scores[row] = value`` for every row it updates, in its own pass (one store per
        unique row). A slot is a row of the table's store. The write is the index's: withdrawn
        when ``journal``'s step is undone (an aborted step's update, should its backward run
        anyway, writes nothing), or when :meth:`touch` writes in its place. Score writes change
        no key: the stamp stays."""
        writer = RowScores(self.scores, int(value))
        if journal is not None:
            journal.record(lambda: setattr(writer, "live", False))
        return writer

    def add(self, slots: torch.Tensor, amounts: torch.Tensor, journal: Optional[Journal] = None) -> None:
        """Adds ``amounts`` to the scores of ``slots`` (duplicates accumulate)."""
        self._record(journal, slots)
        self.scores.index_add_(0, slots, amounts)


class IndexStorage(IndexWrites):
    """The arrays of one index, or of several indexes of one bucket size end to end (a
    *partitioned* index: the hash index a ``DynamicTableGroup``'s tables share, table ``p`` its
    partition ``p``, whose keys hash into its own buckets only: ``dynarec.kernels.ops``), and
    what all of them share: the order of writes and finds across CUDA streams, and the pins
    held back (:meth:`BucketedHashIndex.pin_later`). Each partition is read and written through
    its :class:`BucketedHashIndex` (views of these arrays); a group finds and inserts into all
    of them at once through this object (:meth:`find_flagged`, :meth:`plan_insert`, :meth:`commit`).

    ``num_buckets``: each partition's bucket count (one: an index alone)."""

    def __init__(self, num_buckets: Sequence[int], bucket_size: int, device: torch.device | str = "cpu"):
        if not num_buckets or min(num_buckets) < 1 or bucket_size < 1:
            raise ValueError(f"num_buckets and bucket_size must be >= 1, got {list(num_buckets)}, {bucket_size}")
        self.bucket_size = bucket_size
        self.device = torch.device(device)
        self.part_buckets = list(num_buckets)
        self.part_starts_host = [0, *itertools.accumulate(self.part_buckets)]
        #: ``[P + 1]`` int64 on the device: each partition's first bucket, and the bucket count.
        self.part_starts = torch.tensor(self.part_starts_host, dtype=torch.int64, device=self.device)
        self.num_buckets = self.part_starts_host[-1]
        cap = self.capacity
        self.keys = table_tensor((cap,), 0, torch.int64, self.device)
        self.scores = table_tensor((cap,), 0, torch.int64, self.device)
        self.tags = table_tensor((cap,), 0, torch.uint8, self.device)  # EMPTY_TAG: empty (key_tags)
        # The id of the last training step that pinned the slot (-1: never); a slot is pinned while
        # that step is pending (StepLifecycle). Step ids are never reused (int32: they wrap after
        # 2^31 steps, when a row untouched that long could look pinned for one step), so the pin
        # of an aborted step pins nothing (the pins it replaced are restored: pin's journal).
        self.all_pins = table_tensor((cap + 1,), -1, torch.int32, self.device)  # the last: -1 slots'
        # pin_later's, in order: (step id, slots, their first slot, the partitions still holding it)
        self._pending_pins: list[tuple[int, torch.Tensor, int, set[int]]] = []
        # The last write's event and its stream's id, and the last find's event on each stream (CUDA)
        self._written = torch.cuda.Event() if self.device.type == "cuda" else None
        self._written_on: Optional[int] = None
        self._finds: dict[int, torch.cuda.Event] = {}
        #: Each partition's index (:meth:`partitions` makes them; an index alone registers itself).
        self.parts: list[BucketedHashIndex] = []

    @classmethod
    def partitions(
        cls, num_buckets: Sequence[int], bucket_size: int, device: torch.device | str = "cpu"
    ) -> list[BucketedHashIndex]:
        """A partitioned index: an index a partition of ``num_buckets[p]`` buckets, all of one
        storage (``index.storage``)."""
        storage = cls(num_buckets, bucket_size, device)
        return [BucketedHashIndex(nb, bucket_size, device, storage=(storage, p)) for p, nb in enumerate(num_buckets)]

    @property
    def capacity(self) -> int:
        return self.num_buckets * self.bucket_size

    @property
    def pins(self) -> torch.Tensor:
        """``[capacity]`` int32, every partition's pins (the held-back ones written first)."""
        self.write_pending_pins()
        return self.all_pins[: self.capacity]

    @property
    def size(self) -> int:
        """Occupied slots of every partition."""
        return sum(p.size for p in self.parts)

    def first_slot(self, part: int) -> int:
        return self.part_starts_host[part] * self.bucket_size

    def adopt(self, part: int, index: BucketedHashIndex) -> BucketedHashIndex:
        """Partition ``part``'s index anew, holding ``index``'s keys, scores and pins in their
        slots (``index``: built apart, of the partition's shape: a load's)."""
        self.before_write()
        fresh = BucketedHashIndex(self.part_buckets[part], self.bucket_size, self.device, storage=(self, part))
        for name in ("keys", "scores", "tags", "pins"):
            getattr(fresh, name).copy_(getattr(index, name))
        fresh._size = index.size
        self.mark_written()
        return fresh

    # -- a group's find and insert: every partition at once -----------------------------------

    def find_flagged(self, keys: torch.Tensor, key_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot of each of ``keys`` (each in its partition ``key_parts[i]``; -1: absent), a
        slot of the storage, and ``[P]`` int32 on the device: nonzero for each partition with an
        absent key (set in the find's own pass)."""
        return self.find_op(self.keys, self.tags, self.num_buckets, self.bucket_size, keys, True, self.part_starts,
                            key_parts)  # fmt: skip

    def plan_insert(
        self,
        keys: torch.Tensor,
        key_parts: torch.Tensor,
        pinned_by: Optional[torch.Tensor] = None,
        allow_evict: bool = True,
        movable_pins: Optional[torch.Tensor] = None,
    ) -> InsertPlan:
        """:meth:`BucketedHashIndex.plan_insert` of ``keys`` (unique in their partition, absent),
        each into its partition ``key_parts[i]``, ranked as given (each partition's keys in
        ascending order): one plan, each partition's own plan of its keys (its slots are the
        storage's)."""
        return insert_plan.plan_insert(
            self, keys, pinned_by, allow_evict, None, movable_pins, keys_ascending=True, key_parts=key_parts
        )

    def commit(
        self, plan: InsertPlan, scores: torch.Tensor, added: Sequence[int], journal: Optional[Journal] = None
    ) -> torch.Tensor:
        """Writes a plan of :meth:`plan_insert` (:meth:`BucketedHashIndex.commit`); ``added``:
        each partition's keys placed less its keys evicted (the caller counts them). Returns the
        evicted keys."""
        evicted = self._write_plan(plan, scores, journal)
        for part, n in zip(self.parts, added):
            part._size += n
        self._wrote(moved=bool(plan.moved_from.numel()), removed=bool(plan.evicted_slots.numel()))
        return evicted

    def _sizes(self) -> list[int]:
        return [p._size for p in self.parts]

    def _set_sizes(self, sizes: list[int]) -> None:
        for part, n in zip(self.parts, sizes):
            part._size = n

    def _wrote(self, moved: bool = True, removed: bool = True) -> None:
        """A write of the storage: every partition's stamp changes (``BucketedHashIndex._wrote``)."""
        for part in self.parts:
            part.restamp(moved, removed)
        self.mark_written()

    def _before_write(self) -> None:
        self.before_write()

    # -- order across CUDA streams -----------------------------------------------------------

    def mark_written(self) -> None:
        """Marks the arrays as written by the work queued so far on the current stream: a later
        find on another stream waits for it (a collection runs its finds on its input stream,
        ahead of the main stream's work: :mod:`.streams`)."""
        if self._written is not None:  # CUDA
            stream = current_stream(self.device)
            # One event, recorded again: a wait queued earlier keeps the record it was queued after
            self._written.record(stream)
            self._written_on = stream.stream_id

    def before_write(self) -> None:
        """Makes the current stream wait for every find queued so far on another stream: a write
        never changes keys or tags a find is still reading (a find made two steps ahead, on the
        input stream, may still run when the next step inserts)."""
        if self._finds:
            stream = current_stream(self.device)
            for stream_id, done in self._finds.items():
                if stream_id != stream.stream_id:
                    stream.wait_event(done)

    def find_op(self, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``dynarec::find`` op of ``args``, ordered against the writes on other streams
        (CUDA): it waits for the writes queued before it, and the writes queued after it wait
        for it."""
        stream = current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None and self._written_on is not None and self._written_on != stream.stream_id:
            stream.wait_event(self._written)  # type: ignore[arg-type]
        slots, absent = torch.ops.dynarec.find(*args)
        if stream is not None:
            done = self._finds.get(stream.stream_id)
            if done is None:
                done = self._finds[stream.stream_id] = torch.cuda.Event()
            done.record(stream)  # one event a stream, recorded again (as wrote's)
        return slots, absent

    # -- pins ----------------------------------------------------------------------------------

    def pin(self, slots: torch.Tensor, step_id: int, offset: int = 0, journal: Optional[Journal] = None) -> None:
        """Pins ``slots`` (+ ``offset``: slots of a partition; -1: skipped) for ``step_id``;
        ``journal``: records how to give them back the pins they had (:meth:`BucketedHashIndex.pin`)."""
        self.write_pending_pins()
        self._pin(slots, step_id, offset, journal)

    def pin_later(self, slots: torch.Tensor, step_id: int, offset: int = 0, parts: Optional[set[int]] = None) -> None:
        """:meth:`pin`, written only when something reads pins; held for the partitions
        ``parts`` (all: None) until each :meth:`release` s it."""
        self._pending_pins.append((step_id, slots, offset, set(range(len(self.parts))) if parts is None else parts))

    def release(self, part: int, step_id: int) -> None:
        """``step_id`` is no longer pending in partition ``part``: the pins held back for it
        there are dropped (written or not, a pin of a step no longer pending pins nothing)."""
        for _, _, _, parts in (entry for entry in self._pending_pins if entry[0] == step_id):
            parts.discard(part)
        self._pending_pins = [entry for entry in self._pending_pins if entry[3]]

    def write_pending_pins(self) -> None:
        pending, self._pending_pins = self._pending_pins, []
        for step_id, slots, offset, _ in pending:  # in order: a later pin of a slot is its last
            self._pin(slots, step_id, offset)

    def _pin(self, slots: torch.Tensor, step_id: int, offset: int, journal: Optional[Journal] = None) -> None:
        if journal is not None:
            at = slot_positions(slots, offset, self.capacity)  # the pins fill_slots overwrites
            saved = self.all_pins[at]  # (duplicates: one value each, restored alike)

            def undo() -> None:
                self.all_pins.index_copy_(0, at, saved)

            journal.record(undo)
        torch.ops.dynarec.fill_slots(self.all_pins, slots, step_id % PIN_WRAP, offset)


class BucketedHashIndex(IndexWrites):
    def __init__(
        self,
        num_buckets: int,
        bucket_size: int,
        device: torch.device | str = "cpu",
        storage: Optional[tuple[IndexStorage, int]] = None,
    ):
        """``storage``: ``(storage, p)``, this index being partition ``p`` of ``storage`` (its
        arrays views of the storage's); else the index has a storage of its own."""
        if num_buckets < 1 or bucket_size < 1:
            raise ValueError(f"num_buckets and bucket_size must be >= 1, got {num_buckets}, {bucket_size}")
        self.storage, self.part = storage or (IndexStorage([num_buckets], bucket_size, device), 0)
        assert self.storage.part_buckets[self.part] == num_buckets and self.storage.bucket_size == bucket_size
        if self.part < len(self.storage.parts):  # a fresh index of the partition (a load's): in its place
            self.storage.parts[self.part] = self
        else:
            self.storage.parts.append(self)
        self.num_buckets = num_buckets
        self.bucket_size = bucket_size
        self.device = torch.device(device)
        self.first_slot = first = self.storage.first_slot(self.part)
        cap = num_buckets * bucket_size
        self.keys = self.storage.keys[first : first + cap]
        self.scores = self.storage.scores[first : first + cap]
        self.tags = self.storage.tags[first : first + cap]
        self._size = 0
        self._stamp = IndexStamp(next(_SERIALS), 0, 0, 0)
        self._wrote()

    def _wrote(self, moved: bool = True, removed: bool = True) -> None:
        """Marks the keys and tags as written by the work queued so far on the current stream
        (:meth:`IndexStorage.mark_written`), and changes :attr:`stamp`. ``moved`` / ``removed``: the
        write may have moved keys to other slots / removed keys (neither: it only placed keys in
        free slots)."""
        self.restamp(moved, removed)
        self.storage.mark_written()

    def restamp(self, moved: bool = True, removed: bool = True) -> None:
        """Changes :attr:`stamp` for a write of this partition's keys (``moved`` / ``removed``: as
        :meth:`_wrote`); the writer marks the storage written."""
        serial, moves, removals, writes = self._stamp
        self._stamp = IndexStamp(serial, moves + moved, removals + removed, writes + 1)

    def _before_write(self) -> None:
        self.storage.before_write()

    @property
    def stamp(self) -> IndexStamp:
        """The state of the keys now. Equal stamps: equal keys in equal slots (a find made at one
        holds at the other); :class:`IndexStamp` compares two that differ."""
        return self._stamp

    @property
    def pins(self) -> torch.Tensor:
        """``[capacity]`` int32: the id (modulo ``PIN_WRAP``) of the last step that pinned each
        slot, -1 where none did; the pins :meth:`pin_later` holds back are written first."""
        self.storage.write_pending_pins()
        return self.storage.all_pins[self.first_slot : self.first_slot + self.capacity]

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
        pins = self.storage.all_pins[self.first_slot : self.first_slot + self.capacity]
        return sum(t.numel() * t.element_size() for t in (self.keys, self.scores, self.tags, pins))

    # -- reads -------------------------------------------------------------------------------

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slot of each key, ``-1`` where absent. ``keys``: ``[n]`` int64. On a GPU, on any
        stream: it waits for the writes queued before it, and the writes queued after it wait
        for it."""
        return self._find(keys, flag=False)[0]

    def find_flagged(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`find`, and whether any key is absent: a ``[]`` int32 on the device, nonzero if one
        is (set in the find's own pass: no second read of the slots)."""
        return self._find(keys, flag=True)

    def _find(self, keys: torch.Tensor, flag: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``dynarec::find`` op, ordered against the writes on other streams (CUDA)."""
        return self.storage.find_op(self.keys, self.tags, self.num_buckets, self.bucket_size, keys, flag)

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
    ) -> InsertPlan:
        """Plans inserting ``keys`` (unique, absent), writing nothing (:meth:`commit` writes the
        plan). ``keys_ascending``: the caller's keys are in ascending order (``torch.unique``'s
        output), so ranking them by key needs no sort.

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
        commit) may move but not be evicted. A key left without a slot gets ``NO_SLOT`` (-1).
        The two step-id tensors may be on the host: only steps 2-3 need them on the device.
        (:mod:`.insert_plan`: the planners, and the plain-torch reference the tests use.)
        """
        return insert_plan.plan_insert(self, keys, pinned_by, allow_evict, priority, movable_pins, keys_ascending)

    # -- writes ------------------------------------------------------------------------------

    def commit(self, plan: InsertPlan, scores: torch.Tensor, journal: Optional[Journal] = None) -> torch.Tensor:
        """Writes a plan: moves residents, then places its keys with their ``scores``; returns
        the evicted keys."""
        evicted = self._write_plan(plan, scores, journal)
        self._size += plan.placed - plan.evicted_slots.numel()  # the planner's count: no host read
        self._wrote(moved=bool(plan.moved_from.numel()), removed=bool(plan.evicted_slots.numel()))
        return evicted

    def remove(self, slots: torch.Tensor, journal: Optional[Journal] = None) -> None:
        """Frees ``slots`` (each occupied, no duplicates): tag, key and score 0, as in a fresh
        index (a commit into free slots relies on it to undo without reading)."""
        self._before_write()
        self._record(journal, slots)
        self._clear(slots)
        self._size -= slots.numel()
        self._wrote(moved=False)

    def _sizes(self) -> int:
        return self._size

    def _set_sizes(self, sizes: int) -> None:
        self._size = sizes

    def pin(self, slots: torch.Tensor, step_id: int, journal: Optional[Journal] = None) -> None:
        """Pins ``slots`` for the step ``step_id`` (duplicates allowed; -1: skipped, with no host
        read: they pin a spare entry past the last slot). A slot is pinned while its step is
        pending: a plan given that step in ``pinned_by`` neither moves nor evicts it.
        ``journal``: records how to give the slots back the pins they had. An aborted step's
        pins pin nothing, but they may have replaced the pins of an earlier step still pending
        (several steps pending: their shared keys' rows would lose that step's protection)."""
        self.storage.pin(slots, step_id, self.first_slot, journal)

    def pin_later(self, slots: torch.Tensor, step_id: int) -> None:
        """:meth:`pin`, written only when something reads pins (a plan, a rehash, a move): a step
        that inserts nothing while it is pending (a warm table's) writes none."""
        self.storage.pin_later(slots, step_id, self.first_slot, {self.part})

    def release(self, step_id: int) -> None:
        """The step ``step_id`` is no longer pending: the pins :meth:`pin_later` holds back for it
        are dropped (a pin of a step no longer pending pins nothing)."""
        self.storage.release(self.part, step_id)

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
