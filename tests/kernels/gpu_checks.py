"""The kernels against their plain-torch twins (``dynarec.kernels.reference``), on any device the
Triton kernels run on (CUDA, or the CPU under Triton's interpreter: ``TRITON_INTERPRET=1``); the
checks that go through the ``torch.ops.dynarec`` ops (the index's find and plans, the update of
every registered optimizer) hold the C++ extension to the same reference on a CPU. Used by
tests/kernels/test_gpu_kernels.py (both lanes), tests/kernels/test_cpu_kernels.py and
tests/embedding/test_hash_index.py."""

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator

import torch

from dynarec.embedding.hash_index import BucketedHashIndex
from dynarec.embedding.insert_plan import InsertPlan, plan_insert_reference
from dynarec.embedding.key_hash import key_tags
from dynarec.embedding.step import Journal
from dynarec.kernels import gpu, reference
from dynarec.kernels.gpu import hashing as gpu_hashing
from dynarec.kernels.gpu import plan as gpu_plan
from dynarec.kernels.gpu import update as gpu_update
from dynarec.kernels.reference import hashing as reference_hashing
from dynarec.optim import SGD, Adagrad, Adam, RowWiseAdagrad, definition, registered
from dynarec.optim.fused import bag_gradients, fused_row_update
from dynarec.optim.kernel import KernelCode
from dynarec.optim.reference import reference_update
from dynarec.optim.rounding import rounding_base

SPECS = [
    SGD(lr=0.3),
    Adagrad(lr=0.2, initial_accumulator_value=0.1),
    RowWiseAdagrad(lr=0.2, initial_accumulator_value=0.1),
    RowWiseAdagrad(lr=0.2, weight_decay=0.1, weight_decay_mode="l2"),
    RowWiseAdagrad(lr=0.2, weight_decay=0.1, weight_decay_mode="decoupled"),
    Adam(lr=0.05),
    Adam(lr=0.05, weight_decay=0.01, beta1=0.8, beta2=0.99),
]


def find_reference(index: BucketedHashIndex, query: torch.Tensor) -> torch.Tensor:
    """The plain-torch find of ``query`` in ``index``."""
    return reference.find(index.keys, index.tags, index.num_buckets, index.bucket_size, query, False)[0]


@contextlib.contextmanager
def tuned(module, attribute: str = "TUNING", **fields) -> Iterator[None]:
    """Runs the block with ``module.TUNING`` (or another settings ``attribute``) changed in
    ``fields`` (None: as it is)."""
    saved = getattr(module, attribute)
    setattr(module, attribute, dataclasses.replace(saved, **{k: v for k, v in fields.items() if v is not None}))
    try:
        yield
    finally:
        setattr(module, attribute, saved)


def check_find(device, num_buckets=64, bucket_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    index = BucketedHashIndex(num_buckets, bucket_size, device)
    keys = torch.unique(torch.randint(-(2**63), 2**63 - 1, (int(0.8 * index.capacity),), generator=g)).to(device)
    plan = index.plan_insert(keys, allow_evict=False)
    index.commit(plan, torch.zeros_like(keys))
    placed = keys[plan.slots >= 0]  # one bulk plan at load 0.8 may leave a few keys out
    assert placed.numel() >= 0.99 * keys.numel()
    query = torch.cat(
        [
            keys,
            torch.randint(-(2**63), 2**63 - 1, (500,), generator=g).to(device),
            torch.tensor([-(2**63), 0, 2**63 - 1], device=device),
        ]
    )
    got = gpu_hashing.find_two_choice(index.keys, index.tags, index.num_buckets, index.bucket_size, query)
    assert torch.equal(got, find_reference(index, query))
    assert int((got >= 0).sum()) == placed.numel()
    assert torch.equal(got[: keys.numel()][plan.slots >= 0], plan.slots[plan.slots >= 0])
    # Keys sharing a tag in one bucket: the key at the first matching lane is not always the one
    # looked for (the kernel then compares every matching lane)
    one = BucketedHashIndex(1, 16, device)
    pool = torch.randint(-(2**63), 2**63 - 1, (400,), generator=g).unique().to(device)
    tags = key_tags(pool).long()
    shared = torch.nonzero(torch.bincount(tags, minlength=256) >= 2).flatten()[:4]  # tags of 2+ keys
    twins = torch.cat([pool[tags == t][:2] for t in shared.tolist()])  # 4 pairs, one tag each
    assert twins.numel() == 8
    one.commit(one.plan_insert(twins, allow_evict=False), torch.zeros_like(twins))
    for q in (twins, pool[:50]):
        assert torch.equal(gpu_hashing.find_two_choice(one.keys, one.tags, 1, 16, q), find_reference(one, q))
    assert bool((find_reference(one, twins) >= 0).all())
    for q in (query, placed, query[-1:]):  # some absent, none absent, one absent key
        absent = torch.zeros((), dtype=torch.int32, device=device)
        flagged = gpu_hashing.find_two_choice(index.keys, index.tags, index.num_buckets, index.bucket_size, q, absent)
        assert torch.equal(flagged, find_reference(index, q))
        assert bool(absent) == bool((flagged < 0).any())


def check_candidate_buckets(device, num_buckets):
    keys = torch.cat(
        [
            torch.randint(-(2**63), 2**63 - 1, (3000,), generator=torch.Generator().manual_seed(num_buckets)),
            torch.tensor([-(2**63), -1, 0, 1, 2**63 - 1]),
        ]
    ).to(device)
    got, want = gpu_hashing.candidate_buckets(keys, num_buckets), reference.candidate_buckets(keys, num_buckets)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def check_uniform_rows(device, dim, dtype):
    """The uniform initializer's rows written in place by one kernel: each row the float32 of
    ``(2u - 1) * bound`` from the plain-torch float64 draws, in the table's dtype rounded to
    nearest; other rows and columns untouched (rows of a wider tensor's column slice too); salts
    and bounds whose 32-bit halves are 0 or 1 (Triton would make such an argument a constant)."""
    gen = torch.Generator().manual_seed(dim)
    keys = torch.cat([torch.randint(-(2**63), 2**63 - 1, (300,), generator=gen), torch.tensor([-(2**63), 0, -1])])
    rows = torch.randperm(500, generator=gen)[: keys.numel()]
    for seed, bound, pad in [(0, 0.0123, 0), (-7, 1.0, 3), (12345, 2.0**-20, 0)]:
        for salt in (reference.uniform_salt(seed, 0), 1, 1 << 32):
            u = reference_hashing.uniform01_of_salt(keys, dim, salt)
            want = torch.randn(500, dim + 2 * pad, generator=gen).to(dtype)
            got = want.clone().to(device)
            want[rows, pad : pad + dim] = ((2.0 * u - 1.0) * bound).float().to(dtype)
            gpu_hashing.uniform_rows(got[:, pad : pad + dim], rows.to(device), keys.to(device), salt, bound)
            assert torch.equal(got.cpu(), want), (seed, bound, pad, salt)


def check_uniform01(device, dim):
    """The initializers' key-seeded draws: the kernel's bits are the plain-torch ones, at every
    column of every key (the int64 extremes included), for both streams and a negative seed."""
    keys = torch.cat(
        [
            torch.randint(-(2**63), 2**63 - 1, (1000,), generator=torch.Generator().manual_seed(dim)),
            torch.tensor([-(2**63), -1, 0, 1, 2**63 - 1]),
        ]
    ).to(device)
    for seed, stream in [(0, 0), (12345, 1), (-7, 0)]:
        got = torch.ops.dynarec.uniform01(keys, dim, seed, stream)
        assert got.dtype == torch.float64 and got.shape == (keys.numel(), dim)
        assert torch.equal(got, reference.uniform01(keys, dim, seed, stream)), (seed, stream)
    assert torch.ops.dynarec.uniform01(keys[:0], dim, 1, 0).shape == (0, dim)
    # salts whose 32-bit halves are 1 or 0 (Triton makes an argument of 1 a constant) or all ones
    for salt in (1, 1 << 32, (1 << 32) | 1, (1 << 64) - 1, 1 << 63):
        got = gpu_hashing.uniform01(keys, dim, salt)
        assert torch.equal(got, reference.hashing.uniform01_of_salt(keys, dim, salt)), salt


def check_claim_free_slots(device, num_buckets=64, bucket_size=16, load=0.6, seed=0, batches=3):
    """Step 1 of an insert plan: the kernels' rounds give every key the slot the plain-torch
    rounds give it, and leave the same keys (in rank order), at loads up to full buckets."""
    gen = torch.Generator().manual_seed(seed)
    index = BucketedHashIndex(num_buckets, bucket_size, device)
    resident = torch.unique(torch.randint(-(2**62), 2**62, (int(load * index.capacity),), generator=gen))
    resident = resident.to(device)
    index.commit(plan_insert_reference(index, resident, allow_evict=False), torch.zeros_like(resident))
    for i in range(batches):  # more new keys than free slots: rounds, full buckets, keys left over
        keys = torch.randint(-(2**62), 2**62, (index.capacity // 2 + i * 7,), generator=gen).to(device)
        keys = keys[~torch.isin(keys, resident)].unique()
        order = torch.randperm(keys.numel(), generator=gen).to(device)
        b1, b2 = reference.candidate_buckets(keys, num_buckets)
        want = torch.full_like(keys, -1)
        want_left = reference.claim_free_slots(index.tags, bucket_size, b1, b2, order, want)
        got = torch.full_like(keys, -1)
        state = gpu_plan.PlanState.fresh(index.keys, index.tags, index.scores, index.pins, num_buckets, bucket_size)
        got_left = gpu_plan.claim_free_slots(state, keys, order, got)
        assert torch.equal(got, want) and torch.equal(got_left, want_left)
        assert (want >= 0).any() and (load < 0.9 or want_left.numel() > 0)


PLAN_FIELDS = ("slots", "evicted_slots", "moved_from", "moved_to")


def check_plan(device, num_buckets, bucket_size, load, batches=4):
    """``plan_insert`` (on ``device``: the Triton planner, or on a CPU the C++ one) gives the
    plain-torch planner's plan: every slot, move and eviction, with pins that block moves and
    evictions, a movable pin, priorities, with and without eviction, and keys given as a strided
    view."""
    gen = torch.Generator().manual_seed(num_buckets * 100 + bucket_size)
    index = BucketedHashIndex(num_buckets, bucket_size, device)
    resident = torch.unique(torch.randint(-(2**62), 2**62, (int(load * index.capacity),), generator=gen)).to(device)
    index.commit(
        plan_insert_reference(index, resident, allow_evict=False),
        torch.randint(0, 5, (resident.numel(),), generator=gen).to(device),  # tied scores too
    )
    slots = index.entries()[0]
    for step in (7, 9):
        index.pin(slots[torch.randperm(slots.numel(), generator=gen)[: slots.numel() // 4].to(device)], step)
    moves = evictions = 0
    for seed in range(batches):
        keys = torch.randint(-(2**62), 2**62, (index.capacity // 2 + 3 * seed,), generator=gen).unique().to(device)
        keys = keys[index.find(keys) < 0]
        priority = torch.randint(0, 3, (keys.numel(),), generator=gen).to(device)
        pins = torch.tensor([7, 9], device=device)
        for kw in (
            dict(allow_evict=True),
            dict(allow_evict=False),
            dict(allow_evict=True, pinned_by=pins, movable_pins=pins[1:]),
            dict(allow_evict=True, pinned_by=pins[1:], priority=priority),
        ):
            got, want = index.plan_insert(keys, **kw), plan_insert_reference(index, keys, **kw)  # type: ignore[arg-type]
            for name in PLAN_FIELDS:
                assert torch.equal(getattr(got, name), getattr(want, name)), (kw, name)
            assert got.num_placed == want.num_placed == int((got.slots >= 0).sum())
            moves += got.moved_from.numel()
            evictions += got.evicted_slots.numel()
        strided = torch.stack([keys, keys], 1)[:, 0]  # a view: the kernels must not read it as contiguous
        got, want = index.plan_insert(strided), plan_insert_reference(index, keys)
        for name in PLAN_FIELDS:
            assert torch.equal(getattr(got, name), getattr(want, name)), ("strided", name)
    assert evictions > 0 and (moves > 0 or load >= 0.75)  # below that, keys make room by moving


def check_plan_of_a_full_index(device, num_buckets=8, bucket_size=16):
    """An index with no empty slot (every insert of a table at capacity): told so
    (``free_slots=0``), the planner skips steps 1 and 2 and gives the plan it gives untold (-1),
    which is the plain-torch plan; with pins blocking evictions and keys left without a slot."""
    gen = torch.Generator().manual_seed(num_buckets)
    index = BucketedHashIndex(num_buckets, bucket_size, device)
    while index.size < index.capacity:
        keys = torch.unique(torch.randint(-(2**62), 2**62, (index.capacity,), generator=gen)).to(device)
        keys = keys[index.find(keys) < 0]
        index.commit(
            index.plan_insert(keys, allow_evict=False), torch.randint(0, 4, keys.shape, generator=gen).to(device)
        )
    assert int((index.tags != 0).sum()) == index.capacity
    slots = index.entries()[0]
    index.pin(slots[torch.randperm(slots.numel(), generator=gen)[: slots.numel() * 3 // 4].to(device)], 5)
    new = torch.unique(torch.randint(-(2**62), 2**62, (index.capacity,), generator=gen)).to(device)
    args = (index.tags, index.keys, index.scores, index.pins, num_buckets, bucket_size, new,
            torch.arange(new.numel(), device=device), None, torch.tensor([5], device=device), True)  # fmt: skip
    told, untold = torch.ops.dynarec.plan_insert(*args, 0), torch.ops.dynarec.plan_insert(*args, -1)
    want = reference.plan_insert(*args, -1)
    for a, b, c in zip(told, untold, want):
        assert torch.equal(a, b) and torch.equal(a, c)
    _, left, moved_from, _, evicted = told
    assert moved_from.numel() == 0 and 0 < evicted.numel() < new.numel() and left.numel() == new.numel()


def check_plan_of_a_few_keys(device, num_buckets=512):
    """A plan of 1-3 keys at load 0.97, each with many residents to try moving (the C++ planner's
    bucket table grows as moves bring buckets in), with pins of a step id past PIN_WRAP (pins
    hold step ids modulo PIN_WRAP)."""
    from dynarec.embedding.insert_plan import PIN_WRAP

    gen = torch.Generator().manual_seed(5)
    index = BucketedHashIndex(num_buckets, 16, device)
    resident = torch.unique(torch.randint(-(2**62), 2**62, (int(0.97 * index.capacity),), generator=gen)).to(device)
    index.commit(plan_insert_reference(index, resident, allow_evict=False), torch.zeros_like(resident))
    slots = index.entries()[0]
    step = PIN_WRAP + 12
    index.pin(slots[torch.randperm(slots.numel(), generator=gen)[: slots.numel() // 2].to(device)], step)
    pins = torch.tensor([step], device=device)
    placed = 0
    for n in (1, 2, 3, 3, 3):
        keys = torch.randint(-(2**62), 2**62, (n,), generator=gen).unique().to(device)
        for kw in (dict(), dict(pinned_by=pins), dict(pinned_by=pins, movable_pins=pins)):
            got, want = index.plan_insert(keys, **kw), plan_insert_reference(index, keys, **kw)  # type: ignore[arg-type]
            for name in PLAN_FIELDS:
                assert torch.equal(getattr(got, name), getattr(want, name)), (kw, name)
            placed += got.num_placed
    assert placed > 0


def check_partitioned(device, sizes=(3, 1, 8, 2), bucket_size=8, load=0.85, seed=0):
    """A partitioned index (several indexes' arrays end to end, each a partition) gives, in one
    ``find`` and one ``plan_insert`` (the op on ``device``, and the plain-torch twin), each
    partition's own find and plan as an index alone: every slot, absent flag, move, eviction and
    key left, with pins that block moves and evictions and a movable pin."""
    gen = torch.Generator().manual_seed(seed)
    indexes = [BucketedHashIndex(nb, bucket_size, device) for nb in sizes]
    for index in indexes:
        resident = torch.unique(torch.randint(-(2**62), 2**62, (int(load * index.capacity),), generator=gen))
        resident = resident.to(device)
        index.commit(
            plan_insert_reference(index, resident, allow_evict=False),
            torch.randint(0, 5, (resident.numel(),), generator=gen).to(device),
        )
        slots = index.entries()[0]
        index.pin(slots[torch.randperm(slots.numel(), generator=gen)[: slots.numel() // 3].to(device)], 7)
    starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], device=device)
    total = int(starts[-1])
    offsets = [int(s) * bucket_size for s in starts[:-1]]
    arrays = [torch.cat([getattr(ix, name) for ix in indexes]) for name in ("keys", "tags", "scores", "pins")]
    keys_all, tags_all, scores_all, pins_all = arrays

    def joined(parts, offsets_of):
        """Each partition's tensor of slots (-1: none) shifted by its offset, end to end."""
        return torch.cat([torch.where(p >= 0, p + o, p) for p, o in zip(parts, offsets_of)])

    # one find of every partition's keys, present and absent ones (partition 1 all present)
    queries = []
    for i, index in enumerate(indexes):
        present = index.entries()[1]
        absent = torch.randint(-(2**62), 2**62, (0 if i == 1 else 5,), generator=gen).to(device)
        queries.append(torch.cat([present[: 2 * index.capacity // 3], absent, present[:2]]))
    query = torch.cat(queries)
    query_parts = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor([q.numel() for q in queries]))
    query_parts = query_parts.to(device)
    want = joined([ix.find(q) for ix, q in zip(indexes, queries)], offsets)
    want_absent = torch.tensor([int((ix.find(q) < 0).any()) for ix, q in zip(indexes, queries)], dtype=torch.int32)
    for find in (torch.ops.dynarec.find, reference.find):
        slots, absent = find(keys_all, tags_all, total, bucket_size, query, True, starts, query_parts)
        assert torch.equal(slots, want)
        assert torch.equal(absent.cpu(), want_absent)
    assert want_absent.tolist() == [1, 0, 1, 1]

    # one plan of every partition's new keys, ranked by (partition, key): few (moves) and many
    # (evictions)
    pins = torch.tensor([7], device=device)
    moves = evictions = 0
    settings = ((None, None, True), (pins, pins, True), (None, pins, False))  # move pins, evict pins, evict
    for share, (move_pins, evict_pins, allow_evict) in itertools.product((8, 2), settings):
        news = [torch.randint(-(2**62), 2**62, (ix.capacity // share + 1,), generator=gen).unique() for ix in indexes]
        news = [n.to(device)[ix.find(n.to(device)) < 0] for ix, n in zip(indexes, news)]
        new = torch.cat(news)
        counts = torch.tensor([n.numel() for n in news])
        key_parts = torch.repeat_interleave(torch.arange(len(sizes)), counts).to(device)
        key_offsets = [0, *counts.cumsum(0).tolist()[:-1]]
        order = torch.arange(new.numel(), device=device)
        args = (tags_all, keys_all, scores_all, pins_all, total, bucket_size, new, order, move_pins, evict_pins,
                allow_evict, -1, starts, key_parts)  # fmt: skip
        apart = [
            torch.ops.dynarec.plan_insert(ix.tags, ix.keys, ix.scores, ix.pins, ix.num_buckets, bucket_size, n,
                                          torch.arange(n.numel(), device=device), move_pins, evict_pins, allow_evict)
            for ix, n in zip(indexes, news)
        ]  # fmt: skip
        for plan in (torch.ops.dynarec.plan_insert(*args), reference.plan_insert(*args)):
            slots, left, moved_from, moved_to, evicted = plan
            assert torch.equal(slots, joined([a[0] for a in apart], offsets))
            for i, (a, o, ko) in enumerate(zip(apart, offsets, key_offsets)):
                mine = (moved_from >= o) & (moved_from < o + indexes[i].capacity)
                assert torch.equal(moved_from[mine], a[2] + o) and torch.equal(moved_to[mine], a[3] + o)
                assert torch.equal(evicted[(evicted >= o) & (evicted < o + indexes[i].capacity)], a[4] + o)
                assert torch.equal(left[key_parts[left] == i], a[1] + ko)
            moves += moved_from.numel()
            evictions += evicted.numel()
    assert moves > 0 and evictions > 0, (moves, evictions)


def check_place_keys(device, seed=0):
    """The one-kernel commit of new keys into free slots writes what the plain-torch commit
    writes (a -1 slot: nothing); through ``commit`` with a journal (the kernel where it runs),
    the undo restores the index exactly, also into slots freed by ``remove``."""
    gen = torch.Generator().manual_seed(seed)
    index = BucketedHashIndex(64, 16, device)
    resident = torch.unique(torch.randint(-(2**62), 2**62, (400,), generator=gen)).to(device)
    index.commit(index.plan_insert(resident, allow_evict=False), torch.randint_like(resident, 1, 99))
    index.remove(index.find(resident[::3]))  # freed slots: as a fresh index's (key 0, score 0)
    resident = resident[index.find(resident) >= 0]
    new = torch.randint(-(2**62), 2**62, (150,), generator=gen).to(device)
    new = new[~torch.isin(new, resident)].unique()
    scores = torch.randint(0, 4, new.shape, generator=gen).to(device)  # zeros too: a free slot holds score 0
    plan = index.plan_insert(new, allow_evict=False)
    assert bool((plan.slots >= 0).all()) and not plan.moved_from.numel()  # free slots only: the kernel's case
    names = ("keys", "scores", "tags", "pins")
    before = {k: getattr(index, k).clone() for k in names}

    def expected(slots):
        ok = slots >= 0
        out = {k: v.clone() for k, v in before.items()}
        out["keys"][slots[ok]], out["scores"][slots[ok]], out["tags"][slots[ok]] = (
            new[ok],
            scores[ok],
            key_tags(new[ok]),
        )
        return out

    slots = plan.slots.clone()
    slots[::7] = -1  # keys left without a slot
    arrays = {k: v.clone() for k, v in before.items()}
    gpu_plan.place_keys(arrays["keys"], arrays["scores"], arrays["tags"], slots, new, scores)
    for k, want in expected(slots).items():
        assert torch.equal(arrays[k], want), k
    journal, size = Journal(), index.size
    index.commit(plan, scores, journal)
    assert index.size == size + new.numel()
    for k, want in expected(plan.slots).items():
        assert torch.equal(getattr(index, k), want), k
    journal.undo()
    assert index.size == size
    for k in names:
        assert torch.equal(getattr(index, k), before[k]), k
    # more keys than slots (an overflowing plan: most get -1)
    small = BucketedHashIndex(2, 4, device)
    small_slots = torch.full_like(new, -1)
    small_slots[:5] = torch.arange(5, device=device)
    gpu_plan.place_keys(small.keys, small.scores, small.tags, small_slots, new, scores)
    assert torch.equal(small.keys[:5], new[:5]) and torch.equal(small.scores[:5], scores[:5])
    assert not bool(small.tags[5:].any())
    # a plan that leaves keys without a slot (-1), through commit and undo
    empty = plan.evicted_slots
    journal = Journal()
    index.commit(InsertPlan(new, slots, empty, empty, empty), scores, journal)
    assert index.size == size + int((slots >= 0).sum())
    for k, want in expected(slots).items():
        assert torch.equal(getattr(index, k), want), k
    journal.undo()
    for k in names:
        assert torch.equal(getattr(index, k), before[k]), k


def random_bags(device, num_rows=50, bags=40, max_len=6, dim=8, weighted=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (bags,), generator=g)
    n = int(lengths.sum())
    rows = (torch.randint(0, 10, (n,), generator=g) ** 2 % num_rows).to(device)  # duplicates
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)]).to(device)
    psw = torch.rand(n, generator=g).to(device) + 0.5 if weighted else None
    return rows, offsets, psw


def check_pooled(device, dim=8, weighted=True, max_len=6, bags=40):
    rows, offsets, psw = random_bags(device, bags=bags, dim=dim, weighted=weighted, max_len=max_len)
    weight = torch.randn(50, dim, generator=torch.Generator().manual_seed(1)).to(device)
    got = gpu.pooled_forward(weight, rows, offsets, psw)
    ref = torch.nn.functional.embedding_bag(
        rows, weight, offsets, mode="sum", per_sample_weights=psw, include_last_offset=True
    )
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def check_update(
    device, spec, dim=8, weighted=True, steps=3, update=None, max_len=6, block=None, kernel=None, bags=40
):  # fmt: skip
    """``update`` (default the Triton kernels, with ``kernel`` (``run`` / ``scan``) and ``block``
    (occurrences a block) as their tuning, None: its default) against torch aggregation + the
    native update, over ``steps`` steps of ``bags`` bags. ``max_len`` 60 gives rows of ~100
    occurrences (with 40 bags). Every step also sets the rows' scores (1, then values past
    int32): exactly the updated rows get the step's value."""
    g = torch.Generator().manual_seed(2)
    w_ref = torch.randn(50, dim, generator=g).to(device)
    states_ref = {s.name: torch.full((50, s.width(dim)), s.initial_value, device=device) for s in spec.state_specs()}
    w, states = w_ref.clone(), {k: v.clone() for k, v in states_ref.items()}
    scores = torch.full((50,), -7, dtype=torch.int64, device=device)
    for step in range(1, steps + 1):
        rows, offsets, psw = random_bags(device, bags=bags, dim=dim, weighted=weighted, seed=step, max_len=max_len)
        grad_out = torch.randn(offsets.numel() - 1, dim, generator=g).to(device)
        value = 1 if step == 1 else (1 << 40) + step
        scores_before = scores.clone()
        with tuned(gpu_update, kernel=kernel, block=block):
            (update or gpu.bag_update)(
                definition(spec).kernel(spec, step),
                lr=spec.lr,
                weight=w,
                states=states,
                rows=rows,
                offsets=offsets,
                per_sample_weights=psw,
                grad_out=grad_out,
                scores=scores,
                score=value,
            )
        per_id = bag_gradients(grad_out, offsets, psw, rows.numel())
        unique, inverse = torch.unique(rows, return_inverse=True)
        assert torch.equal(scores, scores_before.index_fill(0, unique, value))
        agg = per_id.new_zeros(unique.numel(), dim).index_add_(0, inverse, per_id)
        fused_row_update(spec, lr=spec.lr, step=step, weight=w_ref, states=states_ref, rows=unique, grad=agg)
    # A hot row sums ~100 float32 terms of size ~1 in another order than index_add: its gradient
    # differs by ~1e-5 absolute, and lr times that shows in the weight. Even a row of a few
    # terms differs by a few float32 ulps of its operands (~1): a weight near 0 that is the
    # difference of two such numbers (w - lr * g) shows them as ~1e-6 absolute (an H200 run:
    # 1.17e-6 at SGD lr 0.3).
    tol = dict(rtol=1e-5, atol=4e-6 if max_len <= 6 else 2e-5)
    torch.testing.assert_close(w, w_ref, **tol)
    for k in states:
        torch.testing.assert_close(states[k], states_ref[k], **tol)


def kernel_specs():
    """A spec of every registered optimizer with kernels (``OptimizerDef.kernel``): its defaults,
    lr 0.1."""
    return [d.spec(lr=0.1) for d in registered() if d.kernel is not None]  # type: ignore[call-arg]


def check_registered_kernel(device, spec, update, dim=6, steps=2, num_rows=30):
    """``update`` (a fused update kernel, ``(KernelArgs, *, lr, weight, states, rows, offsets,
    per_sample_weights, grad_out)``) runs ``spec``'s kernel code as the optimizer's per-row
    ``reference_update`` does, over ``steps`` steps of weighted bags with repeated rows."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(num_rows, dim, generator=g)
    states = {s.name: torch.full((num_rows, s.width(dim)), s.initial_value) for s in spec.state_specs()}
    w_ref, states_ref = weight.clone(), {k: v.clone() for k, v in states.items()}
    weight, states = weight.to(device), {k: v.to(device) for k, v in states.items()}
    for step in range(1, steps + 1):
        rows, offsets, psw = random_bags("cpu", num_rows=num_rows, bags=10, dim=dim, seed=step)
        grad_out = torch.randn(offsets.numel() - 1, dim, generator=g)
        args = definition(spec).kernel(spec, step)
        assert KernelCode(args.code) in KernelCode
        update(args, lr=spec.lr, weight=weight, states=states, rows=rows.to(device), offsets=offsets.to(device),
               per_sample_weights=psw.to(device), grad_out=grad_out.to(device))  # fmt: skip
        dense = torch.zeros(num_rows, dim).index_add_(0, rows, bag_gradients(grad_out, offsets, psw, rows.numel()))
        reference_update(spec, lr=spec.lr, step=step, weight=w_ref, states=states_ref, touched=rows, dense_grad=dense)
    torch.testing.assert_close(weight.cpu(), w_ref, rtol=1e-5, atol=1e-6)
    for k in states:
        torch.testing.assert_close(states[k].cpu(), states_ref[k], rtol=1e-5, atol=1e-6)


def check_half_update(device, spec, dtype, keyed, dim=8, steps=3, kernel=None, max_len=6, update=None):
    """The Triton update (or ``update``: the C++ one) of half-precision rows (``dtype``) against the torch path of
    ``fused_bag_update`` on a CPU copy: the same fp32 update, stored by the same keyed
    stochastic rounding (``keyed``: a dynamic table's key array, else row + offset). Where the
    kernel's float32 arithmetic matches torch's to the bit (SGD: one multiply and subtract) the
    rows match to the bit; elsewhere a draw may flip where the two float32 results straddle it,
    one storage step."""
    from dynarec.optim.fused import torch_bag_update
    from dynarec.optim.rounding import RowKeys

    g = torch.Generator().manual_seed(3)
    w_cpu = (torch.randn(50, dim, generator=g) * 0.3).to(dtype)
    states_cpu = {s.name: torch.full((50, s.width(dim)), s.initial_value) for s in spec.state_specs()}
    w, states = w_cpu.to(device), {k: v.to(device) for k, v in states_cpu.items()}
    keys = torch.randint(-(2**62), 2**62, (50,), generator=g)
    row_keys_cpu = RowKeys(keys=lambda: keys) if keyed else RowKeys(offset=1000)
    for step in range(1, steps + 1):
        rows, offsets, psw = random_bags("cpu", bags=40, dim=dim, seed=step, max_len=max_len)
        grad_out = torch.randn(offsets.numel() - 1, dim, generator=g)
        with tuned(gpu_update, kernel=kernel) if update is None else contextlib.nullcontext():
            (update or gpu.bag_update)(
                definition(spec).kernel(spec, step), lr=spec.lr, weight=w, states=states, rows=rows.to(device),
                offsets=offsets.to(device), per_sample_weights=psw.to(device), grad_out=grad_out.to(device),
                row_keys=keys.to(device) if keyed else None, key_offset=0 if keyed else 1000,
                rounding_base=rounding_base(11, step),
            )  # fmt: skip
        torch_bag_update(
            spec, spec.lr, step, w_cpu, states_cpu, rows, offsets, psw, grad_out, rounding_seed=11,
            row_keys=row_keys_cpu,
        )  # fmt: skip
    got, want = w.cpu().float(), w_cpu.float()
    assert w.dtype == dtype
    if spec.__class__.__name__ == "SGD":
        assert torch.equal(got, want)
    else:
        assert (got == want).float().mean() > 0.98
        step_size = torch.finfo(dtype).eps * want.abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((got - want).abs() <= 2 * step_size + 1e-30).all()
    for k in states:
        torch.testing.assert_close(states[k].cpu(), states_cpu[k], rtol=1e-5, atol=1e-6)


def check_static_update(device, spec, dtype=torch.float32, keyed=False, capture=False, kernel=None, dim=8, steps=4):
    """A :class:`~dynarec.kernels.gpu.update.StaticBagUpdate` (fixed buffers holding up to 20 ids
    a bag, the ids past a step's never read; ``capture``: replayed from a CUDA graph) updates
    rows, states and scores bit for bit as ``bag_update`` launched (never captured), over steps
    of several id counts, in blocks of 8 (``kernel``: the block kernel; runs cross blocks, and
    the blocks past the step's ids hold only pads), whose scalars all change: learning rate,
    Adam's bias corrections, the score (past int32), the rounding draws (half-precision
    ``dtype``; ``keyed``: by a key array)."""
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(50, dim, generator=g) * 0.3).to(dtype).to(device)
    states = {s.name: torch.full((50, s.width(dim)), s.initial_value, device=device) for s in spec.state_specs()}
    scores = torch.full((50,), -1, dtype=torch.int64, device=device)
    keys = torch.randint(-(2**62), 2**62, (50,), generator=g).to(device) if keyed else None
    eager = (weight, states, scores)
    static_rows = (weight.clone(), {k: v.clone() for k, v in states.items()}, scores.clone())
    bags, static, counts = 12, None, set()
    for step in range(1, steps + 1):
        rows, offsets, psw = random_bags(device, bags=bags, dim=dim, seed=step, max_len=20)
        counts.add(rows.numel())
        grad_out = torch.randn(bags, dim, generator=g).to(device)
        args = definition(spec).kernel(spec, step)
        scalars = dict(lr=spec.lr / step, score=(1 << 40) + step, key_offset=0 if keyed else 1000,
                       rounding_base=rounding_base(11, step))  # fmt: skip
        with tuned(gpu_update, kernel=kernel, block=8), tuned(gpu_update, "CAPTURE", enabled=False):
            gpu.bag_update(args, weight=eager[0], states=eager[1], rows=rows, offsets=offsets, per_sample_weights=psw,
                           grad_out=grad_out, scores=eager[2], row_keys=keys, **scalars)  # fmt: skip
            if static is None:
                w, st, sc = static_rows
                launch = gpu_update.Launch.of(args, w, psw, grad_out, sc, keys, None)
                static = gpu_update.StaticBagUpdate(launch, w, st, sc, keys, None, capacity=20 * bags, num_bags=bags,
                                                    grad_width=dim, capture=capture)  # fmt: skip
        static(rows, offsets, psw, grad_out, gpu_update.hyper_values(args, **scalars))  # its launch's tuning
        assert (static.graph is not None) == capture
    assert len(counts) > 1, "the steps' id counts should differ"
    assert torch.equal(eager[0], static_rows[0]) and torch.equal(eager[2], static_rows[2])
    for k in states:
        assert torch.equal(eager[1][k], static_rows[1][k]), k


def check_packed(device, spec, dims=(3, 16, 70), steps=3, kernel=None, max_len=6, bags=9, pooled=None, update=None):
    """The pooled lookup and the fused update of packed rows (tables of ``dims``, their rows end to
    end; :mod:`dynarec.kernels.packed`) against each table's own: ``pooled`` / ``update`` (default
    the Triton kernels, with ``kernel`` as their tuning) over ``steps`` steps of bags of every
    table, the bags' output ``[num_bags, widest dim]`` zero past a table's dim, its gradient
    random there (the update reads a row's own columns only)."""
    from dynarec.kernels.packed import packed_layout, table_views

    pooled = pooled or gpu.pooled_forward
    update = update or gpu.bag_update
    g = torch.Generator().manual_seed(3)
    shapes = [(n, d) for n, d in zip((7, 50, 30), dims)]
    width = max(dims)
    layout = packed_layout(shapes, device)
    host_layout = packed_layout(shapes)
    refs = [torch.randn(n, d, generator=g).to(device) for n, d in shapes]
    states_ref = [
        {s.name: torch.full((n, s.width(d)), s.initial_value, device=device) for s in spec.state_specs()}
        for n, d in shapes
    ]
    weight = torch.cat([w.flatten() for w in refs])
    states = {s.name: torch.cat([st[s.name].flatten() for st in states_ref]) for s in spec.state_specs()}
    tol = dict(rtol=1e-5, atol=1e-6 if max_len <= 6 else 2e-5)  # check_update's: long bags sum in another order
    for step in range(1, steps + 1):
        parts = [random_bags(device, num_rows=n, bags=bags, max_len=max_len, seed=10 * step + t) for t, (n, _) in
                 enumerate(shapes)]  # fmt: skip
        rows = torch.cat([p[0] + int(host_layout[0, t]) for t, p in enumerate(parts)])
        offsets = torch.cat([parts[0][1]] + [p[1][1:] + sum(int(q[1][-1]) for q in parts[:t]) for t, p in
                                             enumerate(parts) if t > 0])  # fmt: skip
        psw = torch.cat([p[2] for p in parts])
        out = pooled(weight, rows, offsets, psw, layout, width)
        expected = torch.cat([
            torch.nn.functional.pad(torch.nn.functional.embedding_bag(
                r, refs[t], o, mode="sum", per_sample_weights=w, include_last_offset=True), (0, width - shapes[t][1]))
            for t, (r, o, w) in enumerate(parts)
        ])  # fmt: skip
        torch.testing.assert_close(out, expected, **tol)
        grad_out = torch.randn(offsets.numel() - 1, width, generator=g).to(device)
        with tuned(gpu_update, kernel=kernel):
            update(definition(spec).kernel(spec, step), lr=spec.lr, weight=weight, states=states, rows=rows,
                   offsets=offsets, per_sample_weights=psw, grad_out=grad_out, layout=layout)  # fmt: skip
        bag_at = 0
        for t, (r, o, w) in enumerate(parts):
            bags = o.numel() - 1
            per_id = bag_gradients(grad_out[bag_at : bag_at + bags, : shapes[t][1]], o, w, r.numel())
            unique, inverse = torch.unique(r, return_inverse=True)
            agg = per_id.new_zeros(unique.numel(), shapes[t][1]).index_add_(0, inverse, per_id)
            fused_row_update(spec, lr=spec.lr, step=step, weight=refs[t], states=states_ref[t], rows=unique, grad=agg)
            bag_at += bags
    for t in range(len(shapes)):
        torch.testing.assert_close(table_views(weight, host_layout.to(device))[t], refs[t], **tol)
        for name in states:
            torch.testing.assert_close(table_views(states[name], host_layout.to(device))[t], states_ref[t][name], **tol)


def check_exchange_rows(device, fields, host_where, halves=("out", "in"), n=40, seed=0, records=False):
    """``exchange_rows`` (the reference and the kernel) of every field of ``fields`` (``(dtype,
    width)`` each; more than a launch takes, where given) against a row-by-row loop: bits moved
    (NaN payloads, negative zeros), rows written out where ``out_rows >= 0`` only.
    ``host_where``: ``device`` (the host rows on the device too) or ``locked`` (CPU memory locked
    for the device, which reads and writes it in place; on the interpreter's lane: CPU).
    ``records``: the host fields side by side in one float32 record a row (strided views)."""
    from dynarec.devices import page_lock
    from dynarec.kernels.gpu import rows as gpu_rows

    g = torch.Generator().manual_seed(seed)

    def bits_of(dtype):
        return torch.int16 if dtype.itemsize == 2 else torch.int32

    def random_rows(count, dtype, width):
        draws = torch.randint(-(2**15), 2**15, (count, width), generator=g, dtype=torch.int32)
        return draws.to(bits_of(dtype)).view(dtype)

    hosts = [random_rows(1000, dtype, width) for dtype, width in fields]
    caches = [random_rows(64, dtype, width) for dtype, width in fields]
    slots = torch.randperm(64, generator=g)[:n]
    picked = torch.randperm(1000, generator=g)[: 2 * n]
    out_rows = torch.where(torch.rand(n, generator=g) < 0.25, -1, picked[:n]) if "out" in halves else None
    in_rows = picked[n:] if "in" in halves else None
    want_hosts, want_caches = [h.clone() for h in hosts], [c.clone() for c in caches]
    for want_host, want_cache in zip(want_hosts, want_caches):
        for i in range(n):
            if out_rows is not None and out_rows[i] >= 0:
                want_host[out_rows[i]] = want_cache[slots[i]]
            if in_rows is not None:
                want_cache[slots[i]] = want_host[in_rows[i]]
    on_device = [None if t is None else t.to(device) for t in (slots, out_rows, in_rows)]
    held = []

    def host_fields():
        """The host fields as the run gets them: tensors of their own, or views of one record a row."""
        if not records:
            got = [h.clone().to(device) if host_where == "device" else h.clone() for h in hosts]
            if host_where == "locked" and torch.device(device).type == "cuda":
                got = [page_lock(h) for h in got]
            return got
        words = [-(-width * dtype.itemsize // 4) for dtype, width in fields]
        buffer = torch.full((1000, sum(words) + 1), float("nan"), device=device if host_where == "device" else "cpu")
        if host_where == "locked" and torch.device(device).type == "cuda":
            buffer = page_lock(buffer)
        held.append(buffer)  # locked while this tensor lives, not only its views
        got, at = [], 1  # (a word before the first field: no field starts its record)
        for h, (dtype, width), w in zip(hosts, fields, words):
            view = buffer[:, at : at + w].view(dtype)[:, :width]
            view.copy_(h)
            got.append(view)
            at += w
        return got

    for run in (reference.exchange_rows, gpu_rows.exchange_rows):
        got_hosts, got_caches = host_fields(), [c.clone().to(device) for c in caches]
        run(got_caches, on_device[0], got_hosts, on_device[1], on_device[2])
        for (dtype, _), got_cache, got_host, want_cache, want_host in zip(
            fields, got_caches, got_hosts, want_caches, want_hosts
        ):
            bits = bits_of(dtype)
            assert torch.equal(got_cache.cpu().view(bits), want_cache.view(bits)), run
            assert torch.equal(got_host.cpu().contiguous().view(bits), want_host.view(bits)), run
