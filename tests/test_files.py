"""dynarec.files: what the commands write for users and tools to read."""

import json
import math

import pytest

from dynarec.files import json_text


def test_json_text_is_strict_json_with_undefined_numbers_as_null():
    """metrics.json and the train / evaluate reports held a bare NaN where a metric is undefined on
    the data (a grouped AUC whose every group holds one class): Python reads it, JSON readers
    (jq, JavaScript, Go) refuse the file. Non-finite numbers are written as null."""
    report = {"eval": {"auc": 0.75, "grouped_auc": math.nan}, "losses": [[1, math.inf], [2, -math.inf]], "step": 3}
    text = json_text(report)

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    assert json.loads(text, parse_constant=refuse) == {
        "eval": {"auc": 0.75, "grouped_auc": None},
        "losses": [[1, None], [2, None]],
        "step": 3,
    }
    with pytest.raises(ValueError):
        json.loads(json.dumps(report), parse_constant=refuse)  # (what was written before)
