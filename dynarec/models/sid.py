"""Semantic-ID models: RQ-VAE (TorchEasyRec's ``SidRqvae``) and residual k-means (``SidRqkmeans``);
their configs are :mod:`dynarec.config.sid`, their task (losses, predictions, metrics)
:mod:`dynarec.models.semantic_ids`.

Both quantize residuals layer by layer: ``r_0 = x``; layer ``k`` (its ``r`` L2-normalized first
with ``normalize_residuals``) picks a code ``c_k`` and its vector ``e_k``, ``r_{k+1} = r_k - e_k``;
the quantized vector is ``sum_k e_k`` and the row's semantic id ``(c_0, ..., c_{L-1})``.

- RQ-VAE quantizes an encoder's output ``z`` with learned codebooks (``nn.Embedding``, Kaiming
  uniform): the nearest code by squared L2 or cosine distance, in training balanced by Sinkhorn
  (over every rank's rows) or drawn by a hard Gumbel-softmax; the decoder reads the quantized
  sum through a straight-through estimator (``z + sg(q - z)``, or the rotation trick), so the
  encoder learns from the reconstruction and the codebooks from the commitment loss.
- RQ-KMeans reads the input as it is; in training it only samples rows (reservoir sampling,
  seeded by ``train.seed``), and :meth:`SidRqkmeans.finish_training` fits each layer's centroids
  once by faiss's k-means.

Each model returns its :class:`~dynarec.models.semantic_ids.SidLayout` row a batch row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dynarec.config.schema import Config
from dynarec.config.sid import SidRqkmeansCfg, SidRqvaeCfg
from dynarec.models.blocks import MLP, DeepGroup
from dynarec.models.features import FeatureInputs
from dynarec.models.semantic_ids import LOGIT_SCALE_INIT, layout_of, world_size

__all__ = ["ReservoirSampler", "SidRqkmeans", "SidRqvae", "faiss_kmeans", "residual_kmeans", "sinkhorn"]

# One layer: the residual ``[B, D]`` -> (codes ``[B]`` int64, their vectors ``[B, D]``).
Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _all_reduce(x: torch.Tensor, op=None) -> torch.Tensor:
    """``x`` reduced over the ranks (sum, or ``op``), in place; as it is in one process."""
    if world_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM if op is None else op)
    return x


@torch.no_grad()
def sinkhorn(cost: torch.Tensor, iters: int, epsilon: float) -> torch.Tensor:
    """``[B, K]`` balanced assignment weights of ``cost [B, K]`` (TorchEasyRec's ``_sinkhorn``, the
    Sinkhorn-Knopp iteration): ``Q = exp(-cost * epsilon)`` normalized to sum 1, then ``iters``
    times each code's total to ``1 / K`` and each row's to ``1 / B``, ``B`` the rows over every
    rank (the sums too); returned times ``B``."""
    q = torch.exp(-cost * epsilon).t()
    k, rows = q.shape[0], q.shape[1] * world_size()
    q /= _all_reduce(q.sum()) + 1e-8
    for _ in range(iters):
        q /= _all_reduce(q.sum(dim=1, keepdim=True)) + 1e-8
        q /= k
        q /= q.sum(dim=0, keepdim=True) + 1e-8
        q /= rows
    q *= rows
    return q.t()


@torch.no_grad()
def standardized_cost(distances: torch.Tensor) -> torch.Tensor:
    """``distances [B, K]`` standardized over all of them (every rank's: the mean and the
    population standard deviation) and shifted so that the smallest is 0: Sinkhorn's cost.
    TorchEasyRec standardizes each rank's alone: the same in one process."""
    n = _all_reduce(distances.new_tensor(float(distances.numel())))
    mean = _all_reduce(distances.sum()) / n
    std = (_all_reduce((distances - mean).square().sum()) / n).sqrt()
    cost = (distances - mean) / std.add(1e-12)
    low = cost.min() if cost.numel() else cost.new_tensor(float("inf"))  # a rank may hold no row
    return cost - _all_reduce(low, dist.ReduceOp.MIN)


def squared_l2(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` float32 squared L2 distances of ``x [B, D]`` to ``w [K, D]``, ``|x|^2 - 2 x.w +
    |w|^2`` clamped at 0 (what ``torch.cdist`` computes past 25 rows; one formula for every batch
    size, so that an export traces it for any), in float32 under autocast too: in bf16 the
    difference cancels (the nearest code of 58% of rows against 98.7% with cdist, measured)."""
    with torch.autocast(x.device.type, enabled=False):
        x, w = x.float(), w.float()
        d = x.square().sum(1, keepdim=True) - 2 * x @ w.t() + w.square().sum(1)[None, :]
    return d.clamp_min(0)


def residual_walk(
    x: torch.Tensor, layers: list[Quantize], normalize: bool
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The residual quantization of ``x [B, D]`` (module doc): ``(codes [B, L], the quantized sum
    [B, D], the cumulative sums q_1..q_L, the last layer's input)``. A layer's vector is
    subtracted without its gradient and summed with it."""
    residual, total = x, torch.zeros_like(x)
    codes, cumulative = [], []
    for quantize in layers:
        if normalize:
            residual = F.normalize(residual, dim=-1)
        last_input = residual
        ids, vectors = quantize(residual)
        codes.append(ids)
        total = total + vectors
        cumulative.append(total)
        residual = residual - vectors.detach()
    return torch.stack(codes, dim=-1), total, cumulative, last_input


def candidates(codes: torch.Tensor, distances: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's ``top_k`` nearest codes (``distances [B, K]`` of its input), each after
    the row's other codes: ``([B, top_k, L] codes, [B, top_k] distances)``, the nearest first."""
    scores, ids = torch.topk(distances, k=top_k, dim=-1, largest=False)
    prefix = codes[:, None, :-1].expand(-1, top_k, -1)
    return torch.cat([prefix, ids[..., None]], dim=-1), scores


def faiss_kmeans(x: np.ndarray, clusters: int, kwargs: dict):
    """A trained ``faiss.Kmeans`` of ``x [N, D]`` float32 into ``clusters`` centroids."""
    import faiss

    if x.shape[0] < clusters:
        raise ValueError(f"{x.shape[0]} rows cannot fit {clusters} centroids")
    km = faiss.Kmeans(x.shape[1], clusters, **kwargs)
    km.train(x)
    return km


def residual_kmeans(x: np.ndarray, codebook: list[int], normalize: bool, kwargs: dict) -> list[np.ndarray]:
    """Each layer's centroids ``[K_l, D]``: layer ``l`` fitted by faiss's k-means on the residuals
    the layers before it leave (each row less its nearest centroid), L2-normalized first with
    ``normalize``. ``x`` is not modified."""
    x = np.array(x, dtype=np.float32, copy=True)
    out = []
    for clusters in codebook:
        if normalize:
            x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        km = faiss_kmeans(x, clusters, kwargs)
        centroids = np.array(km.centroids, dtype=np.float32)
        for start in range(0, len(x), 1 << 19):  # assignments in chunks: a bounded distance buffer
            _, idx = km.index.search(x[start : start + (1 << 19)], 1)
            x[start : start + (1 << 19)] -= centroids[idx[:, 0]]
        out.append(centroids)
    return out


class VectorQuantizer(nn.Module):
    """One RQ-VAE layer: a learned codebook ``[n, dim]`` and its code assignment (module doc)."""

    def __init__(self, n: int, dim: int, cfg: SidRqvaeCfg):
        super().__init__()
        self.codebook = nn.Embedding(n, dim)
        nn.init.kaiming_uniform_(self.codebook.weight)
        self.cfg = cfg

    def distances(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, n]``: squared L2, or minus the cosine similarity."""
        w = self.codebook.weight
        if self.cfg.distance_type == "l2":
            return squared_l2(x, w)
        with torch.autocast(x.device.type, enabled=False):  # float32, as squared_l2
            return -(F.normalize(x.float(), p=2, dim=1) @ F.normalize(w.float(), p=2, dim=1).t())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if self.training and cfg.forward_mode == "gumbel_softmax":
            weights = F.gumbel_softmax(-self.distances(x), tau=1.0, hard=True, dim=-1)
            return weights.argmax(dim=-1), weights @ self.codebook.weight
        with torch.no_grad():
            d = self.distances(x)
            if self.training and cfg.sinkhorn.enabled:
                ids = sinkhorn(standardized_cost(d), cfg.sinkhorn.iters, cfg.sinkhorn.epsilon).argmax(dim=-1)
            else:
                ids = d.argmin(dim=-1)
        return ids, self.codebook(ids)


def rotation_trick(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``q`` with ``x``'s gradient rotated onto it (Fifty et al. 2024, eq. 4.2; TorchEasyRec's
    ``_apply_rotation_trick``): ``lambda * (x - 2 (x.r) r + 2 (x.x_hat) q_hat)`` with ``r`` the
    normalized ``x_hat + q_hat``, ``x_hat``, ``q_hat`` the unit vectors and ``lambda = |q| / |x|``,
    every factor but ``x`` constant."""
    q, x0 = q.detach(), x.detach()
    q_norm = torch.linalg.vector_norm(q, dim=-1, keepdim=True)
    x_norm = torch.linalg.vector_norm(x0, dim=-1, keepdim=True)
    x_hat, q_hat = x0 / (x_norm + 1e-8), q / (q_norm + 1e-8)
    r = F.normalize(x_hat + q_hat, p=2, dim=1)
    lam = q_norm / (x_norm + 1e-8)
    reflected = x - 2 * (x * r).sum(-1, keepdim=True) * r + 2 * (x * x_hat).sum(-1, keepdim=True) * q_hat
    return lam * reflected


class SidRqvae(nn.Module):
    """RQ-VAE (module doc; :class:`~dynarec.config.sid.SidRqvaeCfg`)."""

    codebooks_ready: torch.Tensor

    def __init__(self, config: Config, cfg: SidRqvaeCfg):
        super().__init__()
        self.cfg = cfg
        self.inputs = FeatureInputs(config)
        self.group = DeepGroup(config, config.model.group(config.model.sid_input), self.inputs)
        dim = self.group.out_dim
        hidden = list(cfg.hidden_dims) or [max(dim // 2, 1)]
        self.encoder = nn.Sequential(MLP(dim, hidden), nn.Linear(hidden[-1], cfg.embed_dim))
        self.decoder = nn.Sequential(MLP(cfg.embed_dim, hidden[::-1]), nn.Linear(hidden[0], dim))
        self.layers = nn.ModuleList(VectorQuantizer(n, cfg.embed_dim, cfg) for n in cfg.codebook)
        self.layout = layout_of(config, dim)
        self.pair: Optional[DeepGroup] = None
        self.pair_flag: Optional[DeepGroup] = None
        if cfg.contrastive is not None:
            name = config.model.name
            self.pair = DeepGroup(config, config.model.group(cfg.contrastive.pair_group), self.inputs)
            self.pair_flag = DeepGroup(config, config.model.group(cfg.contrastive.pair_flag_group), self.inputs)
            if self.pair.out_dim != dim:
                raise ValueError(
                    f"model.{name}.contrastive.pair_group: its group gives {self.pair.out_dim} numbers a row, the "
                    f"input group {dim}: the same encoder reads both"
                )
            if self.pair_flag.out_dim != 1:
                raise ValueError(
                    f"model.{name}.contrastive.pair_flag_group: its group gives {self.pair_flag.out_dim} numbers a "
                    "row; it holds one flag (above 0.5: the row is a pair)"
                )
            self.logit_scales = nn.Parameter(torch.full((3,), LOGIT_SCALE_INIT))
        # kmeans_init: the codebooks from the first training batch (faiss on the host); the flag
        # saved with the model, its mirror read by the steps (no device read a step).
        self.register_buffer("codebooks_ready", torch.tensor(not cfg.kmeans_init))
        self._ready = not cfg.kmeans_init
        self.capturable = not cfg.kmeans_init  # a CUDA graph cannot hold the host's fit

    def quantizers(self) -> list[VectorQuantizer]:
        return [cast(VectorQuantizer, m) for m in self.layers]

    @torch.no_grad()
    def _kmeans_init(self, z: torch.Tensor) -> None:
        """The codebooks from a residual k-means of ``z`` (rank 0's batch; every rank gets its
        centroids), once (TorchEasyRec's ``init_embed_``: faiss, niter 10, seed 123)."""
        largest = max(self.cfg.codebook)
        enough = torch.tensor([float(z.shape[0] >= largest)], device=z.device)
        if world_size() > 1:
            dist.broadcast(enough, src=0)
        if not bool(enough):
            raise ValueError(
                f"model.{type(self).__name__}: kmeans_init fits the codebooks on the first training batch, which "
                f"holds {z.shape[0]} rows (rank 0's); the largest codebook needs {largest}: raise data.batch_size "
                "or set kmeans_init: false"
            )
        if world_size() == 1 or dist.get_rank() == 0:
            sample = z.float().cpu().numpy()
            fitted = residual_kmeans(sample, list(self.cfg.codebook), False, {"niter": 10, "seed": 123})
            centers = [torch.from_numpy(c).to(z.device) for c in fitted]
        else:
            centers = [z.new_empty(n, self.cfg.embed_dim, dtype=torch.float32) for n in self.cfg.codebook]
        for layer, c in zip(self.quantizers(), centers):
            if world_size() > 1:
                dist.broadcast(c, src=0)
            layer.codebook.weight.copy_(c)
        self.codebooks_ready.fill_(True)
        self._ready = True

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._ready = bool(self.codebooks_ready)

    def _view(self, x: torch.Tensor, candidates_of: bool) -> dict[str, torch.Tensor]:
        """One view's parts: its encoding, quantization and reconstruction (module doc)."""
        cfg = self.cfg
        z = self.encoder(x)
        if self.training and not self._ready:
            self._kmeans_init(z)
        gumbel = self.training and cfg.forward_mode == "gumbel_softmax"
        codes, total, cumulative, last = residual_walk(
            z if gumbel else z.detach(), list(self.quantizers()), cfg.normalize_residuals
        )
        q = total
        if self.training and not gumbel:
            q = rotation_trick(z, total) if cfg.rotation_trick else z + (total - z).detach()
        parts = {"codes": codes, "x_hat": self.decoder(q), "x": x, "z": z, "latents": torch.stack(cumulative, 1)}
        if candidates_of and self.layout.top_k:
            last_layer = self.quantizers()[-1]
            with torch.no_grad():
                found, scores = candidates(codes, last_layer.distances(last), self.layout.top_k)
            parts["candidate_codes"], parts["candidate_scores"] = found, scores
        return parts

    def forward(self, embeddings, seq_lengths, dense) -> torch.Tensor:
        """``[B, layout.width]`` (:class:`~dynarec.models.semantic_ids.SidLayout`)."""
        parts = self._view(self.group(embeddings, seq_lengths, dense), True)
        if self.pair is not None and self.pair_flag is not None:
            pair = self._view(self.pair(embeddings, seq_lengths, dense), False)
            parts.update({f"pair_{k}": v for k, v in pair.items() if k in ("x_hat", "x", "z", "latents")})
            parts["pair_flag"] = self.pair_flag(embeddings, seq_lengths, dense)
            rows = parts["codes"].shape[0]
            parts["logit_scales"] = self.logit_scales[None, :].expand(rows, -1)
        return self.layout.pack(parts)


class ReservoirSampler:
    """A uniform sample of at most ``capacity`` rows of a stream (Vitter's algorithm R, vectorized
    as TorchEasyRec's ``ReservoirSampler``), in host memory, its draws from a generator seeded by
    ``seed``: the same rows for the same stream."""

    def __init__(self, capacity: int, dim: int, seed: int):
        self.capacity, self.dim = capacity, dim
        self.generator = torch.Generator().manual_seed(seed)
        self._buffer: Optional[torch.Tensor] = None  # [capacity, dim], allocated at the first row
        self.filled = self.seen = 0

    @property
    def rows(self) -> torch.Tensor:
        """``[min(seen, capacity), dim]`` float32: the sample."""
        return self._buffer[: self.filled] if self._buffer is not None else torch.empty(0, self.dim)

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        """Offer the rows of ``x [B, dim]``: the first ``capacity`` are kept; row ``i`` of the
        stream after them replaces a uniformly drawn one with probability ``capacity / (i + 1)``
        (of several taking one slot in a batch, the last)."""
        x = x.detach().to("cpu", torch.float32)
        if self._buffer is None:
            self._buffer = torch.empty(self.capacity, self.dim)
        if self.filled < self.capacity:
            take = min(len(x), self.capacity - self.filled)
            self._buffer[self.filled : self.filled + take] = x[:take]
            self.filled += take
            self.seen += take
            x = x[take:]
        if not len(x):
            return
        position = self.seen + torch.arange(len(x), dtype=torch.float64)
        accept = torch.rand(len(x), generator=self.generator, dtype=torch.float64) < self.capacity / (position + 1)
        idx = accept.nonzero()[:, 0]
        slots = torch.randint(0, self.capacity, (len(idx),), generator=self.generator)
        # of the rows drawing one slot the last (the stable sort keeps their order): a pass over the
        # accepted rows, not over the whole sample
        slots, order = torch.sort(slots, stable=True)
        last = torch.ones_like(slots, dtype=torch.bool)
        last[:-1] = slots[1:] != slots[:-1]
        self._buffer[slots[last]] = x[idx[order[last]]]
        self.seen += len(x)


class SidRqkmeans(nn.Module):
    """Residual k-means (module doc; :class:`~dynarec.config.sid.SidRqkmeansCfg`)."""

    # Training copies each batch to the host's sample.
    capturable = False

    def __init__(self, config: Config, cfg: SidRqkmeansCfg):
        super().__init__()
        if world_size() > 1:
            raise ValueError(
                f"model.sid_rqkmeans: fits its centroids on one process's sample of the training rows; this run has "
                f"{world_size()} processes: train it in one"
            )
        self.cfg = cfg
        self.inputs = FeatureInputs(config)
        self.group = DeepGroup(config, config.model.group(config.model.sid_input), self.inputs)
        dim = self.group.out_dim
        self.layout = layout_of(config, dim)
        for k, n in enumerate(cfg.codebook):
            self.register_buffer(f"centroids_{k}", torch.zeros(n, dim))
        # The trainer's step needs a parameter: the loss reads it times 0 (nothing trains).
        self.unused = nn.Parameter(torch.zeros(()))
        self.sample = ReservoirSampler(cfg.sample_size, dim, config.train.seed)

    def centroids(self) -> list[torch.Tensor]:
        return [getattr(self, f"centroids_{k}") for k in range(len(self.cfg.codebook))]

    def check_servable(self) -> None:
        """ValueError where the centroids were never fitted: a checkpoint written before training
        ended holds none (all zeros; a fit never gives that), and its codes would all be 0."""
        if all(not bool(c.any()) for c in self.centroids()):
            raise ValueError(
                "model.sid_rqkmeans: these centroids are not fitted (the fit runs once, when training ends; a "
                "checkpoint written before then holds none): evaluate, predict or export the final checkpoint"
            )

    @torch.no_grad()
    def finish_training(self) -> str:
        """Fits the centroids on the training rows' sample (module doc); returns what it did."""
        rows = self.sample.rows
        largest = max(self.cfg.codebook)
        if len(rows) < largest:
            raise ValueError(
                f"model.sid_rqkmeans: training gave {len(rows)} rows to fit the centroids; the largest codebook "
                f"needs {largest}: train on more rows or use a smaller codebook"
            )
        fitted = residual_kmeans(
            rows.numpy(), list(self.cfg.codebook), self.cfg.normalize_residuals, self.cfg.kmeans.kwargs()
        )
        for c, f in zip(self.centroids(), fitted):
            c.copy_(torch.from_numpy(f))
        self.sample = ReservoirSampler(self.sample.capacity, self.sample.dim, 0)  # its memory back
        return f"fitted {len(fitted)} layers of centroids {list(self.cfg.codebook)} on {len(rows)} sampled rows"

    def _layer(self, centroids: torch.Tensor) -> Quantize:
        def quantize(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            ids = squared_l2(r.to(centroids.dtype), centroids).argmin(dim=-1)
            return ids, centroids[ids]

        return quantize

    def forward(self, embeddings, seq_lengths, dense) -> torch.Tensor:
        """``[B, layout.width]``; in training the rows are sampled and the codes are 0."""
        x = self.group(embeddings, seq_lengths, dense)
        if self.training:
            self.sample.add(x)
            rows = x.shape[0]
            parts: dict[str, torch.Tensor] = {
                "codes": x.new_zeros(rows, self.layout.layers),
                "x_hat": torch.zeros_like(x),
                "x": x,
                "candidate_codes": x.new_zeros(rows, self.layout.top_k * self.layout.layers),
                "candidate_scores": x.new_zeros(rows, self.layout.top_k),
            }
            return self.layout.pack(parts) + 0 * self.unused
        centroids = self.centroids()
        codes, total, _, last = residual_walk(x, [self._layer(c) for c in centroids], self.cfg.normalize_residuals)
        parts = {"codes": codes, "x_hat": total, "x": x}
        if self.layout.top_k:
            d = squared_l2(last, centroids[-1])
            parts["candidate_codes"], parts["candidate_scores"] = candidates(codes, d, self.layout.top_k)
        return self.layout.pack(parts)
