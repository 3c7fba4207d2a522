"""A retrieval model's task at run time (model.dssm, model.dat, model.mind): its loss, predictions and
metrics, in the shape of :class:`~dynarec.models.tasks.Tasks`.

The model gives ``[R, 2 * D]`` (user then item embedding per row) over a batch's ``B`` rows and
its ``N`` sampled items (``R = B + N``). Each user ``i`` is scored against its own item and the
sampled ones: ``s_i = [u_i . v_i, u_i . v_{B}, ..., u_i . v_{B+N-1}] / temperature``
(``in_batch_negative``: against every item of the batch and the samples,
``s_i = u_i . v_j / temperature`` for all ``j < R``, its own item at ``j = i``) — TorchEasyRec's
``MatchModel.sim``. With hard negatives (the last ``H`` sampled rows, each of one user: the
batch's ``hard_negative_rows``) a user's scores end with its own hard negatives, ``-inf`` past
their count (``in_batch_negative``: they are items like the others). The loss is the softmax
cross-entropy of the own item, averaged over the global batch. DAT's rows end with the
augmented vectors ``a_u``, ``a_v`` (``[R, 4 * D]``) and its loss adds the adaptive-mimic terms
(TorchEasyRec's, summed over the batch's rows; each rank's share divided by the world size, as
TorchEasyRec's averaged gradients are)::

    amm_u_weight * sum_i ||normalize(a_u_i) - v_i||^2 + amm_i_weight * sum_i ||normalize(a_v_i) - u_i||^2

the tower outputs ``u``, ``v`` held constant there. A row's prediction is its own item's rank
among the scored items (0: the best; the items scoring strictly higher); recall@k is the share
of rows ranking below k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from dynarec.config.hstu import CHANNEL_SUFFIXES
from dynarec.config.schema import Config, DATCfg, HSTUMatchCfg, MINDCfg

__all__ = ["Retrieval"]


class Retrieval:
    """The task of a retrieval model (``config.model.dssm``)."""

    def __init__(self, config: Config, world_size: int = 1):
        cfg = config.model.retrieval
        self.temperature = cfg.temperature
        self.in_batch_negative = cfg.in_batch_negative
        self.top_k = list(cfg.recall_at_k)
        self.towers = config.tasks()
        self.dim = cfg.embedding_dim
        self.amm = (cfg.amm_u_weight, cfg.amm_i_weight) if isinstance(cfg, DATCfg) else None
        # MIND's rows end with each user's interests, which an export serves
        self.interests = cfg.user_tower.capsule.max_k if isinstance(cfg, MINDCfg) else 0
        self.world_size = world_size

    def scores(self, out: torch.Tensor, rows: int, hard_negative_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[B, C]`` similarity scores of the ``rows`` users (module doc); the own item is column
        0 (``in_batch_negative``: column ``i`` of row ``i``)."""
        d = self.dim
        user, item = out[:rows, :d].float(), out[:, d : 2 * d].float()
        if self.in_batch_negative:
            return user @ item.T / self.temperature
        hard = 0 if hard_negative_rows is None else hard_negative_rows.numel()
        own = (user * item[:rows]).sum(1, keepdim=True)
        parts = [own, user @ item[rows : item.shape[0] - hard].T]
        if hard:
            assert hard_negative_rows is not None
            owner = hard_negative_rows.to(user.device)
            counts = torch.bincount(owner, minlength=rows)
            position = torch.arange(hard, device=user.device) - (torch.cumsum(counts, 0) - counts)[owner]
            block = user.new_full((rows, int(counts.max())), float("-inf"))
            block[owner, position] = (user[owner] * item[item.shape[0] - hard :]).sum(1)
            parts.append(block)
        return torch.cat(parts, dim=1) / self.temperature

    def _own(self, scores: torch.Tensor) -> torch.Tensor:
        if self.in_batch_negative:
            return torch.arange(scores.shape[0], device=scores.device)
        return torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)

    def loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        global_rows: Union[int, torch.Tensor],
        global_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        sessions: Optional[torch.Tensor] = None,
        teaching=None,
        hard_negative_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """This rank's share of the mean softmax cross-entropy over the global batch (``labels``
        ``[B, L]`` give the batch's rows; their values are not read)."""
        rows = labels.shape[0]
        scores = self.scores(logits, rows, hard_negative_rows)
        loss = F.cross_entropy(scores, self._own(scores), reduction="sum") / global_rows
        if self.amm is not None:
            d = self.dim
            own = logits[:rows].float()
            user, item = own[:, :d].detach(), own[:, d : 2 * d].detach()
            user_augment, item_augment = own[:, 2 * d : 3 * d], own[:, 3 * d :]
            amm_u = (F.normalize(user_augment, p=2.0, dim=1) - item).square().sum()
            amm_i = (F.normalize(item_augment, p=2.0, dim=1) - user).square().sum()
            loss = loss + (self.amm[0] * amm_u + self.amm[1] * amm_i) / self.world_size
        return loss

    def output_names(self) -> list[str]:
        return ["positive_rank"]

    @property
    def logits_width(self) -> int:
        """The numbers a row of the model's output holds: the user's and the item's embeddings, then
        DAT's two augmented vectors or MIND's interests."""
        return (2 + (2 if self.amm is not None else self.interests)) * self.dim

    def served_names(self) -> list[str]:
        return ["user_interests" if self.interests else "user_embedding", "item_embedding"]

    def tower_features(self, config: Config) -> dict[str, set[str]]:
        """``{served name: the features its tower reads}`` (its groups' features and those they
        read through ``feature:`` inputs): a table of one tower's columns serves that tower's
        output."""
        cfg, model = config.model.retrieval, config.model
        names = {g.group_name for g in model.feature_groups}
        if isinstance(cfg, HSTUMatchCfg):
            base = cfg.user_tower.input
            user = [base + s for s in CHANNEL_SUFFIXES] + ["contextual", "query_time"]
            item = [cfg.item_tower.input]
        else:
            user, item = [cfg.user_tower.input], [cfg.item_tower.input]
            if isinstance(cfg, DATCfg):
                user.append(cfg.user_tower.augment_input)
                item.append(cfg.item_tower.augment_input)
            if isinstance(cfg, MINDCfg):
                user.append(cfg.user_tower.history_input)

        def read(groups: list[str]) -> set[str]:
            return {
                m
                for g in groups
                if g in names
                for n in model.group(g).all_feature_names()
                for m in config.features_read(n)
            }

        return dict(zip(self.served_names(), (read(user), read(item))))

    def served(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """What an export serves for each row (no sampled items there): ``{"user_embedding":
        [B, D], "item_embedding": [B, D]}`` float32, the towers' outputs (normalized for cosine
        similarity): a user's is the query of an index of the items'. MIND serves
        ``"user_interests"`` ``[B, K * D]`` instead (K queries a user, zero past its count)."""
        d = self.dim
        item = logits[:, d : 2 * d].float()
        if self.interests:
            return {"user_interests": logits[:, 2 * d : (2 + self.interests) * d].float(), "item_embedding": item}
        return {"user_embedding": logits[:, :d].float(), "item_embedding": item}

    def predictions(
        self, logits: torch.Tensor, rows: Optional[int] = None, hard_negative_rows: Optional[torch.Tensor] = None
    ) -> dict[str, torch.Tensor]:
        """``{"positive_rank": [B] float32}``: each user's own item's rank among its scored items
        (the other items scoring as high or higher; NaN where a score is NaN or +inf, or the own
        item's not finite, which the evaluation then names by file and row; -inf marks no hard
        negative)."""
        if rows is None:
            raise ValueError("a retrieval model's predictions need the batch's rows (its sampled items follow them)")
        scores = self.scores(logits, rows, hard_negative_rows)
        own = scores.gather(1, self._own(scores)[:, None])
        rank = ((scores >= own).sum(1) - 1).float()  # a tie counts against the own item
        bad = torch.isnan(scores).any(1) | torch.isposinf(scores).any(1) | ~torch.isfinite(own[:, 0])
        return {"positive_rank": torch.where(bad, float("nan"), rank)}

    def metrics(
        self, predictions: dict[str, np.ndarray], labels: np.ndarray, groups: Optional[np.ndarray]
    ) -> dict[str, float]:
        """recall@k for each ``recall_at_k`` k: the share of rows whose own item ranks below k."""
        rank = predictions["positive_rank"]
        return {f"recall@{k}": float(np.mean(rank < k)) if len(rank) else float("nan") for k in self.top_k}
