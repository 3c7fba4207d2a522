"""The YAML config, validated with pydantic: unknown keys are errors, and every error names the
field path (e.g. ``train.sparse_optimizer.adagrad_optimizer``).

Vocabulary follows EasyRec / TorchEasyRec where it exists: ``feature_configs`` with
``id_feature`` / ``sequence_feature`` / ``raw_feature`` / ``combo_feature`` / ... (the kinds are
in :mod:`dynarec.config.features`, docs/features.md), ``embedding_name`` to share a table,
``num_buckets`` for a fixed table or a ``dynamicemb`` block for a dynamic one, and
``sparse_optimizer`` with ``adagrad_optimizer`` etc.
"""

from __future__ import annotations

import bisect
import math
from typing import Annotated, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ByteSize,
    Field,
    PlainSerializer,
    PlainValidator,
    model_validator,
)

from dynarec.config.base import Activation, Count, DropoutRatios, NotBoolean, exactly_one
from dynarec.config.base import MLPDropouts as _MLPDropouts
from dynarec.config.base import Strict as _Strict
from dynarec.config.features import (
    TABLE_SETTINGS,
    BoolMaskFeatureCfg,
    ComboFeatureCfg,
    CustomFeatureCfg,
    ExprFeatureCfg,
    Feature,
    FeatureCfg,
    IdFeatureCfg,
    KvDotProductCfg,
    LookupFeatureCfg,
    MatchFeatureCfg,
    NormalizerCfg,
    OverlapFeatureCfg,
    RawFeatureCfg,
    SequenceFeatureCfg,
    SequenceRawFeatureCfg,
    TokenizeFeatureCfg,
    check_features,
    dependency_order,
)
from dynarec.config.hstu import CHANNEL_SUFFIXES, HSTU_GROUPS, DlrmHSTUCfg, HSTUMatchUserTowerCfg, UltraHSTUCfg
from dynarec.config.sid import SID_KEYS, SidRqkmeansCfg, SidRqvaeCfg
from dynarec.config.tasks import TaskTowerCfg, check_task_towers
from dynarec.config.tdm import TDMCfg, TDMSamplerCfg
from dynarec.embedding.config import Backend
from dynarec.optim.base import OptimizerSpec
from dynarec.optim.dense import DenseOptimizerSpec, dense_spec_from_yaml, dense_spec_to_yaml
from dynarec.optim.registry import spec_from_yaml, spec_to_yaml

__all__ = [
    "TABLE_SETTINGS",
    "BoolMaskFeatureCfg",
    "ComboFeatureCfg",
    "Config",
    "CustomFeatureCfg",
    "DenseOptimizer",
    "ExprFeatureCfg",
    "Feature",
    "FeatureCfg",
    "IdFeatureCfg",
    "KvDotProductCfg",
    "LookupFeatureCfg",
    "MatchFeatureCfg",
    "ModelCfg",
    "NormalizerCfg",
    "OverlapFeatureCfg",
    "RawFeatureCfg",
    "SequenceFeatureCfg",
    "SequenceRawFeatureCfg",
    "SparseOptimizer",
    "TokenizeFeatureCfg",
]


# The feature kinds live in dynarec.config.features; their names are importable from here too.
_exactly_one = exactly_one


Bytes = Annotated[ByteSize, NotBoolean]  # ("80GiB", or a number of bytes)


class Strict(_Strict, BaseModel):
    """:class:`dynarec.config.base.Strict` (BaseModel named again so that linters see a pydantic
    model: its fields' defaults are copied per instance)."""


class MLPDropouts(_MLPDropouts, BaseModel):
    """:class:`dynarec.config.base.MLPDropouts`, named again as :class:`Strict` is."""


# A sparse optimizer block, ``{adagrad_optimizer: {lr: 0.05, ...}}``: exactly one of the registered
# optimizers' YAML keys (dynarec.optim.registry), validated straight into its spec.
SparseOptimizer = Annotated[
    OptimizerSpec,
    PlainValidator(lambda block: spec_from_yaml(block, where="")),
    PlainSerializer(spec_to_yaml, return_type=dict),
]

# A dense optimizer block, ``{adam_optimizer: {lr: 0.002}}`` (dynarec.optim.dense).
DenseOptimizer = Annotated[
    DenseOptimizerSpec,
    PlainValidator(lambda block: dense_spec_from_yaml(block, where="")),
    PlainSerializer(dense_spec_to_yaml, return_type=dict),
]


class LRScheduleCfg(Strict):
    """The learning rate as a function of the training step ``k`` (0 for the first step), given
    the optimizer's ``lr`` (``base``); TorchEasyRec's schedules, stepped every step.

    ``constant``: ``base``. ``warmup``: ``base * min(1, (k + 1) / warmup_steps)``, then
    ``exponential_decay``'s factor when ``decay_steps`` is given. ``exponential_decay``: for
    ``k < warmup_steps`` linear from ``warmup_learning_rate`` to ``base``; then
    ``max(base * decay_rate ** p, min_learning_rate)`` with ``p = (k - warmup_steps) /
    decay_steps``, floored when ``staircase``. ``manual_step``: ``learning_rates[j]`` once ``k``
    passes ``schedule_steps[j]`` (``k > schedule_steps[j]``); before the first, ``base`` (or,
    with ``warmup``, linear from ``base`` to ``learning_rates[0]``).
    """

    kind: Literal["constant", "exponential_decay", "warmup", "manual_step"] = "constant"
    decay_steps: Optional[Count] = None
    decay_rate: float = Field(1.0, gt=0)
    staircase: bool = False
    min_learning_rate: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    warmup_learning_rate: float = Field(0.0, ge=0)
    schedule_steps: list[Count] = []
    learning_rates: list[Annotated[float, Field(ge=0)]] = []
    warmup: bool = False

    @model_validator(mode="after")
    def _needs(self):
        if self.kind == "exponential_decay" and self.decay_steps is None:
            raise ValueError("exponential_decay needs decay_steps")
        if self.kind == "warmup" and self.warmup_steps == 0:
            raise ValueError("warmup needs warmup_steps > 0")
        if self.kind == "manual_step":
            if not self.schedule_steps or len(self.schedule_steps) != len(self.learning_rates):
                raise ValueError("manual_step needs schedule_steps and learning_rates of one length (at least 1)")
            if any(a >= b for a, b in zip(self.schedule_steps, self.schedule_steps[1:])):
                raise ValueError(f"manual_step: schedule_steps must increase, got {self.schedule_steps}")
        elif self.schedule_steps or self.learning_rates or self.warmup:
            raise ValueError("schedule_steps, learning_rates and warmup belong to kind manual_step")
        return self

    def learning_rate(self, step: int, base: float) -> float:
        """The learning rate of step ``step`` (0-based) for an optimizer of ``lr`` ``base``."""
        k = step
        if self.kind == "constant":
            return base
        if self.kind == "warmup":
            f = min(1.0, (k + 1) / self.warmup_steps)
            if self.decay_steps:
                f *= self.decay_rate ** (max(k - self.warmup_steps, 0) / self.decay_steps)
            return base * f
        if self.kind == "exponential_decay":
            assert self.decay_steps is not None
            if k < self.warmup_steps:
                return self.warmup_learning_rate + (base - self.warmup_learning_rate) * k / self.warmup_steps
            p = (k - self.warmup_steps) / self.decay_steps
            if self.staircase:
                p = math.floor(p)
            return max(base * self.decay_rate**p, self.min_learning_rate)
        j = bisect.bisect_left(self.schedule_steps, k)
        if j > 0:
            return self.learning_rates[j - 1]
        if self.warmup:
            return base + (self.learning_rates[0] - base) * k / self.schedule_steps[0]
        return base


class SequenceGroupCfg(Strict):
    """A sequence group nested in a deep group: its features of one value a row (the query) and
    its sequence features (read position by position), for a ``sequence_encoders`` entry."""

    group_name: str
    feature_names: list[str] = Field(min_length=1)


class DINEncoderCfg(Strict):
    """DIN attention of the query over the sequence (the query zero-padded to the sequence's
    width): ``[B, sequence width]``."""

    input: Optional[str] = None  # the sequence group; default: the deep group's only one
    attn_hidden_units: list[Count] = Field([64, 32], min_length=1)
    activation: Activation = "relu"


class SimpleAttentionCfg(Strict):
    """Softmax of the sequence's dot products with the query (as wide as the sequence) sums the
    sequence: ``[B, sequence width]``, no parameters."""

    input: Optional[str] = None


class PoolingEncoderCfg(Strict):
    """The sequence's valid positions averaged or summed: ``[B, sequence width]``."""

    input: Optional[str] = None
    pooling_type: Literal["mean", "sum"] = "mean"


class SequenceEncoderCfg(Strict):
    """One encoder of a deep group's sequence group (TorchEasyRec's ``sequence_encoders``)."""

    din_encoder: Optional[DINEncoderCfg] = None
    simple_attention: Optional[SimpleAttentionCfg] = None
    pooling_encoder: Optional[PoolingEncoderCfg] = None

    @model_validator(mode="after")
    def _one_kind(self):
        exactly_one(self, ("din_encoder", "simple_attention", "pooling_encoder"))
        return self

    @property
    def body(self) -> Union[DINEncoderCfg, SimpleAttentionCfg, PoolingEncoderCfg]:
        body = self.din_encoder or self.simple_attention or self.pooling_encoder
        assert body is not None
        return body


class FeatureGroupCfg(Strict):
    """A feature group. A deep group may nest ``sequence_groups``, each read by a
    ``sequence_encoders`` entry whose output joins the group's: ``[features..., encoders...]``."""

    group_name: str
    feature_names: list[str] = Field(min_length=1)
    group_type: Literal["deep", "sequence", "wide"] = "deep"
    sequence_groups: list[SequenceGroupCfg] = []
    sequence_encoders: list[SequenceEncoderCfg] = []

    @model_validator(mode="after")
    def _nested_sequences(self):
        if not self.sequence_groups and not self.sequence_encoders:
            return self
        if self.group_type != "deep":
            raise ValueError("sequence_groups and sequence_encoders belong to a deep group")
        if not self.sequence_encoders:
            raise ValueError("sequence_groups: no sequence_encoders entry reads them")
        names = [s.group_name for s in self.sequence_groups]
        if len(set(names)) != len(names):
            raise ValueError(f"sequence_groups: duplicate group_name in {names}")
        read = set()
        for i, e in enumerate(self.sequence_encoders):
            name = e.body.input
            if name is None:
                if len(names) != 1:
                    raise ValueError(f"sequence_encoders[{i}]: give input, the sequence group to encode (of {names})")
                name = names[0]
            elif name not in names:
                raise ValueError(f"sequence_encoders[{i}]: input '{name}' names no sequence group; groups: {names}")
            read.add(name)
        unread = [n for n in names if n not in read]
        if unread:
            raise ValueError(f"sequence_groups: {unread} read by no sequence_encoders entry")
        return self

    def all_feature_names(self) -> list[str]:
        """The group's features, then those of its nested sequence groups."""
        return [*self.feature_names, *(n for s in self.sequence_groups for n in s.feature_names)]

    def encoded_sequences(self) -> list[tuple[str, SequenceEncoderCfg, SequenceGroupCfg]]:
        """``(config path, encoder, the sequence group it reads)`` of every sequence encoder."""
        groups = {s.group_name: s for s in self.sequence_groups}
        return [
            (f"sequence_encoders[{i}]", e, groups[e.body.input or self.sequence_groups[0].group_name])
            for i, e in enumerate(self.sequence_encoders)
        ]


class TowerCfg(Strict):
    input: str
    hidden_units: list[Count] = Field(min_length=1)
    activation: Activation = "relu"


class DinTowerCfg(Strict):
    input: str
    attn_hidden_units: list[Count] = Field([64, 32], min_length=1)
    pooling: Literal["attention", "mean"] = "attention"  # "mean": the no-attention baseline
    activation: Activation = "relu"  # of the attention MLP


class MultiTowerDINCfg(Strict):
    towers: list[TowerCfg] = []
    din_towers: list[DinTowerCfg] = []
    final_hidden_units: list[Count] = [64]
    final_activation: Activation = "relu"


class DINCfg(Strict):
    din_tower: DinTowerCfg
    deep_hidden_units: list[Count] = [128, 64]


class DeepFMCfg(Strict):
    """First order over the ``wide`` groups (every group when there is none), FM over
    ``fm_group``'s id features (default: every other group's), an MLP over the groups that are
    neither wide nor ``fm_group``; ``final_hidden_units``: an MLP over [first order, FM, deep]."""

    deep_hidden_units: list[Count] = [128, 64]
    final_hidden_units: list[Count] = []
    fm_group: Optional[str] = None


class WideAndDeepCfg(Strict):
    deep_hidden_units: list[Count] = [128, 64]
    final_hidden_units: list[Count] = []  # an MLP over [wide logit, deep MLP] before the output


class DLRMCfg(Strict):
    bottom_hidden_units: list[Count] = [64]
    top_hidden_units: list[Count] = [64, 32]
    arch_with_sparse: bool = False  # the top MLP also reads the embeddings themselves


class DCNCfg(Strict):
    """Deep & Cross (v1) over the first feature group."""

    cross_num: Count = 3
    deep_hidden_units: list[Count] = Field(min_length=1)
    final_hidden_units: list[Count] = Field(min_length=1)


class DCNV2Cfg(Strict):
    """DCN v2 over the first feature group: ``backbone_hidden_units`` (optional) before the
    low-rank cross layers, ``deep_hidden_units`` (optional) beside them."""

    backbone_hidden_units: list[Count] = []
    cross_num: Count = 3
    low_rank: Count = 32
    deep_hidden_units: list[Count] = []
    final_hidden_units: list[Count] = Field(min_length=1)


class XDeepFMCfg(Strict):
    """xDeepFM: a CIN over ``wide_group``'s fields (one width), an MLP over ``deep_group``."""

    cin_layer_size: list[Count] = Field(min_length=1)
    deep_hidden_units: list[Count] = Field(min_length=1)
    final_hidden_units: list[Count] = Field(min_length=1)
    wide_group: str = "wide"
    deep_group: str = "deep"


class MaskBlockCfg(Strict):
    hidden_dim: Count
    reduction_ratio: float = Field(1.0, gt=0)  # aggregation dim = input dim x this ...
    aggregation_dim: Optional[Count] = None  # ... unless given


class MaskNetCfg(Strict):
    """MaskNet over the first feature group."""

    n_mask_blocks: Count
    mask_block: MaskBlockCfg
    top_hidden_units: list[Count] = Field(min_length=1)
    use_parallel: bool = True


class WuKongLayerCfg(Strict):
    lcb_feature_num: Count
    fmb_feature_num: Count
    compressed_feature_num: Count = 16
    feature_num_hidden_units: list[Count] = Field(min_length=1)


class WuKongCfg(Strict):
    """WuKong over ``sparse_group``'s fields (the first group when it has no such group) and,
    when the model has ``dense_group``, its MLP output as one more field."""

    wukong_layers: list[WuKongLayerCfg] = Field(min_length=1)
    final_hidden_units: list[Count] = Field(min_length=1)
    dense_hidden_units: list[Count] = []
    sparse_group: str = "sparse"
    dense_group: str = "dense"


class RocketLaunchingCfg(Strict):
    """A light net taught by a booster net over the first feature group, the light net served
    (:mod:`dynarec.models.rocket_launching`): an optional shared MLP, the two MLPs, and
    ``feature_based_distillation`` of each light layer by the first booster layer of its width
    (``cosine``, or ``l2``: TorchEasyRec's non-cosine distance)."""

    share_hidden_units: list[Count] = []
    booster_hidden_units: list[Count] = Field(min_length=1)
    light_hidden_units: list[Count] = Field(min_length=1)
    feature_based_distillation: bool = False
    feature_distillation_function: Literal["cosine", "l2"] = "cosine"


class SimpleMultiTaskCfg(Strict):
    """Each task's tower MLP straight over the first feature group (no shared layer)."""

    task_towers: list[TaskTowerCfg]


class MMoECfg(MLPDropouts):
    """Multi-gate Mixture-of-Experts (Ma et al., 2018) over the first feature group:
    ``num_expert`` expert MLPs, one softmax gate per task (a linear map, after ``gate_hidden_units``
    when given) mixing them into that task's tower."""

    expert_hidden_units: list[Count] = Field(min_length=1)
    expert_dropout_ratio: DropoutRatios = []
    gate_hidden_units: list[Count] = []
    num_expert: Count = 3
    task_towers: list[TaskTowerCfg]


class ExtractionNetworkCfg(MLPDropouts):
    """One PLE extraction layer: ``share_num`` shared experts and ``expert_num_per_task`` experts
    per task; each task's gate mixes its own and the shared experts."""

    network_name: str = ""
    share_num: Count
    expert_num_per_task: Count
    share_expert_hidden_units: list[Count] = Field(min_length=1)
    task_expert_hidden_units: list[Count] = Field(min_length=1)
    share_expert_dropout_ratio: DropoutRatios = []
    task_expert_dropout_ratio: DropoutRatios = []


class PLECfg(Strict):
    """Progressive Layered Extraction (Tang et al., 2020): stacked extraction layers over the
    first feature group, then the task towers."""

    extraction_networks: list[ExtractionNetworkCfg] = Field(min_length=1)
    task_towers: list[TaskTowerCfg]


class DBMTLCfg(MLPDropouts):
    """Deep Bayesian Multi-Target Learning over the first feature group: an optional MaskNet and
    bottom MLP shared by the tasks, optional MMoE experts (``expert_hidden_units``), each task's
    MLP, and relation MLPs that feed a task the outputs of the tasks it depends on
    (``relation_tower_names``)."""

    mask_net: Optional[MaskNetCfg] = None
    bottom_hidden_units: list[Count] = []
    bottom_dropout_ratio: DropoutRatios = []
    expert_hidden_units: list[Count] = []
    expert_dropout_ratio: DropoutRatios = []
    gate_hidden_units: list[Count] = []
    num_expert: Count = 3
    task_towers: list[TaskTowerCfg]


class PEPNetCfg(MLPDropouts):
    """TorchEasyRec's PEPNet (parameter and embedding personalized network, Chang et al. 2023):
    ``main_input``'s vector, scaled by EPNet's gate over ``[domain_input, main]`` (where
    ``domain_input`` is given), goes through PPNet's per-task MLP (``ppnet_hidden_units``), each
    layer's output scaled by a gate over ``[uia_input, main]`` (where ``uia_input`` is given), into
    each task's tower. A gate is ``gamma * sigmoid(linear(relu(linear(x))))``, the main vector
    held constant in the gates' inputs. ``domain_label`` (TorchEasyRec's ``domain_input_name``):
    each task has ``task_domain_num`` towers, and a row's loss and metrics read the tower of
    its domain (that label's value, in ``[0, task_domain_num)``); predictions and exports give
    every domain's (``probs_<task>_<domain>``)."""

    main_input: str = "all"
    domain_input: Optional[str] = None
    uia_input: Optional[str] = None
    epnet_hidden_unit: Optional[Count] = None  # default: the main vector's width
    epnet_gamma: float = 2.0
    ppnet_hidden_units: list[Count] = []
    ppnet_activation: Activation = "relu"
    ppnet_dropout_ratio: DropoutRatios = []
    ppnet_gamma: float = 2.0
    domain_label: Optional[str] = None
    task_domain_num: Count = 1
    task_towers: list[TaskTowerCfg]

    @model_validator(mode="after")
    def _ppnet(self):
        if self.uia_input is not None and not self.ppnet_hidden_units:
            raise ValueError("uia_input: PPNet needs ppnet_hidden_units")
        if self.uia_input is None and self.ppnet_hidden_units:
            raise ValueError("ppnet_hidden_units: PPNet runs only with a uia_input group")
        if self.task_domain_num > 1 and self.domain_label is None:
            raise ValueError("task_domain_num: several towers a task need a domain_label choosing a row's")
        return self

    @property
    def domains(self) -> int:
        """Towers a task: ``task_domain_num`` where a domain label chooses, else 1."""
        return self.task_domain_num if self.domain_label is not None else 1


class MatchTowerCfg(TowerCfg, MLPDropouts):
    use_bn: bool = False  # batch normalization after each linear layer (TorchEasyRec's MLP use_bn)
    dropout_ratio: DropoutRatios = []


class DSSMCfg(Strict):
    """A two-tower retrieval model (TorchEasyRec's DSSM): a user tower over ``user_tower.input``
    and an item tower over ``item_tower.input``, each an MLP then (``output_dim`` > 0) a linear
    layer to ``output_dim``, L2-normalized for ``cosine`` similarity. A user's positive item is
    scored against ``data.negative_sampler``'s sampled items (``in_batch_negative``: against the
    batch's other items too) by ``similarity / temperature``, trained by softmax
    cross-entropy; ``recall_at_k``: recall@k is reported for each k."""

    user_tower: MatchTowerCfg
    item_tower: MatchTowerCfg
    output_dim: int = Field(ge=0)
    similarity: Literal["inner_product", "cosine"] = "inner_product"
    temperature: float = Field(1.0, gt=0)
    in_batch_negative: bool = False
    recall_at_k: list[Count] = [1, 5]

    @property
    def embedding_dim(self) -> int:
        """The width of a user's and an item's embedding."""
        return self.output_dim or self.user_tower.hidden_units[-1]


class DATTowerCfg(MatchTowerCfg):
    augment_input: str  # the group whose output (the augmented vector) joins the tower's input


class DATCfg(DSSMCfg):
    """TorchEasyRec's DAT (dual augmented two-tower, Yu et al. 2021): a DSSM whose towers also
    read an augmented vector (``augment_input``: a group, typically the user's or the item's id
    embedding, as wide as the towers' output), which the adaptive-mimic losses pull toward the
    other tower's output: ``amm_u_weight * sum ||normalize(a_u) - v||^2`` over the positive
    pairs (``v`` not trained by it), and ``amm_i_weight`` likewise for ``a_i`` and ``u``."""

    user_tower: DATTowerCfg
    item_tower: DATTowerCfg
    amm_u_weight: float = Field(0.5, ge=0)
    amm_i_weight: float = Field(0.5, ge=0)


class MINDCfg(DSSMCfg):
    """TorchEasyRec's MIND (multi-interest network with dynamic routing, Li et al. 2019): the
    user tower gives up to ``capsule.max_k`` interests a user; in training and evaluation each
    user's embedding is their softmax mix by ``simi_pow`` times their similarity to the user's own
    item (label-aware attention), scored as DSSM scores; an export serves the interests."""

    user_tower: MINDUserTowerCfg
    similarity: Literal["inner_product", "cosine"] = "cosine"
    simi_pow: float = 10.0

    @property
    def embedding_dim(self) -> int:
        return self.output_dim or self.user_tower.concat_mlp.hidden_units[-1]


class MLPCfg(MLPDropouts):
    """An MLP (TorchEasyRec's ``MLP``): each linear layer (with a bias unless ``bias`` is false)
    followed by batch normalization (``use_bn``, per unit over every row and position), the
    activation and dropout."""

    hidden_units: list[Count] = Field(min_length=1)
    activation: Activation = "relu"
    use_bn: bool = False
    bias: bool = True
    dropout_ratio: DropoutRatios = []


class CapsuleCfg(Strict):
    """MIND's behaviour-to-interest capsule layer (TorchEasyRec's ``B2ICapsule``): the sequence,
    cut or zero-padded to ``max_seq_len``, mapped to ``high_dim`` by one bilinear matrix and
    routed ``num_iters`` times into ``max_k`` interest capsules (``const_caps_num``: all of them;
    else ``max(1, min(max_k, log2(length)))``), squashed with ``squash_pow``. Routing starts from
    logits drawn from N(0, ``routing_logits_stddev``) (``routing_init_method: zeros``: from 0),
    scaled by ``routing_logits_scale`` in the softmax."""

    max_k: Count = 5
    max_seq_len: Count
    high_dim: Count
    num_iters: Count = 3
    routing_logits_scale: float = 20.0
    routing_logits_stddev: float = Field(1.0, ge=0)
    squash_pow: float = 1.0
    const_caps_num: bool = False
    routing_init_method: Literal["normal", "zeros"] = "normal"


class MINDUserTowerCfg(MatchTowerCfg):
    """MIND's user tower: the user group through the user MLP (``hidden_units``, its last layer
    linear), the ``history_input`` sequence group through ``hist_seq_mlp`` (its last layer linear,
    no bias) and the capsule layer; each interest joined to the user vector, through
    ``concat_mlp`` and a linear map to ``output_dim``."""

    history_input: str
    hist_seq_mlp: Optional[MLPCfg] = None
    capsule: CapsuleCfg
    concat_mlp: MLPCfg


class HSTUMatchCfg(Strict):
    """TorchEasyRec's HSTUMatch (two-tower retrieval, ``hstu.py``): the user tower is HSTU over
    the user's history (:class:`~dynarec.config.hstu.HSTUMatchUserTowerCfg`; its last token is the
    user), the item tower an MLP (then ``output_dim`` > 0: a linear layer) over each candidate's
    rows; L2-normalized for ``cosine``. A row's candidates (the ``candidate`` sequence group) are
    its positives: each is a query of the row's user, scored against its own item and the sampled
    items (``data.negative_sampler``, whose ``item_id_field`` is the candidates' column) by
    ``similarity / temperature`` under softmax cross-entropy; recall@k over the queries. Optional
    groups: ``contextual`` (features of one width, a token each before the history) and
    ``query_time`` (one number a row: the request time the history's ages count from; absent, the
    newest history token's time). ``sequence_timestamp_is_ascending: false``: the data's
    histories are newest first (each row's is read in reverse, as TorchEasyRec's flip does)."""

    user_tower: HSTUMatchUserTowerCfg
    item_tower: MatchTowerCfg
    output_dim: int = Field(0, ge=0)
    similarity: Literal["inner_product", "cosine"] = "inner_product"
    temperature: float = Field(1.0, gt=0)
    in_batch_negative: Literal[False] = False  # several positives a row: TorchEasyRec refuses it too
    recall_at_k: list[Count] = [1, 5]
    sequence_timestamp_is_ascending: bool = True

    @property
    def embedding_dim(self) -> int:
        """The width of a user's and an item's embedding."""
        return self.output_dim or self.user_tower.hstu.stu.embedding_dim


MULTI_TASK_KEYS = ("simple_multi_task", "mmoe", "ple", "dbmtl", "pepnet")
# Retrieval models: a user and an item tower scored against sampled items.
RETRIEVAL_KEYS = ("dssm", "dat", "mind", "hstu_match")
# HSTUMatch's groups (TorchEasyRec's fixed names besides the towers' inputs), and whether each is
# a sequence group.
HSTU_MATCH_GROUPS = {"contextual": False, "query_time": False}
# Models that read groups feature by feature (FM, pairwise interactions, CIN, WuKong's fields):
# their groups cannot nest sequence_groups.
FIELD_WISE_MODELS = ("deepfm", "dlrm", "xdeepfm", "wukong")

# Models that score each row's candidates (labels are lists, one value a candidate).
CANDIDATE_KEYS = ("dlrm_hstu", "ultra_hstu")

MODEL_KEYS = (
    "multi_tower_din",
    "din",
    "deepfm",
    "wide_and_deep",
    "dlrm",
    "dcn",
    "dcn_v2",
    "xdeepfm",
    "mask_net",
    "wukong",
    "rocket_launching",
    *MULTI_TASK_KEYS,
    *RETRIEVAL_KEYS,
    *CANDIDATE_KEYS,
    *SID_KEYS,
    "tdm",
)


class VariationalDropoutCfg(Strict):
    """TorchEasyRec's variational dropout: a learned dropout rate per part of every deep group of
    more than one part, trained through a concrete relaxation, its keep rates penalized by
    ``regularization_lambda`` (:mod:`dynarec.models.variational_dropout`)."""

    regularization_lambda: float = Field(0.01, ge=0)


class ModelCfg(Strict):
    feature_groups: list[FeatureGroupCfg] = Field(min_length=1)
    variational_dropout: Optional[VariationalDropoutCfg] = None
    multi_tower_din: Optional[MultiTowerDINCfg] = None
    din: Optional[DINCfg] = None
    deepfm: Optional[DeepFMCfg] = None
    wide_and_deep: Optional[WideAndDeepCfg] = None
    dlrm: Optional[DLRMCfg] = None
    dcn: Optional[DCNCfg] = None
    dcn_v2: Optional[DCNV2Cfg] = None
    xdeepfm: Optional[XDeepFMCfg] = None
    mask_net: Optional[MaskNetCfg] = None
    wukong: Optional[WuKongCfg] = None
    rocket_launching: Optional[RocketLaunchingCfg] = None
    simple_multi_task: Optional[SimpleMultiTaskCfg] = None
    mmoe: Optional[MMoECfg] = None
    ple: Optional[PLECfg] = None
    dbmtl: Optional[DBMTLCfg] = None
    pepnet: Optional[PEPNetCfg] = None
    dssm: Optional[DSSMCfg] = None
    dat: Optional[DATCfg] = None
    mind: Optional[MINDCfg] = None
    dlrm_hstu: Optional[DlrmHSTUCfg] = None
    ultra_hstu: Optional[UltraHSTUCfg] = None
    hstu_match: Optional[HSTUMatchCfg] = None
    sid_rqvae: Optional[SidRqvaeCfg] = None
    sid_rqkmeans: Optional[SidRqkmeansCfg] = None
    tdm: Optional[TDMCfg] = None

    @model_validator(mode="after")
    def _one_model(self):
        name = _exactly_one(self, MODEL_KEYS)
        names = [g.group_name for g in self.feature_groups]
        names += [s.group_name for g in self.feature_groups for s in g.sequence_groups]
        if len(set(names)) != len(names):
            raise ValueError(f"feature_groups: duplicate group_name in {names} (sequence_groups included)")
        for i, g in enumerate(self.feature_groups):
            twice = sorted({n for n in g.feature_names if g.feature_names.count(n) > 1})
            if twice:
                raise ValueError(f"feature_groups[{i}] ({g.group_name}): feature(s) {twice} listed twice")
        if name in MULTI_TASK_KEYS or name in CANDIDATE_KEYS:
            check_task_towers(self.task_towers, f"model.{name}")
        if name in CANDIDATE_KEYS:
            self._check_hstu_groups(name)
        if name == "hstu_match":
            self._check_hstu_match_groups()
        if name == "tdm":
            sequence = [g.group_name for g in self.feature_groups if g.group_type == "sequence"]
            wide = [g.group_name for g in self.feature_groups if g.group_type == "wide"]
            if len(sequence) != 1 or wide:
                raise ValueError(
                    f"tdm: reads one sequence group (its multi-window DIN's) and deep groups; sequence groups "
                    f"{sequence}, wide groups {wide}"
                )
        if name in SID_KEYS:
            top = {g.group_name: g for g in self.feature_groups}
            for where, group, _ in self._tower_inputs(name):
                if group in top and top[group].sequence_groups:
                    raise ValueError(f"{where}: a semantic-ID model reads its group's features; '{group}' nests some")
        if self.variational_dropout is not None and name in FIELD_WISE_MODELS:
            raise ValueError(
                f"variational_dropout: {name} reads its groups feature by feature; variational dropout applies to "
                "a model reading whole deep groups"
            )
        nested = [g.group_name for g in self.feature_groups if g.sequence_groups]
        if nested and name in FIELD_WISE_MODELS:
            raise ValueError(
                f"{name}: reads its groups feature by feature and has no place for a sequence encoder's output; "
                f"group(s) {nested} have sequence_groups"
            )
        kinds = {g.group_name: g.group_type for g in self.feature_groups}
        for where, group, wanted in self._tower_inputs(name):
            if group not in kinds:
                raise ValueError(f"{where}: input '{group}' names no feature group; groups: {sorted(kinds)}")
            if (kinds[group] == "sequence") != (wanted == "sequence"):
                raise ValueError(
                    f"{where}: input '{group}' is a '{kinds[group]}' group; this tower needs a "
                    f"{'sequence' if wanted == 'sequence' else 'deep'} group"
                )
        return self

    def _check_hstu_groups(self, name: str) -> None:
        """A generative ranker's groups: TorchEasyRec's fixed names, each of its kind."""
        cfg = getattr(self, name)
        known = dict(HSTU_GROUPS)
        needed = ["candidate", "candidate_timestamp"]
        for channel in cfg.channels:
            base = channel.history_group
            known.update({base + suffix: True for suffix in CHANNEL_SUFFIXES})
            needed += [base, base + "_timestamp"] + ([base + "_action"] if channel.action_encoder else [])
        self._check_named_groups(name, known, needed)

    def _check_named_groups(self, name: str, known: dict[str, bool], needed: list[str]) -> None:
        """A model reading its groups by name: every group is one it reads (``known``: whether
        each is a sequence group) and of its kind, and the ``needed`` ones are given."""
        kinds = {g.group_name: g.group_type for g in self.feature_groups}
        missing = [g for g in needed if g not in kinds]
        if missing:
            raise ValueError(f"{name}: needs the feature group(s) {missing}; groups: {sorted(kinds)}")
        for g, kind in kinds.items():
            if g not in known:
                raise ValueError(f"{name}: reads the groups {list(known)}; group '{g}' would be ignored")
            if (kind == "sequence") != known[g]:
                want = "a sequence group" if known[g] else "a deep group"
                raise ValueError(f"{name}: group '{g}' must be {want}, it is '{kind}'")

    def _check_hstu_match_groups(self) -> None:
        """HSTUMatch's groups: its towers' inputs, the history's ``_action`` / ``_watchtime`` /
        ``_timestamp`` groups (sequences), ``contextual`` and ``query_time`` (deep)."""
        cfg = self.hstu_match
        assert cfg is not None
        base = cfg.user_tower.input
        known = {**HSTU_MATCH_GROUPS, base: True, cfg.item_tower.input: True}
        known.update({base + suffix: True for suffix in CHANNEL_SUFFIXES[1:]})
        hstu = cfg.user_tower.hstu
        timed = hstu.positional_encoder.use_time_encoding or hstu.postprocessor.kind == "timestamp_layernorm"
        needed = [base + "_timestamp"] if timed else []
        needed += [base + "_action"] if hstu.action_encoder is not None else []
        self._check_named_groups("hstu_match", known, needed)
        names = {g.group_name for g in self.feature_groups}
        for g in (base + "_action", base + "_timestamp", "query_time"):
            if g in names and len(self.group(g).feature_names) != 1:
                raise ValueError(f"hstu_match: group '{g}' holds one feature of one number an element")

    def _tower_inputs(self, name: str) -> list[tuple[str, str, str]]:
        """``(config path, group name, 'deep' | 'sequence')`` of every tower input of the model."""
        if name == "multi_tower_din":
            cfg = self.multi_tower_din
            assert cfg is not None
            if not cfg.towers and not cfg.din_towers:
                raise ValueError("multi_tower_din: give at least one of towers or din_towers")
            return [(f"multi_tower_din.towers[{i}]", t.input, "deep") for i, t in enumerate(cfg.towers)] + [
                (f"multi_tower_din.din_towers[{i}]", t.input, "sequence") for i, t in enumerate(cfg.din_towers)
            ]
        if name == "din":
            assert self.din is not None
            return [("din.din_tower", self.din.din_tower.input, "sequence")]
        if name == "deepfm" and self.deepfm is not None and self.deepfm.fm_group is not None:
            return [("deepfm.fm_group", self.deepfm.fm_group, "deep")]
        if name == "pepnet":
            p = self.pepnet
            assert p is not None
            given = (("main_input", p.main_input), ("domain_input", p.domain_input), ("uia_input", p.uia_input))
            return [(f"pepnet.{key}", group, "deep") for key, group in given if group is not None]
        if name == "hstu_match":
            assert self.hstu_match is not None
            return [
                ("hstu_match.user_tower", self.hstu_match.user_tower.input, "sequence"),
                ("hstu_match.item_tower", self.hstu_match.item_tower.input, "sequence"),
            ]
        if name in RETRIEVAL_KEYS:
            towers = self.retrieval
            assert isinstance(towers, DSSMCfg)
            out = [
                (f"{name}.user_tower", towers.user_tower.input, "deep"),
                (f"{name}.item_tower", towers.item_tower.input, "deep"),
            ]
            if isinstance(towers, DATCfg):
                out += [
                    (f"{name}.user_tower.augment_input", towers.user_tower.augment_input, "deep"),
                    (f"{name}.item_tower.augment_input", towers.item_tower.augment_input, "deep"),
                ]
            if isinstance(towers, MINDCfg):
                out.append((f"{name}.user_tower.history_input", towers.user_tower.history_input, "sequence"))
            return out
        if name in SID_KEYS:
            sid = self.sid
            out = [(f"{name}.input", self.sid_input, "deep")]
            if isinstance(sid, SidRqvaeCfg) and sid.contrastive is not None:
                out += [
                    (f"{name}.contrastive.pair_group", sid.contrastive.pair_group, "deep"),
                    (f"{name}.contrastive.pair_flag_group", sid.contrastive.pair_flag_group, "deep"),
                ]
            return out
        return []

    @property
    def sid(self) -> Union[SidRqvaeCfg, SidRqkmeansCfg]:
        """The semantic-ID model's block (sid_rqvae, sid_rqkmeans)."""
        cfg = getattr(self, self.name)
        assert isinstance(cfg, (SidRqvaeCfg, SidRqkmeansCfg)), f"model '{self.name}' is not a semantic-ID model"
        return cfg

    @property
    def sid_input(self) -> str:
        """The group a semantic-ID model's codes are of: its ``input``, else the first group."""
        return self.sid.input or self.feature_groups[0].group_name

    @property
    def retrieval(self) -> Union[DSSMCfg, HSTUMatchCfg]:
        """The retrieval model's block (dssm; dat and mind: a DSSMCfg with other towers; hstu_match)."""
        cfg = getattr(self, self.name)
        assert isinstance(cfg, (DSSMCfg, HSTUMatchCfg)), f"model '{self.name}' is not a retrieval model"
        return cfg

    @property
    def name(self) -> str:
        return next(k for k in MODEL_KEYS if getattr(self, k) is not None)

    @property
    def task_towers(self) -> list[TaskTowerCfg]:
        """A multi-task model's task towers; [] for a single-task model."""
        return list(getattr(getattr(self, self.name), "task_towers", []))

    def sequence_groups(self) -> list[tuple[str, str, list[str]]]:
        """``(config path, group name, feature names)`` of every sequence group: the groups of
        type ``sequence`` and the ``sequence_groups`` nested in deep groups."""
        out = []
        for i, g in enumerate(self.feature_groups):
            if g.group_type == "sequence":
                out.append((f"model.feature_groups[{i}]", g.group_name, list(g.feature_names)))
            for j, s in enumerate(g.sequence_groups):
                out.append((f"model.feature_groups[{i}].sequence_groups[{j}]", s.group_name, list(s.feature_names)))
        return out

    def aligned_sequences(self) -> list[list[str]]:
        """Feature names whose sequences the model reads position by position, so that a row's
        must have one length: each sequence group's; a generative ranker's history groups of a
        channel together (items, actions, timestamps) and its candidate groups together."""
        out = [names for _, _, names in self.sequence_groups()]
        groups = {g.group_name: list(g.feature_names) for g in self.feature_groups}
        if self.name in CANDIDATE_KEYS:
            sides = [
                [c.history_group + suffix for suffix in CHANNEL_SUFFIXES] for c in getattr(self, self.name).channels
            ]
            for side in [*sides, ["candidate", "candidate_timestamp"]]:
                out.append([n for g in side for n in groups.get(g, [])])
        if self.hstu_match is not None:
            base = self.hstu_match.user_tower.input
            out.append([n for suffix in CHANNEL_SUFFIXES for n in groups.get(base + suffix, [])])
        return out

    def group(self, name: str) -> FeatureGroupCfg:
        for g in self.feature_groups:
            if g.group_name == name:
                return g
        raise KeyError(name)


class HardNegativesCfg(Strict):
    """Hard negatives besides the sampled items (TorchEasyRec's ``hard_negative_sampler``): each
    row's user (its ``user_id_field`` column) gets the items of its edges in the edge table at
    ``edge_input_path`` — columns ``user_id`` (int64), ``item_id`` (int64, an item of the item
    table), ``weight`` (float; a CSV / text table split on the sampler's ``field_delimiter``) —
    all of them, or at most ``num_hard_sample`` (more: that many drawn by edge weight, without
    replacement). They are scored against their own user only."""

    edge_input_path: str
    user_id_field: str
    num_hard_sample: Optional[Count] = None


class NegativeSamplerCfg(Strict):
    """Sampled negatives of a retrieval model (TorchEasyRec's ``negative_sampler``): each batch
    gets ``num_sample`` items (``num_eval_sample`` in eval; 0: ``num_sample``) drawn with
    probability proportional to their weight, none of them an item of the batch, from the
    item table at ``input_path``: columns ``id`` (int64), ``weight`` (float) and the attributes
    (a string: the ``attr_fields`` columns' values in order, joined by ``attr_delimiter``); a
    CSV or text table's fields are split on ``field_delimiter`` (default a tab), and a
    ``name:type`` header keeps its name. ``item_id_field``: the batch's item id column;
    ``hard_negatives``: each user's hard negatives besides."""

    input_path: str
    num_sample: Count
    attr_fields: list[str] = Field(min_length=1)
    item_id_field: str
    attr_delimiter: str = Field(":", min_length=1)
    num_eval_sample: int = Field(0, ge=0)
    field_delimiter: Optional[str] = None
    hard_negatives: Optional[HardNegativesCfg] = None


class DataCfg(Strict):
    train_input_path: Union[str, list[str]]
    eval_input_path: Union[str, list[str], None] = None
    # A single-task model's label column (default "label"); a multi-task model's tasks name theirs.
    label_field: Optional[str] = None
    batch_size: Count = 1024
    eval_batch_size: Optional[Count] = None
    # DataLoader workers building batches; None: automatic (0 on a CPU device, where they would
    # compete with the step for the cores; on a GPU as many as the host spares, up to 8). At most
    # the CPUs the process may use (more: that many, said in one line).
    num_workers: Optional[int] = Field(None, ge=0)
    # Keep the first whole epoch's built batches: later epochs train on them instead of reading
    # and building the files again (the same batches). true or "memory": held in memory (every
    # batch's tensors); "disk": a file a batch under batch_cache_dir, read back each epoch
    # (dynarec/data/batch_cache.py).
    cache_batches: Union[bool, Literal["memory", "disk"]] = False
    # Where cache_batches "disk" writes (a directory of the run's own is made there and removed
    # when the run ends); default: the system's temp directory.
    batch_cache_dir: Optional[str] = None
    input_type: Optional[Literal["parquet", "csv"]] = None  # default: from the file extension
    negative_sampler: Optional[NegativeSamplerCfg] = None  # a retrieval model's sampled items
    tdm_sampler: Optional[TDMSamplerCfg] = None  # a TDM model's tree and its layer-wise samples

    def side_tables(self) -> list[tuple[str, str]]:
        """``(field, path)`` of every table the samplers read beside the data (the item table,
        the hard negatives' edges, the TDM tree's node and edge tables)."""
        out = []
        if self.negative_sampler is not None:
            out.append(("data.negative_sampler.input_path", self.negative_sampler.input_path))
            if self.negative_sampler.hard_negatives is not None:
                hard = self.negative_sampler.hard_negatives.edge_input_path
                out.append(("data.negative_sampler.hard_negatives.edge_input_path", hard))
        if self.tdm_sampler is not None:
            out.append(("data.tdm_sampler.item_input_path", self.tdm_sampler.item_input_path))
            out.append(("data.tdm_sampler.edge_input_path", self.tdm_sampler.edge_input_path))
        return out

    @property
    def batch_cache(self) -> Optional[Literal["memory", "disk"]]:
        """Where the first epoch's batches are kept (``cache_batches``), None: nowhere."""
        if self.cache_batches is True:
            return "memory"
        return self.cache_batches or None


class GradientClippingCfg(Strict):
    max_norm: float = Field(1.0, gt=0)
    norm_type: float = Field(2.0, gt=0)


class GradScalerCfg(Strict):
    """FP16's dynamic loss scaling (torch.amp.GradScaler's fields and defaults; TorchEasyRec's
    ``grad_scaler``): dynarec/train/loss_scaling.py."""

    init_scale: float = Field(65536.0, gt=0)
    growth_factor: float = Field(2.0, gt=1)
    backoff_factor: float = Field(0.5, gt=0, lt=1)
    growth_interval: Count = 2000


class TrainCfg(Strict):
    sparse_optimizer: SparseOptimizer
    table_optimizers: dict[str, SparseOptimizer] = {}  # per-table overrides, by table name
    dense_optimizer: DenseOptimizer = Field(default_factory=lambda: dense_spec_from_yaml({"adam_optimizer": {}}, ""))
    sparse_lr_schedule: LRScheduleCfg = LRScheduleCfg()
    dense_lr_schedule: LRScheduleCfg = LRScheduleCfg()
    sparse_backend: Backend = "native"
    num_epochs: Optional[Count] = None  # passes over the training data (default 1) ...
    num_steps: Optional[Count] = None  # ... or exactly this many steps, cycling the data as needed
    save_checkpoints_steps: Optional[Count] = None
    save_checkpoints_epochs: Optional[Count] = None  # also a checkpoint after every this many epochs
    keep_checkpoints: Count = 3
    # The dense model's forward in bfloat16 or float16 (torch.autocast; the tables and the loss stay
    # float32). fp16 takes grad_scaler: dynamic loss scaling, the tables' updates inside it.
    mixed_precision: Optional[Literal["bf16", "fp16"]] = None
    grad_scaler: Optional[GradScalerCfg] = None
    # The dense parameters' gradient norm clipped to max_norm before the dense optimizer's step
    # (torch.nn.utils.clip_grad_norm_); the tables' fused updates take their gradients as they are.
    gradient_clipping: Optional[GradientClippingCfg] = None
    # The dense optimizer steps every this many steps on the sum of their gradients, each step's
    # loss divided by it; the tables' fused updates run every step (TorchEasyRec's rule).
    gradient_accumulation_steps: Count = 1
    # On a GPU, in one process: the dense model's training forward and backward replayed as CUDA
    # graphs, one per input shape (dynarec/train/graphs.py). Not with mixed_precision or
    # gradient_accumulation_steps > 1, where the model runs eagerly. On any GPU run, a fused
    # Adam's step replays from a graph too (dynarec/train/optimizer_graph.py).
    cuda_graphs: bool = True
    # With cuda_graphs, on a GPU in one process: a whole training step of fixed tables (lookup,
    # dense model, loss, fused updates, Adam's step) replayed from two CUDA graphs for each recurring
    # batch signature, the loss's finiteness read between them (dynarec/train/step_graph.py); the
    # same results as the eager step, bit for bit. Setups it cannot capture run eagerly.
    whole_step_graphs: bool = True
    # With whole_step_graphs: tables the graphs cannot capture (dynamic tables, tables in host
    # memory, FBGEMM's) looked up eagerly around them, their outputs handed to the graphs and
    # their gradients taken back, so that the rest of such a model's step still replays (their
    # input stage read ahead as an eager step's); the same results as the eager step, bit for bit.
    whole_step_graphs_eager_lookups: bool = True
    log_step_count_steps: Count = 50
    eval_every_steps: Optional[Count] = None
    seed: int = 0
    # A step whose loss is NaN or infinite writes nothing: 'error' stops training naming the step;
    # 'skip_batch' skips the batch (it does not count as a step) and reports how many were skipped.
    nan_policy: Literal["error", "skip_batch"] = "error"
    # Bytes a rank's tables may take at their largest ("80GiB", or an integer); default: the memory
    # available on the rank's device. A plan that does not fit is an error naming the table.
    memory_budget_per_rank: Optional[Bytes] = None
    # Bytes of rows a rank may keep in host memory (tables with cache_load_factor: "1TB"); default:
    # the host's available memory when the tables are built. A plan over it is an error naming the table.
    host_memory_budget_per_rank: Optional[Bytes] = None
    # Seconds a rank waits in a collective of a multi-process run before it gives up, naming what
    # it waited for.
    collective_timeout_seconds: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _steps_or_epochs(self):
        if self.num_epochs is not None and self.num_steps is not None:
            raise ValueError("give one of num_epochs or num_steps, not both")
        if self.grad_scaler is not None and self.mixed_precision != "fp16":
            raise ValueError(
                f"grad_scaler: loss scaling is for mixed_precision fp16 (given: {self.mixed_precision!r}; "
                "bf16 needs none)"
            )
        return self

    @property
    def epochs(self) -> int:
        return self.num_epochs or 1


class EvalCfg(Strict):
    # A single-task model's (a multi-task model's are its task towers'); accuracy: of the
    # probability's class at 0.5 (a tie is class 0).
    metrics: list[Literal["auc", "grouped_auc", "log_loss", "accuracy"]] = ["auc", "grouped_auc", "log_loss"]
    grouped_auc_field: Optional[str] = None  # the column to group by; default the first id feature's
    max_steps: Optional[Count] = None


class ExportCfg(Strict):
    pass


class Config(Strict):
    feature_configs: list[FeatureCfg] = Field(min_length=1)
    model: ModelCfg
    data: DataCfg
    train: TrainCfg
    eval: EvalCfg = EvalCfg()
    export: ExportCfg = ExportCfg()

    @model_validator(mode="after")
    def _cross_references(self):
        tables = check_features(self.feature_configs)
        seen = {f.feature.feature_name for f in self.feature_configs}
        for gi, g in enumerate(self.model.feature_groups):
            for fi, n in enumerate(g.feature_names):
                if n not in seen:
                    raise ValueError(f"model.feature_groups[{gi}].feature_names[{fi}]: unknown feature '{n}'")
            for si, sg in enumerate(g.sequence_groups):
                for fi, n in enumerate(sg.feature_names):
                    if n not in seen:
                        where = f"model.feature_groups[{gi}].sequence_groups[{si}].feature_names[{fi}]"
                        raise ValueError(f"{where}: unknown feature '{n}'")
        for where, name, names in self.model.sequence_groups():
            seqs = {
                n: getattr(self.feature(n), "sequence_length")  # noqa: B009 - every sequence kind has one
                for n in names
                if self.feature(n).is_sequence
            }
            if len(set(seqs.values())) > 1:
                raise ValueError(
                    f"{where} ({name}): its sequence features are "
                    f"concatenated position by position and need one sequence_length, got {seqs}"
                )
        for name in self.train.table_optimizers:
            if name not in tables:
                raise ValueError(f"train.table_optimizers: unknown table '{name}'; tables: {sorted(tables)}")
        return self

    def features(self) -> list[Feature]:
        """Every feature, in the config's order."""
        return [f.feature for f in self.feature_configs]

    def features_in_order(self) -> list[Feature]:
        """Every feature, each after the features it reads (``feature:<name>`` inputs)."""
        return dependency_order(self.features())

    def feature(self, name: str):  # -> Feature (untyped: callers read a kind's own fields)
        for f in self.features():
            if f.feature_name == name:
                return f
        raise KeyError(name)

    @model_validator(mode="after")
    def _tdm(self):
        sampler, name = self.data.tdm_sampler, self.model.name
        if (sampler is None) != (name != "tdm"):
            raise ValueError(
                "model.tdm: trains on its tree's layer-wise samples: give data.tdm_sampler"
                if sampler is None
                else f"data.tdm_sampler: samples a TDM model's tree; model '{name}' is not tdm"
            )
        return self

    @model_validator(mode="after")
    def _retrieval(self):
        name, sampler = self.model.name, self.data.negative_sampler
        if sampler is not None and name not in RETRIEVAL_KEYS:
            raise ValueError(
                f"data.negative_sampler: samples items for a retrieval model ({', '.join(RETRIEVAL_KEYS)}); "
                f"model '{name}' is a ranking model"
            )
        if name not in RETRIEVAL_KEYS:
            return self
        cfg = self.model.retrieval
        if sampler is None and not cfg.in_batch_negative:
            raise ValueError(
                f"model.{name}: scores each user's item against other items: give data.negative_sampler, or set "
                "in_batch_negative"
            )
        if sampler is not None and not cfg.in_batch_negative:
            candidates = 1 + (sampler.num_eval_sample or sampler.num_sample)
            if max(cfg.recall_at_k) >= candidates:
                raise ValueError(
                    f"model.{name}.recall_at_k: {max(cfg.recall_at_k)} of {candidates} scored items (the own and "
                    "the sampled ones) is every item: recall would be 1 whatever the model; give a smaller k or "
                    "sample more items (data.negative_sampler.num_eval_sample)"
                )
        if isinstance(cfg, HSTUMatchCfg):
            if sampler is None:
                raise ValueError(
                    "model.hstu_match: scores each positive against sampled items: give data.negative_sampler"
                )
            if sampler.hard_negatives is not None:
                raise ValueError("data.negative_sampler.hard_negatives: not supported with hstu_match yet")
            candidate = self.candidate_feature()
            if candidate is None or sampler.item_id_field not in self.columns_read(candidate):
                raise ValueError(
                    f"data.negative_sampler.item_id_field: hstu_match's positives are its candidates' ids; "
                    f"'{sampler.item_id_field}' is not the column of its candidate feature '{candidate}'"
                )
        if sampler is not None:
            groups = [cfg.item_tower.input] + ([cfg.item_tower.augment_input] if isinstance(cfg, DATCfg) else [])
            for n in dict.fromkeys(n for g in groups for n in self.model.group(g).all_feature_names()):
                outside = [c for c in self.columns_read(n) if c not in sampler.attr_fields]
                if outside:
                    raise ValueError(
                        f"model.{name}.item_tower: feature '{n}' reads column(s) {outside}, which the sampled items "
                        f"lack; data.negative_sampler.attr_fields: {sampler.attr_fields}"
                    )
        return self

    def features_read(self, name: str) -> list[str]:
        """Feature ``name`` and the features it reads (``feature:`` inputs), through theirs too."""
        out = [name]
        for n in self.feature(name).feature_inputs:
            out += self.features_read(n)
        return list(dict.fromkeys(out))

    def columns_read(self, name: str) -> list[str]:
        """The columns feature ``name`` reads, through the features it reads too."""
        return list(dict.fromkeys(c for n in self.features_read(name) for c in self.feature(n).columns))

    @model_validator(mode="after")
    def _tasks(self):
        towers = self.model.task_towers
        if towers and self.data.label_field is not None:
            raise ValueError(
                f"data.label_field: model '{self.model.name}' reads the labels its task_towers name (label_name), "
                "not data.label_field; remove it"
            )
        if self.model.name in SID_KEYS and self.data.label_field is not None:
            raise ValueError(f"data.label_field: model '{self.model.name}' gives semantic ids and reads no label")
        if self.model.name == "sid_rqkmeans" and self.train.eval_every_steps is not None:
            raise ValueError(
                "train.eval_every_steps: model 'sid_rqkmeans' fits its centroids when training ends; an evaluation "
                "before would score none"
            )
        return self

    def tasks(self) -> list[TaskTowerCfg]:
        """The model's tasks: a multi-task model's task towers, or the one task of a single-task
        model (``data.label_field`` under binary cross-entropy, scored by ``eval.metrics``, named
        ``main``: its outputs and metrics carry no task suffix); none for a semantic-ID model,
        which reads no label."""
        if self.model.name in SID_KEYS:
            return []
        return self.model.task_towers or [
            TaskTowerCfg(
                tower_name="main", label_name=self.data.label_field or "label", metrics=list(self.eval.metrics)
            )
        ]

    def candidate_feature(self) -> Optional[str]:
        """The sequence feature whose elements are each row's candidates, for a model that scores
        them (``dlrm_hstu``; ``hstu_match``: its positives): its labels are lists, one value a
        candidate; None for the others."""
        if self.model.hstu_match is not None:
            return self.model.group(self.model.hstu_match.item_tower.input).feature_names[0]
        if self.model.name not in CANDIDATE_KEYS:
            return None
        return self.model.group("candidate").feature_names[0]

    def label_fields(self) -> list[str]:
        """The label columns the model reads, in first-use order: each task's label, then its
        task-space indicator; then PEPNet's domain label."""
        names: list[str] = []
        for t in self.tasks():
            for n in (t.label_name, t.task_space_indicator_label):
                if n is not None and n not in names:
                    names.append(n)
        pepnet = self.model.pepnet
        if pepnet is not None and pepnet.domain_label is not None and pepnet.domain_label not in names:
            names.append(pepnet.domain_label)  # which of a task's towers a row's loss reads
        return names
