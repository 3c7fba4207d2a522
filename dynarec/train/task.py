"""The trainable model: the embedding collection (fused sparse optimizer) and the dense model.

In a multi-process run the collection is the sharded one (tables spread by the plan) and the
dense model is wrapped in DistributedDataParallel, whose gradients are *summed* over the ranks:
each rank's loss is its share of the global batch's mean, so the sum is the gradient of the
global-batch loss — the same rule every sharded table follows.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from dynarec.config.schema import Config, SequenceFeatureCfg
from dynarec.data.batch import Batch
from dynarec.distributed.collection import ShardedEmbeddingCollection
from dynarec.distributed.context import DistContext, single_process
from dynarec.embedding.collection import EmbeddingCollection
from dynarec.models.inputs import model_inputs
from dynarec.models.registry import build_model
from dynarec.planner.plan import Plan, plan_from_config

__all__ = ["RankingTask"]


def _allreduce_sum_hook(process_group, bucket):
    """DDP comm hook: the sum (not the mean) of the ranks' gradients."""
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class RankingTask(nn.Module):
    """``batch -> logits [B]``. ``embeddings`` trains its tables inside backward; ``dense``
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
        if self.ctx.distributed:
            self.embeddings = ShardedEmbeddingCollection(self.plan, self.ctx)
        else:
            self.embeddings = EmbeddingCollection(
                self.plan.table_configs(), device=self.device, memory_budget=config.train.memory_budget_per_rank
            )
        self.dense = build_model(config).to(self.device)
        self._dense_forward: nn.Module = self.dense
        if self.ctx.distributed:
            ddp = nn.parallel.DistributedDataParallel(
                self.dense,
                device_ids=[self.device] if self.device.type == "cuda" else None,
                process_group=self.ctx.group,
            )
            ddp.register_comm_hook(self.ctx.group, _allreduce_sum_hook)
            self._dense_forward = ddp
        self.sequence_features = [f.feature_name for f in config.features() if isinstance(f, SequenceFeatureCfg)]

    def forward(self, batch: Batch) -> torch.Tensor:
        return self._dense_forward(*model_inputs(self.embeddings, batch, self.sequence_features, self.device))
