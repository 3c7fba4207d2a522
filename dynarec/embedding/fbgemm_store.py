"""Row store on FBGEMM's TBE (``SplitTableBatchedEmbeddingBagsCodegen``, CPU build).

FBGEMM runs the lookup and the fused optimizer; dynarec only configures it from the table's
optimizer spec and reads/writes rows through TBE's public accessors
(``split_embedding_weights``, ``split_optimizer_states``, ``set_learning_rate``). Nothing of
FBGEMM is patched or copied, and no environment variable is involved.

Pitfalls of FBGEMM's CPU build and how this store handles them (see docs/optimizers.md):
- ``initial_accumulator_value``: TBE has no such argument; the store fills ``momentum1``
  through ``split_optimizer_states()`` right after building the TBE.
- RowWiseAdagrad weight decay: the CPU kernel's fast path for a table used by one feature drops
  it. When a spec has weight decay, the store maps a second, always-empty feature onto the
  table (``feature_table_map=[0, 0]``), which takes TBE's generic path that applies it.
- Mean pooling with per-sample weights: the CPU kernel skips ``1/L``. The store never asks TBE
  to pool by mean; callers pass ``1/L`` in the per-sample weights (SUM pooling), which is
  exactly the GPU meaning.
- Adam: the CPU TBE refuses it; so does this store, naming the native backend.
"""

from __future__ import annotations

from typing import Optional

import torch

from dynarec.embedding.config import check_fbgemm_dim
from dynarec.embedding.row_store import RowStore
from dynarec.optim.base import OptimizerSpec
from dynarec.optim.registry import FbgemmMapping, definition

__all__ = ["FbgemmRowStore", "check_fbgemm_supports", "fbgemm_available"]


def fbgemm_available() -> bool:
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (  # noqa: F401
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except Exception:
        return False
    return True


def check_fbgemm_supports(spec: OptimizerSpec, device: torch.device, where: str, dim: Optional[int] = None) -> None:
    """Raises ValueError naming the ``native`` backend for what the fbgemm backend cannot do."""
    if not fbgemm_available():
        raise ValueError(
            f"{where}: backend 'fbgemm' needs FBGEMM (fbgemm-gpu-cpu==1.8.0) installed; use backend='native'"
        )
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"{where}: backend 'fbgemm' runs on CPU only here (FBGEMM's CUDA build is not "
            f"installed); got device {device}; use backend='native'"
        )
    fbgemm_mapping(spec, where)
    if dim is not None:
        check_fbgemm_dim(where, dim)


def fbgemm_mapping(spec: OptimizerSpec, where: str) -> FbgemmMapping:
    """The registry's FBGEMM mapping of ``spec``; ValueError naming ``native`` where it refuses."""
    defn = definition(spec)
    if isinstance(defn.fbgemm, str):
        raise ValueError(
            f"{where}: {defn.name} is not supported by backend 'fbgemm' ({defn.fbgemm}); use backend='native'"
        )
    return defn.fbgemm(spec)


class FbgemmRowStore(RowStore):
    """Rows in one FBGEMM TBE table on CPU, its optimizer fused by FBGEMM."""

    def __init__(
        self, num_rows: int, dim: int, spec: OptimizerSpec, device: torch.device | str = "cpu", where: str = "table"
    ):
        check_fbgemm_supports(spec, torch.device(device), where, dim)
        super().__init__(num_rows, dim, spec, torch.device(device))
        self._mapping = fbgemm_mapping(spec, where)
        self._shared_feature_map = self._mapping.needs_generic_path
        self._allocate(num_rows)

    def _tbe_kwargs(self) -> dict:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

        m = self._mapping
        kwargs: dict = {
            "learning_rate": self.lr,
            "optimizer": EmbOptimType[m.optimizer],
            "gradient_clipping": self.spec.gradient_clipping,
            "max_gradient": self.spec.max_gradient,
            **m.kwargs,
        }
        if m.weight_decay_mode is not None:
            kwargs["weight_decay_mode"] = WeightDecayMode[m.weight_decay_mode]
        return kwargs

    def _allocate(self, num_rows: int) -> None:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            SplitTableBatchedEmbeddingBagsCodegen,
        )
        from fbgemm_gpu.tbe.config.embedding_config import (
            BoundsCheckMode,
            ComputeDevice,
            EmbeddingLocation,
            PoolingMode,
        )

        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(num_rows, self.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            feature_table_map=[0, 0] if self._shared_feature_map else [0],
            pooling_mode=PoolingMode.SUM,
            bounds_check_mode=BoundsCheckMode.NONE,  # ids are validated before they get here
            **self._tbe_kwargs(),
        )
        self.tbe.train()
        self._weight_view = self.tbe.split_embedding_weights()[0]
        self._weight_view.zero_()
        raw_states = self.tbe.split_optimizer_states()[0] if self.spec.state_specs() else []
        self._state_views = {}
        for spec, t in zip(self.spec.state_specs(), raw_states):
            view = t.view(num_rows, spec.width(self.dim))
            view.fill_(spec.initial_value)
            self._state_views[spec.name] = view

    def __getstate__(self) -> dict:
        """For ``copy.deepcopy`` and pickling: the rows and states as tensors, not the TBE (a
        deep-copied TBE clones its weights apart from this store's views of them, and it holds
        closures pickle refuses); :meth:`__setstate__` builds a TBE of them."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("tbe", "_weight_view", "_state_views")}
        state["_rows"] = {"weight": self._weight_view.detach().clone()}
        state["_rows"].update({k: v.detach().clone() for k, v in self._state_views.items()})
        return state

    @torch.no_grad()
    def __setstate__(self, state: dict) -> None:
        rows = state.pop("_rows")
        self.__dict__.update(state)
        self._allocate(self.num_rows)
        self._weight_view.copy_(rows.pop("weight"))
        for name, values in rows.items():
            self._state_views[name].copy_(values)

    @property
    def weight(self) -> torch.Tensor:
        return self._weight_view

    def storage(self):
        return (self.num_rows, self.tbe, self._weight_view, self._state_views)

    def restore_storage(self, handle) -> None:
        self.num_rows, self.tbe, self._weight_view, self._state_views = handle
        self.tbe.set_learning_rate(self.lr)

    @property
    def states(self) -> dict[str, torch.Tensor]:
        return self._state_views

    def set_learning_rate(self, lr: float) -> None:
        super().set_learning_rate(lr)
        self.tbe.set_learning_rate(self.lr)

    def lookup(self, rows, offsets, per_sample_weights: Optional[torch.Tensor], train, step=0, row_scores=None):
        if row_scores is not None:
            raise ValueError("FbgemmRowStore: FBGEMM's update cannot write row scores (writes_row_scores is False)")
        num_bags = offsets.numel() - 1
        if self._shared_feature_map:  # the second feature: num_bags empty bags
            offsets = torch.cat([offsets, offsets[-1:].expand(num_bags)])
        psw = None if per_sample_weights is None else per_sample_weights.contiguous()
        if train and torch.is_grad_enabled():
            out = self.tbe(rows, offsets, per_sample_weights=psw)
        else:
            with torch.no_grad():
                out = self.tbe(rows, offsets, per_sample_weights=psw)
        return out[:, : self.dim] if self._shared_feature_map else out
