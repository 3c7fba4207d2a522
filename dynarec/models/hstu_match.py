"""HSTUMatch: TorchEasyRec's two-tower retrieval over a user's history (``tzrec/models/hstu.py``
``HSTUMatch``, its ``HSTUMatchEncoder`` with the ``uih_preprocessor``), in
:mod:`dynarec.models.hstu`'s blocks; :class:`~dynarec.models.retrieval.Retrieval` scores it.

The user tower encodes a row's history alone (no candidate in the sequence)::

    token   = Linear(history row) + action_mlp(action encoding)          # the uih_preprocessor
    row     = [contexts | the U history tokens], timestamps [0.. | history]
    x       = dropout(positional(row, ages from the query time)); x = stack(x, causal mask)
    user    = postprocessor(x)[the row's last token]                    # zeros for an empty row

then a linear layer to ``output_dim`` (where > 0) and, for cosine similarity, an L2
normalization; the item tower is an MLP over each candidate's rows, the same after it. A
batch's rows each hold their positives (the candidate sequence); the sampled items follow the
rows, one candidate each. The model returns one row a candidate, ``[E, 2 * D]``: the row's user
(zeros for a sampled item) then the candidate's item — a positive's row is a query, scored by
``Retrieval`` against its own item and every sampled item (``_sim_with_sampler``'s layout with
each user repeated for each of its positives, as TorchEasyRec's ``repeat_interleave``). An export
serves :class:`HSTUMatchTowers`: a row's user and the item of its first candidate."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from dynarec.config.hstu import UIHEncoderCfg
from dynarec.config.schema import Config, HSTUMatchCfg
from dynarec.models.dlrm_hstu import positional_of, postprocessor_of, stu_stack_of
from dynarec.models.features import FeatureInputs
from dynarec.models.hstu import (
    ContextualProjection,
    SimpleActionEncoder,
    SimpleContextualizedMLP,
    hstu_valid_mask,
    oldest_first,
)
from dynarec.models.mlp import MLP

__all__ = ["HSTUMatch", "HSTUMatchTowers", "UIHEncoder"]


class UIHEncoder(nn.Module):
    """A user's history (and contexts) to one embedding ``[B, D]`` (module doc)."""

    def __init__(
        self, history_dim: int, cfg: UIHEncoderCfg, max_seq_len: int, num_contexts: int = 0, contextual_dim: int = 0
    ):
        super().__init__()
        stu, pe, action = cfg.stu, cfg.positional_encoder, cfg.action_encoder
        dim = stu.embedding_dim
        self.num_contexts = num_contexts
        self.projection = nn.Linear(history_dim, dim)
        self.contexts = ContextualProjection(num_contexts, contextual_dim, dim) if num_contexts else None
        self.action_encoder = (
            SimpleActionEncoder(action.action_embedding_dim, action.action_weights, with_targets=False)
            if action
            else None
        )
        self.action_mlp = None
        if self.action_encoder is not None and cfg.action_mlp_hidden_dim is not None:
            self.action_mlp = SimpleContextualizedMLP(self.action_encoder.output_dim, cfg.action_mlp_hidden_dim, dim)
        self.positional = positional_of(pe, dim, num_contexts)
        self.input_dropout_ratio = cfg.input_dropout_ratio
        self.stack = stu_stack_of(stu, cfg.attn_num_layers, max_seq_len)
        self.max_attn_len = stu.max_attn_len
        self.postprocessor = postprocessor_of(cfg.postprocessor, dim)

    def forward(
        self,
        history: torch.Tensor,
        lengths: torch.Tensor,
        timestamps: Optional[torch.Tensor] = None,
        actions: Optional[torch.Tensor] = None,
        contextual: Optional[torch.Tensor] = None,
        query_time: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``history [B, Lu, history_dim]`` (row b's first ``lengths[b]``), its ``timestamps
        [B, Lu]`` float32 seconds and ``actions [B, Lu]`` int64 bitmasks, ``contextual [B, c * f]``,
        ``query_time [B]`` (None: each row's newest history token's time) -> ``[B, D]``."""
        b, lu = history.shape[:2]
        x = self.projection(history)
        if self.action_encoder is not None and self.action_mlp is not None:
            assert actions is not None, "the action encoder needs the history's actions"
            x = x + self.action_mlp(self.action_encoder(actions))
        c = self.num_contexts
        if self.contexts is not None:
            assert contextual is not None, "contextual tokens need the contextual features"
            x = torch.cat([self.contexts(contextual).to(x.dtype), x], dim=1)
        ts = timestamps if timestamps is not None else x.new_zeros(b, lu)
        ts = torch.cat([ts.new_zeros(b, c), ts.float()], dim=1)  # the contexts' times are 0
        total = lengths + c
        none = torch.zeros_like(total)  # no candidate in the sequence
        x = self.positional(x, total, none, ts, query_time)
        x = F.dropout(x, self.input_dropout_ratio, self.training)
        x = self.stack(x, hstu_valid_mask(total, none, c, x.shape[1], self.max_attn_len))
        x = self.postprocessor(x, ts)
        last = x[torch.arange(b, device=x.device), (total - 1).clamp(min=0)]
        return last * (total > 0)[:, None].to(last.dtype)


class HSTUMatch(nn.Module):
    """HSTUMatch (module doc)."""

    # Its rows are the batch's candidates (data-dependent), gathered by a mask: no CUDA graph.
    capturable = False

    def __init__(self, config: Config, cfg: HSTUMatchCfg):
        super().__init__()
        self.inputs = inputs = FeatureInputs(config)
        groups = {g.group_name: list(g.feature_names) for g in config.model.feature_groups}
        base = cfg.user_tower.input
        self.history = groups[base]
        # the history's times (TorchEasyRec's uih_preprocessor reads them whenever given): the time
        # buckets and a timestamp postprocessor read them
        self.time = groups[base + "_timestamp"][0] if base + "_timestamp" in groups else None
        self.actions = groups[base + "_action"][0] if cfg.user_tower.hstu.action_encoder is not None else None
        self.newest_first = not cfg.sequence_timestamp_is_ascending
        self.contextual = groups.get("contextual", [])
        self.query_time = groups.get("query_time", [None])[0]
        if self.query_time is not None and inputs[self.query_time].width != 1:
            raise ValueError(
                f"hstu_match: group 'query_time' holds one number a row (the request time); feature "
                f"'{self.query_time}' gives {inputs[self.query_time].width}"
            )
        self.candidates = groups[cfg.item_tower.input]
        widths = {inputs[n].width for n in self.contextual}
        if len(widths) > 1:
            raise ValueError(
                "hstu_match: the contextual features become one token each and must share one width, got "
                f"{ {n: inputs[n].width for n in self.contextual} }"
            )
        self.user_tower = UIHEncoder(
            sum(inputs[n].width for n in self.history),
            cfg.user_tower.hstu,
            cfg.user_tower.max_seq_len,
            len(self.contextual),
            widths.pop() if widths else 0,
        )
        dim = cfg.user_tower.hstu.stu.embedding_dim
        tower = cfg.item_tower
        candidate_dim = sum(inputs[n].width for n in self.candidates)
        self.item_mlp = MLP(
            candidate_dim, tower.hidden_units, tower.activation, tower.dropout_ratio, batch_norm=tower.use_bn
        )
        self.user_output = nn.Linear(dim, cfg.output_dim) if cfg.output_dim > 0 else None
        self.item_output = nn.Linear(self.item_mlp.out_dim, cfg.output_dim) if cfg.output_dim > 0 else None
        item_dim = cfg.output_dim or self.item_mlp.out_dim
        if item_dim != (cfg.output_dim or dim):
            raise ValueError(
                f"model.hstu_match: the user tower gives {cfg.output_dim or dim} numbers, the item tower {item_dim}; "
                "set output_dim, or end item_tower.hidden_units at the STU's embedding_dim"
            )
        self.cosine = cfg.similarity == "cosine"

    def _number(self, name: Optional[str], embeddings, dense) -> Optional[torch.Tensor]:
        """A one-number-an-element sequence ``[B, L]`` (or a one-number row ``[B]``), or None."""
        if name is None:
            return None
        if self.inputs[name].kind in ("sequence", "dense_sequence"):
            return self.inputs.positions(name, embeddings, dense)[..., 0]
        return self.inputs.pooled(name, embeddings, {}, dense)[:, 0]

    def users(self, embeddings, seq_lengths, dense) -> torch.Tensor:
        """``[B, D]``: each row's user (module doc)."""
        history = self.inputs.concatenated(self.history, embeddings, dense)
        actions = self._number(self.actions, embeddings, dense)
        contextual = None
        if self.contextual:
            contextual = torch.cat([self.inputs.pooled(n, embeddings, seq_lengths, dense) for n in self.contextual], 1)
        query_time = self._number(self.query_time, embeddings, dense)
        lengths = seq_lengths[self.history[0]]
        times = self._number(self.time, embeddings, dense)
        if self.newest_first:  # the data's histories newest first: each row's read in reverse
            history, times, actions = (
                oldest_first(history, lengths),
                oldest_first(times, lengths),
                oldest_first(actions, lengths),
            )
        user = self.user_tower(
            history,
            lengths,
            times,
            None if actions is None else actions.round().long(),
            contextual,
            None if query_time is None else query_time.float(),
        )
        return self._embedding(user, self.user_output)

    def items(self, candidates: torch.Tensor) -> torch.Tensor:
        """``[E, D]``: the item tower over candidates' rows ``[E, candidate_dim]``."""
        return self._embedding(self.item_mlp(candidates), self.item_output)

    def _embedding(self, x: torch.Tensor, output: Optional[nn.Linear]) -> torch.Tensor:
        """A tower's output: its linear map to ``output_dim`` (where there is one), normalized for
        cosine similarity."""
        if output is not None:
            x = output(x)
        return F.normalize(x, p=2.0, dim=-1, eps=1e-6) if self.cosine else x

    def forward(self, embeddings, seq_lengths, dense, rows: Optional[int] = None) -> torch.Tensor:
        """``[E, 2 * D]``: a row a candidate of the batch, in row order (module doc); ``rows``: the
        batch's rows (the sampled items after them)."""
        candidates = self.inputs.concatenated(self.candidates, embeddings, dense)
        lengths = seq_lengths[self.candidates[0]]
        total = candidates.shape[0]
        rows = total if rows is None else rows
        valid = torch.arange(candidates.shape[1], device=lengths.device)[None, :] < lengths[:, None]
        item = self.items(candidates[valid])
        owner = torch.repeat_interleave(torch.arange(total, device=lengths.device), lengths)
        if rows == 0:
            return torch.cat([torch.zeros_like(item), item], dim=1)
        user = self.users(*[{k: v[:rows] for k, v in d.items()} for d in (embeddings, seq_lengths, dense)])
        query = user[owner.clamp(max=rows - 1)] * (owner < rows)[:, None].to(user.dtype)
        return torch.cat([query, item], dim=1)

    def serving(self) -> nn.Module:
        """What an export serves: :class:`HSTUMatchTowers` over this model's weights."""
        return HSTUMatchTowers(self)


class HSTUMatchTowers(nn.Module):
    """HSTUMatch's two towers a row, what an export serves: ``[B, 2 * D]``, each row's user (its
    history; as in training) then the item of its first candidate (zeros without one) — over a
    table of users the queries, over a table of items (a candidate each) an item index, whose
    inner products are the trained model's scores times the temperature."""

    def __init__(self, model: HSTUMatch):
        super().__init__()
        self.model = model

    def forward(self, embeddings, seq_lengths, dense) -> torch.Tensor:
        m = self.model
        user = m.users(embeddings, seq_lengths, dense)
        candidates = m.inputs.concatenated(m.candidates, embeddings, dense)
        if candidates.shape[1] == 0:
            return torch.cat([user, torch.zeros_like(user)], dim=1)
        has = (seq_lengths[m.candidates[0]] > 0)[:, None]
        item = m.items(candidates[:, 0]) * has.to(user.dtype)
        return torch.cat([user, item], dim=1)
