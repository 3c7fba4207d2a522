"""PEPNet (TorchEasyRec's ``PEPNet``; Chang et al. 2023, parameter and embedding personalized
network): gates that scale the main vector by domain (EPNet) and each task MLP's layers by the
user, item and author (PPNet). ``[B, K * D]``: every task's towers, ``D`` a task
(``task_domain_num`` where a domain label chooses a row's; :mod:`dynarec.models.tasks` picks)."""

from __future__ import annotations

from typing import Optional, cast

import torch
from torch import nn

from dynarec.config.schema import Config, PEPNetCfg
from dynarec.models.blocks import DeepGroup
from dynarec.models.experts import TaskTower
from dynarec.models.features import FeatureInputs
from dynarec.models.mlp import Dice

__all__ = ["PEPNet"]


class GateNU(nn.Module):
    """``gamma * sigmoid(linear(relu(linear(x))))``: ``[B, in_dim] -> [B, out_dim]`` in ``(0, gamma)``."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, gamma: float):
        super().__init__()
        self.gamma = gamma
        self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, out_dim), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gamma * self.net(x)


class _GatedLayer(nn.Module):
    """A linear layer and its activation, scaled by its gate, then dropout."""

    def __init__(self, in_dim: int, units: int, gate_dim: int, activation: str, dropout: float, gamma: float):
        super().__init__()
        self.linear = nn.Linear(in_dim, units)
        self.act: nn.Module = Dice(units) if activation == "dice" else nn.ReLU()
        self.gate = GateNU(gate_dim, units, units, gamma)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, gate_input: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.act(self.linear(x)) * self.gate(gate_input))


class PPNet(nn.Module):
    """One MLP a task over the main vector, each layer's output (after its activation, before its
    dropout) scaled by its own gate over ``[uia, main]``: ``num_task`` outputs ``[B, hidden[-1]]``."""

    def __init__(
        self, main_dim: int, uia_dim: int, num_task: int, hidden: list[int], activation: str, dropout: list[float],
        gamma: float,
    ):  # fmt: skip
        super().__init__()
        ratios = dropout * len(hidden) if len(dropout) == 1 else (dropout or [0.0] * len(hidden))
        widths = [main_dim, *hidden[:-1]]
        self.tasks = nn.ModuleList(
            nn.ModuleList(
                _GatedLayer(w, units, main_dim + uia_dim, activation, ratio, gamma)
                for w, units, ratio in zip(widths, hidden, ratios)
            )
            for _ in range(num_task)
        )
        self.out_dim = hidden[-1]

    def forward(self, main: torch.Tensor, uia: torch.Tensor) -> list[torch.Tensor]:
        gate_input = torch.cat([uia, main.detach()], dim=1)
        outs = []
        for layers in self.tasks:
            x = main
            for layer in cast(nn.ModuleList, layers):
                x = layer(x, gate_input)
            outs.append(x)
        return outs


class PEPNet(nn.Module):
    def __init__(self, config: Config, cfg: PEPNetCfg):
        super().__init__()
        self.inputs = FeatureInputs(config)
        self.main = DeepGroup(config, config.model.group(cfg.main_input), self.inputs)
        width = self.main.out_dim
        self.domain: Optional[DeepGroup] = None
        self.epnet: Optional[GateNU] = None
        if cfg.domain_input is not None:
            self.domain = DeepGroup(config, config.model.group(cfg.domain_input), self.inputs)
            hidden = cfg.epnet_hidden_unit or width
            self.epnet = GateNU(self.domain.out_dim + width, hidden, width, cfg.epnet_gamma)
        self.uia: Optional[DeepGroup] = None
        self.ppnet: Optional[PPNet] = None
        if cfg.uia_input is not None:
            self.uia = DeepGroup(config, config.model.group(cfg.uia_input), self.inputs)
            self.ppnet = PPNet(
                width, self.uia.out_dim, len(cfg.task_towers), cfg.ppnet_hidden_units, cfg.ppnet_activation,
                cfg.ppnet_dropout_ratio, cfg.ppnet_gamma,
            )  # fmt: skip
            width = self.ppnet.out_dim
        # a task's towers side by side, one a domain
        self.towers = nn.ModuleList(
            nn.ModuleList(TaskTower(width, t.hidden_units, t.num_class, t.dropout_ratio) for _ in range(cfg.domains))
            for t in cfg.task_towers
        )

    def forward(self, embeddings, seq_lengths, dense) -> torch.Tensor:
        main = self.main(embeddings, seq_lengths, dense)
        if self.epnet is not None and self.domain is not None:
            domain = self.domain(embeddings, seq_lengths, dense)
            main = self.epnet(torch.cat([domain, main.detach()], dim=1)) * main
        if self.ppnet is not None and self.uia is not None:
            per_task = self.ppnet(main, self.uia(embeddings, seq_lengths, dense))
        else:
            per_task = [main] * len(self.towers)
        outs = [tower(x) for towers, x in zip(self.towers, per_task) for tower in cast(nn.ModuleList, towers)]
        return torch.cat(outs, dim=1)
