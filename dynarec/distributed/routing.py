"""The routed tables' lookups of a step: every table's ids to their owners in one exchange,
the pooled rows back in another, gradients the reverse way (torchrec's grouped input and output
distribution).

Between pack and lookup, every id of every routed table (with the index of its bag and its
per-sample weight, mean's ``1/L`` included) goes to the rank that owns its row. All tables
travel together: one exchange of counts (ids and bags per destination and table) and one
``all_to_all`` of the ids, bag indices and weights packed side by side (the weights' bits as
integers), so a step's collectives do not grow with the number of tables. The owner runs each
table's own lookup over the bags it received, one bag per (sending rank, bag) pair, and the
pooled partial sums of every table go back in one ``all_to_all``; the sender adds the partials
of its bags. That return is differentiable: in backward every bag's gradient goes back to the
owners in one exchange, whose lookup backward runs the fused optimizer over every occurrence of
a row from every rank at once.

Split sizes are read on the host (they size the receive buffers): one sync per exchange.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dynarec.distributed.context import DistContext
from dynarec.embedding.pack import Bags

__all__ = ["AllToAll", "Routed", "exchange_counts", "return_pooled", "route"]


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable splits, differentiable: backward sends the gradient
    back along the same splits reversed."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], dist_ctx: DistContext, what: str):
        ctx.splits, ctx.dist_ctx, ctx.what = (out_splits, in_splits), dist_ctx, what
        return _all_to_all(x, out_splits, in_splits, dist_ctx, what)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        g = _all_to_all(grad, in_splits, out_splits, ctx.dist_ctx, f"the gradients of {ctx.what}")
        return g, None, None, None, None


def _all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], ctx: DistContext, what: str
) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with ctx.collective(what):
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=ctx.sparse_group)
    return out


def exchange_counts(counts: torch.Tensor, ctx: DistContext, what: str) -> list[int]:
    """Each rank's ``counts`` (``[world * k]``: ``k`` numbers for each destination rank) ->
    the ``k`` numbers each rank sent to this one, rank-major."""
    received = torch.empty_like(counts)
    with ctx.collective(what):
        dist.all_to_all_single(received, counts.contiguous(), group=ctx.sparse_group)
    return received.tolist()


@dataclass
class Routed:
    """The sender's memory of one step's routed lookups, to put the pooled partials back.

    ``num_bags[t]``: table ``t``'s bags on this rank; ``sent_bags[t]``: the bag index of each of
    its pooled rows that will come back, in (owner, bag) order; ``bags_out[r][t]``: bags of
    table ``t`` this rank sent to rank ``r``; ``bags_in[s][t]``: bags of table ``t`` rank ``s``
    sent to this one (the owner's pooled rows per sender)."""

    num_bags: list[int]
    sent_bags: list[torch.Tensor]
    bags_out: list[list[int]]
    bags_in: list[list[int]]


def route(
    bags: Sequence[Bags], owners: Sequence[torch.Tensor], local_ids: Sequence[torch.Tensor], ctx: DistContext
) -> tuple[list[Bags], Routed]:
    """Sends each id of table ``t``'s ``bags[t]`` to its ``owners[t]`` rank (as ``local_ids[t]``,
    its name there), all tables in one exchange.

    Returns, per table, the bags this rank owns (one per sending rank and bag, in rank then bag
    order; empty for a table it does not hold) and the routing to send their pooled rows back
    with :func:`return_pooled`."""
    world, T = ctx.world_size, len(bags)
    if T == 0:  # no routed table (the same on every rank): nothing to exchange
        return [], Routed([], [], [[] for _ in range(world)], [[] for _ in range(world)])
    device = ctx.device
    sizes = [b.ids.numel() for b in bags]
    n = sum(sizes)
    table = torch.repeat_interleave(torch.arange(T, device=device), torch.tensor(sizes, device=device), output_size=n)
    bag_of_id = torch.cat(
        [
            torch.repeat_interleave(
                torch.arange(b.num_bags, device=device), b.offsets[1:] - b.offsets[:-1], output_size=b.ids.numel()
            )
            for b in bags
        ]
    )
    dest, ids = torch.cat(list(owners)), torch.cat(list(local_ids))
    weights = torch.cat([torch.ones(b.ids.numel(), device=device) if b.weights is None else b.weights for b in bags])
    # By (destination, table); a bag's ids stay together and in order (the sort is stable).
    block = dest * T + table
    order = torch.argsort(block, stable=True)
    block, bag_sorted = block[order], bag_of_id[order]
    new = torch.ones(n, dtype=torch.bool, device=device)  # a (destination, table, bag) starts
    if n > 1:
        new[1:] = (block[1:] != block[:-1]) | (bag_sorted[1:] != bag_sorted[:-1])
    pair = torch.cumsum(new.to(torch.int64), 0) - 1
    ids_out = torch.bincount(block, minlength=world * T)
    bags_out_t = torch.bincount(block[new], minlength=world * T)
    first_pair = torch.cumsum(bags_out_t, 0) - bags_out_t
    bag_in_block = pair - first_pair[block]  # the bag's index among those of its (destination, table)
    counts = exchange_counts(torch.stack([ids_out, bags_out_t], 1).flatten(), ctx, "the routed tables' id counts")
    ids_in = [[counts[2 * (s * T + t)] for t in range(T)] for s in range(world)]
    bags_in = [[counts[2 * (s * T + t) + 1] for t in range(T)] for s in range(world)]
    ids_out_l = ids_out.view(world, T).sum(1).tolist()
    bags_out = bags_out_t.view(world, T).tolist()
    packed = torch.stack([ids[order], bag_in_block, _bits(weights[order])], 1)
    received = _all_to_all(packed, [sum(r) for r in ids_in], ids_out_l, ctx, "the routed tables' ids")
    owned = _owned_bags(received, ids_in, bags_in, device)
    sent_bags = [bag_sorted[new & (block % T == t)] for t in range(T)]
    return owned, Routed([b.num_bags for b in bags], sent_bags, bags_out, bags_in)


def _owned_bags(
    received: torch.Tensor, ids_in: list[list[int]], bags_in: list[list[int]], device: torch.device
) -> list[Bags]:
    """Per table, the bags of the ids received (``[N, 3]``: local id, bag index in its
    (sender, table) block, weight bits), arriving sender-major and table-major within a sender:
    one bag per (sender, bag), in sender then bag order."""
    world, T = len(ids_in), len(ids_in[0]) if ids_in else 0
    counts = torch.tensor([c for row in ids_in for c in row], dtype=torch.int64)  # [world * T], sender-major
    n = received.shape[0]
    block = torch.repeat_interleave(torch.arange(world * T), counts, output_size=n).to(device)
    table = block % T
    order = torch.argsort(table, stable=True)  # table-major; within a table by sender, then as sent
    rec, table, block = received[order], table[order], block[order]
    sender = block // T
    # Bag b of sender s for table t is the table's bag base[t][s] + b.
    base = []
    for t in range(T):
        before = [0]
        for s in range(world):
            before.append(before[-1] + bags_in[s][t])
        base.append(before[:-1])
    base_t = torch.tensor(base, dtype=torch.int64, device=device)  # [T, world]
    bag = rec[:, 1] + base_t[table, sender]
    out = []
    start = 0
    for t in range(T):
        size = sum(ids_in[s][t] for s in range(world))
        num_bags = sum(bags_in[s][t] for s in range(world))
        lengths = torch.bincount(bag[start : start + size], minlength=num_bags)
        offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        weights = _floats(rec[start : start + size, 2])
        out.append(Bags(rec[start : start + size, 0], offsets, weights))
        start += size
    return out


def _bits(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` as int64 holding its bits (it travels beside int64 ids, bit-exact)."""
    return x.contiguous().view(torch.int32).to(torch.int64)


def _floats(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int32).view(torch.float32)


def return_pooled(pooled: Sequence[torch.Tensor], dims: Sequence[int], routed: Routed, ctx: DistContext):
    """Every table's owner-side pooled rows (``pooled[t]`` ``[sum_s bags_in[s][t], dims[t]]``,
    sender-major) back to their senders in one exchange, summed per bag: ``[num_bags[t],
    dims[t]]`` per table (differentiable: backward returns every bag's gradient to its owner in
    one exchange)."""
    world, T = ctx.world_size, len(pooled)
    if T == 0:
        return []
    parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for t, p in enumerate(pooled):
        at = 0
        for s in range(world):
            k = routed.bags_in[s][t]
            parts[s].append(p[at : at + k].reshape(-1))
            at += k
    send = torch.cat([x for row in parts for x in row])
    out_splits = [sum(routed.bags_out[r][t] * dims[t] for t in range(T)) for r in range(world)]
    in_splits = [sum(routed.bags_in[s][t] * dims[t] for t in range(T)) for s in range(world)]
    back = AllToAll.apply(send, out_splits, in_splits, ctx, "the routed tables' pooled rows")
    chunks = back.split([routed.bags_out[r][t] * dims[t] for r in range(world) for t in range(T)])
    out = []
    for t in range(T):
        rows = torch.cat([chunks[r * T + t].view(-1, dims[t]) for r in range(world)])
        zeros = rows.new_zeros(routed.num_bags[t], dims[t])
        out.append(zeros.index_add(0, routed.sent_bags[t], rows))
    return out
