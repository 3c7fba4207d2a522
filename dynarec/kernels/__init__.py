"""Device kernels behind the embedding layer's plain-torch code.

- ``dynarec.kernels.cpu``: a small C++ extension (compiled once per machine with torch's
  ``cpp_extension``, cached) for the CPU hot spots: the hash find, insert plans, the key-seeded
  initializer, the fused bag update. Where it cannot be built, the plain-torch code runs.
- ``dynarec.kernels.gpu``: Triton kernels of the CUDA path, one module a job: ``hashing`` (find,
  candidate buckets), ``plan`` (an insert plan's three steps and its commit), ``lookup`` (pooled
  forward), ``update`` (fused backward + update). They also run on CPU tensors under Triton's
  interpreter (``TRITON_INTERPRET=1``), which their tests use where there is no GPU.

Each kernel computes what its plain-torch twin computes (tests compare them); the fused update
runs an optimizer through the template parameters it registers (``OptimizerDef.kernel``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

__all__ = ["bag_update_kernel"]


def bag_update_kernel(device: torch.device) -> Optional[Callable[..., None]]:
    """The fused bag-update kernel of ``device`` (``(KernelArgs, *, lr, weight, states, rows,
    offsets, per_sample_weights, grad_out, row_scores)``), or None where it has none."""
    from dynarec.kernels import cpu, gpu

    if gpu.available(device):
        return gpu.bag_update
    if device.type == "cpu" and cpu.available():
        return cpu.bag_update
    return None
