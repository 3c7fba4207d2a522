"""The dense optimizer's step replayed from a CUDA graph (dynarec.train.optimizer_graph): every
step equals torch's eager step bit for bit — gradients in the captured buffers or elsewhere, a
learning rate changed, a parameter without a gradient, states loaded — and only torch's fused
Adam on a GPU is captured."""

import copy

import pytest
import torch
from torch import nn

from dynarec.train.optimizer_graph import OptimizerStepGraph, captures_step
from tests.matrix import needs_cuda


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)


def test_only_fused_adam_on_a_gpu_is_captured():
    model = _model("cpu")
    params = list(model.parameters())
    assert not captures_step(torch.optim.Adam(params, fused=True))  # a CPU's parameters
    with pytest.raises(ValueError, match="Adam over these parameters is not captured"):
        OptimizerStepGraph(torch.optim.Adam(params, fused=True))
    if torch.cuda.is_available():
        params = list(_model("cuda").parameters())
        assert captures_step(torch.optim.Adam(params, fused=True))
        assert captures_step(torch.optim.AdamW(params, fused=True))
        assert not captures_step(torch.optim.Adam(params))  # not fused
        assert not captures_step(torch.optim.SGD(params, lr=0.1, fused=True))


def _same(a: nn.Module, b: nn.Module, opt_a: torch.optim.Optimizer, opt_b: torch.optim.Optimizer) -> None:
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        for k, v in opt_a.state[p].items():
            assert torch.equal(v, opt_b.state[q][k]), k


@needs_cuda
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_replayed_steps_equal_eager_steps(cls):
    eager_model, graph_model = _model("cuda"), _model("cuda")
    eager = cls(eager_model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    opt = cls(graph_model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    params = list(graph_model.parameters())
    stepper = OptimizerStepGraph(opt)
    # the gradients in buffers of their own (as the dense graphs give them), filled each step
    buffers = [torch.zeros_like(p) for p in params]
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(12):
        fresh = step in (6, 7)  # gradients in other tensors: those steps run eagerly
        if step == 8:  # a new learning rate: eager, then captured again
            for o in (eager, opt):
                o.param_groups[0]["lr"] = 5e-3
        grads = [torch.randn(p.shape, device="cuda", generator=g) for p in params]
        for p, q, grad, buf in zip(eager_model.parameters(), params, grads, buffers):
            p.grad = grad.clone()
            q.grad = grad.clone() if fresh else buf.copy_(grad)
        if step == 10:  # a parameter without a gradient this step (the step skips it)
            eager_model[2].bias.grad = graph_model[2].bias.grad = None
        eager.step()
        stepper.step()
        _same(eager_model, graph_model, eager, opt)
    assert stepper.refused is None
    # steps 0 (it creates the states) and 1 eager, 2 captured, 3-5 replayed; 6-7 eager (gradients
    # elsewhere); 8 a new rate: eager, 9 captured; 10 a parameter skipped: eager; 11 replayed
    assert stepper.replays == 6


@needs_cuda
def test_loaded_states_are_stepped_not_the_captured_ones():
    eager_model, graph_model = _model("cuda"), _model("cuda")
    eager = torch.optim.Adam(eager_model.parameters(), lr=1e-2, fused=True)
    opt = torch.optim.Adam(graph_model.parameters(), lr=1e-2, fused=True)
    params = list(graph_model.parameters())
    stepper = OptimizerStepGraph(opt)
    buffers = [torch.zeros_like(p) for p in params]
    saved = None
    for step in range(8):
        for p, q, buf in zip(eager_model.parameters(), params, buffers):
            grad = torch.full_like(p, 0.1 * (step + 1))
            p.grad, q.grad = grad.clone(), buf.copy_(grad)
        if step == 2:
            saved = copy.deepcopy(opt.state_dict())
        if step == 5:  # both load the step-2 states
            eager.load_state_dict(copy.deepcopy(saved))
            opt.load_state_dict(copy.deepcopy(saved))  # (its hook forgets the graph)
        eager.step()
        stepper.step()
        _same(eager_model, graph_model, eager, opt)
    # steps 0-1 eager, 2 captured, 3-4 replayed; 5 eager after the load, 6 captured, 7 replayed
    assert stepper.replays == 5
