"""The device a command runs on, checked before anything is built or written."""

from __future__ import annotations

import torch

__all__ = ["check_device"]

_INSTALL = "see README.md, 'On a GPU', to install torch's CUDA build (make setup DEVICE=cuda)"


def check_device(name: str) -> torch.device:
    """``torch.device(name)``; ValueError saying how to get it where this torch cannot use it
    (a CPU-only build, no visible GPU, a GPU index past the last one)."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name}: not a device ({e}); use cpu, cuda or cuda:N") from None
    if device.type != "cuda":
        return device
    if not torch.backends.cuda.is_built():
        raise ValueError(f"--device {name}: this torch build ({torch.__version__}) has no CUDA support; {_INSTALL}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch {torch.__version__} sees no CUDA device on this machine")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
