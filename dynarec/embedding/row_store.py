"""Row stores: the rows of a table (weights + optimizer states) and its fused lookup.

A fixed table and a dynamic table both keep their rows in a :class:`RowStore`; a dynamic table
only adds a key -> row index in front. Every lookup is a list of weighted bags over row indices
(``offsets`` in CSR form, SUM pooling with per-sample weights), so mean pooling and sequences
are expressed by the caller as weights and singleton bags, and every backend gives them the same
meaning. In training the backward pass aggregates each unique row's gradient over all its bags
and applies the table's optimizer in place, once per unique row.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch

import dynarec.kernels.ops  # registers torch.ops.dynarec
from dynarec.devices import page_lock, table_tensor
from dynarec.kernels.packed import packed_layout, table_views
from dynarec.kernels.reference.bags import bags_of_ids
from dynarec.optim.base import OptimizerSpec
from dynarec.optim.fused import GradReducer, RowScores, fused_bag_update
from dynarec.optim.rounding import RowKeys

if TYPE_CHECKING:
    from dynarec.embedding.initializers import Initializer

__all__ = ["NativeRowStore", "PackedRowStore", "RowStore", "RowStoreSlice", "field_rows"]


class RowStore(ABC):
    """Rows ``[num_rows, dim]`` (float32, or a native store's half-precision ``dtype``) with the
    optimizer states ``spec`` lays out (float32).

    ``lr`` is the current learning rate (a schedule changes it with ``set_learning_rate``). The
    step counter ``t`` is the table's (:class:`~dynarec.embedding.step.StepLifecycle`); a lookup
    is given the ``t`` its backward updates with.
    """

    def __init__(self, num_rows: int, dim: int, spec: OptimizerSpec, device: torch.device):
        self.num_rows = num_rows
        self.dim = dim
        self.spec = spec
        self.device = torch.device(device)
        self.lr = float(spec.lr)

    #: Whether :meth:`lookup` takes ``row_scores``: its update then writes the rows' scores.
    writes_row_scores = False
    #: The keys half-precision rows' rounding draws are keyed by, set by the owning table (a
    #: fixed table's global row ids, a dynamic table's keys); stores of fp32 rows never read them.
    row_keys: RowKeys = RowKeys()
    #: Of the store's bytes, those in host memory (a host-memory tier's rows; 0 for a store on its device).
    host_nbytes = 0

    @property
    @abstractmethod
    def weight(self) -> torch.Tensor:
        """``[num_rows, dim]`` in the storage dtype (a view: writing it writes the table)."""

    @property
    @abstractmethod
    def states(self) -> dict[str, torch.Tensor]:
        """``{name: [num_rows, dim or 1]}`` float32 views, in ``spec.state_specs()`` order."""

    @abstractmethod
    def lookup(
        self,
        rows: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor],
        train: bool,
        step: int = 0,
        row_scores: Optional[RowScores] = None,
    ) -> torch.Tensor:
        """Weighted-sum bags: ``out[b] = sum_{i in bag b} psw[i] * weight[rows[i]]``.

        Args:
            rows: ``[n]`` int64 row indices in ``[0, num_rows)``.
            offsets: ``[num_bags + 1]`` int64, CSR offsets into ``rows``.
            per_sample_weights: ``[n]`` float32 or None (all ones).
            train: when True and grad is enabled, the output's backward applies the fused
                optimizer update to the looked-up rows.
            step: the table's step counter ``t`` of this training step (>= 1).
            row_scores: where :attr:`writes_row_scores`, the update also sets the score of
                each updated row (in the same pass: one store per unique row).
        Returns:
            ``[num_bags, dim]`` float32.
        """

    @abstractmethod
    def _allocate(self, num_rows: int) -> None:
        """Replaces the storage by ``num_rows`` rows: zero weights, states at initial values."""

    def reallocate(self, num_rows: int) -> None:
        """Drops every row and allocates ``num_rows`` fresh ones."""
        self._allocate(num_rows)
        self.num_rows = num_rows

    def set_learning_rate(self, lr: float) -> None:
        self.lr = float(lr)

    @abstractmethod
    def storage(self) -> Any:
        """An opaque handle to the current storage (no copy): :meth:`restore_storage` puts it
        back after a resize, which allocates new storage (undoing a growth)."""

    @abstractmethod
    def restore_storage(self, handle: Any) -> None: ...

    def read(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of ``weight`` and every state at ``rows``."""
        out = {"weight": self.weight.index_select(0, rows).float()}  # exact for half-precision rows
        for name, t in self.states.items():
            out[name] = t.index_select(0, rows)  # a new tensor: index_select copies
        return out

    @torch.no_grad()
    def write(self, rows: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """Writes the given tensors (``weight`` and/or state names) at ``rows``, every field
        checked before any is written (a bad field writes nothing)."""
        targets = {"weight": self.weight, **self.states}
        checked = {
            name: field_rows(name, v, targets.get(name), rows.numel(), sorted(targets)) for name, v in values.items()
        }
        for name, v in checked.items():
            targets[name].index_copy_(0, rows, v)

    @torch.no_grad()
    def reset_rows(self, rows: torch.Tensor, weight: torch.Tensor) -> None:
        """Gives ``rows`` fresh contents: ``weight`` (float32; half-precision rows store it
        rounded to nearest) and every state at its initial value."""
        self.weight.index_copy_(0, rows, weight.to(self.weight.dtype))
        self.reset_states(rows)

    @torch.no_grad()
    def init_rows(
        self, rows: torch.Tensor, keys: torch.Tensor, initializer: Initializer, seed: int, default_bound: float
    ) -> None:
        """:meth:`reset_rows` with row ``rows[i]``'s weights the initializer's for ``keys[i]``
        (``rows`` distinct), written in place where the initializer can
        (:meth:`Initializer.write_rows`)."""
        initializer.write_rows(self.weight, rows, keys, seed, default_bound)
        self.reset_states(rows)

    @torch.no_grad()
    def reset_states(self, rows: torch.Tensor) -> None:
        """Every optimizer state of ``rows`` at its spec's initial value (Adagrad's
        ``initial_accumulator_value``): a fresh row's states, on every table kind."""
        for spec in self.spec.state_specs():
            torch.ops.dynarec.fill_rows(self.states[spec.name], rows, spec.initial_value)

    @torch.no_grad()
    def resize(self, num_rows: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Reallocates to ``num_rows`` rows, moving row ``src[i]`` to ``dst[i]`` bit-exactly."""
        old = self.read(src)
        self.reallocate(num_rows)
        self.write(dst, old)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, *self.states.values()))


def field_rows(
    name: str,
    values: torch.Tensor,
    like: Optional[torch.Tensor],
    n: int,
    fields: list[str],
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """``values`` of ``n`` rows of the field ``name`` (``weight`` or a state) of rows like ``like``
    (None: the table has no such field, named among ``fields``), on ``device`` (default:
    ``like``'s) in ``like``'s dtype and ``[n, width]`` (a row-wise state may be given ``[n]``);
    ValueError naming the field."""
    if like is None:
        raise ValueError(f"unknown row field '{name}'; this table has {fields}")
    v = values.to(device=like.device if device is None else device, dtype=like.dtype)
    if v.dim() == 1 and like.shape[1] == 1:
        v = v[:, None]
    if tuple(v.shape) != (n, like.shape[1]):
        raise ValueError(f"'{name}' must have shape {(n, like.shape[1])}, got {tuple(v.shape)}")
    return v


class _NativeFusedLookup(torch.autograd.Function):
    """Forward: weighted-sum bags. Backward: aggregate per unique row, apply the optimizer.

    ``anchor`` is an empty tensor that requires grad, so autograd calls backward; the weights
    themselves are not autograd leaves (no dense optimizer may ever see them).
    """

    @staticmethod
    def forward(ctx, anchor, store, rows, offsets, per_sample_weights, step, row_scores, on_update):
        ctx.store = store
        ctx.lr = store.lr  # the step's rate is the one at its forward (as FBGEMM's TBE and a group take it)
        ctx.step = step
        ctx.row_scores = row_scores
        ctx.on_update = on_update
        ctx.save_for_backward(rows, offsets, per_sample_weights)
        return store.pooled(rows, offsets, per_sample_weights)

    @staticmethod
    def backward(ctx, grad_out):
        rows, offsets, psw = ctx.saved_tensors
        store: NativeRowStore = ctx.store
        # Before the update writes the rows: d out[bag(i)] / d psw[i] is row(i) as the forward read it.
        psw_grad = per_sample_weights_grad(store, rows, offsets, grad_out) if ctx.needs_input_grad[4] else None
        fused_bag_update(
            store.spec,
            lr=ctx.lr,
            step=ctx.step,
            weight=store.weight,
            states=store.states,
            rows=rows,
            offsets=offsets,
            per_sample_weights=psw,
            grad_out=grad_out,
            reducer=store.grad_reducer,
            row_scores=ctx.row_scores,
            rounding_seed=store.rounding_seed,
            row_keys=store.row_keys,
            layout=store.layout,
            hyper=store.captured_hyper,
        )
        if ctx.on_update is not None:
            ctx.on_update()
        return None, None, None, None, psw_grad, None, None, None


def per_sample_weights_grad(
    store: NativeRowStore, rows: torch.Tensor, offsets: torch.Tensor, grad_out: torch.Tensor
) -> torch.Tensor:
    """``[n]`` float32: ``<grad_out[bag(i)], row(i)>`` for each id ``i`` of the bags (``rows``
    ``[n]``, CSR ``offsets``; ``grad_out`` ``[num_bags, D]``): the gradient of the per-sample
    weights of a weighted-sum lookup. Each row is read as the lookup reads it, by the store's
    own pooled op over bags of one id (float32 from half-precision rows, zeros past a packed
    table's dim)."""
    n = rows.numel()
    each = store.pooled(rows, torch.arange(n + 1, device=rows.device), None)
    return (each * grad_out.index_select(0, bags_of_ids(offsets, n))).sum(1)


class NativeRowStore(RowStore):
    """Rows in torch tensors, looked up and updated by the dynarec ops (``pooled``,
    ``bag_update``); runs on any device torch supports.

    ``grad_reducer`` (a data-parallel table's, given by the sharder): sums a step's row
    gradients over the ranks before the update, ``(unique rows, their gradients) -> (rows,
    gradients)``, so every replica applies the same update."""

    writes_row_scores = True
    #: Packed rows' layout on the device (:class:`PackedRowStore`); None: rows ``[num_rows, dim]``.
    layout: Optional[torch.Tensor] = None
    #: While a training step's backward is captured in a CUDA graph (``dynarec.train.step_graph``):
    #: the device buffer its fused update reads the step's scalars from (``kernel_hyper``'s), which
    #: the graph's owner writes before each replay; None otherwise.
    captured_hyper: Optional[torch.Tensor] = None

    def __init__(
        self,
        num_rows: int,
        dim: int,
        spec: OptimizerSpec,
        device: torch.device | str = "cpu",
        grad_reducer: Optional[GradReducer] = None,
        dtype: torch.dtype = torch.float32,
        rounding_seed: int = 0,
        page_locked: bool = False,
        records: bool = False,
    ):
        """``page_locked`` (rows on the CPU): their memory locked for CUDA devices
        (:func:`~dynarec.devices.page_lock`: a GPU reads and writes them in place; a host-memory
        tier's rows). ``records``: each row's weights and states side by side, one record a row
        in one allocation (``weight`` and ``states`` are strided views of it: a GPU reaching a
        row in host memory reaches all its fields at one place). ``dtype``: the weights' storage
        (float32, float16 or bfloat16); half-precision rows are updated in float32 and stored by
        stochastic rounding seeded by ``rounding_seed``, each row's draws keyed by ``row_keys``
        (set by the owning table: a fixed table's global row ids, a dynamic table's keys; default
        the row indices; :mod:`dynarec.optim.rounding`)."""
        super().__init__(num_rows, dim, spec, torch.device(device))
        self.grad_reducer = grad_reducer
        self.dtype = dtype
        self.rounding_seed = rounding_seed
        self.row_keys = RowKeys()
        self.page_locked = page_locked
        self.records = records
        self._records: Optional[torch.Tensor] = None  # the allocation ``weight`` and ``states`` view
        self._allocate(num_rows)

    def _allocate(self, num_rows: int) -> None:
        lock = page_lock if self.page_locked else (lambda t: t)
        if self.records:
            self._allocate_records(num_rows, lock)
            return
        self._weight = lock(table_tensor((num_rows, self.dim), 0, self.dtype, self.device))
        self._states = {
            s.name: lock(table_tensor((num_rows, s.width(self.dim)), s.initial_value, torch.float32, self.device))
            for s in self.spec.state_specs()
        }

    def _allocate_records(self, num_rows: int, lock: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """One float32 allocation ``[num_rows, record]``: a row's weights (in ``dtype``, padded to
        whole float32 words), then each state's floats."""
        weight_words = -(-self.dim * self.dtype.itemsize // 4)
        widths = [s.width(self.dim) for s in self.spec.state_specs()]
        records = lock(table_tensor((num_rows, weight_words + sum(widths)), 0, torch.float32, self.device))
        self._records = records  # held: its memory stays locked while this tensor lives (not its views)
        self._weight = records[:, :weight_words].view(self.dtype)[:, : self.dim]  # (zero: the whole record is)
        self._states, at = {}, weight_words
        for spec, width in zip(self.spec.state_specs(), widths):
            self._states[spec.name] = records[:, at : at + width].fill_(spec.initial_value)
            at += width

    @property
    def weight(self) -> torch.Tensor:
        return self._weight

    @property
    def states(self) -> dict[str, torch.Tensor]:
        return self._states

    def storage(self):
        return (self.num_rows, self._weight, self._states, self._records)

    def restore_storage(self, handle) -> None:
        self.num_rows, self._weight, self._states, self._records = handle

    def lookup(self, rows, offsets, per_sample_weights, train, step=0, row_scores=None, on_update=None):
        """``on_update``: called once the training lookup's fused update has run."""
        if train and torch.is_grad_enabled():
            anchor = torch.empty(0, device=self.device, requires_grad=True)
            args = (rows, offsets, per_sample_weights, step, row_scores, on_update)
            return _NativeFusedLookup.apply(anchor, self, *args)
        return self.pooled(rows, offsets, per_sample_weights)

    def pooled(self, rows: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor]):
        """The weighted-sum bags of the current weights (no autograd): the ``dynarec::pooled`` op
        (Triton on a GPU, ``F.embedding_bag`` elsewhere); half-precision rows are summed in
        float32 (read as they are by the kernels, Triton and C++; else copied to float32 first)."""
        weight = self.weight
        if weight.dtype != torch.float32 and not dynarec.kernels.ops.takes_half_rows(weight.device):
            weight = weight.index_select(0, rows).float()
            rows = torch.arange(rows.numel(), device=rows.device)
        return torch.ops.dynarec.pooled(weight, rows, offsets, per_sample_weights)


class PackedRowStore(NativeRowStore):
    """The rows of several tables in one store (a :class:`~dynarec.embedding.grouped.TableGroup`'s
    or a ``DynamicTableGroup``'s: a dynamic table's slots), table ``i`` of ``shapes[i] = (rows, dim)``
    holding the store's rows from the sum of the rows before it. Each table reads and writes
    its rows through a :class:`RowStoreSlice`; the group looks all of them up at once.

    Tables of one dim lie as any store's rows, ``[num_rows, dim]``. Tables of several dims lie
    packed end to end (:mod:`dynarec.kernels.packed`: ``weight`` and element-wise states flat,
    row-wise states one float a row, :attr:`layout` their layout on the device); the lookup's
    bags are then ``[num_bags, dim]`` with ``dim`` the widest, zero past a bag's table's dim, and
    the ``dynarec`` ops' packed form looks up and updates them (the Triton kernels: a collection
    packs tables of several dims only where they run)."""

    def __init__(
        self,
        shapes: Sequence[tuple[int, int]],
        spec: OptimizerSpec,
        device: torch.device | str = "cpu",
        grad_reducer: Optional[GradReducer] = None,
    ):
        self.shapes = [(int(rows), int(dim)) for rows, dim in shapes]
        dims = {dim for _, dim in self.shapes}
        if len(dims) > 1 and grad_reducer is not None:
            raise ValueError("packed rows of several dims cannot take a row-gradient reducer")
        self.host_layout = packed_layout(self.shapes)  # each table's rows, whatever the dims
        self.layout = self.host_layout.to(device) if len(dims) > 1 else None
        super().__init__(sum(rows for rows, _ in self.shapes), max(dims), spec, device, grad_reducer)

    def _allocate(self, num_rows: int) -> None:
        if self.layout is None:
            return super()._allocate(num_rows)
        elements = sum(rows * dim for rows, dim in self.shapes)
        self._weight = table_tensor((elements,), 0, self.dtype, self.device)
        self._states = {
            s.name: table_tensor((num_rows if s.rowwise else elements,), s.initial_value, torch.float32, self.device)
            for s in self.spec.state_specs()
        }

    def table_rows(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Table ``index``'s ``(weight [rows, dim], {state: [rows, dim or 1]})``, views (rows of
        one dim lie packed as rows ``[num_rows, dim]`` do)."""
        weight = table_views(self._weight.view(-1), self.host_layout)[index]
        return weight, {name: table_views(t.view(-1), self.host_layout)[index] for name, t in self._states.items()}

    def pooled(self, rows: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor]):
        if self.layout is None:
            return super().pooled(rows, offsets, per_sample_weights)
        return torch.ops.dynarec.pooled(self._weight, rows, offsets, per_sample_weights, self.layout, self.dim)

    def storage(self):
        raise NotImplementedError("a group's shared row store is never resized")

    def restore_storage(self, handle) -> None:
        raise NotImplementedError("a group's shared row store is never resized")


class RowStoreSlice(NativeRowStore):
    """Table ``index``'s rows of a :class:`PackedRowStore` shared by several tables (a
    :class:`~dynarec.embedding.grouped.TableGroup` or ``DynamicTableGroup``): its weight and states are views of the
    parent's, so reads, writes, lookups and updates through the slice act on the shared rows,
    and the group's one lookup of every table's ids acts on the same memory. Its learning rate
    is its own (the group runs its fused lookup only while its slices' rates agree).

    Its table never changes size (a fixed table; a dynamic one that never grows):
    :meth:`reallocate` (a load) resets the rows in place."""

    def __init__(self, parent: PackedRowStore, index: int, grad_reducer: Optional[GradReducer] = None):
        rows, dim = parent.shapes[index]
        RowStore.__init__(self, rows, dim, parent.spec, parent.device)
        self.grad_reducer = grad_reducer
        self.dtype, self.rounding_seed, self.row_keys = parent.dtype, parent.rounding_seed, RowKeys()
        self._weight, self._states = parent.table_rows(index)

    @torch.no_grad()
    def _allocate(self, num_rows: int) -> None:
        if num_rows != self.num_rows:
            raise ValueError(f"a slice of a shared row store holds {self.num_rows} rows, not {num_rows}")
        self._weight.zero_()
        for spec in self.spec.state_specs():
            self._states[spec.name].fill_(spec.initial_value)

    def storage(self):
        raise NotImplementedError("a slice of a shared row store is never resized")

    def restore_storage(self, handle) -> None:
        raise NotImplementedError("a slice of a shared row store is never resized")
