"""The GPU update's host side that needs no kernel run: its step scalars and the bounds of a
static update (``dynarec.kernels.gpu.update``)."""

import pytest
import torch

from dynarec.kernels import gpu
from dynarec.optim import Adam, definition
from tests.matrix import needs_cuda

pytestmark = pytest.mark.skipif(not gpu.HAVE_TRITON, reason="Triton is not installed")


def test_the_step_scalars_are_laid_out_as_the_kernels_read_them():
    from dynarec.kernels.gpu import update

    spec = Adam(lr=0.01, weight_decay=0.1)
    args = definition(spec).kernel(spec, 3)
    values = dict(zip(update.HYPER, update.hyper_values(args, 0.01, score=7, key_offset=5, rounding_base=2**32 - 1)))
    assert len(values) == len(update.HYPER) == 13
    assert values["lr"] == 0.01 and values["beta1"] == args.beta1 and values["bias2"] == args.bias2
    assert values["c1"] == 1.0 - args.beta1 and values["decay"] == 1.0 - 0.01 * args.weight_decay
    assert (values["score"], values["key_offset"], values["rounding_base"]) == (7, 5, 2**32 - 1)


@pytest.mark.parametrize("name", ["score", "key_offset", "rounding_base"])
def test_an_integer_scalar_beyond_float64s_exact_range_is_refused_by_name(name):
    from dynarec.kernels.gpu import update

    spec = Adam(lr=0.01)
    with pytest.raises(ValueError, match=f"{name} {2**53} is not under 2\\^53"):
        update.hyper_values(definition(spec).kernel(spec, 1), 0.01, **{name: 2**53})


def test_a_static_update_refuses_more_ids_or_other_bags_than_it_holds():
    from dynarec.kernels.gpu import update

    spec = Adam(lr=0.01)
    args = definition(spec).kernel(spec, 1)
    weight = torch.zeros(10, 4)
    states = {s.name: torch.zeros(10, 4) for s in spec.state_specs()}
    grad = torch.zeros(2, 4)
    launch = update.Launch.of(args, weight, None, grad, None, None, None)
    static = update.StaticBagUpdate(launch, weight, states, None, None, None, capacity=4, num_bags=2, grad_width=4,
                                    capture=False)  # fmt: skip
    hyper = update.hyper_values(args, 0.01)
    with pytest.raises(ValueError, match="holds 4 ids in 2 bags, got 5 in 2"):
        static(torch.zeros(5, dtype=torch.int64), torch.tensor([0, 2, 5]), None, grad, hyper)
    with pytest.raises(ValueError, match="holds 4 ids in 2 bags, got 3 in 3"):
        static(torch.zeros(3, dtype=torch.int64), torch.tensor([0, 1, 2, 3]), None, torch.zeros(3, 4), hyper)
    assert torch.equal(weight, torch.zeros(10, 4)), "a refused step writes nothing"


def test_capacities_are_sixteen_sizes_an_octave_and_at_least_256():
    from dynarec.kernels.gpu.update import capacity_for

    assert [capacity_for(n) for n in (1, 256, 257, 4096, 4097, 1 << 20, (1 << 20) + 1)] == [
        256, 256, 512, 4096, 4352, 1 << 20, (1 << 20) + (1 << 16),
    ]  # fmt: skip
    for n in range(1, 200_000, 997):
        assert n <= capacity_for(n) <= max(256, n + n // 16)


def test_scalars_given_on_the_device_are_checked_by_name():
    from dynarec.kernels.gpu import update

    spec = Adam(lr=0.01)
    args = definition(spec).kernel(spec, 1)
    weight = torch.zeros(10, 4)
    with pytest.raises(ValueError, match="hyper must be 13 float64"):
        update.bag_update(
            args, lr=0.01, weight=weight, states={}, rows=torch.tensor([1]), offsets=torch.tensor([0, 1]),
            per_sample_weights=None, grad_out=torch.ones(1, 4), hyper=torch.zeros(13, dtype=torch.float32),
        )  # fmt: skip


@needs_cuda
def test_an_update_captured_with_its_scalars_on_the_device_replays_each_steps_scalars():
    """A graph of ``bag_update`` reading ``hyper`` replays the update of whatever scalars the
    buffer holds (Adam's step counter and rate here), as an eager update of them; inside a
    capture an update without them is refused (it would read freed host memory at each replay)."""
    from dynarec.devices import capture_graph
    from dynarec.kernels.gpu import update

    spec = Adam(lr=0.01, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 50, (300,), generator=g).cuda()
    offsets = torch.arange(0, 301, 3).cuda()
    grad = torch.randn(100, 8, generator=g).cuda()
    init = torch.randn(50, 8, generator=g).cuda()
    tables = [(init.clone(), {s.name: torch.zeros(50, 8, device="cuda") for s in spec.state_specs()}) for _ in "ab"]
    (weight, states), (eager_weight, eager_states) = tables
    hyper = torch.zeros(len(update.HYPER), dtype=torch.float64, device="cuda")
    call = dict(rows=rows, offsets=offsets, per_sample_weights=None, grad_out=grad)
    update.bag_update(definition(spec).kernel(spec, 1), lr=0.01, weight=weight, states=states, **call)  # compiled
    update.bag_update(definition(spec).kernel(spec, 1), lr=0.01, weight=eager_weight, states=eager_states, **call)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph):
        update.bag_update(definition(spec).kernel(spec, 1), lr=0.0, weight=weight, states=states, hyper=hyper, **call)
    with pytest.raises(RuntimeError, match="without hyper"), capture_graph(torch.cuda.CUDAGraph()):
        update.bag_update(definition(spec).kernel(spec, 1), lr=0.01, weight=weight, states=states, **call)
    for t, lr in ((2, 0.01), (3, 0.005), (4, 0.02)):
        args = definition(spec).kernel(spec, t)
        hyper.copy_(torch.tensor(update.hyper_values(args, lr), dtype=torch.float64))
        graph.replay()
        update.bag_update(args, lr=lr, weight=eager_weight, states=eager_states, **call)
        torch.testing.assert_close(weight, eager_weight, rtol=0, atol=0, msg=f"step {t}")
        for name in states:
            torch.testing.assert_close(states[name], eager_states[name], rtol=0, atol=0, msg=f"{name}, step {t}")
