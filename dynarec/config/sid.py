"""Semantic-ID models' configs (``model.sid_rqvae``, ``model.sid_rqkmeans``): TorchEasyRec's
``SidRqvae`` and ``SidRqkmeans`` (``sid_model.proto``) in dynarec's names; the models are
:mod:`dynarec.models.sid`.

A semantic-ID model reads one deep group (``input``; default the first feature group: an item's
content embedding, a raw feature of ``value_dim`` numbers, and any side features) and gives each
row a tuple of codes, one per residual layer (``codebook``: each layer's number of codes). It
reads no label. RQ-VAE trains an encoder, the layers' codebooks and a decoder by its losses;
RQ-KMeans clusters a sample of the training rows once, when training ends (faiss's k-means).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from dynarec.config.base import Count, Strict

__all__ = [
    "SID_KEYS",
    "CandidateOutputCfg",
    "CommitmentLossCfg",
    "KMeansCfg",
    "PairContrastiveCfg",
    "ReconLossCfg",
    "SidRqkmeansCfg",
    "SidRqvaeCfg",
    "SinkhornCfg",
]

SID_KEYS = ("sid_rqvae", "sid_rqkmeans")

# Codes travel as float32 in the model's output: exact below 2**24.
MAX_CODEBOOK = 1 << 24

Distance = Literal["l2", "l1", "cos"]


class SinkhornCfg(Strict):
    """Balanced code assignment in RQ-VAE's training (TorchEasyRec's ``SinkhornConfig``): a layer's
    squared distances, standardized over the batch and shifted to 0, give ``exp(-cost * epsilon)``,
    normalized ``iters`` times by codes then by rows (over every rank's rows); a row takes its
    largest entry's code. ``enabled: false``: the nearest code."""

    iters: int = Field(5, ge=0)
    epsilon: float = Field(10.0, gt=0)
    enabled: bool = True


class ReconLossCfg(Strict):
    """RQ-VAE's reconstruction loss: the mean over rows of ``type``'s distance between the decoder's
    output and the input (``l2``: the mean squared difference over the input's numbers; ``l1``:
    the mean absolute one; ``cos``: 1 - cosine similarity)."""

    type: Distance = "l2"


class CommitmentLossCfg(Strict):
    """RQ-VAE's commitment loss: ``w1 * d(z, sg(q_k)) + w2 * d(sg(z), q_k)`` averaged over rows and
    layers, ``z`` the encoder's output, ``q_k`` the sum of the first ``k`` layers' codes, ``sg``
    a stop-gradient, ``d`` of ``type`` (``l2``, ``l1``: averaged over the numbers too); the first
    term trains the encoder, the second the codebooks. ``latent_weight``: ``[w1, w2]``."""

    latent_weight: tuple[float, float] = (1.0, 0.5)
    type: Distance = "l2"


class PairContrastiveCfg(Strict):
    """RQ-VAE's pair contrastive objective (TorchEasyRec's ``contrastive_config`` with its
    ``contrastive_loss``, one setting here): rows whose ``pair_flag_group`` (one number) is above
    0.5 hold a second view of the item in ``pair_group`` (as wide as ``input``; the same encoder,
    codebooks and decoder). Both views are reconstructed; the pair rows' reconstructions are
    pulled together by three masked InfoNCE terms (each view against the other's reconstruction,
    the other's input and its own input; learned temperatures), and the reconstruction loss
    counts the other rows only."""

    pair_group: str
    pair_flag_group: str


class CandidateOutputCfg(Strict):
    """Predictions also give each row's ``top_k`` nearest codes of the last layer (the greedy code
    first), each with the row's other codes (``candidate_codes`` ``[top_k * layers]``) and its
    squared distance (``candidate_scores`` ``[top_k]``): alternatives for resolving SID
    collisions (TorchEasyRec's ``candidate_output_config``)."""

    top_k: Count = 1


class _SidCfg(Strict):
    input: Optional[str] = None  # the deep group the codes are of (default: the first feature group)
    codebook: list[Count] = Field(min_length=1)
    normalize_residuals: bool = False
    candidate_output: Optional[CandidateOutputCfg] = None

    @model_validator(mode="after")
    def _codes(self):
        if max(self.codebook) > MAX_CODEBOOK:
            raise ValueError(f"codebook: at most {MAX_CODEBOOK} codes a layer, got {max(self.codebook)}")
        if self.candidate_output is not None and self.candidate_output.top_k > self.codebook[-1]:
            raise ValueError(
                f"candidate_output.top_k: {self.candidate_output.top_k} is more than the last layer's "
                f"{self.codebook[-1]} codes"
            )
        return self


class SidRqvaeCfg(_SidCfg):
    """RQ-VAE (TorchEasyRec's ``SidRqvae``; Lee et al. 2022, TIGER): an encoder MLP
    (``hidden_dims``, ReLU, then a linear map to ``embed_dim``; default one hidden layer of half
    the input's width), a residual vector quantizer of ``codebook`` layers, and a decoder
    mirroring the encoder. ``forward_mode``: ``ste`` (straight-through estimator over the
    quantized sum; ``rotation_trick``: Fifty et al. 2024's rotation instead) or
    ``gumbel_softmax`` (hard Gumbel-softmax assignment, temperature 1; no Sinkhorn).
    ``distance_type``: ``l2`` (squared) or ``cosine``. ``kmeans_init``: the codebooks start from
    a residual k-means of the first training batch's encodings (faiss; the batch must hold at
    least the largest codebook's rows). Losses: ``recon_loss``, ``commitment_loss`` (set one to
    null to drop it) and ``contrastive``."""

    embed_dim: Count = 64
    hidden_dims: list[Count] = Field(default_factory=list)
    forward_mode: Literal["ste", "gumbel_softmax"] = "ste"
    distance_type: Literal["l2", "cosine"] = "l2"
    rotation_trick: bool = False
    kmeans_init: bool = False
    sinkhorn: SinkhornCfg = Field(default_factory=SinkhornCfg)
    recon_loss: Optional[ReconLossCfg] = Field(default_factory=ReconLossCfg)
    commitment_loss: Optional[CommitmentLossCfg] = Field(default_factory=CommitmentLossCfg)
    contrastive: Optional[PairContrastiveCfg] = None

    @model_validator(mode="after")
    def _losses(self):
        if self.recon_loss is None and self.commitment_loss is None and self.contrastive is None:
            raise ValueError("give at least one of recon_loss, commitment_loss or contrastive: nothing would train")
        if self.forward_mode == "gumbel_softmax" and self.sinkhorn.enabled:
            raise ValueError(
                "sinkhorn: the Gumbel-softmax assignment picks its own code; set sinkhorn.enabled: false with "
                "forward_mode gumbel_softmax"
            )
        if self.forward_mode == "gumbel_softmax" and self.rotation_trick:
            raise ValueError("rotation_trick: applies to forward_mode ste only")
        return self


class KMeansCfg(Strict):
    """faiss.Kmeans's settings (TorchEasyRec's ``faiss_kmeans_kwargs``); unset: faiss's defaults
    (niter 25, nredo 1, seed 1234, max 256 and min 39 points per centroid, not spherical)."""

    niter: Optional[Count] = None
    nredo: Optional[Count] = None
    seed: Optional[int] = Field(None, ge=0)
    max_points_per_centroid: Optional[Count] = None
    min_points_per_centroid: Optional[Count] = None
    spherical: Optional[bool] = None
    verbose: bool = False

    def kwargs(self) -> dict[str, object]:
        """The settings given, as faiss.Kmeans's keyword arguments."""
        return {k: v for k, v in self.model_dump().items() if v is not None and (k != "verbose" or v)}


class SidRqkmeansCfg(_SidCfg):
    """Residual k-means (TorchEasyRec's ``SidRqkmeans``): training draws a uniform sample of
    ``train_sample_size`` rows of the input (reservoir sampling over every training row; 0: the
    largest codebook times ``max_points_per_centroid``, what faiss subsamples to) and, when
    training ends, fits each layer's centroids by faiss's k-means on the residuals of the layers
    before it. No gradient training: the optimizers are not used. One process (the sample is
    one process's)."""

    kmeans: KMeansCfg = Field(default_factory=KMeansCfg)
    train_sample_size: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _sample(self):
        if 0 < self.train_sample_size < max(self.codebook):
            raise ValueError(
                f"train_sample_size: {self.train_sample_size} rows cannot fit {max(self.codebook)} centroids; give at "
                "least the largest codebook (0: the default)"
            )
        return self

    @property
    def sample_size(self) -> int:
        """Rows the fit samples."""
        return self.train_sample_size or max(self.codebook) * (self.kmeans.max_points_per_centroid or 256)
