"""The dense models' input contract, shared by training and serving."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["align_sequences", "model_inputs"]


def align_sequences(embeddings: dict[str, torch.Tensor], names: list[str], min_len: int = 2) -> dict[str, torch.Tensor]:
    """Zero-pads every sequence embedding ``[B, L_f, D]`` to one length ``L = max(L_f, min_len)``.

    Sequence groups concatenate their features along the dim, which needs one ``L``; a fixed
    minimum of 2 keeps exported programs free of 0/1-length specialisation. Padding is masked
    out by the lengths, so it changes no result.
    """
    if not names:
        return embeddings
    target = max([min_len] + [embeddings[n].shape[1] for n in names])
    out = dict(embeddings)
    for n in names:
        extra = target - out[n].shape[1]
        if extra:
            out[n] = F.pad(out[n], (0, 0, 0, extra))
    return out


def model_inputs(embeddings, batch, sequence_features: list[str], device: torch.device | str = "cpu"):
    """``(embeddings, sequence lengths, dense features)`` for a dense model, from a batch with
    ``.sparse`` (a KJT), ``.dense`` and ``.sequence_lengths(names)``, looked up in the
    ``embeddings`` collection. Training, export and serving all go through here, so exported
    predictions see exactly the inputs eval does."""
    emb = align_sequences(embeddings(batch.sparse), sequence_features)
    lengths = {k: v.to(device, non_blocking=True) for k, v in batch.sequence_lengths(sequence_features).items()}
    dense = {k: v.to(device, non_blocking=True) for k, v in batch.dense.items()}
    return emb, lengths, dense
