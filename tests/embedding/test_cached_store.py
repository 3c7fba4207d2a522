"""A table's host-memory tier (dynarec.embedding.cached_store): its rows in host memory, a cache
of them on the device. Trained with a cache of a quarter of its rows, rows evicted and loaded
back every step, a fixed table equals the same table kept whole on the device bit for bit (on
the CPU), for every optimizer and pooling; so does a dynamic table, its keys growing the table
and evicting each other meanwhile; pending steps keep their rows; what cannot fit, or cannot be
cached, is refused by name."""

import pytest
import torch

from dynarec import DynamicTableOptions, EmbeddingCollection, FeatureConfig, JaggedBatch, TableConfig
from dynarec.embedding.cached_store import CacheFullError
from dynarec.embedding.config import cache_rows_of
from dynarec.optim import SGD, Adagrad, Adam
from tests.kernels.gpu_checks import SPECS
from tests.matrix import needs_cuda

ROWS = 200


def table(pooling, cache):
    return TableConfig(
        name="t", dim=6, num_embeddings=ROWS, pooling=pooling,
        features=["f", FeatureConfig("s", pooling="none")], cache_load_factor=cache,
    )  # fmt: skip


def batches(n, size=8, seed=0, weighted=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lists, weights = {}, {}
        for name in ("f", "s"):
            lengths = torch.randint(0, 4, (size,), generator=g)
            lists[name] = [torch.randint(0, ROWS, (int(k),), generator=g).tolist() for k in lengths]
            weights[name] = [torch.rand(int(k), generator=g).tolist() for k in lengths]
        out.append(JaggedBatch.from_lists(lists, weights if weighted else None))
    return out


def same(a: torch.Tensor, b: torch.Tensor, device: str) -> bool:
    """Equal bit for bit on the CPU; on a GPU to float32 summation order (the update's blocks
    follow the rows' numbering, and cache slots number rows otherwise than the table does)."""
    a, b = a.cpu(), b.cpu()
    if device != "cpu" and a.dtype == torch.float32:
        return torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    return torch.equal(a, b)


def train(coll, data, prefetch=False):
    """Trains on ``data``; ``prefetch``: as the trainer does, each batch's input stage run
    ``prefetch_depth`` steps ahead once the backward before is queued (a cached table's rows made
    resident there, on a GPU on the input stream beside the step)."""
    outs = []
    depth = coll.prefetch_depth if prefetch else 0
    for kjt in data[:depth]:
        coll.prefetch(kjt)
    for i, kjt in enumerate(data):
        out = coll(kjt)
        sum((v * torch.arange(v.numel(), device=v.device).view_as(v).cos()).sum() for v in out.values()).backward()
        if i + depth < len(data) and depth:
            coll.prefetch(data[i + depth])
        outs.append({k: v.detach().clone() for k, v in out.items()})
    return outs


@pytest.mark.parametrize("prefetch", [False, True], ids=["in_lookup", "prefetched"])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_a_cached_table_trains_as_the_table_kept_whole_on_the_device(spec, pooling, prefetch, device):
    data = [kjt.to(device) for kjt in batches(8, weighted=pooling == "sum")]
    cached = EmbeddingCollection([table(pooling, 0.25)], spec, device=device)
    whole = EmbeddingCollection([table(pooling, None)], spec, device=device)
    store = cached.tables["t"].store
    assert store.cache_rows == 50
    for x, y in zip(train(cached, data, prefetch), train(whole, data)):
        assert x.keys() == y.keys() and all(same(x[k], y[k], device) for k in x)
    assert store.counters["written_back"] > 0 and store.counters["loaded"] > store.cache_rows  # rows came and went
    if prefetch:  # rows loaded ahead of their lookup: all of them one batch ahead (the CPU's depth)
        assert 0 < store.counters["prefetched"] <= store.counters["loaded"]
        assert store.counters["prefetched"] == store.counters["loaded"] or cached.prefetch_depth > 1
    a, b = cached.tables["t"].dump(), whole.tables["t"].dump()
    assert a.keys() == b.keys()
    for k in a:
        assert same(a[k], b[k], device), (k, (a[k].cpu().double() - b[k].cpu().double()).abs().max())
    cached.eval()
    whole.eval()
    with torch.no_grad():
        x, y = cached(data[0]), whole(data[0])
    assert all(same(x[k], y[k], device) for k in x)


@pytest.mark.parametrize("data_type", ["fp32", "fp16"])
def test_rows_read_from_the_cache_from_host_memory_or_both_are_the_whole_tables(data_type, device):
    """read_rows of rows all cached, none cached, and some of each: the values and dtypes of the
    table kept whole; describe() counts the host copy's bytes apart."""
    spec = Adagrad(lr=0.1)
    cfg = lambda cache: TableConfig(
        name="t", dim=6, num_embeddings=ROWS, features=["f", FeatureConfig("s", pooling="none")],
        cache_load_factor=cache, data_type=data_type,
    )  # fmt: skip
    cached = EmbeddingCollection([cfg(0.25)], spec, device=device)
    whole = EmbeddingCollection([cfg(None)], spec, device=device)
    data = [kjt.to(device) for kjt in batches(4)]
    train(cached, data), train(whole, data)
    store = cached.tables["t"].store
    slot_of = store._slot_of_row.cpu()
    in_cache, on_host = torch.nonzero(slot_of >= 0).flatten(), torch.nonzero(slot_of < 0).flatten()
    assert in_cache.numel() and on_host.numel()
    for rows in (in_cache, on_host, torch.cat([on_host[:3], in_cache[:3], on_host[3:5]]), torch.arange(ROWS)):
        a, b = cached.read_rows("t", rows), whole.read_rows("t", rows)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and same(a[k], b[k], device), k
    info = cached.tables["t"].describe()
    assert info["host_bytes"] == store.host.nbytes > 0
    # the cache's rows and states, and its maps: a slot a row (int32), a row and a last use a slot (int64)
    assert info["bytes"] == store.host.nbytes + store.cache.nbytes + 4 * ROWS + 16 * store.cache_rows
    assert whole.tables["t"].describe()["host_bytes"] == 0


def dynamic_table(cache, score="step"):
    """Up to 256 keys, from 64 slots: 2000 keys grow it to 256, then evict the coldest each step."""
    options = DynamicTableOptions(256, init_capacity=64, bucket_size=8, score_strategy=score)
    features = ["f", FeatureConfig("s", pooling="none")]
    return TableConfig(name="t", dim=6, dynamic=options, features=features, cache_load_factor=cache)


def key_batches(n, size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lists = {}
        for name in ("f", "s"):
            lengths = torch.randint(0, 4, (size,), generator=g)
            lists[name] = [(torch.randint(0, 2000, (int(k),), generator=g) * 7919 + 13).tolist() for k in lengths]
        out.append(JaggedBatch.from_lists(lists))
    return out


@pytest.mark.parametrize("prefetch", [False, True], ids=["in_lookup", "prefetched"])
@pytest.mark.parametrize("score", ["step", "lfu"])
@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_a_cached_dynamic_table_trains_as_the_table_kept_whole_through_growth_and_eviction(
    spec, score, prefetch, device
):
    data = [kjt.to(device) for kjt in key_batches(12)]
    cached = EmbeddingCollection([dynamic_table(0.25, score)], spec, device=device)
    whole = EmbeddingCollection([dynamic_table(None, score)], spec, device=device)
    store = cached.tables["t"].store
    assert store.cache_rows == 64 and store.num_rows == 64  # a quarter of max_capacity; the rows start at 64
    for x, y in zip(train(cached, data, prefetch), train(whole, data)):
        assert x.keys() == y.keys() and all(same(x[k], y[k], device) for k in x)
    table = cached.tables["t"]
    assert table.capacity == 256 and table.evicted_keys > 0 and store.counters["written_back"] > 0
    assert (store.counters["prefetched"] > 0) == prefetch  # the keys found ahead: their rows
    a, b = table.dump(), whole.tables["t"].dump()
    assert a.keys() == b.keys()
    for k in a:
        assert same(a[k], b[k], device), k


@pytest.mark.parametrize("data_type", ["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["fixed", "dynamic"])
@pytest.mark.parametrize("spec", [SGD(lr=0.3), Adagrad(lr=0.2, initial_accumulator_value=0.1)], ids=repr)
def test_half_precision_rows_cached_train_as_kept_whole(spec, kind, data_type, device):
    """bf16 / fp16 rows behind a cache: each row's rounding draws are keyed by its row (a fixed
    table's global row id, a dynamic table's key) whatever slot it takes, so the cached table
    stores the same values as the table kept whole (bit for bit on the CPU)."""
    import dataclasses

    def config(cache):
        base = table("sum", cache) if kind == "fixed" else dynamic_table(cache)
        return dataclasses.replace(base, data_type=data_type)

    data = batches(8) if kind == "fixed" else key_batches(12)
    data = [kjt.to(device) for kjt in data]
    cached = EmbeddingCollection([config(0.25)], spec, device=device)
    whole = EmbeddingCollection([config(None)], spec, device=device)
    for x, y in zip(train(cached, data), train(whole, data)):
        assert all(same(x[k], y[k], device) for k in x)
    assert cached.tables["t"].store.counters["written_back"] > 0
    a, b = cached.tables["t"].dump(), whole.tables["t"].dump()
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[data_type]
    if kind == "fixed":  # (a dynamic table's dump reads its rows into float32, exactly)
        assert a["weight"].dtype == b["weight"].dtype == half
    assert torch.equal(a["weight"].cpu(), a["weight"].cpu().to(half).to(a["weight"].dtype))  # stored in half
    for k in a:
        if k == "weight" and device != "cpu":  # a float32 update a float ulp apart may round a storage step apart
            torch.testing.assert_close(a[k].float(), b[k].float(), rtol=2**-7, atol=1e-6)
        else:
            assert same(a[k].float(), b[k].float(), device) if a[k].is_floating_point() else torch.equal(a[k], b[k]), k


def test_a_growth_undone_puts_back_a_cached_dynamic_tables_rows():
    """A step that grew the table aborted (its rows cached meanwhile): the rows, keys and states of
    before the step, as the table kept whole gives them."""
    from dynarec.embedding.snapshot import dump

    spec = Adagrad(lr=0.1, initial_accumulator_value=0.1)
    runs = []
    for cache in (0.5, None):
        coll = EmbeddingCollection([dynamic_table(cache)], spec)
        train(coll, key_batches(2, seed=4))
        table = coll.tables["t"]
        before, capacity = dump(table.index, table.store, table.step, None), table.capacity
        coll(JaggedBatch.from_lists({"f": [list(range(10, 110))], "s": [[]]}))
        assert table.capacity > capacity
        coll.abort_step()
        after = dump(table.index, table.store, table.step, None)
        assert table.capacity == capacity and all(torch.equal(before[k], after[k]) for k in before)
        train(coll, key_batches(3, seed=5))
        runs.append(table.dump())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


@pytest.mark.parametrize("cache", [0.5, None])
def test_a_table_does_not_grow_under_a_late_backward(cache):
    """Two forwards, the second's backward (committing both steps), a third step whose new keys
    would grow the table, aborted; then the first's backward: it finds its rows where it left
    them (a growth waits while an earlier lookup's update is still to come), and its keys get both
    updates, cached or not."""
    coll = EmbeddingCollection([dynamic_table(cache)], SGD(lr=1.0))
    train(coll, key_batches(1, seed=4))
    a = JaggedBatch.from_lists({"f": [[5, 6]], "s": [[]]})
    o1, o2 = coll(a), coll(a)
    before = coll.read_rows("t", torch.tensor([5, 6]))["weight"]  # created by o1's step
    sum(v.sum() for v in o2.values()).backward()
    table = coll.tables["t"]
    capacity = table.capacity
    with pytest.warns(UserWarning, match="could not get a row"):
        o3 = coll(JaggedBatch.from_lists({"f": [list(range(1000, 1100))], "s": [[]]}))
    assert table.capacity == capacity  # no growth while o1's update is to come
    coll.abort_step()
    del o3
    sum(v.sum() for v in o1.values()).backward()
    assert torch.equal(coll.read_rows("t", torch.tensor([5, 6]))["weight"], before - 1.0 - 1.0)  # two SGD steps
    coll(JaggedBatch.from_lists({"f": [list(range(1000, 1100))], "s": [[]]}))
    assert table.capacity > capacity  # nothing to come now: it grows


def test_a_load_after_an_aborted_step_replaces_the_cache_too():
    """An aborted step's lookup, its output still held (a traceback keeps it), does not stop a
    load: the cache is replaced with the rest."""
    spec = Adagrad(lr=0.1)
    coll = EmbeddingCollection([dynamic_table(0.25)], spec)
    train(coll, key_batches(1, seed=2))
    table = coll.tables["t"]
    saved = table.dump()
    train(coll, key_batches(4, seed=3))
    held = coll(key_batches(1, seed=7)[0])
    coll.abort_step()
    table.load(saved)
    assert torch.equal(coll.read_rows("t", saved["keys"])["weight"], saved["weight"])
    train(coll, key_batches(2, seed=8))
    del held


def test_rows_read_written_dumped_and_loaded_through_the_cache(device):
    """Rows in the cache and rows in host memory in one read and one write (on a GPU the host
    rows are locked for it, and read and written by it in place)."""
    spec = Adagrad(lr=0.1)
    coll = EmbeddingCollection([table("sum", 0.25)], spec, device=device)
    whole = EmbeddingCollection([table("sum", None)], spec, device=device)
    data = [kjt.to(device) for kjt in batches(3, seed=1)]
    train(coll, data), train(whole, data)
    store = coll.tables["t"].store
    assert store.host.weight.is_pinned() == (device != "cpu")
    where = store._slot_of_row.cpu()
    rows = torch.cat([torch.nonzero(where >= 0)[:3, 0], torch.nonzero(where < 0)[:3, 0]])
    before = coll.read_rows("t", rows)
    for k, v in whole.read_rows("t", rows).items():
        assert same(before[k], v, device), k
    coll.write_rows("t", rows, {"weight": torch.arange(36.0).view(6, 6), "momentum1": torch.full((6, 6), 0.5)})
    assert torch.equal(coll.read_rows("t", rows)["weight"].cpu(), torch.arange(36.0).view(6, 6))
    assert torch.equal(coll.read_rows("t", rows)["momentum1"].cpu(), torch.full((6, 6), 0.5))
    whole.write_rows("t", rows, {"weight": torch.arange(36.0).view(6, 6), "momentum1": torch.full((6, 6), 0.5)})
    dump = coll.tables["t"].dump()
    for k, v in whole.tables["t"].dump().items():
        assert same(dump[k], v, device) if v.is_floating_point() else torch.equal(dump[k].cpu(), v.cpu()), k
    other = EmbeddingCollection([table("sum", 0.25)], spec, device=device)
    other.tables["t"].load(dump)
    data = [kjt.to(device) for kjt in batches(2, seed=2)]
    whole.tables["t"].load(dump)
    for x, y in zip(train(other, data), train(whole, data)):
        assert all(same(x[k], y[k], device) for k in x)


def test_pending_steps_keep_their_rows_and_a_batch_too_large_is_a_named_error():
    """Two forwards before their backwards (gradient accumulation): the second may not take the
    first's rows, so with a cache too small for both it is refused by name, and nothing moved;
    with room for both, the two steps equal the uncached ones."""
    spec = Adam(lr=0.05)
    data = batches(2, size=8, seed=3)
    need = [int(torch.unique(b.values()).numel()) for b in data]
    tight = EmbeddingCollection([table("sum", (max(need) + 1) / ROWS)], spec)
    first = tight(data[0])  # its backward still to come
    with pytest.raises(CacheFullError, match=r"table 't': a lookup needs \d+ rows more on the device, but its cache"):
        tight(data[1])
    roomy, whole = (EmbeddingCollection([table("sum", c)], spec) for c in (sum(need) / ROWS, None))
    for coll in (roomy, whole):
        loss = sum(v.sum() for kjt in data for v in coll(kjt).values())
        loss.backward()
    a, b = roomy.tables["t"].dump(), whole.tables["t"].dump()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(
        CacheFullError,
        match=rf"the batch reads {need[0]} distinct rows: raise cache_load_factor until its share of the table's "
        rf"rows \(a dynamic table's max_capacity\) is at least {need[0]} ",
    ):
        EmbeddingCollection([table("sum", 2 / ROWS)], spec)(data[0])
    del first


def test_rows_are_not_written_or_dumped_while_an_update_is_still_to_come():
    """A dump or a write empties the cache: refused while a training lookup's update is still to
    come (it would update an emptied slot); a read of rows writes the cache back and is allowed."""
    from dynarec.embedding.step import StepPendingError

    coll = EmbeddingCollection([table("sum", 0.5)], SGD(lr=0.1))
    out = coll(batches(1)[0])
    assert coll.read_rows("t", torch.tensor([3]))["weight"].shape == (1, 6)
    with pytest.raises(StepPendingError, match="table 't': its rows are written or viewed whole while a training"):
        coll.tables["t"].dump()
    sum(v.sum() for v in out.values()).backward()
    coll.tables["t"].dump()


def test_a_late_backward_finds_its_rows_where_it_left_them():
    """Two forwards, the second's backward (which commits both steps), a third forward, then the
    first's backward: the first lookup's slots are kept until its own update ran — a cache with
    no other room refuses the third forward by name; with room, the run equals the uncached one.
    A forward dropped without a backward (an aborted step) gives its slots back."""
    spec = SGD(lr=1.0)
    a, b = JaggedBatch.from_lists({"f": [[0, 1]], "s": [[]]}), JaggedBatch.from_lists({"f": [[2, 3]], "s": [[]]})

    def late(coll):
        o1, o2 = coll(a), coll(a)
        sum(v.sum() for v in o2.values()).backward()
        o3 = coll(b)
        for o in (o1, o3):
            sum(v.sum() for v in o.values()).backward()

    tight = EmbeddingCollection([table("sum", 2 / ROWS)], spec)
    with pytest.raises(CacheFullError, match="rows whose update is still to come"):
        late(tight)
    roomy, whole = (EmbeddingCollection([table("sum", c)], spec) for c in (4 / ROWS, None))
    late(roomy)
    late(whole)
    x, y = roomy.tables["t"].dump(), whole.tables["t"].dump()
    assert all(torch.equal(x[k], y[k]) for k in x)
    dropped = EmbeddingCollection([table("sum", 2 / ROWS)], spec)
    dropped(a)  # its output dropped at once, the step undone
    dropped.abort_step()
    sum(v.sum() for v in dropped(b).values()).backward()


def spy_on_holds(monkeypatch) -> list[bool]:
    """Whether each lookup of a cached store from now on was given a valid hold, in order."""
    from dynarec.embedding.cached_store import CachedRowStore

    held: list[bool] = []
    resident = CachedRowStore._resident

    def spied(self, rows, tick, hold=None):
        held.append(hold is not None and hold.valid)
        return resident(self, rows, tick, hold)

    monkeypatch.setattr(CachedRowStore, "_resident", spied)
    return held


def test_a_prefetched_lookup_reads_its_slots_from_its_hold_and_loads_nothing(monkeypatch):
    """Batches made resident two steps ahead: each lookup takes its slots from its hold (no host
    read on a GPU), loads nothing, and releases the hold; the run equals the table kept whole."""

    spec = Adagrad(lr=0.1)
    data = batches(6, size=8, seed=5)
    most = max(len(torch.unique(b.values())) for b in data)
    cached = EmbeddingCollection([table("sum", 3 * most / ROWS)], spec, prefetch_depth=2)
    store = cached.tables["t"].store
    held = spy_on_holds(monkeypatch)
    outs = train(cached, data, prefetch=True)
    assert held == [True] * len(data)
    whole = EmbeddingCollection([table("sum", None)], spec)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(outs, train(whole, data)) for k in x)
    assert store.counters["loaded"] == store.counters["prefetched"]  # no lookup loaded a row
    assert store.counters["written_back"] > 0  # (rows came and went)
    assert not store._reserved  # every hold released by its lookup
    a, b = cached.tables["t"].dump(), whole.tables["t"].dump()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_hold_whose_rows_may_have_moved_is_not_read():
    """A weight view (the cache written back and emptied) between a prefetch and its lookup: the
    lookup loads its rows again instead of reading the hold's slots; the run equals the table
    kept whole."""
    spec = SGD(lr=0.5)
    data = batches(3, size=8, seed=6)
    cached, whole = (EmbeddingCollection([table("sum", c)], spec) for c in (0.5, None))
    store = cached.tables["t"].store
    for coll in (cached, whole):
        for kjt in data:
            coll.prefetch(kjt)
            loaded = store.counters["loaded"]
            coll.tables["t"].store.weight  # noqa: B018 - a view: the cache written back and emptied
            assert store.counters["loaded"] == loaded
            sum(v.sum() for v in coll(kjt).values()).backward()
            assert coll is whole or store.counters["loaded"] == loaded + len(torch.unique(kjt.values()))
    assert store.counters["prefetched"] > 0 and not store._reserved
    a, b = cached.tables["t"].dump(), whole.tables["t"].dump()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_lookup_takes_a_holds_slots_only_without_other_room_and_the_holds_lookup_then_finds_its_rows():
    """A cache of 8 rows: batch a (4 rows) made resident, b (4 other rows) trained, then c (4
    rows more) needs 4 slots, and all that are not b's are a's hold's: c takes a's (the least
    recently used), so a's lookup finds its rows again (not reading slots that now hold c's
    rows). The run equals the table kept whole."""
    spec = Adagrad(lr=0.5)
    a, b, c = (
        JaggedBatch.from_lists({"f": [rows], "s": [[]]}) for rows in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11])
    )
    cached, whole = (EmbeddingCollection([table("sum", cache)], spec) for cache in (8 / ROWS, None))
    for coll in (cached, whole):
        coll.prefetch(a)
        for kjt in (b, c, a):
            sum(v.sum() for v in coll(kjt).values()).backward()
    counters = cached.tables["t"].store.counters
    assert counters["prefetched"] == 4 and counters["loaded"] == 4 + 4 + 4 + 4  # a twice
    x, y = cached.tables["t"].dump(), whole.tables["t"].dump()
    assert all(torch.equal(x[k], y[k]) for k in x)


SLEEP = 400_000_000  # GPU clock cycles, some 0.2 s: the delayed stream's work comes long after the others'


def rows_of(*lists):
    """Batches in pinned host memory, as the trainer's: their input stage waits for nothing on the
    main stream (a batch already on the device would wait for all of it, the updates too)."""
    return [JaggedBatch.from_lists({"f": [rows], "s": [[]]}).pin_memory() for rows in lists]


@needs_cuda
def test_on_a_gpu_a_held_lookup_waits_for_rows_an_earlier_prefetch_is_still_moving(monkeypatch):
    """The rows stream held back: a prefetch of a loads its rows (moving late), a prefetch of b
    (rows of a's) moves nothing, and b's forward drops a's stage: b's lookup still waits for
    a's moves before reading its slots, so the run equals the table kept whole."""
    from dynarec.embedding.cached_store import CachedRowStore
    from dynarec.embedding.streams import rows_stream

    moves = CachedRowStore._move_aside

    def late(self, *args):
        with torch.cuda.stream(rows_stream(self.device)):
            torch.cuda._sleep(SLEEP)
        moves(self, *args)

    spec = Adagrad(lr=0.5)
    warm, a, b = rows_of([9], [0, 1, 2, 3, 4, 5], [1, 3, 5])
    cached, whole = (EmbeddingCollection([table("sum", c)], spec, device="cuda") for c in (8 / ROWS, None))
    for coll in (cached, whole):  # the kernels compiled before any stream is held back
        sum(v.sum() for v in coll(warm).values()).backward()
    torch.cuda.synchronize()
    monkeypatch.setattr(CachedRowStore, "_move_aside", late)
    outs = []
    for coll in (cached, whole):
        coll.prefetch(a)
        coll.prefetch(b)
        out = coll(b)
        sum(v.sum() for v in out.values()).backward()
        outs.append(out["f"].detach().cpu())
    store = cached.tables["t"].store
    assert store.counters["prefetched"] == 6 and store.counters["loaded"] == 7  # (the warm-up's row) b's: none
    assert torch.equal(outs[0], outs[1])
    x, y = cached.tables["t"].dump(), whole.tables["t"].dump()
    assert all(same(x[k], y[k], "cuda") for k in x)


@needs_cuda
def test_on_a_gpu_a_prefetch_spares_the_slots_of_an_update_still_running(monkeypatch):
    """The fused update held back on the main stream: a's update is queued but not run when a
    prefetch of c needs more slots than b's; it may not take a's (it would write a's rows back
    before their update), so it loads nothing and c's lookup loads them after the update. The
    run equals the table kept whole."""
    import dynarec.embedding.row_store as row_store

    update = row_store.fused_bag_update

    def late(*args, **kwargs):
        torch.cuda._sleep(SLEEP)
        update(*args, **kwargs)

    spec = SGD(lr=1.0)
    a, b, c = rows_of([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12, 13])
    cached, whole = (EmbeddingCollection([table("sum", c)], spec, device="cuda") for c in (8 / ROWS, None))
    for coll in (cached, whole):  # the kernels compiled before the updates are held back
        sum(v.sum() for v in coll(b).values()).backward()
    torch.cuda.synchronize()
    monkeypatch.setattr(row_store, "fused_bag_update", late)
    for coll in (cached, whole):
        for kjt in (b, a):
            sum(v.sum() for v in coll(kjt).values()).backward()
        coll.prefetch(c)
        sum(v.sum() for v in coll(c).values()).backward()
    counters = cached.tables["t"].store.counters
    assert counters["prefetches_skipped"] == 1 and counters["prefetched"] == 0
    x, y = cached.tables["t"].dump(), whole.tables["t"].dump()
    assert all(same(x[k], y[k], "cuda") for k in x)


def test_a_prefetch_without_room_loads_nothing_and_its_lookup_loads_the_rows():
    """A cache with room for one batch's rows, a prefetch of the next batch while the first's
    update is still to come: the prefetch may not take those slots, so it loads nothing
    (counted); the next lookup loads its rows. The run equals the table kept whole."""
    spec = Adagrad(lr=0.3)
    data = batches(2, size=8, seed=6)
    need = max(len(torch.unique(b.values())) for b in data)
    cached, whole = (EmbeddingCollection([table("sum", c)], spec) for c in (need / ROWS, None))
    for coll in (cached, whole):
        first = coll(data[0])
        coll.prefetch(data[1])
        sum(v.sum() for v in first.values()).backward()
        sum(v.sum() for v in coll(data[1]).values()).backward()
    counters = cached.tables["t"].store.counters
    assert counters["prefetches_skipped"] == 1 and counters["prefetched"] == 0
    assert counters["loaded"] == len(torch.unique(torch.cat([b.values() for b in data])))  # each row once
    a, b = cached.tables["t"].dump(), whole.tables["t"].dump()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_what_cannot_be_cached_is_refused_by_name():
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match=r"table 't': cache_load_factor must be a share of the rows in \(0, 1\]"):
            table("sum", bad)
    with pytest.raises(ValueError, match="cache_load_factor caches rows of backend 'native', not 'fbgemm'"):
        TableConfig(name="t", dim=4, num_embeddings=8, features=["f"], cache_load_factor=0.5, backend="fbgemm")
    assert cache_rows_of(200, 0.25) == 50 and cache_rows_of(3, 0.01) == 1 and cache_rows_of(7, 1.0) == 7


def test_a_yaml_config_trains_a_cached_table_as_the_table_kept_whole(tmp_path):
    """``cache_load_factor`` on the features of a fixed table and of a dynamic one (YAML): the
    trainer's run equals the one without it, every table's keys, rows and states bit for bit (the
    caches evicting as they go)."""
    from dynarec.config import load_config
    from dynarec.train.trainer import Trainer
    from tests.pipeline_fixtures import config_dict, make_data, write_config

    make_data(tmp_path)
    dumps = []
    for factor in (None, {"item": 0.75, "user_id": 0.25}):
        c = config_dict(data__eval_input_path=None)
        for entry in c["feature_configs"]:
            body = next(iter(entry.values()))
            name = body.get("embedding_name", body["feature_name"])
            if factor is not None and name in factor:
                body["cache_load_factor"] = factor[name]
        tag = "cached" if factor else "whole"
        trainer = Trainer(load_config(write_config(tmp_path, c, f"{tag}.yaml")), tmp_path / tag, progress=False)
        trainer.fit()
        stores = [trainer.task.embeddings.tables[name].store for name in ("item", "user_id")]
        assert [(type(s).__name__, getattr(s, "cache_rows", None)) for s in stores] == (
            [("NativeRowStore", None)] * 2 if factor is None else [("CachedRowStore", 150), ("CachedRowStore", 128)]
        )
        dumps.append({n: t.dump() for n, t in trainer.task.embeddings.tables.items()})
        if factor is not None:
            assert all(s.counters["written_back"] > 0 for s in stores)
    for name, dump in dumps[0].items():
        assert all(torch.equal(v, dumps[1][name][k]) for k, v in dump.items()), name


def test_the_plan_shows_a_cached_tables_bytes_on_the_device_and_in_host_memory():
    from dynarec.embedding.memory import table_bytes
    from dynarec.planner.plan import Plan, TablePlan
    from dynarec.planner.sharding import TableSharding

    spec = Adagrad(lr=0.1)
    cached, whole = table("sum", 0.25), table("sum", None)
    b, w = table_bytes(cached, spec), table_bytes(whole, spec)
    assert (b.weights, b.states, b.host) == (w.weights // 4, w.states // 4, w.weights + w.states)
    assert b.index == 4 * ROWS + 16 * 50  # the slot map of every row, each slot's row and last use
    d, dw = table_bytes(dynamic_table(0.25), spec), table_bytes(dynamic_table(None), spec)
    assert (d.weights, d.host) == (dw.weights // 4, dw.weights + dw.states)
    assert d.index == dw.index + 4 * 256 + 16 * 64  # the hash index stays on the device, beside the cache's map
    plan = Plan((TablePlan(cached, spec, TableSharding("table_wise", 1, (0,))),))
    (row,) = plan.describe()
    assert (row["bytes/rank"], row["host bytes/rank"]) == ("3.9 KiB", "9.4 KiB")


def test_the_planner_never_replicates_a_cached_table():
    from dynarec.planner.plan import PlanError, _decide

    spec = Adagrad(lr=0.1)
    assert _decide(table("sum", 0.25), spec, 2, None, [0, 0]).kind == "table_wise"
    assert _decide(table("sum", None), spec, 2, None, [0, 0]).kind == "data_parallel"
    forced = TableConfig(name="t", dim=6, num_embeddings=ROWS, features=["f"], cache_load_factor=0.5,
                         sharding="data_parallel")  # fmt: skip
    with pytest.raises(PlanError, match="a data_parallel table keeps every row on each device"):
        _decide(forced, spec, 2, None, [0, 0])


def test_rows_the_host_cannot_hold_are_refused_before_anything_is_allocated():
    from dynarec.embedding.memory import check_fits

    huge = TableConfig(name="huge", dim=128, num_embeddings=10**12, features=["f"], cache_load_factor=0.001)
    with pytest.raises(
        ValueError, match=r"of host memory but .* is available:\n  table 'huge': .* of rows in host"
    ) as e:
        check_fits([(huge, Adagrad(lr=0.1))], torch.device("cpu"))
    # On a CPU its cache and slot map are in RAM too: every byte of the total is named.
    assert "on the device, which is host memory on a CPU" in str(e.value)


@pytest.mark.parametrize("where", ["prefetch", "lookup"])
def test_rows_whose_move_raised_stay_where_they_were(where, monkeypatch):
    """A move that raises (out of memory, say) after its slots were claimed leaves the cache as
    before the claim: the rows those slots held stay there, the missing rows in host memory. A
    prefetch's error is dropped (its lookup loads the rows itself), a lookup's is raised; the
    run then equals the table kept whole (before the mend: rows read the slots' old rows)."""
    from dynarec.embedding.cached_store import CachedRowStore

    spec = Adagrad(lr=0.2)
    data = batches(8, size=8, seed=7)
    need = max(len(torch.unique(b.values())) for b in data)
    cached, whole = (EmbeddingCollection([table("sum", c)], spec) for c in (2 * need / ROWS, None))
    store = cached.tables["t"].store
    calls = []
    real = CachedRowStore._move_aside if where == "prefetch" else CachedRowStore._exchange

    def failing(self, *moves):
        if self is store and moves[2] is not None:  # a claim's moves (not a write-back)
            calls.append(1)
            if len(calls) % 2:  # every other one raises
                raise RuntimeError("CUDA out of memory (simulated)")
        return real(self, *moves)

    monkeypatch.setattr(CachedRowStore, "_move_aside" if where == "prefetch" else "_exchange", failing)
    failed = 0
    for coll in (cached, whole):
        for i, kjt in enumerate(data):
            if where == "prefetch":
                out = coll(kjt)
                if i + 1 < len(data):
                    coll.prefetch(data[i + 1])
            else:
                while True:  # a lookup that raised is tried again, as a rerun would
                    try:
                        out = coll(kjt)
                        break
                    except RuntimeError as e:
                        assert "simulated" in str(e)
                        failed += coll is cached
            sum(v.sum() for v in out.values()).backward()
    assert len(calls) >= 4 and (where == "prefetch" or failed >= 2)
    assert store.counters["loaded"] - store.counters["written_back"] == int((store._row_of_slot >= 0).sum())
    a, b = cached.tables["t"].dump(), whole.tables["t"].dump()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_dynamic_tables_prefetched_lookup_reads_its_hold_where_every_key_was_found(monkeypatch):
    """Warm keys (every key of a batch found ahead, nothing inserted since): each lookup takes its
    slots from its hold; a batch with a new key does not (its rows are the found keys' and the new
    one's). The run equals the table kept whole."""

    spec = Adagrad(lr=0.1)
    warm = key_batches(3, seed=11)
    cold = key_batches(1, seed=12)
    data = warm + warm + cold + warm  # the repeats' keys are all present when prefetched
    cached = EmbeddingCollection([dynamic_table(1.0)], spec, prefetch_depth=1)
    whole = EmbeddingCollection([dynamic_table(None)], spec, prefetch_depth=1)
    held = spy_on_holds(monkeypatch)
    outs = train(cached, data, prefetch=True)
    assert held[3:6] == [True] * 3 and held[6] is False and held[7:] == [True] * 3
    for x, y in zip(outs, train(whole, data, prefetch=True)):
        assert all(torch.equal(x[k], y[k]) for k in x)
    a, b = cached.tables["t"].dump(), whole.tables["t"].dump()
    assert all(torch.equal(a[k], b[k]) for k in a)
