"""Dynamic tables: same optimizer meaning as fixed tables, row lifecycle, capacity, dump/load."""

import time
import warnings

import numpy as np
import pytest
import torch

from dynarec import (
    AdmissionConfig,
    DynamicTableOptions,
    EmbeddingCollection,
    FeatureConfig,
    Initializer,
    JaggedBatch,
    TableConfig,
)
from dynarec.embedding import TableFullError
from dynarec.embedding.hash_index import PIN_WRAP, candidate_buckets
from dynarec.embedding.jagged import split_features
from dynarec.kernels import reference
from dynarec.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from tests.embedding.test_hash_index import check_invariants, keys_with_buckets
from tests.matrix import BACKENDS
from tests.reference_model import zipf_batch

TOL = dict(rtol=1e-5, atol=1e-6)
D = 4
INIT = Initializer("uniform", bound=0.5)


def dynamic(name="d", backend="native", spec=None, features=("f",), **kw):
    """A dynamic table; ``kw`` are DynamicTableOptions fields (and ``initializer``, ``seed``)."""
    kw.setdefault("max_capacity", 1024)
    kw.setdefault("bucket_size", 4)
    feats = [f if isinstance(f, FeatureConfig) else FeatureConfig(f) for f in features]
    return TableConfig(
        name=name,
        dim=D,
        features=feats,
        backend=backend,
        optimizer=spec,
        initializer=kw.pop("initializer", INIT),
        seed=kw.pop("seed", 11),
        dynamic=DynamicTableOptions(**kw),
    )


def pinned(t):
    """``[capacity]`` bool: the slots of ``t`` a pending training step has pinned (not evictable)."""
    pending = torch.tensor([s.id for s in t.steps.pending], dtype=torch.int64) % PIN_WRAP
    return torch.isin(t.index.pins, pending.to(t.device)) & t.index.occupied


def one(coll, feats, backward=True, weights=None):
    """A training step; ``backward=False`` inserts without updating (no grad)."""
    if not backward:
        with torch.no_grad():
            return coll(JaggedBatch.from_lists(feats, weights))
    out = coll(JaggedBatch.from_lists(feats, weights))
    if backward:
        g = torch.Generator().manual_seed(sum(len(s) for v in feats.values() for s in v))
        sum((v * torch.randn(v.shape, generator=g)).sum() for v in out.values()).backward()
    return out


# -- the same optimizer on both kinds --------------------------------------------------------------

SPECS = (
    [SGD(lr=0.3)]
    + [
        s
        for iav in (0.0, 0.1)
        for s in (
            Adagrad(lr=0.2, initial_accumulator_value=iav),
            RowWiseAdagrad(lr=0.2, initial_accumulator_value=iav),
            RowWiseAdagrad(lr=0.2, initial_accumulator_value=iav, weight_decay=0.2, weight_decay_mode="decoupled"),
        )
    ]
    + [Adam(lr=0.05), Adam(lr=0.05, weight_decay=0.1)]
    + [Adagrad(lr=0.2, initial_accumulator_value=0.1, gradient_clipping=True, max_gradient=0.3)]
)


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_dynamic_equals_fixed(backend, spec):
    if backend == "fbgemm" and isinstance(spec, Adam):
        with pytest.raises(ValueError, match="backend='native'"):
            EmbeddingCollection([dynamic(backend=backend)], spec)
        return
    n = 40
    features = ["item_id", FeatureConfig("hist_item_id", pooling="none"), FeatureConfig("m", pooling="mean")]
    fixed = EmbeddingCollection(
        [TableConfig(name="d", dim=D, num_embeddings=n, features=features, backend=backend, initializer=INIT, seed=11)],
        spec,
    )
    dyn = EmbeddingCollection([dynamic(backend=backend, features=features, max_capacity=256, init_capacity=16)], spec)
    rng = np.random.default_rng(1)
    for _ in range(4):
        feats = {f: zipf_batch(rng, 5, 4, n) for f in ("item_id", "hist_item_id", "m")}
        out_f = one(fixed, feats)
        out_d = one(dyn, feats)
        for k in out_f:
            torch.testing.assert_close(out_d[k].detach(), out_f[k].detach(), **TOL)
    keys = torch.arange(n)
    rf, rd = fixed.read_rows("d", keys), dyn.read_rows("d", keys)
    present = rd.pop("present")
    assert int(present.sum()) == dyn.tables["d"].size > 10
    assert dyn.tables["d"].capacity > 16  # it grew on the way
    for k in rf:
        torch.testing.assert_close(rd[k][present], rf[k][present], **TOL)
    assert dyn.tables["d"].step == fixed.tables["d"].step == 4


@pytest.mark.parametrize("cls", [Adagrad, RowWiseAdagrad])
@pytest.mark.parametrize("iav", [0.0, 0.1])
def test_fresh_and_returning_rows_start_at_initial_accumulator_value(backend, cls, iav):
    spec = cls(lr=0.5, initial_accumulator_value=iav)
    # One bucket of 4 slots at max capacity: the 5th key evicts the lowest-score row.
    coll = EmbeddingCollection([dynamic(backend=backend, max_capacity=4, bucket_size=4)], spec)
    coll(JaggedBatch.from_lists({"f": [[100]]}))["f"].sum().backward()  # step 1 inserts 100
    # Fresh row, through the real path: train forward inserts, read before backward.
    out = coll(JaggedBatch.from_lists({"f": [[7]]}))
    row = coll.read_rows("d", torch.tensor([7]))
    assert bool(row["present"][0])
    assert torch.equal(row["momentum1"], torch.full_like(row["momentum1"], iav))
    torch.testing.assert_close(row["weight"][0], INIT.values(torch.tensor([7]), D, 11, 0.0)[0], rtol=0, atol=0)
    out["f"].sum().backward()
    after = coll.read_rows("d", torch.tensor([7]))
    h = torch.tensor(iav) + 1.0  # g = 1 in every column: g*g = mean(g*g) = 1
    torch.testing.assert_close(after["momentum1"], torch.full_like(after["momentum1"], float(h)), rtol=1e-6, atol=0)
    torch.testing.assert_close(after["weight"][0], row["weight"][0] - 0.5 / (h.sqrt() + 1e-8), rtol=1e-6, atol=1e-7)
    # Fill the bucket (keys 1, 2 at step 3), then key 9 evicts the lowest score: key 100 (step 1).
    one(coll, {"f": [[1, 2]]})
    one(coll, {"f": [[9]]})
    assert not bool(coll.read_rows("d", torch.tensor([100]))["present"][0])
    # Key 100 comes back: a fresh row again, accumulator at the initial value before its update.
    coll(JaggedBatch.from_lists({"f": [[100]]}))
    back = coll.read_rows("d", torch.tensor([100]))
    assert bool(back["present"][0])
    assert torch.equal(back["momentum1"], torch.full_like(back["momentum1"], iav))
    assert coll.tables["d"].evicted_keys == 2


# -- eviction order ---------------------------------------------------------------------------------


def full_bucket(strategy, **kw):
    coll = EmbeddingCollection([dynamic(max_capacity=4, bucket_size=4, score_strategy=strategy, **kw)], SGD(lr=0.1))
    return coll, coll.tables["d"]


def keys_present(table, keys):
    return [k for k in keys if bool(table.read_rows(torch.tensor([k]))["present"][0])]


def test_step_strategy_evicts_least_recently_touched():
    coll, t = full_bucket("step")
    for k in (10, 20, 30, 40):  # steps 1..4
        one(coll, {"f": [[k]]})
    one(coll, {"f": [[10]]})  # step 5 touches 10 again; 20 is now the oldest
    one(coll, {"f": [[50]]})
    assert keys_present(t, [10, 20, 30, 40, 50]) == [10, 30, 40, 50]


def test_lfu_strategy_evicts_least_frequent():
    coll, t = full_bucket("lfu")
    one(coll, {"f": [[10, 10, 10], [20], [30, 30], [40, 40]]})
    one(coll, {"f": [[20, 20]]})  # counts: 10:3, 20:3, 30:2, 40:2 -> evict 30 or 40 (tie: smaller slot)
    one(coll, {"f": [[50]]})
    present = keys_present(t, [10, 20, 30, 40, 50])
    assert 50 in present and 10 in present and 20 in present and len(present) == 4
    slot_of = {k: int(t.index.find(torch.tensor([k]))[0]) for k in (10, 20, 30, 40) if k in present}
    evicted = ({30, 40} - set(present)).pop()
    survivor = ({30, 40} - {evicted}).pop()
    # keys were inserted in ascending order into slots 0..3, so 30 sat in the smaller slot
    assert evicted == 30 and slot_of[survivor] == 3


def test_timestamp_strategy_evicts_oldest_wall_clock():
    coll, t = full_bucket("timestamp")
    for k in (40, 30, 20, 10):
        one(coll, {"f": [[k]]})
    one(coll, {"f": [[50]]})
    assert keys_present(t, [10, 20, 30, 40, 50]) == [10, 20, 30, 50]


def test_ties_go_to_the_smaller_slot():
    coll, t = full_bucket("step")
    one(coll, {"f": [[40, 10, 30, 20]]})  # same step: equal scores; ascending keys take slots 0..3
    assert [int(t.index.find(torch.tensor([k]))[0]) for k in (10, 20, 30, 40)] == [0, 1, 2, 3]
    one(coll, {"f": [[50]]})
    assert keys_present(t, [10, 20, 30, 40, 50]) == [20, 30, 40, 50]


def test_rows_looked_up_in_a_step_are_pinned():
    coll, t = full_bucket("step", check_mode="ignore")
    one(coll, {"f": [[10, 20, 30, 40]]})
    before = t.read_rows(torch.tensor([10, 20, 30, 40]))
    out = one(coll, {"f": [[10, 20, 30, 40], [50]]})  # every row pinned: 50 cannot get one
    assert keys_present(t, [10, 20, 30, 40, 50]) == [10, 20, 30, 40]
    assert t.dropped_keys == 1
    assert torch.equal(out["f"][1].detach(), torch.zeros(D))  # 50 read the eval initializer (0)
    # Pins last until backward: a second forward before backward cannot evict the first's rows.
    out1 = coll(JaggedBatch.from_lists({"f": [[10]]}))
    out2 = coll(JaggedBatch.from_lists({"f": [[60]]}))  # 10 pinned by out1; 20/30/40 free: 20 goes (ties)
    assert keys_present(t, [10, 20, 60]) == [10, 60]
    out1["f"].sum().backward()
    # A row is pinned until its own step's backward: 10 is free again, 60 waits for out2's backward.
    assert pinned(t).nonzero().flatten().tolist() == t.index.find(torch.tensor([60])).tolist()
    out2["f"].sum().backward()
    assert not bool(pinned(t).any())
    del before


def _crowded_table():
    """4 buckets of 4; buckets 0 and 1 full of rows whose keys have no other bucket, but for
    ``residents[0]`` (buckets 0 and 2), placed in bucket 0. Returns ``(coll, table, residents, x,
    y)``: ``x`` and ``y`` new keys whose two buckets are 0 and 1."""
    coll = EmbeddingCollection(
        [dynamic(max_capacity=16, init_capacity=16, bucket_size=4, score_strategy="step")], SGD(lr=0.1)
    )
    t = coll.tables["d"]
    r, *others = keys_with_buckets(4, [(0, 2)] + [(0, 1)] * 3 + [(1, 0)] * 4 + [(0, 1)] * 2)
    others, (x, y) = others[:7], others[7:]
    one(coll, {"f": [[r]]})  # both buckets empty: the first one
    one(coll, {"f": [others]})
    residents = [r, *others]
    assert sorted(int(s) // 4 for s in t.index.find(torch.tensor(residents))) == [0] * 4 + [1] * 4
    return coll, t, residents, x, y


def test_a_row_of_this_step_moves_to_make_room_for_a_new_key():
    coll, t, residents, x, _ = _crowded_table()
    r = residents[0]
    before = t.read_rows(torch.tensor(residents))["weight"]
    # Every resident is looked up in this step (pinned), and the new key's buckets are full:
    # r moves to its other bucket (its row with it), x takes its slot; nothing is dropped.
    out = coll(JaggedBatch.from_lists({"f": [[k] for k in residents] + [[x]]}))
    assert t.dropped_keys == 0 and t.report()["moved_keys"] == 1
    assert int(t.index.find(torch.tensor([r]))[0]) // 4 == 2
    torch.testing.assert_close(out["f"][:-1].detach(), before, rtol=0, atol=0)
    torch.testing.assert_close(out["f"][-1].detach(), t.initial_weights(torch.tensor([x]))[0], rtol=0, atol=0)
    out["f"].sum().backward()  # the update lands on the rows' new slots
    after = t.read_rows(torch.tensor([*residents, x]))["weight"]
    torch.testing.assert_close(after[:-1], before - 0.1, rtol=1e-6, atol=1e-6)


def test_an_aborted_step_puts_a_moved_row_back():
    coll, t, residents, x, _ = _crowded_table()
    slots = t.index.find(torch.tensor(residents))
    before = t.read_rows(torch.tensor(residents))["weight"]
    coll(JaggedBatch.from_lists({"f": [[k] for k in residents] + [[x]]}))  # r moves, x placed
    coll.abort_step()
    assert torch.equal(t.index.find(torch.tensor(residents)), slots) and keys_present(t, [x]) == []
    assert torch.equal(t.read_rows(torch.tensor(residents))["weight"], before)
    check_invariants(t.index)


@pytest.mark.parametrize("grouped", [False, True])
def test_an_aborted_step_gives_back_the_pins_of_an_earlier_step_still_pending(grouped):
    """Two steps pending: the later one pins a key the earlier one looked up (over the earlier's
    pin) and is aborted. The earlier step's row stays pinned: a third step's insert into the
    full table evicts another row (without the pin's undo it evicted the row the earlier step's
    backward will update). Alone and in a group of two tables (its one plan)."""
    configs = [dynamic(init_capacity=4, max_capacity=4, score_strategy="step")]
    if grouped:
        configs.append(dynamic("e", features=("g",), init_capacity=4, max_capacity=4, score_strategy="step"))
    coll = EmbeddingCollection(configs, SGD(lr=0.1))
    assert coll.lookup_groups[0] == (("d", "e") if grouped else ("d",))
    t = coll.tables["d"]
    other = {"g": [[7]]} if grouped else {}
    one(coll, {"f": [[1, 2, 3, 4]], **other})  # one bucket, full; key 1 in slot 0 (equal scores: evicted first)
    earlier = coll(JaggedBatch.from_lists({"f": [[1]], **other}))  # pending, no backward yet
    coll(JaggedBatch.from_lists({"f": [[1, 50]], **other}))  # pins key 1 again, inserts 50
    coll.abort_step()
    assert keys_present(t, [1, 2, 3, 4, 50]) == [1, 2, 3, 4]
    later = coll(JaggedBatch.from_lists({"f": [[60]], **other}))  # full: evicts a row not pinned
    assert keys_present(t, [1, 60]) == [1, 60]
    (sum(v.sum() for v in earlier.values()) + sum(v.sum() for v in later.values())).backward()


def test_a_table_that_served_the_step_moves_none_of_its_rows():
    coll, t, residents, x, y = _crowded_table()
    out = coll(JaggedBatch.from_lists({"f": [[k] for k in residents] + [[x]]}))  # r moves; x placed
    slots = t.index.find(torch.tensor([*residents, x]))
    # A second lookup in the same step (its first one's slots are final): y finds no room.
    bags, _ = t.pack(split_features(JaggedBatch.from_lists({"f": [[y]]})))
    with pytest.warns(UserWarning, match="1 new key"):
        t.lookup(bags, train=True)
    assert t.dropped_keys == 1 and torch.equal(t.index.find(torch.tensor([*residents, x])), slots)
    out["f"].sum().backward()


@pytest.mark.parametrize("mode", ["error", "warn", "ignore"])
def test_score_none_never_evicts_and_follows_check_mode(mode):
    coll, t = full_bucket("none", check_mode=mode)
    one(coll, {"f": [[10, 20, 30, 40]]})
    kjt = JaggedBatch.from_lists({"f": [[50, 10]]})
    if mode == "error":
        with pytest.raises(TableFullError, match="table 'd': 1 new key"):
            coll(kjt)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = coll(kjt)
    assert (len(caught) == 1) == (mode == "warn")
    assert keys_present(t, [10, 20, 30, 40, 50]) == [10, 20, 30, 40]
    assert t.dropped_keys == 1
    w10 = t.read_rows(torch.tensor([10]))["weight"][0]
    torch.testing.assert_close(out["f"][0].detach(), w10)  # 50 contributes the eval initializer, 0


def test_score_none_default_check_mode_is_error():
    assert dynamic(score_strategy="none").dynamic.check_mode == "error"
    assert dynamic(score_strategy="step").dynamic.check_mode == "warn"


# -- capacity -------------------------------------------------------------------------------------


def test_growth_preserves_rows_bit_exactly_and_stops_at_max_capacity():
    coll = EmbeddingCollection(
        [dynamic(init_capacity=8, max_capacity=64, bucket_size=4)], Adagrad(lr=0.1, initial_accumulator_value=0.1)
    )
    t = coll.tables["d"]
    one(coll, {"f": [[1, 2, 3], [4]]})
    keys = torch.tensor([1, 2, 3, 4])
    snapshot = t.read_rows(keys)
    assert t.capacity == 8
    one(coll, {"f": [list(range(100, 110))]})  # 14 keys > 0.75 * 8: grows
    assert t.capacity > 8
    grown = t.read_rows(keys)
    for k in snapshot:
        assert torch.equal(grown[k], snapshot[k]), k
    with pytest.warns(UserWarning, match="136 new key"):  # 210 keys in one step, 64 slots, all pinned
        one(coll, {"f": [list(range(1000, 1200))]})
    assert t.capacity == 64 and t.size <= 64


def test_an_abandoned_forward_is_settled_by_the_next_backward():
    coll = EmbeddingCollection([dynamic(init_capacity=8, max_capacity=64, bucket_size=4)], SGD(lr=0.1))
    t = coll.tables["d"]
    coll(JaggedBatch.from_lists({"f": [[1, 2]]}))  # a training forward whose backward never runs
    assert len(t.steps.pending) == 1 and bool(pinned(t).any())
    one(coll, {"f": [[3]]})  # the next step's backward settles it
    assert len(t.steps.pending) == 0 and not bool(pinned(t).any())
    one(coll, {"f": [list(range(100, 120))]})
    assert t.capacity > 8 and t.size == 23


def test_no_growth_while_a_backward_is_pending():
    coll = EmbeddingCollection([dynamic(init_capacity=8, max_capacity=64, bucket_size=4)], SGD(lr=0.1))
    t = coll.tables["d"]
    out = coll(JaggedBatch.from_lists({"f": [[1, 2]]}))
    with pytest.warns(UserWarning, match="4 new key"):  # would grow, but out's rows must not move
        coll(JaggedBatch.from_lists({"f": [list(range(100, 110))]}))
    assert t.capacity == 8
    out["f"].sum().backward()


def test_keys_anywhere_in_int64_range():
    coll = EmbeddingCollection([dynamic()], SGD(lr=1.0))
    extremes = [-(2**63), -1, 0, 2**63 - 1, 2**40]
    one(coll, {"f": [extremes]})
    rows = coll.read_rows("d", torch.tensor(extremes))
    assert bool(rows["present"].all())
    assert coll.tables["d"].size == 5


def test_eval_mode_leaves_table_bit_identical():
    coll = EmbeddingCollection([dynamic(eval_initializer=Initializer("constant", value=0.25))], Adam(lr=0.1))
    one(coll, {"f": [[1, 2], [3]]})
    t = coll.tables["d"]
    before = t.dump()
    coll.eval()
    out = coll(JaggedBatch.from_lists({"f": [[1, 99], [98]]}))
    after = t.dump()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    w1 = t.read_rows(torch.tensor([1]))["weight"][0]
    torch.testing.assert_close(out["f"][0], w1 + 0.25)
    torch.testing.assert_close(out["f"][1], torch.full((D,), 0.25))


def test_soak_million_keys_into_bounded_table():
    max_capacity, bucket = 100_000, 16
    coll = EmbeddingCollection(
        [
            TableConfig(
                name="d",
                dim=8,
                features=["f"],
                dynamic=DynamicTableOptions(max_capacity=max_capacity, init_capacity=8192, bucket_size=bucket),
            )
        ],
        SGD(lr=0.0),
    )
    t = coll.tables["d"]
    stream = torch.randperm(1_000_000, generator=torch.Generator().manual_seed(0)).long() * 7_919 - 3_000_000_000
    written = {}
    for i, chunk in enumerate(stream.split(20_000)):
        if i % 2 == 0:  # a training forward inserts (and evicts)
            coll(JaggedBatch(["f"], chunk, torch.ones_like(chunk)))["f"].sum().backward()
        else:  # write_rows inserts and sets known values
            values = chunk.double().remainder(1000.0).float()[:, None].expand(-1, 8).contiguous()
            t.write_rows(chunk, {"weight": values})
            written.update(dict.fromkeys(chunk.tolist(), True))
        assert t.size <= t.capacity <= max_capacity
        assert t.size == int(t.index.occupied.sum())
    # Bytes bound from max capacity: per slot the weight (32 B), key, score (8 + 8 B), the pin (4 B:
    # the id of the step that pinned it) and the tag (1 B: 0 for an empty slot).
    assert t.nbytes <= max_capacity * (8 * 4 + 8 + 8 + 4 + 1)
    assert t.size > 0.9 * t.capacity
    _, keys, _ = t.index.entries()
    rows = t.read_rows(keys)
    assert bool(rows["present"].all())
    from_write = torch.tensor([k in written for k in keys.tolist()])
    expect_written = keys.double().remainder(1000.0).float()[:, None].expand(-1, 8)
    expect_init = t.initial_weights(keys)
    expected = torch.where(from_write[:, None], expect_written, expect_init)
    assert torch.equal(rows["weight"], expected)  # lr 0: every present key reads its last write


# -- admission --------------------------------------------------------------------------------------


def test_admission_threshold_counts_occurrences(backend):
    adm = AdmissionConfig(threshold=3, initializer=Initializer("constant", value=0.5))
    coll = EmbeddingCollection([dynamic(backend=backend, admission=adm)], SGD(lr=1.0))
    t = coll.tables["d"]
    out = one(coll, {"f": [[7, 7], [8]]})  # 7 seen twice, 8 once: no rows
    assert t.size == 0
    torch.testing.assert_close(out["f"].detach(), torch.tensor([[1.0] * D, [0.5] * D]))
    dump = t.dump()
    assert dump["admission_keys"].tolist() == [7, 8] and dump["admission_counts"].tolist() == [2, 1]
    coll(JaggedBatch.from_lists({"f": [[7]]}))  # third sighting: created in this step...
    row = t.read_rows(torch.tensor([7]))
    assert bool(row["present"][0])
    w0 = row["weight"][0].clone()
    coll(JaggedBatch.from_lists({"f": [[7]]}))["f"].sum().backward()  # ...and updated from then on
    torch.testing.assert_close(t.read_rows(torch.tensor([7]))["weight"][0], w0 - 1.0)
    assert t.dump()["admission_keys"].tolist() == [8]


def test_admitted_key_is_updated_in_the_step_it_is_admitted():
    coll = EmbeddingCollection([dynamic(admission=AdmissionConfig(threshold=2))], SGD(lr=1.0))
    t = coll.tables["d"]
    one(coll, {"f": [[5]]}, backward=False)
    coll.train()
    out = coll(JaggedBatch.from_lists({"f": [[5]]}))
    w0 = t.read_rows(torch.tensor([5]))["weight"][0].clone()
    out["f"].sum().backward()
    torch.testing.assert_close(t.read_rows(torch.tensor([5]))["weight"][0], w0 - 1.0)


# -- dump and load ----------------------------------------------------------------------------------


def trained_table(spec=None, **kw):
    coll = EmbeddingCollection([dynamic(**kw)], spec or Adam(lr=0.1))
    rng = np.random.default_rng(0)
    for _ in range(5):
        one(coll, {"f": zipf_batch(rng, 8, 5, 200)})
    return coll.tables["d"]


def test_dump_load_round_trip_bit_exact_any_larger_capacity(backend):
    spec = RowWiseAdagrad(lr=0.1, initial_accumulator_value=0.1)
    src = trained_table(
        spec, backend=backend, max_capacity=256, init_capacity=32, admission=AdmissionConfig(threshold=2)
    )
    dump = src.dump()
    for cap in (256, 1024):
        coll = EmbeddingCollection(
            [dynamic(backend=backend, max_capacity=cap, init_capacity=32, admission=AdmissionConfig(threshold=2))], spec
        )
        dst = coll.tables["d"]
        assert dst.load(dump) == {"loaded": dump["keys"].numel(), "dropped": 0, "admission_dropped": 0}
        again = dst.dump()
        for k in dump:
            assert torch.equal(dump[k], again[k]), k


def test_load_into_smaller_capacity_keeps_highest_scores():
    src = trained_table(max_capacity=256, score_strategy="lfu")
    dump = src.dump()
    n = dump["keys"].numel()
    assert n > 16
    coll = EmbeddingCollection([dynamic(max_capacity=16, bucket_size=16)], Adam(lr=0.1))
    report = coll.tables["d"].load(dump)
    assert report == {"loaded": 16, "dropped": n - 16, "admission_dropped": 0}
    kept = coll.tables["d"].dump()
    order = torch.argsort(-dump["scores"], stable=True)[:16]  # keys ascend in a dump: ties -> smaller key
    assert sorted(kept["keys"].tolist()) == sorted(dump["keys"][order].tolist())
    idx = torch.searchsorted(dump["keys"], kept["keys"])
    for k in ("weight", "momentum1", "momentum2", "scores"):
        assert torch.equal(kept[k], dump[k][idx])


def test_load_weights_only_resets_states():
    src = trained_table(Adagrad(lr=0.1, initial_accumulator_value=0.1))
    dump = src.dump()
    coll = EmbeddingCollection([dynamic()], Adagrad(lr=0.1, initial_accumulator_value=0.1))
    t = coll.tables["d"]
    t.load(dump, weights_only=True)
    got = t.dump()
    assert torch.equal(got["weight"], dump["weight"])
    assert torch.equal(got["momentum1"], torch.full_like(dump["momentum1"], 0.1))
    assert int(got["step"]) == 0 and int(dump["step"]) == 5


def test_report():
    t = trained_table(max_capacity=256, init_capacity=64)
    r = t.report()
    assert r["size"] == t.size and r["capacity"] == t.capacity and r["max_capacity"] == 256
    assert r["load_factor"] == pytest.approx(r["size"] / r["capacity"])
    assert r["bytes"] == t.nbytes > 0


def test_deterministic_and_independent_of_insertion_order():
    keys = list(range(-50, 50, 3))
    a = EmbeddingCollection([dynamic(init_capacity=8, max_capacity=512)], SGD(lr=0.1))
    b = EmbeddingCollection([dynamic(init_capacity=8, max_capacity=512)], SGD(lr=0.1))
    one(a, {"f": [keys]}, backward=False)
    for k in reversed(keys):
        one(b, {"f": [[k]]}, backward=False)
    da, db = a.tables["d"].dump(), b.tables["d"].dump()
    assert torch.equal(da["keys"], db["keys"]) and torch.equal(da["weight"], db["weight"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("strategy", ["step", "timestamp", "lfu"])
def test_scores_of_touched_rows_whoever_writes_them(backend, strategy):
    """The eviction score of each touched row after a step, whether the fused update wrote it
    (native store, a backward ran) or the commit did (FBGEMM store, ``lfu``, a forward whose
    backward never ran, a no-grad training forward): ``step`` = the step, ``timestamp`` = the
    forward's clock, ``lfu`` += occurrences."""
    coll = EmbeddingCollection([dynamic(backend=backend, score_strategy=strategy)], Adagrad(lr=0.1))
    t = coll.tables["d"]

    def scores() -> dict[int, int]:
        dump = t.dump()
        return dict(zip(dump["keys"].tolist(), dump["scores"].tolist()))

    start = time.time_ns() // 1000
    one(coll, {"f": [[1, 2], [2, 3]]})  # step 1, backward
    coll(JaggedBatch.from_lists({"f": [[3, 4]]}))  # step 2, abandoned: settled by step 3's backward
    one(coll, {"f": [[5]]})  # step 3
    one(coll, {"f": [[6, 6]]}, backward=False)  # step 4, no grad: committed at once
    one(coll, {"f": [[1]]})  # step 5
    end = time.time_ns() // 1000
    got = scores()
    if strategy == "step":
        assert got == {1: 5, 2: 1, 3: 2, 4: 2, 5: 3, 6: 4}
    elif strategy == "lfu":
        assert got == {1: 2, 2: 2, 3: 2, 4: 1, 5: 1, 6: 2}
    else:
        assert all(start <= v <= end for v in got.values())
        assert got[2] <= got[3] == got[4] <= got[5] <= got[6] <= got[1]  # forwards in clock order


def test_scores_follow_the_commit_order_whatever_order_backwards_run_in():
    """Two steps pending, sharing a key: the later step's score stays, whether one backward runs
    through both lookups (autograd runs the later one first, and its commit settles the earlier
    step) or the earlier step's backward runs after the later one's. (The native store: its
    update writes the scores. FBGEMM's TBE refuses one backward through two of its lookups, whose
    saved weights the first update changed in place; its scores are written at commit.)"""
    coll = EmbeddingCollection([dynamic(init_capacity=64)], Adagrad(lr=0.1))
    t = coll.tables["d"]
    out1 = coll(JaggedBatch.from_lists({"f": [[1, 2]]}))["f"]  # step 1
    out2 = coll(JaggedBatch.from_lists({"f": [[2, 3]]}))["f"]  # step 2
    (out1.sum() + out2.sum()).backward()
    out3 = coll(JaggedBatch.from_lists({"f": [[4, 5]]}))["f"]  # step 3
    out4 = coll(JaggedBatch.from_lists({"f": [[5, 6]]}))["f"]  # step 4
    out4.sum().backward()  # commits step 3, then step 4
    out3.sum().backward()  # step 3's own backward, late: it updates its rows, but no score
    dump = t.dump()
    assert dict(zip(dump["keys"].tolist(), dump["scores"].tolist())) == {1: 1, 2: 2, 3: 2, 4: 3, 5: 4, 6: 4}


def test_write_rows_is_refused_while_a_training_step_is_pending():
    """A growth would move the rows the pending step's backward updates."""
    from dynarec.embedding.step import StepPendingError

    coll = EmbeddingCollection([dynamic(init_capacity=8, max_capacity=64, bucket_size=4)], SGD(lr=0.1))
    out = coll(JaggedBatch.from_lists({"f": [[1, 2]]}))
    keys = torch.arange(100, 130)
    with pytest.raises(StepPendingError, match="write_rows while a training step is pending"):
        coll.write_rows("d", keys, {"weight": torch.ones(30, D)})
    out["f"].sum().backward()
    coll.write_rows("d", keys, {"weight": torch.ones(30, D)})
    assert coll.tables["d"].capacity > 8 and bool(coll.read_rows("d", keys)["present"].all())


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"weight": torch.ones(8, D - 1)}, r"'weight' must have shape \(8, 4\), got \(8, 3\)"),
        ({"wieght": torch.ones(8, D)}, r"unknown row field 'wieght'"),
        ({"weight": torch.ones(7, D)}, r"'weight' must have shape \(8, 4\), got \(7, 4\)"),
    ],
)
def test_a_refused_write_rows_inserts_no_key_and_evicts_no_row(bad, message):
    """The new keys of a write were inserted before its values were checked: a refused write left
    them in the table with fresh rows, and at max_capacity evicted the trained rows for them (8
    trained keys gone, 8 keys never written in their place)."""
    coll = EmbeddingCollection([dynamic(max_capacity=8, bucket_size=4, spec=Adagrad(lr=0.1))], SGD(lr=0.1))
    t = coll.tables["d"]
    for k in range(8):
        coll(JaggedBatch.from_lists({"f": [[k]]}))["f"].sum().backward()
    before = t.dump()
    with pytest.raises(ValueError, match="table 'd': write_rows: " + message):
        coll.write_rows("d", torch.arange(100, 108), bad)
    after = t.dump()
    assert all(torch.equal(before[k], after[k]) for k in before) and t.report()["evicted_keys"] == 0


def test_write_rows_of_what_read_rows_returned_writes_the_present_rows_alone():
    """read_rows adds ``present``; writing its result back was refused ("unknown row field
    'present'"), and writing it without ``present`` created the absent keys with zero rows. Now
    the mask says which rows to write: a read-modify-write round trip creates no key."""
    coll = EmbeddingCollection([dynamic(max_capacity=64, spec=Adagrad(lr=0.1))], SGD(lr=0.1))
    t = coll.tables["d"]
    coll.write_rows("d", torch.tensor([5]), {"weight": torch.ones(1, D), "momentum1": torch.full((1, D), 0.5)})
    ids = torch.tensor([7, 5, 9])
    rows = coll.read_rows("d", ids)
    assert rows["present"].tolist() == [False, True, False]
    coll.write_rows("d", ids, rows)
    assert t.size == 1 and all(torch.equal(coll.read_rows("d", ids)[k], v) for k, v in rows.items())
    rows["weight"] = rows["weight"] * 2
    coll.write_rows("d", ids, rows)
    assert t.size == 1 and coll.read_rows("d", torch.tensor([5]))["weight"].tolist() == [[2.0] * D]
    assert coll.read_rows("d", torch.tensor([5]))["momentum1"].tolist() == [[0.5] * D]
    with pytest.raises(ValueError, match=r"table 'd': write_rows' present must be \[3\] bool"):
        coll.write_rows("d", ids, {**rows, "present": torch.ones(3)})
    with pytest.raises(ValueError, match=r"table 'd': write_rows: 'weight' must have shape \(3, 4\), got \(2, 4\)"):
        coll.write_rows("d", ids, {**rows, "weight": rows["weight"][:2]})


@pytest.mark.parametrize("grow", [True, False], ids=["growth", "cuckoo-move"])
def test_write_rows_of_present_and_new_keys_lands_every_value_in_its_key_row(grow):
    """Inserting the new keys of a write may move present keys' rows (a growth rehashes them all; a
    cuckoo step moves one to its other bucket): every key still reads the value written for it."""
    if grow:
        coll = EmbeddingCollection([dynamic(init_capacity=8, max_capacity=256, bucket_size=4)], SGD(lr=0.1))
        present = torch.arange(1, 6)
        new = torch.arange(100, 140)
    else:
        coll = EmbeddingCollection([dynamic(max_capacity=8, bucket_size=2)], SGD(lr=0.1))
        r0, r1, r2, r3, k = keys_with_buckets(4, [(0, 2), (0, 1), (1, 0), (1, 0), (0, 1)])
        present, new = torch.tensor([r0, r1, r2, r3]), torch.tensor([k])
    t = coll.tables["d"]
    coll.write_rows("d", present, {"weight": torch.zeros(present.numel(), D)})
    before = (t.capacity, t.report()["moved_keys"])
    keys = torch.cat([present, new])
    values = keys.float()[:, None].expand(-1, D).contiguous()
    coll.write_rows("d", keys, {"weight": values})
    assert (t.capacity > before[0]) if grow else (t.report()["moved_keys"] > before[1])
    rows = coll.read_rows("d", keys)
    assert bool(rows["present"].all()) and torch.equal(rows["weight"], values)


def test_a_growth_moves_keys_its_first_rounds_left_out_to_their_other_bucket():
    """A growth rehashes keys by score in free-slot rounds, which leave keys out (a round's keys all
    choose from its start's free counts: here x and y, whose one bucket k2 and k3 took); the keys
    placed are then residents that move to their other bucket to make room: nothing is lost."""
    coll = EmbeddingCollection([dynamic(init_capacity=8, max_capacity=16, bucket_size=2)], SGD(lr=0.1))
    t = coll.tables["d"]
    # Under 8 buckets (and so under 4): x, y only in bucket 1; k1 in 0 or 1; k2, k3 in 1 or 2.
    x, y, k1, k2, k3 = keys_with_buckets(8, [(1, 1), (1, 1), (0, 1), (1, 2), (1, 2)])
    for keys in ([x, y], [k1, k2, k3]):  # step 1, then step 2 (higher scores)
        coll(JaggedBatch.from_lists({"f": [keys]}))["f"].sum().backward()
    assert t.capacity == 8 and t.size == 5
    old = torch.tensor([x, y, k1, k2, k3])
    before = t.read_rows(old)["weight"]
    z1, z2 = keys_with_buckets(8, [(5, 6), (6, 7)], start=1 << 20)  # 7 keys > 0.75 * 8 slots: it grows to 16
    coll(JaggedBatch.from_lists({"f": [[z1, z2]]}))
    assert t.capacity == 16 and t.evicted_keys == 0 and t.size == 7
    rows = t.read_rows(old)
    assert bool(rows["present"].all()) and torch.equal(rows["weight"], before)
    assert sorted(int(s) // 2 for s in t.index.find(torch.tensor([k2, k3]))) == [2, 2]  # both moved
    check_invariants(t.index)


def test_a_key_a_growth_at_max_capacity_drops_reads_the_initializer_and_gets_no_update():
    """A growth into max_capacity can still drop a key that only a chain of two moves would place
    (one-slot buckets, 4 -> 8: y's one bucket 0 holds k2, whose other bucket holds k3). When the key
    is in the step that grew the table, its occurrences have no row: they read the eval
    initializer, and the step updates every other row (none at a slot -1)."""
    options = dict(init_capacity=4, max_capacity=8, bucket_size=1, growth_load_factor=1.0)
    coll = EmbeddingCollection([dynamic(**options)], SGD(lr=0.1))
    t = coll.tables["d"]
    y, k1, k2, k3, z = 39242, 396330, 210143, 363784, 1103835
    # Candidate buckets under 8: y (0, 0), k1 (2, 0), k2 (0, 3), k3 (3, 5), z (4, 6).
    assert candidate_buckets(torch.tensor([y, k1, k2, k3, z]), 8)[0].tolist() == [0, 2, 0, 3, 4]
    for k in (y, k1, k2, k3):  # one step each: y has the lowest score
        coll(JaggedBatch.from_lists({"f": [[k]]}))["f"].sum().backward()
    assert t.capacity == 4 and t.size == 4
    before = t.read_rows(torch.tensor([k1]))["weight"]
    out = coll(JaggedBatch.from_lists({"f": [[y], [z], [k1]]}))["f"]  # z: 5 keys > 4 slots: it grows to 8
    assert t.capacity == 8 and t.evicted_keys == 1
    assert not bool(t.read_rows(torch.tensor([y]))["present"].any())
    assert torch.equal(out[0].detach(), torch.zeros(D))  # y reads the eval initializer (zeros)
    out.sum().backward()
    rows = t.read_rows(torch.tensor([k1, k2, k3, z]))
    assert bool(rows["present"].all()) and not torch.equal(rows["weight"][0], before[0])  # k1 was updated


def test_write_rows_into_a_full_table_that_evicts_nothing_says_so():
    """score_strategy 'none': the write's bucket is full of other keys' rows, which nothing
    evicts (the message said the write's own rows filled it, and to write fewer keys at once)."""
    coll = EmbeddingCollection([dynamic(max_capacity=4, bucket_size=4, score_strategy="none")], SGD(lr=0.1))
    coll.write_rows("d", torch.arange(4), {"weight": torch.ones(4, D)})
    with pytest.raises(
        TableFullError,
        match=r"place 1 of its new key\(s\) \(max_capacity 4; their buckets are full, "
        r"and score_strategy 'none' evicts no row\); nothing was written: raise max_capacity",
    ):
        coll.write_rows("d", torch.tensor([99]), {"weight": torch.ones(1, D)})
    assert coll.tables["d"].size == 4


@pytest.mark.parametrize("own", [True, False], ids=["full-of-its-own-rows", "room-by-evicting"])
def test_write_rows_at_max_capacity_never_evicts_its_own_keys(own):
    """At max_capacity a write's new key evicts a row of another key, never one of the same write's
    keys (its rows are pinned while it inserts). When a new key finds only the write's own rows,
    the write is refused whole, before any row changes: here f could have evicted c or d, and
    it does not (the default check_mode, 'warn', would let a training step go on)."""
    coll = EmbeddingCollection([dynamic(max_capacity=4, bucket_size=2)], SGD(lr=0.1))
    t = coll.tables["d"]
    a, b, c, d, e, f, g = keys_with_buckets(2, [(0, 0), (0, 0), (1, 1), (1, 1), (0, 0), (1, 1), (0, 1)])
    full = torch.tensor([a, b, c, d])
    coll.write_rows("d", full, {"weight": torch.arange(4.0)[:, None].expand(4, D)})
    assert t.size == 4
    if own:
        with pytest.raises(TableFullError, match=r"write_rows could not place 1 of its new key.*nothing was written"):
            coll.write_rows("d", torch.tensor([a, b, e, f]), {"weight": torch.ones(4, D)})
        rows = coll.read_rows("d", torch.tensor([a, b, c, d, e, f]))
        assert rows["present"].tolist() == [True] * 4 + [False] * 2
        assert torch.equal(rows["weight"][:4], torch.arange(4.0)[:, None].expand(4, D))
        assert t.evicted_keys == 0 and t.dropped_keys == 0
        return
    coll.write_rows("d", torch.tensor([a, g]), {"weight": torch.full((2, D), 9.0)})  # b, c, d: one goes
    rows = coll.read_rows("d", torch.tensor([a, g, b, c, d]))
    assert rows["present"][:2].all() and int(rows["present"][2:].sum()) == 2 and t.evicted_keys == 1
    assert torch.equal(rows["weight"][:2], torch.full((2, D), 9.0))


@pytest.mark.parametrize("follow_moves", [torch.ops.dynarec.follow_moves, reference.follow_moves])
def test_slots_follow_a_plans_cuckoo_moves(follow_moves):
    slots = torch.tensor([5, -1, 7, 5, 2, 9, 0])
    got = follow_moves(slots, torch.tensor([9, 5]), torch.tensor([12, 3]))
    assert torch.equal(got, torch.tensor([3, -1, 7, 3, 2, 12, 0]))


@pytest.mark.parametrize(
    "spec, field, value, message",
    [
        (Adagrad(lr=0.1), "momentum1", -1.0, r"'momentum1' holds -1.0 in row 2 .* at least 0 \(a sum of squares\)"),
        (Adagrad(lr=0.1), "weight", float("nan"), r"'weight' holds nan in row 2 .* must be a finite number$"),
        (Adam(lr=0.1), "momentum2", -0.5, r"'momentum2' holds -0.5 in row 2"),
        (Adam(lr=0.1), "momentum1", float("inf"), r"'momentum1' holds inf in row 2"),
        (RowWiseAdagrad(lr=0.1), "momentum1", float("-inf"), r"'momentum1' holds -inf in row 2"),
    ],
)
@pytest.mark.parametrize("kind", ["fixed", "dynamic"])
def test_write_rows_refuses_values_a_step_would_turn_into_nan(spec, field, value, message, kind):
    """A negative accumulator (its square root is NaN) or a non-finite weight or state was
    written as given, and the next step trained the row into NaN."""
    if kind == "dynamic":
        table = dynamic(max_capacity=64, spec=spec)
    else:
        table = TableConfig(name="x", dim=D, num_embeddings=64, features=["f"], optimizer=spec, initializer=INIT)
    coll = EmbeddingCollection([table], SGD(lr=0.1))
    name = next(iter(coll.tables))
    rows = {k: v.clone() for k, v in coll.read_rows(name, torch.arange(4)).items() if k != "present"}
    rows[field][2, 0] = value
    before = coll.tables[name].dump()
    with pytest.raises(ValueError, match=f"table '{name}': write_rows: " + message):
        coll.write_rows(name, torch.arange(4), rows)
    after = coll.tables[name].dump()
    assert all(torch.equal(before[k], after[k]) for k in before)
    rows[field][2, 0] = 0.0
    coll.write_rows(name, torch.arange(4), rows)  # (the same rows, good)
