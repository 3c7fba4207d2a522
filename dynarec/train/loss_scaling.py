"""FP16 training's dynamic loss scaling, with the tables' fused updates inside it.

``torch.amp.GradScaler``'s rule (TorchEasyRec's ``grad_scaler``): the loss is multiplied by the
scale ``S`` before backward, so that small gradients survive the float16 backward; the gradients
are divided by ``S`` before they are applied; a step whose gradients overflowed (a non-finite
value) is skipped and ``S`` multiplied by ``backoff_factor``; after ``growth_interval`` steps in
a row without overflow ``S`` is multiplied by ``growth_factor``.

The tables' fused updates run inside backward, where a scaled loss would scale their gradients
and an overflow could not be taken back. So under loss scaling the dense model reads the
embeddings as leaves of their own (:meth:`RankingTask.forward_detached`): the scaled backward
stops there; then, where every gradient of the step is finite (on every rank), the embeddings'
gradients divided by ``S`` run the tables' backward — their fused updates see exactly the
gradient of the unscaled loss — and where one is not, the tables' step is aborted (nothing of it
written) and the window's dense step skipped. The tables update every step as always in dynarec
(``gradient_accumulation_steps`` accumulates the dense gradients only): a step of an
accumulation window that overflows updates no table, and neither does any later step of that
window (its dense gradients hold the overflow).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dynarec.config.schema import GradScalerCfg

__all__ = ["LossScaler"]


class LossScaler:
    """The scale and its growth tracker (a checkpoint holds both: :meth:`state`)."""

    def __init__(self, cfg: GradScalerCfg):
        self.cfg = cfg
        self.scale = float(cfg.init_scale)
        self.growth_tracker = 0  # steps in a row without overflow
        self.overflowed = False  # in the current accumulation window
        self.skipped_steps = 0  # dense steps skipped for an overflow

    @staticmethod
    def finite(grads: Sequence[torch.Tensor]) -> bool:
        """Whether every value of ``grads`` is finite (one device-to-host read)."""
        if not grads:
            return True
        return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    def unscale_(self, params: Sequence[torch.nn.Parameter]) -> None:
        """The dense gradients divided by the scale, in place (before clipping and the step)."""
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self) -> bool:
        """Ends an accumulation window: returns whether its dense step is to be taken, and moves
        the scale (torch.amp.GradScaler.update's rule)."""
        take = not self.overflowed
        if take:
            self.growth_tracker += 1
            if self.growth_tracker == self.cfg.growth_interval:
                self.scale *= self.cfg.growth_factor
                self.growth_tracker = 0
        else:
            self.scale *= self.cfg.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
        self.overflowed = False
        return take

    def state(self) -> dict[str, float]:
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "skipped_steps": self.skipped_steps,
            "overflowed": float(self.overflowed),  # (a checkpoint inside an accumulation window)
        }

    def load_state(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.overflowed = bool(state.get("overflowed", 0.0))
