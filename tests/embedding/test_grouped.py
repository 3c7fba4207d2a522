"""Table batching: fixed tables of one optimizer spec share a row store and one lookup a step
(TableGroup): tables of one dim on any device, tables of several dims packed end to end where the
Triton kernels run (a GPU; the CPU under Triton's interpreter, whose lane runs this file too).
Grouped and per-table collections give the same outputs, weights and states (bit for bit on the
CPU's kernels), for every optimizer and pooling, and a step is one fused update per group."""

import pytest
import torch

from dynarec import DynamicTableOptions, EmbeddingCollection, FeatureConfig, JaggedBatch, TableConfig
from dynarec.embedding.config import AdmissionConfig
from dynarec.embedding.initializers import Initializer
from dynarec.embedding.jagged import split_features
from dynarec.kernels.ops import packs_rows
from dynarec.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from tests.matrix import DEVICES, needs_fbgemm

SPECS = [
    SGD(lr=0.3),
    Adagrad(lr=0.2, initial_accumulator_value=0.1),
    RowWiseAdagrad(lr=0.2, weight_decay=0.1, weight_decay_mode="l2"),
    RowWiseAdagrad(lr=0.2, weight_decay=0.1, weight_decay_mode="decoupled"),
    Adam(lr=0.05, weight_decay=0.01),
]


def tables():
    """Three fixed tables of dim 8 (one group; one of them serves a pooled feature and a sequence),
    a fixed table of dim 4 (in the group where rows of several dims are packed), a dynamic table
    of dim 8 (never in a group), mean pooling on one."""
    return [
        TableConfig(name="a", dim=8, num_embeddings=50, features=["fa", FeatureConfig("sa", pooling="none")]),
        TableConfig(name="b", dim=8, num_embeddings=7, features=["fb"], pooling="mean"),
        TableConfig(name="c", dim=8, num_embeddings=300, features=["fc"]),
        TableConfig(name="d", dim=4, num_embeddings=20, features=["fd"]),
        TableConfig(name="u", dim=8, dynamic=DynamicTableOptions(256), features=["fu"]),
    ]


ROWS = {"fa": 50, "sa": 50, "fb": 7, "fc": 300, "fd": 20, "fu": 1 << 40}


def batch(g, size, weighted):
    lists, weights = {}, {}
    for name, rows in ROWS.items():
        lengths = torch.randint(0, 4, (size,), generator=g)
        lists[name] = [torch.randint(0, min(rows, 1 << 31), (int(n),), generator=g).tolist() for n in lengths]
        weights[name] = [torch.rand(int(n), generator=g).tolist() for n in lengths]
    return JaggedBatch.from_lists(lists, weights if weighted else None)


def run(coll, batches, device):
    outs = []
    for kjt in batches:
        out = coll(kjt.to(device))
        loss = sum((v * torch.arange(v.numel(), device=device).view_as(v).sin()).sum() for v in out.values())
        loss.backward()
        outs.append({k: v.detach().cpu() for k, v in out.items()})
    return outs


def assert_same(a, b, exact=True):
    """Bit for bit on the CPU, where each row's gradient is summed in occurrence order. On a GPU
    the update kernel splits long runs of a row across blocks by position, so a group's other
    tables change how a row's sum is associated: equal to the tolerance policy's 1e-5 there."""
    for name in a.tables:
        da, db = a.tables[name].dump(), b.tables[name].dump()
        assert da.keys() == db.keys()
        for field in da:
            if exact or not da[field].is_floating_point():
                assert torch.equal(da[field], db[field]), (name, field)
            else:
                torch.testing.assert_close(da[field], db[field], rtol=1e-5, atol=1e-6, msg=f"{name}.{field}")


def assert_outputs(x, y, exact):
    assert x.keys() == y.keys()
    for k in x:
        if exact:
            assert torch.equal(x[k], y[k]), k
        else:
            torch.testing.assert_close(x[k], y[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS, ids=repr)
@pytest.mark.parametrize("weighted", [False, True])
def test_grouped_tables_equal_tables_looked_up_apart(device, spec, weighted):
    g = torch.Generator().manual_seed(0)
    batches = [batch(g, 33, weighted) for _ in range(4)]
    grouped = EmbeddingCollection(tables(), spec, device=device)
    apart = EmbeddingCollection(tables(), spec, device=device, group_tables=False)
    packed = packs_rows(torch.device(device))
    assert grouped.lookup_groups == ([("a", "b", "c", "d")] if packed else [("a", "b", "c"), ("d",)]) + [("u",)]
    assert apart.lookup_groups == [("a",), ("b",), ("c",), ("d",), ("u",)]
    exact = device == "cpu" and not packed
    for x, y in zip(run(grouped, batches, device), run(apart, batches, device)):
        assert_outputs(x, y, exact)
    assert_same(grouped, apart, exact)
    grouped.eval()
    apart.eval()
    with torch.no_grad():
        assert_outputs(grouped(batches[0].to(device)), apart(batches[0].to(device)), exact)


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_of_a_group_is_one_fused_update(device, monkeypatch):
    from dynarec.optim import fused

    calls = []
    real = fused.fused_bag_update

    def counted(spec, **kw):
        calls.append(kw["weight"].shape[0])
        return real(spec, **kw)

    monkeypatch.setattr("dynarec.embedding.row_store.fused_bag_update", counted)
    coll = EmbeddingCollection(tables(), Adagrad(lr=0.1), device=device)
    run(coll, [batch(torch.Generator().manual_seed(1), 9, False)], device)
    if packs_rows(torch.device(device)):  # one update of the packed rows (weight: every element)
        assert sorted(calls) == sorted([(50 + 7 + 300) * 8 + 20 * 4, coll.tables["u"].capacity])
    else:
        assert sorted(calls) == sorted([50 + 7 + 300, 20, coll.tables["u"].capacity])


def test_tables_of_a_group_keep_their_own_rows_learning_rates_and_step_counters():
    """A table given its own learning rate, or loaded from another run's dump (another step
    counter), is looked up apart for the steps where it differs — the same results as tables
    never grouped."""
    g = torch.Generator().manual_seed(2)
    batches = [batch(g, 17, True) for _ in range(3)]
    spec = Adam(lr=0.05)
    colls = [EmbeddingCollection(tables(), spec), EmbeddingCollection(tables(), spec, group_tables=False)]
    donor = EmbeddingCollection(tables(), spec)
    run(donor, batches[:2], "cpu")
    for coll in colls:
        coll.set_learning_rate(0.01, table="b")
        coll.tables["c"].load(donor.tables["c"].dump())  # step counter 2, the others 0
        run(coll, batches, "cpu")
    assert colls[0].tables["c"].step == 5 and colls[0].tables["a"].step == 3
    assert_same(*colls)
    # Rows by table: a write to one table's row leaves its neighbours in the shared store alone.
    coll = colls[0]
    before = {n: coll.tables[n].dump() for n in ("a", "c")}
    coll.write_rows("b", torch.tensor([0, 6]), {"weight": torch.full((2, 8), 7.0)})
    assert torch.equal(coll.read_rows("b", torch.tensor([6]))["weight"], torch.full((1, 8), 7.0))
    for n in ("a", "c"):
        assert all(torch.equal(before[n][k], v) for k, v in coll.tables[n].dump().items())
    with pytest.raises(ValueError, match=r"table 'b', read_rows: id 7 is out of range \[0, 7\)"):
        coll.read_rows("b", torch.tensor([7]))


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_a_group_updates_every_row_its_step_looked_up_even_of_a_table_outside_the_loss(spec):
    """A step whose loss leaves out a table's features: a table alone gets no backward (its rows
    stay), a group's one update reaches every row the step looked up with a zero gradient (as
    FBGEMM TBE and torchrec, whose outputs are one tensor, do). That moves a row only where a zero
    gradient does: Adam's moments, weight decay; SGD and Adagrad train as apart, bit for bit."""
    g = torch.Generator().manual_seed(4)
    batches = [batch(g, 9, False) for _ in range(2)]
    grouped, apart = EmbeddingCollection(tables(), spec), EmbeddingCollection(tables(), spec, group_tables=False)
    assert ("a", "b", "c") in grouped.lookup_groups
    for coll in (grouped, apart):
        run(coll, batches[:1], "cpu")
        out = coll(batches[1])
        sum(v.sum() for k, v in out.items() if k != "fb").backward()  # table b's feature left out
    rows = split_features(batches[1])["fb"].values.unique()
    moved = grouped.tables["b"].dump()["weight"][rows] != apart.tables["b"].dump()["weight"][rows]
    if isinstance(spec, (SGD, Adagrad)):
        assert_same(grouped, apart)
    else:
        assert moved.any(dim=1).all()
        for name in ("a", "c", "d", "u"):
            assert all(torch.equal(v, apart.tables[name].dump()[k]) for k, v in grouped.tables[name].dump().items())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group_tables", [True, False])
def test_per_sample_weights_that_require_grad_get_their_gradient(device, group_tables):
    """d loss / d w_i = <d loss / d out[bag(i)], row(i)> (over L under mean pooling), the rows as
    the forward read them, for pooled and sequence features, fixed and dynamic tables, grouped
    (rows of several dims packed where the device packs them) or not: torchrec's position-weighted
    features learn their weights by it. The native lookup's backward returned none."""
    g = torch.Generator().manual_seed(9)
    plain = batch(g, 6, True)
    coll = EmbeddingCollection(tables(), SGD(lr=0.1), device=device, group_tables=group_tables)
    run(coll, [plain], device)  # the dynamic table's keys have rows from here on
    kjt = plain.to(device)
    weights = kjt.weights_or_none().clone().requires_grad_()
    out = coll(JaggedBatch(kjt.keys(), kjt.values(), kjt.lengths(), weights))
    reference_weights = weights.detach().clone().requires_grad_()
    reference, start = {}, 0
    for name, s in split_features(kjt).items():
        table = coll.table_of(name)
        pooling = table.config.pooling_of(next(f for f in table.features if f.name == name))
        rows = table.read_rows(s.values)["weight"].float()
        w = reference_weights[start : start + s.num_ids]
        start += s.num_ids
        each = rows * w[:, None]
        bag = torch.repeat_interleave(torch.arange(s.lengths.numel(), device=device), s.lengths)
        if pooling == "none":
            padded = torch.zeros(s.lengths.numel(), max(s.max_length, 0), table.dim, device=device)
            position = torch.arange(s.num_ids, device=device) - (s.lengths.cumsum(0) - s.lengths)[bag]
            reference[name] = padded.index_put((bag, position), each)
        else:
            if pooling == "mean":
                each = each / s.lengths[bag][:, None]
            reference[name] = torch.zeros(s.lengths.numel(), table.dim, device=device).index_add(0, bag, each)
    for name, v in reference.items():
        torch.testing.assert_close(out[name].detach(), v.detach(), rtol=1e-5, atol=1e-6, msg=name)
    for values in (out, reference):
        sum((v * torch.arange(v.numel(), device=device).view_as(v).sin()).sum() for v in values.values()).backward()
    assert weights.grad is not None
    torch.testing.assert_close(weights.grad, reference_weights.grad, rtol=1e-5, atol=1e-5)


PACKED_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.skipif(
    not packs_rows(torch.device(PACKED_DEVICE)),
    reason="rows of several dims are packed where the Triton kernels run (a GPU; the CPU under Triton's interpreter)",
)
@pytest.mark.parametrize("spec", [SPECS[1], SPECS[2], SPECS[4]], ids=repr)
def test_fixed_tables_of_several_dims_share_one_packed_lookup(spec):
    """Fixed tables of dims 8, 8, 8, 4 and 12 (sequence and mean-pooled features among them): one
    lookup unit, the same outputs, rows and states as each table apart (to the GPU tolerance),
    each feature's output of its own table's dim; training and evaluation."""
    device = PACKED_DEVICE
    configs = [t for t in tables() if t.kind == "fixed"] + [
        TableConfig(name="e", dim=12, num_embeddings=11, features=["fe"], pooling="mean")
    ]
    rows = {**ROWS, "fe": 11}
    g = torch.Generator().manual_seed(4)

    def fixed_batch():
        lists, weights = {}, {}
        for name in ("fa", "sa", "fb", "fc", "fd", "fe"):
            lengths = torch.randint(0, 4, (9,), generator=g)
            lists[name] = [torch.randint(0, rows[name], (int(n),), generator=g).tolist() for n in lengths]
            weights[name] = [torch.rand(int(n), generator=g).tolist() for n in lengths]
        return JaggedBatch.from_lists(lists, weights)

    batches = [fixed_batch() for _ in range(2)]
    grouped = EmbeddingCollection(configs, spec, device=device)
    apart = EmbeddingCollection(configs, spec, device=device, group_tables=False)
    assert grouped.lookup_groups == [("a", "b", "c", "d", "e")]
    for x, y in zip(run(grouped, batches, device), run(apart, batches, device)):
        assert_outputs(x, y, exact=False)
        assert x["fd"].shape == (9, 4) and x["fe"].shape == (9, 12) and x["sa"].shape[2] == 8
        assert x["fd"].is_contiguous() and x["fe"].is_contiguous()
    assert_same(grouped, apart, exact=False)
    grouped.eval()
    apart.eval()
    with torch.no_grad():
        assert_outputs(grouped(batches[0].to(device)), apart(batches[0].to(device)), exact=False)


def test_tables_pack_with_tables_of_their_row_tile_only():
    """Packed, a bag's output is the group's widest dim: tables pack only within one row tile of
    the kernels (dims up to 16, up to 32, ...), so a narrow table never carries a wide one's
    columns; unpacked, tables group by dim."""
    from dynarec.embedding.grouped import group_key

    spec = Adagrad(lr=0.1)

    def key(dim, packs):
        return group_key(TableConfig(name="t", dim=dim, num_embeddings=4, features=["f"]), spec, packs)

    assert key(4, True) == key(16, True) != key(17, True) == key(32, True) != key(64, True)
    assert key(4, False) != key(8, False)


@pytest.mark.parametrize("device", DEVICES)
def test_batches_of_the_same_id_counts_reuse_the_groups_row_shift(device):
    """Batches whose features hold the same number of ids (one a sample: a Criteo-style step)
    take each table's row base from one kept tensor, and look up what tables apart do; batches of
    other counts get their own."""

    def same_counts(g, size):
        lists = {
            n: [[int(torch.randint(0, min(r, 1 << 31), (1,), generator=g))] for _ in range(size)]
            for n, r in ROWS.items()
        }
        return JaggedBatch.from_lists(lists)

    g = torch.Generator().manual_seed(3)
    batches = [same_counts(g, 16) for _ in range(3)] + [batch(g, 16, False)]
    grouped = EmbeddingCollection(tables(), Adagrad(lr=0.1), device=device)
    apart = EmbeddingCollection(tables(), Adagrad(lr=0.1), device=device, group_tables=False)
    exact = device == "cpu" and not packs_rows(torch.device(device))
    for x, y in zip(run(grouped, batches, device), run(apart, batches, device)):
        assert_outputs(x, y, exact)
    assert_same(grouped, apart, exact)
    (group,) = [u for u in grouped._units if hasattr(u, "_shifts")]
    assert len(group._shifts) == 2  # the three batches of one id a sample share one


# -- dynamic tables ------------------------------------------------------------------------------


def dynamic_tables(score_strategy="step", **extra):
    """Dynamic tables of dim 8 and 64 slots that never grow: three in one group (one serves a pooled
    feature and a sequence, one mean-pooled, one with admission); one of 8-slot buckets (on its
    own: a group's tables share one index, of one bucket size); one that grows (on its own); a
    fixed table. Keys from a few hundred: the tables fill, evict and move rows."""

    def options(**kw):
        return DynamicTableOptions(64, score_strategy=score_strategy, **{**extra, **kw})

    return [
        TableConfig(name="p", dim=8, dynamic=options(), features=["fp", FeatureConfig("sp", pooling="none")]),
        TableConfig(name="q", dim=8, dynamic=options(), features=["fq"], pooling="mean"),
        TableConfig(name="g", dim=8, dynamic=options(init_capacity=32), features=["fg"]),
        TableConfig(name="m", dim=8, dynamic=options(admission=AdmissionConfig(threshold=2)), features=["fm"]),
        TableConfig(name="x", dim=8, num_embeddings=40, features=["fx"]),
        TableConfig(name="r", dim=8, dynamic=options(bucket_size=8), features=["fr"]),
    ]


DYNAMIC_ROWS = {"fp": 300, "sp": 300, "fq": 90, "fg": 200, "fm": 100, "fx": 40, "fr": 400}


def dynamic_batch(g, size, weighted, rows=DYNAMIC_ROWS):
    lists, weights = {}, {}
    for name, n_rows in rows.items():
        lengths = torch.randint(0, 4, (size,), generator=g)
        keys = [torch.randint(0, n_rows, (int(n),), generator=g) for n in lengths]
        lists[name] = [(k if name == "fx" else k * 7919 - 1000).tolist() for k in keys]  # negative keys too
        weights[name] = [torch.rand(int(n), generator=g).tolist() for n in lengths]
    return JaggedBatch.from_lists(lists, weights if weighted else None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS, ids=repr)
@pytest.mark.parametrize("weighted", [False, True])
def test_dynamic_tables_that_never_grow_share_one_lookup_and_train_as_apart(device, spec, weighted):
    """Three dynamic tables that never grow: one lookup unit, each table its own keys; the same
    outputs, keys, slots, scores, rows, states and counters as the tables looked up apart,
    through inserts, evictions and cuckoo moves; evaluation with absent keys too."""
    g = torch.Generator().manual_seed(5)
    batches = [dynamic_batch(g, 9, weighted) for _ in range(8)]
    grouped = EmbeddingCollection(dynamic_tables(), spec, device=device)
    apart = EmbeddingCollection(dynamic_tables(), spec, device=device, group_tables=False)
    assert grouped.lookup_groups == [("p", "q", "m"), ("g",), ("x",), ("r",)]
    exact = device == "cpu"
    for x, y in zip(run(grouped, batches, device), run(apart, batches, device)):
        assert_outputs(x, y, exact)
    assert_same(grouped, apart, exact)
    for name in ("p", "q", "r"):
        report = grouped.tables[name].report()
        assert report == apart.tables[name].report()
        assert report["evicted_keys"] > 0 and report["dropped_keys"] == 0, (name, report)  # the group's lookup
    grouped.eval()
    apart.eval()
    with torch.no_grad():  # some keys evicted by now: they read the eval initializer
        assert_outputs(grouped(batches[0].to(device)), apart(batches[0].to(device)), exact)
        present = {n: grouped.tables[t].dump()["keys"][:3].tolist() for n, t in (("fp", "p"), ("sp", "p"))}
        present.update({n: grouped.tables[n[1]].dump()["keys"][:2].tolist() for n in ("fq", "fr")})
        kjt = JaggedBatch.from_lists(
            {n: [present.get(n, [])] for n in DYNAMIC_ROWS} | {"fg": [[]], "fm": [[]], "fx": [[1]]}
        )
        assert_outputs(grouped(kjt.to(device)), apart(kjt.to(device)), exact)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [0, 3])
def test_a_batch_without_ids_passes_every_group_in_training_and_evaluation(device, size):
    """A batch of no ids (no samples, or samples whose every feature is empty) through fixed and
    dynamic groups: zeros of each feature's shape, no table changed, and training goes on as the
    tables apart do (a group's find of no keys once returned no flag per table)."""
    empty = JaggedBatch.from_lists({name: [[] for _ in range(size)] for name in DYNAMIC_ROWS})
    g = torch.Generator().manual_seed(8)
    batches = [dynamic_batch(g, 9, False), empty, dynamic_batch(g, 9, False)]
    grouped = EmbeddingCollection(dynamic_tables(), Adagrad(lr=0.1), device=device)
    apart = EmbeddingCollection(dynamic_tables(), Adagrad(lr=0.1), device=device, group_tables=False)
    assert ("p", "q", "m") in grouped.lookup_groups
    exact = device == "cpu"
    outs = run(grouped, batches, device)
    for x, y in zip(outs, run(apart, batches, device)):
        assert_outputs(x, y, exact)
    assert_same(grouped, apart, exact)
    assert outs[1]["fp"].shape == (size, 8) and outs[1]["sp"].shape == (size, 0, 8)
    assert not any(v.any() for v in outs[1].values())
    before = {n: t.dump() for n, t in grouped.tables.items()}
    grouped.eval()
    with torch.no_grad():
        assert not any(v.any() for v in grouped(empty.to(device)).values())
    for name, dump in before.items():
        assert all(torch.equal(v, grouped.tables[name].dump()[k]) for k, v in dump.items()), name


@pytest.mark.parametrize("device", DEVICES)
def test_a_dynamic_group_step_is_one_fused_update_which_writes_the_scores(device, monkeypatch):
    """A group's step is one fused update of its shared store, which writes the touched rows'
    scores in its own pass (a slot of the shared index is a row of the store), as a table alone
    does."""
    from dynarec.optim import fused

    calls = []
    real = fused.fused_bag_update

    def counted(spec, **kw):
        calls.append((kw["weight"].shape[0], kw["row_scores"] is not None))
        return real(spec, **kw)

    monkeypatch.setattr("dynarec.embedding.row_store.fused_bag_update", counted)
    coll = EmbeddingCollection(dynamic_tables(), Adagrad(lr=0.1), device=device)
    run(coll, [dynamic_batch(torch.Generator().manual_seed(6), 9, False)], device)
    assert sorted(calls) == sorted([(3 * 64, True), (64, True), (32, True), (40, False)])
    for name in ("p", "q", "m", "r"):  # scores: the step, at every key the step touched (m: admitted)
        scores = coll.tables[name].dump()["scores"]
        assert scores.numel() and bool((scores == 1).all())


def test_a_dynamic_group_finds_and_inserts_every_tables_keys_at_once(monkeypatch):
    """A training step of a group: one find of every table's keys, their absent keys (positions,
    unique keys, counts) from one AbsentKeys.of_parts pass, and one insert plan, however many of
    its tables insert (on a GPU the host reads of a find and a plan are made once a step for the
    group, not once a table); a table alone takes its own."""
    from dynarec.embedding.dynamic import AbsentKeys
    from dynarec.embedding.hash_index import IndexStorage

    calls = {"of": 0, "of_parts": [], "group_plans": 0}
    of, of_parts = AbsentKeys.of.__func__, AbsentKeys.of_parts.__func__
    plan = IndexStorage.plan_insert

    def count_of(cls, *a):
        calls["of"] += 1
        return of(cls, *a)

    def count_of_parts(cls, keys, slots, parts, num_parts):
        calls["of_parts"].append(num_parts)
        return of_parts(cls, keys, slots, parts, num_parts)

    def count_plans(*a, **kw):
        calls["group_plans"] += 1
        return plan(*a, **kw)

    monkeypatch.setattr(AbsentKeys, "of", classmethod(count_of))
    monkeypatch.setattr(AbsentKeys, "of_parts", classmethod(count_of_parts))
    monkeypatch.setattr(IndexStorage, "plan_insert", count_plans)
    coll = EmbeddingCollection(dynamic_tables(), Adagrad(lr=0.1))
    run(coll, [dynamic_batch(torch.Generator().manual_seed(6), 9, False)], "cpu")
    # the group's 3 tables at once; "g" and "r" alone
    assert calls == {"of": 2, "of_parts": [3], "group_plans": 1}
    only_p = JaggedBatch.from_lists({n: [[]] for n in DYNAMIC_ROWS} | {"fp": [[123456789]]})
    run(coll, [only_p], "cpu")
    assert calls == {"of": 2, "of_parts": [3, 3], "group_plans": 2}  # one table of the group inserting
    coll.tables["q"].write_rows(torch.tensor([424242]), {"weight": torch.ones(1, 8)})  # takes q a step id
    run(coll, [dynamic_batch(torch.Generator().manual_seed(7), 9, False)], "cpu")
    assert calls["group_plans"] == 3  # the group's steps still share one id: still one plan
    assert len({coll.tables[n].steps.last_id for n in ("p", "q", "m")}) == 1


def test_a_dynamic_group_aborts_loads_and_looks_up_apart_where_its_tables_differ():
    """An aborted step leaves every table of the group as before it; a table loaded from another
    run (another step counter) or given its own learning rate is looked up apart for the steps
    where it differs; a dump of another capacity loads at the table's own (it never grows) —
    throughout, the same as tables never grouped."""
    g = torch.Generator().manual_seed(7)
    batches = [dynamic_batch(g, 9, True) for _ in range(4)]
    spec = Adam(lr=0.05)
    grouped = EmbeddingCollection(dynamic_tables(), spec)
    apart = EmbeddingCollection(dynamic_tables(), spec, group_tables=False)
    donor = EmbeddingCollection(
        [TableConfig(name="q", dim=8, dynamic=DynamicTableOptions(32), features=["fq"], pooling="mean")], spec
    )
    run(donor, [dynamic_batch(g, 9, True, {"fq": 90}) for _ in range(2)], "cpu")
    for coll in (grouped, apart):
        run(coll, batches[:1], "cpu")
        before = {n: coll.tables[n].dump() for n in ("p", "q", "r")}
        coll(batches[1])  # a forward whose backward never runs
        coll.abort_step()
        for n in ("p", "q", "r"):
            assert all(torch.equal(before[n][k], v) for k, v in coll.tables[n].dump().items()), n
        coll.tables["q"].load(donor.tables["q"].dump())  # 32 slots' layout, step counter 2
        assert coll.tables["q"].capacity == 64 and coll.tables["q"].step == 2
        coll.set_learning_rate(0.01, table="r")
        run(coll, batches[1:], "cpu")
    assert grouped.tables["q"].step == 5 and grouped.tables["p"].step == 4
    assert_same(grouped, apart)
    fresh = EmbeddingCollection(dynamic_tables(), spec)
    for n, t in grouped.tables.items():
        fresh.tables[n].load(t.dump())
    assert_same(fresh, grouped)


def test_keys_without_a_row_read_their_tables_eval_initializer_within_the_groups_one_lookup(monkeypatch):
    """Batches larger than the tables (keys dropped in training, check_mode ignore), keys not yet
    admitted, and evaluation of unseen keys: each absent key adds its own table's eval initializer (uniform on one, a
    constant on another), weighted, in the group's one lookup a step; bit for bit the tables
    apart."""
    from dynarec.optim import fused

    calls = []
    real = fused.fused_bag_update
    monkeypatch.setattr(
        "dynarec.embedding.row_store.fused_bag_update",
        lambda spec, **kw: calls.append(kw["weight"].shape[0]) or real(spec, **kw),
    )

    def configs():
        out = dynamic_tables(check_mode="ignore", eval_initializer=Initializer("uniform", bound=0.3))
        out[1] = TableConfig(
            name="q",
            dim=8,
            dynamic=DynamicTableOptions(64, check_mode="ignore", eval_initializer=Initializer("constant", value=0.5)),
            features=["fq"],
            pooling="mean",
        )
        return out

    g = torch.Generator().manual_seed(8)
    batches = [dynamic_batch(g, 40, True) for _ in range(3)]
    grouped = EmbeddingCollection(configs(), Adagrad(lr=0.1))
    apart = EmbeddingCollection(configs(), Adagrad(lr=0.1), group_tables=False)
    assert grouped.lookup_groups[0] == ("p", "q", "m")  # m: keys not yet admitted read its initializer
    calls.clear()
    for x, y in zip(run(grouped, batches, "cpu"), run(apart, batches, "cpu")):
        assert_outputs(x, y, exact=True)
    assert calls.count(3 * 64) == 3  # the group's one update a step, keys dropped or not
    assert all(grouped.tables[n].dropped_keys > 0 for n in ("p", "q", "r"))
    assert_same(grouped, apart)
    grouped.eval()
    apart.eval()
    with torch.no_grad():
        unseen = dynamic_batch(torch.Generator().manual_seed(9), 7, True)
        assert_outputs(grouped(unseen), apart(unseen), exact=True)


@pytest.mark.parametrize("device", DEVICES)
def test_a_dynamic_groups_new_rows_get_each_tables_initializer_seed_and_bound(device):
    """A group's new rows are written for all its tables at once (the uniform ones of one bound
    in one op, each table's seed folded into its keys): the same weights and states, bit for bit,
    as each table's own rows; tables of two default bounds (capacities), an explicit bound, a
    seed given, a normal and a constant initializer."""

    def configs():
        def options(capacity=64, **kw):
            return DynamicTableOptions(capacity, score_strategy="step", **kw)

        return [
            TableConfig(name="a", dim=8, dynamic=options(), features=["fa"]),
            TableConfig(name="b", dim=8, dynamic=options(128), features=["fb"]),  # another default bound
            TableConfig(name="c", dim=8, dynamic=options(), features=["fc"], seed=7),
            TableConfig(
                name="d", dim=8, dynamic=options(), features=["fd"], initializer=Initializer("uniform", bound=0.3)
            ),
            TableConfig(
                name="e", dim=8, dynamic=options(), features=["fe"], initializer=Initializer("normal", std=0.2)
            ),
            TableConfig(name="f", dim=8, dynamic=options(128), features=["ff"], seed=7),
            TableConfig(
                name="h", dim=8, dynamic=options(), features=["fh"], initializer=Initializer("constant", value=0.5)
            ),
        ]

    rows = {f: 50 for f in ("fa", "fb", "fc", "fd", "fe", "ff", "fh")}
    g = torch.Generator().manual_seed(9)
    batches = [dynamic_batch(g, 7, True, rows) for _ in range(3)]
    grouped = EmbeddingCollection(configs(), Adagrad(lr=0.1, initial_accumulator_value=0.25), device=device)
    apart = EmbeddingCollection(
        configs(), Adagrad(lr=0.1, initial_accumulator_value=0.25), device=device, group_tables=False
    )
    assert grouped.lookup_groups == [("a", "b", "c", "d", "e", "f", "h")]
    for x, y in zip(run(grouped, batches, device), run(apart, batches, device)):
        assert_outputs(x, y, exact=device == "cpu")
    assert_same(grouped, apart, exact=device == "cpu")


@pytest.mark.parametrize(
    "setup",
    ["fixed alone", "fixed grouped", "dynamic alone", "dynamic grouped", pytest.param("fbgemm", marks=needs_fbgemm)],
)
def test_a_learning_rate_set_between_forward_and_backward_applies_from_the_next_step(setup):
    """A step's rate is the one at its forward, on every table kind, grouped or not, and on
    FBGEMM's TBE (was: the backward's rate for a table alone, the forward's in a group and on
    FBGEMM)."""
    dynamic = DynamicTableOptions(64) if setup.startswith("dynamic") else None
    rows = None if dynamic else 10
    backend = "fbgemm" if setup == "fbgemm" else "native"
    tables = [TableConfig(name="t", dim=4, num_embeddings=rows, dynamic=dynamic, features=["f"], backend=backend)]
    if setup.endswith("grouped"):  # a twin of one dim and optimizer: one store, one lookup
        tables.append(TableConfig(name="u", dim=4, num_embeddings=rows, dynamic=dynamic, features=["g"]))
    coll = EmbeddingCollection(tables, SGD(lr=1.0))
    batch = JaggedBatch.from_lists({"f": [[3]], **({"g": [[3]]} if len(tables) > 1 else {})})
    before = coll.read_rows("t", torch.tensor([3]))["weight"] if rows else None
    out = coll(batch)
    if before is None:
        before = coll.read_rows("t", torch.tensor([3]))["weight"]
    coll.set_learning_rate(0.1)
    out["f"].sum().backward()
    torch.testing.assert_close(coll.read_rows("t", torch.tensor([3]))["weight"], before - 1.0)  # lr 1.0
    coll(batch)["f"].sum().backward()
    torch.testing.assert_close(coll.read_rows("t", torch.tensor([3]))["weight"], before - 1.1)  # then 0.1
