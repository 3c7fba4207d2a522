"""A whole training step replayed from CUDA graphs (dynarec.train.step_graph): a trained run
whose steps replay equals one whose steps run eagerly, a replayed step whose loss is not finite
writes nothing, a restore forgets the graphs; and, on any machine, what keeps a setup's steps
eager is named, what a signature holds and when it may be captured, the scalars a replay writes,
and the pieces the graphs rely on hold (the update's device scalars refused where they are not
read, a dry run of a step leaves no trace, a checked batch's forward)."""

import copy
import itertools
from types import SimpleNamespace

import pytest
import torch

from dynarec.config import load_config
from dynarec.data.batch import Batch
from dynarec.embedding import DynamicTableOptions, EmbeddingCollection, FeatureConfig, TableConfig
from dynarec.embedding.grouped import TableGroup
from dynarec.embedding.jagged import JaggedBatch
from dynarec.embedding.step import StepLifecycle, StepPendingError
from dynarec.kernels.gpu.update import HYPER, HostStaging
from dynarec.optim import SGD, Adagrad, Adam
from dynarec.optim.fused import fused_bag_update, kernel_hyper
from dynarec.train.graphs import DenseGraphs
from dynarec.train.step_graph import StepGraphs, _Captured
from dynarec.train.trainer import Trainer
from tests.matrix import needs_cuda
from tests.pipeline_fixtures import changed, config_dict, make_data, write_config


def _fixed_config(dynamic_user: bool = False, **changes) -> dict:
    """The pipeline tests' click log as a DLRM of fixed tables only, read by a DataLoader worker
    (its batches travel packed in one buffer, which a replay copies): two lookups, three float32
    tables in one group and a table of bfloat16 rows (stochastically rounded: its scalars carry
    the step's rounding draws) on its own. ``dynamic_user``: the user table a dynamic one instead
    (growing, scored by step: a third lookup, which the graphs do not capture)."""
    cfg = config_dict()
    user: dict = {"feature_name": "user_id", "embedding_dim": 8, "value_type": "string", "hash_bucket_size": 997}
    if dynamic_user:
        del user["hash_bucket_size"]
        user["dynamicemb"] = {"max_capacity": 4096, "init_capacity": 64, "score_strategy": "step"}
    features = [
        {"id_feature": user},
        {"id_feature": {"feature_name": "age", "embedding_dim": 8, "num_buckets": 8}},
        {"id_feature": {"feature_name": "item_id", "embedding_dim": 8, "num_buckets": 200}},
        {"id_feature": {"feature_name": "cate_id", "embedding_dim": 8, "num_buckets": 10, "data_type": "bf16"}},
        {"raw_feature": {"feature_name": "price", "normalizer": {"log1p": True, "mean": 3.0, "std": 0.8}}},
    ]
    cfg["feature_configs"] = features
    cfg["model"] = {
        "feature_groups": [{"group_name": "all", "feature_names": ["user_id", "age", "item_id", "cate_id", "price"]}],
        "dlrm": {"bottom_hidden_units": [8], "top_hidden_units": [8]},
    }
    cfg["data"]["num_workers"] = 1
    cfg["train"].update(nan_policy="skip_batch")  # (train.whole_step_graphs: on by default)
    return changed(cfg, **changes)


def _trainer(tmp_path, name: str, device: str = "cuda", dynamic_user: bool = False, **changes) -> Trainer:
    config = load_config(write_config(tmp_path, _fixed_config(dynamic_user, **changes), f"{name}.yaml"))
    return Trainer(config, tmp_path / f"model-{name}", device=device, progress=False)


def _state(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {f"dense.{n}": p.detach().clone() for n, p in trainer.task.dense.named_parameters()}
    for name, table in trainer.task.embeddings.tables.items():
        out.update({f"{name}.{k}": v.clone() for k, v in table.dump().items()})
        out[f"{name}.t"] = torch.tensor(table.step)
    return out


@needs_cuda
@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed-tables", "a-dynamic-table-looked-up-eagerly"])
def test_a_run_whose_steps_replay_equals_one_whose_steps_run_eagerly(tmp_path, dynamic):
    make_data(tmp_path)
    runs = {}
    for graphs in (True, False):
        trainer = _trainer(
            tmp_path, f"g{graphs}", dynamic_user=dynamic, train__cuda_graphs=graphs,
            train__whole_step_graphs_eager_lookups=dynamic,
        )  # fmt: skip
        runs[graphs] = (trainer.fit(), trainer)
    (m_on, on), (m_off, off) = runs[True], runs[False]
    assert off.step_graphs is None and on.step_graph_refusal is None
    graphs = on.step_graphs
    assert graphs is not None and graphs.refused is None and graphs.num_graphs >= 1
    assert [u.name for u in graphs.eager_units] == (["user_id"] if dynamic else [])
    # every full batch after the first two of an epoch (the first eager, the second captured)
    assert graphs.replays >= m_on["step"] - 4, (graphs.replays, m_on["step"])
    assert m_on["step"] == m_off["step"]
    assert m_on["cuda_graphs"]["whole_step_replayed_steps"] == graphs.replays
    assert m_on["cuda_graphs"]["whole_step_captures"] == graphs.captures >= 1
    assert m_off["cuda_graphs"]["whole_step_refused"] == "train.cuda_graphs is off"
    assert m_on["eval"]["auc"] == pytest.approx(m_off["eval"]["auc"], abs=1e-5)
    want, got = _state(off), _state(on)
    assert want.keys() == got.keys()
    assert len(on.task.embeddings.units) == 2 + dynamic
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    on.restore()  # the graphs hold the tables' memory by address: a load forgets them
    assert graphs.num_graphs == 0


@needs_cuda
@pytest.mark.slow
def test_a_din_on_histories_of_varying_length_replays_its_dense_model(tmp_path):
    """The pipeline's DIN on histories of 3 to 8 ids: each batch's id counts differ, so no whole
    step replays; its eager steps run the dense model from the dense model's own graphs (from the
    second step on: the first is bypassed, as its signature might recur), and fit's report says
    so. The run trains as one whose steps run without any graph (the dense graphs change no
    result)."""
    make_data(tmp_path)
    reports = {}
    for graphs in (True, False):
        config = changed(config_dict(), data__num_workers=1, train__cuda_graphs=graphs)
        trainer = Trainer(load_config(write_config(tmp_path, config, f"din{graphs}.yaml")), tmp_path / f"din{graphs}",
                          device="cuda", progress=False)  # fmt: skip
        reports[graphs] = (trainer.fit(), trainer)
    (report, on), (m_off, off) = reports[True], reports[False]
    graphs = report["cuda_graphs"]
    assert graphs["whole_step_refused"] is None and graphs["whole_step_replayed_steps"] == 0
    assert on.task.graphs is not None and graphs["dense_replays"] == on.task.graphs.replays
    # every step but the first (a dense signature's capture replays it at once)
    assert graphs["dense_replays"] == report["step"] - 1, (graphs, report["step"])
    assert report["eval"]["auc"] == pytest.approx(m_off["eval"]["auc"], abs=1e-5)
    want, got = _state(off), _state(on)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


@needs_cuda
def test_a_replayed_step_whose_loss_is_not_finite_writes_nothing(tmp_path):
    make_data(tmp_path)
    trainer = _trainer(tmp_path, "nan")
    batches = trainer.input.batches(trainer.position)
    items = [next(batches) for _ in range(5)]
    for batch, _, rows in items[:3]:  # eager, captured, replayed
        assert trainer.train_step(batch, rows) is not None
    graphs = trainer.step_graphs
    assert graphs is not None and graphs.replays == 2 and graphs.refused is None
    before = _state(trainer)
    batch, _, rows = items[3]
    batch.dense["price"][0] = float("inf")  # (a view of the batch's packed buffer)
    assert graphs.takes(batch, rows)
    assert trainer.train_step(batch, rows) is None  # nan_policy: skip_batch
    assert trainer.skipped_batches == 1 and trainer.step == 3 and graphs.replays == 2
    after = _state(trainer)
    for name in before:
        assert torch.equal(after[name], before[name]), name
    batch, _, rows = items[4]
    assert trainer.train_step(batch, rows) is not None
    assert graphs.replays == 3 and trainer.step == 4
    assert all(t.step == 4 for t in trainer.task.embeddings.tables.values())


def test_what_keeps_a_setups_steps_eager_is_named(tmp_path):
    make_data(tmp_path)
    off = changed(config_dict(), train__whole_step_graphs_eager_lookups=False)
    dynamic = load_config(write_config(tmp_path, off, "dynamic.yaml"))
    why = Trainer(dynamic, tmp_path / "d", device="cpu", progress=False).step_graph_refusal
    assert "user_id: dynamic" in why and "whole_step_graphs_eager_lookups is off" in why
    eager = _trainer(tmp_path, "e", device="cpu", dynamic_user=True)  # (eager lookups: on by default)
    assert eager.step_graph_refusal == "the device is cpu, not a GPU"  # (its dynamic table looked up eagerly)
    graphs = StepGraphs(
        eager.task.embeddings, eager.dense_optimizer, lambda b, r: torch.zeros(()), lambda: None, eager.task
    )
    assert [u.name for u in graphs.eager_units] == ["user_id"]
    assert [u.name for u in graphs.units] == ["age+item_id", "cate_id"] and len(graphs.tables) == 3
    cases = {
        "train.cuda_graphs is off": {"train__cuda_graphs": False},
        "gradient_accumulation_steps 2": {"train__gradient_accumulation_steps": 2},
        "train.whole_step_graphs is off": {"train__whole_step_graphs": False},
        "the device is cpu, not a GPU": {},
    }
    for i, (why, changes) in enumerate(cases.items()):
        trainer = _trainer(tmp_path, f"r{i}", device="cpu", **changes)
        assert trainer.step_graphs is None
        assert why in trainer.step_graph_refusal


def test_device_scalars_are_refused_where_no_kernel_reads_them():
    weight = torch.zeros(4, 2)
    hyper = torch.zeros(len(HYPER), dtype=torch.float64)
    rows, offsets, grad = torch.tensor([1, 2]), torch.tensor([0, 1, 2]), torch.ones(2, 2)
    with pytest.raises(ValueError, match="hyper"):
        torch.ops.dynarec.bag_update(
            weight, None, None, grad, rows, offsets, None, None, 0, 0, 0, 0.1, 0.0, 0.0, 0.9, 0.999, 1.0, 1.0,
            hyper=hyper,
        )  # fmt: skip
    with pytest.raises(ValueError, match="hyper"):
        fused_bag_update(
            SGD(lr=0.1), lr=0.1, step=1, weight=weight, states={}, rows=rows, offsets=offsets,
            per_sample_weights=None, grad_out=grad, reducer=lambda r, g: (r, g), hyper=hyper,
        )  # fmt: skip
    assert weight.abs().sum() == 0


def test_kernel_scalars_follow_the_step_and_rate():
    adam = Adam(lr=0.01, beta1=0.9, beta2=0.99)
    first, third = (kernel_hyper(adam, lr=0.02, step=t, half=False) for t in (1, 3))
    at = dict(zip(HYPER, third))
    assert at["lr"] == 0.02 and first[HYPER.index("lr")] == 0.02
    assert at["bias1"] == pytest.approx(1 - 0.9**3) and at["bias2"] == pytest.approx(1 - 0.99**3)
    assert first[HYPER.index("bias1")] == pytest.approx(0.1)


def test_a_dry_run_of_a_step_leaves_no_trace():
    steps = StepLifecycle("table 't'")
    steps.begin()
    steps.commit(steps.current)
    with steps.dry_run():
        step = steps.begin()
        assert steps.t == 2
        steps.commit(step)
    assert steps.t == 1 and not steps.pending
    assert steps.begin().t == 2 and steps.current.id > step.id  # (ids are never given twice)
    with pytest.raises(StepPendingError, match="dry run"), steps.dry_run():
        pass


def test_a_checked_batchs_forward_is_the_forward_and_the_check_names_a_bad_id():
    tables = [
        TableConfig("a", 4, num_embeddings=10, features=["fa"]),
        TableConfig("b", 4, num_embeddings=5, features=["fb"]),
    ]
    collection = EmbeddingCollection(tables, SGD(lr=0.1))
    other = copy.deepcopy(collection)
    batch = JaggedBatch.from_lists({"fa": [[1, 2], [3]], "fb": [[4], []]})
    want = collection(batch)
    with other.inputs_checked():
        got = other(batch)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    with pytest.raises(ValueError, match="fb"):
        other.check(JaggedBatch.from_lists({"fa": [[1]], "fb": [[5]]}))


@pytest.mark.parametrize("spec", [Adam(lr=0.05), Adagrad(lr=0.1, initial_accumulator_value=0.1)], ids=repr)
def test_lookups_handed_to_a_graph_train_as_the_collections_own(spec):
    """The lookups a replayed step runs eagerly (``lookup_units``), their outputs given to the
    forward (``inputs_checked(given)``) and their backward run from the gradient the rest left
    for them: the same tables after three steps as the collection's own forward and backward
    (a dynamic table growing and inserting, a fixed one, a sequence feature of the fixed one)."""
    tables = [
        TableConfig("dyn", 4, dynamic=DynamicTableOptions(64, init_capacity=8, bucket_size=4), features=["u"]),
        TableConfig("fix", 4, num_embeddings=20, features=["i", FeatureConfig("hist", pooling="none")]),
    ]
    torch.manual_seed(0)
    own = EmbeddingCollection(tables, spec)
    handed = copy.deepcopy(own)
    weights = torch.randn(3, 4)
    dyn = next(u for u in handed.units if getattr(u, "name", None) == "dyn")
    for step in range(3):
        batch = JaggedBatch.from_lists(
            {"u": [[10 * step + 1], [7], [10 * step + 9]], "i": [[1], [2], [3]], "hist": [[1, 2], [3], [4, 5, 6]]}
        )
        out = own(batch)
        loss = sum(((out[f] * w).sum() for f, w in zip(("u", "i"), weights)), out["hist"].square().sum())
        loss.backward()
        given = handed.lookup_units(batch, ["dyn"])
        output, layout = given["dyn"]
        leaf = output.detach().clone().requires_grad_()
        with handed.inputs_checked({"dyn": (leaf, layout)}):
            got = handed(batch)
        assert got.keys() == out.keys()
        loss = sum(((got[f] * w).sum() for f, w in zip(("u", "i"), weights)), got["hist"].square().sum())
        loss.backward()  # the rest's update, and the given output's gradient
        torch.autograd.backward([output], [leaf.grad])  # the dynamic table's update
    assert dyn.steps.t == 3 and not dyn.steps.pending
    for name in ("dyn", "fix"):
        want, have = own.tables[name].dump(), handed.tables[name].dump()
        assert want.keys() == have.keys()
        for field in want:
            torch.testing.assert_close(have[field], want[field], rtol=0, atol=0, msg=f"{name}.{field}")


def _stand_in_graphs(trainer: Trainer) -> StepGraphs:
    """The trainer's StepGraphs on the CPU, its "graphs" stand-ins that rerun the captured Python
    at each replay (a forward under ``inputs_checked(given leaves)``, then the backward and the
    dense step, the leaves' gradients copied out), every lookup handed to them: what runs is
    ``StepGraphs.forward``/``backward``'s own work around the graphs."""
    embeddings = trainer.task.embeddings
    graphs = StepGraphs(
        embeddings, trainer.dense_optimizer, lambda b, r: trainer._forward_loss(b, r)[0], trainer._dense_step,
        trainer.task,
    )  # fmt: skip
    graphs.eager_units, graphs.units, graphs.tables = list(embeddings.units), [], []

    def capture(key, buffer, hyper, given, slots, layout, global_rows):
        leaves = {n: torch.empty_like(out.detach()).requires_grad_() for n, (out, _) in given.items()}
        inputs = {n: (leaves[n], unit_layout) for n, (_, unit_layout) in given.items()}
        grads = {n: torch.empty_like(leaf) for n, leaf in leaves.items()}
        ran = {}

        def forward():
            for leaf in leaves.values():
                leaf.grad = None
            with embeddings.inputs_checked(inputs):
                ran["loss"] = graphs.forward_loss(Batch.unpacked(buffer, slots, layout), global_rows)
            captured.loss.copy_(ran["loss"].detach())
            captured.finite.copy_(torch.isfinite(ran["loss"]))

        def backward():
            ran.pop("loss").backward()
            graphs.dense_step()
            for n, leaf in leaves.items():
                grads[n].copy_(leaf.grad)

        captured = _Captured(
            SimpleNamespace(replay=forward), SimpleNamespace(replay=backward), buffer, hyper, torch.zeros(()),
            torch.ones((), dtype=torch.bool), leaves, grads,
        )  # fmt: skip
        graphs._staging = HostStaging(hyper.numel(), buffer.device)
        graphs._graphs[key] = captured
        return captured

    graphs._capture = capture
    return graphs


def test_steps_replayed_around_eager_lookups_train_as_eager_steps_and_a_nan_one_writes_nothing(tmp_path):
    """StepGraphs' own work around the graphs, on the CPU (stand-in graphs, every lookup eager: a
    dynamic user table and the fixed ones): the leaves filled from the eager lookups, their
    gradients handed back to the lookups' backward, the steps opened and committed, a NaN
    step's lookups undone. The same tables and dense weights as a trainer's eager steps."""
    make_data(tmp_path)
    eager = _trainer(tmp_path, "eager", device="cpu", dynamic_user=True)
    replayed = _trainer(tmp_path, "replayed", device="cpu", dynamic_user=True)
    replayed.step_graphs = graphs = _stand_in_graphs(replayed)
    source = eager.input.batches(eager.position)
    items = list(itertools.islice(source, 6))
    source.close()
    eager.input.close()  # (its DataLoader worker let go before any step: a failing step leaves none behind)
    assert items[-1][0].num_rows == items[0][0].num_rows  # (full batches: one signature)
    embeddings = replayed.task.embeddings
    names = [u.name for u in embeddings.units]
    for step, (batch, _, rows) in enumerate(items[:5]):
        assert eager.train_step(batch, rows) is not None
        # Read ahead as the trainer's loop does: a step that replays, or captures, takes its lookups'
        # stage from it (every unit's here); an eager one given the stage of one unit alone drops it
        # and runs the whole stage (the first). The fourth is not read ahead (as under --follow):
        # its lookups read the graph buffer's copy of the batch.
        ahead = graphs.ahead_units(batch, rows)
        assert ahead == (None if step < 2 else names)  # (captured at the second step, replayed from the third)
        if step != 3:
            embeddings.prefetch(batch.sparse, batch.ready, units=names[:1] if step == 0 else ahead)
        assert len(embeddings._prefetched) == (step != 3)
        assert replayed.train_step(batch, rows) is not None
        assert not embeddings._prefetched  # taken by the step
    assert graphs.replays == 4 and graphs.num_graphs == 1  # the first step eager, then captured and replayed
    want, got = _state(eager), _state(replayed)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    batch, _, rows = items[5]
    batch.dense["price"][0] = float("inf")  # (a view of the batch's packed buffer)
    assert replayed.train_step(batch, rows) is None  # nan_policy: skip_batch
    assert graphs.replays == 4 and replayed.skipped_batches == 1
    after = _state(replayed)
    for name in got:
        torch.testing.assert_close(after[name], got[name], rtol=0, atol=0, msg=name)
    tables = replayed.task.embeddings.tables.values()
    assert all(not t.steps.pending and t.step == 5 for t in tables)
    assert replayed.task.embeddings.tables["user_id"].size == eager.task.embeddings.tables["user_id"].size


def test_a_signature_is_captured_only_after_an_eager_step_of_it_ran_whole(tmp_path):
    """The host side of the graphs, on any machine: what a signature holds, and when one may be
    captured (after an eager step of it ran whole: its optimizer states exist)."""
    make_data(tmp_path)
    trainer = _trainer(tmp_path, "keys", device="cpu")
    embeddings, optimizer = trainer.task.embeddings, trainer.dense_optimizer
    graphs = StepGraphs(embeddings, optimizer, lambda batch, rows: torch.zeros(()), lambda: None, trainer.task)
    batches = trainer.input.batches(trainer.position)
    (first, _, rows), (second, _, _) = next(batches), next(batches)
    assert first.packed_buffer() is not None  # (from a DataLoader worker)
    key = graphs._key(first, rows)
    assert key is not None and graphs._key(second, rows) == key  # full batches of one layout
    assert graphs._key(first, rows + 1) != key  # the rows the loss is averaged over
    assert graphs._key(Batch.unpacked(*first.packed()), rows) == key  # (repacked: the same layout)
    assert not graphs.takes(first, rows)
    assert graphs.forward(first, rows) is None  # the first step of a signature runs eagerly
    assert graphs.captures_next  # (its dense model then runs eagerly too: DenseGraphs.bypassed)
    assert not graphs._may_capture(key)  # ... and is captured only once it ran whole
    graphs.ran_eagerly()
    assert graphs._may_capture(key) and not graphs.takes(second, rows)  # (captured at the step: not yet)
    optimizer.param_groups[0]["lr"] *= 2  # a dense rate baked into a graph
    assert graphs._key(first, rows) != key
    group = next(u for u in embeddings.units if isinstance(u, TableGroup))
    group.tables[0].set_learning_rate(0.5)  # the group's tables apart: each its own lookup
    assert graphs._key(first, rows) is None
    group.tables[0].set_learning_rate(group.tables[1].learning_rate)
    key = graphs._key(first, rows)
    with torch.no_grad():  # an eager step refuses to train: so does no replay
        assert graphs._key(first, rows) is None
    trainer.task.dense.eval()  # a module's mode (a batch norm's statistics) is read afresh by an eager step
    assert graphs._key(first, rows) != key
    trainer.task.dense.train()
    weight = next(trainer.task.dense.parameters())
    weight.requires_grad_(False)  # a parameter frozen: no gradient, no optimizer step
    assert graphs._key(first, rows) != key
    weight.requires_grad_(True)
    assert graphs._key(first, rows) == key
    embeddings.requires_grad_(False)  # frozen tables open no step
    assert graphs._key(first, rows) is None


def test_eager_steps_keep_the_dense_graphs_where_no_signature_recurs(tmp_path):
    """An eager step bypasses the dense model's graphs (``captures_next``) only while signatures
    recur: the first of a run, or the first after a replay. Where every step's differs from the
    step's before (a history's lengths vary: its features' id counts; the rows a loss is averaged
    over stand in for them here), eager steps keep the dense graphs from the second on."""
    make_data(tmp_path)
    trainer = _trainer(tmp_path, "varying", device="cpu")
    graphs = trainer.step_graphs = _stand_in_graphs(trainer)
    source = trainer.input.batches(trainer.position)
    items = list(itertools.islice(source, 6))
    source.close()
    trainer.input.close()
    (batch, _, rows), *_ = items
    expected = [  # (the rows, whether the step replays, captures_next after it)
        (rows, False, True),  # the run's first step: its signature may recur
        (rows + 1, False, False),  # a second new signature in a row
        (rows + 2, False, False),
        (rows + 2, True, False),  # one recurs: captured (here, a stand-in) and replayed
        (rows + 3, False, True),  # a new one after a replay
        (rows + 4, False, False),
    ]
    for step, ((batch, _, _), (global_rows, replays, bypass)) in enumerate(zip(items, expected)):
        before = graphs.replays
        assert trainer.train_step(batch, global_rows) is not None
        assert graphs.replays - before == replays, step
        assert graphs.captures_next == bypass, step
    assert graphs.num_graphs == 1


def test_the_dense_graphs_bypassed_run_the_model_eagerly_and_capture_nothing():
    """The eager step before a whole step's capture runs the dense model as it is: the dense
    model's own capture (its warm-up passes, its memory) would never be replayed."""

    class Dense(torch.nn.Module):  # (a dense model takes dicts of tensors)
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 2)

        def forward(self, inputs):
            return self.linear(inputs["x"])

    model = Dense()
    graphs = DenseGraphs(model)
    x = {"x": torch.randn(4, 3)}
    with graphs.bypassed():
        out = graphs(x)  # (on the CPU a capture would fail: none is tried)
    torch.testing.assert_close(out, model(x))
    assert graphs.num_graphs == 0 and graphs.replays == 0 and graphs.refused is None
    assert not graphs._bypassed


def test_the_least_recently_replayed_graphs_make_room_for_a_new_one(tmp_path):
    make_data(tmp_path)
    trainer = _trainer(tmp_path, "room", device="cpu")
    graphs = StepGraphs(
        trainer.task.embeddings, trainer.dense_optimizer, lambda b, r: torch.zeros(()), lambda: None, trainer.task,
        max_graphs=2,
    )  # fmt: skip
    graphs._graphs.update(old=object(), recent=object())  # (as captures leave them: the latest last)
    graphs._make_room()
    assert list(graphs._graphs) == ["recent"]


def test_a_replay_writes_the_scalars_each_lookup_would_give_its_update(tmp_path):
    make_data(tmp_path)
    trainer = _trainer(tmp_path, "scalars", device="cpu")
    embeddings = trainer.task.embeddings
    graphs = StepGraphs(
        embeddings, trainer.dense_optimizer, lambda batch, rows: torch.zeros(()), lambda: None, trainer.task
    )
    group, single = embeddings.units  # three float32 tables, and the bfloat16 one apart
    for table in group.tables:
        table.set_learning_rate(0.25)
    for unit in (group, single):
        unit.begin_step()
    store = single.store
    assert graphs._hyper(group) == kernel_hyper(group.store.spec, lr=0.25, step=1, half=False)
    assert group.store.lr == 0.25  # (as the group's lookup sets it)
    assert graphs._hyper(single) == kernel_hyper(
        store.spec, lr=store.lr, step=1, half=True, key_offset=store.row_keys.offset, rounding_seed=store.rounding_seed
    )
    embeddings.abort_step()
