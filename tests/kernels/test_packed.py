"""Packed rows (dynarec.kernels.packed): tables of several dims end to end, looked up and updated by
the ops' plain-torch twins on a CPU as each table apart (the Triton kernels are held to the same
check in test_gpu_kernels.py), and refused where only a kernel may take them."""

import pytest
import torch

from dynarec.embedding.row_store import PackedRowStore
from dynarec.kernels.packed import packed_layout, table_views
from dynarec.optim import Adagrad, Adam
from dynarec.optim.fused import fused_bag_update
from tests.kernels import gpu_checks


def _op_update(args, *, lr, weight, states, rows, offsets, per_sample_weights, grad_out, layout):
    torch.ops.dynarec.bag_update(
        weight, states.get("momentum1"), states.get("momentum2"), grad_out, rows, offsets, per_sample_weights,
        None, 0, int(args.code), int(args.weight_decay_mode), lr, args.eps, args.weight_decay, args.beta1,
        args.beta2, args.bias1, args.bias2, None, 0, 0, layout,
    )  # fmt: skip


@pytest.mark.parametrize("spec", gpu_checks.SPECS, ids=repr)
def test_the_torch_twins_take_packed_rows_as_each_table_apart(spec):
    gpu_checks.check_packed("cpu", spec, max_len=20, pooled=torch.ops.dynarec.pooled, update=_op_update)


def test_the_layout_and_each_tables_views():
    layout = packed_layout([(2, 3), (4, 1), (1, 5)])
    assert layout.tolist() == [[0, 2, 6, 7], [0, 6, 10, 15], [3, 1, 5, 0]]
    flat = torch.arange(15.0)
    views = table_views(flat, layout)
    assert [tuple(v.shape) for v in views] == [(2, 3), (4, 1), (1, 5)]
    assert views[2].tolist() == [[10.0, 11.0, 12.0, 13.0, 14.0]]
    rowwise = table_views(torch.arange(7.0), layout)
    assert [v.flatten().tolist() for v in rowwise] == [[0.0, 1.0], [2.0, 3.0, 4.0, 5.0], [6.0]]


def test_packed_rows_are_refused_where_no_kernel_takes_them():
    with pytest.raises(ValueError, match="cannot take a row-gradient reducer"):
        PackedRowStore([(3, 4), (5, 8)], Adagrad(lr=0.1), grad_reducer=lambda rows, grad: (rows, grad))
    store = PackedRowStore([(3, 4), (5, 8)], Adam(lr=0.1))
    assert store.weight.shape == (3 * 4 + 5 * 8,) and store.dim == 8
    with pytest.raises(ValueError, match="packed rows are updated by the bag_update kernels only"):
        fused_bag_update(
            store.spec, lr=0.1, step=1, weight=store.weight, states=store.states, rows=torch.tensor([0]),
            offsets=torch.tensor([0, 1]), per_sample_weights=None, grad_out=torch.ones(1, 8),
            reducer=lambda rows, grad: (rows, grad), layout=store.layout,
        )  # fmt: skip
