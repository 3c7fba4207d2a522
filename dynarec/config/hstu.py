"""The generative ranker's config (``model.dlrm_hstu``): TorchEasyRec's ``DlrmHSTU``
(``multi_task_rank.proto``) in dynarec's names, its blocks those of :mod:`dynarec.models.hstu`.

A DlrmHSTU model scores each row's candidates: its feature groups have fixed names —
``uih`` (the user's history of items, a sequence group), ``candidate`` (the items to score, a
sequence group: its length is the row's number of candidates), ``uih_timestamp`` and
``candidate_timestamp`` (one number an element: seconds), ``uih_action`` (an action bitmask an
element, with an ``action_encoder``) and ``contextual`` (a deep group of features of one width,
optional) — and its labels are lists, one value a candidate.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from dynarec.config.base import Count, Strict
from dynarec.config.tasks import TaskTowerCfg

__all__ = [
    "CHANNEL_SUFFIXES",
    "HSTU_GROUPS",
    "ActionEncoderCfg",
    "DlrmHSTUCfg",
    "HSTUCfg",
    "HSTUMatchUserTowerCfg",
    "HSTUPostprocessorCfg",
    "PositionalEncoderCfg",
    "STUCfg",
    "UltraHSTUCfg",
]

# The groups a generative ranker reads besides its channels' (TorchEasyRec's names), and whether
# each is a sequence group; a channel's history groups: its name, then these suffixes.
HSTU_GROUPS = {"contextual": False, "candidate": True, "candidate_timestamp": True}
CHANNEL_SUFFIXES = ("", "_action", "_watchtime", "_timestamp")


class STUCfg(Strict):
    """One STU layer's sizes (:class:`dynarec.models.hstu.STULayer`)."""

    embedding_dim: Count
    num_heads: Count
    hidden_dim: Count
    attention_dim: Count
    output_dropout_ratio: float = Field(0.3, ge=0, lt=1)
    max_attn_len: int = Field(0, ge=0)
    attn_alpha: Optional[float] = Field(None, gt=0)  # None: 1 / sqrt(attention_dim)
    use_group_norm: bool = False
    # Semi-local attention (UltraHSTU's): a history token sees a global prefix of max(sla_k2,
    # contexts) tokens and its last sla_k1; a candidate the whole history, not itself. 0, 0: off.
    sla_k1: int = Field(0, ge=0)
    sla_k2: int = Field(0, ge=0)


class PositionalEncoderCfg(Strict):
    """Position and time buckets (:class:`dynarec.models.hstu.HSTUPositionalEncoder`)."""

    num_position_buckets: Count
    num_time_buckets: int = Field(0, ge=0)
    use_time_encoding: bool = False
    time_bucket_fn: Literal["sqrt", "log"] = "sqrt"
    time_bucket_increments: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _time(self):
        if self.use_time_encoding and self.num_time_buckets < 1:
            raise ValueError("use_time_encoding needs num_time_buckets >= 1")
        return self


class ActionEncoderCfg(Strict):
    """TorchEasyRec's ``simple_action_encoder``: an embedding per action bit."""

    action_embedding_dim: Count
    action_weights: list[Count] = Field(min_length=1)


class HSTUPostprocessorCfg(Strict):
    """The candidates' postprocessor: ``timestamp_layernorm`` (time of day and week, then a
    Linear and a LayerNorm), ``layernorm`` or ``l2norm``."""

    kind: Literal["timestamp_layernorm", "layernorm", "l2norm"] = "layernorm"
    time_duration_period_units: list[Count] = Field(default_factory=list)
    time_duration_units_per_period: list[Count] = Field(default_factory=list)

    @model_validator(mode="after")
    def _periods(self):
        if len(self.time_duration_period_units) != len(self.time_duration_units_per_period):
            raise ValueError("time_duration_period_units and time_duration_units_per_period differ in length")
        if self.kind == "timestamp_layernorm" and not self.time_duration_period_units:
            raise ValueError("timestamp_layernorm needs time_duration_period_units and time_duration_units_per_period")
        return self


class HSTUCfg(Strict):
    """The transducer (:class:`dynarec.models.hstu.HSTUTransducer`): contextual tokens, the
    content MLP over the history and candidate rows (the slice content encoder), the action
    encoder and its MLP (optional), positions and times, ``attn_num_layers`` STU layers, the
    candidates' postprocessor. ``name``: the channel, whose history groups are ``<name>``,
    ``<name>_action``, ``<name>_watchtime`` and ``<name>_timestamp`` (empty: ``uih``). With
    ``attn_truncation_split_layer`` > 0 the layers from that one on read each row's contexts, its
    last ``attn_truncation_tail_len`` history tokens and its candidates (UltraHSTU's)."""

    stu: STUCfg
    name: str = ""
    attn_truncation_split_layer: int = Field(0, ge=0)
    attn_truncation_tail_len: int = Field(0, ge=0)
    attn_num_layers: Count = 3
    input_dropout_ratio: float = Field(0.2, ge=0, lt=1)
    positional_encoder: PositionalEncoderCfg
    content_mlp_hidden_dim: Count
    action_encoder: Optional[ActionEncoderCfg] = None
    action_mlp_hidden_dim: Optional[Count] = None
    postprocessor: HSTUPostprocessorCfg = Field(default_factory=HSTUPostprocessorCfg)

    @model_validator(mode="after")
    def _action(self):
        if (self.action_encoder is None) != (self.action_mlp_hidden_dim is None):
            raise ValueError("action_encoder and action_mlp_hidden_dim go together")
        split, tail = self.attn_truncation_split_layer, self.attn_truncation_tail_len
        if (split > 0) != (tail > 0) or split >= self.attn_num_layers:
            raise ValueError(
                f"attn_truncation_split_layer ({split}) and attn_truncation_tail_len ({tail}): both 0, or both above "
                f"0 with the split below attn_num_layers ({self.attn_num_layers})"
            )
        return self

    @property
    def history_group(self) -> str:
        """The name of this channel's history group (its others add ``_action``, ``_watchtime``, ``_timestamp``)."""
        return self.name or "uih"


class UIHEncoderCfg(Strict):
    """HSTU over a user's history alone (TorchEasyRec's ``HSTUMatchEncoder`` with its
    ``uih_preprocessor``): each history row through one Linear to ``stu.embedding_dim`` (plus its
    actions' encoding through the action MLP), the contextual tokens before them, positions and
    times, ``attn_num_layers`` STU layers under the causal mask, the postprocessor on every token;
    the user is the row's last token (zeros for an empty row)."""

    stu: STUCfg
    attn_num_layers: Count = 3
    input_dropout_ratio: float = Field(0.2, ge=0, lt=1)
    positional_encoder: PositionalEncoderCfg
    action_encoder: Optional[ActionEncoderCfg] = None
    action_mlp_hidden_dim: Optional[Count] = None
    postprocessor: HSTUPostprocessorCfg = Field(default_factory=lambda: HSTUPostprocessorCfg(kind="l2norm"))

    @model_validator(mode="after")
    def _action(self):
        if (self.action_encoder is None) != (self.action_mlp_hidden_dim is None):
            raise ValueError("action_encoder and action_mlp_hidden_dim go together")
        if self.stu.sla_k1 or self.stu.sla_k2:
            raise ValueError(
                "stu.sla_k1 / sla_k2: semi-local attention is UltraHSTU's; the user tower reads the history whole"
            )
        return self


class HSTUMatchUserTowerCfg(Strict):
    """HSTUMatch's user tower: :class:`UIHEncoderCfg` over the history group ``input`` (its
    ``<input>_action``, ``<input>_timestamp`` groups beside it), ``max_seq_len`` dividing the
    attention scores."""

    input: str = "uih"
    hstu: UIHEncoderCfg
    max_seq_len: Count


class _GenerativeRankerCfg(Strict):
    """What DlrmHSTU and UltraHSTU share: the candidates' own embedding, the fusion tower, the
    tasks. ``max_seq_len`` divides the attention scores (a constant, as TorchEasyRec's);
    ``sequence_timestamp_is_ascending: false``: the data's histories are newest first (each
    row's is read in reverse, as TorchEasyRec's flip does)."""

    max_seq_len: Count
    sequence_timestamp_is_ascending: bool = True
    item_embedding_hidden_dim: Count = 512
    fusion_hidden_units: list[Count] = Field(default_factory=list)
    fusion_activation: Literal["relu", "silu", "none"] = "relu"
    fusion_layer_norm: bool = False
    task_towers: list[TaskTowerCfg] = Field(min_length=1)

    @model_validator(mode="after")
    def _towers(self):
        for t in self.task_towers:
            if t.hidden_units or t.relation_tower_names:
                raise ValueError(
                    f"task_towers ({t.tower_name}): the fusion tower is shared; a task has no MLP of its own"
                )
        return self

    @property
    def channels(self) -> list[HSTUCfg]:
        raise NotImplementedError


class DlrmHSTUCfg(_GenerativeRankerCfg):
    """TorchEasyRec's DlrmHSTU (module doc): the transducer's encoding of each candidate times
    the candidate's own (an item MLP over its rows: Linear, SwishLayerNorm, Linear, LayerNorm),
    then the fusion tower — an MLP (``fusion_hidden_units``) and one Linear emitting every task's
    logits."""

    hstu: HSTUCfg

    @property
    def channels(self) -> list[HSTUCfg]:
        return [self.hstu]


class UltraHSTUCfg(_GenerativeRankerCfg):
    """TorchEasyRec's UltraHSTU, a mixture of transducers: one per history channel (``hstu``
    entries, each its own ``name`` and groups, sharing the candidates and the contexts), their
    encodings of a candidate concatenated; the candidate's own embedding as wide as them all."""

    hstu: list[HSTUCfg] = Field(min_length=1)

    @property
    def channels(self) -> list[HSTUCfg]:
        return list(self.hstu)

    @model_validator(mode="after")
    def _names(self):
        names = [c.history_group for c in self.hstu]
        if len(set(names)) != len(names):
            raise ValueError(f"ultra_hstu.hstu: each channel needs its own name, got {names}")
        return self
