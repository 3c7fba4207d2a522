"""The dense models' input contract, shared by training and serving."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from dynarec.devices import to_device

__all__ = ["align_sequences", "model_inputs", "pool_elements"]


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


def pool_elements(seq: torch.Tensor, element_lengths: torch.Tensor, pooling: str) -> torch.Tensor:
    """A sequence of several ids an element: its ids' rows ``[B, T, D]`` (each row's ids in order,
    zero-padded) pooled per element, ``element_lengths [B, L]`` ids each (0 past the row's
    elements), by ``pooling`` (``sum`` or ``mean``): ``[B, L, D]``, zeros past a row's elements."""
    b, t, d = seq.shape
    ends = element_lengths.cumsum(1)  # [B, L]: where each element's ids end
    positions = torch.arange(t, device=seq.device).expand(b, t).contiguous()
    element = torch.searchsorted(ends, positions, right=True)  # [B, T]; past the row's ids: L
    out = seq.new_zeros(b, element_lengths.shape[1] + 1, d).scatter_add_(1, element[..., None].expand(b, t, d), seq)
    out = out[:, :-1].contiguous()  # (an exported program's inputs are contiguous)
    if pooling == "mean":
        out = out / element_lengths.clamp(min=1).to(seq.dtype)[..., None]
    return out


def model_inputs(
    embeddings,
    batch,
    sequence_features: list[str],
    device: torch.device | str = "cpu",
    element_pooling: Optional[dict[str, str]] = None,
):
    """``(embeddings, sequence lengths, dense features)`` for a dense model, from a batch with
    ``.sparse`` (a KJT), ``.dense``, ``.element_lengths`` and ``.sequence_lengths(names)``, looked
    up in the ``embeddings`` collection; a sequence of several ids an element pooled per element
    by ``element_pooling[name]``. Training, export and serving all go through here, so exported
    predictions see exactly the inputs eval does."""
    # One copy for the batch's tensors that lie in one buffer (a DataLoader worker's batch)
    host_lengths = batch.sequence_lengths(sequence_features)
    moved = iter(to_device([*batch.dense.values(), *host_lengths.values()], torch.device(device)))
    dense = {k: next(moved) for k in batch.dense}
    lengths = {k: next(moved).long() for k in host_lengths}  # (narrower where they travelled so)
    emb = embeddings(batch.sparse)
    for name, pooling in (element_pooling or {}).items():
        emb[name] = pool_elements(emb[name], batch.element_lengths[name].to(device, non_blocking=True), pooling)
    emb, dense = align_sequences(emb, dense, sequence_features)
    return emb, lengths, dense
