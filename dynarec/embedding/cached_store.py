"""A host-memory tier: a table's rows in host memory, its hot rows cached on the device.

FBGEMM TBE's managed caching and dynamicemb's caching mode keep a table's rows (weights and
optimizer states together) in host memory and the rows a step touches in a cache on the device.
:class:`CachedRowStore` does that for a fixed table's rows and for a dynamic table's slots:
``cache_rows`` slots on the device, each holding one row of the table with its states, over
every row in host memory. A dynamic table's hash index stays on the device (a key is found,
inserted or evicted there whether its row is cached or not: the rows move, the keys do not), and
its rows grow in host memory; the cache keeps its size (the share of the table's largest).

A lookup first makes every row of its bags resident. The batch's rows missing from the cache
take the slots of the least recently used rows (empty slots first); the rows they displace are
written back to host memory with their states first. A slot a training lookup used is kept until
that lookup's fused update has run (or its output was dropped without a backward): gradient
accumulation and late backwards find their rows where they left them. A batch needing more rows
than the cache can give is a named error. The lookup and its fused update then run on the cache
exactly as on a table's own rows (:class:`NativeRowStore`), cache slots standing for rows: each
row's values are moved, never recomputed, so a cached table trains as the same table kept whole
on the device (bit for bit on the CPU, whose update sums a row's gradients in occurrence order
whatever the rows' numbering; to float32 summation order on a GPU, whose update blocks depend
on the numbering).

A lookup's rows may be made resident ahead (:meth:`CachedRowStore.prefetch`, a collection's
input stage of a coming batch, on its input stream: FBGEMM's and dynamicemb's prefetch
pipelines): the rows move while the device runs the steps before, and the :class:`CacheHold`
it gives keeps them in their slots until the batch's lookup, which then reads their slots from
it with no host read. A prefetch spares the slots of every lookup whose update is still to come
or still running on the device, and of every hold; where those leave too few, it loads nothing
and the lookup loads the rows itself. Every other use of the store, on any stream, first waits
for the uses, updates and moves queued before it on the others (events): the streams see the
store in the order the host called it.

Rows move by ``dynarec::exchange_rows``, one launch a field (the weights, each state) and a
lookup: the rows a lookup displaces are written back and its missing rows read into their slots
by the device itself, over its link, from host memory locked in place for it
(:func:`~dynarec.devices.page_lock`; a CPU "device" moves them with torch ops). The host reads or
frees the host rows only after waiting for the device (whole-table views, growth, loads).

Rows read, written or reset from outside (``read``, ``write``, ``reset_rows``: a dynamic
table's inserts, moves and evictions, ``write_rows``) go to wherever each row lives, the cache
or host memory. Whole-table views (``weight``, ``states``: dumps) write the cache back and empty
it, refused while a training lookup's update is still to come. A growth moves the rows in host
memory and renumbers the cached ones in place. On the device the cache keeps a map from every
row of the table to its slot (4 bytes a row; FBGEMM's set-associative cache needs none: not
built).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Optional, TypeVar

import torch

from dynarec.devices import HostMemoryError, synchronize
from dynarec.embedding.row_store import NativeRowStore, RowStore, field_rows
from dynarec.embedding.step import StepPendingError
from dynarec.embedding.streams import current_stream, rows_stream
from dynarec.optim.base import OptimizerSpec
from dynarec.optim.fused import RowScores
from dynarec.optim.rounding import RowKeys

if TYPE_CHECKING:
    from dynarec.embedding.initializers import Initializer

__all__ = ["CacheFullError", "CacheHold", "CachedRowStore"]

_T = TypeVar("_T")


class CacheFullError(RuntimeError):
    """A batch needs more rows on the device than a table's cache can give it."""


def _in_order_of_uses(method: Callable[..., _T]) -> Callable[..., _T]:
    """A use of a :class:`CachedRowStore` (see :meth:`CachedRowStore._in_order`)."""

    @functools.wraps(method)
    def use(self: CachedRowStore, *args, **kwargs) -> _T:
        with self._in_order():
            return method(self, *args, **kwargs)

    return use


_ALL_USES = frozenset({"use", "update", "moves"})


class CacheHold:
    """Rows :meth:`CachedRowStore.prefetch` made resident for a coming lookup: ``slots`` ``[n]``
    int64, the cache slot of each row it was given, in order; its rows keep their slots until
    :meth:`release` (or until the hold is dropped), unless the cache is emptied, resized or
    reloaded meanwhile, or a lookup needed their slots (the lookup then finds them again)."""

    def __init__(self, store: CachedRowStore, slots: torch.Tensor, tick: int):
        self.slots = slots
        self._store = store
        self._generation = store._generation
        self.release = weakref.finalize(self, store._reserved.discard, tick)
        #: On a GPU, the event after its rows' moves (on the rows stream), where it moved any.
        self.moved: Optional[torch.cuda.Event] = None

    @property
    def valid(self) -> bool:
        """Whether every row is still in the slot :attr:`slots` gives it."""
        return self.release.alive and self._generation == self._store._generation

    def lookup(self, rows, offsets, per_sample_weights, train, step=0, row_scores: Optional[RowScores] = None):
        """The store's lookup of ``rows`` (the rows given to the prefetch), reading their slots here."""
        return self._store.lookup(rows, offsets, per_sample_weights, train, step, row_scores, hold=self)


class CachedRowStore(RowStore):
    """``num_rows`` rows in host memory, ``cache_rows`` of them at a time on ``device`` (see the
    module's doc). ``name`` names the table in errors. ``dtype`` and ``rounding_seed``: the
    rows' storage, as :class:`NativeRowStore`'s; half-precision rows' rounding draws are keyed by
    :attr:`row_keys` (set by the owning table, in its rows' numbering) whatever slot a row takes."""

    def __init__(
        self,
        num_rows: int,
        dim: int,
        spec: OptimizerSpec,
        device: torch.device | str,
        cache_rows: int,
        name: str = "",
        dtype: torch.dtype = torch.float32,
        rounding_seed: int = 0,
    ):
        super().__init__(num_rows, dim, spec, torch.device(device))
        if cache_rows < 1:
            raise ValueError(f"table '{name}': a cache needs at least one row, got {cache_rows}")
        self.name = name
        self.cache_rows = cache_rows
        self.row_keys = RowKeys()
        with self._naming_host_errors():
            self.host = NativeRowStore(
                num_rows,
                dim,
                spec,
                "cpu",
                dtype=dtype,
                rounding_seed=rounding_seed,
                page_locked=self.device.type == "cuda",
                records=True,  # a row's fields side by side: one place for the GPU to reach
            )
        self.cache = NativeRowStore(self.cache_rows, dim, spec, self.device, dtype=dtype, rounding_seed=rounding_seed)
        self.cache.row_keys = RowKeys(keys=self._slot_keys)  # a slot's draws are its row's
        self.counters = {"loaded": 0, "written_back": 0, "prefetched": 0, "prefetches_skipped": 0}
        self._clock = 0  # one tick a lookup or prefetch
        self._in_flight: set[int] = set()  # ticks of training lookups whose update is still to come
        self._reserved: set[int] = set()  # ticks of prefetches whose hold is kept
        self._updating: list[tuple[int, torch.cuda.Event]] = []  # updates queued on a GPU, maybe not done
        # The event after the store's last use of each kind on each stream (:meth:`_in_order`).
        self._uses: dict[tuple[torch.cuda.Stream, str], torch.cuda.Event] = {}
        self._generation = 0  # bumped where rows held by a prefetch may lose their slots
        self._reset_cache(num_rows)

    @contextlib.contextmanager
    def _naming_host_errors(self) -> Iterator[None]:
        """Host rows that cannot be locked for the GPU: the error names the table."""
        try:
            yield
        except HostMemoryError as e:
            raise HostMemoryError(f"table '{self.name}': {e}; lower the rows it keeps or give the host more") from None

    def _slot_keys(self) -> torch.Tensor:
        """The key (:attr:`row_keys`) of each cache slot's row (an empty slot's: any)."""
        return self.row_keys.of(self._row_of_slot.clamp(min=0))

    def _drop_holds(self) -> None:
        """Every hold's rows may lose their slots: the holds' lookups find their rows again, and
        the holds spare nothing from here."""
        self._generation += 1
        self._reserved.clear()

    def _reset_cache(self, num_rows: int) -> None:
        self._drop_holds()
        device = self.device
        self._slot_of_row = torch.full((num_rows,), -1, dtype=torch.int32, device=device)
        self._row_of_slot = torch.full((self.cache_rows,), -1, dtype=torch.int64, device=device)
        self._last_used = torch.full((self.cache_rows,), -1, dtype=torch.int64, device=device)

    @contextlib.contextmanager
    def _in_order(self, waits: frozenset[str] = _ALL_USES) -> Iterator[None]:
        """Runs the block, on the current stream, after the store's last uses of the kinds
        ``waits`` on every other stream (a GPU; events), then counts it as a ``"use"`` of the
        current stream. Kinds: ``"use"`` (lookups, reads, writes, a prefetch's bookkeeping: what
        reads or writes the bookkeeping), ``"update"`` (a training lookup's fused update),
        ``"moves"`` (a prefetch's rows moving, on the rows stream). A prefetch's bookkeeping
        waits for uses only (the slots of updates still running are spared instead, the moves
        queued before it touch no slot it may take); a lookup of rows a hold keeps waits for
        uses and updates, and for its own hold's moves (:meth:`_resident`); everything else for
        all three: the streams then see the store as the host ordered them."""
        if self.device.type != "cuda":
            yield
            return
        stream = current_stream(self.device)
        for (other, kind), done in self._uses.items():
            if other != stream and kind in waits:
                stream.wait_event(done)
        try:
            yield
        finally:  # (also after an error: what the block queued is waited for all the same)
            self._record("use", stream)

    def _record(self, kind: str, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """Counts the work queued so far on ``stream`` as its last use of ``kind``."""
        done = torch.cuda.Event()
        done.record(stream)
        self._uses[(stream, kind)] = done
        return done

    # -- the lookup ----------------------------------------------------------------------------

    def lookup(
        self,
        rows,
        offsets,
        per_sample_weights,
        train,
        step=0,
        row_scores: Optional[RowScores] = None,
        hold: Optional[CacheHold] = None,
    ):
        """``hold``: a :meth:`prefetch` of these very ``rows``; its slots are read where still
        valid (no host read), else the rows are found again."""
        with self._in_order(frozenset({"use", "update"}) if hold is not None and hold.valid else _ALL_USES):
            self._clock += 1
            tick = self._clock
            slots = self._resident(rows, tick, hold)
            if not (train and torch.is_grad_enabled()):
                return self.cache.lookup(slots, offsets, per_sample_weights, train, step)
            self._in_flight.add(tick)
            out = self.cache.lookup(
                slots, offsets, per_sample_weights, True, step, on_update=lambda: self._updated(tick)
            )
            weakref.finalize(out, self._in_flight.discard, tick)  # dropped without a backward (an aborted step)
            return out

    def _updated(self, tick: int) -> None:
        """A training lookup's update is queued: on a GPU its slots stay spared by a prefetch on
        another stream until the update has run (:meth:`_spared_from`)."""
        self._in_flight.discard(tick)
        if self.device.type == "cuda":
            self._updates_done()  # (keeps the list to the updates still running)
            self._updating.append((tick, self._record("update", current_stream(self.device))))

    def _spared_from(self, tick: int, holds: bool = True, updating: bool = False) -> int:
        """The oldest tick whose slots must stay (its rows are used from ``tick`` on): every
        lookup's whose update is still to come, ``holds``: every kept prefetch's, ``updating``:
        every update's the device may still be running (a prefetch on another stream than the
        updates', which does not wait for them)."""
        ticks = [tick, *self._in_flight]
        if holds:
            ticks += self._reserved
        if updating:
            self._updates_done()
            ticks += [t for t, _ in self._updating]
        return min(ticks)

    def _updates_done(self) -> None:
        """Drops the updates the device has run from :attr:`_updating` (oldest first: an update
        whose event is done, on the stream of those before it, follows them)."""
        while self._updating and self._updating[0][1].query():
            self._updating.pop(0)

    def _resident(self, rows: torch.Tensor, tick: int, hold: Optional[CacheHold] = None) -> torch.Tensor:
        """The cache slot (int64) of every row of ``rows``, loading the missing ones. From a
        valid ``hold``: one stamp. Else, where every row is cached: two gathers, one stamp and
        one sync (no sort of the batch's rows)."""
        if hold is not None and hold.valid:
            slots = hold.slots
            if hold.moved is not None:  # the moves of its rows, on the rows stream
                current_stream(self.device).wait_event(hold.moved)
        else:
            slots = self._slot_of_row[rows].long()
            absent = slots < 0
            if bool(absent.any()):
                self._last_used[slots[~absent]] = tick  # this batch's cached rows are not evicted for it
                missing = torch.unique(rows[absent])
                moves = self._claim(missing, self._spared_from(tick))  # the holds' rows spared, where they can be
                if moves is None:
                    self._drop_holds()  # some of their rows may move: their lookups find them again
                    moves = self._claim(missing, self._spared_from(tick, holds=False), refuse=rows)
                assert moves is not None  # (refused otherwise)
                with self._unclaimed_on_error(moves):
                    self._exchange(*moves)
                slots = self._slot_of_row[rows].long()
        self._last_used[slots] = tick  # (a row met twice: the same stamp twice)
        return slots

    @torch.no_grad()
    def prefetch(self, rows: torch.Tensor) -> Optional[CacheHold]:
        """Makes ``rows`` (``[n]`` int64, on the device; repeats allowed) resident for a coming
        lookup of them, on the current stream (a collection's input stream), and keeps them in
        their slots until the returned hold is released or dropped. None where the slots it may
        take are too few (it then loads nothing; the lookup loads the rows itself)."""
        with self._in_order(frozenset({"use"})):
            self._clock += 1
            tick = self._clock
            slots = self._slot_of_row[rows].long()
            absent = slots < 0
            moves = None
            if bool(absent.any()):
                self._last_used[slots[~absent]] = tick
                missing = torch.unique(rows[absent])
                moves = self._claim(missing, self._spared_from(tick, updating=True))
                if moves is None:
                    self.counters["prefetches_skipped"] += 1
                    return None
            with self._unclaimed_on_error(moves):
                if moves is not None:
                    slots = self._slot_of_row[rows].long()
                hold = CacheHold(self, slots, tick)
                if moves is not None:
                    self._move_aside(*moves)
            self._last_used[slots] = tick  # (after the moves queued: a claim undone stamps nothing)
            if moves is not None:
                self.counters["prefetched"] += moves[2].numel()
            self._reserved.add(tick)
            # The moves queued so far: its rows may be among those an earlier prefetch moves.
            hold.moved = self._uses.get((rows_stream(self.device), "moves")) if self.device.type == "cuda" else None
            return hold

    def _move_aside(self, slots: torch.Tensor, out_rows: torch.Tensor, in_rows: torch.Tensor) -> None:
        """A prefetch's moves (:meth:`_exchange`), on a GPU on the rows stream after the
        bookkeeping that chose them: the next prefetch's host reads do not wait for them, nor
        does a held lookup but for its own rows' (:meth:`_in_order`); elsewhere in place."""
        if self.device.type != "cuda":
            self._exchange(slots, out_rows, in_rows)
            return
        aside = rows_stream(self.device)
        aside.wait_stream(current_stream(self.device))
        with torch.cuda.stream(aside):
            self._exchange(slots, out_rows, in_rows)
        for t in (slots, out_rows, in_rows):  # made on the input stream, read on the rows stream
            t.record_stream(aside)
        self._record("moves", aside)

    @torch.no_grad()
    def _claim(
        self, missing: torch.Tensor, keep_from: int, refuse: Optional[torch.Tensor] = None
    ) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Gives the ``missing`` rows (unique) the least recently used slots used before tick
        ``keep_from``, in the bookkeeping; returns the moves to make (:meth:`_exchange`'s
        arguments: the slots, the rows they held (-1: none) and the rows they take). None where
        those slots are too few (nothing claimed), or with ``refuse`` (the lookup's rows) the
        named error. Its host reads come before any move is queued: none of them waits for rows
        moving."""
        order = torch.argsort(self._last_used, stable=True)  # empty slots (-1) first
        free = int((self._last_used < keep_from).sum())
        if free < missing.numel():
            if refuse is None:
                return None
            distinct = int(torch.unique(refuse).numel())
            raise CacheFullError(
                f"table '{self.name}': a lookup needs {missing.numel()} rows more on the device, but its cache of "
                f"{self.cache_rows} rows can give {free} (the others hold this batch's rows or rows whose update is "
                f"still to come); the batch reads {distinct} distinct rows: raise cache_load_factor until its share "
                f"of the table's rows (a dynamic table's max_capacity) is at least {distinct} (more where updates "
                "wait: gradient accumulation), or lower the batch size (data.eval_batch_size for an evaluation)"
            )
        victims = order[: missing.numel()]
        old, by_row = torch.sort(self._row_of_slot[victims])
        victims = victims[by_row]
        # Both host row lists ascending (missing is, from unique): a GPU reaches host memory in
        # address order several times faster than at random (its link's address translation).
        held, victims32 = old[old >= 0], victims.to(torch.int32)  # (allocated before anything is written)
        self._slot_of_row[held] = -1
        self._slot_of_row[missing] = victims32
        self._row_of_slot[victims] = missing
        self.counters["loaded"] += missing.numel()
        self.counters["written_back"] += held.numel()
        return victims, old, missing

    @contextlib.contextmanager
    def _unclaimed_on_error(self, moves: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Iterator[None]:
        """Runs the block that queues a claim's ``moves`` (:meth:`_claim`); where it raises, the
        claim is undone in the bookkeeping: its slots keep the rows they held, the missing rows
        stay in host memory. No cache row has changed then: the plain-torch exchange gathers
        what it reads in before writing any cache row, and the Triton exchange moves every
        field of a table in one launch (up to three fields: weights and two states at most),
        which raises before anything runs or not at all (a fault inside a kernel ends the
        process's use of the device)."""
        try:
            yield
        except BaseException:
            if moves is not None:
                victims, old, missing = moves
                held = old >= 0
                self._slot_of_row[missing] = -1
                self._slot_of_row[old[held]] = victims[held].to(torch.int32)
                self._row_of_slot[victims] = old
                self.counters["loaded"] -= missing.numel()
                self.counters["written_back"] -= int(held.sum())
            raise

    def _fields(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{field: (cache rows, host rows)}`` of the weights and of each state."""
        states = {k: (t, self.host.states[k]) for k, t in self.cache.states.items()}
        return {"weight": (self.cache.weight, self.host.weight), **states}

    def _exchange(self, slots: torch.Tensor, out_rows: Optional[torch.Tensor], in_rows: Optional[torch.Tensor]):
        """``dynarec::exchange_rows`` of every field at once: the rows of cache ``slots`` written
        back to host rows ``out_rows`` (where >= 0), then host rows ``in_rows`` read into them."""
        caches, hosts = zip(*self._fields().values())
        torch.ops.dynarec.exchange_rows(list(caches), slots, list(hosts), out_rows, in_rows)

    @_in_order_of_uses
    @torch.no_grad()
    def _write_back(self, empty: bool) -> None:
        """Writes every cached row back to host memory (``empty``: and empties the cache, refused
        while a training lookup's update is still to come: it would update an emptied slot)."""
        if empty and self._in_flight:
            raise StepPendingError(
                f"table '{self.name}': its rows are written or viewed whole while a training step's update is "
                "still to come (its cache holds rows the update writes); run the backward first"
            )
        held = torch.nonzero(self._row_of_slot >= 0).squeeze(1)
        if held.numel():
            rows, by_row = torch.sort(self._row_of_slot[held])  # in address order, as in _claim
            self._exchange(held[by_row], rows, None)
        if empty:
            self._reset_cache(self.num_rows)
        synchronize(self.device)  # the host rows are the host's to read from here

    # -- the rows from outside -----------------------------------------------------------------

    @property
    def weight(self) -> torch.Tensor:
        """The host rows ``[num_rows, dim]`` (on the CPU), the cache written back and emptied:
        writing the view writes the table until the next lookup caches rows again."""
        self._write_back(empty=True)
        return self.host.weight

    @property
    def states(self) -> dict[str, torch.Tensor]:
        self._write_back(empty=True)
        return self.host.states

    def _where(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(cached mask, their slots, the others' rows)`` of ``rows``, on the device."""
        rows = rows.to(self.device)
        slots = self._slot_of_row[rows].long()
        cached = slots >= 0
        return cached, slots[cached], rows[~cached]

    @_in_order_of_uses
    def read(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of the rows' weights (float32) and states (on ``rows``' device), from wherever
        each lives."""
        cached, slots, elsewhere = self._where(rows)
        at = torch.arange(rows.numel(), device=self.device)
        fields = self._fields()
        values = {}
        for name, (cache, _) in fields.items():
            values[name] = cache.new_empty((rows.numel(), *cache.shape[1:]))
            values[name][cached] = cache[slots]
        hosts = [host for _, host in fields.values()]
        torch.ops.dynarec.exchange_rows(list(values.values()), at[~cached], hosts, None, elsewhere)
        return {k: (v.float() if k == "weight" else v).to(rows.device) for k, v in values.items()}

    @_in_order_of_uses
    @torch.no_grad()
    def write(self, rows: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        fields = self._fields()
        values = {  # checked before any row is written: a bad field writes nothing
            k: field_rows(k, v, fields[k][0] if k in fields else None, rows.numel(), sorted(fields), self.device)
            for k, v in values.items()
        }
        cached, slots, elsewhere = self._where(rows)
        at = torch.arange(elsewhere.numel(), device=self.device)
        for k, v in values.items():
            fields[k][0].index_copy_(0, slots, v[cached])
        hosts = [fields[k][1] for k in values]
        torch.ops.dynarec.exchange_rows([v[~cached].contiguous() for v in values.values()], at, hosts, elsewhere, None)

    @torch.no_grad()
    def init_rows(
        self, rows: torch.Tensor, keys: torch.Tensor, initializer: Initializer, seed: int, default_bound: float
    ) -> None:
        self.reset_rows(rows, initializer.values(keys, self.dim, seed, default_bound))

    @_in_order_of_uses
    @torch.no_grad()
    def reset_rows(self, rows: torch.Tensor, weight: torch.Tensor) -> None:
        cached, slots, elsewhere = self._where(rows)
        weight = weight.to(self.device)
        if slots.numel():
            self.cache.reset_rows(slots, weight[cached])
        if elsewhere.numel():
            fresh = {"weight": weight[~cached]}
            for spec in self.spec.state_specs():
                width = self.cache.states[spec.name].shape[1]
                fresh[spec.name] = torch.full((elsewhere.numel(), width), spec.initial_value, device=self.device)
            self.write(elsewhere, fresh)

    @_in_order_of_uses
    @torch.no_grad()
    def resize(self, num_rows: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """A growth: rows ``src`` become rows ``dst`` of ``num_rows``, in host memory (moved) and in
        the cache (renumbered in place); cached rows not in ``src`` (lost) free their slots."""
        synchronize(self.device)  # the old host rows are read, then freed, by the host
        with self._naming_host_errors():
            self.host.resize(num_rows, src.cpu(), dst.cpu())
        src, dst = src.to(self.device), dst.to(self.device)
        slots = self._slot_of_row[src].long()
        held = slots >= 0
        slot_of_row = torch.full((num_rows,), -1, dtype=torch.int32, device=self.device)
        slot_of_row[dst[held]] = slots[held].to(torch.int32)
        row_of_slot = torch.full_like(self._row_of_slot, -1)
        row_of_slot[slots[held]] = dst[held]
        self._last_used[row_of_slot < 0] = -1  # the lost rows' slots are free
        self._slot_of_row, self._row_of_slot = slot_of_row, row_of_slot
        self.num_rows = num_rows
        self._drop_holds()

    @_in_order_of_uses
    def _allocate(self, num_rows: int) -> None:
        """A load: fresh rows in host memory, an empty cache (the cache's rows are replaced with
        the others; a table refuses a load while a step is pending, so no slot kept for an update
        still to come is needed: an aborted step's lookup may still hold some)."""
        self._in_flight.clear()
        synchronize(self.device)  # the old host rows are freed
        with self._naming_host_errors():
            self.host.reallocate(num_rows)
        self.cache.reallocate(self.cache_rows)
        self._reset_cache(num_rows)

    def set_learning_rate(self, lr: float) -> None:
        super().set_learning_rate(lr)
        self.cache.set_learning_rate(lr)

    def storage(self):
        """The rows as they are now (the cache written back) and where the cache holds them:
        :meth:`restore_storage` puts back the rows of before a growth, the cache emptied."""
        self._write_back(empty=False)
        return self.host.storage(), self.num_rows

    @_in_order_of_uses
    def restore_storage(self, handle) -> None:
        """Undoes a growth (its step aborted: nothing of it is kept; a table grows only while no
        other lookup's update is to come, so the aborted step's are the only ones in flight):
        the host rows of :meth:`storage`, which the cache had been written back into; the
        cache's rows since are dropped."""
        host, self.num_rows = handle
        synchronize(self.device)  # the host rows since are freed
        self.host.restore_storage(host)
        self._in_flight.clear()
        self._reset_cache(self.num_rows)

    @property
    def nbytes(self) -> int:
        """The host copy's bytes and the device cache's (see :attr:`host_nbytes`): its rows and
        states, and its maps (each row's slot, each slot's row and last use), as the planner
        counts them."""
        maps = sum(t.numel() * t.element_size() for t in (self._slot_of_row, self._row_of_slot, self._last_used))
        return self.host.nbytes + self.cache.nbytes + maps

    @property
    def host_nbytes(self) -> int:  # type: ignore[override]
        return self.host.nbytes
