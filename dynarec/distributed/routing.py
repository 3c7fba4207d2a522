"""A sharded table's lookup: ids to their owners, pooled rows back, gradients the reverse way.

Between pack and lookup, every id of a step (with the index of its bag and its per-sample
weight, mean's ``1/L`` included) goes to the rank that owns its row by ``all_to_all`` with
variable splits. The owner runs the table's own lookup stage over the ids it received, one bag
per (sending rank, bag) pair, and sends each pooled partial sum back to its sender, which adds
the partials of its bags. The return trip is an autograd function: in backward each bag's
gradient goes back to the owners, whose lookup backward runs the fused optimizer over every
occurrence of a row from every rank at once.

Split sizes are read on the host (they size the receive buffers): one sync per exchange.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from dynarec.distributed.context import DistContext
from dynarec.embedding.pack import Bags

__all__ = ["AllToAll", "RoutedBags", "exchange_counts", "return_pooled", "route_bags"]


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
    """Each rank's ``counts[d]`` (items for rank ``d``) -> what each rank sends to this one."""
    received = torch.empty_like(counts)
    with ctx.collective(what):
        dist.all_to_all_single(received, counts.contiguous(), group=ctx.sparse_group)
    return received.tolist()


class RoutedBags:
    """The sender's memory of one routed lookup: which bags went where (to put the pooled
    partials back), and the split sizes."""

    def __init__(self, num_bags: int, sent_bags: torch.Tensor, bags_out: list[int], bags_in: list[int]):
        self.num_bags = num_bags
        self.sent_bags = sent_bags  # bag index of each pooled row that will come back, in order
        self.bags_out = bags_out  # bags this rank sent to each rank
        self.bags_in = bags_in  # bags each rank sent to this one (the owner's pooled rows, per sender)


def route_bags(
    bags: Bags, owner: torch.Tensor, local_ids: torch.Tensor, ctx: DistContext, table: str
) -> tuple[Bags, RoutedBags]:
    """Sends each id of ``bags`` to its ``owner`` rank (as ``local_ids``, its name there).

    Returns the bags this rank owns (one per sending rank and bag, in rank then bag order) and
    the routing to send their pooled rows back with :func:`return_pooled`."""
    world = ctx.world_size
    n, m = bags.ids.numel(), bags.num_bags
    device = bags.ids.device
    lengths = bags.offsets[1:] - bags.offsets[:-1]
    bag_of_id = torch.repeat_interleave(torch.arange(m, device=device), lengths, output_size=n)
    order = torch.argsort(owner, stable=True)  # by destination; ids of a bag stay together, in order
    dest, bag_sorted = owner[order], bag_of_id[order]
    weights = bags.weights if bags.weights is not None else torch.ones(n, device=device)
    # A new (destination, bag) pair starts wherever either changes.
    new = torch.ones(n, dtype=torch.bool, device=device)
    if n > 1:
        new[1:] = (dest[1:] != dest[:-1]) | (bag_sorted[1:] != bag_sorted[:-1])
    pair = torch.cumsum(new.to(torch.int64), 0) - 1  # the pair of each id, global over destinations
    ids_out = torch.bincount(dest, minlength=world)
    bags_out_t = torch.bincount(dest[new], minlength=world)
    first_pair = torch.cumsum(bags_out_t, 0) - bags_out_t  # each destination's first pair
    bag_in_dest = pair - first_pair[dest]  # the pair's index among those sent to its destination
    counts = exchange_counts(torch.stack([ids_out, bags_out_t], 1).flatten(), ctx, f"the id counts of table '{table}'")
    ids_in, bags_in = counts[0::2], counts[1::2]
    ids_out_l, bags_out = ids_out.tolist(), bags_out_t.tolist()
    what = f"the ids of table '{table}'"
    recv_ids = _all_to_all(local_ids[order], ids_in, ids_out_l, ctx, what)
    recv_bag = _all_to_all(bag_in_dest, ids_in, ids_out_l, ctx, what)
    recv_w = _all_to_all(weights[order], ids_in, ids_out_l, ctx, what)
    # On the owner: bag b of sender s is pair base[s] + b; the ids arrive grouped by sender, in
    # bag order, so the pairs ascend and their lengths make CSR offsets.
    base = torch.tensor([0, *bags_in], device=device).cumsum(0)[:-1]
    sender = torch.repeat_interleave(
        torch.arange(world, device=device), torch.tensor(ids_in, device=device), output_size=recv_ids.numel()
    )
    global_pair = recv_bag + base[sender]
    pair_lengths = torch.bincount(global_pair, minlength=sum(bags_in))
    offsets = torch.cat([pair_lengths.new_zeros(1), torch.cumsum(pair_lengths, 0)])
    owned = Bags(recv_ids, offsets, recv_w)
    return owned, RoutedBags(m, bag_sorted[new], bags_out, bags_in)


def return_pooled(
    pooled: torch.Tensor, routed: RoutedBags, ctx: DistContext, table: str, dim: Optional[int] = None
) -> torch.Tensor:
    """The owner's pooled rows ``[sum(bags_in), D]`` back to their senders, summed per bag:
    ``[num_bags, D]`` (differentiable: backward returns the bags' gradients to the owners)."""
    back = AllToAll.apply(pooled, routed.bags_out, routed.bags_in, ctx, f"the pooled rows of table '{table}'")
    out = back.new_zeros(routed.num_bags, dim if dim is not None else pooled.shape[1])
    return out.index_add(0, routed.sent_bags, back)
