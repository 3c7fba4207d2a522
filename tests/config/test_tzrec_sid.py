"""import-config of TorchEasyRec's semantic-id models (sid_model.proto): the vendored configs map
field by field; what dynarec would read otherwise is refused by path."""

from pathlib import Path

import pytest

from dynarec.config import config_from_dict
from dynarec.config.tzrec import ConversionError, convert_pipeline_config

TESTS = Path(__file__).parent / "tzrec" / "tests"


def convert(text: str, **kw):
    return convert_pipeline_config(text, train_input_path="d/train", eval_input_path="d/eval", **kw)


def test_the_rqvae_mock_maps_its_losses_and_first_group():
    block = convert((TESTS / "sid_rqvae_mock.config").read_text()).config["model"]["sid_rqvae"]
    assert block["codebook"] == [16, 16, 16] and block["embed_dim"] == 8 and block["hidden_dims"] == [16]
    assert block["recon_loss"] == {"type": "l2"}
    assert block["commitment_loss"] == {"latent_weight": [1.0, 0.5], "type": "l2"}
    assert block["input"] == "deep" and "contrastive" not in block


def test_the_contrastive_mock_is_one_contrastive_setting():
    result = convert((TESTS / "sid_rqvae_contrastive_mock.config").read_text())
    config = config_from_dict(result.config)
    assert config.model.sid_rqvae.contrastive.model_dump() == {"pair_group": "pair", "pair_flag_group": "pair_flag"}
    assert config.label_fields() == []


def test_the_rqkmeans_mock_maps_faiss_kwargs():
    block = convert((TESTS / "sid_rqkmeans_mock.config").read_text()).config["model"]["sid_rqkmeans"]
    assert block["kmeans"] == {"niter": 5, "seed": 42} and block["normalize_residuals"] is False


RQVAE = (TESTS / "sid_rqvae_mock.config").read_text()


@pytest.mark.parametrize(
    ("old", "new", "path"),
    [
        (
            "kmeans_init: false\n    }",
            "kmeans_init: false\n        contrastive_config { "
            'pair_feature_group: "deep" pair_flag_feature_group: "deep" }\n    }',
            r"sid_rqvae\.contrastive_config: contrastive_config and a contrastive_loss must be set together",
        ),
        (
            'forward_mode: "ste"',
            'forward_mode: "soft"',
            r"model_config\.sid_rqvae\.forward_mode: 'soft' is not supported",
        ),
        (
            "kmeans_init: false",
            'kmeans_init: false\n        candidate_output_config { enabled: true topk: 4 strategy: "beam" }',
            r"candidate_output_config\.strategy",
        ),
    ],
)
def test_what_an_rqvae_cannot_carry_is_refused_by_path(old, new, path):
    assert old in RQVAE
    with pytest.raises(ConversionError, match=path):
        convert(RQVAE.replace(old, new))


def test_gumbel_softmax_turns_sinkhorn_off_as_torcheasyrec_does_and_candidates_map():
    text = RQVAE.replace('forward_mode: "ste"', 'forward_mode: "gumbel_softmax"').replace(
        "kmeans_init: false", "kmeans_init: false\n        candidate_output_config { enabled: true topk: 4 }"
    )
    result = convert(text)
    block = result.config["model"]["sid_rqvae"]
    assert block["sinkhorn"] == {"enabled": False} and block["candidate_output"] == {"top_k": 4}
    assert any("Sinkhorn is turned off" in n for n in result.notes)
    config_from_dict(result.config)


def test_rqkmeans_takes_no_loss():
    text = (
        (TESTS / "sid_rqkmeans_mock.config")
        .read_text()
        .replace("model_config {", "model_config {\n    losses { recon_loss {} }")
    )
    with pytest.raises(ConversionError, match=r"model_config\.losses: sid_rqkmeans trains by k-means"):
        convert(text)
