"""HSTU — Hierarchical Sequential Transduction Units (Zhai et al., "Actions Speak Louder than
Words", 2024) — as TorchEasyRec's generative rankers build it (``tzrec/modules/gr/``): the STU
layer and its target-aware attention mask, positional and time encodings, contextual tokens,
action encodings, the contextualized MLPs and the candidates' postprocessors.

The math is TorchEasyRec's PyTorch reference path (``kernel: PYTORCH``; its Triton and CUTLASS
kernels are tested against it). Sequences are padded here, ``[B, N, ...]`` with each row's
length, where TorchEasyRec keeps them jagged: padding never reaches a valid token (it is masked
out of every attention and dropped from every output).

A row of the sequence the STU stack reads is ``[c contextual tokens | the user's history (UIH),
oldest first | the candidates]``, of length ``L = c + U + T``; ``num_targets`` is ``T``.
"""

from __future__ import annotations

import math
from typing import Optional, overload

import torch
import torch.nn.functional as F
from torch import nn

from dynarec.models.mlp import MLP

__all__ = [
    "ContextualProjection",
    "FusionMTLTower",
    "HSTUPositionalEncoder",
    "HSTUTransducer",
    "L2NormPostprocessor",
    "LayerNormPostprocessor",
    "STULayer",
    "STUStack",
    "SimpleActionEncoder",
    "SimpleContextualizedMLP",
    "SwishLayerNorm",
    "TimestampLayerNormPostprocessor",
    "assemble_rows",
    "hstu_valid_mask",
    "oldest_first",
    "semi_local_mask",
    "take_candidates",
    "truncate_history",
]


def _positions(lengths: torch.Tensor, n: int) -> torch.Tensor:
    return torch.arange(n, device=lengths.device).expand(lengths.shape[0], n)


@overload
def oldest_first(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor: ...
@overload
def oldest_first(x: None, lengths: torch.Tensor) -> None: ...
def oldest_first(x: Optional[torch.Tensor], lengths: torch.Tensor) -> Optional[torch.Tensor]:
    """Each row's first ``lengths[b]`` positions of ``x`` ``[B, L, ...]`` in reverse (a history
    given newest first, read oldest first), the padding after them kept zero; None stays None."""
    if x is None:
        return None
    positions = torch.arange(x.shape[1], device=x.device)
    source = lengths[:, None] - 1 - positions[None, :]  # [B, L]
    valid = source >= 0
    index = source.clamp(min=0)
    taken = torch.gather(x, 1, index.view(*index.shape, *([1] * (x.dim() - 2))).expand_as(x))
    return taken * valid.view(*valid.shape, *([1] * (x.dim() - 2))).to(x.dtype)


def hstu_valid_mask(
    lengths: torch.Tensor, num_targets: torch.Tensor, num_contexts: int, n: int, max_attn_len: int = 0
) -> torch.Tensor:
    """``[B, n, n]`` bool: whether query ``i`` attends key ``j`` of each row (``lengths [B]``
    tokens, the last ``num_targets [B]`` of them candidates, the first ``num_contexts`` contextual).

    TorchEasyRec's causal, target-aware mask: positions map to ids (every contextual token 0,
    the UIH 1, 2, ..., every candidate and padding the next id); a query sees keys of strictly
    smaller id and itself; contextual queries see every contextual and UIH key; with
    ``max_attn_len`` > 0 only keys less than that many ids back. So a UIH token sees the
    contexts and the history up to itself, a candidate the contexts, the whole history and
    itself — never another candidate — and a contextual token the contexts and the whole
    history. Keys and queries past a row's length are never valid."""
    pos = _positions(lengths, n)
    c = num_contexts
    if c > 0:
        ids = (pos - c + 1).clamp(min=0)
        max_ids = lengths - c + 1
    else:
        ids = pos
        max_ids = lengths
    max_ids = (max_ids - num_targets)[:, None]
    ids = torch.minimum(ids, max_ids)
    diff = ids[:, :, None] - ids[:, None, :]
    earlier = diff > 0
    if max_attn_len > 0:
        earlier = earlier & (diff <= max_attn_len)
    valid = earlier | torch.eye(n, dtype=torch.bool, device=lengths.device)
    if c > 0:
        valid = valid | ((ids[:, :, None] == 0) & (ids[:, None, :] < max_ids[:, :, None]))
    inside = pos < lengths[:, None]
    return valid & inside[:, :, None] & inside[:, None, :]


class STULayer(nn.Module):
    """One STU layer (TorchEasyRec's ``STULayer``, ``causal`` and ``target_aware``) on padded
    tokens ``x [B, N, D]``::

        u, v, q, k = split(layer_norm(x) @ Wuvqk + b)      # u: SiLU; v, q, k: linear
        attn = (silu(alpha q k^T) / scaling_seqlen * mask) @ v   # per head; no softmax
        y = cat[u, attn, u * norm(attn)]                   # norm: per-head group norm, or layer norm
        x + dropout(y) @ Wout

    ``scaling_seqlen`` is the model's ``max_seq_len`` — a constant, not the row's length; alpha
    is ``attn_alpha`` or ``1 / sqrt(attention_dim)``. Norms compute in float32 (eps 1e-6)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        hidden_dim: int,
        attention_dim: int,
        scaling_seqlen: int,
        output_dropout_ratio: float = 0.3,
        use_group_norm: bool = False,
        attn_alpha: Optional[float] = None,
    ):
        super().__init__()
        self.num_heads, self.hidden_dim, self.attention_dim = num_heads, hidden_dim, attention_dim
        self.scaling_seqlen = scaling_seqlen
        self.alpha = attn_alpha or 1.0 / math.sqrt(attention_dim)
        self.output_dropout_ratio = output_dropout_ratio
        self.use_group_norm = use_group_norm
        width = (2 * hidden_dim + 2 * attention_dim) * num_heads
        self.uvqk_weight = nn.Parameter(torch.empty(dim, width))
        self.uvqk_bias = nn.Parameter(torch.zeros(width))
        self.input_norm_weight = nn.Parameter(torch.ones(dim))
        self.input_norm_bias = nn.Parameter(torch.zeros(dim))
        self.output_weight = nn.Parameter(torch.empty(3 * hidden_dim * num_heads, dim))
        norm_width = num_heads if use_group_norm else hidden_dim * num_heads
        self.output_norm_weight = nn.Parameter(torch.ones(norm_width))
        self.output_norm_bias = nn.Parameter(torch.zeros(norm_width))
        nn.init.xavier_uniform_(self.uvqk_weight)
        nn.init.xavier_uniform_(self.output_weight)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x [B, N, D]``, ``mask [B, N, N]`` bool (:func:`hstu_valid_mask`) -> ``[B, N, D]``."""
        b, n, d = x.shape
        h, dh, da = self.num_heads, self.hidden_dim, self.attention_dim
        normed = F.layer_norm(x.float(), (d,), self.input_norm_weight.float(), self.input_norm_bias.float(), 1e-6)
        uvqk = normed.to(x.dtype) @ self.uvqk_weight.to(x.dtype) + self.uvqk_bias.to(x.dtype)
        u, v, q, k = torch.split(uvqk, [h * dh, h * dh, h * da, h * da], dim=-1)
        u = F.silu(u)
        q = q.view(b, n, h, da).transpose(1, 2)
        k = k.view(b, n, h, da).transpose(1, 2)
        v = v.view(b, n, h, dh).transpose(1, 2)
        scores = F.silu(self.alpha * (q @ k.transpose(-1, -2))) / self.scaling_seqlen
        scores = scores * mask[:, None].to(scores.dtype)
        attn = (scores @ v).transpose(1, 2).reshape(b, n, h * dh)
        if self.use_group_norm:
            flat = attn.float().reshape(b * n, h, dh)
            w, bias = self.output_norm_weight.float(), self.output_norm_bias.float()
            normed_attn = F.group_norm(flat, h, w, bias, 1e-6).view(b, n, h * dh)
        else:
            w, bias = self.output_norm_weight.float(), self.output_norm_bias.float()
            normed_attn = F.layer_norm(attn.float(), (h * dh,), w, bias, 1e-6)
        y = torch.cat([u, attn, u * normed_attn.to(u.dtype)], dim=-1)
        y = F.dropout(y, self.output_dropout_ratio, self.training)
        return x + y @ self.output_weight.to(x.dtype)


class STUStack(nn.ModuleList):
    """STU layers applied in turn, each with its own weights, under one mask."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x, mask)
        return x


class HSTUPositionalEncoder(nn.Module):
    """Scales tokens by ``sqrt(D)`` and adds a position and a time embedding (TorchEasyRec's
    ``HSTUPositionalEncoder``).

    Positions count back from the newest UIH token (``c + 1``) to the oldest (``c + U``), every
    candidate at ``c``, contextual tokens at ``0 .. c - 1``, clamped to the last bucket. With
    ``use_time_encoding`` a token's time bucket comes from its age against the row's query time
    (its last token's timestamp: the last candidate's query time):
    ``int(clamp(f(max(qt - ts, 1e-6) / increments) / num_time_buckets, 0, 1) * num_time_buckets)``,
    ``f`` sqrt or log (``query_time [B]`` given: the row's age anchor instead, HSTUMatch's request
    time). Without it the position is the token's index, clamped to ``L - T``."""

    def __init__(
        self,
        dim: int,
        num_position_buckets: int,
        num_contexts: int,
        num_time_buckets: int = 0,
        use_time_encoding: bool = False,
        time_bucket_fn: str = "sqrt",
        time_bucket_increments: float = 60.0,
    ):
        super().__init__()
        if time_bucket_fn not in ("sqrt", "log"):
            raise ValueError(f"time_bucket_fn must be 'sqrt' or 'log', got {time_bucket_fn!r}")
        self.dim, self.num_contexts = dim, num_contexts
        self.num_position_buckets, self.num_time_buckets = num_position_buckets, num_time_buckets
        self.use_time_encoding = use_time_encoding
        self.time_bucket_fn, self.time_bucket_increments = time_bucket_fn, time_bucket_increments
        bound = math.sqrt(1.0 / num_position_buckets)
        self.position_embeddings = nn.Parameter(torch.empty(num_position_buckets, dim).uniform_(-bound, bound))
        if use_time_encoding:
            bound = math.sqrt(1.0 / num_time_buckets)
            self.time_embeddings = nn.Parameter(torch.empty(num_time_buckets + 1, dim).uniform_(-bound, bound))

    def buckets(
        self,
        lengths: torch.Tensor,
        num_targets: torch.Tensor,
        timestamps: torch.Tensor,
        query_time: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(position [B, N], time [B, N] or None)`` bucket of every token (``timestamps
        [B, N]`` float32 seconds; ``query_time [B]``: the ages' anchor, default each row's last
        token's time)."""
        n = timestamps.shape[1]
        j = _positions(lengths, n)
        high = (lengths - num_targets)[:, None]
        c = self.num_contexts
        if not self.use_time_encoding:
            return torch.minimum(j, high.clamp(max=self.num_position_buckets - 1)), None
        pos = (high - torch.minimum(j, high) + c).clamp(max=self.num_position_buckets - 1)
        pos = torch.where(j < c, j, pos)
        if query_time is None:
            query_time = timestamps.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
        dt = (query_time[:, None] - timestamps).clamp(min=1e-6) / self.time_bucket_increments
        f = torch.sqrt(dt) if self.time_bucket_fn == "sqrt" else torch.log(dt)
        nt = self.num_time_buckets
        time = ((f / nt).clamp(0.0, 1.0) * nt).long()
        return pos, time

    def forward(
        self,
        x: torch.Tensor,
        lengths: torch.Tensor,
        num_targets: torch.Tensor,
        timestamps: torch.Tensor,
        query_time: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``x [B, N, D]`` -> ``[B, N, D]``."""
        pos, time = self.buckets(lengths, num_targets, timestamps, query_time)
        out = x * math.sqrt(self.dim) + self.position_embeddings[pos].to(x.dtype)
        if time is not None:
            out = out + self.time_embeddings[time].to(x.dtype)
        return out


class SwishLayerNorm(nn.Module):
    """``x * sigmoid(layer_norm(x))`` (eps 1e-5, the norm in float32)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(x.float(), self.norm.normalized_shape, self.norm.weight, self.norm.bias, 1e-5)
        return x * torch.sigmoid(normed).to(x.dtype)


def _xavier_linear(n_in: int, n_out: int) -> nn.Linear:
    linear = nn.Linear(n_in, n_out)
    nn.init.xavier_uniform_(linear.weight)
    nn.init.zeros_(linear.bias)
    return linear


class SimpleContextualizedMLP(nn.Sequential):
    """TorchEasyRec's ``simple_mlp``: ``Linear(in, hidden) -> SwishLayerNorm -> Linear(hidden,
    out) -> LayerNorm(out)`` (Linear layers Xavier-uniform, zero bias)."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int):
        super().__init__(
            _xavier_linear(in_dim, hidden_dim),
            SwishLayerNorm(hidden_dim),
            _xavier_linear(hidden_dim, out_dim),
            nn.LayerNorm(out_dim, eps=1e-5),
        )


class ContextualProjection(nn.Module):
    """``c`` contextual features of ``f`` numbers each, a token of ``D`` each: token ``i`` is
    feature ``i`` times its own ``W[i] [f, D]`` plus ``b[i]`` (``W ~ N(0, sqrt(2 / (f + D)))``,
    ``b = 0``)."""

    def __init__(self, num_contexts: int, feature_dim: int, dim: int):
        super().__init__()
        self.num_contexts, self.feature_dim = num_contexts, feature_dim
        std = math.sqrt(2.0 / (feature_dim + dim))
        self.weight = nn.Parameter(torch.empty(num_contexts, feature_dim, dim).normal_(0.0, std))
        self.bias = nn.Parameter(torch.zeros(num_contexts, 1, dim))

    def forward(self, contextual: torch.Tensor) -> torch.Tensor:
        """``contextual [B, c * f]`` (the features concatenated in order) -> ``[B, c, D]``."""
        b = contextual.shape[0]
        x = contextual.view(b, self.num_contexts, self.feature_dim).transpose(0, 1)
        return torch.baddbmm(self.bias.to(x.dtype), x, self.weight.to(x.dtype)).transpose(0, 1)


class SimpleActionEncoder(nn.Module):
    """Actions as embeddings (TorchEasyRec's ``simple_action_encoder``): a history token's action
    bitmask sets slot ``k`` to ``E[k] [a]`` where its bit ``action_weights[k]`` is on (zeros
    elsewhere), ``[K * a]`` in all; every candidate gets one learned vector ``[K * a]``
    (``with_targets``: a sequence without candidates has none). Both tables ``~ N(0, 0.1)``."""

    action_weights: torch.Tensor

    def __init__(self, action_embedding_dim: int, action_weights: list[int], with_targets: bool = True):
        super().__init__()
        self.register_buffer("action_weights", torch.tensor(action_weights, dtype=torch.int64), persistent=False)
        k = len(action_weights)
        self.output_dim = k * action_embedding_dim
        self.action_embeddings = nn.Parameter(torch.empty(k, action_embedding_dim).normal_(0.0, 0.1))
        # (an unread parameter would stall a multi-process step: DDP waits for its gradient)
        self.target_action_embedding = (
            nn.Parameter(torch.empty(1, self.output_dim).normal_(0.0, 0.1)) if with_targets else None
        )

    def forward(self, actions: torch.Tensor) -> torch.Tensor:
        """``actions [...]`` int64 bitmasks -> ``[..., K * a]``."""
        bits = (actions[..., None] & self.action_weights) > 0
        out = bits[..., None].to(self.action_embeddings.dtype) * self.action_embeddings
        return out.flatten(-2)

    def targets(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The candidates' action encoding, ``[*shape, K * a]``."""
        assert self.target_action_embedding is not None, "this action encoder encodes no candidate"
        return self.target_action_embedding.view(*(1 for _ in shape), -1).expand(*shape, -1)


def assemble_rows(
    contexts: torch.Tensor,
    history: torch.Tensor,
    history_lengths: torch.Tensor,
    candidates: torch.Tensor,
    num_targets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's sequence ``[contexts | its U history tokens | its T candidates]``, padded:
    ``(tokens [B, N, ...], lengths [B])`` with ``N = c + max(U + T)``.

    ``contexts [B, c, ...]``, ``history [B, Lu, ...]`` (row b's first ``history_lengths[b]``
    valid), ``candidates [B, Lt, ...]`` (its first ``num_targets[b]`` valid); the trailing
    dims agree. Positions past a row's length hold zeros."""
    b, c = contexts.shape[:2]
    lu, lt = history.shape[1], candidates.shape[1]
    lengths = c + history_lengths + num_targets
    n = c + int((history_lengths + num_targets).max()) if b else c
    zero = torch.zeros_like(candidates[:, :1])
    pool = torch.cat([contexts, history, candidates, zero], dim=1)  # [B, c + Lu + Lt + 1, ...]
    j = _positions(lengths, n)
    u = history_lengths[:, None]
    src = torch.where(j < c + u, j, c + lu + (j - c - u))
    src = torch.where(j < lengths[:, None], src, c + lu + lt)  # past the row: the zero token
    index = src.view(b, n, *(1 for _ in pool.shape[2:])).expand(b, n, *pool.shape[2:])
    return pool.gather(1, index), lengths


def take_candidates(tokens: torch.Tensor, lengths: torch.Tensor, num_targets: torch.Tensor, lt: int) -> torch.Tensor:
    """Each row's last ``num_targets[b]`` tokens (its candidates), padded to ``lt``:
    ``[B, lt, ...]`` from ``tokens [B, N, ...]``; zeros past a row's candidates."""
    b, n = tokens.shape[:2]
    t = _positions(lengths, lt)
    src = (lengths - num_targets)[:, None] + t
    valid = t < num_targets[:, None]
    src = torch.where(valid, src, 0).clamp(max=max(n - 1, 0))
    index = src.view(b, lt, *(1 for _ in tokens.shape[2:])).expand(b, lt, *tokens.shape[2:])
    out = tokens.gather(1, index)
    return out * valid.view(b, lt, *(1 for _ in tokens.shape[2:])).to(out.dtype)


class LayerNormPostprocessor(nn.LayerNorm):
    """``layernorm_postprocessor``: a LayerNorm over ``D`` (eps 1e-5)."""

    def __init__(self, dim: int):
        super().__init__(dim, eps=1e-5)

    def forward(self, x: torch.Tensor, timestamps: Optional[torch.Tensor] = None) -> torch.Tensor:
        return super().forward(x)


class L2NormPostprocessor(nn.Module):
    """``l2norm_postprocessor``: ``x / max(||x||_2, 1e-6)``."""

    def forward(self, x: torch.Tensor, timestamps: Optional[torch.Tensor] = None) -> torch.Tensor:
        return x / x.norm(dim=-1, keepdim=True).clamp(min=1e-6)


class TimestampLayerNormPostprocessor(nn.Module):
    """``timestamp_layernorm_postprocessor``: each token's time of day and of week (or the given
    periods) as ``[cos a, sin a]`` per period, ``a = (floor(t / unit) mod per_period) /
    per_period * 2 * 3.14`` (3.14, as TorchEasyRec writes it), concatenated to the token, then
    ``Linear(D + 2P, D)`` (Xavier, zero bias) and a LayerNorm (eps 1e-5)."""

    period_units: torch.Tensor
    units_per_period: torch.Tensor

    def __init__(self, dim: int, time_duration_period_units: list[int], time_duration_units_per_period: list[int]):
        super().__init__()
        if len(time_duration_period_units) != len(time_duration_units_per_period):
            raise ValueError("time_duration_period_units and time_duration_units_per_period differ in length")
        self.register_buffer(
            "period_units", torch.tensor(time_duration_period_units, dtype=torch.float32), persistent=False
        )
        self.register_buffer(
            "units_per_period", torch.tensor(time_duration_units_per_period, dtype=torch.float32), persistent=False
        )
        self.linear = _xavier_linear(dim + 2 * len(time_duration_period_units), dim)
        self.norm = nn.LayerNorm(dim, eps=1e-5)

    def time_features(self, timestamps: torch.Tensor) -> torch.Tensor:
        """``timestamps [...]`` float32 seconds -> ``[..., 2P]``: ``cos, sin`` of each period's angle."""
        units = torch.div(timestamps[..., None], self.period_units, rounding_mode="floor")
        angle = torch.remainder(units, self.units_per_period) / self.units_per_period * 2 * 3.14
        return torch.stack([torch.cos(angle), torch.sin(angle)], dim=-1).flatten(-2)

    def forward(self, x: torch.Tensor, timestamps: Optional[torch.Tensor] = None) -> torch.Tensor:
        assert timestamps is not None, "the timestamp postprocessor needs the tokens' timestamps"
        features = self.time_features(timestamps).to(x.dtype)
        return self.norm(self.linear(torch.cat([x, features], dim=-1)))


class HSTUTransducer(nn.Module):
    """A user's history and candidates to one encoding a candidate (TorchEasyRec's
    ``HSTUTransducer`` with its ``contextual_preprocessor``, ``slice_content_encoder``,
    ``simple_mlp`` contextualized MLPs and no interleaving), on padded inputs::

        token   = content_mlp(content) + action_mlp(action)       # content: the history's rows, a candidate's
                                                                  # first history_dim numbers; action: the
                                                                  # history's bits, one learned candidate vector
        row     = [contexts | the U history tokens | the T candidates], timestamps [0.. | history | query times]
        x       = dropout(positional(row)); x = stack(x, target-aware mask)
        output  = postprocessor(x at the candidates, their timestamps)

    ``contextual_dim`` numbers a contextual feature (0: no contextual tokens); without an
    ``action_encoder`` tokens are their content alone."""

    def __init__(
        self,
        dim: int,
        history_dim: int,
        candidate_dim: int,
        content_hidden_dim: int,
        positional: HSTUPositionalEncoder,
        stack: STUStack,
        postprocessor: nn.Module,
        num_contexts: int = 0,
        contextual_dim: int = 0,
        action_encoder: Optional[SimpleActionEncoder] = None,
        action_hidden_dim: int = 0,
        input_dropout_ratio: float = 0.2,
        max_attn_len: int = 0,
        sla: tuple[int, int] = (0, 0),
        truncation: tuple[int, int] = (0, 0),
    ):
        """``sla``: ``(sla_k1, sla_k2)`` of :func:`semi_local_mask` for every layer (``(0, 0)``: the
        target-aware mask); ``truncation``: ``(split layer, tail)`` of :func:`truncate_history`
        before that layer (``(0, 0)``: none)."""
        super().__init__()
        if candidate_dim < history_dim:
            raise ValueError(
                f"the slice content encoder takes a candidate's first {history_dim} numbers: "
                f"its rows have {candidate_dim}"
            )
        self.history_dim, self.num_contexts = history_dim, num_contexts
        self.contexts = ContextualProjection(num_contexts, contextual_dim, dim) if num_contexts else None
        self.content_mlp = SimpleContextualizedMLP(history_dim, content_hidden_dim, dim)
        self.action_encoder = action_encoder
        self.action_mlp = (
            SimpleContextualizedMLP(action_encoder.output_dim, action_hidden_dim, dim) if action_encoder else None
        )
        self.positional, self.stack, self.postprocessor = positional, stack, postprocessor
        self.input_dropout_ratio, self.max_attn_len = input_dropout_ratio, max_attn_len
        self.sla, self.truncation = sla, truncation

    def _mask(self, lengths: torch.Tensor, num_targets: torch.Tensor, n: int) -> torch.Tensor:
        if any(self.sla):
            return semi_local_mask(lengths, num_targets, self.num_contexts, n, *self.sla)
        return hstu_valid_mask(lengths, num_targets, self.num_contexts, n, self.max_attn_len)

    def forward(
        self,
        history: torch.Tensor,
        history_lengths: torch.Tensor,
        history_timestamps: torch.Tensor,
        candidates: torch.Tensor,
        num_targets: torch.Tensor,
        candidate_timestamps: torch.Tensor,
        history_actions: Optional[torch.Tensor] = None,
        contextual: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``history [B, Lu, history_dim]`` (row b's first ``history_lengths[b]``), its
        ``history_timestamps [B, Lu]`` float32 seconds and ``history_actions [B, Lu]`` int64
        bitmasks; ``candidates [B, Lt, candidate_dim]`` (the first ``num_targets[b]``) and their
        query times ``[B, Lt]``; ``contextual [B, c * contextual_dim]`` -> ``[B, Lt, D]``, zeros
        past a row's candidates."""
        b, lt = candidates.shape[:2]
        content = self.content_mlp(torch.cat([history, candidates[..., : self.history_dim]], dim=1))
        if self.action_encoder is not None and self.action_mlp is not None:
            assert history_actions is not None, "the action encoder needs the history's actions"
            actions = torch.cat([self.action_encoder(history_actions), self.action_encoder.targets((b, lt))], dim=1)
            content = content + self.action_mlp(actions)
        lu = history.shape[1]
        tokens_h, tokens_c = content[:, :lu], content[:, lu:]
        c = self.num_contexts
        if self.contexts is not None:
            assert contextual is not None, "contextual tokens need the contextual features"
            contexts = self.contexts(contextual).to(content.dtype)
        else:
            contexts = content.new_zeros(b, 0, content.shape[-1])
        x, lengths = assemble_rows(contexts, tokens_h, history_lengths, tokens_c, num_targets)
        ts, _ = assemble_rows(
            history_timestamps.new_zeros(b, c, 1),
            history_timestamps[..., None],
            history_lengths,
            candidate_timestamps[..., None],
            num_targets,
        )
        ts = ts.squeeze(-1)
        x = self.positional(x, lengths, num_targets, ts)
        x = F.dropout(x, self.input_dropout_ratio, self.training)
        mask = self._mask(lengths, num_targets, x.shape[1])
        split, tail = self.truncation
        for i, layer in enumerate(self.stack):
            if split and i == split:  # from here on: the contexts, the newest history, the candidates
                x, lengths, _ = truncate_history(x, lengths, num_targets, c, tail)
                mask = self._mask(lengths, num_targets, x.shape[1])
            x = layer(x, mask)
        out = take_candidates(x, lengths, num_targets, lt)
        valid = (_positions(num_targets, lt) < num_targets[:, None])[..., None]
        return self.postprocessor(out, candidate_timestamps) * valid.to(out.dtype)


class FusionMTLTower(nn.Module):
    """TorchEasyRec's ``FusionMTLTower``: ``user * item`` (element-wise), an optional MLP, then
    one shared Linear emitting every task's logits, split in task order (``num_classes[i]``
    each). Every Linear Xavier-uniform with zero bias."""

    def __init__(
        self,
        dim: int,
        num_classes: list[int],
        hidden_units: tuple[int, ...] = (),
        activation: str = "silu",
        layer_norm: bool = False,
    ):
        super().__init__()
        self.mlp = MLP(dim, hidden_units, activation=activation, layer_norm=layer_norm) if hidden_units else None
        self.num_classes = list(num_classes)
        self.out = nn.Linear(self.mlp.out_dim if self.mlp is not None else dim, sum(num_classes))
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> list[torch.Tensor]:
        """``user``, ``item [..., D]`` -> one ``[..., num_classes[i]]`` per task."""
        x = user * item
        if self.mlp is not None:
            x = self.mlp(x)
        return list(torch.split(self.out(x), self.num_classes, dim=-1))


def semi_local_mask(
    lengths: torch.Tensor, num_targets: torch.Tensor, num_contexts: int, n: int, sla_k1: int, sla_k2: int
) -> torch.Tensor:
    """``[B, n, n]`` bool: Semi-Local Attention (UltraHSTU's ``sla_k1``, ``sla_k2``), replacing
    :func:`hstu_valid_mask` in every layer of a channel. A history query at position ``p`` (the
    contexts count as history) sees a global prefix of ``k2 = max(sla_k2, num_contexts)`` keys
    and a causal window of its last ``sla_k1`` keys, itself included:
    ``[0, min(p + 1, k2)) ∪ [max(p - sla_k1 + 1, k2), p + 1)``; a candidate sees the whole
    history, not itself nor another candidate. Keys and queries past a row's length never."""
    pos = _positions(lengths, n)
    history = (lengths - num_targets).clamp(min=0)[:, None, None]  # contexts and history: Hb
    q, k = pos[:, :, None], pos[:, None, :]
    k2 = max(sla_k2, num_contexts)
    prefix = k < torch.clamp(q + 1, max=k2)
    window = (k >= torch.clamp(q - sla_k1 + 1, min=k2)) & (k <= q)
    valid = torch.where(q < history, prefix | window, k < history)
    inside = pos < lengths[:, None]
    return valid & inside[:, :, None] & inside[:, None, :]


def truncate_history(
    x: torch.Tensor,
    lengths: torch.Tensor,
    num_targets: torch.Tensor,
    num_contexts: int,
    tail_len: int,
    *others: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """UltraHSTU's mid-stack truncation (``attn_truncation_tail_len``): each row keeps its
    contexts, its last ``tail_len`` history tokens (the oldest dropped) and every candidate.
    ``x [B, N, ...]`` and ``others`` (the tokens' timestamps, say: ``[B, N, ...]``) ->
    ``(x', lengths', others')``, padded to the longest kept row (zeros past a row)."""
    c = num_contexts
    history = lengths - c - num_targets
    dropped = (history - tail_len).clamp(min=0)
    kept = lengths - dropped
    n = int(kept.max()) if kept.numel() else 0
    j = _positions(lengths, n)
    src = torch.where(j < c, j, j + dropped[:, None])
    inside = j < kept[:, None]
    src = torch.where(inside, src, 0)

    def take(t: torch.Tensor) -> torch.Tensor:
        index = src.view(*src.shape, *(1 for _ in t.shape[2:])).expand(*src.shape, *t.shape[2:])
        out = t.gather(1, index)
        return out * inside.view(*inside.shape, *(1 for _ in t.shape[2:])).to(out.dtype)

    return take(x), kept, [take(t) for t in others]
