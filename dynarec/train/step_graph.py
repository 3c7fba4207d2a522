"""A whole training step replayed from two CUDA graphs.

On a GPU a steady step of a model with many tables is host work: TorchEasyRec's DLRM at batch
8,192 takes 2.3-2.4 ms a step on an H100 against 0.92 ms of device work, spread over some twenty
pieces of 50-250 µs of Python and launches each (the batch's copy and split, the packing, the
lookup, the dense model's replays, the loss, the fused update, the optimizer).
:class:`StepGraphs` captures a step, for a batch signature that recurs (a DLRM's every full
batch), as two graphs sharing one memory pool:

- ``forward``: the batch unpacked from a device copy of its packed buffer (the one buffer a
  DataLoader worker's batch travels in), the tables' lookup, the dense model, the loss, and
  whether the loss is finite;
- ``backward``: the loss's backward (the dense model's, then the tables' fused updates, which
  read the step's scalars from device buffers) and the dense optimizer's step.

A step replays them with the one host read of the finiteness flag between them: a step whose loss
is not finite writes nothing, as an eager one. What the graphs cannot rerun is done around them,
as the eager step does it: the batch's checks on the host before anything (its ids against the
tables, from the ranges its maker worked out), its copy into the graph's buffer, each table's
step opened before the forward and committed after the backward (or aborted), and the fused
updates' scalars (each lookup's learning rate and step counter: a schedule's rates reach them)
written before the replay. The replays run the eager step's kernels on the same tensors, so
the results should be the eager step's bit for bit; ``tests/train/test_step_graph.py`` holds
them to that.

On by default (``train.whole_step_graphs``). On an H100, TorchEasyRec's ``dlrm_criteo`` at batch
8,192 steps in 0.97 ms instead of 3.41 ms, about its device work
(``benchmarks/results/2026-12-07-h100-whole-step-graphs.md``).

A signature (the packed buffer's layout, the features' id counts, the rows the loss is averaged
over, the tables' rows and the dense optimizer's settings: a graph bakes them in) is captured at
a step that follows an eager step of it run whole (its kernels compiled, the optimizer's states
made), and replayed while it recurs; at most ``max_graphs`` are kept, the least recently replayed
given up for a new one. The signature also holds what the eager step would read afresh: grad mode,
every module's training flag, every parameter's ``requires_grad``. Any other step runs
eagerly: a group whose tables' rates or step counters differ, a dense learning rate that changes
every step, and a batch whose features' id counts differ from the batch before's (histories whose
lengths vary from row to row: replaying those would need the ids in buffers of bucketed
capacity, not done yet). An eager step expected to be captured next time runs its dense model
eagerly (the dense model's own graphs would go to no replay), but only while signatures recur:
where each batch's differs, eager steps keep the dense model's graphs from the second on
(:attr:`StepGraphs.captures_next`). Where a capture fails (out of memory included), the step
runs eagerly, the reason is reported once and no capture is tried again. ``Trainer.fit``'s
report counts the steps replayed (``cuda_graphs``).

Eligible (:func:`step_graph_refusal` names what stands in the way): one process on a GPU with
``train.cuda_graphs`` and ``train.whole_step_graphs``, float32 without loss scaling, no gradient
accumulation, a dense model that draws nothing (dropout) and may be captured, and torch's fused
Adam or AdamW for it. The tables the graphs capture are fixed ones in device memory updated by
the fused kernels.

The others (:func:`uncaptured_reason`: dynamic tables, whose inserts read the host; tables in
host memory; FBGEMM's) are looked up eagerly around the graphs, with
``train.whole_step_graphs_eager_lookups`` (on by default; without it such a model's steps run
eagerly):

- before the forward's replay their lookups run as in an eager step
  (``EmbeddingCollection.lookup_units``: their steps opened, keys inserted), their input stage
  (the batch's copy, their hash finds) read ahead while the step before runs, as an eager
  step's (:meth:`StepGraphs.ahead_units`);
- their outputs are copied into leaves the forward graph reads in their place
  (``EmbeddingCollection.inputs_checked(given)``);
- after the backward's replay their outputs' backward runs from the gradients the graph left in
  those leaves (their fused updates).

So a DIN's dynamic user table runs eagerly while its fixed tables, attention and MLPs replay. A
NaN loss aborts their steps with the others'. On an H100, the DIN of ``dynarec bench e2e`` at
batch 4,096 steps in 4.21 ms instead of 6.40 ms, and trains the same model (its eval AUC the
eager run's to every digit; ``benchmarks/results/2026-12-07-h100-din-eager-lookups.md``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union, cast

import torch
from torch import nn

from dynarec.data.batch import Batch
from dynarec.devices import capture_graph
from dynarec.embedding.collection import EmbeddingCollection
from dynarec.embedding.grouped import TableGroup
from dynarec.embedding.pack import BagLayout
from dynarec.embedding.row_store import NativeRowStore, PackedRowStore
from dynarec.embedding.table import FixedTable, commit_backward
from dynarec.kernels.gpu.update import HYPER, HostStaging
from dynarec.optim.fused import kernel_hyper
from dynarec.optim.registry import definition
from dynarec.train.graphs import uncapturable_modules
from dynarec.train.optimizer_graph import captures_step

__all__ = ["StepGraphs", "step_graph_refusal"]

Unit = Union[TableGroup, FixedTable]


def step_graph_refusal(
    embeddings: Any,
    dense: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    device: torch.device,
    distributed: bool,
    cuda_graphs: bool,
    whole_step: bool,
    eager_lookups: bool,
    mixed_precision: Optional[str],
    accumulation_steps: int,
    loss_scaling: bool,
    draws: bool,
) -> Optional[str]:
    """Why a training step of this setup is not replayed from CUDA graphs (module doc), or None
    where it may be."""
    if not cuda_graphs:
        return "train.cuda_graphs is off"
    if not whole_step:
        return "train.whole_step_graphs is off"
    if distributed:
        return "a multi-process run (its steps exchange gradients between the ranks)"
    if not isinstance(embeddings, EmbeddingCollection):
        return "the tables are sharded"
    if embeddings.frozen:
        return "the tables are frozen (their lookups open no step)"
    for unit in embeddings.units:
        why = uncaptured_reason(unit)
        if why is not None and not eager_lookups:
            return f"table(s) {unit.name}: {why}; train.whole_step_graphs_eager_lookups is off"
    if mixed_precision is not None:
        return f"train.mixed_precision {mixed_precision}"
    if loss_scaling:
        return "train.grad_scaler (the tables' update waits for the overflow check)"
    if accumulation_steps != 1:
        return f"train.gradient_accumulation_steps {accumulation_steps}"
    if draws:
        return "the dense model draws random numbers (dropout)"
    kept = uncapturable_modules(dense)
    if kept:
        return f"the dense model keeps something of a forward outside its outputs ({', '.join(kept)})"
    if device.type != "cuda":
        return f"the device is {device}, not a GPU"
    if not captures_step(optimizer):
        return f"the dense optimizer is {type(optimizer).__name__}, not torch's fused Adam or AdamW"
    return None


def uncaptured_reason(unit: Any) -> Optional[str]:
    """Why a lookup of the collection is not captured (it is looked up eagerly around the
    graphs, its output handed to them), or None where it is."""
    if not isinstance(unit, (TableGroup, FixedTable)):
        return "dynamic (a step's inserts read the device)"
    store = unit.store
    if (
        not isinstance(store, NativeRowStore)
        or type(store) not in _CAPTURED_STORES
        or store.page_locked
        or store.grad_reducer is not None
    ):
        return "not rows in device memory of dynarec's native store"
    if definition(store.spec).kernel is None:
        return f"{store.spec!r} is not run by the fused kernels"
    return None


_CAPTURED_STORES = (NativeRowStore, PackedRowStore)
# A lookup's update scalars take a row of 16 float64 (128 bytes) in the graph's buffer: each row's
# address 16-byte aligned, as the eager update's own buffer is (Triton compiles apart for others).
_HYPER_ROW = 16


@dataclass
class _Captured:
    """One signature's graphs and what they read and write by address: ``buffer`` (the packed
    batch's device copy), ``hyper`` (``[lookups, _HYPER_ROW]`` float64: each captured lookup's
    update scalars in the first of their row's ``_HYPER_ROW``), ``loss`` and ``finite`` (the
    forward's outputs), and for each lookup not captured its output's copy (``outputs``) and the
    gradient the backward leaves for it (``grads``), by unit name."""

    forward: torch.cuda.CUDAGraph
    backward: torch.cuda.CUDAGraph
    buffer: torch.Tensor
    hyper: torch.Tensor
    loss: torch.Tensor
    finite: torch.Tensor
    outputs: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]


class StepGraphs:
    """The training steps of ``embeddings`` and a dense model, replayed from CUDA graphs where
    the step's signature recurs (module doc).

    ``forward_loss(batch, global_rows)`` is the step's forward and loss (the trainer's, run
    eagerly for steps not replayed: one definition of the step); ``dense_step()`` its dense
    optimizer's step and the gradients' release; ``model`` the module the forward runs (its
    modules' training flags and parameters' ``requires_grad`` are part of a signature). A
    replayed step is :meth:`forward`, the caller's decision on its loss, then :meth:`backward`
    (or the tables' ``abort_step``).
    """

    def __init__(
        self,
        embeddings: EmbeddingCollection,
        optimizer: torch.optim.Optimizer,
        forward_loss: Callable[[Batch, Optional[int]], torch.Tensor],
        dense_step: Callable[[], None],
        model: nn.Module,
        max_graphs: int = 4,
    ):
        self.embeddings = embeddings
        self.optimizer = optimizer
        self._modules = list(model.modules())
        self._parameters = list(model.parameters())
        self.forward_loss = forward_loss
        self.dense_step = dense_step
        self.max_graphs = max_graphs
        self.units: list[Unit] = []
        self.eager_units: list[Any] = []  # looked up eagerly around the graphs, their outputs handed to them
        for unit in embeddings.units:
            (self.units if uncaptured_reason(unit) is None else self.eager_units).append(unit)  # type: ignore[arg-type]
        self.tables = [t for u in self.units for t in (u.tables if isinstance(u, TableGroup) else [u])]
        self.refused: Optional[str] = None  # why a capture failed (no capture is tried again)
        self.on_refusal: Optional[Callable[[str], None]] = None
        self.replays = 0  # steps replayed
        self.captures = 0  # signatures captured (some may have been given up since: max_graphs)
        self._graphs: dict[tuple, _Captured] = {}
        self._last: Optional[tuple] = None  # the signature of the last step run eagerly, whole
        self._eager: Optional[tuple] = None  # that of the step forward() left to run eagerly
        # eager steps in a row whose signature was not that of the last step run eagerly whole (not
        # captured next time; 0 after a replay or capture, kept by a step without a signature)
        self._unrepeated = 0
        self._pending: Optional[_Captured] = None  # the graphs of a step whose forward was replayed
        self._given: dict[str, tuple[torch.Tensor, BagLayout]] = {}  # its eager lookups' outputs
        self._pool: Any = None
        self._staging: Optional[HostStaging] = None
        alive = weakref.ref(self)  # optimizer states loaded: the graphs step the old ones
        optimizer.register_load_state_dict_post_hook(lambda _: _forget(alive))

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def reset(self) -> None:
        """Forgets every graph (the tables or the optimizer's states were loaded: the graphs
        hold the tensors they replaced)."""
        if self._graphs:
            torch.cuda.synchronize()
        self._graphs.clear()
        self._last = self._eager = self._pending = self._pool = None
        self._given = {}
        self._unrepeated = 0

    def takes(self, batch: Batch, global_rows: Optional[int]) -> bool:
        """Whether :meth:`forward` would replay a step of ``batch`` now, as far as known before
        the step's learning rates are set (a schedule that changes the dense rate every step is
        captured for no step): the embeddings' input stage is then run ahead for the units
        looked up around the graphs alone (:meth:`ahead_units`)."""
        key = self._key(batch, global_rows)
        return key is not None and key in self._graphs

    def ahead_units(self, batch: Batch, global_rows: Optional[int]) -> Optional[list[str]]:
        """The units whose input stage (``EmbeddingCollection.prefetch``) is run ahead for a step
        of ``batch``: None (all) where the step would not be replayed (:meth:`takes`), else
        those looked up eagerly around the graphs (the graphs copy and split the batch for the
        others themselves): their finds' host reads then wait for no step's device work."""
        return [u.name for u in self.eager_units] if self.takes(batch, global_rows) else None

    @property
    def captures_next(self) -> bool:
        """Whether the signature of the step :meth:`forward` left to run eagerly is expected to
        be captured at its next step, should this one run whole: it has one, no capture failed,
        and signatures recur. The step then runs its dense model eagerly, its own CUDA graphs
        bypassed (``DenseGraphs.bypassed``: their capture would go to no replay). Signatures
        recur unless the step before also ran eagerly with a signature that could not be
        captured (not that of the last step run eagerly whole): where every batch's differs (a
        history whose length varies from row to row changes the features' id counts), the eager
        steps keep the dense model's graphs from their second on. (A signature that recurs
        later is still captured: a capture needs only its eager step run whole before it.)"""
        return self._eager is not None and self.refused is None and self._unrepeated < 2

    def ran_eagerly(self) -> None:
        """Tells that the step :meth:`forward` left to run eagerly ran whole, its backward and
        dense optimizer's step included (not skipped): its signature may be captured at its next
        step, whose kernels are compiled and whose optimizer states exist by then."""
        self._last = self._eager

    def forward(self, batch: Batch, global_rows: Optional[int]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The step's forward replayed (captured first where its signature recurs): ``(loss,
        finite)``, the loss a copy of the graph's, the flag the graph's own; None where the
        step is not replayed (nothing was done: run it eagerly). The batch is checked first,
        and an error raised before anything is written. Each table's step is open on return."""
        self._pending, self._given = None, {}
        key = self._key(batch, global_rows)
        captured = None
        if key is not None and key in self._graphs:
            captured = self._graphs[key] = self._graphs.pop(key)  # (the most recently replayed last)
        if key is None or (captured is None and not self._may_capture(key)):
            self._eager = key
            if key is not None:
                self._unrepeated += 1
            return None
        self._eager, self._unrepeated = None, 0  # (replayed or captured: nothing left to run eagerly)
        device = self.embeddings.device
        if batch.ready is not None:  # a batch made on another stream (a cached epoch's)
            torch.cuda.current_stream(device).wait_event(batch.ready)
        self.embeddings.check(batch.sparse)
        packed = batch.packed_buffer()
        assert packed is not None
        source, slots, layout = packed
        if captured is None:
            self._make_room()
            buffer = torch.empty(source.numel(), dtype=torch.uint8, device=device)
            hyper = torch.zeros(len(self.units), _HYPER_ROW, dtype=torch.float64, device=device)
        else:
            buffer, hyper = captured.buffer, captured.hyper
        buffer.copy_(source, non_blocking=True)
        given = {}
        if self.eager_units:  # (their steps opened here; aborted by the caller's abort_step)
            names = [u.name for u in self.eager_units]
            kjt = batch.sparse  # (its stage read ahead for them, else the graph's device copy of it)
            if not self.embeddings.prefetched(kjt, names):
                kjt = Batch.unpacked(buffer, slots, layout).sparse
            given = self.embeddings.lookup_units(kjt, names)
        if captured is None:
            captured = self._capture(key, buffer, hyper, given, slots, layout, global_rows)
            if captured is None:
                for unit in reversed(self.eager_units):  # the step runs eagerly, from its start
                    unit.abort_step()
                return None
        begun: list[Any] = []
        try:
            with torch.no_grad():  # (into the leaves the forward graph reads)
                for name, (output, _) in given.items():
                    leaf = captured.outputs[name]
                    if output.shape != leaf.shape or output.dtype != leaf.dtype:
                        raise RuntimeError(
                            f"table(s) {name}: a lookup of {output.dtype} {tuple(output.shape)} for a graph captured "
                            f"with {leaf.dtype} {tuple(leaf.shape)} under the same signature"
                        )
                    leaf.copy_(output)
            for unit in self.units:  # as the eager lookup opens them
                unit.begin_step()
                begun.append(unit)
            values: list[float] = []
            for unit in self.units:
                values += self._hyper(unit) + [0.0] * (_HYPER_ROW - len(HYPER))
            assert self._staging is not None
            self._staging.copy_to(captured.hyper.view(-1), values)
            captured.forward.replay()
        except BaseException:  # nothing of the step stays: every lookup's step undone
            for unit in [*reversed(begun), *reversed(self.eager_units)]:
                unit.abort_step()
            raise
        self._pending, self._given = captured, given
        return captured.loss.clone(), captured.finite

    def backward(self) -> None:
        """The backward of the step :meth:`forward` replayed, then each captured table's step
        committed (as its lookup's backward commits it), then the backward of the lookups not
        captured, from the gradients the replay left for their outputs (their updates)."""
        captured, given = self._pending, self._given
        self._pending, self._given = None, {}
        assert captured is not None, "backward() without a replayed forward"
        captured.backward.replay()
        commit_backward([(t, t.steps.current) for t in self.tables])
        if given:  # (the gradients' memory may be another signature's scratch: read now, before any replay)
            torch.autograd.backward([output for output, _ in given.values()], [captured.grads[n] for n in given])
        self.replays += 1

    # -- signatures and captures ---------------------------------------------------------------

    def _may_capture(self, key: tuple) -> bool:
        return key == self._last and self.refused is None

    def _make_room(self) -> None:
        """Gives up the least recently replayed graphs while ``max_graphs`` are kept (a staircase
        schedule's old dense rates, say), once the device has replayed them."""
        if len(self._graphs) >= self.max_graphs:
            if self.embeddings.device.type == "cuda":
                torch.cuda.synchronize(self.embeddings.device)
            while len(self._graphs) >= self.max_graphs:
                del self._graphs[next(iter(self._graphs))]

    def _key(self, batch: Batch, global_rows: Optional[int]) -> Optional[tuple]:
        """What a step's graphs bake in: the packed batch's layout (its slots, keys, id counts
        per feature and shortest and longest bags), the rows the loss is averaged over, each
        lookup's path (a group's tables at one rate and step counter, or each its own) and
        rows' addresses, the dense optimizer's settings, and the modules' training flags and
        parameters' ``requires_grad``; None for a batch not packed in one buffer, a group whose
        tables' rates or step counters differ (each is looked up on its own), tables frozen
        since, and grad mode off (an eager step refuses to train then)."""
        packed = batch.packed_buffer()
        if packed is None or not self.embeddings.trains_tables or not torch.is_grad_enabled():
            return None
        if any(isinstance(u, TableGroup) and u.shared_step() is None for u in self.units):
            return None
        buffer, slots, layout = packed
        stats = layout.stats
        lookups = tuple(
            (u.store.weight.data_ptr(), *(s.data_ptr() for s in u.store.states.values())) for u in self.units
        )
        groups = tuple(tuple((k, v) for k, v in g.items() if k != "params") for g in self.optimizer.param_groups)
        return (
            buffer.numel(),
            tuple(slots),
            tuple(layout.keys),
            stats.length_per_key,
            stats.min_length_per_key,
            stats.max_length_per_key,
            tuple(layout.present),
            tuple(tuple(k) for k in layout.dict_keys),
            layout.num_rows,
            layout.sampled_rows,
            global_rows,
            lookups,
            groups,
            tuple(m.training for m in self._modules),
            tuple(p.requires_grad for p in self._parameters),
        )

    def _hyper(self, unit: Unit) -> list[float]:
        """The scalars of ``unit``'s fused update at its current step (:func:`kernel_hyper`), at
        the rate and step counter its training lookup takes."""
        store = _store(unit)
        if isinstance(unit, TableGroup):
            shared = unit.shared_step()
            assert shared is not None, "the signature holds the group's path"
            lr, t = shared
            store.set_learning_rate(lr)  # (as the lookup sets it)
        else:
            lr, t = store.lr, unit.step
        half = store.weight.dtype != torch.float32
        return kernel_hyper(
            store.spec, lr=lr, step=t, half=half, key_offset=store.row_keys.offset, rounding_seed=store.rounding_seed
        )

    def _capture(
        self,
        key: tuple,
        buffer: torch.Tensor,
        hyper: torch.Tensor,
        given: Mapping[str, tuple[torch.Tensor, BagLayout]],
        slots: list,
        layout: Any,
        global_rows: Optional[int],
    ) -> Optional[_Captured]:
        """Captures the step of signature ``key``, whose batch's packed copy ``buffer`` holds,
        the lookups not captured given (``given``: their outputs and layouts); nothing runs: the
        captured tables' steps that its Python opens and commits are forgotten after it. None
        where the capture fails (:attr:`refused` says why); ``slots`` and ``layout``: the
        packed batch's (``Batch.packed_buffer``)."""
        device = self.embeddings.device
        if self._staging is None:
            self._staging = HostStaging(hyper.numel(), device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        generator = torch.cuda.default_generators[
            device.index if device.index is not None else torch.cuda.current_device()
        ]
        rng = generator.clone_state()
        stream = torch.cuda.current_stream(device)
        forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        stores = [_store(u) for u in self.units]
        # the outputs of the lookups not captured: leaves the graphs read, and take gradients of
        outputs = {name: torch.empty_like(out.detach()).requires_grad_() for name, (out, _) in given.items()}
        inputs = {name: (outputs[name], unit_layout) for name, (_, unit_layout) in given.items()}
        try:
            for name, (_, unit_layout) in given.items():
                if any(f.pooling == "none" and not f.padded for f in unit_layout.features):
                    raise ValueError(f"table(s) {name}: a sequence not padded (its lengths read at each replay)")
            with _dry_runs(self.tables):
                with capture_graph(forward, self._pool), self.embeddings.inputs_checked(inputs):
                    loss = self.forward_loss(Batch.unpacked(buffer, slots, layout), global_rows)
                    finite = torch.isfinite(loss)
                for store, row in zip(stores, hyper):
                    store.captured_hyper = row[: len(HYPER)]
                try:
                    with capture_graph(backward, self._pool):
                        loss.backward()
                        self.dense_step()
                finally:
                    for store in stores:
                        store.captured_hyper = None
            grads = {name: leaf.grad for name, leaf in outputs.items()}
            for name, grad in grads.items():
                if grad is None:
                    raise ValueError(f"table(s) {name}: the loss takes no gradient of their output")
        except Exception as e:  # this setup cannot be captured (or not beside the rest in memory): eager steps
            torch.cuda.set_stream(stream)
            generator.graphsafe_set_state(rng)
            self.optimizer.zero_grad(set_to_none=True)  # a backward cut short left gradients never computed
            torch.cuda.synchronize(device)
            self._graphs.clear()
            self._pool = None
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            self.refused = f"{type(e).__name__}: {first}" if first else type(e).__name__
            if self.on_refusal is not None:
                self.on_refusal(self.refused)
            return None
        captured = _Captured(
            forward, backward, buffer, hyper, loss.detach(), finite, outputs, cast(dict[str, torch.Tensor], grads)
        )
        self._graphs[key] = captured
        self.captures += 1
        return captured


def _store(unit: Unit) -> NativeRowStore:
    store = unit.store
    assert isinstance(store, NativeRowStore), "a lookup of another store is refused (step_graph_refusal)"
    return store


@contextlib.contextmanager
def _dry_runs(tables: Sequence[FixedTable]) -> Iterator[None]:
    """Every table's step lifecycle in a dry run (:meth:`StepLifecycle.dry_run`) for the block."""
    with contextlib.ExitStack() as stack:
        for table in tables:
            stack.enter_context(table.steps.dry_run())
        yield


def _forget(step_graphs: weakref.ref) -> None:
    alive = step_graphs()
    if alive is not None:
        alive.reset()
