import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from dynarec.config import config_from_dict
from dynarec.data import DataError
from dynarec.models.retrieval import Retrieval
from dynarec.train.trainer import Trainer
from tests.data.test_sampler import dssm_config
from tests.pipeline_fixtures import make_data


def retrieval(**dssm) -> Retrieval:
    c = dssm_config("items.tsv")
    c["model"]["dssm"].update(dssm)
    return Retrieval(config_from_dict(c))


def test_the_loss_is_the_softmax_cross_entropy_of_each_users_own_item_against_the_samples():
    """TorchEasyRec's MatchModel.sim: [u_i . v_i, u_i . v_B, ..., u_i . v_{B+N-1}] / temperature,
    the own item at column 0; the loss is this rank's share of the global mean."""
    torch.manual_seed(0)
    b, n, d = 3, 4, 5
    user, item = torch.randn(b + n, d), torch.randn(b + n, d)
    out = torch.cat([user, item], dim=1).requires_grad_()
    task = retrieval(temperature=0.5, output_dim=d)
    loss = task.loss(out, torch.zeros(b, 1), global_rows=6)
    want = 0.0
    for i in range(b):
        s = torch.stack([user[i] @ item[i]] + [user[i] @ item[b + j] for j in range(n)]) / 0.5
        want += -torch.log_softmax(s, 0)[0]
    torch.testing.assert_close(loss, want / 6)
    loss.backward()
    assert out.grad is not None and out.grad[b:, :d].abs().sum() == 0  # the samples' user halves are not read


def test_in_batch_negatives_score_every_item_of_the_batch_and_the_samples():
    torch.manual_seed(1)
    b, n, d = 3, 2, 4
    out = torch.randn(b + n, 2 * d)
    task = retrieval(in_batch_negative=True)
    scores = out[:b, :d] @ out[:, d:].T
    torch.testing.assert_close(task.loss(out, torch.zeros(b, 1), b), F.cross_entropy(scores, torch.arange(b)))
    ranks = task.predictions(out, b)["positive_rank"]
    assert ranks.tolist() == [float((scores[i] >= scores[i, i]).sum() - 1) for i in range(b)]


def test_recall_at_k_is_the_share_of_own_items_ranked_below_k():
    task = retrieval(recall_at_k=[1, 3], output_dim=2)
    # row 0: own item best; row 1: two samples above it; row 2: one above, two tied (a tie counts against)
    user = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    own = torch.tensor([[2.0, 0.0], [0.0, 0.5], [1.0, 0.0]])
    samples = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 2.0]])
    out = torch.cat([torch.cat([user, torch.zeros(3, 2)]), torch.cat([own, samples])], dim=1)
    ranks = task.predictions(out, 3)["positive_rank"]
    assert ranks.tolist() == [0.0, 2.0, 3.0]
    assert task.metrics({"positive_rank": ranks.numpy()}, np.zeros((3, 1)), None) == {
        "recall@1": pytest.approx(1 / 3),
        "recall@3": pytest.approx(2 / 3),
    }
    out[1, 0] = float("nan")  # a score that is not a number: the row's rank too
    assert task.predictions(out, 3)["positive_rank"].isnan().tolist() == [False, True, False]


def item_table_of(root) -> str:
    """Every item of the click log, weight 1, attributes 'item_id:cate_id'."""
    import pyarrow.parquet as pq

    items = {}
    for f in sorted((root / "data" / "train").glob("*.parquet")):
        t = pq.read_table(f, columns=["item_id", "cate_id"])
        items.update(zip(t.column("item_id").to_pylist(), t.column("cate_id").to_pylist()))
    path = root / "items.tsv"
    path.write_text(
        "id:int64\tweight:float\tfeature:string\n" + "".join(f"{i}\t1\t{i}:{c}\n" for i, c in items.items())
    )
    return str(path)


def trained_on_the_click_log(tmp_path, config_of):
    """``config_of(item table path, num_sample=20)``'s config trained six epochs on the tests'
    click log: ``(config dict, trainer, eval before, eval after)``."""
    make_data(tmp_path)
    c = config_of(item_table_of(tmp_path), num_sample=20)
    for key in ("train_input_path", "eval_input_path"):
        c["data"][key] = str(tmp_path / c["data"][key])
    c["train"]["num_epochs"] = 6
    trainer = Trainer(config_from_dict(c), tmp_path / "model", progress=False)
    before = trainer.evaluate()
    return c, trainer, before, trainer.fit()["eval"]


def test_dssm_trains_on_the_click_log_to_far_better_than_chance_recall(tmp_path):
    """20 sampled items a batch: chance recall@1 is 1/21. Six epochs of the tiny click log lift
    it far above (the users' histories point at their items). The export serves each row's user
    and item embeddings; their products rank as evaluation ranked."""
    c, trainer, before, after = trained_on_the_click_log(tmp_path, dssm_config)
    # chance: 0.048; train.seed 0-3 (the draws') ended at recall@1 0.50, 0.50, 0.65, 0.38
    assert before["recall@1"] < 0.1 and after["recall@1"] > 0.3
    assert before["recall@5"] < 0.35 and after["recall@5"] > 0.6
    from dynarec.serving import ExportedModel
    from dynarec.train.export import export_model

    served = ExportedModel(export_model(trainer.task, trainer.example_batch(), tmp_path / "export"))
    out = served.predict_files(c["data"]["eval_input_path"], batch_size=37)
    user, item = out["user_embedding"], out["item_embedding"]
    assert user.shape == item.shape == (400, 4)
    # the served towers are the trained model's: its rows, re-scored, give evaluation's ranks
    eval_batches = trainer.input.dataset(c["data"]["eval_input_path"], 100)
    ranks = trainer.predict(c["data"]["eval_input_path"])[0]["positive_rank"]
    task = trainer.evaluator.tasks
    first = next(iter(trainer.input.loader(eval_batches)))
    with torch.no_grad():
        trainer.task.eval()
        rows = trainer.task(first)
    np.testing.assert_allclose(rows[:100, :4].numpy(), user[:100], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rows[:100, 4:8].numpy(), item[:100], rtol=1e-5, atol=1e-6)
    assert task.predictions(rows, 100)["positive_rank"].numpy().tolist() == ranks[:100].tolist()
    # an item catalog (the item tower's columns alone) serves the item index; a table of users the queries
    table = pq.read_table(c["data"]["eval_input_path"])
    for columns, name, want in (
        (["item_id", "cate_id"], "item_embedding", item),
        (["user_id", "age", "hist_item_id"], "user_embedding", user),
    ):
        pq.write_table(table.select(columns), tmp_path / f"{name}.parquet")
        alone = served.predict_files(str(tmp_path / f"{name}.parquet"), batch_size=64)
        assert list(alone) == [name]
        np.testing.assert_allclose(alone[name], want, rtol=1e-5, atol=1e-6)
    pq.write_table(table.select(["item_id"]), tmp_path / "neither.parquet")
    with pytest.raises(
        DataError, match=r"neither tower: user_embedding needs \['age', .*item_embedding needs \['cate_id'\]"
    ):
        served.predict_files(str(tmp_path / "neither.parquet"))


def test_dats_adaptive_mimic_terms_pull_each_augmented_vector_toward_the_other_towers_output():
    """TorchEasyRec's DAT loss: the softmax cross-entropy plus amm_u * sum ||norm(a_u) - v||^2
    + amm_i * sum ||norm(a_v) - u||^2 over the batch's rows (u, v constant there), each rank's
    share of the sums divided by the world size."""
    c = dssm_config("items.tsv")
    c["model"]["feature_groups"] += [
        {"group_name": "user_aug", "feature_names": ["user_id"]},
        {"group_name": "item_aug", "feature_names": ["item_id"]},
    ]
    towers = {
        k: {**c["model"]["dssm"][k], "augment_input": g}
        for k, g in (("user_tower", "user_aug"), ("item_tower", "item_aug"))
    }
    c["model"]["dat"] = {**c["model"].pop("dssm"), **towers, "amm_u_weight": 0.3, "amm_i_weight": 0.7}
    config = config_from_dict(c)
    torch.manual_seed(2)
    b, n, d = 3, 2, 4
    out = torch.randn(b + n, 4 * d, requires_grad=True)
    dat, dssm = Retrieval(config, world_size=2), retrieval()
    user, item, a_u, a_v = out[:b, :d], out[:b, d : 2 * d], out[:b, 2 * d : 3 * d], out[:b, 3 * d :]
    amm_u = sum(((a_u[i] / a_u[i].norm()) - item[i]).square().sum() for i in range(b))
    amm_i = sum(((a_v[i] / a_v[i].norm()) - user[i]).square().sum() for i in range(b))
    base = dssm.loss(torch.cat([out[:, :d], out[:, d : 2 * d]], dim=1), torch.zeros(b, 1), 6)
    loss = dat.loss(out, torch.zeros(b, 1), 6)
    torch.testing.assert_close(loss, base + (0.3 * amm_u + 0.7 * amm_i) / 2)
    (loss - base).backward()
    assert out.grad[:, : 2 * d].abs().sum() == 0  # the towers' outputs are held constant by the mimic terms
    assert out.grad[:b, 2 * d :].abs().sum() > 0 and out.grad[b:].abs().sum() == 0


def test_hard_negatives_are_scored_against_their_own_user_only():
    """TorchEasyRec's _sim_with_sampler with hard_neg_indices [[0, 0], [1, 0], [1, 1]]: user 0 has
    one hard negative, user 1 two, user 2 none; columns past a user's count are -inf."""
    torch.manual_seed(2)
    b, n, h, d = 3, 2, 3, 4
    user, item = torch.randn(b + n + h, d), torch.randn(b + n + h, d)
    out = torch.cat([user, item], dim=1)
    owners = torch.tensor([0, 1, 1])
    task = retrieval(temperature=0.5, output_dim=d)
    scores = task.scores(out, b, owners)
    ninf = float("-inf")
    want = torch.tensor(
        [
            [user[i] @ item[i], user[i] @ item[3], user[i] @ item[4], *hard]
            for i, hard in enumerate(
                [[user[0] @ item[5], ninf], [user[1] @ item[6], user[1] @ item[7]], [ninf, ninf]]
            )
        ]
    )  # fmt: skip
    torch.testing.assert_close(scores, want / 0.5)
    loss = task.loss(out, torch.zeros(b, 1), b, hard_negative_rows=owners)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, F.cross_entropy(want / 0.5, torch.zeros(b, dtype=torch.long)))
    ranks = task.predictions(out, b, owners)["positive_rank"]  # -inf is no item: never above the own
    assert ranks.tolist() == [float((want[i] >= want[i, 0]).sum() - 1) for i in range(b)]
