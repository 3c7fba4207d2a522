"""Tree-based deep model configs (``model.tdm``, ``data.tdm_sampler``): TorchEasyRec's ``TDM``
(``model.proto``) and ``TDMSampler`` (``sampler.proto``) in dynarec's names; the model is
:mod:`dynarec.models.tdm`, the sampler :mod:`dynarec.data.tdm_sampler`, the tree
:mod:`dynarec.data.tree`.

TDM retrieves items by beam search down a tree whose leaves are the items: one ranking model
scores (user, node) pairs at every level. It trains on each row's item (a leaf), the leaf's
ancestors (positives, label 1) and, at every level, nodes drawn from that level (negatives,
label 0), each sampled row holding the node's attributes in the item columns and the row's own
values in the others.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from dynarec.config.base import Activation, Count, Strict

__all__ = ["MultiWindowDINCfg", "TDMCfg", "TDMSamplerCfg"]


class TDMSamplerCfg(Strict):
    """The tree and its layer-wise sampling (TorchEasyRec's ``tdm_sampler``).

    ``item_input_path``: the node table, graph-learn's layout as TorchEasyRec's tools write it
    (``id:int64  weight:float  feature:string``, the feature the node's level, its id and the
    ``attr_fields`` values joined by ``attr_delimiter``); ``edge_input_path``: the edge table,
    each leaf to each of its ancestors below the root (``src_id:int64  dst_id:int64
    weight:float``). ``dynarec tdm init-tree`` and ``cluster-tree`` write both.
    ``layer_num_sample[i]``: the negatives a row gets at level ``i`` (the root's: 0), one entry a
    level of the tree. ``remain_ratio`` < 1: each batch trains that share of the levels between
    the root and the leaves (drawn by ``probability_type``), the leaves always."""

    item_input_path: str
    edge_input_path: str
    item_id_field: str
    attr_fields: list[str] = Field(default_factory=list)
    layer_num_sample: list[int] = Field(min_length=2)
    attr_delimiter: str = Field(",", min_length=1)
    field_delimiter: Optional[str] = None  # of a text table's fields (default a tab)
    remain_ratio: float = Field(1.0, gt=0, le=1)
    probability_type: Literal["UNIFORM", "ARITHMETIC", "RECIPROCAL"] = "UNIFORM"

    @model_validator(mode="after")
    def _samples(self):
        if self.layer_num_sample[0] != 0:
            raise ValueError(
                f"layer_num_sample[0]: the root level has no negatives (0), got {self.layer_num_sample[0]}"
            )
        bad = [i for i, k in enumerate(self.layer_num_sample) if k < 0]
        if bad:
            raise ValueError(
                f"layer_num_sample[{bad[0]}]: a count of negatives >= 0, got {self.layer_num_sample[bad[0]]}"
            )
        if self.item_id_field in self.attr_fields:
            raise ValueError(
                f"attr_fields: '{self.item_id_field}' is the item_id_field (a node's id), not an attribute"
            )
        return self

    @property
    def item_columns(self) -> list[str]:
        """The columns a sampled node fills: the item id, then the attributes."""
        return [self.item_id_field, *self.attr_fields]


class MultiWindowDINCfg(Strict):
    """DIN attention summed over consecutive windows of the history (TorchEasyRec's
    ``MultiWindowDINEncoder``): ``windows_len`` the windows' lengths, newest first; the attention
    MLP's hidden units and activation (``prelu``: TorchEasyRec's ``nn.PReLU``)."""

    windows_len: list[Count] = Field(min_length=1)
    attn_hidden_units: list[Count] = Field([36], min_length=1)
    attn_activation: Activation = "prelu"


class TDMCfg(Strict):
    """TorchEasyRec's TDM: the multi-window DIN over the model's sequence group, concatenated with
    every deep group, through the final MLP (``final_batch_norm``: TorchEasyRec's ``use_bn``) to
    one logit."""

    multiwindow_din: MultiWindowDINCfg
    final_hidden_units: list[Count] = Field([256, 128, 64, 32], min_length=1)
    final_activation: Activation = "relu"
    final_batch_norm: bool = False
