"""CUDA graphs of the dense model's training forward and backward, one per input shape.

On a GPU the dense model's part of a step is a few hundred small kernels, each launched from
Python or from the autograd engine; at batch 4,096 the host takes several times longer to launch
them than the device takes to run them (about 190 launches and 1.5 ms of device time in an
11 ms DIN step on an H200). A captured graph launches all of a pass's kernels at once.

:class:`DenseGraphs` captures the dense model's forward and its backward (the gradients of the
parameters and of the inputs that need them) the first time it meets an input signature (every
tensor's name, shape, dtype and whether it needs a gradient) and replays them after that, as
one autograd node: the parameters' gradients reach ``.grad`` as eager autograd's do, and the
embeddings' gradients flow back into their lookups, whose fused update runs eagerly. The
features' outputs of one lookup (pieces of its one output tensor) enter that node as the one
tensor, and its gradient leaves it whole: the graph cuts the pieces itself (26 inputs of a DLRM
become one, and their 26 gradients are not concatenated eagerly); inputs needing no gradient
enter outside autograd, copied into the graph's buffers in one piece where they lie in one. The graphs
change no result: the same kernels run on the same inputs, and the capture's warm-up passes
leave no trace (the model's buffers, batch-norm statistics say, and the random generators are
restored), so the first replayed step starts from the state an eager step would.

Where it runs the model eagerly instead: a signature beyond ``max_graphs`` (each graph keeps its
own inputs, outputs and gradients), a forward without gradients, a step run within
:meth:`DenseGraphs.bypassed` (one whose whole step is to be captured: ``dynarec.train.step_graph``
replays that signature from its own graphs after it), and a model that cannot be
captured — one whose forward or backward waits for the device (a host read), or whose capture
fails otherwise: the reason is reported once and the model stays eager for the run.

A replay's parameter gradients are the graph's own buffers (as ``make_graphed_callables``'):
each step's must be consumed and dropped before the next replay, as the trainer's dense step
does (``zero_grad(set_to_none=True)``, no gradient accumulation when graphs are on).

This is torch's ``make_graphed_callables`` recipe, with what a trainer needs beyond it: captures
that errors in other threads (a DataLoader's pinning thread) cannot break, a failed capture that
leaves the random generator usable, and the capture's autograd graph released (a parameter's
gradient accumulator then belongs to the training stream, not to the capture's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, cast

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils._pytree import tree_flatten, tree_unflatten

from dynarec.devices import StorageSpan, byte_offset, capture_graph, storage_spans

__all__ = ["DenseGraphs", "uncapturable_modules"]

Inputs = tuple[dict[str, torch.Tensor], ...]


def uncapturable_modules(model: nn.Module) -> list[str]:
    """The class names (sorted, once each) of ``model``'s modules whose forward keeps something of
    a pass outside its outputs: they say so with ``capturable = False``, and no graph holds them."""
    return sorted({type(m).__name__ for m in model.modules() if not getattr(m, "capturable", True)})


def _signature(inputs: Inputs) -> tuple:
    """What a graph is specialised to: each input dict's keys in order, with each tensor's shape,
    dtype and whether it needs a gradient (a graph's inputs are flattened in this order)."""
    return tuple(tuple((k, tuple(v.shape), v.dtype, v.requires_grad) for k, v in d.items()) for d in inputs)


def _flat(inputs: Inputs) -> list[torch.Tensor]:
    return [v for d in inputs for v in d.values()]


class _Captured:
    """One signature's forward and backward graphs with their static tensors: ``inputs`` (the
    flattened inputs' static copies, copied into before a replay; None for a group's members),
    ``groups`` (inputs that are consecutive pieces of one tensor, as the features' pooled
    outputs of one lookup are: each a static leaf that the captured forward cuts into its
    members, so that a replay takes the one tensor and gives back its one gradient),
    ``outputs`` (the forward's, flattened), ``grad_outputs`` (copied into before the backward's
    replay) and ``grad_inputs`` (for the :meth:`surface`, then the parameters; None where none
    is needed)."""

    def __init__(self, dense: nn.Module, params: Sequence[nn.Parameter], inputs: Inputs, pool: Any):
        flat = _flat(inputs)
        self.keys = [list(d) for d in inputs]
        self.groups = [_Group(flat, members) for members in _split_groups(flat)]
        grouped = {i for g in self.groups for i in g.members}
        self.inputs, self.spans = _static_inputs(flat, grouped)
        # the inputs needing a gradient outside the groups: autograd inputs of the replay
        self.grad_members = [i for i, t in enumerate(flat) if t.requires_grad and i not in grouped]
        surface = [
            *(g.leaf for g in self.groups),
            *(t for t in self.inputs if t is not None and t.requires_grad),
            *params,
        ]
        wanted = [t for t in surface if t.requires_grad]

        def passes() -> tuple[list[torch.Tensor], Any, tuple[Optional[torch.Tensor], ...]]:
            outputs, spec = tree_flatten(dense(*self._sample()))
            live = [o for o in outputs if o.requires_grad]
            grad_outputs = [torch.ones_like(o) for o in live]
            grads = torch.autograd.grad(live, wanted, grad_outputs, allow_unused=True) if live else ()
            return outputs, spec, grads

        # Warm-up, eagerly: lazy initialisation (cuBLAS workspaces) stays out of the capture, and
        # a pass that waits for the device is refused here, before any capture starts.
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings():  # (torch's note that the mode is a prototype, on every run)
            warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
            torch.cuda.set_sync_debug_mode("error")
        try:
            passes()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        passes()
        torch.cuda.synchronize()

        self.forward = torch.cuda.CUDAGraph()
        with capture_graph(self.forward, pool):
            outputs, self.spec = tree_flatten(dense(*self._sample()))
        live = [o for o in outputs if o.requires_grad]
        self.grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in outputs]
        self.backward = torch.cuda.CUDAGraph()
        grads: Sequence[Optional[torch.Tensor]] = ()
        if live:
            with capture_graph(self.backward, pool):
                grads = torch.autograd.grad(
                    live, wanted, [g for g in self.grad_outputs if g is not None], allow_unused=True
                )
        found = iter(grads)
        self.grad_inputs = [next(found, None) if t.requires_grad else None for t in surface]
        # Where autograd gave two inputs one gradient tensor (an add passing it through), the
        # later ones get copies: each parameter's .grad must be its own memory, as eagerly.
        seen: set[int] = set()
        self.copy_grad = []
        for g in self.grad_inputs:
            self.copy_grad.append(g is not None and g.data_ptr() in seen)
            if g is not None:
                seen.add(g.data_ptr())
        self.has_backward = bool(live)
        # Detached: the capture's autograd graph (and the accumulators it made on the capture's
        # stream) is released.
        self.outputs = [o.detach() for o in outputs]

    def _sample(self) -> Inputs:
        """The dense model's arguments made of the static inputs, each group's members cut from
        its leaf (views: no kernel, and autograd takes the leaf's gradient through them)."""
        flat = list(self.inputs)
        for group in self.groups:
            for i, piece in zip(group.members, group.pieces(group.leaf)):
                flat[i] = piece
        values = iter(cast(list[torch.Tensor], flat))  # every None was a group's member
        return tuple({k: next(values) for k in keys} for keys in self.keys)

    def surface(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The replay's autograd inputs from the given flattened inputs: each group's tensor
        (their base where they are its pieces as captured, else their concatenation), then the
        other inputs needing a gradient."""
        return [*(g.given(flat) for g in self.groups), *(flat[i] for i in self.grad_members)]

    def copy_inputs(self, flat: Sequence[torch.Tensor], groups: Sequence[torch.Tensor]) -> None:
        """The static inputs take the values of ``flat`` (the given inputs) and the groups' leaves
        those of ``groups`` (:meth:`surface`'s first): the members of a span in one copy where
        they lie in one storage as they did when captured (a batch's features copied in one
        piece), the others one by one (none where a given tensor is the static one itself)."""
        for group, given in zip(self.groups, groups):
            if given.data_ptr() != group.leaf.data_ptr():
                group.leaf.copy_(given)
        copied: set[int] = set()
        for span, buffer in self.spans:
            storage = flat[span.members[0]].untyped_storage()
            start = _span_start(span, storage, flat, self.inputs)
            if start is not None:
                if storage.data_ptr() + start != buffer.data_ptr():
                    buffer.copy_(span.source(storage, start))
                copied.update(span.members)
        for i, (static, g) in enumerate(zip(self.inputs, flat)):
            if static is not None and i not in copied and static.data_ptr() != g.data_ptr():
                static.copy_(g)


class _Group:
    """Inputs needing a gradient that are consecutive pieces of one contiguous tensor, covering
    it (``members``: their positions in the flattened inputs, in the tensor's order), as a
    graph's one static leaf of that tensor's shape."""

    def __init__(self, flat: Sequence[torch.Tensor], members: tuple[int, ...]):
        base = flat[members[0]]._base
        assert base is not None
        self.members = members
        self.sizes = [flat[i].numel() for i in members]
        self.shapes = [flat[i].shape for i in members]
        self.offsets = [flat[i].storage_offset() - base.storage_offset() for i in members]
        self.leaf = base.detach().clone().requires_grad_()

    def pieces(self, whole: torch.Tensor) -> list[torch.Tensor]:
        return [p.view(shape) for p, shape in zip(whole.view(-1).split(self.sizes), self.shapes)]

    def given(self, flat: Sequence[torch.Tensor]) -> torch.Tensor:
        """The group's tensor in the given inputs: the members' base where they are its pieces as
        captured (no copy; its gradient comes back whole), else their concatenation."""
        base = flat[self.members[0]]._base
        checked: set[int] = set()
        if (
            base is not None
            and base.shape == self.leaf.shape
            and all(
                flat[i]._base is base
                and _piece_of(flat[i], base, checked)
                and flat[i].storage_offset() - base.storage_offset() == offset
                for i, offset in zip(self.members, self.offsets)
            )
        ):
            return base
        return torch.cat([flat[i].reshape(-1) for i in self.members]).view(self.leaf.shape)


# Autograd nodes of view ops that cut a tensor into pieces (their names less the trailing digit)
_VIEW_NODES = frozenset(
    {"SplitBackward", "SplitWithSizesBackward", "UnbindBackward", "ViewBackward", "SliceBackward", "SelectBackward"}
)


def _piece_of(t: torch.Tensor, base: Optional[torch.Tensor], checked: Optional[set[int]] = None) -> bool:
    """Whether ``t`` is a contiguous view of the contiguous ``base`` (its ``_base``) whose
    gradient autograd takes to ``base`` through view ops alone, with no hook of its own: so that
    handing ``base`` to the replay, and its gradient back to it, skips nothing. ``checked``:
    autograd nodes already found to lead to ``base`` (pieces of one split share one)."""
    if (
        base is None
        or not base.requires_grad
        or t.grad_fn is None
        or t.retains_grad
        or t._backward_hooks
        or t.dtype != base.dtype
        or not t.is_contiguous()
        or not base.is_contiguous()
    ):
        return False
    fn: Any = t.grad_fn
    seen = []
    for _ in range(4):  # a split, then a view or two
        if checked is not None and id(fn) in checked:
            break
        if type(fn).__name__.rstrip("0123456789") not in _VIEW_NODES:
            return False
        seen.append(id(fn))
        (fn, _), *rest = fn.next_functions
        if rest and any(n is not None for n, _ in rest):
            return False
        if fn is not None and (fn is base.grad_fn or getattr(fn, "variable", None) is base):
            break
    else:
        return False
    if checked is not None:
        checked.update(seen)
    return True


def _split_groups(flat: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    """Runs of two or more inputs needing a gradient that are consecutive contiguous pieces of
    one contiguous tensor and cover it exactly (what ``torch.split`` of a lookup's output
    gives), each in the tensor's order."""
    by_base: dict[int, list[int]] = {}
    for i, t in enumerate(flat):
        base = t._base
        if _piece_of(t, base):
            by_base.setdefault(id(base), []).append(i)
    groups = []
    for members in by_base.values():
        if len(members) < 2:
            continue
        base = flat[members[0]]._base
        assert base is not None
        order = sorted(members, key=lambda i: flat[i].storage_offset())
        at = base.storage_offset()
        for i in order:
            if flat[i].storage_offset() != at:
                break
            at += flat[i].numel()
        else:
            if at == base.storage_offset() + base.numel():
                groups.append(tuple(order))
    return groups


def _static_inputs(
    inputs: Sequence[torch.Tensor], skip: set[int]
) -> tuple[list[Optional[torch.Tensor]], list[tuple[StorageSpan, torch.Tensor]]]:
    """A graph's static inputs, holding the values of ``inputs`` (None at the positions in
    ``skip``): tensors that lie in one storage (:func:`~dynarec.devices.storage_spans`) are
    views of one buffer laid out as they are, so that a replay copies them in one piece;
    ``[(span, its buffer)]``, its members indexing ``inputs``."""
    kept = [i for i in range(len(inputs)) if i not in skip]
    static: list[Optional[torch.Tensor]] = [None] * len(inputs)
    spans = []
    for span in storage_spans([inputs[i] for i in kept], with_grad=True):
        span = dataclasses.replace(span, members=tuple(kept[m] for m in span.members))
        first = inputs[span.members[0]]
        buffer = span.source(first.untyped_storage()).clone()
        for i, view in zip(span.members, span.views(buffer, inputs)):
            static[i] = view.requires_grad_(inputs[i].requires_grad)
        spans.append((span, buffer))
    for i in kept:
        if static[i] is None:
            t = inputs[i]
            static[i] = t.detach().clone().requires_grad_(t.requires_grad)
    return static, spans


def _span_start(
    span: StorageSpan,
    storage: torch.UntypedStorage,
    given: Sequence[torch.Tensor],
    static: Sequence[Optional[torch.Tensor]],
) -> Optional[int]:
    """Where ``span`` starts in ``storage`` (its first member's in ``given``), where the
    ``given`` tensors all lie in it as the span's members do in ``static`` (offsets and
    strides); else None."""
    start = byte_offset(given[span.members[0]]) - span.offsets[0]
    if start < 0 or start + span.nbytes > storage.nbytes():
        return None
    ptr = storage.data_ptr()
    for i, offset in zip(span.members, span.offsets):
        g, s = given[i], static[i]
        if (
            s is None
            or g.untyped_storage().data_ptr() != ptr
            or byte_offset(g) != start + offset
            or g.stride() != s.stride()
        ):
            return None
    return start


class _Replay(torch.autograd.Function):
    """A captured forward as one autograd node whose backward is the captured backward: its
    autograd inputs are the captured :meth:`~_Captured.surface` and the parameters (the inputs
    needing no gradient come as a plain list, ``flat``, untracked)."""

    @staticmethod
    def forward(
        ctx, captured: _Captured, flat: Sequence[torch.Tensor], *surface: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        captured.copy_inputs(flat, surface[: len(captured.groups)])
        captured.forward.replay()
        ctx.captured = captured
        # A group given as a leaf (not a lookup's output) gets a gradient of its own memory, as
        # eagerly: it may outlive the step, which the graph's buffer does not.
        ctx.leaf_groups = [t.is_leaf for t in surface[: len(captured.groups)]]
        return tuple(o.detach() for o in captured.outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        captured: _Captured = ctx.captured
        for static, given in zip(captured.grad_outputs, grads):
            if static is not None and static.data_ptr() != given.data_ptr():
                static.copy_(given)
        if captured.has_backward:
            captured.backward.replay()
        # The parameters' .grad take these buffers as they are (autograd's accumulator steals a
        # tensor only it holds): correct while each step's gradients are consumed and dropped
        # before the next replay (the trainer's zero_grad(set_to_none=True), no accumulation).
        copies = [leaf or copy for leaf, copy in zip(ctx.leaf_groups, captured.copy_grad)]
        copies += captured.copy_grad[len(copies) :]
        return (
            None,
            None,
            *(
                None if g is None else (g.clone() if copy else g.detach())
                for g, copy in zip(captured.grad_inputs, copies)
            ),
        )


class DenseGraphs:
    """``dense(*inputs)`` in training, replayed from CUDA graphs.

    ``inputs`` are the dense model's arguments (``embeddings``, ``sequence lengths``, ``dense
    features``: dicts of CUDA tensors); returns what the model returns, its tensors the graph's
    static outputs (rewritten by the next replay). ``on_refusal(reason)`` is called once when a
    model cannot be captured; it then runs eagerly for the rest of the run.
    """

    def __init__(
        self,
        dense: nn.Module,
        max_graphs: int = 4,
        on_refusal: Optional[Callable[[str], None]] = None,
    ):
        self.dense = dense
        self.max_graphs = max_graphs
        self.on_refusal = on_refusal
        self.refused: Optional[str] = None
        self.replays = 0
        self._params = [p for p in dense.parameters() if p.requires_grad]
        self._graphs: dict[tuple, _Captured] = {}
        self._pool: Any = None  # one memory pool: a step replays one graph's forward, then its backward
        self._bypassed = False

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Within it the model runs eagerly, nothing captured: a step whose signature the whole
        step's graphs capture next time (their capture replaces this one, whose warm-up passes
        and memory would go to no replay)."""
        self._bypassed = True
        try:
            yield
        finally:
            self._bypassed = False

    def __call__(self, *inputs: dict[str, torch.Tensor]) -> Any:
        # a forward without backward: nothing to replay; inside a whole step's capture
        # (dynarec.train.step_graph): captured there
        if self._bypassed or not torch.is_grad_enabled() or torch.cuda.is_current_stream_capturing():
            return self.dense(*inputs)
        key = _signature(inputs)
        captured = self._graphs.get(key)
        if captured is None:
            if self.refused is not None or len(self._graphs) >= self.max_graphs:
                return self.dense(*inputs)
            captured = self._capture(inputs)
            if captured is None:
                return self.dense(*inputs)
            self._graphs[key] = captured
        self.replays += 1
        flat = _flat(inputs)
        outputs = _Replay.apply(captured, flat, *captured.surface(flat), *self._params)
        return tree_unflatten(list(outputs), captured.spec)

    def _capture(self, inputs: Inputs) -> Optional[_Captured]:
        device = next(t for d in inputs for t in d.values()).device
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        rng = generator.clone_state()
        buffers = [(b, b.detach().clone()) for b in self.dense.buffers()]
        stream = torch.cuda.current_stream(device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            with torch.random.fork_rng(devices=[device]):
                return _Captured(self.dense, self._params, inputs, self._pool)
        except torch.OutOfMemoryError:
            raise  # the step's own error (the trainer names it), not the model's
        except Exception as e:  # the model cannot be captured: it stays eager
            # A failed capture leaves the generator marked as capturing: its state is put back
            # (replaced, which graphs captured before would no longer follow: they are dropped
            # too), and the stream the step runs on, which a warm-up pass may have changed.
            torch.cuda.set_stream(stream)
            generator.graphsafe_set_state(rng)
            self._graphs.clear()
            self._pool = None
            torch.cuda.synchronize(device)
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            self.refused = f"{type(e).__name__}: {first}" if first else type(e).__name__
            if self.on_refusal is not None:
                self.on_refusal(self.refused)
            return None
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
