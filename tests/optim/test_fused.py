"""The fused row update against the row-by-row reference, and one step by hand."""

import pytest
import torch

from dynarec.optim import SGD, Adagrad, Adam, RowWiseAdagrad, fused_row_update
from dynarec.optim.fused import RowScores, fused_bag_update
from dynarec.optim.reference import initial_states, reference_update

SPECS = [
    SGD(lr=0.1),
    Adagrad(lr=0.1, initial_accumulator_value=0.1),
    RowWiseAdagrad(lr=0.1, initial_accumulator_value=0.5),
    RowWiseAdagrad(lr=0.1, weight_decay=0.2, weight_decay_mode="l2"),
    RowWiseAdagrad(lr=0.1, weight_decay=0.2, weight_decay_mode="decoupled"),
    Adam(lr=0.1),
    Adam(lr=0.1, weight_decay=0.05, beta1=0.8, beta2=0.99),
]


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_fused_equals_reference_over_steps(spec):
    torch.manual_seed(0)
    n, d = 20, 8
    w_ref = torch.randn(n, d)
    s_ref = initial_states(spec, n, d)
    w, s = w_ref.clone(), {k: v.clone() for k, v in s_ref.items()}
    for step in range(1, 5):
        rows = torch.randperm(n)[:7]
        grad = torch.randn(7, d)
        dense = torch.zeros(n, d).index_copy_(0, rows, grad)
        fused_row_update(spec, lr=spec.lr, step=step, weight=w, states=s, rows=rows, grad=grad)
        reference_update(spec, lr=spec.lr, step=step, weight=w_ref, states=s_ref, touched=rows, dense_grad=dense)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    for k in s:
        torch.testing.assert_close(s[k], s_ref[k], rtol=1e-5, atol=1e-6)


def test_adagrad_one_step_by_hand_float32():
    spec = Adagrad(lr=0.5, initial_accumulator_value=0.1)
    w = torch.tensor([[1.0, -2.0]])
    s = initial_states(spec, 1, 2)
    g = torch.tensor([[0.5, 3.0]])
    fused_row_update(spec, lr=0.5, step=1, weight=w, states=s, rows=torch.tensor([0]), grad=g)
    h = torch.tensor([0.1 + 0.25, 0.1 + 9.0], dtype=torch.float32)
    expected = torch.tensor([1.0, -2.0]) - 0.5 * torch.tensor([0.5, 3.0]) / (h.sqrt() + 1e-8)
    assert torch.equal(s["momentum1"][0], h)
    torch.testing.assert_close(w[0], expected, rtol=0, atol=0)


def test_zero_gradient_still_moves_adam_and_decoupled_decay():
    # "Touched" rows are updated even with a zero gradient, as FBGEMM does.
    w = torch.ones(1, 2)
    s = initial_states(RowWiseAdagrad(), 1, 2)
    spec = RowWiseAdagrad(lr=0.1, weight_decay=0.5, weight_decay_mode="decoupled")
    fused_row_update(spec, lr=0.1, step=1, weight=w, states=s, rows=torch.tensor([0]), grad=torch.zeros(1, 2))
    torch.testing.assert_close(w, torch.full((1, 2), 0.95))


@pytest.mark.parametrize("with_reducer", [False, True], ids=["kernel", "torch"])
def test_bag_update_sets_the_scores_of_the_rows_it_updates(with_reducer):
    """``row_scores``: every row the update touches gets the value, once; no other row changes.
    The reducer (data-parallel tables) takes the plain-torch path; without it the CPU kernel."""
    spec = Adagrad(lr=0.1)
    weight = torch.randn(30, 4)
    states = {"momentum1": torch.zeros(30, 4)}
    rows = torch.tensor([3, 7, 3, 29, 0, 7, 7])
    offsets = torch.tensor([0, 2, 2, 5, 7])
    scores = torch.arange(30, dtype=torch.int64) - 100
    before = scores.clone()
    fused_bag_update(
        spec,
        lr=spec.lr,
        step=1,
        weight=weight,
        states=states,
        rows=rows,
        offsets=offsets,
        per_sample_weights=None,
        grad_out=torch.randn(4, 4),
        reducer=(lambda r, g: (r, g)) if with_reducer else None,
        row_scores=RowScores(scores, 1 << 41),
    )
    touched = torch.tensor([0, 3, 7, 29])
    assert torch.equal(scores[touched], torch.full((4,), 1 << 41))
    keep = torch.ones(30, dtype=torch.bool)
    keep[touched] = False
    assert torch.equal(scores[keep], before[keep])
