"""The dense optimizer's step replayed from a CUDA graph.

torch's fused Adam updates every dense parameter in one kernel, but its ``step()`` spends about
0.2 ms of host time a step getting there (the parameter groups walked, the states looked up, a
profiler range, the step counters' own launch): a tenth of a DLRM step at batch 8,192 on an
H100, whose host work is what bounds it. A captured step launches the same kernels on the same
tensors as one graph.

A graph reads the gradients where they were when it was captured, and bakes in the learning
rates. So :class:`OptimizerStepGraph` replays only a step whose gradients lie at the captured
addresses (with their strides) and whose rates and states are the captured ones: the dense
graphs' gradients, which are their graphs' own buffers (``dynarec.train.graphs``), or the same
blocks handed out again by torch's allocator. Any other step runs eagerly, and a step seen
twice in a row that way is captured for the next ones. The captured step is the eager one: the
same fused kernels on the same tensors, bit for bit.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Optional

import torch

from dynarec.devices import capture_graph

__all__ = ["OptimizerStepGraph", "captures_step"]


def captures_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether :class:`OptimizerStepGraph` replays ``optimizer``'s steps: torch's fused Adam or
    AdamW (its ``capturable`` flag changes nothing in the fused kernels) over parameters all on
    one GPU."""
    devices = {p.device for p in _params(optimizer)}
    return (
        isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
        and len(devices) == 1
        and next(iter(devices)).type == "cuda"
        and all(g.get("fused") for g in optimizer.param_groups)
    )


class OptimizerStepGraph:
    """``optimizer.step()``, replayed from a CUDA graph where the step matches the captured one
    (module doc), else run eagerly."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        if not captures_step(optimizer):
            raise ValueError(f"{type(optimizer).__name__} over these parameters is not captured (captures_step)")
        self.optimizer = optimizer
        self.params = _params(optimizer)
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._captured: Optional[tuple] = None  # the graph's step (_step_key)
        self._last: Optional[tuple] = None  # the last eager step's
        self.refused: Optional[str] = None  # why a capture failed (the steps then stay eager)
        self.replays = 0  # steps replayed from the graph
        # states loaded replace the ones the graph steps: it is forgotten (weakly: no cycle)
        alive = weakref.ref(self)
        optimizer.register_load_state_dict_post_hook(lambda _: _forget(alive))

    def step(self) -> None:
        if torch.cuda.is_current_stream_capturing():  # inside a whole step's capture: captured there
            with _capturable(self.optimizer):
                self.optimizer.step()
            return
        key = self._step_key()
        if (self.graph is not None and key == self._captured) or (
            key == self._last and self.refused is None and self._capture(key)  # (a capture runs nothing)
        ):
            assert self.graph is not None
            self.graph.replay()
            self.replays += 1
            return
        self.optimizer.step()
        self._last = key

    def reset(self) -> None:
        """Forgets the graph (the optimizer's ``load_state_dict`` calls it: the states it steps
        were replaced)."""
        self.graph = self._captured = self._last = None

    def _step_key(self) -> tuple:
        """What a graph bakes in: each parameter's address, its gradient's address and strides
        (None: no gradient, a parameter the step skips), each group's settings, and the states'
        count (a step before the first has none: it creates them)."""
        grads = tuple(
            (p.data_ptr(), None if p.grad is None else (p.grad.data_ptr(), p.grad.stride())) for p in self.params
        )
        groups = tuple(tuple((k, v) for k, v in g.items() if k != "params") for g in self.optimizer.param_groups)
        return grads, groups, len(self.optimizer.state)

    def _capture(self, key: tuple) -> bool:
        """Captures the step (its states exist: an eager step ran); False where the capture
        fails (:attr:`refused` says why; later steps stay eager)."""
        graph = torch.cuda.CUDAGraph()
        try:
            with _capturable(self.optimizer), capture_graph(graph):
                self.optimizer.step()
        except RuntimeError as e:
            self.refused = str(e).splitlines()[0][:200]
            return False
        self.graph, self._captured = graph, key
        return True


@contextlib.contextmanager
def _capturable(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Each group's ``capturable`` flag set in the block: torch refuses to capture a step
    otherwise, and the fused kernels ignore it."""
    groups = optimizer.param_groups
    flags = [g["capturable"] for g in groups]
    for g in groups:
        g["capturable"] = True
    try:
        yield
    finally:
        for g, flag in zip(groups, flags):
            g["capturable"] = flag


def _params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """Every parameter ``optimizer`` steps, group by group."""
    return [p for g in optimizer.param_groups for p in g["params"]]


def _forget(step_graph: weakref.ref) -> None:
    alive = step_graph()
    if alive is not None:
        alive.reset()
