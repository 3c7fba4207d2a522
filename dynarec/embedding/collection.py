"""EmbeddingCollection: many tables (fixed and dynamic), several features per table."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from dynarec.embedding.config import FeatureConfig, TableConfig
from dynarec.embedding.dynamic import DynamicTable
from dynarec.embedding.jagged import KeyedJaggedLike, split_features
from dynarec.embedding.table import EmbeddingTable, FixedTable
from dynarec.optim.base import OptimizerSpec

__all__ = ["EmbeddingCollection"]


class EmbeddingCollection(nn.Module):
    """Looks up every configured feature of a KeyedJaggedTensor-shaped batch.

    Args:
        tables: the tables; feature names must be unique across tables.
        optimizer: the sparse optimizer of every table without its own ``TableConfig.optimizer``.
        device: where the tables live.

    ``forward(kjt)`` returns ``{feature: tensor}``: ``[B, D]`` for pooled features (sum or mean)
    and ``[B, L, D]`` for sequence features (pooling ``none``), zero-padded to the batch's longest
    sequence; a sample's length is in ``kjt.lengths()``. In training mode, backward applies each
    table's fused optimizer to the touched rows (no dense optimizer is involved: the collection
    has no parameters).
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        optimizer: Optional[OptimizerSpec] = None,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.device = torch.device(device)
        self.tables: dict[str, EmbeddingTable] = {}
        self._features: dict[str, tuple[EmbeddingTable, FeatureConfig]] = {}
        for config in tables:
            if config.name in self.tables:
                raise ValueError(f"table '{config.name}' is configured twice")
            spec = config.optimizer or optimizer
            if spec is None:
                raise ValueError(f"table '{config.name}' has no optimizer: give the collection one or the table its own")
            table_cls = FixedTable if config.kind == "fixed" else DynamicTable
            table = table_cls(config, spec, self.device)
            self.tables[config.name] = table
            for feature in config.features:
                assert isinstance(feature, FeatureConfig)
                if feature.name in self._features:
                    raise ValueError(
                        f"feature '{feature.name}' is served by tables "
                        f"'{self._features[feature.name][0].name}' and '{config.name}'"
                    )
                self._features[feature.name] = (table, feature)

    @property
    def feature_names(self) -> list[str]:
        return list(self._features)

    def table_of(self, feature: str) -> EmbeddingTable:
        return self._features[feature][0]

    def forward(self, kjt: KeyedJaggedLike) -> dict[str, torch.Tensor]:
        slices = split_features(kjt)
        unknown = [k for k in slices if k not in self._features]
        if unknown:
            raise ValueError(f"batch feature(s) {unknown} are not served by any table; known: {self.feature_names}")
        missing = [f for f in self._features if f not in slices]
        if missing:
            raise ValueError(f"batch is missing feature(s) {missing}")
        for name, s in slices.items():
            if s.values.device != self.device:
                s.values, s.lengths = s.values.to(self.device), s.lengths.to(self.device)
                s.weights = None if s.weights is None else s.weights.to(self.device)
        # Validate every table's ids before any table creates, evicts or updates a row.
        for name, (table, _) in self._features.items():
            table.validate(name, slices[name].values)
        out: dict[str, torch.Tensor] = {}
        done: list[EmbeddingTable] = []
        try:
            for table in self.tables.values():
                inputs = [(feature, slices[feature.name]) for feature in table.features]
                out.update(table.forward(inputs, train=self.training))
                done.append(table)
        except BaseException:
            # The step will never have a backward: undo it on the tables that completed it
            # (the failing table undid its own), so step counters and pins stay consistent.
            if self.training:
                for table in done:
                    table.abort_step(looked_up=True)
            raise
        return out

    def read_rows(self, table: str, ids) -> dict[str, torch.Tensor]:
        """Weights and optimizer states at ``ids`` (row ids of a fixed table, keys of a dynamic
        one; a dynamic table adds a ``present`` mask)."""
        return self._table(table).read_rows(ids)

    def write_rows(self, table: str, ids, values: dict[str, torch.Tensor]) -> None:
        self._table(table).write_rows(ids, values)

    def set_learning_rate(self, lr: float, table: Optional[str] = None) -> None:
        """Sets the current learning rate of one table, or of every table."""
        for t in ([self._table(table)] if table is not None else self.tables.values()):
            t.set_learning_rate(lr)

    def describe(self) -> list[dict[str, object]]:
        return [t.describe() for t in self.tables.values()]

    def _table(self, name: str) -> EmbeddingTable:
        if name not in self.tables:
            raise KeyError(f"no table named '{name}'; tables: {list(self.tables)}")
        return self.tables[name]
