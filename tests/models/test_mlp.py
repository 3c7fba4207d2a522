"""MLP batch normalization over ranks: in a multi-process run a batch norm's training statistics
are the global batch's, so N ranks at batch B compute what one process at batch N * B does:
outputs, input gradients, the parameters' gradients summed over the ranks, running statistics.
Two real gloo processes against torch's nn.BatchNorm1d in one."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dynarec.models.mlp import BatchNorm, Dice, normalize_over_ranks

ROWS, UNITS = 12, 5


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 3, UNITS, generator=g) * 3 + torch.arange(UNITS)  # [B, L, units]: over B and L
    return x, torch.randn(ROWS, 3, UNITS, generator=g)


def train_steps(module: torch.nn.Module, x: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two training forwards and backwards of ``module`` on ``x`` (loss ``sum(out * w)``)."""
    out = {}
    for step in range(2):
        xi = (x + step).requires_grad_(True)
        y = module(xi)
        (y * w).sum().backward()
        out[f"y{step}"], out[f"dx{step}"] = y.detach(), xi.grad
    out.update({f"grad.{n}": p.grad for n, p in module.named_parameters()})
    out.update({f"buffer.{n}": b.clone() for n, b in module.named_buffers()})
    return out


def modules() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    bn = BatchNorm(UNITS)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    dice = Dice(UNITS)
    with torch.no_grad():
        dice.alpha.uniform_(-1, 1)
    return {"bn": bn, "dice": dice}


def _rank(rank: int, world: int, init_file: str, queue) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    x, w = inputs()
    share = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    results = {}
    for name, module in modules().items():
        normalize_over_ranks(module, dist.group.WORLD)
        results[name] = train_steps(module, x[share], w[share])
    # As numpy arrays, pickled whole: a tensor would travel as a file descriptor that the parent
    # fetches from this process later, and fails to once this process has exited.
    queue.put((rank, {name: {k: v.numpy() for k, v in r.items()} for name, r in results.items()}))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_batch_norm_over_two_ranks_equals_one_process_over_their_rows():
    x, w = inputs()
    whole = {name: train_steps(m, x, w) for name, m in modules().items()}
    assert isinstance(modules()["dice"].bn, BatchNorm)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_rank, args=(r, 2, os.path.join(d, "init"), queue)) for r in range(2)]
        for p in procs:
            p.start()
        got = {
            rank: {name: {k: torch.from_numpy(v) for k, v in r.items()} for name, r in results.items()}
            for rank, results in (queue.get(timeout=120) for _ in procs)
        }
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    for name, expected in whole.items():
        for key, value in expected.items():
            if key.startswith(("y", "dx")):  # each rank's rows, in order
                part = torch.cat([got[0][name][key], got[1][name][key]])
            elif key.startswith("grad."):  # summed over the ranks (DDP's sum hook)
                part = got[0][name][key] + got[1][name][key]
            else:  # running statistics: the same on both ranks
                assert torch.equal(got[0][name][key], got[1][name][key]), (name, key)
                part = got[0][name][key]
            torch.testing.assert_close(part, value.to(part.dtype), rtol=1e-5, atol=1e-5, msg=f"{name} {key}")


def test_batch_norm_without_a_group_is_torchs():
    x, _ = inputs()
    ours, torchs = BatchNorm(UNITS), torch.nn.BatchNorm1d(UNITS)
    torch.testing.assert_close(ours(x), torchs(x.reshape(-1, UNITS)).reshape(x.shape), rtol=0, atol=0)
    torch.testing.assert_close(ours.running_var, torchs.running_var, rtol=0, atol=0)
