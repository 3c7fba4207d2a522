"""Multi-task rankers in TorchEasyRec's layout: simple multi-task, MMoE, PLE and DBMTL. Each
reads the first feature group and returns its tasks' logits side by side, ``[B, K]`` (``K`` the
sum of the towers' ``num_class``, in tower order; :mod:`dynarec.models.tasks` splits them)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from dynarec.config.schema import Config, DBMTLCfg, MMoECfg, PLECfg, SimpleMultiTaskCfg
from dynarec.config.tasks import TaskTowerCfg
from dynarec.models.blocks import MLP, DeepGroup
from dynarec.models.experts import ExtractionNet, TaskTower
from dynarec.models.experts import MMoE as MMoEModule
from dynarec.models.features import FeatureInputs
from dynarec.models.interaction import MaskNetModule

__all__ = ["DBMTL", "PLE", "MMoE", "SimpleMultiTask"]


class _MultiTask(nn.Module):
    """The first feature group as one ``[B, width]`` input (``self.group``), and the towers."""

    def __init__(self, config: Config, towers: list[TaskTowerCfg]):
        super().__init__()
        self.inputs = FeatureInputs(config)
        self.group = DeepGroup(config, config.model.feature_groups[0], self.inputs)
        self.tower_cfgs = towers

    def _input(self, embeddings, seq_lengths, dense) -> torch.Tensor:
        return self.group(embeddings, seq_lengths, dense)


class SimpleMultiTask(_MultiTask):
    """Each task's tower straight over the first group."""

    def __init__(self, config: Config, cfg: SimpleMultiTaskCfg):
        super().__init__(config, cfg.task_towers)
        self.towers = nn.ModuleList(
            TaskTower(self.group.out_dim, t.hidden_units, t.num_class, t.dropout_ratio) for t in cfg.task_towers
        )

    def forward(self, embeddings, seq_lengths, dense):
        x = self._input(embeddings, seq_lengths, dense)
        return torch.cat([tower(x) for tower in self.towers], dim=1)


class MMoE(_MultiTask):
    """Multi-gate Mixture-of-Experts: the experts' mix under task ``t``'s gate feeds tower ``t``."""

    def __init__(self, config: Config, cfg: MMoECfg):
        super().__init__(config, cfg.task_towers)
        self.mmoe = MMoEModule(
            self.group.out_dim, cfg.expert_hidden_units, cfg.num_expert, len(cfg.task_towers), cfg.gate_hidden_units,
            cfg.expert_dropout_ratio,
        )  # fmt: skip
        self.towers = nn.ModuleList(
            TaskTower(self.mmoe.out_dim, t.hidden_units, t.num_class, t.dropout_ratio) for t in cfg.task_towers
        )

    def forward(self, embeddings, seq_lengths, dense):
        mixed = self.mmoe(self._input(embeddings, seq_lengths, dense))
        return torch.cat([tower(x) for tower, x in zip(self.towers, mixed)], dim=1)


class PLE(_MultiTask):
    """Progressive Layered Extraction: extraction layers (the last without a shared gate), then
    tower ``t`` over task ``t``'s output of the last layer."""

    def __init__(self, config: Config, cfg: PLECfg):
        super().__init__(config, cfg.task_towers)
        n = len(cfg.task_towers)
        task_dims, shared_dim = [self.group.out_dim] * n, self.group.out_dim
        layers = []
        for i, e in enumerate(cfg.extraction_networks):
            layer = ExtractionNet(
                task_dims, shared_dim, e.share_num, e.expert_num_per_task, e.share_expert_hidden_units,
                e.task_expert_hidden_units, final=i == len(cfg.extraction_networks) - 1,
                share_expert_dropout=e.share_expert_dropout_ratio, task_expert_dropout=e.task_expert_dropout_ratio,
            )  # fmt: skip
            layers.append(layer)
            task_dims, shared_dim = layer.task_out_dims, layer.shared_out_dim
        self.layers = nn.ModuleList(layers)
        self.towers = nn.ModuleList(
            TaskTower(d, t.hidden_units, t.num_class, t.dropout_ratio) for d, t in zip(task_dims, cfg.task_towers)
        )

    def forward(self, embeddings, seq_lengths, dense):
        x = self._input(embeddings, seq_lengths, dense)
        tasks, shared = [x] * len(self.towers), x
        for layer in self.layers:
            tasks, shared = layer(tasks, shared)
        return torch.cat([tower(t) for tower, t in zip(self.towers, tasks)], dim=1)


class DBMTL(_MultiTask):
    """Deep Bayesian Multi-Target Learning: a shared bottom (MaskNet, then an MLP; each
    optional), optional MMoE experts, each task's MLP; a task with ``relation_tower_names`` reads
    its MLP's output beside those tasks' (relation) outputs through its relation MLP; then each
    task's output layer."""

    def __init__(self, config: Config, cfg: DBMTLCfg):
        super().__init__(config, cfg.task_towers)
        width = self.group.out_dim
        self.mask_net: Optional[MaskNetModule] = None
        if cfg.mask_net is not None:
            m = cfg.mask_net
            aggregation = m.mask_block.aggregation_dim or max(int(width * m.mask_block.reduction_ratio), 1)
            mask_net = MaskNetModule(
                width, m.n_mask_blocks, m.mask_block.hidden_dim, aggregation, m.top_hidden_units, m.use_parallel
            )
            self.mask_net, width = mask_net, mask_net.out_dim
        self.bottom = MLP(width, cfg.bottom_hidden_units, dropout=cfg.bottom_dropout_ratio)
        width = self.bottom.out_dim
        self.mmoe: Optional[MMoEModule] = None
        if cfg.expert_hidden_units:
            mmoe = MMoEModule(
                width, cfg.expert_hidden_units, cfg.num_expert, len(cfg.task_towers), cfg.gate_hidden_units,
                cfg.expert_dropout_ratio,
            )  # fmt: skip
            self.mmoe, width = mmoe, mmoe.out_dim
        task_mlps = [MLP(width, t.hidden_units, dropout=t.dropout_ratio) for t in cfg.task_towers]
        self.task_mlps = nn.ModuleList(task_mlps)
        index = {t.tower_name: i for i, t in enumerate(cfg.task_towers)}
        self.relations = [[index[r] for r in t.relation_tower_names] for t in cfg.task_towers]
        self.relation_mlps = nn.ModuleDict()  # by tower index, for the towers with relations
        outs: list[nn.Linear] = []
        widths: list[int] = []
        for i, t in enumerate(cfg.task_towers):
            width = task_mlps[i].out_dim
            if t.relation_tower_names:
                mlp = MLP(
                    width + sum(widths[j] for j in self.relations[i]),
                    t.relation_hidden_units,
                    dropout=t.relation_dropout_ratio,
                )
                self.relation_mlps[str(i)] = mlp
                width = mlp.out_dim
            widths.append(width)
            outs.append(nn.Linear(width, t.num_class))
        self.outs = nn.ModuleList(outs)

    def forward(self, embeddings, seq_lengths, dense):
        net = self._input(embeddings, seq_lengths, dense)
        if self.mask_net is not None:
            net = self.mask_net(net)
        net = self.bottom(net)
        inputs = self.mmoe(net) if self.mmoe is not None else [net] * len(self.task_mlps)
        nets: list[torch.Tensor] = []
        for i, mlp in enumerate(self.task_mlps):
            net = mlp(inputs[i])
            if str(i) in self.relation_mlps:
                net = self.relation_mlps[str(i)](torch.cat([net] + [nets[j] for j in self.relations[i]], dim=1))
            nets.append(net)
        return torch.cat([out(x) for out, x in zip(self.outs, nets)], dim=1)
