"""Plain unfused reference of a table step, for tests.

Outputs are built one sample at a time from a leaf copy of the weights; autograd gives the
dense gradient; :func:`dynarec.optim.reference.reference_update` applies the optimizer row by
row. Shares no code with the tables under test.
"""

from __future__ import annotations

import numpy as np
import torch

from dynarec.optim.reference import reference_update


def zipf_batch(rng: np.random.Generator, batch: int, max_len: int, num_rows: int, a: float = 1.3):
    """``batch`` samples of 0..max_len Zipf-distributed ids in [0, num_rows) (duplicates)."""
    out = []
    for _ in range(batch):
        n = int(rng.integers(0, max_len + 1))
        out.append([int(x) % num_rows for x in rng.zipf(a, size=n)])
    return out


def reference_outputs(leaf: torch.Tensor, samples, pooling: str, weights=None) -> torch.Tensor:
    """[B, D] pooled or [B, L, D] padded outputs of one feature over ``leaf`` rows."""
    dim = leaf.shape[1]
    if pooling == "none":
        max_len = max((len(s) for s in samples), default=0)
        rows = []
        for b, s in enumerate(samples):
            seq = [leaf[i] * (1.0 if weights is None else weights[b][j]) for j, i in enumerate(s)]
            seq += [torch.zeros(dim)] * (max_len - len(s))
            rows.append(torch.stack(seq) if seq else torch.zeros(0, dim))
        return torch.stack(rows)
    bags = []
    for b, s in enumerate(samples):
        acc = torch.zeros(dim)
        for j, i in enumerate(s):
            acc = acc + leaf[i] * (1.0 if weights is None else weights[b][j])
        if pooling == "mean" and s:
            acc = acc / len(s)
        bags.append(acc)
    return torch.stack(bags)


def reference_table_step(spec, *, lr, step, weight, states, features, poolings, grads, weights=None):
    """One training step of a table serving ``features`` ({name: samples}), in place.

    The loss is ``sum_f (out_f * grads[f]).sum()``; with ``spec.gradient_clipping`` the
    gradient reaching each output element is ``grads[f]`` clamped to ``max_gradient``. Returns
    the outputs.
    """
    leaf = weight.clone().requires_grad_(True)
    loss = torch.zeros(())
    outs, touched = {}, []
    for name, samples in features.items():
        w = None if weights is None else weights.get(name)
        out = reference_outputs(leaf, samples, poolings[name], w)
        outs[name] = out.detach()
        g = grads[name]
        if spec.gradient_clipping:
            g = g.clamp(-spec.max_gradient, spec.max_gradient)
        loss = loss + (out * g).sum()
        touched += [i for s in samples for i in s]
    loss.backward()
    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(weight)
    reference_update(
        spec,
        lr=lr,
        step=step,
        weight=weight,
        states=states,
        touched=torch.tensor(touched, dtype=torch.int64),
        dense_grad=grad,
    )
    return outs
