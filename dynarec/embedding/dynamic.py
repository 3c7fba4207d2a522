"""Dynamic tables: any int64 key, rows created on demand, grown, evicted, optionally admitted.

A :class:`DynamicTable` is a :class:`BucketedHashIndex` (key -> slot, with a score per slot) in
front of the same :class:`RowStore` a fixed table uses: slot ``s`` is row ``s``. So the optimizer
code exists once, and ``initial_accumulator_value`` (or any other optimizer setting) means the
same thing here as on a fixed table: a created row gets the initializer's weights and every
state at the spec's initial value — on first insertion and again when an evicted key returns.

Row lifecycle in a training lookup (the table's step is open, ``begin_step()``):
1. Keys found in the index are pinned: no insert of this step, or of another step pending
   before its backward, may evict them.
2. Absent keys are counted by the admission counter, if any; those that reach the threshold
   (or all absent keys, without admission) are inserted. Below ``max_capacity`` the table grows
   (doubling the buckets, rehashing, rows moved bit-exactly) when the load would pass
   ``growth_load_factor`` or a bucket is full; at ``max_capacity`` the lowest-score unpinned row
   of the key's bucket is evicted, ties to the smaller slot.
3. A key left without a row follows ``check_mode`` (error / warn / ignore): it reads the eval
   initializer and gets no update; ``dropped_keys`` counts them.
4. When the step commits (its backward ran), the scores of the touched rows are updated:
   ``step`` = the step, ``lfu`` += occurrences, ``timestamp`` = the forward's wall clock (us).
   A native row store's fused update writes ``step`` and ``timestamp`` scores itself, once per
   unique row, through the writer the index hands out (``BucketedHashIndex.scores_writer``); a
   step committed without its backward (a later step's backward settles it), ``lfu``, the
   FBGEMM store and a grouped table (its rows updated with other tables', ``DynamicTableGroup``)
   write them through the index at commit.

Everything 1-3 change is journaled: ``abort_step()`` restores evicted keys with their rows,
removes created rows, takes back admission counts and a growth.

The table composes four parts, each with one job: its slots (:class:`~.capacity.Capacity`: the
index, the rows behind it, growth and its counters), admission (:class:`~.admission.Admission`:
the counter and its threshold), the eviction scores (:class:`~.scores.ScorePolicy`: which value,
written by whom) and dump/load (:mod:`.snapshot`). What stays here: a lookup's slots, the insert
of new keys (growth first, then the plan, ``check_mode``, the rows it creates), rows by key.

Eval mode only finds: nothing is created, evicted, counted or updated.

Host reads per training lookup: whether any key is absent (in :meth:`find`, which a CUDA
collection runs on its input stream, beside the previous step's backward); when some are, how
many occurrences are absent and how many distinct keys they hold (data-dependent sizes), and one
count per free-slot round of the insert plan (at load 0.5, one round). Pins skip -1 slots on the
device, and whether every key got a row follows from the plan's count. A warm table with no new
keys pays only the first (``torch.cuda.set_sync_debug_mode`` lists a step's syncs). Moves read
more: one count a round; evictions (a full table) one count every 4 rounds (about 3 a step at
4.2M ids with 5% new keys). A group of tables (``DynamicTableGroup``, its tables' indexes one
index's partitions) makes these reads once a step for all its tables: one find (its flag a
table), one pass over the absent keys (:meth:`AbsentKeys.of_parts`), one plan, one read of the
tables' admitted counts where tables admit, and one of each table's counts where the plan moved,
evicted or dropped keys.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Optional, Union

import torch

from dynarec.embedding import snapshot
from dynarec.embedding.admission import Admission
from dynarec.embedding.cached_store import CacheHold
from dynarec.embedding.capacity import Capacity, num_buckets
from dynarec.embedding.config import TableConfig
from dynarec.embedding.hash_index import BucketedHashIndex, IndexStamp
from dynarec.embedding.insert_plan import InsertPlan
from dynarec.embedding.pack import Bags
from dynarec.embedding.row_store import RowStore
from dynarec.embedding.scores import ScorePolicy
from dynarec.embedding.step import Journal, Step
from dynarec.embedding.table import EmbeddingTable, FoundKeys, late_backward, make_row_store
from dynarec.kernels.reference import bags_of_ids
from dynarec.optim.base import OptimizerSpec
from dynarec.optim.rounding import ROW_DTYPES, RowKeys

__all__ = [
    "AbsentKeys",
    "DynamicTable",
    "TableFullError",
    "move_rows",
    "present_bags",
    "refuse_moved_rows",
]


class TableFullError(RuntimeError):
    """Raised (check_mode ``error``) when keys cannot get a row."""


class DynamicTable(EmbeddingTable):
    """``capacity``: a key-hash shard's ``(init_capacity, max_capacity)`` (its share of the
    table's); initializers still use the whole table's bound, so a key's row is the same
    whatever the sharding."""

    index_fields = snapshot.INDEX_FIELDS

    def __init__(
        self,
        config: TableConfig,
        spec: OptimizerSpec,
        device: torch.device,
        capacity: Optional[tuple[int, int]] = None,
        store: Optional[RowStore] = None,
        index: Optional[BucketedHashIndex] = None,
    ):
        """``store`` and ``index``: rows of a store and a partition of an index shared with other
        tables (a ``DynamicTableGroup``'s) instead of its own, for a table that never grows
        (``init_capacity`` at ``max_capacity``), of exactly its slots."""
        super().__init__(config, spec, device)
        assert config.dynamic is not None
        self.options = options = config.dynamic
        init_capacity, max_capacity = capacity or (options.init_capacity, options.max_capacity)
        bucket_size = options.bucket_size
        max_buckets = self._max_buckets = num_buckets(max_capacity, bucket_size)
        init_buckets = min(max_buckets, num_buckets(init_capacity, bucket_size))  # type: ignore[arg-type]
        rows, max_rows = init_buckets * bucket_size, max_buckets * bucket_size
        if store is not None and not store.num_rows == rows == max_rows:  # (it would grow)
            raise ValueError(
                f"table '{self.name}': a shared store holds a table that never grows, of {max_rows} slots; "
                f"given {store.num_rows} rows for {rows} slots growing to {max_rows}"
            )
        if store is None:
            store = make_row_store(config, spec, rows, self.device, max_rows=max_rows)
        # Bound methods, not lambdas, wherever a part reads back its table: a deepcopy rebinds a
        # method to the copy, while a lambda would go on reading (and writing) the original.
        store.row_keys = RowKeys(keys=self._index_keys)  # half-precision rows' rounding draws: by key
        #: The index, the rows behind it and how both grow.
        self.space = Capacity(
            store, bucket_size, init_buckets, max_buckets, options.growth_load_factor, self.device, index
        )
        self.admission: Optional[Admission] = None
        if options.admission is not None:
            self.admission = Admission(
                options.admission, options.max_capacity, self.max_capacity, bucket_size, self.device,
                self.eval_initializer,
            )  # fmt: skip
        self.score_policy = ScorePolicy(options.score_strategy, self._current_index)
        self.served_step: Optional[int] = None  # the last training step this table looked up
        # Training lookups whose fused update is still to come (a step committed by a later
        # step's backward may still have its own): a growth would move their rows under them.
        self._updates_to_come: set[int] = set()
        self._lookups = itertools.count()

    @property
    def index(self) -> BucketedHashIndex:
        """The hash index: key -> slot (= row of :attr:`store`), with a score and a pin a slot."""
        return self.space.index

    def _current_index(self) -> BucketedHashIndex:
        return self.space.index

    def _index_keys(self) -> torch.Tensor:
        return self.space.index.keys

    @property
    def store(self) -> RowStore:
        return self.space.store

    @property
    def capacity(self) -> int:
        """Slots allocated now."""
        return self.space.slots

    @property
    def max_capacity(self) -> int:
        return self.space.max_slots

    @property
    def size(self) -> int:
        """Keys with a row."""
        return self.index.size

    @property
    def nbytes(self) -> int:
        """Bytes held by the table: rows, states, index and admission counter."""
        total = self.store.nbytes + self.index.nbytes
        if self.admission is not None:
            total += self.admission.nbytes
        return total

    @property
    def evicted_keys(self) -> int:
        return self.space.counters["evicted"]

    @property
    def dropped_keys(self) -> int:
        return self.space.counters["dropped"]

    def report(self) -> dict[str, object]:
        size, counters = self.size, self.space.counters
        return {
            "size": size,
            "capacity": self.capacity,
            "max_capacity": self.max_capacity,
            "load_factor": size / self.capacity,
            "evicted_keys": self.evicted_keys,
            "evicted_below_full_capacity": counters["premature"],
            "dropped_keys": self.dropped_keys,
            "moved_keys": counters["moved"],
            "bytes": self.nbytes,
            "host_bytes": self.store.host_nbytes,  # of them, in host memory
        }

    def describe(self) -> dict[str, object]:
        return {**super().describe(), **self.report()}

    def begin_step(self, step_id: Optional[int] = None) -> Step:
        """Opens a training step; once it is no longer pending (committed or aborted), the pins it
        held back in the index are dropped."""
        step = super().begin_step(step_id)

        def release() -> None:
            self.index.release(step.id)

        step.on_commit.append(release)
        step.journal.record(release)
        return step

    # -- the lookup stage ----------------------------------------------------------------------

    def find(self, bags: Bags) -> FoundKeys:
        slots, absent = self.index.find_flagged(bags.ids)
        return FoundKeys(slots, self.index.stamp, absent)

    def _rows_of(self, bags: Bags, found: Optional[FoundKeys]) -> Optional[torch.Tensor]:
        """The rows of the keys found. Every key found, they are the lookup's rows in order, and
        the lookup reads its hold's slots where the find still holds by then; else they are only
        rows made resident ahead, and the lookup finds its own."""
        return None if found is None else found.slots[found.slots >= 0]

    def lookup(
        self, bags: Bags, train: bool, found: Optional[FoundKeys] = None, hold: Optional[CacheHold] = None
    ) -> torch.Tensor:
        """Keys -> pooled rows. A key without a row (eval, not admitted, dropped) reads the eval
        initializer (in training with admission: the admission initializer), weighted like a row;
        mean pooling still divides by the bag's full length."""
        step = self.steps.current if train else None
        if found is None or not self._still_holds(found):
            found, hold = self.find(bags), None
        if hold is not None and not found.all_present:
            hold = None  # it holds the keys found then; this lookup's rows are others too
        slots, all_present = self._slots_for(bags.ids, found, step)
        return self._pooled_at(bags, slots, all_present, step, hold)

    def _slots_for(self, keys: torch.Tensor, found: FoundKeys, step: Optional[Step]) -> tuple[torch.Tensor, bool]:
        """The slot of every key (-1: no row), and whether every key has one: in training
        (``step``), absent keys inserted first (admission permitting); else ``found``'s (a find
        of ``keys`` that still holds)."""
        if step is None:
            return found.slots, found.all_present
        slots, all_present = self._slots_for_training(keys, found, step)
        self.served_step = step.id
        return slots, all_present

    def _pooled_at(
        self,
        bags: Bags,
        slots: torch.Tensor,
        all_present: bool,
        step: Optional[Step],
        hold: Optional[CacheHold] = None,
    ) -> torch.Tensor:
        """Stage 2's reads: ``bags`` pooled from the rows at ``slots`` (:meth:`_slots_for`'s), the
        eval (admission) initializer where a key has none; in training the output's backward
        updates the rows and commits ``step``."""
        offsets, weights = bags.offsets, bags.weights
        missing_out = None
        if not all_present:
            absent, bag_of_id = slots < 0, bags_of_ids(bags.offsets, bags.ids.numel())
            values = self.absent_values(bags.ids, weights, absent, step)
            if values is not None:
                missing_out = values.new_zeros(bags.num_bags, self.dim).index_add_(0, bag_of_id[absent], values)
            slots, offsets, weights = present_bags(bags, slots, bag_of_id)
        # A hold's rows are the found keys' slots in order: every key found, they are this lookup's
        # (its slots read there: no host read).
        store_lookup = self.store.lookup if hold is None else hold.lookup
        if step is None:
            out = store_lookup(slots, offsets, weights, False)
        else:
            fused = self.store.writes_row_scores and torch.is_grad_enabled()
            row_scores = self.score_policy.schedule(slots, step, fused)
            out = store_lookup(slots, offsets, weights, True, step=step.t, row_scores=row_scores)
            self._await_update(out, step, slots)
            self._commit_on_backward(out, step)
        return out if missing_out is None else out + missing_out

    def absent_values(
        self, keys: torch.Tensor, weights: Optional[torch.Tensor], absent: torch.Tensor, step: Optional[Step]
    ) -> Optional[torch.Tensor]:
        """What the keys without a row (``absent``, ``[n]`` bool) add to their bags: the eval
        initializer's values (in training with admission: the admission initializer's), times
        their per-sample weights, ``[m, dim]`` in the order of the absent keys; None where that
        initializer is zero."""
        init = self.eval_initializer
        if step is not None and self.admission is not None:
            init = self.admission.initializer
        if init.is_zero:
            return None
        values = init.values(keys[absent], self.dim, self.config.seed, self.config.default_bound)  # type: ignore[arg-type]
        return values if weights is None else values * weights[absent][:, None]

    def _await_update(self, out: torch.Tensor, step: Step, slots: torch.Tensor) -> None:
        """Counts ``out``'s fused update (of the rows at ``slots``) as still to come until its
        backward reaches it (the update runs then), its output is dropped, or its step is aborted;
        and refuses a late backward whose rows changed keys (:func:`refuse_moved_rows`). Call it
        before the output's commit hook is registered."""
        if not out.requires_grad:
            return
        token = next(self._lookups)
        self._updates_to_come.add(token)
        refuse_moved_rows(out, step, slots, lambda: self.index.keys, self.name)

        def done(*_) -> None:
            self._updates_to_come.discard(token)

        out.register_hook(done)
        weakref.finalize(out, done)
        step.journal.record(done)

    def _still_holds(self, found: FoundKeys) -> bool:
        return self.still_holds(found.stamp, found.all_present)

    def still_holds(self, stamp: IndexStamp, all_present: bool) -> bool:
        """Whether a find made earlier (at index ``stamp``; ``all_present``: it found every key)
        gives this lookup's slots: every key present then is still in its slot, and either
        nothing written since or every key found (keys added since cannot be among them)."""
        now = self.index.stamp
        return now.keys_kept_since(stamp) and (now.writes == stamp.writes or all_present)

    def _slots_for_training(self, keys: torch.Tensor, found: FoundKeys, step: Step) -> tuple[torch.Tensor, bool]:
        """Slot of every key occurrence (``found``: the find's, every occurrence), creating rows
        (admission permitting); -1: no row. And whether every key has a row. A warm table (no new
        key) reads nothing more on the host than the find did."""
        slots = found.slots
        if found.all_present:
            # Pins matter only to an insert while this step is pending: they are written then.
            self.index.pin_later(slots, step.id)
            return slots, True
        # The keys found (-1s skipped), before inserting. Their pins may replace an earlier pending
        # step's, which an abort of this step gives back (with no other step pending: none).
        self.index.pin(slots, step.id, step.journal if len(self.steps.pending) > 1 else None)
        absent = AbsentKeys.of(keys, slots)
        uniq, inverse, counts = absent.unique, absent.inverse, absent.counts
        new_keys, admitted = uniq, None
        if self.admission is not None:
            admitted = torch.nonzero(self.admission.count(uniq, counts, step, self.pending_ids())).squeeze(1)
            new_keys = uniq[admitted]
        all_present = new_keys.numel() == uniq.numel()
        if new_keys.numel():
            before = self.index.stamp
            plan = self._insert(new_keys, step, keys_ascending=True)
            new_slots = plan.slots
            all_present = all_present and plan.placed == new_keys.numel()
            if admitted is not None:
                new_slots = torch.full_like(uniq, -1).index_copy_(0, admitted, new_slots)
            if self.index.stamp.serial != before.serial:  # a growth: every key may have moved
                slots = self.index.find(keys)
                all_present = bool((slots >= 0).all())  # a growth at max_capacity may have dropped a key
                self.index.pin(slots, step.id)  # their new slots (the insert pinned its new rows)
            else:
                if plan.moved_from.numel():  # cuckoo moves: the keys found in a moved row follow it
                    slots = torch.ops.dynarec.follow_moves(slots, plan.moved_from, plan.moved_to)
                slots.index_copy_(0, absent.positions, new_slots[inverse])
        return slots, all_present

    def pending_ids(self, *extra: int) -> torch.Tensor:
        """The pending steps' ids and ``extra`` ids, a CPU tensor (``plan_insert`` moves it to the
        device only when it needs it: a copy to the GPU waits for the stream)."""
        return torch.tensor([s.id for s in self.steps.pending] + list(extra), dtype=torch.int64)

    # -- insertion, growth, eviction -------------------------------------------------------------

    def _can_grow(self) -> bool:
        """Growth moves rows: only when no step but the current one is pending and no earlier
        lookup's update is still to come (a late backward finds its rows where it left them)."""
        return self.space.can_grow(len(self.steps.pending)) and not self._updates_to_come

    def _insert(
        self,
        keys: torch.Tensor,
        step: Optional[Step],
        keys_ascending: bool = False,
        write_id: Optional[int] = None,
    ) -> InsertPlan:
        """Gives rows to absent ``keys`` (unique; ``keys_ascending``: in ascending order); returns
        the plan it committed: their slots (-1: no row), how many got one, the residents moved.
        ``step``: the training step doing it (its journal records the changes), or None
        (``write_rows``, which pinned its own rows with the id ``write_id``: they may move to their
        other bucket, and are not evicted).

        A row this step already looked up may move to its other bucket to make room (its slot
        changes; the caller follows the plan's moves), unless the table served this step before:
        that lookup's slots are final. Rows pinned by other pending steps never move."""
        journal = step.journal if step is not None else None
        space = self.space
        while self._can_grow() and space.crowded(keys.numel()):
            space.grow(journal)
        while True:
            allow_evict = self.score_policy.evicts and (space.at_max or not self._can_grow())
            plan = self.index.plan_insert(
                keys,
                pinned_by=self.pending_ids(*([] if write_id is None else [write_id])),
                allow_evict=allow_evict,
                movable_pins=self.movable_pins(step, write_id),
                keys_ascending=keys_ascending,
            )
            if plan.dropped and self._can_grow():
                space.grow(journal)
                continue
            break
        overflow = plan.dropped
        if overflow and write_id is not None:  # a write is refused whole, before it changes a row
            if self.score_policy.evicts:
                why, then = (
                    "their buckets hold this write's own rows",
                    "write fewer new keys at once or raise max_capacity",
                )
            else:  # (nothing is evicted: a full bucket stays full)
                why = "their buckets are full, and score_strategy 'none' evicts no row"
                then = "raise max_capacity, or give the table a score_strategy that evicts"
            raise TableFullError(
                f"table '{self.name}': write_rows could not place {overflow} of its new key(s) (max_capacity "
                f"{self.max_capacity}; {why}); nothing was written: {then}"
            )
        self.count_insert(journal, plan.placed, overflow, plan.evicted_slots.numel(), plan.moved_from.numel())
        move_rows(self.store, plan, journal)
        self.index.commit(plan, torch.zeros_like(keys), journal)
        new_slots, new_keys = plan.slots, keys
        if plan.placed < keys.numel():
            ok = plan.slots >= 0
            new_slots, new_keys = plan.slots[ok], keys[ok]
        self.store.init_rows(new_slots, new_keys, self.initializer, self.config.seed, self.config.default_bound)  # type: ignore[arg-type]
        if step is not None:
            self.index.pin(new_slots, step.id)
        return plan

    def count_insert(
        self, journal: Optional[Journal], placed: int, dropped: int, evicted: int, moved: int, depth: int = 0
    ) -> None:
        """Counts an insert's keys (before its commit): ``dropped`` keys left without a row follow
        ``check_mode`` (a ``TableFullError``, a warning, or nothing), and the counters of
        :meth:`report` take the dropped, evicted and moved keys. ``depth``: frames between the
        collection's lookup and this call, past a table's own (the warning names that line)."""
        if not (dropped or evicted or moved):  # only keys placed in free slots: nothing to count
            return
        options = self.options
        if dropped:
            message = (
                f"table '{self.name}': {dropped} new key(s) could not get a row (capacity "
                f"{self.capacity}, max_capacity {self.max_capacity}, score_strategy "
                f"'{options.score_strategy}'; their buckets are full of rows "
                f"{'pinned in this step' if options.score_strategy != 'none' else 'that cannot be evicted'})"
            )
            if options.check_mode == "error":
                raise TableFullError(message + "; raise max_capacity or set check_mode 'warn'/'ignore'")
            if options.check_mode == "warn":
                warnings.warn(message + "; they read the eval initializer and get no update", stacklevel=7 + depth)
        # Evictions while a slot was still free somewhere (below full capacity) are the ones
        # max_capacity promises to avoid; report() counts them apart.
        free_left = self.max_capacity - (self.size + placed - evicted)
        self.space.count(
            journal, dropped=dropped, evicted=evicted, premature=min(evicted, max(free_left, 0)), moved=moved
        )

    def movable_pins(self, step: Optional[Step], write_id: Optional[int] = None) -> Optional[torch.Tensor]:
        if write_id is not None:
            return torch.tensor([write_id], dtype=torch.int64)
        if step is None or self.served_step == step.id:
            return None
        return torch.tensor([step.id], dtype=torch.int64)

    # -- rows by key ---------------------------------------------------------------------------

    def read_rows(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``weight`` and states of each key, plus ``present`` ``[n]`` bool: rows of absent keys
        are zeros (they have no row; a lookup would read the eval initializer)."""
        keys = self.row_ids(ids, "read_rows")
        slots = self.index.find(keys)
        present = slots >= 0
        out = self.store.read(slots.clamp(min=0))
        for t in out.values():
            t[~present] = 0
        out["present"] = present
        return out

    def write_rows(self, ids: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """Writes rows by key, creating rows for absent keys (fresh state where not given).
        ``values`` may hold :meth:`read_rows`' ``present`` ``[n]`` bool: only the rows it marks
        are written (``write_rows(ids, read_rows(ids))`` changes nothing and creates no key).
        Refused while a training step is pending: a growth would move the rows its backward
        updates."""
        self.steps.check_idle("write_rows")
        keys = self.row_ids(ids, "write_rows")
        present = values.get("present")
        values = {name: v for name, v in values.items() if name != "present"}
        self.check_row_values(values, keys.numel())  # (before a new key takes a row, or evicts one)
        if present is not None:
            keys, values = self._present_rows(keys, values, present)
        if torch.unique(keys).numel() != keys.numel():
            raise ValueError(f"table '{self.name}': write_rows got duplicate keys")
        slots = self.index.find(keys)
        absent = slots < 0
        if bool(absent.any()):
            # The write's own rows are pinned while it inserts its new keys: at max_capacity an
            # eviction takes another key's row, never one this write is about to write (a pinned
            # row may still move to its other bucket: its key is found again below).
            write_id = self.steps.new_id()
            self.index.pin(slots, write_id)
            self._insert(keys[absent], step=None, write_id=write_id)  # refused whole if a key gets no row
            # Found again: the insert may have moved rows (a growth, a cuckoo step).
            slots = self.index.find(keys)
            lost = int((slots < 0).sum())
            if lost:  # a growth into max_capacity that dropped keys (see BucketedHashIndex.fill)
                raise TableFullError(
                    f"table '{self.name}': growing to place write_rows' new keys lost {lost} of its key(s) "
                    f"(max_capacity {self.max_capacity}); raise max_capacity"
                )
        self.store.write(slots, values)

    def _present_rows(
        self, keys: torch.Tensor, values: dict[str, torch.Tensor], present
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The keys and rows of ``values`` (checked: a row a key) where ``present`` is true;
        ValueError for a ``present`` that is not ``[n]`` bool."""
        present = torch.as_tensor(present)
        if present.dtype != torch.bool or tuple(present.shape) != tuple(keys.shape):
            raise ValueError(
                f"table '{self.name}': write_rows' present must be {list(keys.shape)} bool (read_rows' mask), got "
                f"{list(present.shape)} {present.dtype}"
            )
        rows = {n: torch.as_tensor(v) for n, v in values.items()}
        return keys[present.to(keys.device)], {n: v[present.to(v.device)] for n, v in rows.items()}

    # -- dump and load -------------------------------------------------------------------------

    def dump(self) -> dict[str, torch.Tensor]:
        """Every key (ascending) with its weight (in the rows' storage dtype, as a fixed table's
        dump), optimizer states, score and slot; the bucket layout; the step counter; the
        admission counter's keys, counts and slots. CPU tensors (:mod:`.snapshot`)."""
        counter = None if self.admission is None else self.admission.counter
        out = snapshot.dump(self.index, self.store, self.step, counter)
        out["weight"] = out["weight"].to(ROW_DTYPES[self.config.data_type])  # (exact: read widened it)
        return out

    def check_dump(self, dump: Mapping[str, torch.Tensor], weights_only: bool = False) -> list[str]:
        fields = self._dump_fields(dump, weights_only)
        self._check_rows(dump, fields, snapshot.check_dump(dump, self.name))
        return fields

    @torch.no_grad()
    def keys_without_room(self, dump: Mapping[str, torch.Tensor]) -> int:
        """How many of ``dump``'s keys (a dump :meth:`check_dump` accepts) a :meth:`load` to
        train would leave out: more keys than ``max_capacity`` places (or than their buckets
        hold). 0 for a table of a group's shared index, which places keys as it loads them."""
        if self.space.shared:
            return 0
        held = self.space.max_buckets
        self.space.max_buckets = self._max_buckets  # (as load() holds it)
        try:
            return snapshot.keys_left_out(dict(dump), self.space)
        finally:
            self.space.max_buckets = held

    @torch.no_grad()
    def load(self, dump: dict[str, torch.Tensor], weights_only: bool = False, to_read: bool = False) -> dict[str, int]:
        """Replaces the table's contents by ``dump`` (from :meth:`dump`, of any capacity).

        When the dump's bucket layout fits this table (same bucket size, a capacity from
        ``init_capacity`` to ``max_capacity``), every key goes back to its own slot at the dump's
        capacity, so a resumed run evicts exactly as the original would have. Otherwise the
        capacity becomes the smallest from ``init_capacity`` on that holds every key at
        ``growth_load_factor``, capped at ``max_capacity``; when the rows do not fit, the highest
        scores are kept (ties to the smaller key).
        ``weights_only`` resets optimizer states to their initial values and the step counter to
        0. Returns ``{"loaded": n, "dropped": m, "admission_dropped": c}`` (``c``: admission
        counts that found no room in a counter of another layout).

        ``to_read``: the table is loaded to be read (evaluated, exported, served: no key is
        inserted), with every key of the dump: past ``max_capacity`` where the keys need it, which
        then becomes the table's. A checkpoint of N ranks whose shards are full holds as many keys
        as their slots together, more than the buckets of one ``max_capacity`` place (a bucket
        overflows before the table is full, and each shard's capacity is rounded up to whole
        buckets). A table of a group's shared index has exactly its slots: ``to_read`` changes
        nothing there.
        """
        fields = self.check_dump(dump, weights_only)
        self.space.max_buckets = self._max_buckets  # (a load to train is held to max_capacity, whatever came before)
        index, slots, src = snapshot.index_for_load(dump, self.space, past_max=to_read and not self.space.shared)
        self.space.max_buckets = max(self._max_buckets, index.num_buckets)
        self.space.install(index)
        self._load_rows(slots, src, dump, fields, weights_only)
        counts_dropped = 0
        if self.admission is not None:
            fresh = self.admission.fresh_counter()
            self.admission.counter, counts_dropped = snapshot.restored_counter(fresh, None if weights_only else dump)
        loaded = slots.numel()
        return {"loaded": loaded, "dropped": dump["keys"].numel() - loaded, "admission_dropped": counts_dropped}


@dataclass(frozen=True, eq=False)
class AbsentKeys:
    """The keys of a find without a row: ``positions`` ``[m]`` int64 (ascending, into the find's
    keys), and ``keys[positions]`` as ``torch.unique`` gives them: ``unique`` ``[u]`` (ascending),
    ``inverse`` ``[m]`` (each position's index into ``unique``), ``counts`` ``[u]``."""

    positions: torch.Tensor
    unique: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def of(cls, keys: torch.Tensor, slots: torch.Tensor) -> AbsentKeys:
        """Those of ``keys`` ``[n]`` whose ``slots`` ``[n]`` are -1 (``dynarec::absent_keys``: one
        host read on a GPU for their number, one for the unique keys')."""
        return cls(*torch.ops.dynarec.absent_keys(keys, slots))

    @classmethod
    def of_parts(
        cls, keys: torch.Tensor, slots: torch.Tensor, parts: torch.Tensor, num_parts: int
    ) -> tuple[AbsentKeys, torch.Tensor, list[int]]:
        """:meth:`of` with keys distinct by ``(partition, key)`` (``parts`` ``[n]`` int64: each
        key's partition, a table of a group's shared index): ``unique`` ordered by partition,
        then key. Also each unique key's partition ``[u]``, and how many distinct keys each
        partition has (a host list: with ``nonzero``'s, two host reads on a GPU whatever the
        number of partitions)."""
        positions = torch.nonzero(slots < 0).squeeze(1)  # ascending
        k, t = keys[positions], parts[positions]
        order = torch.argsort(k, stable=True)
        order = order[torch.argsort(t[order], stable=True)]  # by partition, then key
        sk, st = k[order], t[order]
        first = torch.ones_like(sk, dtype=torch.bool)  # the first of each (partition, key)
        first[1:] = (sk[1:] != sk[:-1]) | (st[1:] != st[:-1])
        uid = torch.cumsum(first, 0) - 1
        inverse = torch.empty_like(uid).index_copy_(0, order, uid)
        distinct = torch.zeros(num_parts, dtype=torch.int64, device=keys.device).index_add_(0, st, first.long())
        distinct_of = distinct.tolist()  # the host read besides nonzero's
        firsts = torch.nonzero_static(first, size=sum(distinct_of)).squeeze(1)
        unique = sk[firsts]
        counts = torch.zeros_like(unique).index_add_(0, uid, torch.ones_like(uid))
        return cls(positions, unique, inverse, counts), st[firsts], distinct_of


def move_rows(store: RowStore, plan: InsertPlan, journal: Optional[Journal]) -> None:
    """The rows of ``plan``'s moved residents follow them to their new slots (a slot is a row
    of ``store``), and ``journal`` records how to bring back every row the plan's commit
    overwrites (evicted and moved residents')."""
    overwritten = plan.overwritten_slots
    if journal is not None and overwritten.numel():
        rows = store.read(overwritten)
        journal.record(lambda: store.write(overwritten, rows))
    if plan.moved_from.numel():
        store.write(plan.moved_to, store.read(plan.moved_from))


def present_bags(
    bags: Bags, rows: torch.Tensor, bag_of_id: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(rows, offsets, weights)`` of ``bags`` keeping only the ids with a row (``rows[i] >=
    0``; ``bag_of_id``: each id's bag, ``bags_of_ids``): the same bags, each without its absent ids."""
    present = rows >= 0
    lengths = torch.bincount(bag_of_id[present], minlength=bags.num_bags)
    offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    return rows[present], offsets, None if bags.weights is None else bags.weights[present]


def refuse_moved_rows(
    out: torch.Tensor,
    step: Step,
    slots: torch.Tensor,
    index_keys: Callable[[], torch.Tensor],
    name: Union[str, Callable[[torch.Tensor], str]],
) -> None:
    """Refuses the backward of ``out`` (a training lookup of the rows at ``slots`` of an index
    whose keys ``index_keys()`` gives now) where its rows changed keys since: a later step's
    backward may commit ``step`` first (a model's two lookups in one backward, or a backward left
    for later), its rows are no longer pinned then, so their keys are kept aside, and this
    lookup's own backward updates them only where they still hold those keys (a forward since may
    have given a row to another key: refused, nothing updated). ``name``: the table the error
    names, or a function of the slots whose keys changed giving it (a group's). Register it
    before the output's commit hook."""
    kept: list[torch.Tensor] = []

    def keep_keys() -> None:  # (the step committed; by a later step's backward where its own has not run)
        if not step.backward_ran:
            kept.append(index_keys()[slots])

    def check(_grad: torch.Tensor) -> None:
        if not kept:
            return
        changed = _moved_rows(index_keys(), slots, kept[0])
        if changed is not None:
            who = name if isinstance(name, str) else name(changed)
            raise late_backward(who, step, "a later step's backward committed it, and its rows changed keys")

    step.on_commit.append(keep_keys)
    out.register_hook(check)


def _moved_rows(index_keys: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> Optional[torch.Tensor]:
    """The slots among ``slots`` that no longer hold their ``keys`` (one host read), or None:
    every row holds its key still."""
    if slots.numel() and int(slots.max()) >= index_keys.numel():  # (a smaller index loaded since)
        return slots
    now = index_keys[slots]
    return None if bool(torch.equal(now, keys)) else slots[now != keys]
