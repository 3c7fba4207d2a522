"""The dense model's CUDA graphs (dynarec.train.graphs): replays equal eager passes — outputs,
parameter and input gradients, batch-norm statistics, dropout draws — a new input shape gets its
own graph, a model that cannot be captured runs eagerly with the reason reported once, and a
trained run with graphs equals the one without."""

import copy

import pytest
import torch
from torch import nn

from dynarec.config import load_config
from dynarec.train.graphs import DenseGraphs, _Group, _split_groups
from dynarec.train.trainer import Trainer
from tests.matrix import needs_cuda
from tests.pipeline_fixtures import config_dict, make_data, write_config


class _Dense(nn.Module):
    """The dense models' contract: (embeddings, sequence lengths, dense features) -> logits."""

    def __init__(self, host_read: bool = False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(9, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
        self.host_read = host_read

    def forward(self, emb, lengths, dense):
        seq = emb["hist"].sum(1) / lengths["hist"].clamp(min=1)[:, None]
        x = torch.cat([emb["user"], seq, dense["price"][:, None]], 1)
        if self.host_read and float(x.abs().max()) > 1e9:  # a host read: not capturable
            x = x * 0
        return self.net(x).squeeze(1)


def _inputs(batch: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    emb = {
        "user": torch.randn(batch, 4, generator=g).cuda().requires_grad_(),
        "hist": torch.randn(batch, length, 4, generator=g).cuda().requires_grad_(),
    }
    lengths = {"hist": torch.randint(0, length + 1, (batch,), generator=g).cuda()}
    dense = {"price": torch.rand(batch, generator=g).cuda()}
    return emb, lengths, dense


def _step(model, forward, inputs, seed):
    torch.manual_seed(seed)
    out = forward(*inputs)
    (out.square().mean() + out.mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    input_grads = {n: t.grad.clone() for n, t in inputs[0].items()}
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads.values()):
            p -= 0.1 * g
    return out.detach().clone(), grads, input_grads


@needs_cuda
def test_replays_equal_eager_passes():
    torch.manual_seed(0)
    eager = _Dense().cuda()
    graphed_model = copy.deepcopy(eager)
    graphs = DenseGraphs(graphed_model)
    shapes = [(64, 5), (64, 5), (64, 5), (32, 5), (64, 7), (64, 5)]
    for i, (batch, length) in enumerate(shapes):
        want = _step(eager, eager, _inputs(batch, length, i), 100 + i)
        got = _step(graphed_model, graphs, _inputs(batch, length, i), 100 + i)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        for (name, b), gb in zip(eager.named_buffers(), graphed_model.buffers()):
            torch.testing.assert_close(gb, b, rtol=1e-5, atol=1e-6, msg=f"step {i}: buffer {name}")
    assert graphs.refused is None
    assert graphs.num_graphs == 3  # (64, 5), (32, 5), (64, 7)
    assert graphs.replays == len(shapes)


def test_pieces_of_one_tensor_are_grouped_in_its_order():
    """What the replay takes as one tensor: contiguous pieces (views needing its gradient) that
    cover one contiguous tensor, in the tensor's order; nothing else."""
    whole = (torch.arange(12.0) * 1).requires_grad_()
    a, b, c = whole.split([4, 4, 4])
    other = torch.ones(6, requires_grad=True) * 1
    x, y = other.view(3, 2).unbind(1)  # strided pieces
    left, _ = other.split([3, 3])
    assert _split_groups([c.view(2, 2), a, torch.zeros(3), b.view(2, 2)]) == [(1, 3, 0)]
    assert _split_groups([a, b]) == []  # c is missing: they do not cover it
    assert _split_groups([x, y]) == []
    assert _split_groups([left, a.detach().requires_grad_(), b.detach()]) == []
    with torch.no_grad():
        d, e = whole.split([6, 6])
    assert _split_groups([d, e]) == []  # cut without autograd: no gradient reaches the tensor

    class Scaled(torch.autograd.Function):  # a gradient-scaling view: its backward must run
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return 2 * g

    f, h = whole.split([6, 6])
    assert _split_groups([f, Scaled.apply(h)]) == []
    f, h = whole.split([6, 6])
    h.register_hook(lambda g: g * 2)
    assert _split_groups([f, h]) == []
    f, h = whole.split([6, 6])
    h.retain_grad()
    assert _split_groups([f, h]) == []
    f, h = whole.split([6, 6])
    assert _split_groups([f.view(2, 3), h]) == [(0, 1)]
    out = whole * 2  # a lookup's output: not a leaf
    pieces = list(out.split([5, 7]))
    (members,) = _split_groups(pieces)
    group = _Group(pieces, members)
    assert group.given(pieces) is out
    apart = [p.detach().clone().requires_grad_() for p in pieces]
    torch.testing.assert_close(group.given(apart), out)  # others: their concatenation


def _packed_inputs(batch: int, length: int, seed: int):
    """``_inputs``' values laid out as a step gives them: the embeddings views of one pooled
    output (its leaf returned too), the dense feature and the lengths views of one byte buffer."""
    emb, lengths, dense = _inputs(batch, length, seed)
    pooled = torch.cat([emb["user"].detach().flatten(), emb["hist"].detach().flatten()]).requires_grad_()
    views = {"user": pooled[: batch * 4].view(batch, 4), "hist": pooled[batch * 4 :].view(batch, length, 4)}
    buffer = torch.empty(batch * 12, dtype=torch.uint8, device="cuda")
    price, lens = buffer[: batch * 4].view(torch.float32), buffer[batch * 4 :].view(torch.int64)
    price.copy_(dense["price"])
    lens.copy_(lengths["hist"])
    return (views, {"hist": lens}, {"price": price}), pooled


@needs_cuda
def test_inputs_lying_in_one_storage_are_copied_in_one_piece_and_replay_as_eagerly():
    """The features' outputs of one lookup, and a batch's tensors copied as one buffer, fill the
    graph's static inputs in one copy each; steps alternating that layout with inputs of their
    own give what eager passes give."""
    torch.manual_seed(0)
    eager = _Dense().cuda()
    graphed_model = copy.deepcopy(eager)
    graphs = DenseGraphs(graphed_model)
    for i in range(6):
        packed = i % 3 != 2
        if packed:
            inputs, pooled = _packed_inputs(64, 5, i)
            eager_inputs, eager_pooled = _packed_inputs(64, 5, i)
        else:
            inputs, eager_inputs = _inputs(64, 5, i), _inputs(64, 5, i)
        torch.manual_seed(100 + i)
        want = eager(*eager_inputs)
        (want.square().mean() + want.mean()).backward()
        torch.manual_seed(100 + i)
        got = graphs(*inputs)
        if packed:  # the replay's autograd inputs: the embeddings' one tensor, then the parameters
            edges = got.grad_fn.next_functions
            assert len(edges) == 1 + len(list(graphed_model.parameters()))
            assert edges[0][0].variable is pooled
        (got.square().mean() + got.mean()).backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        if packed:
            torch.testing.assert_close(pooled.grad, eager_pooled.grad, rtol=1e-5, atol=1e-6)
        else:  # each given their own gradient (the replay took them concatenated)
            for name, t in inputs[0].items():
                torch.testing.assert_close(t.grad, eager_inputs[0][name].grad, rtol=1e-5, atol=1e-6, msg=name)
        for (name, p), q in zip(eager.named_parameters(), graphed_model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=f"step {i}: {name}")
        eager.zero_grad(set_to_none=True)
        graphed_model.zero_grad(set_to_none=True)
    (captured,) = graphs._graphs.values()
    # captured on packed inputs: the embeddings one group (pieces of one tensor), the dense
    # feature and the lengths one span of the buffer (in storage order: the feature first)
    assert [g.members for g in captured.groups] == [(0, 1)]
    assert [span.members for span, _ in captured.spans] == [(3, 2)]
    assert graphs.num_graphs == 1 and graphs.replays == 6


@needs_cuda
def test_signatures_beyond_the_limit_run_eagerly():
    torch.manual_seed(0)
    model = _Dense().cuda()
    graphs = DenseGraphs(model, max_graphs=1)
    graphs(*_inputs(16, 3, 0))
    out = graphs(*_inputs(8, 3, 1))
    assert graphs.num_graphs == 1 and graphs.replays == 1
    assert out.shape == (8,)


@needs_cuda
def test_a_model_that_reads_the_host_runs_eagerly_and_says_why():
    torch.manual_seed(0)
    eager = _Dense(host_read=True).cuda()
    model = copy.deepcopy(eager)
    reasons = []
    graphs = DenseGraphs(model, on_refusal=reasons.append)
    for i in range(3):
        want = _step(eager, eager, _inputs(16, 3, i), i)
        got = _step(model, graphs, _inputs(16, 3, i), i)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert len(reasons) == 1 and graphs.refused == reasons[0]
    assert graphs.num_graphs == 0 and graphs.replays == 0
    torch.cuda.synchronize()  # the device is still usable


class _FailsInCapture(_Dense):
    """Eagerly fine, and passes the warm-up's sync check; inside a capture it reads the host,
    which invalidates the capture (torch then raises from the graph's exit)."""

    def forward(self, emb, lengths, dense):
        out = super().forward(emb, lengths, dense)
        if torch.cuda.is_current_stream_capturing():
            out = out + float(out.detach().sum()) * 0
        return out


@needs_cuda
def test_a_capture_that_fails_leaves_the_stream_and_the_generator_as_they_were():
    torch.manual_seed(0)
    eager = _FailsInCapture().cuda()
    model = copy.deepcopy(eager)
    reasons = []
    graphs = DenseGraphs(model, on_refusal=reasons.append)
    stream = torch.cuda.current_stream()
    for i in range(3):  # dropout draws after the failed capture: the generator works
        want = _step(eager, eager, _inputs(16, 3, i), i)
        got = _step(model, graphs, _inputs(16, 3, i), i)
        assert torch.cuda.current_stream() == stream
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert len(reasons) == 1 and graphs.num_graphs == 0 and graphs.replays == 0


class _SharedGradient(nn.Module):
    """Two parameters autograd hands one gradient tensor (``a + b``: the add passes it on)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.ones(4))

    def forward(self, emb, lengths, dense):
        return (emb["user"] * (self.a + self.b)).sum(1)


@needs_cuda
def test_parameters_given_one_gradient_tensor_get_their_own_grad():
    model = _SharedGradient().cuda()
    graphs = DenseGraphs(model)
    for i in range(2):
        graphs(*_inputs(8, 3, i)).sum().backward()
        assert graphs.replays == i + 1
        assert model.a.grad.data_ptr() != model.b.grad.data_ptr()
        torch.testing.assert_close(model.a.grad, model.b.grad)
        model.zero_grad(set_to_none=True)


@needs_cuda
def test_a_forward_without_gradients_runs_eagerly():
    model = _Dense().cuda()
    graphs = DenseGraphs(model)
    with torch.no_grad():
        out = graphs(*_inputs(8, 3, 0))
    assert out.shape == (8,) and graphs.num_graphs == 0 and graphs.refused is None


@needs_cuda
@pytest.mark.slow
def test_training_with_graphs_equals_training_without(tmp_path):
    make_data(tmp_path)
    runs = {}
    for graphs in (True, False):
        config = load_config(write_config(tmp_path, config_dict(train__cuda_graphs=graphs), f"g{graphs}.yaml"))
        trainer = Trainer(config, tmp_path / f"model-{graphs}", device="cuda", progress=False)
        metrics = trainer.fit()
        runs[graphs] = (metrics, trainer)
    (m_on, on), (m_off, off) = runs[True], runs[False]
    assert off.task.graphs is None
    assert on.task.graphs.refused is None and on.task.graphs.num_graphs >= 1
    # every step replays the dense graphs but the first, which whole-step graphs (on by default)
    # bypass in case its signature recurs: none does here (each batch's histories differ in length)
    assert m_on["cuda_graphs"]["whole_step_replayed_steps"] == 0
    assert on.task.graphs.replays == m_on["step"] - 1 and m_on["step"] == m_off["step"]
    assert off._optimizer_graph is None
    assert on._optimizer_graph.refused is None and on._optimizer_graph.replays >= m_on["step"] - 2
    assert m_on["eval"]["auc"] == pytest.approx(m_off["eval"]["auc"], abs=1e-4)
    for (name, p), q in zip(off.task.dense.named_parameters(), on.task.dense.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
    for name, table in off.task.embeddings.tables.items():
        got = on.task.embeddings.tables[name].dump()["weight"]
        torch.testing.assert_close(got, table.dump()["weight"], rtol=1e-4, atol=1e-5, msg=name)


def test_no_graphs_off_the_gpu(tmp_path):
    make_data(tmp_path)
    config = load_config(write_config(tmp_path, config_dict()))
    assert config.train.cuda_graphs
    trainer = Trainer(config, tmp_path / "m", device="cpu", progress=False)
    assert trainer.task.graphs is None and trainer._optimizer_graph is None
    assert trainer.task.dense_graph_refusal == "the device is cpu, not a GPU"
    assert trainer.cuda_graphs_report()["dense_refused"] == "the device is cpu, not a GPU"


class _KeepsAForward(nn.Module):
    capturable = False  # (keeps something of a forward pass outside its outputs)


@pytest.mark.parametrize(
    "changes, device, distributed, why",
    [
        ({"cuda_graphs": False}, "cuda", False, "train.cuda_graphs is off"),
        ({}, "cuda", True, "a multi-process run"),
        ({"mixed_precision": "bf16"}, "cuda", False, "train.mixed_precision is bf16"),
        ({"gradient_accumulation_steps": 2}, "cuda", False, "train.gradient_accumulation_steps is 2"),
        ({}, "cuda", False, "module(s) _KeepsAForward keep something of a forward pass"),
        ({}, "cpu", False, "the device is cpu, not a GPU"),
    ],
)
def test_what_keeps_the_dense_model_off_graphs_is_named(tmp_path, changes, device, distributed, why):
    from dynarec.train.task import dense_graph_refusal

    raw = config_dict()
    raw["train"].update(changes)
    config = load_config(write_config(tmp_path, raw))
    dense = nn.Sequential(nn.Linear(2, 2), _KeepsAForward()) if why.startswith("module") else nn.Linear(2, 2)
    assert why in dense_graph_refusal(config, torch.device(device), distributed, dense)
    assert (
        dense_graph_refusal(
            load_config(write_config(tmp_path, config_dict(), "plain.yaml")),
            torch.device("cuda"),
            False,
            nn.Linear(2, 2),
        )
        is None
    )
