"""Embedding tables: ids -> rows of a :class:`RowStore`, pooled per feature.

A table serves one or more features, each with its own pooling (``sum``, ``mean``, or ``none``
for a sequence). All of a step's lookups of a table go to its row store as one list of weighted
bags, so the backward pass sees every occurrence of a row across all features and updates it
once, with the summed gradient.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

import torch

from dynarec.embedding.config import FeatureConfig, TableConfig
from dynarec.embedding.fbgemm_store import FbgemmRowStore
from dynarec.embedding.initializers import Initializer
from dynarec.embedding.jagged import FeatureSlice
from dynarec.embedding.row_store import NativeRowStore, RowStore
from dynarec.optim.base import OptimizerSpec

__all__ = ["EmbeddingTable", "FixedTable", "make_row_store", "pad_sequence_rows"]

_ZERO = Initializer(kind="constant", value=0.0)


def make_row_store(config: TableConfig, spec: OptimizerSpec, num_rows: int, device: torch.device) -> RowStore:
    if config.backend == "fbgemm":
        return FbgemmRowStore(num_rows, config.dim, spec, device, where=f"table '{config.name}'")
    return NativeRowStore(num_rows, config.dim, spec, device)


def pad_sequence_rows(rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Jagged ``[n, D]`` (sample-major) -> padded ``[B, L, D]``, zeros past each length.

    ``L`` is the batch's longest sequence. Differentiable w.r.t. ``rows``.
    """
    batch = lengths.numel()
    max_len = int(lengths.max()) if batch and rows.shape[0] else 0
    starts = torch.cumsum(lengths, 0) - lengths
    sample = torch.repeat_interleave(torch.arange(batch, device=rows.device), lengths, output_size=rows.shape[0])
    position = torch.arange(rows.shape[0], device=rows.device) - starts[sample]
    flat = rows.new_zeros(batch * max_len, rows.shape[1]).index_copy(0, sample * max_len + position, rows)
    return flat.view(batch, max_len, rows.shape[1])


class EmbeddingTable(ABC):
    """Base of fixed and dynamic tables. Not an ``nn.Module``: its rows are trained by the fused
    optimizer only, so no dense optimizer can pick them up through ``parameters()``."""

    def __init__(self, config: TableConfig, spec: OptimizerSpec, device: torch.device):
        self.config = config
        self.name = config.name
        self.dim = config.dim
        self.spec = spec
        self.device = torch.device(device)
        self.features: list[FeatureConfig] = list(config.features)  # type: ignore[arg-type]
        self.initializer = config.initializer or Initializer()
        self.eval_initializer = (config.dynamic and config.dynamic.eval_initializer) or _ZERO

    @property
    @abstractmethod
    def store(self) -> RowStore: ...

    @abstractmethod
    def rows_for(self, ids: torch.Tensor, train: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Row index of every id, and a mask of the ids that have one (None: all do)."""

    def validate(self, feature: str, ids: torch.Tensor) -> None:
        """Raises ValueError for ids this table cannot take, before anything is written."""

    def eval_initializer_for(self, train: bool) -> Initializer:
        """What an id with no row reads in a forward of this mode."""
        return self.eval_initializer

    def initial_weights(self, ids: torch.Tensor) -> torch.Tensor:
        """Key-seeded initial weights ``[n, D]`` of a new row for each id."""
        return self.initializer.values(ids, self.dim, self.config.seed, self.config.default_bound)

    def on_lookup(self, out: torch.Tensor, train: bool) -> None:
        """Hook for subclasses, called with the row store's output."""

    def abort_step(self, looked_up: bool) -> None:
        """Undoes a training forward whose backward will never run: it raised (``looked_up``
        False) or a later table of the same step raised (True). The step counter goes back."""
        self.store.step -= 1

    @property
    def step(self) -> int:
        return self.store.step

    @property
    def learning_rate(self) -> float:
        return self.store.lr

    def set_learning_rate(self, lr: float) -> None:
        self.store.set_learning_rate(lr)

    def forward(self, inputs: Sequence[tuple[FeatureConfig, FeatureSlice]], train: bool) -> dict[str, torch.Tensor]:
        """Looks up every feature of ``inputs`` in one fused call.

        Returns ``{feature: [B, D]}`` for pooled features and ``{feature: [B, L, D]}``
        (zero-padded, L the batch's longest) for sequence features (pooling ``none``).
        Per-sample weights scale each id's row; mean pooling divides by the bag's full length
        (ids without a row included), with weights or without.
        """
        if not train:
            return self._forward(inputs, train)
        self.store.advance_step()
        try:
            return self._forward(inputs, train)
        except BaseException:
            self.abort_step(looked_up=False)
            raise

    def _forward(self, inputs: Sequence[tuple[FeatureConfig, FeatureSlice]], train: bool) -> dict[str, torch.Tensor]:
        ids = torch.cat([s.values for _, s in inputs]) if inputs else torch.empty(0, dtype=torch.int64)
        rows, valid = self.rows_for(ids, train)

        bag_lengths, weights, need_weights = [], [], False
        for feature, s in inputs:
            pooling = self.config.pooling_of(feature)
            w = s.weights
            if pooling == "none":
                bag_lengths.append(torch.ones_like(s.values))
            else:
                bag_lengths.append(s.lengths)
                if pooling == "mean":
                    inv = 1.0 / s.lengths.clamp(min=1).to(torch.float32)
                    scale = torch.repeat_interleave(inv, s.lengths, output_size=s.values.numel())
                    w = scale if w is None else w * scale
            need_weights |= w is not None
            weights.append(w)
        lengths = torch.cat(bag_lengths)
        num_bags = lengths.numel()
        psw = None
        if need_weights:
            psw = torch.cat([torch.ones(s.values.numel(), device=ids.device) if w is None else w
                             for w, (_, s) in zip(weights, inputs)])

        missing_out = None
        if valid is not None and bool(valid.all()):
            valid = None
        if valid is not None:
            bag_of_id = torch.repeat_interleave(torch.arange(num_bags, device=ids.device), lengths,
                                                output_size=ids.numel())
            absent = ~valid
            init = self.eval_initializer_for(train)
            if bool(absent.any()) and not init.is_zero:
                values = init.values(ids[absent], self.dim, self.config.seed, self.config.default_bound)
                if psw is not None:
                    values = values * psw[absent][:, None]
                missing_out = values.new_zeros(num_bags, self.dim).index_add_(0, bag_of_id[absent], values)
            lengths = torch.bincount(bag_of_id[valid], minlength=num_bags)
            rows = rows[valid]
            psw = None if psw is None else psw[valid]
        offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        out = self.store.lookup(rows, offsets, psw, train)
        self.on_lookup(out, train)
        if missing_out is not None:
            out = out + missing_out

        result: dict[str, torch.Tensor] = {}
        start = 0
        for (feature, s), n_bags in zip(inputs, (b.numel() for b in bag_lengths)):
            chunk = out[start : start + n_bags]
            start += n_bags
            if self.config.pooling_of(feature) == "none":
                chunk = pad_sequence_rows(chunk, s.lengths)
            result[feature.name] = chunk
        return result

    # -- rows by id ---------------------------------------------------------------------------

    @abstractmethod
    def read_rows(self, ids: torch.Tensor) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def write_rows(self, ids: torch.Tensor, values: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def dump(self) -> dict[str, torch.Tensor]:
        """Everything needed to restore the table exactly (CPU tensors)."""

    @abstractmethod
    def load(self, dump: dict[str, torch.Tensor], weights_only: bool = False) -> dict[str, int]:
        """Restores from :meth:`dump`; ``weights_only`` resets optimizer states and the step."""

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "kind": self.config.kind, "backend": self.config.backend,
                "dim": self.dim, "optimizer": type(self.spec).__name__, "step": self.step}


class FixedTable(EmbeddingTable):
    """``num_embeddings`` rows; id ``i`` is row ``i``. Initial weights are key-seeded with the
    ids as keys, so a fixed table starts from the rows a dynamic table gives the same keys."""

    def __init__(self, config: TableConfig, spec: OptimizerSpec, device: torch.device):
        super().__init__(config, spec, device)
        self.num_embeddings: int = config.num_embeddings  # type: ignore[assignment]
        self._store = make_row_store(config, spec, self.num_embeddings, self.device)
        chunk = 1 << 16
        with torch.no_grad():
            for start in range(0, self.num_embeddings, chunk):
                ids = torch.arange(start, min(start + chunk, self.num_embeddings), device=self.device)
                self._store.weight[start : start + ids.numel()] = self.initial_weights(ids)

    @property
    def store(self) -> RowStore:
        return self._store

    def validate(self, feature: str, ids: torch.Tensor) -> None:
        if ids.numel() == 0:
            return
        lo, hi = torch.aminmax(ids)
        if int(lo) < 0 or int(hi) >= self.num_embeddings:
            bad = int(lo) if int(lo) < 0 else int(hi)
            raise ValueError(
                f"table '{self.name}', feature '{feature}': id {bad} is out of range "
                f"[0, {self.num_embeddings})"
            )

    def rows_for(self, ids, train):
        return ids, None

    def read_rows(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        ids = torch.as_tensor(ids, dtype=torch.int64, device=self.device)
        self.validate("read_rows", ids)
        return self.store.read(ids)

    def write_rows(self, ids: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        ids = torch.as_tensor(ids, dtype=torch.int64, device=self.device)
        self.validate("write_rows", ids)
        self.store.write(ids, values)

    def dump(self) -> dict[str, torch.Tensor]:
        out = {"weight": self.store.weight.detach().cpu().clone()}
        out.update({k: v.detach().cpu().clone() for k, v in self.store.states.items()})
        out["step"] = torch.tensor(self.store.step, dtype=torch.int64)
        return out

    @torch.no_grad()
    def load(self, dump: dict[str, torch.Tensor], weights_only: bool = False) -> dict[str, int]:
        weight = dump["weight"]
        if tuple(weight.shape) != (self.num_embeddings, self.dim):
            raise ValueError(f"table '{self.name}': dump holds weight {tuple(weight.shape)}, "
                             f"the table is {(self.num_embeddings, self.dim)}")
        rows = torch.arange(self.num_embeddings, device=self.device)
        self.store.reallocate(self.num_embeddings)
        fields = ["weight"] if weights_only else ["weight", *self.store.states]
        missing = [f for f in fields if f not in dump]
        if missing:
            raise ValueError(f"table '{self.name}': dump lacks {missing} (optimizer {type(self.spec).__name__})")
        self.store.write(rows, {f: dump[f] for f in fields})
        self.store.step = 0 if weights_only else int(dump["step"])
        return {"loaded": self.num_embeddings, "dropped": 0}

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "num_embeddings": self.num_embeddings, "bytes": self.store.nbytes}
