"""The trainable model: the embedding collection (fused sparse optimizer) and the dense model.

In a multi-process run the collection is the sharded one (tables spread by the plan) and the
dense model is wrapped in DistributedDataParallel, whose gradients are *summed* over the ranks:
each rank's loss is its share of the global batch's mean, so the sum is the gradient of the
global-batch loss — the same rule every sharded table follows.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from dynarec.config.schema import Config
from dynarec.data.batch import Batch
from dynarec.distributed.collection import ShardedEmbeddingCollection
from dynarec.distributed.context import DistContext, single_process
from dynarec.embedding.collection import EmbeddingCollection
from dynarec.embedding.memory import available_memory, format_bytes
from dynarec.models.features import element_poolings, sequence_names
from dynarec.models.inputs import model_inputs
from dynarec.models.mlp import normalize_over_ranks
from dynarec.models.registry import build_model
from dynarec.planner.plan import Plan, plan_from_config
from dynarec.train.graphs import DenseGraphs, uncapturable_modules

__all__ = ["RankingTask", "check_dense_fits", "check_servable", "dense_graph_refusal"]


_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _allreduce_sum_hook(process_group, bucket):
    """DDP comm hook: the sum (not the mean) of the ranks' gradients."""
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def check_dense_fits(config: Config, device: torch.device, budget: Optional[int] = None) -> int:
    """Bytes the dense model takes in training — weights, gradients and the dense optimizer's
    state — counted on the meta device before anything is allocated. Raises ValueError naming
    the largest layers and the numbers when that exceeds ``budget`` (default: the memory
    available on ``device``)."""
    with torch.device("meta"):
        model = build_model(config)
    params = [(name, p) for name, p in model.named_parameters()]
    weights = sum(p.numel() * p.element_size() for _, p in params)
    states = config.train.dense_optimizer.state_tensors_per_parameter()
    need = weights * (2 + states)
    budget = available_memory(device) if budget is None else budget
    if need <= budget:
        return need
    largest = sorted(params, key=lambda x: -x[1].numel())[:3]
    layers = ", ".join(f"{name} {list(p.shape)} ({format_bytes(p.numel() * p.element_size())})" for name, p in largest)
    raise ValueError(
        f"the dense model needs {format_bytes(need)} in training ({sum(p.numel() for _, p in params):,} parameters: "
        f"weights, gradients and {states} optimizer state(s) each) but {format_bytes(budget)} is available on "
        f"{device}; its largest layers: {layers}; make the model's hidden_units smaller"
    )


def check_servable(task: RankingTask) -> None:
    """ValueError where ``task``'s dense model cannot score yet (its ``check_servable``: an
    RQ-KMeans checkpoint written before its fit); evaluation, prediction and export call it."""
    check = getattr(task.dense, "check_servable", None)
    if check is not None:
        check()


class RankingTask(nn.Module):
    """``batch -> logits``: ``[B]``, or ``[B, K]`` for a multi-task model (dynarec.models.tasks).
    ``embeddings`` trains its tables inside backward; ``dense``
    holds every parameter a dense optimizer may see."""

    def __init__(
        self,
        config: Config,
        device: torch.device | str = "cpu",
        ctx: Optional[DistContext] = None,
        plan: Optional[Plan] = None,
    ):
        super().__init__()
        self.config = config
        self.device = torch.device(device)
        self.ctx = ctx or single_process(self.device)
        self.plan: Plan = plan or plan_from_config(config, world_size=self.ctx.world_size)
        self.embeddings: Union[EmbeddingCollection, ShardedEmbeddingCollection]
        # The dense model first: the tables get what it leaves.
        given = config.train.memory_budget_per_rank
        budget = available_memory(self.device) if given is None else int(given)
        budget -= check_dense_fits(config, self.device, budget)
        if self.ctx.distributed:
            self.embeddings = ShardedEmbeddingCollection(self.plan, self.ctx)
        else:
            self.embeddings = EmbeddingCollection(self.plan.table_configs(), device=self.device, memory_budget=budget)
        self.dense = build_model(config).to(self.device)
        self._dense_forward: nn.Module = self.dense
        if self.ctx.distributed:
            normalize_over_ranks(self.dense, self.ctx.group)  # a batch norm's statistics: the global batch's
            ddp = nn.parallel.DistributedDataParallel(
                self.dense,
                device_ids=[self.device] if self.device.type == "cuda" else None,
                process_group=self.ctx.group,
            )
            ddp.register_comm_hook(self.ctx.group, _allreduce_sum_hook)
            self._dense_forward = ddp
        self.graphs: Optional[DenseGraphs] = None
        #: Why the dense model has no CUDA graphs (None: it has them).
        self.dense_graph_refusal = dense_graph_refusal(config, self.device, self.ctx.distributed, self.dense)
        if self.dense_graph_refusal is None:
            self.graphs = DenseGraphs(self.dense)
        self.sequence_features = sequence_names(config)
        self.element_pooling = element_poolings(config)

    def dense_gradients_kept_local(self) -> contextlib.AbstractContextManager:
        """Around a step whose dense gradients stay on this rank (a gradient-accumulation window's
        steps before its last, forward and backward): DDP's ``no_sync``; nothing in one process.
        Its sum hook reduces a parameter's whole ``.grad``, so a window's earlier steps, reduced at
        each step, were summed over the ranks again at every later one (world size times)."""
        if isinstance(self._dense_forward, nn.parallel.DistributedDataParallel):
            return self._dense_forward.no_sync()
        return contextlib.nullcontext()

    def forward(self, batch: Batch, precision: Optional[str] = None) -> torch.Tensor:
        """Float32 logits (``[B]`` or ``[B, K]``); ``precision`` (``"bf16"`` / ``"fp16"``): the dense model
        under autocast in that dtype (the embeddings are looked up and the logits returned in float32)."""
        return self._forward(batch, precision, detach=False)[0]

    def forward_detached(
        self, batch: Batch, precision: Optional[str] = None
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """:meth:`forward` where the dense model reads every embedding output that needs a gradient as a
        leaf of its own: ``(logits, [(output, leaf)])``. A backward of the logits stops at the leaves; the
        outputs' backward (the tables' fused updates) is the caller's to run, with the leaves' gradients
        or not at all (dynarec/train/loss_scaling.py)."""
        return self._forward(batch, precision, detach=True)

    def _forward(
        self, batch: Batch, precision: Optional[str], detach: bool
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        emb, lengths, dense = model_inputs(
            self.embeddings, batch, self.sequence_features, self.device, self.element_pooling
        )
        held: list[tuple[torch.Tensor, torch.Tensor]] = []
        if detach:
            leaves: dict[int, torch.Tensor] = {}  # one leaf an output (a dict may name one twice)
            for k, v in emb.items():
                if v.requires_grad:
                    if id(v) not in leaves:
                        leaves[id(v)] = v.detach().requires_grad_()
                        held.append((v, leaves[id(v)]))
                    emb[k] = leaves[id(v)]
        # A retrieval model's batch may end with sampled items: the model learns where its users end.
        extra = {"rows": batch.num_rows} if batch.sampled_rows else {}
        if precision is None:
            if self.graphs is not None and self.training and not extra:
                return self.graphs(emb, lengths, dense), held
            return self._dense_forward(emb, lengths, dense, **extra), held
        with torch.autocast(self.device.type, dtype=_AUTOCAST[precision]):
            logits = self._dense_forward(emb, lengths, dense, **extra)
        return logits.float(), held


def dense_graph_refusal(config: Config, device: torch.device, distributed: bool, dense: nn.Module) -> Optional[str]:
    """Why the dense model ``dense`` trains without CUDA graphs under ``config`` on ``device``,
    None where it is captured: in training where the graphs can hold — one process (no DDP
    hooks), float32, gradients not accumulated over steps (a replay rewrites the buffer a
    parameter's ``.grad`` was taken from), and a model that keeps nothing of a forward pass outside
    its outputs (a module that does says so: ``capturable = False``)."""
    train = config.train
    if not train.cuda_graphs:
        return "train.cuda_graphs is off"
    if device.type != "cuda":
        return f"the device is {device.type}, not a GPU"
    if distributed:
        return "a multi-process run (DistributedDataParallel's hooks run in the backward)"
    if train.mixed_precision is not None:
        return f"train.mixed_precision is {train.mixed_precision}"
    if train.gradient_accumulation_steps != 1:
        return f"train.gradient_accumulation_steps is {train.gradient_accumulation_steps}"
    kept = uncapturable_modules(dense)
    if kept:
        return f"module(s) {', '.join(kept)} keep something of a forward pass outside their outputs"
    return None
