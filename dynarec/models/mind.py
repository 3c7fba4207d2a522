"""MIND: multi-interest network with dynamic routing (Li et al. 2019; TorchEasyRec's ``MIND``).

The user tower turns the user's behaviour sequence into up to ``K`` interest vectors with a
capsule layer (:class:`CapsuleLayer`, TorchEasyRec's ``CapsuleLayer``: B2I dynamic routing), joins
each to the user's own vector and maps it to ``D`` = ``output_dim``. The item tower is DSSM's.
In training and evaluation each user's embedding is the label-aware attention of its interests
over its own item: ``softmax_k(simi_pow * <interest_k, item>)``-weighted sum over the valid
interests, scored by :class:`~dynarec.models.retrieval.Retrieval` as DSSM's (the sampled items,
or in-batch negatives). A row is ``[user embedding (D) | item (D) | interests (K * D)]``, the
interests zero where a user has fewer than ``K``; an export serves the interests and the item.

Routing starts from random logits (``routing_init_method: normal``). In training they are drawn
afresh for every batch from torch's global generator, as TorchEasyRec draws them; in evaluation,
export and serving they are one fixed draw (a buffer of the model, saved with it), so a row's
interests depend on that row alone and the served interests equal the evaluated ones.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dynarec.config.schema import CapsuleCfg, Config, MINDCfg, MLPCfg
from dynarec.models.blocks import MLP, DeepGroup, SequenceGroup
from dynarec.models.dssm import _Tower
from dynarec.models.features import FeatureInputs

__all__ = ["MIND", "CapsuleLayer"]


def _lengths_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, width]`` bool: position ``j`` of row ``b`` is below ``lengths[b]`` (any real dtype)."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


class CapsuleLayer(nn.Module):
    """Behaviour-to-interest dynamic routing: ``([B, L, low_dim] sequence, [B] lengths) ->
    ([B, max_k, high_dim] interests, [B, max_k] bool mask)``; invalid interests are zero."""

    def __init__(self, cfg: CapsuleCfg, low_dim: int):
        super().__init__()
        self.cfg = cfg
        self.bilinear = nn.Parameter(torch.randn(low_dim, cfg.high_dim))
        # The routing logits' start in eval mode (module doc): one draw, saved with the model.
        self.register_buffer("eval_routing_logits", torch.randn(cfg.max_seq_len, cfg.max_k))

    def squash(self, x: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(1e-7)
        sq = norm.square()
        return (sq / (1 + sq)).pow(self.cfg.squash_pow) / norm * x

    def _initial_logits(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        shape = (batch, cfg.max_seq_len, cfg.max_k)
        if cfg.routing_init_method == "zeros":
            return like.new_zeros(shape)
        if self.training:
            return torch.randn(shape, device=like.device, dtype=like.dtype)
        start = self.get_buffer("eval_routing_logits")
        return start.to(like.dtype).expand(shape)

    def forward(self, sequence: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        batch = sequence.shape[0]
        # cut or zero-pad to max_seq_len, with no branch on the batch's longest sequence (an
        # export keeps that length dynamic)
        sequence = F.pad(sequence, (0, 0, 0, cfg.max_seq_len))[:, : cfg.max_seq_len]
        seq_mask = _lengths_mask(lengths, cfg.max_seq_len)
        sequence = sequence * seq_mask[..., None].to(sequence.dtype)
        if cfg.const_caps_num:
            num_interests = torch.full_like(lengths, cfg.max_k, dtype=torch.float32)
        else:
            num_interests = torch.log2(lengths.float()).clamp(max=cfg.max_k).clamp(min=1.0)
        capsule_mask = _lengths_mask(num_interests, cfg.max_k)  # [B, K]
        # -inf on the logits of the interests a user does not have, +inf (no bound) elsewhere.
        bound = torch.where(capsule_mask, float("inf"), float("-inf"))[:, None, :]

        logits = (self._initial_logits(batch, sequence) * cfg.routing_logits_stddev).detach()
        low = torch.einsum("bsl,lh->bsh", sequence, self.bilinear)
        low_detached = low.detach()
        low_direction = F.normalize(low_detached, p=2.0, dim=-1)
        valid = seq_mask[..., None].to(sequence.dtype)
        interests = low.new_zeros(batch, cfg.max_k, cfg.high_dim)
        for i in range(cfg.num_iters):
            weights = torch.softmax(torch.minimum(logits, bound) * cfg.routing_logits_scale, dim=2) * valid
            if i + 1 < cfg.num_iters:
                # TorchEasyRec's routing: the next logits are these weights plus the agreement.
                high = torch.einsum("bsh,bsk->bkh", low_detached, weights)
                logits = weights + torch.einsum("bkh,bsh->bsk", high, low_direction)
            else:
                interests = self.squash(torch.einsum("bsh,bsk->bkh", low, weights))
        return interests * capsule_mask[..., None].to(interests.dtype), capsule_mask


def _mlp_then_linear(in_dim: int, cfg: MLPCfg, bias: bool) -> nn.Module:
    """TorchEasyRec's MIND MLPs: ``hidden_units[:-1]`` as an MLP (its first dropout ratio on
    every layer), then a linear layer to ``hidden_units[-1]``."""
    *hidden, last = cfg.hidden_units
    if not hidden:
        return nn.Linear(in_dim, last, bias=bias)
    mlp = MLP(in_dim, hidden, cfg.activation, cfg.dropout_ratio[:1], batch_norm=cfg.use_bn, bias=bias)
    return nn.Sequential(mlp, nn.Linear(mlp.out_dim, last, bias=bias))


class _UserTower(nn.Module):
    """``[B, K, D]`` interests (zero past a user's count, L2-normalized for cosine similarity)
    and their ``[B, K]`` mask."""

    def __init__(self, config: Config, cfg: MINDCfg, inputs: FeatureInputs):
        super().__init__()
        tower = cfg.user_tower
        self.group = DeepGroup(config, config.model.group(tower.input), inputs)
        user_mlp = MLPCfg(
            hidden_units=tower.hidden_units,
            activation=tower.activation,
            use_bn=tower.use_bn,
            dropout_ratio=tower.dropout_ratio,
        )
        self.user_mlp = _mlp_then_linear(self.group.out_dim, user_mlp, bias=True)
        where = f"model.mind.user_tower.history_input (group '{tower.history_input}')"
        history = config.model.group(tower.history_input)
        self.history = SequenceGroup(where, history.feature_names, inputs, need_query=False)
        low_dim = self.history.dim
        self.hist_mlp: Optional[nn.Module] = None
        if tower.hist_seq_mlp is not None:
            self.hist_mlp = _mlp_then_linear(low_dim, tower.hist_seq_mlp, bias=False)
            low_dim = tower.hist_seq_mlp.hidden_units[-1]
        self.capsules = CapsuleLayer(tower.capsule, low_dim)
        concat = tower.concat_mlp
        self.concat_mlp = MLP(
            tower.hidden_units[-1] + tower.capsule.high_dim,
            concat.hidden_units,
            concat.activation,
            concat.dropout_ratio,
            batch_norm=concat.use_bn,
            bias=concat.bias,
        )
        self.output = nn.Linear(self.concat_mlp.out_dim, cfg.output_dim, bias=False) if cfg.output_dim else None
        self.out_dim = cfg.output_dim or self.concat_mlp.out_dim
        self.cosine = cfg.similarity == "cosine"

    def forward(self, embeddings, seq_lengths, dense) -> tuple[torch.Tensor, torch.Tensor]:
        user = self.user_mlp(self.group(embeddings, seq_lengths, dense))
        _, sequence, lengths = self.history(embeddings, seq_lengths, dense)
        if self.hist_mlp is not None:
            sequence = self.hist_mlp(sequence)
        capsules, mask = self.capsules(sequence, lengths)
        keep = mask[..., None].to(capsules.dtype)
        joined = torch.cat([user[:, None, :].expand(-1, capsules.shape[1], -1), capsules], dim=-1) * keep
        interests = self.concat_mlp(joined) * keep
        if self.output is not None:
            interests = self.output(interests)
        return (F.normalize(interests, p=2.0, dim=-1) if self.cosine else interests), mask


class MIND(nn.Module):
    """``[R, 2 * D + K * D]`` rows (module doc)."""

    def __init__(self, config: Config, cfg: MINDCfg):
        super().__init__()
        self.inputs = FeatureInputs(config)
        self.user_tower = _UserTower(config, cfg, self.inputs)
        self.item_tower = _Tower(config, cfg.item_tower, cfg.output_dim, cfg.similarity == "cosine", self.inputs)
        self.simi_pow = cfg.simi_pow
        if self.user_tower.out_dim != self.item_tower.out_dim:
            raise ValueError(
                f"model.mind: the user tower's interests have {self.user_tower.out_dim} numbers, the item tower "
                f"gives {self.item_tower.out_dim}; set output_dim, or end concat_mlp and the item tower alike"
            )

    def label_aware(self, interests: torch.Tensor, mask: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        """``[B, D]``: each user's interests mixed by ``softmax(simi_pow * <interest, item>)``
        over its valid interests (``item`` ``[B, D]``: each user's own item)."""
        scores = torch.einsum("bkd,bd->bk", interests, item).masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores * self.simi_pow, dim=1)
        return torch.einsum("bk,bkd->bd", weights, interests)

    def forward(self, embeddings, seq_lengths, dense, rows: Optional[int] = None) -> torch.Tensor:
        """``rows``: the rows that are users (the rest are sampled items, whose user parts are
        zeros); the user tower reads those alone."""
        item, _ = self.item_tower(embeddings, seq_lengths, dense)
        total = item.shape[0]
        rows = total if rows is None else rows
        if rows != total:
            embeddings, seq_lengths, dense = (
                {k: v[:rows] for k, v in d.items()} for d in (embeddings, seq_lengths, dense)
            )
        interests, mask = self.user_tower(embeddings, seq_lengths, dense)
        user = self.label_aware(interests, mask, item[:rows])
        users = torch.cat([user, interests.flatten(1)], dim=1)
        if rows != total:
            users = F.pad(users, (0, 0, 0, total - rows))
        d = item.shape[1]
        return torch.cat([users[:, :d], item, users[:, d:]], dim=1)
