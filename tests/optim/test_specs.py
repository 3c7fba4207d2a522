import dataclasses
import math

import pytest

from dynarec.optim import SGD, Adagrad, Adam, RowWiseAdagrad, registered, spec_from_yaml, spec_to_yaml


def test_defaults_match_fbgemm():
    assert Adagrad().lr == 0.01 and Adagrad().eps == 1e-8 and Adagrad().initial_accumulator_value == 0.0
    assert (Adam().beta1, Adam().beta2, Adam().weight_decay) == (0.9, 0.999, 0.0)
    assert RowWiseAdagrad().weight_decay_mode == "none"


@pytest.mark.parametrize(
    "cls, field, value",
    [
        (SGD, "lr", -0.1),
        (SGD, "lr", math.nan),
        (SGD, "lr", math.inf),
        (SGD, "lr", "0.1"),
        (Adagrad, "eps", 0.0),
        (Adagrad, "eps", -1e-8),
        (Adagrad, "eps", math.nan),
        (Adagrad, "initial_accumulator_value", -0.1),
        (Adagrad, "initial_accumulator_value", math.nan),
        (RowWiseAdagrad, "initial_accumulator_value", -1.0),
        (RowWiseAdagrad, "weight_decay", -0.01),
        (RowWiseAdagrad, "weight_decay_mode", "counter"),
        (Adam, "beta1", 1.0),
        (Adam, "beta1", -0.1),
        (Adam, "beta2", 1.5),
        (Adam, "beta2", math.nan),
        (Adam, "weight_decay", -1.0),
        (Adam, "eps", 0.0),
    ],
)
def test_invalid_field_names_the_field(cls, field, value):
    with pytest.raises(ValueError, match=f"{cls.__name__}.{field}"):
        cls(**{field: value})


def test_rowwise_weight_decay_without_mode_is_an_error():
    with pytest.raises(ValueError, match="weight_decay_mode"):
        RowWiseAdagrad(weight_decay=0.1)
    assert RowWiseAdagrad(weight_decay=0.1, weight_decay_mode="decoupled").weight_decay == 0.1


def test_specs_are_immutable():
    spec = Adagrad(lr=0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.lr = 0.2  # type: ignore[misc]
    assert spec.replace(lr=0.2).lr == 0.2 and spec.lr == 0.1


@pytest.mark.parametrize(
    "cls, key, message",
    [
        (SGD, "initial_accumulator_value", "SGD has no accumulator"),
        (Adam, "initial_accumulator_value", "Adam has no accumulator"),
        (SGD, "eps", "unknown key 'eps'"),
        (Adagrad, "weight_decay", "Adagrad has no weight decay"),
        (SGD, "weight_decay", "unknown key 'weight_decay'"),
        (Adam, "weight_decay_mode", "unknown key 'weight_decay_mode'"),
        (Adagrad, "learning_rate", "unknown key 'learning_rate'"),
        (RowWiseAdagrad, "max_norm", "'max_norm' is not supported"),
        (Adam, "counter_based_regularization", "COUNTER"),
    ],
)
def test_from_dict_rejects_keys_by_name(cls, key, message):
    with pytest.raises(ValueError, match=message) as e:
        cls.from_dict({"lr": 0.1, key: 0.1}, where="train.sparse_optimizer")
    assert "train.sparse_optimizer" in str(e.value)


@pytest.mark.parametrize("cls", [SGD, Adagrad, RowWiseAdagrad, Adam])
def test_gradient_clipping_on_every_optimizer_validated(cls):
    spec = cls.from_dict({"lr": 0.1, "gradient_clipping": True, "max_gradient": 0.5})
    assert (spec.gradient_clipping, spec.max_gradient) == (True, 0.5)
    assert cls.from_dict(spec.to_dict()) == spec
    assert (cls().gradient_clipping, cls().max_gradient) == (False, 1.0)
    with pytest.raises(ValueError, match=rf"where: {cls.__name__}.max_gradient must be > 0"):
        cls.from_dict({"gradient_clipping": True, "max_gradient": 0.0}, where="where")
    with pytest.raises(ValueError, match=rf"{cls.__name__}.gradient_clipping must be true or false, got 1"):
        cls(gradient_clipping=1)


def test_from_dict_builds_and_validates():
    spec = Adagrad.from_dict({"lr": 0.05, "initial_accumulator_value": 0.1})
    assert spec == Adagrad(lr=0.05, initial_accumulator_value=0.1)
    with pytest.raises(ValueError, match=r"cfg: Adam.beta2 must be in \[0, 1\)"):
        Adam.from_dict({"beta2": 1.0}, where="cfg")


def test_spec_from_yaml_by_registered_key():
    assert spec_from_yaml({"rowwise_adagrad_optimizer": {"lr": 0.2}}, "cfg") == RowWiseAdagrad(lr=0.2)
    with pytest.raises(ValueError, match="cfg: unknown optimizer 'lamb_optimizer'"):
        spec_from_yaml({"lamb_optimizer": {}}, "cfg")
    with pytest.raises(ValueError, match="cfg: give exactly one of"):
        spec_from_yaml({"sgd_optimizer": {}, "adam_optimizer": {}}, "cfg")
    assert {d.yaml_key for d in registered()} == {
        "sgd_optimizer",
        "adagrad_optimizer",
        "rowwise_adagrad_optimizer",
        "adam_optimizer",
    }
    for spec in (SGD(lr=0.3), Adagrad(initial_accumulator_value=0.1), Adam(beta1=0.5)):
        assert spec_from_yaml(spec_to_yaml(spec), "cfg") == spec


def test_state_layout():
    assert SGD().state_specs() == ()
    (m,) = Adagrad(initial_accumulator_value=0.1).state_specs()
    assert (m.name, m.width(16), m.initial_value) == ("momentum1", 16, 0.1)
    (m,) = RowWiseAdagrad(initial_accumulator_value=1.0).state_specs()
    assert (m.name, m.width(16), m.initial_value) == ("momentum1", 1, 1.0)
    m1, m2 = Adam().state_specs()
    assert (m1.name, m1.width(8), m2.name, m2.width(8)) == ("momentum1", 8, "momentum2", 8)
    assert (m1.initial_value, m2.initial_value) == (0.0, 0.0)
