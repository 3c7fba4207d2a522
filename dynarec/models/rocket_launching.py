"""RocketLaunching (Zhou et al., 2018; TorchEasyRec's ``rocket_launching``): a light net trained
beside a booster net that teaches it, the light net served.

Over the first feature group, an optional shared MLP; the booster MLP reads its output, the light
MLP the same output detached (the light net never trains what it shares). In training the step's
loss adds, to the light net's task loss, the booster's task loss, the hint loss (the squared
difference of the light logits and the booster's, the booster's detached) and, with
``feature_based_distillation``, a similarity loss between each light hidden layer and the first
booster layer of its width (TorchEasyRec's formulas: cosine ``-0.1 * mean(sum(b^ * l^))``, or
``sqrt(sum((b - l)^2))`` over the batch). Evaluation, export and serving run the light net alone.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dynarec.config.schema import Config, RocketLaunchingCfg
from dynarec.models.blocks import DeepGroup
from dynarec.models.features import FeatureInputs
from dynarec.models.mlp import MLP
from dynarec.models.tasks import Teaching

__all__ = ["RocketLaunching"]


def _hidden(mlp: MLP, x: torch.Tensor) -> list[torch.Tensor]:
    """The output of every layer (after its activation) of ``mlp``."""
    out = []
    for module in mlp:
        x = module(x)
        if not isinstance(module, nn.Linear) and not isinstance(module, nn.Dropout):
            out.append(x)
    return out


class RocketLaunching(nn.Module):
    # Its forward leaves the booster's outputs in self.teaching for the loss: a CUDA graph's
    # replay would not set them (dynarec.train.graphs).
    capturable = False

    def __init__(self, config: Config, cfg: RocketLaunchingCfg):
        super().__init__()
        self.cfg = cfg
        self.inputs = FeatureInputs(config)
        self.group = DeepGroup(config, config.model.feature_groups[0], self.inputs)
        width = self.group.out_dim
        self.share = MLP(width, cfg.share_hidden_units) if cfg.share_hidden_units else None
        width = self.share.out_dim if self.share is not None else width
        self.booster = MLP(width, cfg.booster_hidden_units)
        self.booster_out = nn.Linear(self.booster.out_dim, 1)
        self.light = MLP(width, cfg.light_hidden_units)
        self.light_out = nn.Linear(self.light.out_dim, 1)
        # Each light layer and the first booster layer of its width (feature-based distillation).
        self.pairs = [
            (i, cfg.booster_hidden_units.index(units))
            for i, units in enumerate(cfg.light_hidden_units)
            if units in cfg.booster_hidden_units
        ]
        self.teaching: Optional[Teaching] = None

    def forward(self, embeddings, seq_lengths, dense) -> torch.Tensor:
        net = self.group(embeddings, seq_lengths, dense)
        shared = self.share(net) if self.share is not None else net
        light = _hidden(self.light, shared.detach())
        light_logits = self.light_out(light[-1]).squeeze(1)
        if not self.training:
            self.teaching = None
            return light_logits
        booster = _hidden(self.booster, shared)
        booster_logits = self.booster_out(booster[-1]).squeeze(1)
        rows = (light_logits - booster_logits.detach()) ** 2  # the hint loss
        batch = light_logits.new_zeros(())
        if self.cfg.feature_based_distillation:
            for i, j in self.pairs:
                teacher, student = booster[j].detach(), light[i]
                if self.cfg.feature_distillation_function == "cosine":
                    rows = rows - 0.1 * (F.normalize(teacher, dim=1) * F.normalize(student, dim=1)).sum(1)
                else:
                    batch = batch + torch.sqrt(((teacher - student) ** 2).sum())
        self.teaching = Teaching(booster_logits, rows, batch)
        return light_logits
