"""DlrmHSTU: TorchEasyRec's generative ranker (``tzrec/models/dlrm_hstu.py``), scoring every
candidate of a row from the user's history through HSTU (:mod:`dynarec.models.hstu`).

For each row: the contextual features become tokens, the history's items (``uih``) and the
candidates' (``candidate``) tokens of their content and actions; the STU stack encodes
``[contexts | history | candidates]`` under the target-aware mask (a candidate sees the history,
never another candidate), and each candidate's encoding, times its own item embedding (an MLP
over its rows), goes through the fusion tower to every task's logits. The model returns
``[C, width]``: the batch's ``C`` candidates, row after row, the tasks' logits side by side —
the rows :class:`~dynarec.models.tasks.Tasks` scores against a label a candidate.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from dynarec.config.hstu import (
    DlrmHSTUCfg,
    HSTUCfg,
    HSTUPostprocessorCfg,
    PositionalEncoderCfg,
    STUCfg,
    UltraHSTUCfg,
)
from dynarec.config.schema import Config
from dynarec.models.features import FeatureInputs
from dynarec.models.hstu import (
    FusionMTLTower,
    HSTUPositionalEncoder,
    HSTUTransducer,
    L2NormPostprocessor,
    LayerNormPostprocessor,
    SimpleActionEncoder,
    SimpleContextualizedMLP,
    STULayer,
    STUStack,
    TimestampLayerNormPostprocessor,
    oldest_first,
)

__all__ = ["DlrmHSTU", "positional_of", "postprocessor_of", "stu_stack_of"]


def positional_of(cfg: PositionalEncoderCfg, dim: int, num_contexts: int) -> HSTUPositionalEncoder:
    """The positional encoder of ``cfg`` for tokens of ``dim`` after ``num_contexts`` contexts."""
    return HSTUPositionalEncoder(
        dim,
        cfg.num_position_buckets,
        num_contexts,
        cfg.num_time_buckets,
        cfg.use_time_encoding,
        cfg.time_bucket_fn,
        cfg.time_bucket_increments,
    )


def stu_stack_of(stu: STUCfg, num_layers: int, max_seq_len: int) -> STUStack:
    """``num_layers`` STU layers of ``stu``'s sizes, scores divided by ``max_seq_len``."""
    return STUStack(
        [
            STULayer(
                stu.embedding_dim,
                stu.num_heads,
                stu.hidden_dim,
                stu.attention_dim,
                scaling_seqlen=max_seq_len,
                output_dropout_ratio=stu.output_dropout_ratio,
                use_group_norm=stu.use_group_norm,
                attn_alpha=stu.attn_alpha,
            )
            for _ in range(num_layers)
        ]
    )


def postprocessor_of(cfg: HSTUPostprocessorCfg, dim: int) -> nn.Module:
    """The tokens' postprocessor of ``cfg`` (``x [B, N, D]``, its timestamps ``[B, N]``)."""
    if cfg.kind == "timestamp_layernorm":
        return TimestampLayerNormPostprocessor(dim, cfg.time_duration_period_units, cfg.time_duration_units_per_period)
    return LayerNormPostprocessor(dim) if cfg.kind == "layernorm" else L2NormPostprocessor()


class _Channel:
    """A transducer's inputs: its history group's features, their timestamps and actions."""

    def __init__(self, groups: dict[str, list[str]], cfg: HSTUCfg):
        base = cfg.history_group
        self.history = groups[base]
        self.time = groups[base + "_timestamp"][0]
        self.actions = groups[base + "_action"][0] if cfg.action_encoder is not None else None


class DlrmHSTU(nn.Module):
    """DlrmHSTU (module doc); with several channels (``ultra_hstu``: TorchEasyRec's UltraHSTU, a
    mixture of transducers) each channel's transducer reads its own history and the shared
    candidates and contexts, and a candidate's encodings are concatenated."""

    # The rows and the attention's length change with every batch, and a batch's candidates are
    # picked by a mask: no CUDA graph holds it.
    capturable = False

    def __init__(self, config: Config, cfg: Union[DlrmHSTUCfg, UltraHSTUCfg]):
        super().__init__()
        self.inputs = FeatureInputs(config)
        groups = {g.group_name: list(g.feature_names) for g in config.model.feature_groups}
        self.candidates = groups["candidate"]
        self.candidate_time = groups["candidate_timestamp"][0]
        self.newest_first = not cfg.sequence_timestamp_is_ascending
        self.contextual = groups.get("contextual", [])
        widths = {self.inputs[n].width for n in self.contextual}
        if len(widths) > 1:
            raise ValueError(
                f"{config.model.name}: the contextual features become one token each and must share one width, got "
                f"{ {n: self.inputs[n].width for n in self.contextual} }"
            )
        self.channels = [_Channel(groups, c) for c in cfg.channels]
        for channel, c in zip(self.channels, cfg.channels):
            for group, name in (
                (c.history_group + "_timestamp", channel.time),
                ("candidate_timestamp", self.candidate_time),
            ):
                if len(groups[group]) != 1 or self.inputs[name].width != 1:
                    raise ValueError(
                        f"{config.model.name}: group '{group}' holds one feature of one number an element (seconds)"
                    )
        candidate_dim = sum(self.inputs[n].width for n in self.candidates)
        self.transducers = nn.ModuleList(
            self._transducer(c, ch, candidate_dim, cfg.max_seq_len, widths.copy())
            for c, ch in zip(cfg.channels, self.channels)
        )
        dim = sum(c.stu.embedding_dim for c in cfg.channels)
        self.item_mlp = SimpleContextualizedMLP(candidate_dim, cfg.item_embedding_hidden_dim, dim)
        self.tower = FusionMTLTower(
            dim,
            [t.num_class for t in cfg.task_towers],
            tuple(cfg.fusion_hidden_units),
            cfg.fusion_activation,
            cfg.fusion_layer_norm,
        )

    def _transducer(
        self, hstu: HSTUCfg, channel: _Channel, candidate_dim: int, max_seq_len: int, widths: set[int]
    ) -> HSTUTransducer:
        stu = hstu.stu
        dim = stu.embedding_dim
        action = hstu.action_encoder
        return HSTUTransducer(
            dim=dim,
            history_dim=sum(self.inputs[n].width for n in channel.history),
            candidate_dim=candidate_dim,
            content_hidden_dim=hstu.content_mlp_hidden_dim,
            positional=positional_of(hstu.positional_encoder, dim, len(self.contextual)),
            stack=stu_stack_of(stu, hstu.attn_num_layers, max_seq_len),
            postprocessor=postprocessor_of(hstu.postprocessor, dim),
            num_contexts=len(self.contextual),
            contextual_dim=widths.pop() if widths else 0,
            action_encoder=SimpleActionEncoder(action.action_embedding_dim, action.action_weights) if action else None,
            action_hidden_dim=hstu.action_mlp_hidden_dim or 0,
            input_dropout_ratio=hstu.input_dropout_ratio,
            max_attn_len=stu.max_attn_len,
            sla=(stu.sla_k1, stu.sla_k2),
            truncation=(hstu.attn_truncation_split_layer, hstu.attn_truncation_tail_len),
        )

    def forward(self, embeddings, seq_lengths, dense) -> torch.Tensor:
        """``[C, width]``: every candidate's tasks' logits, row after row (module doc)."""
        candidates = self.inputs.concatenated(self.candidates, embeddings, dense)
        num_targets = seq_lengths[self.candidates[0]]
        query_times = self.inputs.positions(self.candidate_time, embeddings, dense)[..., 0].float()
        contextual = None
        if self.contextual:
            contextual = torch.cat([self.inputs.pooled(n, embeddings, seq_lengths, dense) for n in self.contextual], 1)
        encodings = []
        for channel, transducer in zip(self.channels, self.transducers):
            actions: Optional[torch.Tensor] = None
            if channel.actions is not None:
                actions = self.inputs.positions(channel.actions, embeddings, dense)[..., 0].round().long()
            history = self.inputs.concatenated(channel.history, embeddings, dense)
            times = self.inputs.positions(channel.time, embeddings, dense)[..., 0].float()
            lengths = seq_lengths[channel.history[0]]
            if self.newest_first:  # the data's histories newest first: each row's read in reverse
                history, times = oldest_first(history, lengths), oldest_first(times, lengths)
                actions = oldest_first(actions, lengths)
            encodings.append(
                transducer(
                    history,
                    lengths,
                    times,
                    candidates,
                    num_targets,
                    query_times,
                    actions,
                    contextual,
                )
            )
        user = torch.cat(encodings, dim=-1)
        item = self.item_mlp(candidates)
        logits = torch.cat(self.tower(user, item), dim=-1)  # [B, Lt, width]
        valid = torch.arange(logits.shape[1], device=logits.device)[None, :] < num_targets[:, None]
        return logits[valid]
