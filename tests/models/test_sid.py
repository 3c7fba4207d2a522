"""Semantic-ID models (dynarec/models/sid.py, dynarec/models/semantic_ids.py) against TorchEasyRec's
formulas written out in plain torch (its ``ResidualVectorQuantizer``, ``VectorQuantizeLayer``,
``_sinkhorn``, ``SidReconLoss``, ``SidCommitmentLoss``, ``SidContrastiveLoss``; faiss for the
k-means), their config refusals, and their quality on items with a hierarchy of clusters."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from dynarec.config import config_from_dict
from dynarec.models import build_model
from dynarec.models import sid as sid_module
from dynarec.models.semantic_ids import SemanticIds
from dynarec.models.sid import ReservoirSampler, SidRqkmeans, SidRqvae, sinkhorn, squared_l2, standardized_cost
from dynarec.models.tasks import tasks_of
from dynarec.serving import ExportedModel
from dynarec.train.checkpoint import CheckpointError
from dynarec.train.export import export_model
from dynarec.train.trainer import Trainer

D = 12  # an item's content embedding


def sid_config(kind: str = "sid_rqvae", pairs: bool = False, data=None, **block) -> dict:
    features = [{"raw_feature": {"feature_name": "item_emb", "input_name": "embedding", "value_dim": D}}]
    groups = [{"group_name": "deep", "feature_names": ["item_emb"]}]
    defaults = {"codebook": [4, 4, 4]}
    if kind == "sid_rqvae":
        defaults.update(embed_dim=6, hidden_dims=[10])
    if pairs:
        features += [
            {"raw_feature": {"feature_name": "pair_emb", "input_name": "pair_embedding", "value_dim": D}},
            {"raw_feature": {"feature_name": "is_pair", "input_name": "is_pair"}},
        ]
        groups += [
            {"group_name": "pair", "feature_names": ["pair_emb"]},
            {"group_name": "pair_flag", "feature_names": ["is_pair"]},
        ]
        defaults["contrastive"] = {"pair_group": "pair", "pair_flag_group": "pair_flag"}
    return {
        "feature_configs": features,
        "model": {"feature_groups": groups, kind: {**defaults, **block}},
        "data": {"train_input_path": str(data or "unused.parquet"), "batch_size": 64, "num_workers": 0},
        "train": {
            "sparse_optimizer": {"adagrad_optimizer": {"lr": 0.01}},
            "dense_optimizer": {"adam_optimizer": {"lr": 0.01}},
            "num_epochs": 1,
        },
    }


def model_and_task(c: dict):
    config = config_from_dict(c)
    torch.manual_seed(0)
    model = build_model(config)
    return model, tasks_of(config), config


# -- TorchEasyRec's formulas, written out ---------------------------------------------------------


def tzrec_sinkhorn(distances: torch.Tensor, iters: int, epsilon: float) -> torch.Tensor:
    """VectorQuantizeLayer._find_nearest_embedding's Sinkhorn branch, one process."""
    std, mean = torch.std_mean(distances, unbiased=False)
    d = (distances - mean) / std.add(1e-12)
    d = d - d.min()
    q = torch.exp(-d * epsilon).t()
    b, k = q.size(1), q.size(0)
    q /= torch.sum(q) + 1e-8
    for _ in range(iters):
        q /= torch.sum(q, dim=1, keepdim=True) + 1e-8
        q /= k
        q /= torch.sum(q, dim=0, keepdim=True) + 1e-8
        q /= b
    return (q * b).t()


def tzrec_rotation(x: torch.Tensor, quant: torch.Tensor) -> torch.Tensor:
    """ResidualVectorQuantizer._apply_rotation_trick (the batched matmul form)."""
    qd, xd = quant.detach(), x.detach()
    qn = torch.linalg.vector_norm(qd, dim=-1).unsqueeze(1)
    xn = torch.linalg.vector_norm(xd, dim=-1).unsqueeze(1)
    lam = qn / (xn + 1e-8)
    x_hat, q_hat = xd / (xn + 1e-8), qd / (qn + 1e-8)
    r = F.normalize(x_hat + q_hat, p=2, dim=1)
    xu = x.unsqueeze(1)
    proj = xu @ r.unsqueeze(2) @ r.unsqueeze(1)
    resc = xu @ x_hat.unsqueeze(2) @ q_hat.unsqueeze(1)
    return lam * (xu - 2 * proj + 2 * resc).squeeze(1)


def tzrec_distance(kind, a, b):
    if kind == "l1":
        return F.l1_loss(a, b, reduction="none").mean(dim=-1)
    if kind == "cos":
        return 1 - F.cosine_similarity(a, b, dim=-1)
    return F.mse_loss(a, b, reduction="none").mean(dim=-1)


def tzrec_commitment(kind, z, latents, w1, w2):
    """SidCommitmentLoss.forward."""
    x = z.unsqueeze(1)
    if kind == "cos":
        return (
            w1 * (1 - F.cosine_similarity(x, latents.detach(), dim=-1)).mean()
            + w2 * (1 - F.cosine_similarity(x.detach(), latents, dim=-1)).mean()
        )
    if kind == "l1":
        return w1 * (x - latents.detach()).abs().mean() + w2 * (x.detach() - latents).abs().mean()
    return w1 * (x - latents.detach()).pow(2).mean() + w2 * (x.detach() - latents).pow(2).mean()


def tzrec_rqvae_pass(model: SidRqvae, x: torch.Tensor, gumbel_seed=None):
    """SidRqvae._rqvae_pass in training: encode, the residual walk (ResidualQuantizer's), the
    aggregate STE (or rotation, or Gumbel), decode. Reads the model's weights."""
    cfg = model.cfg
    z = model.encoder(x)
    gumbel = cfg.forward_mode == "gumbel_softmax"
    residual = z if gumbel else z.detach()
    agg, cumulative, codes = torch.zeros_like(z), [], []
    if gumbel_seed is not None:
        torch.manual_seed(gumbel_seed)
    for layer in model.layers:
        if cfg.normalize_residuals:
            residual = F.normalize(residual, dim=-1)
        w = layer.codebook.weight
        if cfg.distance_type == "l2":
            d = torch.cdist(residual, w, p=2).pow(2)
        else:
            d = -torch.matmul(F.normalize(residual, p=2, dim=1), F.normalize(w, p=2, dim=1).t())
        if gumbel:
            weights = F.gumbel_softmax(-d, tau=1.0, hard=True, dim=-1)
            ids, emb = weights.argmax(-1), weights @ w
        else:
            d = d.detach()
            balanced = cfg.sinkhorn.enabled
            ids = tzrec_sinkhorn(d, cfg.sinkhorn.iters, cfg.sinkhorn.epsilon).argmax(-1) if balanced else d.argmin(-1)
            emb = w[ids]
        codes.append(ids)
        agg = agg + emb
        cumulative.append(agg)
        residual = residual - emb.detach()
    q = agg
    if not gumbel:
        q = tzrec_rotation(z, agg) if cfg.rotation_trick else z + (agg - z).detach()
    return z, torch.stack(codes, -1), torch.stack(cumulative, 1), model.decoder(q)


def tzrec_contrastive(a, b, a_ori, b_ori, pair, scales):
    """SidContrastiveLoss.forward, one process."""
    a, b = F.normalize(a, dim=-1, p=2), F.normalize(b, dim=-1, p=2)
    labels = torch.arange(a.shape[0])
    fallback = pair.long().argmax()
    safe = torch.where(pair, labels, fallback.expand_as(labels))
    col = (~pair).unsqueeze(0)
    n = pair.float().sum().clamp(min=1)
    loss = a.new_zeros(())
    for scale, ta, tb in ((scales[0], b, a), (scales[1], b_ori, a_ori), (scales[2], a_ori, b_ori)):
        s = scale.clamp(max=math.log(100)).exp()
        la = (s * a @ ta.t()).masked_fill(col, torch.finfo(a.dtype).min)
        lb = (s * b @ tb.t()).masked_fill(col, torch.finfo(a.dtype).min)
        ce = torch.nan_to_num(F.cross_entropy(la, safe, reduction="none")) + torch.nan_to_num(
            F.cross_entropy(lb, safe, reduction="none")
        )
        loss = loss + (ce * pair.float()).sum() / (2 * n)
    return loss / 3


def grads(loss, params):
    return torch.autograd.grad(loss, params, allow_unused=True)


# -- the quantizer's parts --------------------------------------------------------------------------


def test_sinkhorn_is_torcheasyrecs_iteration_and_balances_the_codes():
    torch.manual_seed(0)
    d = torch.rand(64, 8) ** 3 * 5
    d[:, 0] -= 2  # code 0 nearest for most rows
    mine = sinkhorn(standardized_cost(d), 5, 10.0)
    torch.testing.assert_close(mine, tzrec_sinkhorn(d, 5, 10.0), rtol=1e-5, atol=1e-6)
    nearest = torch.bincount(d.argmin(1), minlength=8)
    balanced = torch.bincount(mine.argmax(1), minlength=8)
    assert nearest.max() > 40 and balanced.max() <= 16, (nearest, balanced)


def test_squared_distances_equal_cdists_at_every_batch_size():
    torch.manual_seed(0)
    w = torch.randn(7, 5)
    for rows in (1, 25, 26, 300):
        x = torch.randn(rows, 5)
        torch.testing.assert_close(squared_l2(x, w), torch.cdist(x, w).pow(2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("distance", ["l2", "cosine"])
def test_codes_are_assigned_in_float32_under_mixed_precision(distance):
    """Under bf16 autocast (train.mixed_precision) a layer's distances stay float32: the codes
    are the float32 ones (in bf16, |x|^2 - 2 x.w + |w|^2 cancels: far rows get a wrong code)."""
    model, _, _ = model_and_task(sid_config(codebook=[256], embed_dim=16, distance_type=distance))
    layer = model.layers[0]
    x = torch.randn(4096, 16) + 5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        d = layer.distances(x)
    assert d.dtype == torch.float32
    torch.testing.assert_close(d, layer.distances(x), rtol=0, atol=0)


def test_a_rank_without_rows_takes_part_and_adds_nothing():
    """A rank whose share of a global batch is empty: Sinkhorn's cost and the contrastive loss
    take no row (and no error) there."""
    assert standardized_cost(torch.empty(0, 4)).shape == (0, 4)
    _, task, _ = model_and_task(sid_config(pairs=True))
    out = torch.zeros(0, task.layout.width, requires_grad=True)
    loss = task.loss(out, torch.zeros(0, 0), global_rows=1)
    assert float(loss.detach()) == 0.0


@pytest.mark.parametrize(
    "block",
    [
        {},
        {"sinkhorn": {"enabled": False}},
        {"distance_type": "cosine", "normalize_residuals": True},
        {"rotation_trick": True, "sinkhorn": {"iters": 3, "epsilon": 2.0}},
        {"recon_loss": {"type": "l1"}, "commitment_loss": {"latent_weight": [0.25, 2.0], "type": "cos"}},
        {"recon_loss": {"type": "cos"}, "commitment_loss": {"type": "l1"}},
        {"forward_mode": "gumbel_softmax", "sinkhorn": {"enabled": False}},
    ],
    ids=["ste-sinkhorn", "ste-nearest", "cosine-normalized", "rotation", "l1-cos", "cos-l1", "gumbel"],
)
def test_an_rqvae_training_step_is_torcheasyrecs_loss_and_gradients(block):
    """The loss over a batch (its share of a global batch of 100 rows) and every parameter's
    gradient equal TorchEasyRec's RQ-VAE pass and losses on the same weights."""
    model, task, _ = model_and_task(sid_config(**block))
    model.train()
    x = torch.randn(40, D)
    torch.manual_seed(7)
    out = model({}, {}, {"item_emb": x})
    loss = task.loss(out, torch.zeros(40, 0), global_rows=100)
    z, codes, latents, x_hat = tzrec_rqvae_pass(model, x, gumbel_seed=7)
    cfg = model.cfg
    want = tzrec_distance(cfg.recon_loss.type, x_hat, x).sum() / 100
    w1, w2 = cfg.commitment_loss.latent_weight
    want = want + tzrec_commitment(cfg.commitment_loss.type, z, latents, w1, w2) * 40 / 100
    parts = task.layout.unpack(out)
    assert torch.equal(parts["codes"].long(), codes)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-7)
    params = [p for p in model.parameters()]
    for name, g, h in zip([n for n, _ in model.named_parameters()], grads(loss, params), grads(want, params)):
        torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-7, msg=name)


def test_the_pair_contrastive_objective_is_torcheasyrecs_masked_infonce():
    """Both views through the same encoder, codebooks and decoder; the reconstruction counts the
    non-pair rows, the commitment both views, the InfoNCE the pair rows."""
    model, task, _ = model_and_task(sid_config(pairs=True))
    model.train()
    rows = 30
    x, y = torch.randn(rows, D), torch.randn(rows, D)
    flag = (torch.arange(rows) % 3 == 0).float()
    out = model({}, {}, {"item_emb": x, "pair_emb": y, "is_pair": flag})
    loss = task.loss(out, torch.zeros(rows, 0), global_rows=rows)
    z1, _, lat1, xh1 = tzrec_rqvae_pass(model, x)
    z2, _, lat2, xh2 = tzrec_rqvae_pass(model, y)
    pair = flag > 0.5
    recon = (tzrec_distance("l2", xh1, x) * (~pair).float()).sum() / (~pair).sum()
    commit = tzrec_commitment("l2", torch.cat([z1, z2]), torch.cat([lat1, lat2]), 1.0, 0.5)
    want = recon + commit + tzrec_contrastive(xh1, xh2, x, y, pair, model.logit_scales)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    names, params = zip(*model.named_parameters())
    mine = dict(zip(names, grads(loss, params)))
    for name, h in zip(names, grads(want, params)):
        torch.testing.assert_close(mine[name], h, rtol=1e-4, atol=1e-6, msg=name)
    assert mine["logit_scales"].abs().min() > 0  # the three temperatures learn


def test_eval_codes_are_the_nearest_codes_layer_by_layer_and_candidates_the_last_layers_next_nearest():
    model, task, _ = model_and_task(sid_config(candidate_output={"top_k": 3}))
    model.eval()
    x = torch.randn(20, D)
    with torch.no_grad():
        out = task.predictions(model({}, {}, {"item_emb": x}))
        z = model.encoder(x)
        residual, codes = z, []
        for layer in model.layers:
            d = torch.cdist(residual, layer.codebook.weight).pow(2)
            codes.append(d.argmin(1))
            last_d = d
            residual = residual - layer.codebook.weight[codes[-1]]
        x_hat = model.decoder(sum(layer.codebook.weight[c] for layer, c in zip(model.layers, codes)))
    codes = torch.stack(codes, 1)
    assert torch.equal(out["codes"], codes)
    top = last_d.topk(3, largest=False)
    cand = out["candidate_codes"].reshape(20, 3, 3)
    assert torch.equal(cand[:, :, :2], codes[:, None, :2].expand(-1, 3, -1))
    assert torch.equal(cand[:, :, 2], top.indices) and torch.equal(cand[:, 0], codes)
    torch.testing.assert_close(out["candidate_scores"], top.values, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["reconstruction_mse"], (x - x_hat).square().mean(1), rtol=1e-5, atol=1e-6)


def test_kmeans_init_fits_the_codebooks_on_the_first_training_batch(monkeypatch):
    import faiss

    model, _, _ = model_and_task(sid_config(kmeans_init=True))
    assert not model.capturable
    model.train()
    x = torch.randn(64, D)
    with torch.no_grad():
        z = model.encoder(x).numpy().copy()
    model({}, {}, {"item_emb": x})
    residual = z.copy()
    for layer in model.layers:  # TorchEasyRec's faiss_residual_kmeans: niter 10, seed 123
        km = faiss.Kmeans(z.shape[1], 4, niter=10, seed=123, verbose=False)
        km.train(residual)
        np.testing.assert_allclose(layer.codebook.weight.detach().numpy(), km.centroids, rtol=1e-5, atol=1e-5)
        _, idx = km.index.search(residual, 1)
        residual = residual - km.centroids[idx[:, 0]]
    first = [layer.codebook.weight.detach().clone() for layer in model.layers]
    model({}, {}, {"item_emb": torch.randn(64, D)})  # once
    assert all(torch.equal(a, layer.codebook.weight) for a, layer in zip(first, model.layers))
    restored, _, _ = model_and_task(sid_config(kmeans_init=True))
    restored.load_state_dict(model.state_dict())  # a checkpoint's codebooks are not fitted again
    restored.train()
    restored({}, {}, {"item_emb": torch.randn(64, D)})
    assert all(torch.equal(a, layer.codebook.weight) for a, layer in zip(first, restored.layers))
    small, _, _ = model_and_task(sid_config(kmeans_init=True))
    small.train()
    with pytest.raises(ValueError, match=r"first training batch, which holds 3 rows .* largest codebook needs 4"):
        small({}, {}, {"item_emb": torch.randn(3, D)})


# -- RQ-KMeans ------------------------------------------------------------------------------------


def test_the_reservoir_keeps_each_row_with_equal_probability_and_is_seeded():
    n, cap = 50, 10
    kept = np.zeros(n)
    trials = 2000
    for seed in range(trials):
        r = ReservoirSampler(cap, 1, seed)
        for start in range(0, n, 7):  # batches of 7
            r.add(torch.arange(start, min(start + 7, n), dtype=torch.float32)[:, None])
        assert len(r.rows) == cap and len(set(r.rows[:, 0].tolist())) == cap
        kept[r.rows[:, 0].long().numpy()] += 1
    p = kept / trials  # each row: cap / n = 0.2; binomial sd 0.009
    assert np.all(np.abs(p - cap / n) < 0.04), p
    a, b = ReservoirSampler(cap, 1, 3), ReservoirSampler(cap, 1, 3)
    for r in (a, b):
        r.add(torch.arange(n, dtype=torch.float32)[:, None])
    assert torch.equal(a.rows, b.rows)


def hierarchical_items(n: int, seed: int = 0) -> np.ndarray:
    """Items whose embeddings sit in a 3-level hierarchy of clusters (4 x 4 x 4 leaves, each level
    a quarter the scale of the one above) plus noise: what residual quantization captures."""
    rng = np.random.default_rng(seed)
    levels = [rng.normal(0, s, (4, D)) for s in (4.0, 1.0, 0.25)]
    picks = rng.integers(0, 4, (n, 3))
    x = sum(levels[k][picks[:, k]] for k in range(3)) + rng.normal(0, 0.02, (n, D))
    return x.astype(np.float32)


def write_items(path, x: np.ndarray, pairs: np.ndarray | None = None):
    cols = {"item_id": np.arange(len(x)), "embedding": pa.array(list(x), pa.list_(pa.float32()))}
    if pairs is not None:
        cols["pair_embedding"] = pa.array(list(pairs), pa.list_(pa.float32()))
        cols["is_pair"] = (np.arange(len(x)) % 4 == 0).astype(np.float32)
    pq.write_table(pa.table(cols), path)
    return path


def test_rqkmeans_fits_faiss_residual_kmeans_on_the_training_rows_and_exports_its_codes(tmp_path):
    import faiss

    x = hierarchical_items(3000)
    data = write_items(tmp_path / "items.parquet", x)
    c = sid_config("sid_rqkmeans", data=data, kmeans={"niter": 20, "nredo": 5, "seed": 5}, train_sample_size=4000)
    c["data"]["eval_input_path"] = str(data)
    config = config_from_dict(c)
    trainer = Trainer(config, tmp_path / "m", progress=False)
    report = trainer.fit()
    model = trainer.task.dense
    assert isinstance(model, SidRqkmeans)
    residual = x.copy()  # every row sampled (train_sample_size >= rows), in the data's order
    for k in range(3):
        km = faiss.Kmeans(D, 4, niter=20, nredo=5, seed=5)
        km.train(residual)
        np.testing.assert_allclose(model.centroids()[k].numpy(), km.centroids, rtol=1e-5, atol=1e-5)
        _, idx = km.index.search(residual, 1)
        residual = residual - km.centroids[idx[:, 0]]
    # the hierarchy's 64 leaves (the best of 5 k-means runs a layer finds its level): a code tuple
    # a leaf, the reconstruction error that of the noise
    variance = float(((x - x.mean(0)) ** 2).mean())
    assert report["eval"]["mse"] < 0.001 * variance, (report["eval"], variance)
    assert report["eval"]["unique_sid_ratio"] == pytest.approx(64 / 3000), report["eval"]
    predicted, _, _ = trainer.predict(str(data), with_labels=False)
    export = export_model(trainer.task, trainer.example_batch(), tmp_path / "export")
    served = ExportedModel(export).predict_files(str(data), batch_size=37)
    assert list(served) == ["codes"] and served["codes"].dtype == np.int64
    np.testing.assert_array_equal(served["codes"], predicted["codes"])
    with pytest.raises(CheckpointError, match="samples its training rows in memory"):
        Trainer(config, tmp_path / "m", progress=False).fit(resume=True)


def test_rqkmeans_refuses_a_sample_smaller_than_a_codebook_and_several_processes(tmp_path, monkeypatch):
    data = write_items(tmp_path / "items.parquet", hierarchical_items(3))
    trainer = Trainer(config_from_dict(sid_config("sid_rqkmeans", data=data)), tmp_path / "m", progress=False)
    with pytest.raises(ValueError, match="training gave 3 rows to fit the centroids; the largest codebook needs 4"):
        trainer.fit()
    monkeypatch.setattr(sid_module, "world_size", lambda: 2)
    with pytest.raises(ValueError, match="this run has 2 processes: train it in one"):
        build_model(config_from_dict(sid_config("sid_rqkmeans")))


def test_an_rqkmeans_checkpoint_written_before_its_fit_is_not_scored(tmp_path):
    """Its centroids are all zeros until training ends: evaluate, predict and export say so
    instead of giving every row the codes 0."""
    data = write_items(tmp_path / "items.parquet", hierarchical_items(200))
    trainer = Trainer(config_from_dict(sid_config("sid_rqkmeans", data=data)), tmp_path / "m", progress=False)
    for action in (
        lambda: trainer.evaluate(str(data)),
        lambda: trainer.predict(str(data), with_labels=False),
        lambda: export_model(trainer.task, trainer.example_batch(), tmp_path / "export"),
    ):
        with pytest.raises(ValueError, match=r"these centroids are not fitted .* export the final checkpoint"):
            action()
    assert not (tmp_path / "export").exists()


# -- quality, end to end ----------------------------------------------------------------------------


def test_rqvae_learns_the_hierarchy_through_train_evaluate_and_export(tmp_path):
    """15 epochs of RQ-VAE on the clustered items (codebooks started by k-means): its
    reconstruction error falls to a few percent of predicting the mean item's (the variance;
    measured 3.0%), its codes are not collapsed (19 tuples measured; a codebook stuck on one
    code a layer gives 1), and export scores as evaluation does."""
    x = hierarchical_items(2000, seed=1)
    data = write_items(tmp_path / "items.parquet", x)
    c = sid_config(data=data, codebook=[4, 4, 4], embed_dim=8, hidden_dims=[32], kmeans_init=True)
    c["data"].update(eval_input_path=str(data), batch_size=128)
    c["train"]["num_epochs"] = 15
    trainer = Trainer(config_from_dict(c), tmp_path / "m", progress=False)
    report = trainer.fit()
    variance = float(((x - x.mean(0)) ** 2).mean())
    assert report["eval"]["mse"] < 0.05 * variance, (report["eval"], variance)
    assert report["eval"]["unique_sid_ratio"] >= 12 / 2000, report["eval"]
    predicted, _, _ = trainer.predict(str(data), with_labels=False)
    export = export_model(trainer.task, trainer.example_batch(), tmp_path / "export")
    served = ExportedModel(export).predict_files(str(data), batch_size=100)
    np.testing.assert_array_equal(served["codes"], predicted["codes"])


def test_a_contrastive_rqvae_trains_and_scores_the_reconstruction_of_non_pair_rows(tmp_path):
    x = hierarchical_items(400, seed=2)
    data = write_items(tmp_path / "items.parquet", x, pairs=x + 0.01)
    c = sid_config(pairs=True, data=data)
    c["data"]["eval_input_path"] = str(data)
    trainer = Trainer(config_from_dict(c), tmp_path / "m", progress=False)
    report = trainer.fit()
    predicted, _, _ = trainer.predict(str(data), with_labels=False)
    keep = predicted["pair_flag"] < 0.5
    assert keep.sum() == 300
    assert report["eval"]["mse"] == pytest.approx(float(predicted["reconstruction_mse"][keep].mean()), rel=1e-5)


# -- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "block", "message"),
    [
        ("sid_rqvae", {"recon_loss": None, "commitment_loss": None}, "nothing would train"),
        ("sid_rqvae", {"forward_mode": "gumbel_softmax"}, "set sinkhorn.enabled: false"),
        ("sid_rqvae", {"candidate_output": {"top_k": 5}}, "more than the last layer's 4 codes"),
        ("sid_rqvae", {"codebook": [1 << 25]}, "at most 16777216 codes a layer"),
        ("sid_rqvae", {"input": "nope"}, "input 'nope' names no feature group"),
        ("sid_rqkmeans", {"train_sample_size": 3}, "cannot fit 4 centroids"),
        ("sid_rqkmeans", {"kmeans": {"niter": 0}}, "greater than 0"),
    ],
)
def test_bad_settings_are_refused_by_name(kind, block, message):
    with pytest.raises(ValueError, match=message):
        config_from_dict(sid_config(kind, **block))


def test_a_pair_group_of_another_width_and_a_label_field_are_refused():
    c = sid_config(pairs=True)
    c["feature_configs"][1]["raw_feature"]["value_dim"] = D - 1
    with pytest.raises(ValueError, match=r"pair_group: its group gives 11 numbers a row, the input group 12"):
        build_model(config_from_dict(c))
    c = sid_config()
    c["data"]["label_field"] = "clk"
    with pytest.raises(ValueError, match="gives semantic ids and reads no label"):
        config_from_dict(c)
    c = sid_config("sid_rqkmeans")
    c["train"]["eval_every_steps"] = 10
    with pytest.raises(ValueError, match="fits its centroids when training ends"):
        config_from_dict(c)


def test_the_task_names_its_outputs_and_metrics():
    _, task, _ = model_and_task(sid_config(candidate_output={"top_k": 2}))
    assert isinstance(task, SemanticIds)
    assert task.output_names() == [
        "codes",
        "candidate_codes",
        "candidate_scores",
        "reconstruction_mse",
        "reconstruction_rel_l1",
    ]
    assert task.served_names() == ["codes", "candidate_codes", "candidate_scores"]
    codes = np.array([[0, 1, 2], [0, 1, 2], [3, 1, 2], [0, 1, 3]])
    metrics = task.metrics(
        {"codes": codes, "reconstruction_mse": np.array([1.0, 2, 3, 4]), "reconstruction_rel_l1": np.ones(4)},
        np.zeros((4, 0)),
        None,
    )
    assert metrics == {"mse": 2.5, "rel_l1": 1.0, "unique_sid_ratio": 0.75}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_semantic_ids_train_on_the_gpu_as_on_the_cpu(tmp_path):
    """RQ-VAE (its dense model in CUDA graphs on the GPU) and RQ-KMeans (the sample copied to the
    host, fitted there) trained on the CPU and on the GPU: RQ-KMeans's centroids and codes are the
    same; RQ-VAE's codes agree on nearly every row and its reconstruction error to a few percent
    (float summation orders differ, and a balanced assignment's ties may fall the other way)."""
    x = hierarchical_items(1500, seed=4)
    data = write_items(tmp_path / "items.parquet", x)
    for kind, block in (
        ("sid_rqkmeans", {"kmeans": {"nredo": 3, "seed": 1}, "train_sample_size": 2000}),
        ("sid_rqvae", {}),
    ):
        c = sid_config(kind, data=data, **block)
        c["data"]["eval_input_path"] = str(data)
        c["train"]["num_epochs"] = 3
        runs = {}
        for device in ("cpu", "cuda"):
            trainer = Trainer(config_from_dict(c), tmp_path / f"{kind}-{device}", device, progress=False)
            report = trainer.fit()
            predicted, _, _ = trainer.predict(str(data), with_labels=False)
            runs[device] = (report["eval"], predicted["codes"], trainer.task.dense)
        (cpu, cpu_codes, cpu_model), (gpu, gpu_codes, gpu_model) = runs["cpu"], runs["cuda"]
        if kind == "sid_rqkmeans":
            for a, b in zip(cpu_model.centroids(), gpu_model.centroids()):
                torch.testing.assert_close(a, b.cpu())
            np.testing.assert_array_equal(cpu_codes, gpu_codes)
        else:
            assert (cpu_codes == gpu_codes).all(axis=1).mean() > 0.95
            assert gpu["mse"] == pytest.approx(cpu["mse"], rel=0.05)


def test_a_model_without_tables_plans_and_verifies_by_saying_so():
    from dynarec.planner import plan_from_config

    assert plan_from_config(config_from_dict(sid_config())).format() == (
        "no embedding tables: the model reads dense features only"
    )
