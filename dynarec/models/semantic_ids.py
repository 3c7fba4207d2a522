"""A semantic-ID model's task at run time (``model.sid_rqvae``, ``model.sid_rqkmeans``): its losses,
predictions and metrics, in the shape of :class:`~dynarec.models.tasks.Tasks`.

The model (:mod:`dynarec.models.sid`) gives one float32 row a batch row, laid out by
:class:`SidLayout`: the row's codes (``L`` layers), its reconstruction ``x_hat`` and input ``x``
(``D`` each), RQ-VAE's encoder output ``z`` and the cumulative quantized sums ``q_1..q_L``
(``E`` each), with a pair contrastive objective the same for the row's second view, its pair
flag and the three learned logit scales, then the candidate codes and their distances. The
losses (TorchEasyRec's ``SidReconLoss``, ``SidCommitmentLoss``, ``SidContrastiveLoss``) are
means over the global batch; each rank's loss is its share, so that the ranks' summed gradients
are the global batch's (TorchEasyRec averages each rank's own means instead: the same in one
process)::

    recon       mean over the reconstructed rows of d(x_hat, x)      (the pair rows left out)
    commitment  w1 * mean d(z, sg(q_k)) + w2 * mean d(sg(z), q_k)    (over rows, layers; both views)
    contrastive (1/3) sum over (self, ori, cl) of the masked InfoNCE of the pair rows

each ``d`` of its loss's type (``l2``/``l1``: averaged over the numbers; ``cos``: 1 - cosine).
The step's loss is their sum. A row's predictions are its ``codes`` (int64 ``[L]``), with
``candidate_output`` its ``candidate_codes`` ``[K * L]`` and ``candidate_scores`` ``[K]``, and
its reconstruction's errors ``reconstruction_mse`` and ``reconstruction_rel_l1`` (the mean over
its numbers of ``|x - x_hat| / (max(|x|, |x_hat|) + 1e-4)``); the metrics are their means over
the evaluated rows (the pair rows left out) and ``unique_sid_ratio``: the distinct code tuples
over the rows — over the whole evaluation, where TorchEasyRec averages it batch by batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
import torch.nn.functional as F

from dynarec.config.schema import Config
from dynarec.config.sid import SidRqvaeCfg

__all__ = ["LOGIT_SCALE_INIT", "SemanticIds", "SidLayout"]

# CLIP's temperature start, log(1 / 0.07), and the cap before exp, log(100) (TorchEasyRec's).
LOGIT_SCALE_INIT = math.log(1 / 0.07)
LOGIT_SCALE_MAX = math.log(100)
REL_L1_EPSILON = 1e-4


@dataclass(frozen=True)
class SidLayout:
    """Where each part of a semantic-ID model's output row lies (module doc): ``layers`` codes,
    inputs ``dim`` wide, RQ-VAE latents ``latent`` wide (0: RQ-KMeans), a second view when
    ``pairs``, ``top_k`` candidates (0: none)."""

    layers: int
    dim: int
    latent: int = 0
    pairs: bool = False
    top_k: int = 0

    def _view_widths(self) -> list[tuple[str, int]]:
        return [("x_hat", self.dim), ("x", self.dim), ("z", self.latent), ("latents", self.layers * self.latent)]

    def widths(self) -> list[tuple[str, int]]:
        """``(part, width)`` in order."""
        parts = [("codes", self.layers), *self._view_widths()]
        if self.pairs:
            parts += [(f"pair_{name}", w) for name, w in self._view_widths()]
            parts += [("pair_flag", 1), ("logit_scales", 3)]
        if self.top_k:
            parts += [("candidate_codes", self.top_k * self.layers), ("candidate_scores", self.top_k)]
        return parts

    @property
    def width(self) -> int:
        return sum(w for _, w in self.widths())

    def pack(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[B, width]`` float32 of ``parts`` (each ``[B, ...]``; the latents ``[B, L, E]``)."""
        rows = parts["codes"].shape[0]
        return torch.cat([parts[name].reshape(rows, w).float() for name, w in self.widths() if w], dim=1)

    def unpack(self, out: torch.Tensor) -> dict[str, torch.Tensor]:
        """The parts of ``out [B, width]`` (views; the latents ``[B, L, E]``)."""
        if out.shape[1] != self.width:
            raise ValueError(f"the semantic-ID model gave {out.shape[1]} numbers a row, its layout holds {self.width}")
        parts, at = {}, 0
        for name, w in self.widths():
            parts[name] = out[:, at : at + w]
            at += w
        for name in ("latents", "pair_latents"):
            if name in parts:
                parts[name] = parts[name].reshape(out.shape[0], self.layers, self.latent)
        return parts


def layout_of(config: Config, input_dim: int) -> SidLayout:
    """The output layout of ``config``'s semantic-ID model reading ``input_dim`` numbers a row."""
    cfg = config.model.sid
    top_k = cfg.candidate_output.top_k if cfg.candidate_output is not None else 0
    if isinstance(cfg, SidRqvaeCfg):
        return SidLayout(len(cfg.codebook), input_dim, cfg.embed_dim, cfg.contrastive is not None, top_k)
    return SidLayout(len(cfg.codebook), input_dim, top_k=top_k)


def _distance(kind: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row distances ``[...]`` of ``a``, ``b`` ``[..., D]`` (l2 / l1: averaged over D)."""
    if kind == "cos":
        return 1 - F.cosine_similarity(a, b, dim=-1)
    diff = a - b
    return (diff.abs() if kind == "l1" else diff.square()).mean(dim=-1)


def _logits_scale(raw: torch.Tensor) -> torch.Tensor:
    return raw.clamp(max=LOGIT_SCALE_MAX).exp()


def world_size() -> int:
    """The processes of the run (the default process group's), 1 without one."""
    return dist.get_world_size() if dist.is_initialized() else 1


def _gather_rows(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """Every rank's rows of each of ``tensors`` (``[rows, ...]``, as many rows each), rank after rank
    (differentiable; ranks may hold different row counts), and where this rank's rows start. In
    one process: the tensors as they are, and 0."""
    if world_size() == 1:
        return tensors, 0
    rows = tensors[0].shape[0]
    counts = [torch.zeros(1, dtype=torch.long, device=tensors[0].device) for _ in range(world_size())]
    dist.all_gather(counts, torch.tensor([rows], device=tensors[0].device))
    sizes = [int(c) for c in counts]
    most = max(sizes)
    keep = torch.cat([torch.arange(most, device=tensors[0].device) < n for n in sizes])
    out = []
    for t in tensors:
        padded = F.pad(t, (0, 0) * (t.dim() - 1) + (0, most - rows))
        out.append(torch.cat(dist_nn.all_gather(padded), dim=0)[keep])
    return out, sum(sizes[: dist.get_rank()])


def contrastive_loss(
    parts: dict[str, torch.Tensor],
    pair: torch.Tensor,
    global_pairs: torch.Tensor,
) -> torch.Tensor:
    """This rank's share of the masked InfoNCE of the pair rows (TorchEasyRec's
    ``SidContrastiveLoss``): each pair row's normalized reconstruction ``a`` (view 1) and ``b``
    (view 2) against every rank's pair rows' targets (self: the other view's reconstruction; ori:
    the other view's input; cl: its own view's input), cross-entropy of its own row, both views
    averaged, the three groups averaged; divided by the global number of pair rows."""
    a = F.normalize(parts["x_hat"], dim=-1, p=2)
    b = F.normalize(parts["pair_x_hat"], dim=-1, p=2)
    (a_all, b_all, a_ori, b_ori, pair_all), start = _gather_rows(
        [a, b, parts["x"], parts["pair_x"], pair.float()[:, None]]
    )
    rows = a.shape[0]
    if rows == 0:  # this rank's share is empty (it took part in the gathers)
        return a.sum() * 0
    own = start + torch.arange(rows, device=a.device)
    safe = torch.where(pair, own, own.new_zeros(()))  # a non-pair row's term is masked out below
    masked = (pair_all[:, 0] < 0.5)[None, :]
    scales = parts["logit_scales"][0]
    weight = pair.float() / (2 * global_pairs.clamp_min(1))
    total = a.new_zeros(())
    for k, (a_target, b_target) in enumerate(((b_all, a_all), (b_ori, a_ori), (a_ori, b_ori))):
        scale = _logits_scale(scales[k])
        logits_a = (scale * a @ a_target.T).masked_fill(masked, torch.finfo(a.dtype).min)
        logits_b = (scale * b @ b_target.T).masked_fill(masked, torch.finfo(a.dtype).min)
        ce = F.cross_entropy(logits_a, safe, reduction="none") + F.cross_entropy(logits_b, safe, reduction="none")
        total = total + (torch.nan_to_num(ce, nan=0.0) * weight).sum()
    return total / 3


def _mean(x: np.ndarray) -> float:
    return float(np.mean(x)) if len(x) else float("nan")


class SemanticIds:
    """The task of a semantic-ID model (module doc)."""

    def __init__(self, config: Config, input_dim: int):
        cfg = config.model.sid
        self.layout = layout_of(config, input_dim)
        self.recon = cfg.recon_loss if isinstance(cfg, SidRqvaeCfg) else None
        self.commitment = cfg.commitment_loss if isinstance(cfg, SidRqvaeCfg) else None
        self.pairs = isinstance(cfg, SidRqvaeCfg) and cfg.contrastive is not None

    def loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        global_rows: Union[int, torch.Tensor],
        global_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        sessions: Optional[torch.Tensor] = None,
        teaching=None,
        hard_negative_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """This rank's share of the step's loss over the global batch (module doc); ``labels``
        ``[B, 0]`` (none is read). RQ-KMeans trains nothing: its loss is 0 (times the output, so
        that the step's backward runs)."""
        parts = self.layout.unpack(logits)
        loss = 0 * logits.sum()
        pair = parts["pair_flag"][:, 0] > 0.5 if self.pairs else None
        pairs_total: Optional[torch.Tensor] = None
        if pair is not None:
            counts = torch.stack([pair.sum(), (~pair).sum()]).float()
            pairs_total = global_sum(counts) if global_sum is not None else counts
        if self.recon is not None:
            rows = _distance(self.recon.type, parts["x_hat"], parts["x"])
            if pair is None:
                loss = loss + rows.sum() / global_rows
            else:
                assert pairs_total is not None
                loss = loss + (rows * (~pair).float()).sum() / pairs_total[1].clamp_min(1)
        if self.commitment is not None:
            w1, w2 = self.commitment.latent_weight
            kind = self.commitment.type
            views = [("z", "latents")] + ([("pair_z", "pair_latents")] if self.pairs else [])
            terms = len(views) * self.layout.layers
            for z_name, q_name in views:
                z, q = parts[z_name][:, None, :], parts[q_name]
                loss = loss + w1 * _distance(kind, z, q.detach()).sum() / (global_rows * terms)
                loss = loss + w2 * _distance(kind, z.detach(), q).sum() / (global_rows * terms)
        if pair is not None:
            assert pairs_total is not None
            loss = loss + contrastive_loss(parts, pair, pairs_total[0])
        return loss

    # -- predictions ---------------------------------------------------------------------------

    def output_names(self) -> list[str]:
        names = ["codes"]
        if self.layout.top_k:
            names += ["candidate_codes", "candidate_scores"]
        names += ["reconstruction_mse", "reconstruction_rel_l1"]
        return names + (["pair_flag"] if self.pairs else [])

    @property
    def logits_width(self) -> int:
        """The numbers a row of the model's output holds (:class:`SidLayout`)."""
        return self.layout.width

    def served_names(self) -> list[str]:
        """What an export serves: the codes (and the candidates)."""
        return ["codes", *(["candidate_codes", "candidate_scores"] if self.layout.top_k else [])]

    def served(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.predictions(logits)
        return {name: out[name] for name in self.served_names()}

    def predictions(
        self, logits: torch.Tensor, rows: Optional[int] = None, hard_negative_rows: Optional[torch.Tensor] = None
    ) -> dict[str, torch.Tensor]:
        """``{"codes": [B, L] int64, ("candidate_codes": [B, K * L] int64, "candidate_scores":
        [B, K] float32,) "reconstruction_mse": [B], "reconstruction_rel_l1": [B] (, "pair_flag":
        [B])}`` (module doc)."""
        parts = self.layout.unpack(logits.float())
        x, x_hat = parts["x"], parts["x_hat"]
        rel = (x - x_hat).abs() / (torch.maximum(x.abs(), x_hat.abs()) + REL_L1_EPSILON)
        out = {"codes": parts["codes"].round().long()}
        if self.layout.top_k:
            out["candidate_codes"] = parts["candidate_codes"].round().long()
            out["candidate_scores"] = parts["candidate_scores"]
        out["reconstruction_mse"] = (x - x_hat).square().mean(dim=1)
        out["reconstruction_rel_l1"] = rel.mean(dim=1)
        if self.pairs:
            out["pair_flag"] = (parts["pair_flag"][:, 0] > 0.5).float()
        return out

    def metrics(
        self, predictions: dict[str, np.ndarray], labels: np.ndarray, groups: Optional[np.ndarray]
    ) -> dict[str, float]:
        """``mse`` and ``rel_l1`` of the reconstructions (the pair rows left out) and
        ``unique_sid_ratio`` (module doc)."""
        codes = predictions["codes"]
        keep = predictions["pair_flag"] < 0.5 if self.pairs else np.ones(len(codes), dtype=bool)
        unique = len(np.unique(codes, axis=0)) / len(codes) if len(codes) else float("nan")
        return {
            "mse": _mean(predictions["reconstruction_mse"][keep]),
            "rel_l1": _mean(predictions["reconstruction_rel_l1"][keep]),
            "unique_sid_ratio": unique,
        }
