"""EmbeddingCollection across table kinds and backends."""

import pytest
import torch

from dynarec import DynamicTableOptions, EmbeddingCollection, FeatureConfig, JaggedBatch, TableConfig
from dynarec.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from tests.matrix import BACKENDS, needs_fbgemm


def mixed(spec, backends):
    tables = []
    for backend in backends:
        tables.append(
            TableConfig(name=f"fixed_{backend}", dim=4, num_embeddings=10, features=[f"fx_{backend}"], backend=backend)
        )
        tables.append(
            TableConfig(
                name=f"dyn_{backend}",
                dim=4,
                dynamic=DynamicTableOptions(64, bucket_size=4),
                features=[f"dy_{backend}"],
                backend=backend,
            )
        )
    return EmbeddingCollection(tables, spec)


@pytest.mark.parametrize("backends", [["native"], pytest.param(["native", "fbgemm"], marks=needs_fbgemm)])
def test_learning_rate_schedule_reaches_every_table(backends):
    coll = mixed(SGD(lr=0.1), backends)
    batch = JaggedBatch.from_lists({f: [[3]] for f in coll.feature_names})
    ids = {name: torch.tensor([3]) for name in coll.tables}
    deltas = []
    for lr in (None, 0.5, 0.02):
        if lr is not None:
            coll.set_learning_rate(lr)
        before = {n: coll.read_rows(n, i)["weight"] for n, i in ids.items()} if lr else None
        out = coll(batch)
        sum(v.sum() for v in out.values()).backward()  # g = 1 in every column of every table
        if before is not None:
            deltas.append({n: before[n] - coll.read_rows(n, i)["weight"] for n, i in ids.items()})
    for lr, delta in zip((0.5, 0.02), deltas):
        assert len(delta) == 2 * len(backends)
        for name, d in delta.items():
            torch.testing.assert_close(d, torch.full_like(d, lr), rtol=1e-5, atol=1e-7, msg=name)
    assert all(t.learning_rate == 0.02 for t in coll.tables.values())


def test_one_update_per_row_across_features_of_a_table():
    # item 3 is looked up by the pooled feature and twice by the sequence: one Adagrad update with
    # the summed gradient (3), not three updates.
    coll = EmbeddingCollection(
        [
            TableConfig(
                name="item", dim=2, num_embeddings=10, features=["item_id", FeatureConfig("hist", pooling="none")]
            )
        ],
        Adagrad(lr=1.0, initial_accumulator_value=0.0),
    )
    w0 = coll.read_rows("item", torch.tensor([3]))["weight"][0]
    out = coll(JaggedBatch.from_lists({"item_id": [[3]], "hist": [[3, 3]]}))
    (out["item_id"].sum() + out["hist"].sum()).backward()
    row = coll.read_rows("item", torch.tensor([3]))
    torch.testing.assert_close(row["momentum1"][0], torch.full((2,), 9.0))
    torch.testing.assert_close(row["weight"][0], w0 - 3.0 / 3.0)


def test_sequence_output_is_zero_padded():
    coll = EmbeddingCollection([TableConfig(name="t", dim=3, num_embeddings=10, features=["s"], pooling="none")], SGD())
    coll.eval()
    out = coll(JaggedBatch.from_lists({"s": [[1, 2, 3], [], [4]]}))["s"]
    w = coll.read_rows("t", torch.arange(10))["weight"]
    assert out.shape == (3, 3, 3)
    torch.testing.assert_close(out[0], w[[1, 2, 3]])
    assert torch.equal(out[1], torch.zeros(3, 3))
    torch.testing.assert_close(out[2, 0], w[4])
    assert torch.equal(out[2, 1:], torch.zeros(2, 3))


def test_duplicate_table_or_feature_is_an_error():
    t = TableConfig(name="a", dim=2, num_embeddings=3, features=["f"])
    with pytest.raises(ValueError, match="table 'a' is configured twice"):
        EmbeddingCollection([t, TableConfig(name="a", dim=2, num_embeddings=3, features=["g"])], SGD())
    with pytest.raises(ValueError, match="feature 'f' is served by tables 'a' and 'b'"):
        EmbeddingCollection([t, TableConfig(name="b", dim=2, num_embeddings=3, features=["f"])], SGD())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "give exactly one of num_embeddings .* or dynamic"),
        (dict(num_embeddings=4, dynamic=DynamicTableOptions(64)), "give exactly one of num_embeddings"),
        (dict(dynamic={"max_capacity": 64}), "dynamic must be a DynamicTableOptions"),
        (dict(num_embeddings=0), "num_embeddings must be >= 1"),
        (dict(num_embeddings=True), "num_embeddings must be an integer"),
        (dict(num_embeddings=4, pooling="max"), "pooling must be one of"),
        (dict(num_embeddings=4, backend="tpu"), "backend must be one of"),
    ],
)
def test_table_config_errors_name_the_table(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        TableConfig(name="tbl", dim=4, features=["f"], **kwargs)
    assert "table 'tbl'" in str(e.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_capacity=8), "max_capacity must be >= 16"),
        (dict(max_capacity=64, init_capacity=128), r"init_capacity must be in \[16, 64\]"),
        (dict(max_capacity=64, bucket_size=0), r"bucket_size must be in \[1, 1024\]"),
        (dict(max_capacity=64, growth_load_factor=1.5), r"growth_load_factor must be in \(0, 1\]"),
        (dict(max_capacity=64, score_strategy="lru"), "score_strategy must be one of"),
        (dict(max_capacity=64, check_mode="silent"), "check_mode must be one of"),
        (dict(max_capacity=True), "max_capacity must be an integer"),
    ],
)
def test_dynamic_table_options_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicTableOptions(**kwargs)


def test_a_failed_training_forward_leaves_every_table_as_it_was():
    coll = EmbeddingCollection(
        [
            TableConfig(name="fixed", dim=2, num_embeddings=10, features=["fx"]),
            TableConfig(
                name="grow", dim=2, dynamic=DynamicTableOptions(64, init_capacity=8, bucket_size=4), features=["g"]
            ),
            TableConfig(
                name="full",
                dim=2,
                dynamic=DynamicTableOptions(4, bucket_size=4, score_strategy="none"),
                features=["fl"],
            ),
        ],
        SGD(lr=0.1),
    )
    ok = JaggedBatch.from_lists({"fx": [[1]], "g": [[1]], "fl": [[1, 2, 3, 4]]})
    sum(v.sum() for v in coll(ok).values()).backward()
    before = {n: t.dump() for n, t in coll.tables.items()}
    from dynarec.embedding import TableFullError

    # 'grow' creates rows and grows (8 -> 32 slots) before 'full' raises: all of it is undone.
    with pytest.raises(TableFullError, match="table 'full'"):
        coll(JaggedBatch.from_lists({"fx": [[2]], "g": [list(range(2, 20))], "fl": [[5]]}))
    grow = coll.tables["grow"]
    assert grow.capacity == 8 and grow.size == 1 and len(grow.steps.pending) == 0
    assert_same_dumps(before, {n: t.dump() for n, t in coll.tables.items()})
    # The table can still grow: nothing waits for the aborted step's backward.
    out = coll(JaggedBatch.from_lists({"fx": [[2]], "g": [list(range(100, 120))], "fl": [[1]]}))
    sum(v.sum() for v in out.values()).backward()
    assert grow.capacity > 8 and grow.size == 21


def assert_same_dumps(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for k in a[name]:
            assert torch.equal(a[name][k], b[name][k]), (name, k)


class _Model(torch.nn.Module):
    """A user's model: a collection beside a dense layer."""

    def __init__(self, tables, fixed_rows: int = 20, optimizer=None):
        super().__init__()
        self.emb = EmbeddingCollection(
            [
                TableConfig(name="a", dim=4, num_embeddings=fixed_rows, features=["fa"]),
                TableConfig(name="b", dim=4, num_embeddings=12, features=["fb"]),  # grouped with "a"
                TableConfig(name="u", dim=4, dynamic=DynamicTableOptions(64, bucket_size=4), features=["fu"]),
                TableConfig(name="v", dim=4, dynamic=DynamicTableOptions(64, bucket_size=4), features=["fv"]),
                TableConfig(
                    name="g", dim=4, dynamic=DynamicTableOptions(256, init_capacity=8, bucket_size=4), features=["fg"]
                ),
            ][:tables],
            optimizer or Adagrad(lr=0.1, initial_accumulator_value=0.1),
        )
        self.head = torch.nn.Linear(4, 1)

    def step(self, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        ids = {"fa": 20, "fb": 12, "fu": 1 << 40, "fv": 1 << 40, "fg": 1 << 40}
        kjt = JaggedBatch.from_lists(
            {
                f: [torch.randint(0, m, (3,), generator=g).tolist() for _ in range(4)]
                for f, m in ids.items()
                if f in self.emb.feature_names
            }
        )
        out = self.emb(kjt)
        loss = sum(self.head(v).sum() for v in out.values())
        loss.backward()
        return loss.detach()


def test_a_models_state_dict_carries_its_tables_and_restores_them_exactly():
    """``model.state_dict()`` of a model holding a collection has every table's rows, optimizer
    states and (dynamic) keys beside the dense parameters; a fresh model loading it (through
    torch.save / torch.load with weights_only) holds the same tables and trains on identically."""
    import io

    torch.manual_seed(0)
    trained, fresh = _Model(5), _Model(5)
    assert trained.emb.lookup_groups == [("a", "b"), ("u", "v"), ("g",)]
    for seed in range(6):  # 'g' grows (8 slots to more) on the way
        trained.step(seed)
    assert trained.emb.tables["g"].capacity > 8
    state = trained.state_dict()
    for name in "abuvg":
        assert {f"emb.tables.{name}.weight", f"emb.tables.{name}.momentum1", f"emb.tables.{name}.step"} <= set(state)
    assert state["emb.tables.a.weight"].shape == (20, 4) and "head.weight" in state
    assert state["emb.tables.u.keys"].numel() == trained.emb.tables["u"].size > 0
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))

    assert_same_dumps(
        {n: t.dump() for n, t in trained.emb.tables.items()}, {n: t.dump() for n, t in fresh.emb.tables.items()}
    )
    assert torch.equal(trained.head.weight, fresh.head.weight)
    for seed in (10, 11):  # the dense head is not stepped: the tables' fused updates alone
        assert torch.equal(trained.step(seed), fresh.step(seed))
    assert_same_dumps(
        {n: t.dump() for n, t in trained.emb.tables.items()}, {n: t.dump() for n, t in fresh.emb.tables.items()}
    )


def test_a_state_dict_that_does_not_fit_the_tables_is_an_error_naming_them():
    trained = _Model(5)
    trained.step(0)
    state = trained.state_dict()

    fewer = _Model(4)  # no table 'g'
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*emb\.tables\.g\.weight"):
        fewer.load_state_dict(state)
    more = _Model(5)
    without_b = {k: v for k, v in state.items() if not k.startswith("emb.tables.b.")}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*emb\.tables\.b\.weight"):
        more.load_state_dict(without_b)
    result = more.load_state_dict(without_b, strict=False)  # the other tables load
    assert result.missing_keys == ["emb.tables.b.weight"]
    assert torch.equal(more.emb.tables["a"].dump()["weight"], state["emb.tables.a.weight"])

    other_rows = _Model(5, fixed_rows=30)
    before = {name: t.dump() for name, t in other_rows.emb.tables.items()}
    with pytest.raises(RuntimeError, match=r"emb\.tables\.a: table 'a': dump holds weight \(20, 4\)") as refused:
        other_rows.load_state_dict(state)
    # Every table's dump is checked before any loads: the tables that fit were loaded all the same
    # (a half-loaded collection), and a state of the table that did not fit was named "unexpected".
    for name, t in other_rows.emb.tables.items():
        assert all(torch.equal(v, t.dump()[k]) for k, v in before[name].items()), name
    assert "Unexpected" not in str(refused.value)

    tiny = EmbeddingCollection(
        [TableConfig(name="u", dim=4, dynamic=DynamicTableOptions(4, bucket_size=4), features=["fu"])], Adagrad(lr=0.1)
    )
    many = {k[len("emb.") :]: v for k, v in state.items() if k.startswith("emb.tables.u.")}
    assert many["tables.u.keys"].numel() > 4
    with pytest.raises(RuntimeError, match=r"tables\.u: \d+ of its \d+ keys would find no row \(max_capacity 4\)"):
        tiny.load_state_dict(many)


def test_a_dynamic_tables_dump_with_more_keys_than_its_max_capacity_loads_no_table():
    """Checked with every table before any loads: the fixed table and the dynamic one are as
    they were (was: the fixed table loaded, and the dynamic one held 32 of the 80 keys)."""

    def collection(capacity: int) -> EmbeddingCollection:
        tables = [
            TableConfig(name="x", dim=2, num_embeddings=4, features=["g"]),
            TableConfig(name="d", dim=2, dynamic=DynamicTableOptions(max_capacity=capacity), features=["f"]),
        ]
        return EmbeddingCollection(tables, Adagrad(lr=0.1))

    big, small = collection(256), collection(32)
    out = big(JaggedBatch.from_lists({"f": [list(range(80))], "g": [[1]]}))
    (out["f"].sum() + out["g"].sum()).backward()
    before = {name: t.dump() for name, t in small.tables.items()}
    with pytest.raises(
        RuntimeError, match=r"tables\.d: 48 of its 80 keys would find no row \(max_capacity 32\); no table"
    ):
        small.load_state_dict(big.state_dict())
    for name, t in small.tables.items():
        after = t.dump()
        assert before[name].keys() == after.keys() and all(torch.equal(v, after[k]) for k, v in before[name].items())


def test_a_state_dict_of_another_dim_is_named_as_that_alone_and_loads_no_table():
    """A table saved at dim 4 loaded into one of dim 8: its Adagrad state was listed as an
    "Unexpected key" (it looked like another optimizer's, at another width) beside the dim error,
    and the collection's other table had been loaded when the error came."""

    def collection(dim_b: int) -> EmbeddingCollection:
        tables = [
            TableConfig(name="a", dim=4, num_embeddings=10, features=["f"]),
            TableConfig(name="b", dim=dim_b, num_embeddings=10, features=["g"]),
        ]
        return EmbeddingCollection(tables, Adagrad(lr=0.1))

    src = collection(4)
    out = src(JaggedBatch.from_lists({"f": [[1]], "g": [[2]]}))
    sum(v.sum() for v in out.values()).backward()
    dst = collection(8)
    before = dst.tables["a"].dump()
    with pytest.raises(RuntimeError) as refused:
        dst.load_state_dict(src.state_dict())
    assert "tables.b: table 'b': dump holds weight of dim 4, the table's is 8" in str(refused.value)
    assert "Unexpected" not in str(refused.value)
    assert all(torch.equal(v, dst.tables["a"].dump()[k]) for k, v in before.items())


@pytest.mark.parametrize(
    "saved, loaded",
    [
        (Adam(lr=0.1), Adagrad(lr=0.1)),
        (Adam(lr=0.1), SGD(lr=0.1)),
        (Adagrad(lr=0.1), SGD(lr=0.1)),
        (SGD(lr=0.1), Adagrad(lr=0.1)),
        (Adagrad(lr=0.1), Adam(lr=0.1)),
        (RowWiseAdagrad(lr=0.1), Adam(lr=0.1)),
        (Adagrad(lr=0.1), RowWiseAdagrad(lr=0.1)),
        (RowWiseAdagrad(lr=0.1), Adagrad(lr=0.1)),
    ],
    ids=[
        "adam-into-adagrad",
        "adam-into-sgd",
        "adagrad-into-sgd",
        "sgd-into-adagrad",
        "adagrad-into-adam",
        "rowwise-into-adam",
        "adagrad-into-rowwise",
        "rowwise-into-adagrad",
    ],
)
def test_a_state_dict_of_another_optimizer_loads_its_weights_alone(saved, loaded):
    """Adam's momentum1 has Adagrad's name and shape: loaded as an accumulator it went negative
    and the next step wrote NaN weights (Adam into SGD dropped the moments silently). A dump
    lacking this optimizer's states (SGD's has none) or holding them at another width (Adagrad's
    accumulator is [n, dim], RowWiseAdagrad's [n, 1]) was refused even with strict=False, the
    width mismatch after the weights were written. A table of another optimizer loads its
    weights alone, this optimizer's states afresh and the step at 0; the differing states are
    unexpected or missing keys: a strict load raises torch's error naming them, strict=False is
    a warm start."""
    trained = _Model(5, optimizer=saved)
    trained.step(0)
    state = trained.state_dict()
    other = _Model(5, optimizer=loaded)
    with pytest.raises(RuntimeError, match=r"key\(s\) in state_dict.*emb\.tables\.a\.momentum"):
        other.load_state_dict(state)
    result = _Model(5, optimizer=loaded).load_state_dict(state, strict=False)
    assert {f"emb.tables.{n}.momentum1" for n in "abuvg"} <= {*result.unexpected_keys, *result.missing_keys}
    for name, table in other.emb.tables.items():
        dump, theirs = table.dump(), trained.emb.tables[name].dump()
        if "keys" in dump:
            assert torch.equal(dump["keys"], theirs["keys"]), name
        assert torch.equal(dump["weight"], theirs["weight"]) and int(dump["step"]) == 0, name
        for spec in table.spec.state_specs():
            assert bool((dump[spec.name] == spec.initial_value).all()), (name, spec.name)
    other.step(1)
    assert all(bool(t.dump()["weight"].isfinite().all()) for t in other.emb.tables.values())


@pytest.mark.parametrize(
    "table, change, error",
    [
        (
            "a",
            lambda d: d.update(momentum1=d["momentum1"][:-1]),
            r"dump holds momentum1 \(19, 4\), the table needs \(20, 4\)",
        ),
        ("u", lambda d: d.update(weight=d["weight"][:-1]), r"dump holds weight \(\d+, 4\), the table needs"),
        ("u", lambda d: d["keys"].__setitem__(1, int(d["keys"][0])), r"dump holds key -?\d+ more than once"),
        ("u", lambda d: d["slots"].__setitem__(1, int(d["slots"][0])), r"dump holds slot \d+ more than once"),
        ("u", lambda d: d.update(keys=d["keys"][:-1]), r"dump holds scores \(\d+,\) for its \d+ keys"),
        ("u", lambda d: d.update(step=torch.tensor(-1)), r"dump's step -1 is not a count of steps"),
    ],
    ids=["short-state", "short-weight", "key-twice", "slot-twice", "short-keys", "negative-step"],
)
def test_a_refused_dump_leaves_its_table_as_it_was(table, change, error):
    """A dump that does not fit its table is refused naming the table and field before any row
    is written (was: the weights written before a state's shape was checked; a dynamic table's
    keys installed before its rows; a key twice held twice, a slot twice a key dropped)."""
    source = _Model(5)
    source.step(0)
    dump = {k: v.clone() for k, v in source.emb.tables[table].dump().items()}
    change(dump)
    target = _Model(5)
    target.step(1)
    before = {k: v.clone() for k, v in target.emb.tables[table].dump().items()}
    with pytest.raises(ValueError, match=error):
        target.emb.tables[table].load(dump)
    after = target.emb.tables[table].dump()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    target.step(2)


def test_rows_by_id_refuse_floating_point_ids_and_a_fixed_tables_duplicate_ids():
    """read_rows([1.7]) read row 1 (a cast truncated it), and write_rows with an id twice kept
    the last on a fixed table (a dynamic table refused it)."""
    model = _Model(5)
    for table in ("a", "u"):
        with pytest.raises(ValueError, match=f"table '{table}': read_rows takes integer ids"):
            model.emb.read_rows(table, torch.tensor([1.7]))
        with pytest.raises(ValueError, match=f"table '{table}': write_rows takes integer ids"):
            model.emb.write_rows(table, [1.0], {"weight": torch.ones(1, 4)})
    before = model.emb.read_rows("a", torch.tensor([1]))["weight"].clone()
    with pytest.raises(ValueError, match="table 'a': write_rows got duplicate ids"):
        model.emb.write_rows("a", torch.tensor([1, 1]), {"weight": torch.stack([torch.ones(4), 2 * torch.ones(4)])})
    assert torch.equal(model.emb.read_rows("a", torch.tensor([1]))["weight"], before)
    for table in ("a", "u"):  # (a raw IndexError from index_select, naming nothing)
        with pytest.raises(
            ValueError, match=rf"table '{table}': read_rows takes ids \[n\], got a tensor of shape \[1, 2\]"
        ):
            model.emb.read_rows(table, torch.tensor([[1, 2]]))


def test_a_batchs_weights_name_the_feature_that_does_not_match_and_default_to_one():
    """from_lists with weights for some features raised a bare KeyError for the others; they
    weigh their ids 1.0 now (as a config's unweighted features do), and weights that do not
    match a feature's ids, or of a feature the batch lacks, are named."""
    b = JaggedBatch.from_lists({"g": [[1], [2, 3]], "h": [[4], []]}, weights={"g": [[0.5], [2.0, 3.0]]})
    assert b.weights_or_none().tolist() == [0.5, 2.0, 3.0, 1.0]
    with pytest.raises(ValueError, match=r"weights of feature 'g' do not match its ids: \[1, 2\] ids a sample"):
        JaggedBatch.from_lists({"g": [[1], [2, 3]], "h": [[4], []]}, weights={"g": [[0.5], [2.0]]})
    with pytest.raises(ValueError, match=r"weights of feature\(s\) \['z'\] the batch does not have"):
        JaggedBatch.from_lists({"g": [[1]]}, weights={"z": [[0.5]]})


@pytest.mark.parametrize("table", ["a", "u"])
def test_write_rows_with_a_bad_field_writes_nothing(table):
    """A weight written before a state of the wrong shape was refused stayed written."""
    model = _Model(5)
    model.emb.write_rows(table, torch.tensor([1]), {"weight": torch.ones(1, 4)})
    before = model.emb.read_rows(table, torch.tensor([1]))
    with pytest.raises(ValueError, match=r"'momentum1' must have shape \(1, 4\), got \(1, 3\)"):
        model.emb.write_rows(table, torch.tensor([1]), {"weight": 2 * torch.ones(1, 4), "momentum1": torch.ones(1, 3)})
    after = model.emb.read_rows(table, torch.tensor([1]))
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("table", ["a", "u"])
def test_read_rows_and_write_rows_of_no_ids_change_nothing(table):
    """write_rows(read_rows(no ids)) raised torch's "cannot reshape tensor of 0 elements"."""
    model = _Model(5)
    before = model.emb.tables[table].dump()
    none = torch.empty(0, dtype=torch.int64)
    rows = model.emb.read_rows(table, none)
    assert rows["weight"].shape == (0, 4)
    model.emb.write_rows(table, none, {k: v for k, v in rows.items() if k != "present"})
    after = model.emb.tables[table].dump()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_state_dict_is_not_loaded_into_a_pending_step():
    model = _Model(2)
    state = model.state_dict()
    out = model.emb(JaggedBatch.from_lists({"fa": [[1]], "fb": [[2]]}))  # a training forward, no backward yet
    from dynarec.embedding.step import StepPendingError

    with pytest.raises(StepPendingError, match="load_state_dict while a training step is pending"):
        model.load_state_dict(state)
    # nor taken from one: its new keys and step count would be in it, its update not
    with pytest.raises(StepPendingError, match="state_dict while a training step is pending"):
        model.state_dict()
    sum(v.sum() for v in out.values()).backward()
    model.load_state_dict(state)
    assert model.state_dict().keys() == state.keys()


def test_a_sharded_collection_refuses_a_state_dict_of_its_shards_only():
    from dynarec.distributed.collection import ShardedEmbeddingCollection
    from dynarec.distributed.context import DistContext
    from dynarec.planner import plan_tables

    tables = [
        TableConfig(name="user", dim=4, dynamic=DynamicTableOptions(64), features=["user"]),
        TableConfig(name="r", dim=4, num_embeddings=10, features=["r"], sharding="data_parallel"),
    ]
    ctx = DistContext(0, 1, 0, torch.device("cpu"), 60.0, group=None)  # its constructor makes no collective
    sharded = ShardedEmbeddingCollection(plan_tables(tables, 1, optimizer=Adagrad(lr=0.1)), ctx)
    with pytest.raises(RuntimeError, match=r"rank 0: state_dict\(\) .* routed table\(s\) \['user'\]; .*Trainer\.save"):
        sharded.state_dict()
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) .* Trainer\.restore"):
        sharded.load_state_dict({})
    replicated = ShardedEmbeddingCollection(plan_tables(tables[1:], 1, optimizer=Adagrad(lr=0.1)), ctx)
    assert set(replicated.state_dict()) == {"local.tables.r.weight", "local.tables.r.momentum1", "local.tables.r.step"}


@pytest.mark.parametrize(
    "move, where",
    [
        (lambda m: m.to("meta"), "meta / torch.float32"),
        (lambda m: m.double(), "cpu / torch.float64"),
        (lambda m: m.to(torch.bfloat16), "cpu / torch.bfloat16"),
    ],
)
def test_moving_a_model_does_not_silently_leave_its_tables_behind(move, where):
    """``.to()`` / ``.double()`` of a model holding a collection is refused, naming the tables,
    before anything moves (a silent no-op left the embeddings where the dense layers were not);
    what changes nothing (the same device, ``share_memory``) still works."""
    model = _Model(2)
    before = model.emb.tables["a"].dump()
    with pytest.raises(
        RuntimeError, match=rf"the embedding tables \['a', 'b'\] stay where they were built \(cpu.*to {where}"
    ):
        move(model)
    assert model.head.weight.dtype == torch.float32 and model.head.weight.device.type == "cpu"
    model.to("cpu").float().share_memory()
    assert_same_dumps({"a": before}, {"a": model.emb.tables["a"].dump()})
    model.step(0)


def test_a_sharded_collection_is_not_moved_either():
    from dynarec.distributed.collection import ShardedEmbeddingCollection
    from dynarec.distributed.context import DistContext
    from dynarec.planner import plan_tables

    tables = [TableConfig(name="user", dim=4, dynamic=DynamicTableOptions(64), features=["user"])]
    ctx = DistContext(0, 1, 0, torch.device("cpu"), 60.0, group=None)
    sharded = ShardedEmbeddingCollection(plan_tables(tables, 1, optimizer=Adagrad(lr=0.1)), ctx)
    with pytest.raises(RuntimeError, match=r"the embedding tables \['user'\] stay where they were built"):
        sharded.double()


def test_printing_a_model_shows_its_tables():
    model = _Model(3)
    model.step(0)
    text = str(model)
    assert "(a): 20 rows x 4 fp32 [fa] Adagrad(lr=0.1" in text
    size = model.emb.tables["u"].size
    assert size > 0 and f"(u): dynamic {size}/64 keys x 4 fp32 [fu]" in text


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_deepcopy_trains_apart_from_its_original(backend):
    """``copy.deepcopy`` of a trained collection (grouped fixed and dynamic tables, one growing,
    one admitting, one of bf16 rows; with fbgemm, two tables of FBGEMM's TBE beside them), or the
    collection pickled whole by ``torch.save``, is a model of its own: training it leaves the
    original as it was, and it trains as the original then does on the same batches (its parts
    read its own index, not the original's; a TBE copy's rows are the ones its reads, writes and
    dumps see: they were the original's, and its TBE did not pickle)."""
    import copy
    import io

    from dynarec.embedding.config import AdmissionConfig

    def options(**kw):
        return DynamicTableOptions(64, bucket_size=4, **kw)

    coll = EmbeddingCollection(
        [
            TableConfig(name="a", dim=4, num_embeddings=20, features=["fa"]),
            TableConfig(name="b", dim=4, num_embeddings=12, features=["fb"]),
            TableConfig(name="u", dim=4, dynamic=options(), features=["fu"]),
            TableConfig(name="v", dim=4, dynamic=options(), features=["fv"]),
            TableConfig(name="g", dim=4, dynamic=options(init_capacity=8), features=["fg"]),
            TableConfig(name="m", dim=4, dynamic=options(admission=AdmissionConfig(threshold=2)), features=["fm"]),
            TableConfig(name="h", dim=4, dynamic=options(), features=["fh"], data_type="bf16"),
            TableConfig(name="t", dim=4, num_embeddings=16, features=["ft"], backend=backend),
            TableConfig(name="d", dim=4, dynamic=options(), features=["fd"], backend=backend),
        ],
        Adagrad(lr=0.1),
    )
    assert ("u", "v", "m", "d") in coll.lookup_groups if backend == "native" else ("u", "v", "m") in coll.lookup_groups

    def train(c, seeds):
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            ranges = {"fa": 20, "fb": 12, "fu": 200, "fv": 200, "fg": 200, "fm": 20, "fh": 200, "ft": 16, "fd": 200}
            kjt = JaggedBatch.from_lists(
                {f: [torch.randint(0, m, (3,), generator=g).tolist() for _ in range(4)] for f, m in ranges.items()}
            )
            out = c(kjt)
            sum((v * (1 + i)).sum() for i, v in enumerate(out.values())).backward()

    train(coll, range(4))
    before = {n: t.dump() for n, t in coll.tables.items()}
    twin = copy.deepcopy(coll)
    buffer = io.BytesIO()
    torch.save(coll, buffer)  # the whole module pickled, as torch.save(model) does
    buffer.seek(0)
    unpickled = torch.load(buffer, weights_only=False)
    for other in (twin, unpickled):
        train(other, range(10, 16))  # it evicts ('u', 'v', 'h': 64 slots) and grows ('g')
        assert_same_dumps(before, {n: t.dump() for n, t in coll.tables.items()})
    train(coll, range(10, 16))
    for other in (twin, unpickled):
        assert_same_dumps({n: t.dump() for n, t in other.tables.items()}, {n: t.dump() for n, t in coll.tables.items()})
    assert twin.tables["g"].capacity > 8 and twin.tables["u"].report()["evicted_keys"] > 0
    twin.eval()  # a row written through the copy is the row its lookup reads
    twin.write_rows("t", torch.tensor([1]), {"weight": torch.full((1, 4), 5.0)})
    with torch.no_grad():
        assert torch.equal(
            twin(JaggedBatch.from_lists({f: [[1]] for f in twin.feature_names}))["ft"], torch.full((1, 4), 5.0)
        )
    assert not torch.equal(coll.read_rows("t", torch.tensor([1]))["weight"], torch.full((1, 4), 5.0))


def test_training_in_a_job_of_several_processes_warns_that_each_rank_holds_its_own_tables():
    """DistributedDataParallel around a model holding a collection synchronizes its dense
    parameters only: each rank's tables trained apart, silently. The first training lookup in a
    job of several processes warns, naming the tables and the sharded collection; evaluation does
    not, nor does a collection whose rows are data-parallel (a sharded collection's replicas)."""
    import warnings

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def coll(**kw):
        return EmbeddingCollection(
            [TableConfig(name="a", dim=4, num_embeddings=10, features=["fa"])], Adagrad(lr=0.1), **kw
        )

    kjt = JaggedBatch.from_lists({"fa": [[1], [2]]})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        quiet = coll(row_reducers=lambda name, rows: None)
        evaluated = coll().eval()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            sum(v.sum() for v in quiet(kjt).values()).backward()
            evaluated(kjt)
        trained = coll()
        with pytest.warns(UserWarning, match=r"job of 2 processes: its tables \['a'\] .*\.ShardedEmbeddingCollection"):
            sum(v.sum() for v in trained(kjt).values()).backward()
        with warnings.catch_warnings():  # once
            warnings.simplefilter("error")
            sum(v.sum() for v in trained(kjt).values()).backward()
    finally:
        dist.destroy_process_group()


def test_a_collections_arguments_are_checked_by_name():
    """Mistakes that reached a raw AttributeError or torch's assertion, or passed silently."""
    one = [TableConfig(name="a", dim=4, num_embeddings=10, features=["u"])]
    with pytest.raises(ValueError, match=r"table 'a': features must be a list of feature names, got the string 'user'"):
        TableConfig(name="a", dim=4, num_embeddings=10, features="user")  # was features u, s, e, r
    with pytest.raises(ValueError, match=r"table 'a': the optimizer must be an OptimizerSpec .* got 'sgd'"):
        EmbeddingCollection(one, optimizer="sgd")  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(
            ValueError, match=r"EmbeddingCollection\(device='cuda'\): (this torch build|torch .* sees no)"
        ):
            EmbeddingCollection(one, SGD(lr=0.1), device="cuda")
    coll = EmbeddingCollection(one, SGD(lr=0.1))
    for lr in (-1.0, float("nan"), float("inf"), "0.1", True):
        with pytest.raises(ValueError, match=r"table 'a': the learning rate must be a finite number >= 0"):
            coll.set_learning_rate(lr)  # type: ignore[arg-type]
    coll.set_learning_rate(torch.tensor(0.25))  # a scheduler's tensor or numpy rate is a number
    assert coll.tables["a"].store.lr == 0.25


def test_requires_grad_false_freezes_the_tables_until_it_is_undone():
    """A frozen collection in training mode looks up as in evaluation: no step, no new key, no
    update, through ``train()``; ``requires_grad_(True)`` trains it again. (It has no
    parameters: ``requires_grad_(False)`` was a no-op and the rows kept training.)"""
    model = _Model(5)
    model.step(0)
    before = {n: t.dump() for n, t in model.emb.tables.items()}
    assert model.emb.requires_grad_(False) is model.emb
    model.train()
    kjt = JaggedBatch.from_lists(
        {"fa": [[1, 2]], "fb": [[3]], "fu": [[1 << 33]], "fv": [[5, 7]], "fg": [[9]]}
    )  # new keys
    out = model.emb(kjt)
    assert not any(v.requires_grad for v in out.values())
    model.emb.abort_step()  # (a NaN loss's undo, as the trainer does): nothing to undo
    assert_same_dumps(before, {n: t.dump() for n, t in model.emb.tables.items()})
    model.emb.requires_grad_(True)
    model.step(1)
    assert model.emb.tables["a"].step == 2 and model.emb.tables["u"].step == 2


def _range_check(seen: list):
    """A validate hook: a fixed table of 10 rows' id check, recording what it was given."""
    from dynarec.embedding.table import check_id_range

    def validate(name, ids, id_range):
        seen.append((name, ids.numel(), id_range))
        check_id_range("t", name, ids, 10, id_range)

    return validate


_GOOD = {"a": [[1, 2], [3]], "b": [[4], []]}


@pytest.mark.parametrize(
    "batch, error",
    [
        (JaggedBatch.from_lists({"a": [[1, 12], [3]], "b": [[4], []]}), r"feature 'a': id 12 is out of range"),
        (JaggedBatch.from_lists({"a": [[1], [3]]}), r"batch is missing feature\(s\) \['b'\]"),
        (JaggedBatch.from_lists({**_GOOD, "c": [[1], [2]]}), r"batch feature\(s\) \['c'\] are not served"),
        (
            JaggedBatch(["a", "b"], torch.tensor([1, 2]), torch.tensor([2, 1, -1, 0])),
            "feature 'b' has a negative length",
        ),
        (
            JaggedBatch.from_lists(_GOOD, {"a": [[1.0, float("nan")], [1.0]], "b": [[1.0], []]}),
            "feature 'a': per-sample weight nan is not a finite number",
        ),
    ],
)
@pytest.mark.parametrize("ranges", [False, True])
def test_a_batch_bound_for_a_device_is_checked_as_one_split_here(batch, error, ranges):
    """check_batch (a batch checked on the host, split on its device) refuses what
    checked_slices refuses, from the batch's id ranges where its maker gave them."""
    from dynarec.embedding.collection import check_batch, checked_slices

    if ranges:  # each feature's (smallest, largest) id, as a DataLoader worker gives them
        lengths = batch.lengths().view(len(batch.keys()), -1).sum(1).tolist()
        pieces = batch.values().split(lengths) if min(lengths) >= 0 else [torch.arange(10)] * len(lengths)
        batch = batch.with_id_ranges([(int(v.min()), int(v.max())) if v.numel() else (0, -1) for v in pieces])
    for check in (check_batch, lambda *a: checked_slices(*a, widen=False)):
        with pytest.raises(ValueError, match=error):
            check(batch, ["a", "b"], _range_check([]))


def test_a_batch_with_its_id_ranges_is_checked_without_a_split():
    from dynarec.embedding.collection import check_batch

    batch = JaggedBatch.from_lists(_GOOD)
    seen: list = []
    check_batch(batch, ["a", "b"], _range_check(seen))  # no ranges: checked on its split
    assert seen == [("a", 3, None), ("b", 1, None)]
    seen.clear()
    check_batch(batch.with_id_ranges([(1, 3), (4, 4)]), ["a", "b"], _range_check(seen))
    assert seen == [("a", 0, (1, 3)), ("b", 0, (4, 4))]


def test_a_batch_bound_for_another_device_is_checked_here_and_split_there():
    """The input stage of a batch on another device than the tables' (here ``cpu`` bound for
    ``cpu:0``, which torch tells apart: the path a GPU's batches take): checked from its id
    ranges, copied, split there; the same outputs as the batch on the tables' own device, and
    the same refusal of an id out of range."""
    tables = [TableConfig(name="t", dim=4, num_embeddings=10, features=["a", "b"])]
    there = EmbeddingCollection(tables, Adagrad(lr=0.1), device=torch.device("cpu", 0))
    here = EmbeddingCollection(tables, Adagrad(lr=0.1))
    assert torch.device("cpu") != there.device
    batch = JaggedBatch.from_lists({"a": [[1], [2, 3]], "b": [[4], []]})
    for b in (batch, batch.with_id_ranges([(1, 3), (4, 4)])):
        out, expected = there(b), here(b)
        for k in expected:
            assert torch.equal(out[k], expected[k]), k
        sum(v.sum() for v in out.values()).backward()
        sum(v.sum() for v in expected.values()).backward()
    bad = JaggedBatch.from_lists({"a": [[1], [12]], "b": [[4], []]})
    for b in (bad, bad.with_id_ranges([(1, 12), (4, 4)])):
        with pytest.raises(ValueError, match=r"table 't', feature 'a': id 12 is out of range \[0, 10\)"):
            there(b)
    assert torch.equal(there.tables["t"].dump()["weight"], here.tables["t"].dump()["weight"])
