"""The trainable model: the embedding collection (fused sparse optimizer) and the dense model."""

from __future__ import annotations

import torch
from torch import nn

from dynarec.config.schema import Config, SequenceFeatureCfg
from dynarec.data.batch import Batch
from dynarec.embedding.collection import EmbeddingCollection
from dynarec.models.inputs import model_inputs
from dynarec.models.registry import build_model
from dynarec.planner.plan import Plan, plan_from_config

__all__ = ["RankingTask"]


class RankingTask(nn.Module):
    """``batch -> logits [B]``. ``embeddings`` trains its tables inside backward; ``dense``
    holds every parameter a dense optimizer may see."""

    def __init__(self, config: Config, device: torch.device | str = "cpu"):
        super().__init__()
        self.config = config
        self.plan: Plan = plan_from_config(config)
        self.embeddings = EmbeddingCollection(self.plan.table_configs(), device=device)
        self.dense = build_model(config).to(device)
        self.sequence_features = [f.feature_name for f in config.features() if isinstance(f, SequenceFeatureCfg)]
        self.device = torch.device(device)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.dense(*model_inputs(self.embeddings, batch, self.sequence_features, self.device))
