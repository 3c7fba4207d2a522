"""The optimizer registry: one place declares an optimizer, and every layer picks it up."""

from dataclasses import dataclass

import pytest
import torch

from dynarec import DynamicTableOptions, EmbeddingCollection, JaggedBatch, TableConfig
from dynarec.config import ConfigError, config_from_dict
from dynarec.optim import OptimizerDef, OptimizerSpec, StateSpec, definition, register, registered
from dynarec.optim.base import check_positive
from dynarec.optim.reference import initial_states, reference_update
from dynarec.optim.registry import unregister
from dynarec.planner import plan_from_config
from tests.matrix import needs_fbgemm
from tests.pipeline_fixtures import config_dict


@dataclass(frozen=True)
class SignSGD(OptimizerSpec):
    """A throwaway optimizer: ``v += |g|``; ``w -= lr * scale * sign(g)``."""

    scale: float = 1.0

    def _validate(self) -> None:
        check_positive("SignSGD", "scale", self.scale)

    def state_specs(self):
        return (StateSpec("velocity", rowwise=False, initial_value=0.5),)


def _native(spec, *, lr, step, weight, states, rows, grad):
    states["velocity"].index_add_(0, rows, grad.abs())
    weight.index_add_(0, rows, grad.sign(), alpha=-lr * spec.scale)


def _reference(spec, *, lr, step, w, states, g):
    states["velocity"] += g.abs()
    w -= lr * spec.scale * torch.sign(g)


@pytest.fixture
def sign_sgd():
    defn = register(
        OptimizerDef(
            spec=SignSGD,
            yaml_key="sign_sgd_optimizer",
            native_update=_native,
            reference_update=_reference,
            fbgemm="FBGEMM has no sign SGD",
        )
    )
    yield defn
    unregister(SignSGD)
    assert SignSGD not in [d.spec for d in registered()]


def test_a_registered_optimizer_reaches_yaml_plan_tables_and_reference(sign_sgd):
    cfg = config_from_dict(config_dict(train__sparse_optimizer={"sign_sgd_optimizer": {"lr": 0.1, "scale": 2.0}}))
    assert cfg.train.sparse_optimizer == SignSGD(lr=0.1, scale=2.0)
    plan = plan_from_config(cfg)
    assert {t.optimizer for t in plan.tables} == {SignSGD(lr=0.1, scale=2.0)}
    # A fixed and a dynamic table trained by it, against the registered reference.
    spec = SignSGD(lr=0.1, scale=2.0)
    coll = EmbeddingCollection(
        [
            TableConfig(name="f", dim=3, num_embeddings=6, features=["a"]),
            TableConfig(name="d", dim=3, dynamic=DynamicTableOptions(64), features=["b"]),
        ],
        spec,
    )
    weight = coll.read_rows("f", torch.arange(6))["weight"]
    states = initial_states(spec, 6, 3)
    assert torch.equal(coll.read_rows("f", torch.arange(6))["velocity"], states["velocity"])
    out = coll(JaggedBatch.from_lists({"a": [[1, 1, 4], [2]], "b": [[10], [10]]}))
    g = torch.tensor([[1.0, -2.0, 0.5], [-1.0, 1.0, 3.0]])
    d_before = coll.read_rows("d", torch.tensor([10]))
    ((out["a"] * g).sum() + (out["b"] * g).sum()).backward()
    dense = torch.zeros(6, 3)
    dense[1] += 2 * g[0]
    dense[4] += g[0]
    dense[2] += g[1]
    reference_update(
        spec, lr=0.1, step=1, weight=weight, states=states, touched=torch.tensor([1, 4, 2]), dense_grad=dense
    )
    rows = coll.read_rows("f", torch.arange(6))
    torch.testing.assert_close(rows["weight"], weight, rtol=0, atol=0)
    torch.testing.assert_close(rows["velocity"], states["velocity"], rtol=0, atol=0)
    d_after = coll.read_rows("d", torch.tensor([10]))
    g_key = g.sum(0)  # key 10 in both samples: one update with the summed gradient
    torch.testing.assert_close(d_after["weight"], d_before["weight"] - 0.2 * g_key.sign(), rtol=0, atol=0)
    torch.testing.assert_close(d_after["velocity"], 0.5 + g_key.abs()[None], rtol=0, atol=0)


def test_a_registered_optimizer_validates_its_yaml_fields(sign_sgd):
    with pytest.raises(
        ConfigError,
        match=r"train.sparse_optimizer: sign_sgd_optimizer: unknown key 'eps' for "
        r"SignSGD; allowed keys: lr, gradient_clipping, max_gradient, scale",
    ):
        config_from_dict(config_dict(train__sparse_optimizer={"sign_sgd_optimizer": {"eps": 0.1}}))
    with pytest.raises(ConfigError, match=r"SignSGD.scale must be > 0"):
        config_from_dict(config_dict(train__sparse_optimizer={"sign_sgd_optimizer": {"scale": 0}}))


@needs_fbgemm
def test_a_registered_optimizer_without_fbgemm_mapping_is_refused_by_fbgemm(sign_sgd):
    with pytest.raises(
        ValueError,
        match=r"table 't': SignSGD is not supported by backend 'fbgemm' "
        r"\(FBGEMM has no sign SGD\); use backend='native'",
    ):
        EmbeddingCollection(
            [TableConfig(name="t", dim=4, num_embeddings=6, features=["a"], backend="fbgemm")], SignSGD()
        )


def test_unregistered_spec_is_a_type_error():
    @dataclass(frozen=True)
    class Stray(OptimizerSpec):
        pass

    with pytest.raises(TypeError, match="Stray is not a registered optimizer"):
        definition(Stray())
    with pytest.raises(ValueError, match="yaml_key 'adagrad_optimizer' is taken"):
        register(
            OptimizerDef(
                spec=Stray,
                yaml_key="adagrad_optimizer",
                native_update=_native,
                reference_update=_reference,
                fbgemm="no",
            )
        )
