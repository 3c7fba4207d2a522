"""dynarec's kernels, behind one op surface: ``torch.ops.dynarec.*``, registered by
:mod:`dynarec.kernels.ops` (the only place an implementation is chosen by device).

- :mod:`dynarec.kernels.reference`: the plain-torch twin of every op, its default
  implementation (any device) and the reference the other twins are tested against;
- :mod:`dynarec.kernels.cpu`: a small C++ extension (compiled once per machine with torch's
  ``cpp_extension``, cached) for the CPU hot spots: the hash find, insert plans, the key-seeded
  initializer, the fused bag update. Where it cannot be built, the plain-torch twins run;
- :mod:`dynarec.kernels.gpu`: Triton kernels of the CUDA path, one module a job: ``hashing``
  (find, candidate buckets), ``plan`` (an insert plan's three steps and its commit), ``lookup``
  (pooled forward), ``update`` (fused backward + update). They also run on CPU tensors under
  Triton's interpreter (``TRITON_INTERPRET=1``), which their tests use where there is no GPU.

The fused update runs an optimizer by its code in ``dynarec.optim.kernel``'s table (the one
source of the codes the C++ and Triton update switch on); its optimizers register their
arguments there (``OptimizerDef.kernel``).
"""
