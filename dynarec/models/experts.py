"""Mixtures of experts for multi-task models (TorchEasyRec's ``tzrec/modules/mmoe.py`` and
``extraction_net.py`` formulas): MMoE's gated experts and PLE's extraction layer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from dynarec.models.blocks import MLP

__all__ = ["ExtractionNet", "MMoE", "TaskTower", "gate"]


def gate(selector: torch.Tensor, experts: list[torch.Tensor], layer: nn.Module) -> torch.Tensor:
    """The experts' ``[B, E]`` outputs mixed by ``softmax(layer(selector))``: ``[B, E]``."""
    weights = torch.softmax(layer(selector), dim=1)  # [B, n]
    return torch.bmm(weights[:, None, :], torch.stack(experts, dim=1)).squeeze(1)


class MMoE(nn.Module):
    """``num_expert`` expert MLPs over ``[B, in_dim]``; task ``t`` reads their mix under its own
    softmax gate (a linear map, after an MLP of ``gate_hidden_units`` when given). ``forward``:
    one ``[B, out_dim]`` per task."""

    def __init__(
        self,
        in_dim: int,
        expert_hidden_units: Sequence[int],
        num_expert: int,
        num_task: int,
        gate_hidden_units: Sequence[int] = (),
        expert_dropout: Sequence[float] = (),
    ):
        super().__init__()
        self.experts = nn.ModuleList(
            MLP(in_dim, expert_hidden_units, dropout=expert_dropout) for _ in range(num_expert)
        )
        gates = []
        for _ in range(num_task):
            hidden = MLP(in_dim, gate_hidden_units)
            gates.append(nn.Sequential(hidden, nn.Linear(hidden.out_dim, num_expert)))
        self.gates = nn.ModuleList(gates)
        self.out_dim: int = expert_hidden_units[-1]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        experts = [e(x) for e in self.experts]
        return [gate(x, experts, g) for g in self.gates]


class ExtractionNet(nn.Module):
    """One PLE layer (customized gate control): per task ``per_task`` experts over the task's
    input, ``share_num`` shared experts over the shared input; task ``t``'s output mixes its own
    and the shared experts by its gate; unless ``final``, the shared output mixes every expert by
    the shared gate. ``forward((task inputs), shared) -> (task outputs, shared output or None)``."""

    def __init__(
        self,
        task_in_dims: Sequence[int],
        shared_in_dim: int,
        share_num: int,
        per_task: int,
        share_expert_hidden_units: Sequence[int],
        task_expert_hidden_units: Sequence[int],
        final: bool,
        share_expert_dropout: Sequence[float] = (),
        task_expert_dropout: Sequence[float] = (),
    ):
        super().__init__()
        self.shared = nn.ModuleList(
            MLP(shared_in_dim, share_expert_hidden_units, dropout=share_expert_dropout) for _ in range(share_num)
        )
        self.task_experts = nn.ModuleList(
            nn.ModuleList(MLP(d, task_expert_hidden_units, dropout=task_expert_dropout) for _ in range(per_task))
            for d in task_in_dims
        )
        self.task_gates = nn.ModuleList(nn.Linear(d, per_task + share_num) for d in task_in_dims)
        self.shared_gate = None if final else nn.Linear(shared_in_dim, len(task_in_dims) * per_task + share_num)
        self.task_out_dims = [task_expert_hidden_units[-1]] * len(task_in_dims)
        self.shared_out_dim: int = share_expert_hidden_units[-1]

    def forward(
        self, task_inputs: list[torch.Tensor], shared_input: torch.Tensor
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        shared = [e(shared_input) for e in self.shared]
        every: list[torch.Tensor] = []
        outputs = []
        for x, experts, g in zip(task_inputs, self.task_experts, self.task_gates):
            own = [e(x) for e in cast(nn.ModuleList, experts)]
            outputs.append(gate(x, own + shared, g))
            every += own
        shared_out = gate(shared_input, every + shared, self.shared_gate) if self.shared_gate is not None else None
        return outputs, shared_out


class TaskTower(nn.Module):
    """A task's MLP (``hidden_units``, may be empty; ``dropout`` ratios) and its output layer:
    ``[B, in_dim] -> [B, num_class]``."""

    def __init__(self, in_dim: int, hidden_units: Sequence[int], num_class: int, dropout: Sequence[float] = ()):
        super().__init__()
        self.mlp = MLP(in_dim, hidden_units, dropout=dropout)
        self.out = nn.Linear(self.mlp.out_dim, num_class)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mlp(x))
