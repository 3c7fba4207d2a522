"""Two-tower retrieval models: DSSM (TorchEasyRec's ``DSSM`` and ``DSSMV2``; Huang et al. 2013)
and DAT (TorchEasyRec's ``DAT``, dual augmented two-tower; Yu et al. 2021).

The dense model is a per-row function: each row's user embedding (its user group through the
user tower) then its item embedding (its item group through the item tower), ``[R, 2 * D]``,
``D`` = ``output_dim`` (or the towers' last width where it is 0), L2-normalized for cosine
similarity. DAT's towers also read an augmented vector (a group's output, joined to the tower's
input), and the rows end with the two augmented vectors: ``[R, 4 * D]``. A training batch's
rows are its users with their positive items, then the sampled items (item features only; the
user tower reads the users' rows alone and gives zeros there);
:class:`~dynarec.models.retrieval.Retrieval` scores each user against them. Serving a tower is
reading its part of a row.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dynarec.config.schema import Config, DATTowerCfg, DSSMCfg, MatchTowerCfg
from dynarec.models.blocks import MLP, DeepGroup
from dynarec.models.features import FeatureInputs

__all__ = ["DAT", "DSSM"]


class _Tower(nn.Module):
    """A group (and DAT's augmented vector: another group) through an MLP, then a linear layer
    to ``output_dim`` (none where it is 0); L2-normalized for ``cosine``."""

    def __init__(
        self, config: Config, tower: MatchTowerCfg, output_dim: int, cosine: bool, inputs: FeatureInputs
    ) -> None:
        super().__init__()
        self.group = DeepGroup(config, config.model.group(tower.input), inputs)
        self.augment: Optional[DeepGroup] = None
        if isinstance(tower, DATTowerCfg):
            self.augment = DeepGroup(config, config.model.group(tower.augment_input), inputs)
        width = self.group.out_dim + (self.augment.out_dim if self.augment is not None else 0)
        self.mlp = MLP(width, tower.hidden_units, tower.activation, tower.dropout_ratio, batch_norm=tower.use_bn)
        self.output = nn.Linear(self.mlp.out_dim, output_dim) if output_dim > 0 else None
        self.out_dim = output_dim if output_dim > 0 else self.mlp.out_dim
        self.cosine = cosine

    def forward(self, embeddings, seq_lengths, dense) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(embedding [R, D], augmented vector [R, A] or None)``."""
        x = self.group(embeddings, seq_lengths, dense)
        augment = self.augment(embeddings, seq_lengths, dense) if self.augment is not None else None
        if augment is not None:
            x = torch.cat([x, augment], dim=1)
        x = self.mlp(x)
        if self.output is not None:
            x = self.output(x)
        return (F.normalize(x, p=2.0, dim=1) if self.cosine else x), augment


class DSSM(nn.Module):
    def __init__(self, config: Config, cfg: DSSMCfg):
        super().__init__()
        self.inputs = FeatureInputs(config)
        cosine = cfg.similarity == "cosine"
        self.user_tower = _Tower(config, cfg.user_tower, cfg.output_dim, cosine, self.inputs)
        self.item_tower = _Tower(config, cfg.item_tower, cfg.output_dim, cosine, self.inputs)
        name = config.model.name
        if self.user_tower.out_dim != self.item_tower.out_dim:
            raise ValueError(
                f"model.{name}: the user tower gives {self.user_tower.out_dim} numbers, the item tower "
                f"{self.item_tower.out_dim}; set output_dim, or end both towers' hidden_units alike"
            )
        for tower, side in ((self.user_tower, "user"), (self.item_tower, "item")):
            if tower.augment is not None and tower.augment.out_dim != tower.out_dim:
                raise ValueError(
                    f"model.{name}.{side}_tower.augment_input: its group gives {tower.augment.out_dim} numbers; "
                    f"the adaptive-mimic loss compares it with the towers' {tower.out_dim}: make them equal"
                )

    def forward(self, embeddings, seq_lengths, dense, rows: Optional[int] = None) -> torch.Tensor:
        """``rows``: the rows that are users (the rest are sampled items): the user tower reads
        those alone (its batch statistics too, as TorchEasyRec's), zeros after them."""
        item, item_augment = self.item_tower(embeddings, seq_lengths, dense)
        total = item.shape[0]
        if rows is None or rows == total:
            user, user_augment = self.user_tower(embeddings, seq_lengths, dense)
        else:
            head = [{k: v[:rows] for k, v in d.items()} for d in (embeddings, seq_lengths, dense)]
            user, user_augment = (
                None if x is None else F.pad(x, (0, 0, 0, total - rows)) for x in self.user_tower(*head)
            )
        parts = [user, item] + [a for a in (user_augment, item_augment) if a is not None]
        return torch.cat(parts, dim=1)


class DAT(DSSM):
    """DSSM with augmented vectors (module doc); ``[R, 4 * D]``."""
