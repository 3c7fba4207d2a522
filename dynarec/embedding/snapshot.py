"""Dump and load of a dynamic table: its keys with their rows, scores and slots, the bucket layout,
the step counter and the admission counter.

A dump holds CPU tensors: ``keys`` (ascending), ``scores`` and ``slots`` of every key, a row field
per key (``weight`` and each optimizer state), ``step``, ``layout`` (``[num_buckets, bucket_size,
LAYOUT_VERSION]``) and, with admission, ``admission_keys`` / ``admission_counts`` /
``admission_slots``.

A load puts every key back in its own slot when the dump's layout fits the table (same bucket
size, buckets from ``init_capacity``'s to ``max_capacity``'s: a table never has fewer slots than
it starts with): a resumed run then evicts exactly as the original would have. Otherwise the keys
are placed anew (``BucketedHashIndex.fill``) in the fewest buckets, from ``init_capacity``'s, that
hold them at the growth load, capped at ``max_capacity``; where they do not fit, the highest
scores are kept (ties to the smaller key).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Optional

import torch

from dynarec.embedding.capacity import Capacity
from dynarec.embedding.hash_index import LAYOUT_VERSION, BucketedHashIndex
from dynarec.embedding.row_store import RowStore

__all__ = ["INDEX_FIELDS", "dump", "index_for_load", "restored_counter"]

Dump = dict[str, torch.Tensor]

INDEX_FIELDS = ("keys", "scores", "slots", "layout", "admission_keys", "admission_counts", "admission_slots")
"""A dump's fields besides its rows (``weight``, the optimizer's states) and ``step``."""


def dump(index: BucketedHashIndex, store: RowStore, step: int, counter: Optional[BucketedHashIndex]) -> Dump:
    """The dump of a table of ``index`` and ``store`` at step counter ``step``, with its admission
    ``counter`` if any."""
    slots, keys, scores = index.entries()
    out: Dump = {"keys": keys, "scores": scores, "slots": slots}
    out.update(store.read(slots))
    out["step"] = torch.tensor(step, dtype=torch.int64)
    out["layout"] = torch.tensor([index.num_buckets, index.bucket_size, LAYOUT_VERSION], dtype=torch.int64)
    if counter is not None:
        cslots, ckeys, ccounts = counter.entries()
        out["admission_keys"], out["admission_counts"], out["admission_slots"] = ckeys, ccounts, cslots
    return {k: v.cpu() for k, v in out.items()}


def check_dump(saved: Mapping[str, torch.Tensor], table: str) -> int:
    """The number of keys of a dynamic table's dump; ValueError naming ``table`` and the field
    where it is not one: ``keys`` ``[n]`` int64 without a key twice, ``scores`` and ``slots`` a
    value a key (``slots`` without a slot twice). Checked before anything is written: a key
    twice would be held twice, a slot twice would drop a key."""
    lacking = [f for f in ("keys", "scores") if f not in saved]
    if lacking:
        raise ValueError(f"table '{table}': dump lacks {lacking}")
    keys = saved["keys"]
    if keys.dim() != 1 or keys.dtype != torch.int64:
        raise ValueError(f"table '{table}': dump's keys are {keys.dtype} {tuple(keys.shape)}, not int64 [n]")
    n = keys.numel()
    for name in ("scores", "slots"):
        if name in saved and tuple(saved[name].shape) != (n,):
            raise ValueError(f"table '{table}': dump holds {name} {tuple(saved[name].shape)} for its {n} keys")
    for name in ("keys", "slots"):
        if name in saved and n:
            values, counts = torch.unique(saved[name], return_counts=True)
            if bool((counts > 1).any()):
                twice = int(values[counts > 1][0])
                raise ValueError(f"table '{table}': dump holds {name[:-1]} {twice} more than once")
    return n


def index_for_load(
    saved: Dump, space: Capacity, past_max: bool = False
) -> tuple[BucketedHashIndex, torch.Tensor, torch.Tensor]:
    """The index a table of ``space`` loads ``saved`` into, and ``(slots, src)``: dump row
    ``src[i]`` goes to slot ``slots[i]`` (the keys left out have none). ``past_max``: the index
    may have more buckets than ``space.max_buckets``, as many as place every key (none is left
    out)."""
    device = space.device
    keys = saved["keys"].to(device)
    scores = saved["scores"].to(device)
    n = keys.numel()
    num_buckets = _own_layout(saved, space)
    if num_buckets is not None:
        index = BucketedHashIndex(num_buckets, space.bucket_size, device)
        slots = saved["slots"].to(device)
        index.install(slots, keys, scores)
        return index, slots, torch.arange(n, device=device)
    limit = math.inf if past_max else space.max_buckets
    num_buckets = space.buckets_for(n, limit)
    while True:
        keep = torch.arange(n, device=device)
        capacity = num_buckets * space.bucket_size
        if n > capacity:  # globally highest scores first, ties to the smaller key (keys ascend)
            keep = torch.argsort(-scores, stable=True)[:capacity]
        index = space.new_index(num_buckets)
        slots = index.fill(keys[keep], scores[keep], priority=scores[keep])
        # A bucket pair can overflow below full capacity; then more buckets, while allowed.
        ok = slots >= 0
        if bool(ok.all()) or num_buckets >= limit:
            return index, slots[ok], keep[ok]
        num_buckets = int(min(limit, num_buckets * 2))


def _own_layout(saved: Dump, space: Capacity) -> Optional[int]:
    """The dump's bucket count where a table of ``space`` takes its own layout (every key back in
    its slot: same layout version and bucket size, a bucket count the table may have), else None."""
    layout = saved.get("layout")
    if layout is None or "slots" not in saved or layout.numel() != 3:
        return None
    num_buckets, bucket_size, version = (int(x) for x in layout)
    fits = space.init_buckets <= num_buckets <= space.max_buckets  # (a table never has fewer slots)
    return num_buckets if version == LAYOUT_VERSION and bucket_size == space.bucket_size and fits else None


def keys_left_out(saved: Dump, space: Capacity) -> int:
    """How many of ``saved``'s keys a load into a table of ``space`` (held to its
    ``max_buckets``) would leave out for want of room: :func:`index_for_load`'s answer, without
    building the index where the dump's own layout places every key."""
    if _own_layout(saved, space) is not None or saved["keys"].numel() == 0:
        return 0
    return saved["keys"].numel() - index_for_load(saved, space)[1].numel()


def restored_counter(fresh: BucketedHashIndex, saved: Optional[Dump]) -> tuple[BucketedHashIndex, int]:
    """``(counter, dropped)``: the admission counter ``fresh`` (empty) holding ``saved``'s counts,
    in their own slots where the dump's counter layout fits, else placed anew (a counter of
    another layout, nearly full, may find no room for some: ``dropped`` of them, the lowest
    counts first); empty without ``saved`` (a weights-only load) or counts in it."""
    if saved is None or "admission_keys" not in saved:
        return fresh, 0
    device = fresh.device
    ckeys = saved["admission_keys"].to(device)
    ccounts = saved["admission_counts"].to(device)
    cslots = saved.get("admission_slots")
    same_layout = "layout" in saved and saved["layout"].numel() == 3 and int(saved["layout"][2]) == LAYOUT_VERSION
    if cslots is not None and same_layout and (cslots.numel() == 0 or int(cslots.max()) < fresh.capacity):
        fresh.install(cslots.to(device), ckeys, ccounts)  # the counter's own layout
        return fresh, 0
    placed = fresh.fill(ckeys, ccounts, priority=ccounts)
    return fresh, int((placed < 0).sum())
