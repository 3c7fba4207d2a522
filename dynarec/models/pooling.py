"""Pooling over padded sequences, masked by their lengths."""

from __future__ import annotations

import torch

__all__ = ["masked_mean", "masked_sum", "sequence_mask"]


def sequence_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[B, max_len]`` bool: position ``l`` of sample ``b`` holds an element (``l < lengths[b]``)."""
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


def masked_mean(seq: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean of each sample's first ``lengths[b]`` rows of a padded ``[B, L, D]``: ``[B, D]``,
    zeros for an empty sequence. What the padding holds, and how long ``L`` is (the longest
    sequence of the batch), never changes the result: a row's score depends on that row alone.
    Every model pools a sequence through here."""
    mask = sequence_mask(lengths, seq.shape[1]).to(seq.dtype)
    return torch.bmm(mask[:, None, :], seq).squeeze(1) / lengths.clamp(min=1).to(seq.dtype)[:, None]


def masked_sum(seq: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sum of each sample's first ``lengths[b]`` rows of a padded ``[B, L, D]``: ``[B, D]``
    (zeros for an empty sequence; the padding never read)."""
    mask = sequence_mask(lengths, seq.shape[1]).to(seq.dtype)
    return torch.bmm(mask[:, None, :], seq).squeeze(1)
