"""DSSM: a two-tower retrieval model (TorchEasyRec's ``DSSM`` and ``DSSMV2``; Huang et al. 2013).

The dense model is a per-row function, ``[R, 2 * D]``: each row's user embedding (its user
group through the user tower) then its item embedding (its item group through the item tower),
``D`` = ``output_dim`` (or the towers' last width where it is 0), L2-normalized for cosine
similarity. A training batch's rows are its users with their positive items, then the sampled
items (item features only); :class:`~dynarec.models.retrieval.Retrieval` scores each user
against them. Serving a tower is reading its half of a row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dynarec.config.schema import Config, DSSMCfg, MatchTowerCfg
from dynarec.models.blocks import MLP, DeepGroup
from dynarec.models.features import FeatureInputs

__all__ = ["DSSM"]


class _Tower(nn.Module):
    def __init__(self, config: Config, tower: MatchTowerCfg, output_dim: int, inputs: FeatureInputs):
        super().__init__()
        self.group = DeepGroup(config, config.model.group(tower.input), inputs)
        self.mlp = MLP(self.group.out_dim, tower.hidden_units, tower.activation, batch_norm=tower.use_bn)
        self.output = nn.Linear(self.mlp.out_dim, output_dim) if output_dim > 0 else None
        self.out_dim = output_dim if output_dim > 0 else self.mlp.out_dim

    def forward(self, embeddings, seq_lengths, dense) -> torch.Tensor:
        x = self.mlp(self.group(embeddings, seq_lengths, dense))
        return self.output(x) if self.output is not None else x


class DSSM(nn.Module):
    def __init__(self, config: Config, cfg: DSSMCfg):
        super().__init__()
        self.inputs = FeatureInputs(config)
        self.user_tower = _Tower(config, cfg.user_tower, cfg.output_dim, self.inputs)
        self.item_tower = _Tower(config, cfg.item_tower, cfg.output_dim, self.inputs)
        if self.user_tower.out_dim != self.item_tower.out_dim:
            raise ValueError(
                f"model.dssm: the user tower gives {self.user_tower.out_dim} numbers, the item tower "
                f"{self.item_tower.out_dim}; set output_dim, or end both towers' hidden_units alike"
            )
        self.cosine = cfg.similarity == "cosine"

    def forward(self, embeddings, seq_lengths, dense) -> torch.Tensor:
        user = self.user_tower(embeddings, seq_lengths, dense)
        item = self.item_tower(embeddings, seq_lengths, dense)
        if self.cosine:
            user, item = F.normalize(user, p=2.0, dim=1), F.normalize(item, p=2.0, dim=1)
        return torch.cat([user, item], dim=1)
