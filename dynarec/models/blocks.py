"""The blocks the models compose: a deep group's input (its features and sequence encoders),
and, from their own modules, MLPs, sequence groups and DIN attention."""

from __future__ import annotations

import torch
from torch import nn

from dynarec.config.schema import Config, FeatureGroupCfg
from dynarec.models.features import FeatureInputs
from dynarec.models.mlp import MLP, Dice
from dynarec.models.pooling import masked_mean, sequence_mask
from dynarec.models.sequence import DINAttention, SequenceGroup, sequence_encoder
from dynarec.models.variational_dropout import VariationalDropout

__all__ = ["MLP", "DINAttention", "DeepGroup", "Dice", "SequenceGroup", "masked_mean", "sequence_mask"]


class DeepGroup(nn.Module):
    """A deep (or wide) group: its members pooled and concatenated, then its sequence encoders'
    outputs, ``[B, out_dim]`` (id features' rows, sequences mean-pooled, dense numbers or their
    dense embeddings; see :class:`~dynarec.models.features.FeatureInputs`, shared by the model's
    groups; the encoders of ``sequence_groups`` in :mod:`dynarec.models.sequence`)."""

    out_dim: int

    def __init__(self, config: Config, group: FeatureGroupCfg, inputs: FeatureInputs):
        super().__init__()
        self.names = list(group.feature_names)
        self.inputs = [inputs]  # in a list: the model owns it (its parameters are not the group's)
        self.sequences: list[SequenceGroup] = []
        self.encoders = nn.ModuleList()
        for where, cfg, seq_cfg in group.encoded_sequences():
            where = f"model.feature_groups '{group.group_name}' {where} (input '{seq_cfg.group_name}')"
            seq = SequenceGroup(where, seq_cfg.feature_names, inputs, need_query=cfg.pooling_encoder is None)
            self.sequences.append(seq)
            self.encoders.append(sequence_encoder(where, cfg, seq))
        widths = [inputs[n].width for n in self.names] + [s.dim for s in self.sequences]
        self.out_dim = sum(widths)
        vd = config.model.variational_dropout
        # TorchEasyRec's rank models apply it to every group of more than one part.
        self.dropout = VariationalDropout(widths, vd.regularization_lambda) if vd and len(widths) > 1 else None

    def parts(self, embeddings, seq_lengths, dense) -> list[torch.Tensor]:
        parts = [self.inputs[0].pooled(n, embeddings, seq_lengths, dense) for n in self.names]
        for seq, encoder in zip(self.sequences, self.encoders):
            parts.append(encoder(*seq(embeddings, seq_lengths, dense)))
        return parts

    def forward(self, embeddings, seq_lengths, dense) -> torch.Tensor:
        x = torch.cat(self.parts(embeddings, seq_lengths, dense), dim=1)
        return self.dropout(x) if self.dropout is not None else x
