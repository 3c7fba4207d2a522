"""tokenize_feature: TorchEasyRec's own expected token ids (tzrec/features/tokenize_feature_test.py,
on its vendored tokenizer files), the text normalizer's options against hand-computed strings, and
the table a tokenizer gives."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dynarec.config import ConfigError
from dynarec.features.text import TextNormalizer, TokenizerError, tokenizer
from tests.data.test_kinds import build, config, ids

ASSETS = Path(__file__).parents[1] / "config" / "tzrec" / "tests" / "data" / "test"
BPE = str(ASSETS / "tokenizer.json")  # TorchEasyRec's data/test/tokenizer.json (GPT-NeoX BPE)
SPIECE = str(ASSETS / "spiece.model")  # TorchEasyRec's data/test/spiece.model


def tokenize(**kw):
    return {"tokenize_feature": {"feature_name": "t", "expression": "user:text", "embedding_dim": 16, **kw}}


@pytest.mark.parametrize(
    "vocab_file, kind, default_value, texts, normalizer, expected",
    [
        # TorchEasyRec's test_tokenize_feature cases
        (BPE, "bpe", "", ["abc efg", "", "hij"], None, [[19758, 299, 16054], [], [73, 1944]]),
        (BPE, "bpe", "xyz", ["abc efg", "", "hij"], None, [[19758, 299, 16054], [35609], [73, 1944]]),
        (
            BPE, "bpe", "", ["ABC efg", "", "HIJ"], {"norm_options": ["TEXT_UPPER2LOWER"]},
            [[19758, 299, 16054], [], [73, 1944]],
        ),
        # ... and test_tokenize_feature_sentencepiece's
        (SPIECE, "sentencepiece", "", ["abc efg", "", "hij"], None, [[703, 75, 3, 15, 89, 122], [], [7102, 354]]),
        (
            SPIECE, "sentencepiece", "xyz", ["abc efg", "", "hij"], None,
            [[703, 75, 3, 15, 89, 122], [3, 226, 63, 172], [7102, 354]],
        ),
    ],
)  # fmt: skip
def test_torcheasyrecs_token_ids(vocab_file, kind, default_value, texts, normalizer, expected):
    kw = {"vocab_file": vocab_file, "tokenizer_type": kind, "default_value": default_value}
    if normalizer is not None:
        kw["text_normalizer"] = normalizer
    assert ids(build(tokenize(**kw), text=texts), "t") == expected


def test_the_table_has_the_tokenizers_vocabulary_size():
    assert config(tokenize(vocab_file=BPE)).features()[0].table_rows == 50277  # with its added tokens
    assert config(tokenize(vocab_file=SPIECE, tokenizer_type="sentencepiece")).features()[0].table_rows == 32000


def test_null_rows_lists_of_texts_and_a_text_the_normalizer_empties():
    f = tokenize(vocab_file=BPE, default_value="xyz", text_normalizer={"norm_options": ["TEXT_FILTER"]})
    # null -> the default; a list -> each text's tokens in order; "!!" filtered to "" -> the default
    batch = build(f, text=pa.array([None, ["abc efg", "hij"], [], ["!!"]]))
    assert ids(batch, "t") == [[35609], [19758, 299, 16054, 73, 1944], [35609], [35609]]
    assert ids(build(tokenize(vocab_file=BPE), text=pa.array([None, "hij"])), "t") == [[], [73, 1944]]


@pytest.mark.parametrize(
    "options, text, expected",
    [
        (["TEXT_LOWER2UPPER"], "Abc déf", "ABC DÉF"),
        (["TEXT_UPPER2LOWER"], "Abc DÉF", "abc déf"),
        (["TEXT_SBC2DBC"], "Ｈｅｌｌｏ，\u3000ｗｏｒｌｄ！１２", "Hello, world!12"),
        (["TEXT_CHT2CHS"], "漢字繁體轉換", "汉字繁体转换"),
        (["TEXT_FILTER"], "a,b.c!d-e_f (g) ¥5 #1 ☺。", "abcdef g 5 1 "),
        (["TEXT_SPLITCHRS"], "abc中文字def 汉", "abc 中 文 字 def 汉"),
        (["TEXT_REMOVE_SPACE"], " a b\tc  d ", "abcd"),
        # TorchEasyRec's default: upper-case, half-width, simplified, filtered
        ([], "Ｈｅｌｌｏ, 漢字 World!", "HELLO 汉字 WORLD"),
        # several: applied in dynarec's order (SBC2DBC, CHT2CHS, case, FILTER, SPLITCHRS, REMOVE_SPACE)
        (["TEXT_REMOVE_SPACE", "TEXT_SPLITCHRS", "TEXT_UPPER2LOWER", "TEXT_SBC2DBC"], "ＡＢ 繁體", "ab繁體"),
    ],
)
def test_the_text_normalizer_options(options, text, expected):
    assert TextNormalizer(tuple(options))(text) == expected


def test_stop_char_file_and_max_length(tmp_path):
    stops = tmp_path / "stop_char"
    stops.write_text("a\nxy\n", encoding="utf-8")  # one or several characters a line
    assert TextNormalizer(("TEXT_FILTER",), str(stops))("a.bxcy!") == ".bc!"
    assert TextNormalizer(("TEXT_UPPER2LOWER",), max_length=3)("ABCDEF") == "abc"
    with pytest.raises(TokenizerError, match=r"stop_char_file .*missing"):
        TextNormalizer(("TEXT_FILTER",), str(tmp_path / "missing"))("a")


def test_bad_settings_and_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="TEXT_LOWER2UPPER and TEXT_UPPER2LOWER contradict"):
        config(tokenize(vocab_file=BPE, text_normalizer={"norm_options": ["TEXT_LOWER2UPPER", "TEXT_UPPER2LOWER"]}))
    with pytest.raises(ConfigError, match="norm_options"):
        config(tokenize(vocab_file=BPE, text_normalizer={"norm_options": ["TEXT_TITLECASE"]}))
    with pytest.raises(ConfigError, match="vocab_file"):
        config(tokenize())
    with pytest.raises(ConfigError, match="boundaries"):
        config(tokenize(vocab_file=BPE, boundaries=[1.0]))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json' cannot be read as a HuggingFace tokenizer\.json"):
        tokenizer(str(bad), "bpe")
    with pytest.raises(TokenizerError, match="cannot be read as a SentencePiece model"):
        tokenizer(str(bad), "sentencepiece")


def test_a_tokenizer_pickles_by_its_file():
    import pickle

    t = tokenizer(BPE, "bpe")
    assert pickle.loads(pickle.dumps(t)) is t  # a worker reads the file once, as its own
    ids_, lengths = t.encode(["abc efg", ""])
    assert ids_.dtype == np.int64 and ids_.tolist() == [19758, 299, 16054] and lengths.tolist() == [3, 0]


def test_a_batch_tokenizes_each_distinct_text_once_and_gives_every_row_its_own_ids():
    rng = np.random.default_rng(0)
    titles = ["Ａｂｃ efg", "hij", "", "漢字 xyz!", None]
    texts = [titles[i] for i in rng.integers(0, len(titles), 200)]
    f = tokenize(vocab_file=BPE, default_value="xyz", text_normalizer={})
    got = ids(build(f, text=texts), "t")
    normalize = config(f).features()[0].normalize
    tok = tokenizer(BPE, "bpe")
    want = [tok.encode([normalize(t or "") or "xyz"])[0].tolist() for t in texts]
    assert got == want
