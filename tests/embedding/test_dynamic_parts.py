"""The parts a DynamicTable is composed of, each on its own: its slots (Capacity: growth and its
undo), admission (the counter and its threshold), the score policy (who writes which score),
the snapshot (dump and load of a layout) and the absent keys of a find (one table's, or a
group's tables' at once)."""

import pytest
import torch

from dynarec.embedding.admission import Admission
from dynarec.embedding.capacity import Capacity
from dynarec.embedding.config import AdmissionConfig
from dynarec.embedding.dynamic import AbsentKeys
from dynarec.embedding.hash_index import BucketedHashIndex
from dynarec.embedding.initializers import Initializer
from dynarec.embedding.row_store import NativeRowStore
from dynarec.embedding.scores import ScorePolicy
from dynarec.embedding.snapshot import dump, index_for_load, restored_counter
from dynarec.embedding.step import StepLifecycle
from dynarec.optim import Adagrad
from tests.matrix import DEVICES

CPU = torch.device("cpu")


def space_with_keys(n=10, init_buckets=2, max_buckets=16):
    store = NativeRowStore(init_buckets * 4, 3, Adagrad(initial_accumulator_value=0.5))
    space = Capacity(store, 4, init_buckets, max_buckets, 0.75, CPU)
    keys = torch.arange(1, n + 1) * 7919
    while space.crowded(n) and space.can_grow(1):
        space.grow(None)
    plan = space.index.plan_insert(keys, allow_evict=False)
    space.index.commit(plan, torch.arange(n))
    store.write(plan.slots, {"weight": keys.float()[:, None].expand(-1, 3)})
    return space, keys


def test_a_growth_moves_every_row_and_its_undo_puts_back_index_rows_and_counters():
    space, keys = space_with_keys()
    before_index, before_rows = space.index, space.store.read(space.index.find(keys))
    steps = StepLifecycle("t")
    step = steps.begin()
    space.count(step.journal, dropped=2)
    space.grow(step.journal)
    assert space.index is not before_index and space.slots == 2 * before_index.capacity
    for k, v in space.store.read(space.index.find(keys)).items():
        assert torch.equal(v, before_rows[k]), k
    steps.abort()
    assert space.index is before_index and space.counters["dropped"] == 0
    assert space.store.num_rows == before_index.capacity
    assert space.buckets_for(0) == 2 and space.buckets_for(7) == 4 and space.buckets_for(10**6) == 16


def test_admission_counts_occurrences_over_steps_and_admits_at_the_threshold():
    admission = Admission(AdmissionConfig(threshold=3), 64, 64, 4, CPU, Initializer("constant", value=0.5))
    assert admission.initializer == Initializer("constant", value=0.5)
    steps = StepLifecycle("t")
    keys = torch.tensor([5, 6, 7])
    step = steps.begin()
    assert admission.count(keys, torch.tensor([1, 2, 3]), step, torch.tensor([step.id])).tolist() == [
        False,
        False,
        True,
    ]
    steps.commit(step)
    step = steps.begin()
    assert admission.count(keys[:2], torch.tensor([1, 1]), step, torch.tensor([step.id])).tolist() == [False, True]
    steps.abort()  # the counts of an aborted step are taken back
    step = steps.begin()
    assert admission.count(keys[:2], torch.tensor([2, 0]), step, torch.tensor([step.id])).tolist() == [True, False]


def test_the_score_policy_writes_through_the_index_at_commit_or_through_the_fused_writer():
    index = BucketedHashIndex(2, 4)
    keys = torch.tensor([3, 4, 5])
    index.commit(index.plan_insert(keys), torch.zeros(3, dtype=torch.int64))
    slots = index.find(keys)
    steps = StepLifecycle("t")
    policy = ScorePolicy("step", lambda: index)
    step = steps.begin()
    assert policy.schedule(slots[:2], step, fused=False) is None
    steps.commit(step)  # no fused writer: the commit writes the step's scores
    assert index.scores[slots].tolist() == [1, 1, 0]
    step = steps.begin()
    writer = policy.schedule(slots[2:], step, fused=True)
    assert writer is not None and writer.scores is index.scores and writer.value == 2
    step.backward_ran = True
    steps.commit(step)  # committed by its own backward: the update writes, not the commit
    assert index.scores[slots].tolist() == [1, 1, 0] and writer.live
    lfu = ScorePolicy("lfu", lambda: index)
    step = steps.begin()
    assert lfu.schedule(slots[[0, 0, 1]], step, fused=True) is None
    steps.commit(step)
    assert index.scores[slots].tolist() == [3, 2, 0]
    assert not ScorePolicy("none", lambda: index).evicts and lfu.evicts


def test_a_dump_loads_into_its_own_layout_or_anew_into_a_smaller_one():
    space, keys = space_with_keys()
    counter = BucketedHashIndex(2, 4)
    counter.commit(counter.plan_insert(torch.tensor([99])), torch.tensor([2]))
    saved = dump(space.index, space.store, 7, counter)
    assert saved["keys"].tolist() == keys.tolist() and int(saved["step"]) == 7
    same = Capacity(NativeRowStore(8, 3, Adagrad()), 4, 2, 16, 0.75, CPU)
    index, slots, src = index_for_load(saved, same)
    assert torch.equal(slots, saved["slots"]) and torch.equal(src, torch.arange(keys.numel()))
    small = Capacity(NativeRowStore(8, 3, Adagrad()), 4, 2, 2, 0.75, CPU)  # 8 slots: the top scores stay
    index, slots, src = index_for_load(saved, small)
    assert index.capacity == 8 and sorted(saved["scores"][src].tolist()) == list(range(2, 10))
    fresh, dropped = restored_counter(BucketedHashIndex(2, 4), saved)
    assert fresh.find(torch.tensor([99])).tolist() == counter.find(torch.tensor([99])).tolist()
    assert dropped == 0 and restored_counter(BucketedHashIndex(2, 4), None)[0].size == 0


@pytest.mark.parametrize("device", DEVICES)
def test_the_absent_keys_of_several_tables_found_at_once_are_each_tables_own(device):
    """AbsentKeys.of_parts (a group's one pass over its tables' keys, a table a partition) gives
    each table, in its share, exactly what AbsentKeys.of (torch.unique of its absent keys) gives
    it alone: positions, unique keys, inverse, counts and dtypes, shifted by the table's place;
    tables without keys or without absent keys too, equal keys in two tables apart."""
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        keys, slots = [], []
        for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
            n = int(torch.randint(0, 30, (1,), generator=g))
            scale = 10**15 if trial % 2 else 1  # keys far apart, negative ones too
            keys.append((torch.randint(-5, 5, (n,), generator=g) * scale).to(device))
            slots.append(torch.where(torch.rand(n, generator=g) < 0.5, -1, 3).to(device))
        table = torch.repeat_interleave(torch.arange(len(keys)), torch.tensor([k.numel() for k in keys])).to(device)
        joint, key_tables, distinct = AbsentKeys.of_parts(torch.cat(keys), torch.cat(slots), table, len(keys))
        ids_at = absent_at = unique_at = 0  # the table's first id, absent id and unique key in the joint
        for i, (k, s) in enumerate(zip(keys, slots)):
            want = AbsentKeys.of(k, s)
            m, u = want.positions.numel(), want.unique.numel()
            assert distinct[i] == u
            shares = {
                "positions": joint.positions[absent_at : absent_at + m] - ids_at,
                "unique": joint.unique[unique_at : unique_at + u],
                "inverse": joint.inverse[absent_at : absent_at + m] - unique_at,
                "counts": joint.counts[unique_at : unique_at + u],
            }
            for field, a in shares.items():
                b = getattr(want, field)
                assert a.dtype == b.dtype and torch.equal(a, b), (trial, field)
            assert key_tables[unique_at : unique_at + u].tolist() == [i] * u
            ids_at, absent_at, unique_at = ids_at + k.numel(), absent_at + m, unique_at + u
        assert joint.positions.numel() == absent_at and joint.unique.numel() == unique_at
