"""The process group of a multi-process run, and the rules every collective follows.

A run started by ``torchrun`` (which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the
rendezvous address — torchrun's own interface) gets a :class:`DistContext` from
:func:`init_distributed`: gloo on CPU, NCCL on GPUs (``cuda:LOCAL_RANK``). Two rules make a run
fail cleanly instead of hanging:

- every collective runs inside :meth:`DistContext.collective`, which turns a timeout or a dead
  peer into a :class:`DistributedError` naming what this rank was waiting for;
- every rank takes part in every collective of a step even when its own part failed, and all
  ranks :meth:`DistContext.agree` on the step's outcome before any of them commits: one rank's
  error stops every rank, each naming the failing rank and its message.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["DistContext", "DistributedError", "StepFailedError", "init_distributed", "single_process"]


class DistributedError(RuntimeError):
    """A collective failed or timed out; the message names what the rank waited for."""


class StepFailedError(RuntimeError):
    """A step failed on one or more ranks; every rank raises it, naming them and their messages."""


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeout_s: float
    group: Any = None  # the default group: agreement, barriers, DDP
    sparse_group: Any = None  # a second group for the embeddings' all-to-alls (never interleaved with DDP)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Runs a collective, turning its failure into an error that names ``what``: a wait past
        the collective timeout, or (sooner) a failure it reports, another rank's connection lost
        among them."""
        began = time.monotonic()
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            if isinstance(e, (DistributedError, StepFailedError)):
                raise
            waited = time.monotonic() - began
            if waited < 0.9 * self.timeout_s:  # (not a wait: a peer gone, or this rank's own failure)
                raise DistributedError(
                    f"rank {self.rank} of {self.world_size}: {what} failed after {waited:.1f}s, before the collective "
                    f"timeout ({e})"
                ) from None
            raise DistributedError(
                f"rank {self.rank} of {self.world_size}: gave up waiting for {what} (collective timeout "
                f"{self.timeout_s:g}s, train.collective_timeout_seconds): another rank stopped or is stuck ({e})"
            ) from None

    def barrier(self, what: str) -> None:
        if self.distributed:
            with self.collective(what):
                dist.barrier(group=self.group)

    def agree(self, error: Optional[BaseException], what: str) -> None:
        """All ranks learn whether any of them failed ``what``; if one did, every rank raises
        StepFailedError naming the failing ranks and their messages."""
        if not self.distributed:
            if error is not None:
                raise error
            return
        flag = torch.tensor([1 if error is not None else 0], device=self.device)
        with self.collective(f"the other ranks to finish {what}"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            if not int(flag):
                return
            messages: list[Optional[str]] = [None] * self.world_size
            dist.all_gather_object(
                messages, None if error is None else f"{type(error).__name__}: {error}", group=self.group
            )
        failed = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
        raise StepFailedError(f"{what} failed on {failed}") from error

    def any(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` holds on any rank."""
        return self.any_each([flag], what)[0]

    def any_each(self, flags: list[bool], what: str) -> list[bool]:
        """Each of ``flags``: whether it holds on any rank (one collective for all of them)."""
        if not self.distributed:
            return list(flags)
        t = torch.tensor([int(f) for f in flags], device=self.device)
        with self.collective(f"the other ranks to finish {what}"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in t.tolist()]

    def all_gather_objects(self, obj: Any, what: str) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self.collective(what):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_reduce_sum(self, tensor: torch.Tensor, what: str, sparse: bool = False) -> torch.Tensor:
        if self.distributed:
            with self.collective(what):
                dist.all_reduce(tensor, group=self.sparse_group if sparse else self.group)
        return tensor


def single_process(device: torch.device | str = "cpu") -> DistContext:
    return DistContext(rank=0, world_size=1, local_rank=0, device=torch.device(device), timeout_s=0.0)


def init_distributed(device: str = "cpu", timeout_s: float = 300.0) -> DistContext:
    """The context of this process: a single process, or one rank of a torchrun job (gloo on
    CPU, NCCL on CUDA, ``cuda`` meaning ``cuda:LOCAL_RANK``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return single_process(device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout, device_id=dev if dev.type == "cuda" else None)
    ctx = DistContext(rank, world, local_rank, dev, timeout_s, group=dist.group.WORLD)
    ctx.sparse_group = dist.new_group(backend=backend, timeout=timeout)
    return ctx
