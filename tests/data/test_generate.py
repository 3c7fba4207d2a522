"""``dynarec make-data --config C``: columns every feature of any config reads, of the types it
expects, with a learnable label."""

import pyarrow.parquet as pq
import pytest

from dynarec.cli import main
from dynarec.config import config_from_dict, load_config
from dynarec.config.tzrec import convert_pipeline_config
from dynarec.data import ArrowBatchDataset, BatchBuilder, make_loader
from dynarec.data.generate import GenerateSpec, make_config_data
from tests.config.test_tzrec import EXAMPLES
from tests.data.test_kinds import ids as ids_of
from tests.pipeline_fixtures import config_dict


def batches_of(config, directory):
    files = sorted(str(p) for p in (directory / "train").glob("*.parquet"))
    ds = ArrowBatchDataset(files, BatchBuilder(config), 64)
    ds.check_files()
    return list(make_loader(ds, 0))


def test_the_columns_of_the_pipeline_config_fixtures_build_batches(tmp_path):
    config = config_from_dict(config_dict())
    meta = make_config_data(config, tmp_path / "d", GenerateSpec(train_rows=300, eval_rows=100, train_files=2))
    assert meta["train_rows"] == 300 and 0.6 < meta["bayes_optimal_eval_auc"] <= 1.0
    (batch, *rest) = batches_of(config, tmp_path / "d")
    assert sum(b.num_rows for b in [batch, *rest]) == 300
    table = pq.read_table(tmp_path / "d" / "train" / "part-0.parquet")
    assert table.schema.field("user_id").type == "string"  # value_type: string
    assert table.schema.field("age").type == "int64"
    lengths = batch.sequence_lengths(["hist_item_id", "hist_cate_id"])
    assert lengths["hist_item_id"].tolist() == lengths["hist_cate_id"].tolist()  # one sequence group
    assert int(lengths["hist_item_id"].max()) <= 6 and int(lengths["hist_item_id"].min()) >= 1
    assert set(batch.labels.flatten().tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("name", ["dlrm_criteo", "deepfm_criteo", "multi_tower_din_taobao"])
def test_torcheasyrecs_examples_get_data_they_train_on(name, tmp_path):
    text = (EXAMPLES / f"{name}.config").read_text()
    result = convert_pipeline_config(text, train_input_path="d/train", eval_input_path="d/eval")
    config = config_from_dict(result.config)
    make_config_data(config, tmp_path / "d", GenerateSpec(train_rows=200, eval_rows=64, train_files=1))
    assert sum(b.num_rows for b in batches_of(config, tmp_path / "d")) == 200


def test_make_data_with_a_config_on_the_command_line(tmp_path, capsys):
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config_dict()))
    args = ["make-data", "--config", str(tmp_path / "c.yaml"), "--output-dir", str(tmp_path / "data")]
    assert main([*args, "--train-rows", "200", "--eval-rows", "50", "--max-sequence-length", "3"]) == 0
    assert "of the columns of" in capsys.readouterr().out
    config = load_config(tmp_path / "c.yaml")
    batches = batches_of(config, tmp_path / "data")
    assert sum(b.num_rows for b in batches) == 200
    lengths = [int(b.sequence_lengths(["hist_item_id"])["hist_item_id"].max()) for b in batches]
    assert max(lengths) == 3  # sequence_length 6, --max-sequence-length 3


def test_make_data_refuses_the_other_generators_options_and_takes_dot(tmp_path, capsys, monkeypatch):
    """--max-sequence-length without --config, and --num-users / --num-items with it, were
    silently ignored (histories up to 29 long; 54 distinct users for --num-users 3); --output-dir
    . failed with "PosixPath('.') has an empty name"."""
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config_dict()))
    rows = ["--train-rows", "100", "--eval-rows", "50"]
    assert main(["make-data", "--output-dir", str(tmp_path / "a"), *rows, "--max-sequence-length", "3"]) == 2
    assert "--max-sequence-length goes with --config" in capsys.readouterr().err
    args = ["make-data", "--config", str(tmp_path / "c.yaml"), "--output-dir", str(tmp_path / "b"), *rows]
    assert main([*args, "--num-users", "3"]) == 2
    assert "--num-users shapes the demo's click log, not --config's data" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert main(["make-data", "--output-dir", ".", *rows, "--num-users", "30"]) == 0
    assert (tmp_path / "here" / "meta.json").is_file()


def test_make_data_of_a_config_using_every_kind_builds_batches(tmp_path):
    """Columns of the right types for every kind (map columns for lookup, nested maps for match,
    vector columns for value_dim, dense sequences, vocabulary words, id:weight pairs); a vocab_file
    that does not exist is written where the config names it."""
    from tests.config.test_config import every_kind_config

    c = every_kind_config()
    vocab = tmp_path / "vocab" / "words.txt"
    c["feature_configs"] += [
        {
            "id_feature": {
                "feature_name": "vf",
                "embedding_dim": 4,
                "vocab_file": str(vocab),
                "default_bucketize_value": 0,
            }
        },
        {"id_feature": {"feature_name": "wt", "embedding_dim": 4, "num_buckets": 50, "weighted": True}},
        {"lookup_feature": {"feature_name": "lv", "map": "user:mv", "key": "item:kv", "value_dim": 3}},
        {
            "lookup_feature": {
                "feature_name": "ld",
                "map": "user:md",
                "key": "item:kd",
                "vocab_list": ["x", "y"],
                "embedding_dim": 4,
            }
        },
        {"match_feature": {"feature_name": "mn", "nested_map": "user:nn", "pkey": "item:pp", "skey": "item:ss"}},
    ]
    c["feature_configs"][-1]["match_feature"].update(num_buckets=20, embedding_dim=4)
    c["model"]["feature_groups"][1]["feature_names"] += ["vf", "wt", "lv", "ld", "mn"]
    config = config_from_dict(c)
    meta = make_config_data(config, tmp_path / "d", GenerateSpec(train_rows=300, eval_rows=64, train_files=2))
    assert meta["vocab_files_written"] == [str(vocab)] and vocab.read_text().startswith("vf_w0\n")
    table = pq.read_table(tmp_path / "d" / "train" / "part-0.parquet")
    types = {name: str(table.schema.field(name).type) for name in table.column_names}
    assert types["m"].startswith("map<string, double") and types["mv"].startswith("map<string, string")
    assert types["n"].startswith("map<string, string") and types["r"].startswith("list<")
    assert types["s"].count("list<") == 2 and types["v"] == "string" and types["q"] == "string"
    assert set(table.column("v").to_pylist()) & {"a", "b"}
    assert ":" in table.column("wt").to_pylist()[0]
    batches = batches_of(config, tmp_path / "d")
    assert sum(b.num_rows for b in batches) == 300
    b = batches[0]
    assert b.dense["lv"].shape == (64, 3) and b.dense["s"].shape[2] == 2 and b.dense_lengths["s"].shape == (64,)
    assert b.sparse.weights_or_none() is not None
    assert float((b.dense["lv"] != 0).float().mean()) > 0.05  # the map is keyed by what the key column holds


def test_torcheasyrecs_fg_mock_with_every_kind_gets_data_it_trains_on(tmp_path):
    """The vendored multi_tower_din_fg_mock (combo, lookup with feature: keys, match, expr,
    EditDistance, raw value_dim 4, autodis / mlp, dense sequences), imported with --lenient."""
    from tests.config.test_tzrec import EXAMPLES

    text = (EXAMPLES / "tests" / "multi_tower_din_fg_mock.config").read_text()
    result = convert_pipeline_config(text, train_input_path="d/train", eval_input_path="d/eval", lenient=True)
    config = config_from_dict(result.config)
    assert {f.KIND for f in config.features()} >= {"combo_feature", "lookup_feature", "match_feature", "expr_feature"}
    make_config_data(config, tmp_path / "d", GenerateSpec(train_rows=200, eval_rows=64, train_files=1))
    assert sum(b.num_rows for b in batches_of(config, tmp_path / "d")) == 200


def test_every_kind_builds_the_same_batch_on_the_python_path(tmp_path):
    """The C++ extension's paths (split-and-hash, hashing, EditDistance) and pyarrow's give one
    batch, for every kind; an empty and a one-row table build too."""
    import torch

    from dynarec.features import native
    from tests.config.test_config import every_kind_config

    config = config_from_dict(every_kind_config())
    make_config_data(config, tmp_path / "d", GenerateSpec(train_rows=200, eval_rows=8, train_files=1))
    table = pq.read_table(tmp_path / "d" / "train" / "part-0.parquet")
    builder = BatchBuilder(config)
    fast = builder.build(table, "t.parquet")
    with native.python_path():
        slow = builder.build(table, "t.parquet")
    assert torch.equal(fast.sparse.values(), slow.sparse.values())
    assert torch.equal(fast.sparse.lengths(), slow.sparse.lengths())
    assert fast.dense.keys() == slow.dense.keys() and all(torch.equal(fast.dense[k], slow.dense[k]) for k in fast.dense)
    for n in (0, 1):
        b = builder.build(table.slice(0, n), "t.parquet")
        assert b.num_rows == n and b.dense["s"].shape[:1] == (n,) and b.dense_lengths["s"].shape == (n,)


def test_make_data_writes_every_label_of_a_multi_task_model(tmp_path):
    """A click, a purchase that needs the click, a class label and a regression target."""
    from tests.models.test_models import model_config

    raw = model_config("mmoe").model_dump(mode="json", exclude_unset=True)
    raw["model"]["mmoe"]["task_towers"] += [
        {"tower_name": "stars", "label_name": "stars", "num_class": 3, "losses": [{"softmax_cross_entropy": {}}]},
        {"tower_name": "dwell", "label_name": "dwell", "losses": [{"l2_loss": {}}]},
    ]
    config = config_from_dict(raw)
    make_config_data(config, tmp_path / "d", GenerateSpec(train_rows=2000, eval_rows=100, train_files=1))
    table = pq.read_table(tmp_path / "d" / "train" / "part-0.parquet")
    click, buy = table.column("label").to_numpy(), table.column("label2").to_numpy()
    assert set(click) == {0, 1} and set(buy) == {0, 1}
    assert (buy <= click).all() and buy.mean() < click.mean()
    assert sorted(set(table.column("stars").to_pylist())) == [0, 1, 2]
    assert table.schema.field("dwell").type == "double"
    (batch, *_) = batches_of(config, tmp_path / "d")
    assert batch.labels.shape == (64, 4)  # label, label2, stars, dwell: Config.label_fields()


def test_a_model_scoring_candidates_gets_a_label_list_a_row_one_value_a_candidate(tmp_path):
    """dlrm_hstu: a bitmask label (0..255, bit 0 the most frequent) and a regression target, a list a
    row aligned with the row's candidates, whose labels follow their ids; histories' times ascend
    up to the candidates' query time; a sequence_length of 8000 draws at most max_sequence_length."""
    import copy

    import numpy as np
    import pyarrow as pa

    from dynarec.metrics import auc
    from tests.models.test_dlrm_hstu import CONFIG

    c = copy.deepcopy(CONFIG)
    for f in c["feature_configs"][2:5]:  # the history's: TorchEasyRec's HSTU configs keep 8000
        next(iter(f.values()))["sequence_length"] = 8000
    towers = c["model"]["dlrm_hstu"]["task_towers"]
    towers += [{"tower_name": f"bit{k}", "label_name": "actions", "task_bitmask": 1 << k} for k in range(2, 8)]
    towers.append({"tower_name": "watch", "label_name": "watch_time", "losses": [{"l2_loss": {}}]})
    config = config_from_dict(c)
    spec = GenerateSpec(train_rows=3000, eval_rows=1000, train_files=1, max_sequence_length=7)
    meta = make_config_data(config, tmp_path / "d", spec)
    assert 0.1 < meta["eval_click_rate"] < 0.6 and meta["bayes_optimal_eval_auc"] > 0.7

    def read(part):
        table = pq.read_table(tmp_path / "d" / part / "part-0.parquet")
        candidates = [s.split("|") for s in table.column("cand_item").to_pylist()]
        return table, candidates

    table, candidates = read("train")
    assert table.schema.field("actions").type == pa.list_(pa.int64())
    assert table.schema.field("watch_time").type == pa.list_(pa.float64())
    actions, watch = table.column("actions").to_pylist(), table.column("watch_time").to_pylist()
    times, query = table.column("hist_time").to_pylist(), table.column("cand_time").to_pylist()
    for cands, a, w, t, q in zip(candidates, actions, watch, times, query):
        assert 1 <= len(cands) <= 5 and len(a) == len(w) == len(q) == len(cands)
        assert 1 <= len(t) <= 7 and t == sorted(t) and len(set(q)) == 1 and q[0] >= t[-1] > 1.5e9
    history_actions = np.concatenate([np.array(a) for a in table.column("hist_action").to_pylist()])
    assert np.all(history_actions == np.round(history_actions)) and 0 <= history_actions.min()
    assert history_actions.max() < 256 and np.mean(history_actions.astype(np.int64) & 1) > 0.3  # bitmasks
    flat = np.concatenate([np.array(a, dtype=np.int64) for a in actions])
    assert flat.min() >= 0 and flat.max() < 256
    rates = [float(np.mean(flat >> k & 1)) for k in range(8)]
    assert rates[:5] == sorted(rates[:5], reverse=True) and rates[0] > 0.1 and rates[4] > 0
    assert sum(b.num_rows for b in batches_of(config, tmp_path / "d")) == 3000  # the reader checks the lists

    # A candidate's click follows its id: each id's click rate on train ranks eval's candidates.
    ids = np.concatenate([np.array(c, dtype=np.int64) for c in candidates])
    clicks = flat & 1
    rate = np.bincount(ids, clicks, 50) / np.maximum(np.bincount(ids, minlength=50), 1)
    table, candidates = read("eval")
    ids = np.concatenate([np.array(c, dtype=np.int64) for c in candidates])
    clicks = np.concatenate([np.array(a, dtype=np.int64) for a in table.column("actions").to_pylist()]) & 1
    assert auc(rate[ids], clicks) > 0.65


def test_max_sequence_length_must_be_positive():
    with pytest.raises(ValueError, match="max_sequence_length"):
        GenerateSpec(max_sequence_length=0)


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_a_tokenize_feature_gets_texts_and_a_tokenizer_where_its_file_is_missing(kind, tmp_path):
    """Texts of made-up words; a tokenizer of the feature's type trained on them after its
    normalizer (upper-cased here: TorchEasyRec's default), which tokenizes them without unknowns."""
    from tests.config.test_config import every_kind_config

    c = every_kind_config()
    path = tmp_path / "tok" / ("tokenizer.json" if kind == "bpe" else "spiece.model")
    feature = {"feature_name": "title", "embedding_dim": 4, "vocab_file": str(path), "tokenizer_type": kind}
    c["feature_configs"].append({"tokenize_feature": {**feature, "text_normalizer": {}}})
    c["model"]["feature_groups"][1]["feature_names"].append("title")
    config = config_from_dict(c)
    meta = make_config_data(config, tmp_path / "d", GenerateSpec(train_rows=200, eval_rows=64, train_files=1))
    assert meta["vocab_files_written"] == [str(path)]
    texts = pq.read_table(tmp_path / "d" / "train" / "part-0.parquet").column("title").to_pylist()
    assert all(1 <= len(t.split(" ")) <= 6 for t in texts) and texts[0].islower()
    tok = config.features()[-1].tokenizer()
    ids, lengths = tok.encode([config.features()[-1].normalize(t) for t in texts])
    assert lengths.min() >= 1 and ids.max() < tok.vocab_size
    if kind == "bpe":  # no word falls back to the unknown token
        assert tok._hf.token_to_id("[UNK]") not in set(ids.tolist())
    (batch, *_) = batches_of(config, tmp_path / "d")
    assert min(len(row) for row in ids_of(batch, "title")) >= 1


def test_overlap_kv_dot_product_and_bool_mask_get_columns_that_meet(tmp_path):
    """Terms of a few words (so queries and titles overlap), k:w terms, and a mask as long as its
    values row by row."""
    from tests.config.test_config import every_kind_config

    c = every_kind_config()
    c["feature_configs"] += [
        {"overlap_feature": {"feature_name": "ov", "query": "user:oq", "title": "item:ot", "method": "is_contain"}},
        {"kv_dot_product": {"feature_name": "kv", "query": "user:kq", "document": "item:kd"}},
        {"bool_mask_feature": {"feature_name": "bm", "expression": ["user:bv", "user:bk"], "num_buckets": 50,
                               "embedding_dim": 4}},
    ]  # fmt: skip
    c["model"]["feature_groups"][1]["feature_names"] += ["ov", "kv", "bm"]
    config = config_from_dict(c)
    make_config_data(config, tmp_path / "d", GenerateSpec(train_rows=200, eval_rows=64, train_files=1))
    (batch, *_) = batches_of(config, tmp_path / "d")
    assert 0 < float((batch.dense["ov"] > 0).float().mean()) < 1 and float((batch.dense["kv"] > 0).float().mean()) > 0
    table = pq.read_table(tmp_path / "d" / "train" / "part-0.parquet")
    values, mask = table.column("bv").to_pylist(), table.column("bk").to_pylist()
    assert all(len(v.split("\x1d")) == len(m.split("\x1d")) for v, m in zip(values, mask))
    kept = ids_of(batch, "bm")
    assert sum(map(len, kept)) < sum(len(v.split("\x1d")) for v in values[: len(kept)])


def test_a_data_directory_is_replaced_by_any_generator_when_it_holds_only_what_its_meta_lists(tmp_path):
    """make-data replaces a data directory whose meta.json lists every file it holds, whatever
    wrote it (a config's generator with an item table, then the click log), and refuses one
    holding a file it does not list, naming it."""
    from dynarec.data.synthetic import SyntheticSpec, make_click_log
    from tests.data.test_sampler import dssm_config

    out = tmp_path / "data"
    c = dssm_config(str(out / "items.tsv"))
    c["data"]["train_input_path"], c["data"]["eval_input_path"] = str(out / "train"), str(out / "eval")
    meta = make_config_data(config_from_dict(c), out, GenerateSpec(train_rows=200, eval_rows=50, seed=1))
    assert "items.tsv" in meta["files"] and "train/part-0.parquet" in meta["files"]
    make_click_log(out, SyntheticSpec(train_rows=200, eval_rows=50))
    assert not (out / "items.tsv").exists()
    (out / "eval" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"\(it holds \['eval/notes.txt'\]\)"):
        make_click_log(out, SyntheticSpec(train_rows=200, eval_rows=50))
    assert (out / "eval" / "notes.txt").read_text() == "mine"
