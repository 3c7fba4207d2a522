import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dynarec.config import config_from_dict
from dynarec.config.schema import NegativeSamplerCfg
from dynarec.data.batch import BatchBuilder, DataError
from dynarec.data.sampler import NegativeSampler, SamplerError
from dynarec.embedding.jagged import split_features
from tests.pipeline_fixtures import config_dict


def item_table(path, rows, header="id:int64\tweight:float\tfeature:string"):
    path.write_text(header + "\n" + "".join(f"{i}\t{w}\t{a}\n" for i, w, a in rows))
    return str(path)


def sampler_cfg(path, **kw) -> NegativeSamplerCfg:
    fields = ["item_id", "cate_id"]
    return NegativeSamplerCfg(input_path=path, num_sample=4, attr_fields=fields, item_id_field="item_id", **kw)


def test_draws_follow_the_weights_and_skip_the_batchs_items(tmp_path):
    path = item_table(
        tmp_path / "items.tsv", [(10, 1.0, "10:1"), (11, 3.0, "11:2"), (12, 6.0, "12:3"), (13, 0.0, "13:4")]
    )
    s = NegativeSampler(sampler_cfg(path))
    picks = s.draw(np.array([], dtype=np.int64), 60_000, "f:0")
    share = np.bincount(s.ids[picks], minlength=14)[10:] / len(picks)
    np.testing.assert_allclose(share, [0.1, 0.3, 0.6, 0.0], atol=0.01)
    picks = s.draw(np.array([12, 7]), 5_000, "f:0")
    assert 12 not in set(s.ids[picks].tolist())  # in the batch
    share = np.bincount(s.ids[picks], minlength=14)[10:12] / len(picks)
    np.testing.assert_allclose(share, [0.25, 0.75], atol=0.03)  # the rest, by weight


def test_draws_depend_on_the_seed_and_the_batch_position_alone(tmp_path):
    path = item_table(tmp_path / "items.tsv", [(i, 1.0, f"{i}:{i % 3}") for i in range(100)])
    a, b = NegativeSampler(sampler_cfg(path), seed=1), NegativeSampler(sampler_cfg(path), seed=1)
    items = np.array([3, 4])
    assert np.array_equal(a.draw(items, 50, "x.parquet:0"), b.draw(items, 50, "x.parquet:0"))
    assert not np.array_equal(a.draw(items, 50, "x.parquet:0"), a.draw(items, 50, "x.parquet:100"))
    assert not np.array_equal(
        a.draw(items, 50, "x.parquet:0"), NegativeSampler(sampler_cfg(path), 2).draw(items, 50, "x.parquet:0")
    )


def test_a_parquet_item_table_reads_as_the_text_one(tmp_path):
    rows = [(5, 1.0, "5:7"), (6, 2.0, "6:8")]
    text = NegativeSampler(sampler_cfg(item_table(tmp_path / "items.tsv", rows)))
    pq.write_table(pa.table({"id": [5, 6], "weight": [1.0, 2.0], "attrs": ["5:7", "6:8"]}), tmp_path / "items.parquet")
    parquet = NegativeSampler(sampler_cfg(str(tmp_path / "items.parquet")))
    assert text.ids.tolist() == parquet.ids.tolist() == [5, 6]
    cols = parquet.columns(np.array([1, 0, 1]), {"item_id": pa.int64()})
    assert cols["item_id"].to_pylist() == [6, 5, 6] and cols["cate_id"].to_pylist() == ["8", "7", "8"]


def test_an_item_table_written_to_a_parquet_path_is_parquet_and_reads_back(tmp_path):
    """make-data wrote graph-learn's text to `items.parquet`, which training then read as
    Parquet: 'magic bytes not found' (a QA pass)."""
    from dynarec.data.sampler import write_item_table

    for name in ("items.parquet", "items.txt"):
        cfg = sampler_cfg(str(tmp_path / name))
        write_item_table(cfg, np.array([5, 6]), np.array([1.0, 2.0]), [["5", "7"], ["6", "8"]])
        s = NegativeSampler(cfg)
        assert s.ids.tolist() == [5, 6], name
        cols = s.columns(np.array([1, 0]), {"item_id": pa.int64()})
        assert cols["item_id"].to_pylist() == [6, 5] and cols["cate_id"].to_pylist() == ["8", "7"], name
    assert pq.read_table(tmp_path / "items.parquet").column_names == ["id", "weight", "attrs"]


@pytest.mark.parametrize(
    "rows, message",
    [
        ([(1, 1.0, "1:2:3")], r"item 1: 3 attribute\(s\) '1:2:3', attr_fields has 2"),
        ([(1, -1.0, "1:2")], r"item 1: weight -1.0 is not a number >= 0"),
        ([(1, 0.0, "1:2")], "every weight is 0"),
    ],
)
def test_a_bad_item_table_names_the_item(tmp_path, rows, message):
    with pytest.raises(SamplerError, match=message):
        NegativeSampler(sampler_cfg(item_table(tmp_path / "items.tsv", rows)))


def test_a_missing_item_table_names_the_setting(tmp_path):
    with pytest.raises(SamplerError, match=r"data.negative_sampler.input_path: .*nope.tsv does not exist"):
        NegativeSampler(sampler_cfg(str(tmp_path / "nope.tsv")))


def dssm_config(path, **sampler) -> dict:
    c = config_dict()
    c["model"] = {
        "feature_groups": [
            {"group_name": "user", "feature_names": ["user_id", "age", "hist_item_id"]},
            {"group_name": "item", "feature_names": ["item_id", "cate_id"]},
        ],
        "dssm": {
            "user_tower": {"input": "user", "hidden_units": [8]},
            "item_tower": {"input": "item", "hidden_units": [8]},
            "output_dim": 4,
        },
    }
    c["data"]["negative_sampler"] = {
        "input_path": path, "num_sample": 5, "attr_fields": ["item_id", "cate_id"], "item_id_field": "item_id",
        **sampler,
    }  # fmt: skip
    return c


def test_a_batch_gets_its_sampled_items_rows_with_their_item_features_only(tmp_path):
    """The sampled items follow the batch's rows: their item features are their attributes'
    (cate_id '7' is id 7), their user features are empty; labels stay the batch's."""
    path = item_table(tmp_path / "items.tsv", [(i, 1.0, f"{i}:{i % 10}") for i in range(100, 140)])
    b = BatchBuilder(config_from_dict(dssm_config(path)), negatives=5)
    t = pa.table(
        {
            "user_id": ["u1", "u2", "u3"], "age": [1, 2, 3], "item_id": [101, 102, 103], "cate_id": [1, 2, 3],
            "hist_item_id": ["1|2", "", "3"], "hist_cate_id": ["1|1", "", "2"], "price": [1.0, 2.0, 3.0],
            "clk": [1, 0, 1],
        }
    )  # fmt: skip
    batch = b.build(t, "t.parquet")
    assert batch.num_rows == 3 and batch.sampled_rows == 5 and batch.labels.shape == (3, 1)
    f = split_features(batch.sparse)
    # keyed by the file's directory name (none here) and name, and its first row
    picks = b.sampler.draw(np.array([101, 102, 103]), 5, "/t.parquet:0")
    drawn = b.sampler.ids[picks]
    assert not set(drawn.tolist()) & {101, 102, 103}
    assert f["item_id"].values.tolist() == [101, 102, 103, *drawn.tolist()]
    assert f["cate_id"].values.tolist() == [1, 2, 3, *(drawn % 10).tolist()]
    assert f["user_id"].lengths.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert f["hist_item_id"].lengths.tolist() == [2, 0, 1, 0, 0, 0, 0, 0]
    assert batch.dense["price"].tolist()[3:] == [0.0] * 5
    seq = batch.sequence_lengths(["hist_item_id"])["hist_item_id"]
    assert seq.tolist() == [2, 0, 1, 0, 0, 0, 0, 0]
    assert torch.equal(b.build(t, "t.parquet").sparse.values(), batch.sparse.values())  # the same draws


def test_a_batch_without_the_item_id_column_names_it(tmp_path):
    path = item_table(tmp_path / "items.tsv", [(i, 1.0, f"{i}:{i % 10}") for i in range(100, 110)])
    cfg = dssm_config(path, item_id_field="adgroup")
    b = BatchBuilder(config_from_dict(cfg), negatives=5)
    t = pa.table({"user_id": ["u1"], "age": [1], "item_id": [101], "cate_id": [1], "hist_item_id": ["1"],
                  "hist_cate_id": ["1"], "price": [1.0], "clk": [1]})  # fmt: skip
    with pytest.raises(DataError, match=r"missing column 'adgroup' \(data.negative_sampler.item_id_field\)"):
        b.build(t, "t.parquet")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c["data"].pop("negative_sampler"), "give data.negative_sampler, or set in_batch_negative"),
        (
            lambda c: c["model"]["feature_groups"][1]["feature_names"].append("price"),
            r"feature 'price' reads column\(s\) \['price'\], which the sampled items lack",
        ),
        (
            lambda c: c["model"].update({"dlrm": {}, "dssm": None}),
            "data.negative_sampler: samples items for a retrieval model",
        ),
        (
            lambda c: c["model"]["dssm"].update(recall_at_k=[1, 6]),
            r"model.dssm.recall_at_k: 6 of 6 scored items \(the own and the sampled ones\) is every item",
        ),
    ],
)
def test_retrieval_settings_that_cannot_train_are_config_errors(tmp_path, change, message):
    c = dssm_config(str(tmp_path / "items.tsv"))
    change(c)
    with pytest.raises(ValueError, match=message):
        config_from_dict(c)


def test_rows_appended_after_several_ids_an_element_keep_their_elements_apart():
    """A user sequence of several ids an element (value_dim 0) gets empty sampled rows: no
    elements there, the batch's element lengths as they were."""
    from dynarec.config.features import SequenceFeatureCfg
    from dynarec.data.batch import _appended, _empty, _Ids

    feature = SequenceFeatureCfg(
        feature_name="s", sequence_length=5, embedding_dim=4, num_buckets=10, value_dim=0, value_separator=";"
    )
    assert feature.several_ids_an_element
    out = _Ids(np.arange(5), np.array([3, 2]), element_lengths=np.array([2, 1, 2]), elements=np.array([2, 1]))
    grown = _appended(out, _empty(feature, 4))
    assert grown.lengths.tolist() == [3, 2, 0, 0, 0, 0] and grown.values.tolist() == [0, 1, 2, 3, 4]
    assert grown.elements.tolist() == [2, 1, 0, 0, 0, 0] and grown.element_lengths.tolist() == [2, 1, 2]


def test_an_item_feature_reading_a_user_column_through_another_feature_is_refused(tmp_path):
    c = dssm_config(str(tmp_path / "items.tsv"))
    c["feature_configs"].append(
        {
            "combo_feature": {
                "feature_name": "item_x_age",
                "expression": ["item:item_id", "user:age"],
                "hash_bucket_size": 9,
                "embedding_dim": 4,
            }
        }
    )
    c["model"]["feature_groups"][1]["feature_names"].append("item_x_age")
    with pytest.raises(
        ValueError, match=r"feature 'item_x_age' reads column\(s\) \['age'\], which the sampled items lack"
    ):
        config_from_dict(c)


def test_the_item_table_path_is_relative_to_the_config(tmp_path):
    import yaml

    from dynarec.config import load_config

    (tmp_path / "conf").mkdir()
    c = dssm_config("../items/items.tsv")
    (tmp_path / "conf" / "c.yaml").write_text(yaml.safe_dump(c))
    assert load_config(tmp_path / "conf" / "c.yaml").data.negative_sampler.input_path == str(
        tmp_path / "items" / "items.tsv"
    )


def test_make_data_writes_an_item_table_inside_its_directory_and_again_on_regeneration(tmp_path):
    """The item table may live in the data directory make-data writes (the natural layout):
    it goes in with the data, and a regeneration replaces it with the new data's items."""
    from dynarec.data.generate import GenerateSpec, make_config_data

    out = tmp_path / "data"
    c = dssm_config(str(out / "items.tsv"))
    c["data"]["train_input_path"], c["data"]["eval_input_path"] = str(out / "train"), str(out / "eval")
    config = config_from_dict(c)
    meta = make_config_data(config, out, GenerateSpec(train_rows=200, eval_rows=50, seed=1))
    assert meta["item_table_written"] == str(out / "items.tsv")
    first = (out / "items.tsv").read_text()
    assert NegativeSampler(config.data.negative_sampler).ids.size > 10
    make_config_data(config, out, GenerateSpec(train_rows=200, eval_rows=50, seed=2))
    assert (out / "items.tsv").exists() and (out / "items.tsv").read_text() != first


@pytest.mark.parametrize("where", ["train/items.parquet", "eval/items.csv", "train/*.parquet"])
def test_a_sampler_table_where_the_data_is_read_is_refused_by_make_data_and_by_training(tmp_path, where):
    """An item table inside the training (or eval) directory, or matched by its pattern, would be
    read as a data file ("missing column 'user_id'"): make-data refuses it before writing
    anything, and training refuses such a file by name."""
    from dynarec.data.generate import GenerateSpec, make_config_data
    from dynarec.train.trainer import Trainer

    out = tmp_path / "data"
    items = out / where.replace("*", "items")
    c = dssm_config(str(items))
    pattern = str(out / where) if "*" in where else None
    c["data"]["train_input_path"] = pattern or str(out / "train")
    c["data"]["eval_input_path"] = str(out / "eval")
    field = "eval" if where.startswith("eval") else "train"
    with pytest.raises(
        ValueError, match=rf"data.negative_sampler.input_path {items} lies where data.{field}_input_path"
    ):
        make_config_data(config_from_dict(c), out, GenerateSpec(train_rows=200, eval_rows=50))
    assert not out.exists()
    # a table put there by hand: training names it
    c["data"]["negative_sampler"]["input_path"] = str(tmp_path / items.name)
    make_config_data(config_from_dict(c), out, GenerateSpec(train_rows=200, eval_rows=50))
    items.parent.mkdir(exist_ok=True)
    (tmp_path / items.name).rename(items)
    c["data"]["negative_sampler"]["input_path"] = str(items)
    trainer = Trainer(config_from_dict(c), tmp_path / "m", progress=False)
    with pytest.raises(Exception, match=rf"{items} is data.negative_sampler.input_path, a sampler's table, not data"):
        trainer.fit()


def edge_table(path, rows, header="src_id:int64\tdst_id:int64\tweight:float"):
    path.write_text(header + "\n" + "".join(f"{u}\t{i}\t{w}\n" for u, i, w in rows))
    return str(path)


def hard_sampler(tmp_path, edges, **hard) -> NegativeSampler:
    items = item_table(tmp_path / "items.tsv", [(i, 1.0, f"{i}:{i % 10}") for i in range(100, 110)])
    hard = {"edge_input_path": edge_table(tmp_path / "edges.tsv", edges), "user_id_field": "uid", **hard}
    return NegativeSampler(sampler_cfg(items, hard_negatives=hard))


def test_hard_negatives_are_each_users_edges_with_the_row_they_belong_to(tmp_path):
    s = hard_sampler(tmp_path, [(7, 101, 1.0), (5, 103, 1.0), (7, 104, 2.0), (9, 109, 1.0)])
    picks, rows = s.hard(np.array([7, 8, 5, 7]), "k")  # user 8 has no edges; user 7 is two rows
    assert s.ids[picks].tolist() == [101, 104, 103, 101, 104] and rows.tolist() == [0, 0, 2, 3, 3]
    picks, rows = s.hard(np.array([8]), "k")
    assert picks.size == 0 and rows.size == 0


def test_past_num_hard_sample_a_users_edges_are_drawn_by_weight_without_replacement(tmp_path):
    edges = [(1, 100 + i, w) for i, w in enumerate([1.0, 0.0, 3.0, 6.0])]
    s = hard_sampler(tmp_path, edges, num_hard_sample=2)
    counts = np.zeros(10)
    for k in range(3000):
        picks, rows = s.hard(np.array([1]), f"k{k}")
        assert len(picks) == 2 and len(set(picks.tolist())) == 2 and rows.tolist() == [0, 0]
        counts[s.ids[picks] - 100] += 1
    assert counts[1] == 0  # weight 0: never
    # two of {100: 1, 102: 3, 103: 6} without replacement: P(103) = 0.6 + 0.1*6/9 + 0.3*6/7 = 0.9238
    np.testing.assert_allclose(counts[3] / 3000, 0.6 + 0.1 * 6 / 9 + 0.3 * 6 / 7, atol=0.02)
    assert np.array_equal(s.hard(np.array([1]), "same")[0], s.hard(np.array([1]), "same")[0])


def test_an_edge_to_an_item_not_in_the_item_table_is_named(tmp_path):
    with pytest.raises(SamplerError, match=r"edges\.tsv: edge 3 -> 555: item 555 is not in the item table"):
        hard_sampler(tmp_path, [(3, 101, 1.0), (3, 555, 1.0)])
    with pytest.raises(SamplerError, match=r"edge 3 -> 101: weight -1\.0 is not a number >= 0"):
        hard_sampler(tmp_path, [(3, 101, -1.0)])


def test_a_batch_ends_with_its_users_hard_negatives_and_their_rows(tmp_path):
    import pickle

    path = item_table(tmp_path / "items.tsv", [(i, 1.0, f"{i}:{i % 10}") for i in range(100, 140)])
    edges = edge_table(tmp_path / "edges.tsv", [(2, 120, 1.0), (2, 121, 1.0), (1, 130, 1.0)])
    hard = {"edge_input_path": edges, "user_id_field": "uid"}
    b = BatchBuilder(config_from_dict(dssm_config(path, hard_negatives=hard)), negatives=5)
    t = pa.table(
        {
            "user_id": ["u1", "u2", "u3"], "uid": [1, 3, 2], "age": [1, 2, 3], "item_id": [101, 102, 103],
            "cate_id": [1, 2, 3], "hist_item_id": ["1|2", "", "3"], "hist_cate_id": ["1|1", "", "2"],
            "price": [1.0, 2.0, 3.0], "clk": [1, 0, 1],
        }
    )  # fmt: skip
    batch = b.build(t, "t.parquet")
    assert batch.num_rows == 3 and batch.sampled_rows == 5 + 3
    assert batch.hard_negative_rows.tolist() == [0, 2, 2]  # user 1 at row 0, user 2 at row 2
    assert split_features(batch.sparse)["item_id"].values.tolist()[-3:] == [130, 120, 121]
    back = pickle.loads(pickle.dumps(batch))  # a worker's batch travels packed
    assert back.hard_negative_rows.tolist() == [0, 2, 2] and back.sampled_rows == 8
    with pytest.raises(DataError, match=r"missing column 'uid' \(data.negative_sampler.hard_negatives.user_id_field\)"):
        b.build(t.drop_columns(["uid"]), "t.parquet")
