"""The plain-torch twins of dynarec's kernels: the default implementation of every
``torch.ops.dynarec`` op (any device), and the reference the C++ and Triton kernels are tested
against, bit for bit where they compute in the same order (hashing, finds, plans, writes) and to
the tolerance policy where they sum in another (pooling, the fused update).

- :mod:`.hashing`: ``mix64``, a key's tag and candidate buckets, the two-choice find, the
  key-seeded uniform draws and the uniform initializer's rows;
- :mod:`.plan`: an insert plan's three steps, the keys a find left without a row, a plan's moves
  followed, and the index writes a commit, a touch and a step's pins make;
- :mod:`.bags`: the pooled lookup, and the fused backward + update of weighted-sum bags;
- :mod:`.rows`: rows moved between a device cache and host memory, fresh optimizer states.

Written with batched tensor ops, no Python loop per key; imports torch alone (and the optimizer
table, ``dynarec.optim.kernel``).
"""

from dynarec.kernels.reference.bags import aggregate, bag_gradients, bag_update, bags_of_ids, pooled
from dynarec.kernels.reference.hashing import (
    candidate_buckets,
    find,
    key_tags,
    mix64,
    uniform01,
    uniform_rows,
    uniform_salt,
    uniform_values,
)
from dynarec.kernels.reference.plan import (
    absent_keys,
    claim_free_slots,
    fill_at,
    fill_slots,
    follow_moves,
    place_keys,
    plan_insert,
    slot_positions,
)
from dynarec.kernels.reference.rows import exchange_rows, fill_rows

__all__ = [
    "absent_keys",
    "aggregate",
    "bag_gradients",
    "bag_update",
    "bags_of_ids",
    "candidate_buckets",
    "claim_free_slots",
    "exchange_rows",
    "fill_at",
    "fill_rows",
    "fill_slots",
    "find",
    "follow_moves",
    "key_tags",
    "mix64",
    "place_keys",
    "plan_insert",
    "pooled",
    "slot_positions",
    "uniform01",
    "uniform_rows",
    "uniform_salt",
    "uniform_values",
]
