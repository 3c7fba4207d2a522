"""The dense models' input contract, shared by training and serving."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["align_sequences", "model_inputs"]


def align_sequences(
    embeddings: dict[str, torch.Tensor], dense: dict[str, torch.Tensor], names: list[str], min_len: int = 2
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Zero-pads every sequence named in ``names``, embedded ``[B, L_f, D]`` or dense
    ``[B, L_f(, value_dim)]``, to one length ``L = max(L_f, min_len)`` along dim 1.

    Sequence groups concatenate their features along the last dim, which needs one ``L``; one
    ``L`` for all also gives an exported program one sequence dimension, and the fixed minimum of
    2 keeps it free of 0/1-length specialisation. Padding is masked out by the lengths, so it
    changes no result.
    """
    present = [(d, n) for d in (embeddings, dense) for n in names if n in d]
    if not present:
        return embeddings, dense
    target = max([min_len] + [d[n].shape[1] for d, n in present])
    out = dict(embeddings), dict(dense)
    for d, n in present:
        x = d[n]
        extra = target - x.shape[1]
        if extra:
            padded = F.pad(x, [0, 0] * (x.dim() - 2) + [0, extra])
            (out[0] if d is embeddings else out[1])[n] = padded
    return out


def model_inputs(embeddings, batch, sequence_features: list[str], device: torch.device | str = "cpu"):
    """``(embeddings, sequence lengths, dense features)`` for a dense model, from a batch with
    ``.sparse`` (a KJT), ``.dense`` and ``.sequence_lengths(names)``, looked up in the
    ``embeddings`` collection. Training, export and serving all go through here, so exported
    predictions see exactly the inputs eval does."""
    dense = {k: v.to(device, non_blocking=True) for k, v in batch.dense.items()}
    emb, dense = align_sequences(embeddings(batch.sparse), dense, sequence_features)
    lengths = {k: v.to(device, non_blocking=True) for k, v in batch.sequence_lengths(sequence_features).items()}
    return emb, lengths, dense
