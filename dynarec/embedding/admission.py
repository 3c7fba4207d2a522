"""Frequency admission of a dynamic table: a new key gets a row only in the training step in
which its occurrences, counted over steps, reach ``threshold``.

Counts live in a bounded counter: a :class:`~dynarec.embedding.hash_index.BucketedHashIndex`
whose scores are the counts, evicting the lowest count when full. Every occurrence in a training
batch counts; a key admitted in a step leaves the counter (it gets a row and is updated in that
step). Until then it reads the admission initializer and gets no update. The counts of a step are
journaled with it, and saved in dumps (:mod:`.snapshot`).
"""

from __future__ import annotations

import torch

from dynarec.embedding.capacity import num_buckets
from dynarec.embedding.config import AdmissionConfig
from dynarec.embedding.hash_index import BucketedHashIndex
from dynarec.embedding.initializers import Initializer
from dynarec.embedding.step import Step

__all__ = ["Admission"]


class Admission:
    """The admission counter of a table of ``max_capacity`` rows, or of a key-hash shard of it
    holding ``shard_max_capacity`` (the counter holds the shard's share of ``config.capacity``).
    ``default_initializer``: what a key not admitted reads when ``config`` names none."""

    def __init__(
        self,
        config: AdmissionConfig,
        max_capacity: int,
        shard_max_capacity: int,
        bucket_size: int,
        device: torch.device,
        default_initializer: Initializer,
    ):
        self.threshold = config.threshold
        self.initializer = config.initializer or default_initializer
        capacity = -(-(config.capacity or max_capacity) * shard_max_capacity // max_capacity)
        self.counter = BucketedHashIndex(num_buckets(capacity, bucket_size), bucket_size, device)

    @property
    def nbytes(self) -> int:
        return self.counter.nbytes

    def fresh_counter(self) -> BucketedHashIndex:
        """An empty counter of this one's size."""
        counter = self.counter
        return BucketedHashIndex(counter.num_buckets, counter.bucket_size, counter.device)

    def count(self, keys: torch.Tensor, counts: torch.Tensor, step: Step, pinned_by: torch.Tensor) -> torch.Tensor:
        """Adds a batch's occurrences (``keys`` unique and ascending, ``counts`` of each) in
        ``step`` (its journal records them); returns the mask of the keys that reach the
        threshold, which leave the counter. Counts of the steps ``pinned_by`` are not evicted by
        this batch's new keys."""
        counter, journal = self.counter, step.journal
        slots = counter.find(keys)
        seen = slots >= 0
        counter.add(slots[seen], counts[seen], journal)
        counter.pin(slots[seen], step.id)  # this batch's counts are not evicted by its new keys
        plan = counter.plan_insert(keys[~seen], pinned_by=pinned_by, allow_evict=True, keys_ascending=True)
        counter.commit(plan, counts[~seen], journal)
        slots[~seen] = plan.slots
        totals = torch.where(slots >= 0, counter.scores[slots.clamp(min=0)], torch.zeros_like(counts))
        admitted = totals >= self.threshold
        counter.remove(slots[admitted], journal)
        return admitted
