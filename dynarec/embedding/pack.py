"""Stages 1 and 3 of a table's forward: **pack** (features -> weighted bags) and **unpack**
(pooled bags -> feature outputs).

A table's forward is ``unpack(lookup(pack(features)))``:

1. :func:`pack` turns every feature a table serves into one list of weighted bags over ids: a
   pooled feature's sample is a bag; a sequence feature's every position of the padded
   ``[B, L]`` is a bag (one id, or none past the sample's length: a zero row), so the lookup
   writes the padded output itself; mean pooling puts ``1/L`` (``L`` the sample's full length)
   into the per-sample weights. It is pure and runs where the batch is — sharding sends its
   output to the rows' owners (a sequence's ids there a bag each: no empty bags to send).
2. ``lookup`` (the table's) turns ids into rows and pools each bag: ``[num_bags, D]``; it is the
   autograd boundary where the fused optimizer runs in backward. GPU kernels replace it.
3. :func:`unpack` splits the pooled bags back into features: ``[B, D]`` for pooled features,
   zero-padded ``[B, L, D]`` for sequences (a view of the lookup's output where it padded).

Neither pack nor unpack reads a tensor's value on the host (no device sync): every size they need
is carried on the host by the batch (``FeatureSlice.num_ids`` / ``max_length``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from dynarec.embedding.config import Pooling
from dynarec.embedding.jagged import FeatureSlice

__all__ = ["BagLayout", "Bags", "FeatureBags", "pack", "pad_sequence_rows", "unpack"]


@dataclass
class Bags:
    """Weighted bags over ids: what pack produces and lookup consumes.

    ``ids`` ``[n]`` int64 (row ids of a fixed table, keys of a dynamic one); ``offsets``
    ``[num_bags + 1]`` int64 CSR offsets into ``ids``; ``weights`` ``[n]`` float32 or None (all
    ones). Bag ``b`` pools ``sum_i weights[i] * row(ids[i])`` over ``i`` in its range.
    """

    ids: torch.Tensor
    offsets: torch.Tensor
    weights: Optional[torch.Tensor]

    @property
    def num_bags(self) -> int:
        return self.offsets.numel() - 1


@dataclass(frozen=True)
class FeatureBags:
    """One feature's share of the bags: ``num_bags`` consecutive bags, unpacked as ``pooling``.
    ``lengths`` ``[B]`` are the samples' lengths; ``max_length`` their max (host int). ``dim``:
    the feature's columns of bags wider than its table (packed rows of several dims), or None
    (all of them). ``padded``: a sequence's bags are its ``B x max_length`` positions (else its
    ids, one bag each)."""

    name: str
    pooling: Pooling
    num_bags: int
    lengths: torch.Tensor
    max_length: int
    dim: Optional[int] = None
    padded: bool = False


@dataclass(frozen=True)
class BagLayout:
    """How :func:`unpack` splits ``[num_bags, D]`` back into features (stays on the batch's rank)."""

    features: tuple[FeatureBags, ...]


def pack(
    inputs: Sequence[tuple[str, Pooling, FeatureSlice]],
    dims: Optional[Sequence[int]] = None,
    pad_sequences: bool = True,
) -> tuple[Bags, BagLayout]:
    """Packs the features ``(name, pooling, slice)`` of one table into one list of bags
    (``dims``: each feature's dim, where the bags are wider: packed rows of several tables).

    Mean pooling divides by each sample's full length ``L`` through the per-sample weights
    (FBGEMM's GPU meaning, with or without per-sample weights); an empty bag pools to zeros.

    A sequence feature (pooling ``none``) of ``B`` samples, the longest ``L`` long, is ``B * L``
    bags with ``pad_sequences``: position ``p`` of sample ``b`` is a bag holding its ``p``-th id,
    empty past its length. Its pooled rows are then the padded ``[B, L, D]`` output itself, and
    its gradient reaches the update as it is (no id reads an empty bag's): no padding pass
    forward, no gather backward, and a bag count that does not change with the samples' lengths
    (a captured update recurs). Without it (bags sent to other ranks: no empty bags to send),
    each id is a bag and :func:`unpack` pads. The ids and weights are the same either way.
    """
    ids, lengths, weights, layout = [], [], [], []
    need_weights = any(p == "mean" or s.weights is not None for _, p, s in inputs)
    for i, (name, pooling, s) in enumerate(inputs):
        ids.append(s.values)
        # every sample full: the padded bags are the ids' own
        full = pooling == "none" and s.num_ids == s.lengths.numel() * s.max_length
        padded = pooling == "none" and pad_sequences and not full
        if padded:
            positions = torch.arange(s.max_length, device=s.lengths.device, dtype=s.lengths.dtype)
            lengths.append((positions < s.lengths.unsqueeze(1)).flatten().to(s.lengths.dtype))
            num_bags = s.lengths.numel() * s.max_length
        elif pooling == "none":
            lengths.append(torch.ones_like(s.values))
            num_bags = s.num_ids
        else:
            lengths.append(s.lengths)
            num_bags = s.lengths.numel()
        w = s.weights
        if pooling == "mean":
            inv = 1.0 / s.lengths.clamp(min=1).to(torch.float32)
            scale = torch.repeat_interleave(inv, s.lengths, output_size=s.num_ids)
            w = scale if w is None else w * scale
        if need_weights:
            weights.append(w if w is not None else torch.ones(s.num_ids, device=s.values.device))
        dim = None if dims is None else dims[i]
        layout.append(FeatureBags(name, pooling, num_bags, s.lengths, s.max_length, dim, padded or full))
    if all(f.pooling != "none" and f.num_bags == s.num_ids and f.max_length <= 1 for f, (*_, s) in zip(layout, inputs)):
        # every bag holds one id (a sum of B ids of at most 1 each is all ones): no lengths to add
        offsets = torch.arange(sum(f.num_bags for f in layout) + 1, device=ids[0].device)
    else:
        all_lengths = _cat(lengths)
        offsets = torch.cat([all_lengths.new_zeros(1), torch.cumsum(all_lengths, 0)])
    bags = Bags(_cat(ids), offsets, _cat(weights) if need_weights else None)
    return bags, BagLayout(tuple(layout))


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat``, without its copy where the tensors are consecutive pieces of one 1-D
    tensor (a batch's features in its order, split by ``split_features``: their span is a view)
    or one tensor (itself). No stage writes into its inputs."""
    if len(tensors) == 1:
        return tensors[0]
    span = _span(tensors)
    return torch.cat(tensors) if span is None else span


def _span(tensors: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensors as one view where each 1-D piece follows the last in one storage, else None
    (also for a tensor needing a gradient: the view's would reach the first piece only). Two
    storages may begin at one address (views of one numpy array): the span must also lie
    within the first one's bytes."""
    first = tensors[0]
    storage = first.untyped_storage()
    address, start = storage.data_ptr(), first.storage_offset()
    at = start
    for t in tensors:
        if (
            t.dim() != 1
            or t.requires_grad
            or t.dtype != first.dtype
            or t.device != first.device
            or (t.numel() > 1 and t.stride(0) != 1)
            or t.storage_offset() != at
            or t.untyped_storage().data_ptr() != address
        ):
            return None
        at += t.numel()
    if at * first.element_size() > storage.nbytes():
        return None
    return first.as_strided((at - start,), (1,), start)


def unpack(pooled: torch.Tensor, layout: BagLayout) -> dict[str, torch.Tensor]:
    """``[num_bags, D]`` -> ``{feature: [B, D]}`` (pooled) or ``{feature: [B, L, D]}`` (sequence,
    zero-padded, ``L`` the batch's longest)."""
    out: dict[str, torch.Tensor] = {}
    # One split, not a slice per feature: its backward is one concatenation of the features'
    # gradients, where slices would each scatter into a zero tensor of all the bags.
    chunks = pooled.split([f.num_bags for f in layout.features]) if len(layout.features) > 1 else (pooled,)
    for f, chunk in zip(layout.features, chunks):
        if f.dim is not None and f.dim < chunk.shape[1]:  # packed rows: the feature's own columns
            chunk = chunk[:, : f.dim]
            if f.pooling != "none":  # a model may view it ([B, D] as any table's output is)
                chunk = chunk.contiguous()
        if f.padded:  # contiguous (a copy only of columns sliced here or by the store): a model may view it
            chunk = chunk.contiguous().view(f.lengths.numel(), f.max_length, chunk.shape[1])
        elif f.pooling == "none":
            chunk = pad_sequence_rows(chunk, f.lengths, f.max_length)
        out[f.name] = chunk
    return out


def pad_sequence_rows(rows: torch.Tensor, lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """Jagged ``[n, D]`` (sample-major) -> padded ``[B, max_length, D]``, zeros past each length.

    Differentiable w.r.t. ``rows``; ``max_length`` must be ``lengths.max()`` (0 when empty).
    """
    batch, n, dim = lengths.numel(), rows.shape[0], rows.shape[1]
    starts = torch.cumsum(lengths, 0) - lengths
    sample = torch.repeat_interleave(torch.arange(batch, device=rows.device), lengths, output_size=n)
    position = torch.arange(n, device=rows.device) - starts[sample]
    # in place into fresh zeros: index_copy would clone them first (a pass over [B * L, D])
    flat = rows.new_zeros(batch * max_length, dim).index_copy_(0, sample * max_length + position, rows)
    return flat.view(batch, max_length, dim)
