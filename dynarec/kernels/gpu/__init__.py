"""Triton kernels of the CUDA path, one module a job:

- :mod:`.hashing`: ``mix64``, a key's tag and candidate buckets, and the hash index's find;
- :mod:`.plan`: an insert plan's three steps (free slots, one cuckoo move, eviction) in ranked
  rounds with their host loop, and the commit of new keys into free slots;
- :mod:`.lookup`: the pooled forward;
- :mod:`.update`: the fused backward + optimizer update.

Each kernel computes what its plain-torch twin computes (the tests compare them: identical slots
and plans, weights within rtol 1e-5 / atol 1e-6), without its intermediate tensors. Each module
keeps its launch shapes in a frozen ``Tuning`` (its ``TUNING``), never in a signature. They run
on CUDA devices, or on the CPU under Triton's interpreter; ``dynarec.kernels.ops`` registers them
as the ops' implementations there.
"""

from __future__ import annotations

from dynarec.kernels.gpu._triton import HAVE_TRITON, INTERPRETED
from dynarec.kernels.gpu.lookup import pooled_forward
from dynarec.kernels.gpu.update import bag_update

__all__ = ["HAVE_TRITON", "INTERPRETED", "bag_update", "pooled_forward"]
