"""`dynarec import-config` on every TorchEasyRec pipeline config vendored under
tests/config/tzrec/{examples,benchmark,tests}/ (65 files, unmodified; README.md there lists each
one's model): each converts and loads, or is refused with every reason naming a field path; with
``--lenient`` each converts, or is refused naming what cannot be dropped consistently. Every
model of the 65 is one dynarec has; they convert without ``--lenient``, except the one listed
below with its reason: 64 convert."""

import re
from pathlib import Path

import pytest

from dynarec.config import config_from_dict
from dynarec.config.tzrec import ConversionError, convert_pipeline_config
from dynarec.config.tzrec.model import tzrec_models

ROOT = Path(__file__).parent / "tzrec"
CONFIGS = sorted(
    str(p.relative_to(ROOT)) for d in ("examples", "benchmark", "tests") for p in (ROOT / d).rglob("*.config")
)

# The configs of a model dynarec has (the importer's list of TorchEasyRec's models it maps).
MODELS = "|".join(tzrec_models())
DYNAREC_MODELS = {name for name in CONFIGS if re.search(rf"^\s*({MODELS})\s*\{{", (ROOT / name).read_text(), re.M)}

# Of those, the ones refused, each with its reason (a regex the refusal must match).
REFUSED = {
    # TorchEasyRec's own example does not build in TorchEasyRec either: its WuKong raises 'dense mlp
    # last hidden_unit must be the same sparse feature dim' (128 against 16).
    "examples/wukong_criteo.config": r"model_config\.wukong\.dense_mlp: its last hidden unit \(128\) must equal",
}

# A refusal line: "  <field path>: <why>".
PATH = re.compile(r"^  (?:[A-Za-z_]\w*(?:\[\d+\])?)(?:\.[A-Za-z_]\w*(?:\[\d+\])?)*: \S")


def convert(name: str, **kw):
    path = ROOT / name
    return convert_pipeline_config(
        path.read_text(),
        train_input_path="d/train",
        eval_input_path="d/eval",
        sampler_input_path="d/items.tsv",
        hard_negative_edge_path="d/edges.tsv",
        tree_dir="d/tree",
        config_dir=path.parent,
        **kw,
    )


def refusal_lines(e: ConversionError) -> list[str]:
    _, *lines = str(e).splitlines()
    assert lines, f"a refusal lists its fields: {e}"
    return lines


def test_the_vendored_configs_are_the_65():
    assert len(CONFIGS) == 65
    assert len(DYNAREC_MODELS) == 65
    assert len(DYNAREC_MODELS - set(REFUSED)) == 64
    assert set(REFUSED) <= DYNAREC_MODELS


@pytest.mark.parametrize("name", CONFIGS)
def test_a_vendored_config_converts_or_is_refused_by_path(name):
    try:
        result = convert(name)
    except ConversionError as e:
        lines = refusal_lines(e)
        bad = [line for line in lines if not PATH.match(line)]
        assert not bad, f"refusals without a field path: {bad}"
        if name in DYNAREC_MODELS:
            assert name in REFUSED, f"{name} has a model dynarec has and must convert:\n{e}"
            assert re.search(REFUSED[name], str(e)), str(e)
        return
    assert name not in REFUSED, f"{name} converts now: take it out of REFUSED"
    assert not result.dropped
    config_from_dict(result.config)


@pytest.mark.parametrize("name", CONFIGS)
def test_lenient_converts_or_names_what_cannot_be_dropped(name):
    try:
        result = convert(name, lenient=True)
    except ConversionError as e:
        assert "--lenient cannot drop" in str(e), str(e)
        bad = [line for line in refusal_lines(e) if not PATH.match(line)]
        assert not bad, f"refusals without a field path: {bad}"
        return
    config = config_from_dict(result.config)
    names = {f.feature_name for f in config.features()}
    for g in config.model.feature_groups:  # what a dropped feature took with it is gone
        assert set(g.feature_names) <= names
    for line in result.dropped:
        assert PATH.match("  " + line), line
