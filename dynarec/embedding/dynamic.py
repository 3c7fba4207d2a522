"""Dynamic tables: any int64 key, rows created on demand, grown, evicted, optionally admitted.

A :class:`DynamicTable` is a :class:`BucketedHashIndex` (key -> slot, with a score per slot) in
front of the same :class:`RowStore` a fixed table uses: slot ``s`` is row ``s``. So the optimizer
code exists once, and ``initial_accumulator_value`` (or any other optimizer setting) means the
same thing here as on a fixed table: a created row gets the initializer's weights and every
state at the spec's initial value — on first insertion and again when an evicted key returns.

Row lifecycle in a training forward:
1. The step counter advances; keys found in the index are pinned (no insert of this step, or
   of another forward before this step's backward, may evict them).
2. Absent keys are counted by the admission counter, if any; those that reach the threshold
   (or all absent keys, without admission) are inserted. Below ``max_capacity`` the table grows
   (doubling the buckets, rehashing, rows moved bit-exactly) when the load would pass
   ``growth_load_factor`` or a bucket is full; at ``max_capacity`` the lowest-score unpinned row
   of the key's bucket is evicted, ties to the smaller slot.
3. A key left without a row follows ``check_mode`` (error / warn / ignore): it reads the eval
   initializer and gets no update; ``dropped_keys`` counts them.
4. Scores are updated: ``step`` = this step, ``lfu`` += occurrences, ``timestamp`` = now (us).

Eval mode only finds: nothing is created, evicted, counted or updated.
"""

from __future__ import annotations

import time
import warnings
from typing import Optional

import torch

from dynarec.embedding.config import TableConfig
from dynarec.embedding.hash_index import BucketedHashIndex, InsertPlan
from dynarec.embedding.row_store import RowStore
from dynarec.embedding.table import EmbeddingTable, make_row_store
from dynarec.optim.base import OptimizerSpec

__all__ = ["DynamicTable", "TableFullError"]


class TableFullError(RuntimeError):
    """Raised (check_mode ``error``) when keys cannot get a row."""


def _num_buckets(capacity: int, bucket_size: int) -> int:
    return max(1, capacity // bucket_size)


class DynamicTable(EmbeddingTable):
    def __init__(self, config: TableConfig, spec: OptimizerSpec, device: torch.device):
        super().__init__(config, spec, device)
        assert config.dynamic is not None
        self.options = options = config.dynamic
        self.bucket_size = options.bucket_size
        self.max_buckets = _num_buckets(options.max_capacity, options.bucket_size)  # type: ignore[arg-type]
        num_buckets = min(self.max_buckets, _num_buckets(options.init_capacity, options.bucket_size))  # type: ignore[arg-type]
        self.index = BucketedHashIndex(num_buckets, self.bucket_size, self.device)
        self._store = make_row_store(config, spec, self.index.capacity, self.device)
        self._pinned = torch.zeros(self.index.capacity, dtype=torch.bool, device=self.device)
        self._pending: list[int] = []  # sequence numbers of training lookups awaiting backward
        self._lookups = 0
        self._last_seq: Optional[int] = None
        self.counter: Optional[BucketedHashIndex] = None
        if options.admission is not None:
            cap = options.admission.capacity or options.max_capacity
            self.counter = BucketedHashIndex(_num_buckets(cap, self.bucket_size), self.bucket_size, self.device)
            self.admission_initializer = options.admission.initializer or self.eval_initializer
        self.dropped_keys = 0
        self.evicted_keys = 0
        self._generation = 0  # bumped by every rehash, which moves rows

    @property
    def store(self) -> RowStore:
        return self._store

    @property
    def capacity(self) -> int:
        return self.index.capacity

    @property
    def max_capacity(self) -> int:
        return self.max_buckets * self.bucket_size

    def size(self) -> int:
        return self.index.size()

    @property
    def nbytes(self) -> int:
        """Bytes held by the table: rows, states, index, pins and admission counter."""
        total = self.store.nbytes + self.index.nbytes + self._pinned.numel()
        if self.counter is not None:
            total += self.counter.nbytes
        return total

    def report(self) -> dict[str, object]:
        size = self.size()
        return {
            "size": size,
            "capacity": self.capacity,
            "max_capacity": self.max_capacity,
            "load_factor": size / self.capacity,
            "evicted_keys": self.evicted_keys,
            "dropped_keys": self.dropped_keys,
            "bytes": self.nbytes,
        }

    def describe(self) -> dict[str, object]:
        return {**super().describe(), **self.report()}

    # -- lookups -------------------------------------------------------------------------------

    def eval_initializer_for(self, train: bool):
        """In training, a table with admission reads the admission initializer for keys without a
        row (not yet admitted, or dropped); eval always reads the eval initializer."""
        return self.admission_initializer if (train and self.counter is not None) else self.eval_initializer

    def rows_for(self, ids: torch.Tensor, train: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        slots = self.index.find(ids)  # every occurrence; duplicates are harmless below
        if not train:
            return slots, slots >= 0
        absent = slots < 0
        if bool(absent.any()):
            self._pinned[slots[~absent]] = True  # before inserting: this step's rows stay
            keys, inverse, counts = torch.unique(ids[absent], return_inverse=True, return_counts=True)
            candidates = torch.arange(keys.numel(), device=ids.device)
            if self.counter is not None:
                candidates = candidates[self._count_admission(keys, counts)]
            if candidates.numel():
                generation = self._generation
                new_slots = torch.full_like(keys, -1)
                new_slots[candidates] = self._insert(keys[candidates])
                if self._generation != generation:  # the table grew: every row moved
                    slots = self.index.find(ids)
                else:
                    slots[absent] = new_slots[inverse]
        present = slots >= 0
        touched = slots[present]  # one entry per occurrence
        self._pinned[touched] = True
        strategy = self.options.score_strategy
        if strategy == "step":
            self.index.scores[touched] = self.store.step
        elif strategy == "lfu":
            self.index.scores.index_add_(0, touched, torch.ones_like(touched))
        elif strategy == "timestamp":
            self.index.scores[touched] = time.time_ns() // 1000
        return slots, present

    def on_lookup(self, out: torch.Tensor, train: bool) -> None:
        if not train:
            return
        self._last_seq = None
        if out.requires_grad:
            self._lookups += 1
            seq = self._last_seq = self._lookups
            self._pending.append(seq)
            out.register_hook(lambda grad: self._settle(seq))
        else:
            self._release_pins_if_settled()

    @property
    def _pending_backward(self) -> int:
        return len(self._pending)

    def _settle(self, seq: int) -> None:
        """The backward of lookup ``seq`` ran: it settles every lookup up to ``seq`` (an earlier
        one whose backward never came was abandoned); with none left, pins are released."""
        self._pending = [s for s in self._pending if s > seq]
        self._release_pins_if_settled()

    def _release_pins_if_settled(self) -> None:
        """Pins last until every training lookup's backward has run (or been settled)."""
        if not self._pending:
            self._pinned.zero_()

    def abort_step(self, looked_up: bool) -> None:
        """Also releases the aborted forward's pins (and its pending backward)."""
        super().abort_step(looked_up)
        if looked_up and self._last_seq in self._pending:
            self._pending.remove(self._last_seq)
        self._release_pins_if_settled()

    # -- admission -----------------------------------------------------------------------------

    def _count_admission(self, keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Adds this batch's occurrences; returns the mask of keys that reach the threshold
        (removed from the counter, to be inserted)."""
        counter = self.counter
        assert counter is not None and self.options.admission is not None
        slots = counter.find(keys)
        seen = slots >= 0
        counter.scores.index_add_(0, slots[seen], counts[seen])
        protected = torch.zeros_like(counter.occupied)
        protected[slots[seen]] = True
        plan = counter.plan_insert(keys[~seen], protected=protected, allow_evict=True)
        counter.commit(plan, counts[~seen])
        slots[~seen] = plan.slots
        totals = torch.where(slots >= 0, counter.scores[slots.clamp(min=0)], torch.zeros_like(counts))
        admitted = totals >= self.options.admission.threshold
        counter.remove(slots[admitted])
        return admitted

    # -- insertion, growth, eviction -------------------------------------------------------------

    def _can_grow(self) -> bool:
        return self.index.num_buckets < self.max_buckets and self._pending_backward == 0

    def _insert(self, keys: torch.Tensor) -> torch.Tensor:
        """Gives rows to absent ``keys`` (unique); returns their slots (-1: no row)."""
        while self._can_grow() and self.size() + keys.numel() > self.options.growth_load_factor * self.capacity:
            self._grow()
        while True:
            at_max = self.index.num_buckets == self.max_buckets
            allow_evict = self.options.score_strategy != "none" and (at_max or not self._can_grow())
            plan = self.index.plan_insert(keys, protected=self._pinned, allow_evict=allow_evict)
            if bool(plan.overflow.any()) and self._can_grow():
                self._grow()
                continue
            break
        overflow = int(plan.overflow.sum())
        if overflow:
            message = (
                f"table '{self.name}': {overflow} new key(s) could not get a row (capacity "
                f"{self.capacity}, max_capacity {self.max_capacity}, score_strategy "
                f"'{self.options.score_strategy}'; their buckets are full of rows "
                f"{'pinned in this step' if self.options.score_strategy != 'none' else 'that cannot be evicted'})"
            )
            if self.options.check_mode == "error":
                raise TableFullError(message + "; raise max_capacity or set check_mode 'warn'/'ignore'")
            if self.options.check_mode == "warn":
                warnings.warn(message + "; they read the eval initializer and get no update", stacklevel=4)
            self.dropped_keys += overflow
        self.evicted_keys += plan.evicted_slots.numel()
        self.index.commit(plan, torch.zeros_like(keys))
        ok = plan.slots >= 0
        new_slots = plan.slots[ok]
        self.store.reset_rows(new_slots, self.initial_weights(keys[ok]))
        self._pinned[new_slots] = True
        return plan.slots

    def _grow(self) -> None:
        self._rehash(min(self.max_buckets, self.index.num_buckets * 2))

    @torch.no_grad()
    def _rehash(self, num_buckets: int) -> int:
        """Moves every row into an index of ``num_buckets`` buckets; returns rows dropped (only
        possible when a bucket of the new index overflows, i.e. not on a doubling)."""
        slots, keys, scores = self.index.entries()
        index = BucketedHashIndex(num_buckets, self.bucket_size, self.device)
        plan = index.plan_insert(keys, allow_evict=False, priority=scores)
        index.commit(plan, scores)
        ok = plan.slots >= 0
        pinned = self._pinned[slots[ok]]
        self.store.resize(index.capacity, slots[ok], plan.slots[ok])
        self.index = index
        self._generation += 1
        self._pinned = torch.zeros(index.capacity, dtype=torch.bool, device=self.device)
        self._pinned[plan.slots[ok]] = pinned
        dropped = int((~ok).sum())
        self.evicted_keys += dropped
        return dropped

    # -- rows by key ---------------------------------------------------------------------------

    def read_rows(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``weight`` and states of each key, plus ``present`` ``[n]`` bool: rows of absent keys
        are zeros (they have no row; a lookup would read the eval initializer)."""
        keys = torch.as_tensor(ids, dtype=torch.int64, device=self.device)
        slots = self.index.find(keys)
        present = slots >= 0
        out = self.store.read(slots.clamp(min=0))
        for t in out.values():
            t[~present] = 0
        out["present"] = present
        return out

    def write_rows(self, ids: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """Writes rows by key, creating rows for absent keys (fresh state where not given)."""
        keys = torch.as_tensor(ids, dtype=torch.int64, device=self.device)
        if torch.unique(keys).numel() != keys.numel():
            raise ValueError(f"table '{self.name}': write_rows got duplicate keys")
        slots = self.index.find(keys)
        absent = slots < 0
        if bool(absent.any()):
            new = self._insert(keys[absent])
            self._release_pins_if_settled()  # write_rows has no backward to wait for
            slots[absent] = new
            if bool((new < 0).any()):
                raise TableFullError(f"table '{self.name}': write_rows could not place every key")
        self.store.write(slots, values)

    # -- dump and load -------------------------------------------------------------------------

    def dump(self) -> dict[str, torch.Tensor]:
        """Every key (ascending) with its weight, optimizer states and score; the step counter;
        the admission counter's keys and counts. CPU tensors."""
        slots, keys, scores = self.index.entries()
        out: dict[str, torch.Tensor] = {"keys": keys, "scores": scores, "slots": slots}
        out.update(self.store.read(slots))
        out["step"] = torch.tensor(self.store.step, dtype=torch.int64)
        out["layout"] = torch.tensor([self.index.num_buckets, self.bucket_size], dtype=torch.int64)
        if self.counter is not None:
            cslots, ckeys, ccounts = self.counter.entries()
            out["admission_keys"], out["admission_counts"], out["admission_slots"] = ckeys, ccounts, cslots
        return {k: v.cpu() for k, v in out.items()}

    @torch.no_grad()
    def load(self, dump: dict[str, torch.Tensor], weights_only: bool = False) -> dict[str, int]:
        """Replaces the table's contents by ``dump`` (from :meth:`dump`, of any capacity).

        When the dump's bucket layout fits this table (same bucket size, no more buckets than
        ``max_capacity`` allows), every key goes back to its own slot at the dump's capacity, so
        a resumed run evicts exactly as the original would have. Otherwise the capacity becomes
        the smallest that holds every key at ``growth_load_factor``, capped at ``max_capacity``;
        when the rows do not fit, the highest scores are kept (ties to the smaller key).
        ``weights_only`` resets optimizer states to their initial values and the step counter to
        0. Returns ``{"loaded": n, "dropped": m}``.
        """
        keys = dump["keys"].to(self.device)
        scores = dump["scores"].to(self.device)
        n = keys.numel()
        layout = dump.get("layout")
        if layout is not None and "slots" in dump:
            num_buckets, bucket_size = (int(x) for x in layout)
            if bucket_size == self.bucket_size and num_buckets <= self.max_buckets:
                index = BucketedHashIndex(num_buckets, bucket_size, self.device)
                slots = dump["slots"].to(self.device)
                index.commit(InsertPlan(keys, slots, slots[:0]), scores)
                return self._restore(index, slots, torch.arange(n, device=self.device), dump, weights_only)
        num_buckets = _num_buckets(self.options.init_capacity, self.bucket_size)  # type: ignore[arg-type]
        num_buckets = min(num_buckets, self.max_buckets)
        while num_buckets < self.max_buckets and n > self.options.growth_load_factor * num_buckets * self.bucket_size:
            num_buckets = min(self.max_buckets, num_buckets * 2)
        keep = torch.arange(n, device=self.device)
        capacity = num_buckets * self.bucket_size
        if n > capacity:  # globally highest scores first, ties to the smaller key (keys ascend)
            keep = torch.argsort(-scores, stable=True)[:capacity]
        index = BucketedHashIndex(num_buckets, self.bucket_size, self.device)
        plan = index.plan_insert(keys[keep], allow_evict=False, priority=scores[keep])
        index.commit(plan, scores[keep])
        ok = plan.slots >= 0
        return self._restore(index, plan.slots[ok], keep[ok], dump, weights_only)

    def _restore(self, index: BucketedHashIndex, slots: torch.Tensor, src: torch.Tensor,
                 dump: dict[str, torch.Tensor], weights_only: bool) -> dict[str, int]:
        """Installs ``index`` and writes dump rows ``src`` into ``slots``."""
        self.index = index
        self._generation += 1
        self.store.reallocate(index.capacity)
        self._pinned = torch.zeros(index.capacity, dtype=torch.bool, device=self.device)
        self._pending = []
        fields = ["weight"] if weights_only else ["weight", *self.store.states]
        self.store.write(slots, {f: dump[f].to(self.device)[src] for f in fields})
        self.store.step = 0 if weights_only else int(dump["step"])
        if self.counter is not None:
            cap = self.counter.capacity
            self.counter = BucketedHashIndex(self.counter.num_buckets, self.bucket_size, self.device)
            if not weights_only and "admission_keys" in dump:
                ckeys = dump["admission_keys"].to(self.device)
                ccounts = dump["admission_counts"].to(self.device)
                cslots = dump.get("admission_slots")
                if cslots is not None and (cslots.numel() == 0 or int(cslots.max()) < cap):
                    cslots = cslots.to(self.device)
                    cplan = InsertPlan(ckeys, cslots, cslots[:0])  # the counter's own layout
                else:
                    cplan = self.counter.plan_insert(ckeys, allow_evict=False, priority=ccounts)
                self.counter.commit(cplan, ccounts)
        n = dump["keys"].numel()
        return {"loaded": slots.numel(), "dropped": n - slots.numel()}
