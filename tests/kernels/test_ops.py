"""The one op surface, ``torch.ops.dynarec.*``: every op registered with its schema, each op on a
CPU equal to its plain-torch twin, fake implementations that agree with the real ones
(``torch.library.opcheck``), and ops that trace: ``torch.export`` and ``torch.compile(fullgraph)``
of a lookup through ``find`` and ``pooled``, and an export of an insert plan (data-dependent
output sizes)."""

import pytest
import torch

from dynarec.embedding.hash_index import BucketedHashIndex
from dynarec.kernels import reference
from dynarec.kernels.ops import SCHEMAS
from dynarec.optim.kernel import KernelCode, WeightDecayCode

OPS = sorted(SCHEMAS)


def test_every_op_is_registered_with_its_schema():
    for name in OPS:
        schema = str(getattr(torch.ops.dynarec, name).default._schema)
        assert schema.startswith(f"dynarec::{name}("), schema


def filled_index(num_buckets=8, bucket_size=4, n=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    index = BucketedHashIndex(num_buckets, bucket_size)
    keys = torch.randint(-(2**62), 2**62, (n,), generator=g).unique()
    index.commit(index.plan_insert(keys, allow_evict=False), torch.randint(0, 9, keys.shape, generator=g))
    return index, keys


def sample_args():
    """Arguments of each op: an index with keys, queries with absent keys, bags of repeated rows."""
    index, keys = filled_index()
    query = torch.cat([keys[:7], torch.tensor([-5, 12345])])
    arrays = (index.tags, index.keys, index.scores, index.pins, index.num_buckets, index.bucket_size)
    new = torch.tensor([3, -9, 77, 1 << 40, 5])
    weight, rows = torch.randn(10, 3), torch.tensor([1, 4, 1, 9, 0, 4])
    offsets, psw = torch.tensor([0, 2, 2, 6]), torch.rand(6) + 0.5
    free = torch.nonzero(index.tags == 0).flatten()[: new.numel()]
    adam = [KernelCode.ADAM, WeightDecayCode.DECOUPLED, 0.1, 1e-8, 0.01, 0.9, 0.99, 0.1, 0.01]
    sgd = [KernelCode.SGD, WeightDecayCode.NONE, 0.1, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    scores, bags = torch.zeros(10, dtype=torch.int64), (rows, offsets, psw)
    return {
        "find": [(index.keys, index.tags, index.num_buckets, index.bucket_size, query, flag) for flag in (True, False)],
        "candidate_buckets": [(query, 7), (query, 1)],
        "plan_insert": [
            (*arrays, new, torch.arange(new.numel()), None, None, True),
            (*arrays, new, torch.arange(new.numel()).flip(0), torch.tensor([2]), torch.tensor([2, 3]), False),
        ],
        "place_keys": [
            (index.keys.clone(), index.scores.clone(), index.tags.clone(), free, new, torch.ones_like(new)),
            # keys left without a slot (-1), zero scores (not written: a free slot holds 0)
            (
                index.keys.clone(),
                index.scores.clone(),
                index.tags.clone(),
                torch.cat([free[:3], torch.tensor([-1, -1])]),
                new,
                torch.tensor([0, 5, 0, 2, 1]),
            ),
        ],
        "fill_at": [(index.scores.clone(), torch.tensor([0, 3, 3]), 1 << 41)],
        "fill_slots": [  # an index's pins (its last: the spare), -1s and an offset
            (torch.full((33,), -1, dtype=torch.int32), torch.tensor([0, -1, 3, 3, 31]), 7),
            (torch.zeros(11, dtype=torch.int64), torch.tensor([-1, 2, 0]), 1 << 41, 8),
        ],
        "absent_keys": [
            (query, torch.tensor([3, -1, 4, -1, -1, 0, 2, -1, -1])),
            (torch.tensor([5, 5, -3, 5]), torch.tensor([-1, -1, -1, -1])),  # a repeated key
            (query, torch.zeros_like(query)),  # none absent
        ],
        "follow_moves": [
            (torch.tensor([5, -1, 7, 5, 2, 9, 0]), torch.tensor([9, 5, 0]), torch.tensor([12, 3, 4])),
            (torch.tensor([1, 2]), torch.tensor([40]), torch.tensor([41])),
        ],
        "fill_rows": [
            (torch.randn(10, 3), torch.tensor([4, 0, 4]), 0.1),
            (torch.randn(10, 5)[:, 1:4], torch.tensor([9, 2]), -2.5),  # a field of one record a row
        ],
        "uniform01": [(query, 5, 11, 1)],
        "uniform_rows": [
            (torch.zeros(10, 3), torch.tensor([7, 0, 2]), torch.tensor([3, -9, 1 << 40]), 11, 0, 0.05),
            (torch.zeros(10, 4, dtype=torch.bfloat16)[:, :3], torch.tensor([1, 5]), torch.tensor([8, 2]), 3, 1, 2.0),
            (torch.zeros(10, 3, dtype=torch.float16), torch.tensor([9]), torch.tensor([-(2**63)]), 0, 0, 1e-3),
        ],
        "pooled": [(weight, rows, offsets, psw), (weight, rows, offsets, None)],
        "bag_update": [
            (weight.clone(), torch.zeros(10, 3), torch.zeros(10, 3), torch.randn(3, 3), *bags, scores, 7, *adam),
            (weight.clone(), None, None, torch.randn(3, 3), rows, offsets, None, None, 0, *sgd),
        ],
        "exchange_rows": [
            ([torch.randn(4, 3)], torch.tensor([2, 0]), [weight.clone()], torch.tensor([-1, 5]), torch.tensor([7, 8])),
            (
                [torch.randn(4, 3), torch.randn(4, 1)],
                torch.tensor([1]),
                [weight.clone(), torch.randn(10, 1)],
                None,
                torch.tensor([9]),
            ),
        ],
    }


def clone(args):
    """Fresh copies of the tensors (and of lists of tensors) an op may write."""
    return tuple(
        a.clone() if isinstance(a, torch.Tensor) else [t.clone() for t in a] if isinstance(a, list) else a for a in args
    )


def tensors(args):
    """The tensors among ``args``, those of lists too, in order."""
    return [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("name", OPS)
def test_each_op_on_a_cpu_equals_its_plain_torch_twin(name):
    """The CPU implementation (C++ where built) gives the reference's outputs and writes: bit for
    bit, but for the pooled sums and the update, which sum in their own order."""
    for args in sample_args()[name]:
        mine, ref = clone(args), clone(args)
        got = outputs(getattr(torch.ops.dynarec, name)(*mine))
        want = outputs(getattr(reference, name)(*ref))
        assert len(got) == len(want)
        written = list(zip(tensors(mine), tensors(ref)))
        for a, b in [*zip(got, want), *written]:
            if name in ("pooled", "bag_update"):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            else:
                assert a.dtype == b.dtype and torch.equal(a, b), (a, b)


def outputs(result):
    """An op's outputs as a list."""
    if result is None:
        return []
    return list(result) if isinstance(result, tuple) else [result]


@pytest.mark.parametrize("name", OPS)
def test_each_op_passes_opcheck(name):
    """Schema (mutations and aliasing as declared), fake implementation (shapes, dtypes, the
    dynamic sizes of a plan's outputs) and the op's behaviour under tracing, against the real
    implementation."""
    for args in sample_args()[name]:
        torch.library.opcheck(
            getattr(torch.ops.dynarec, name).default,
            clone(args),
            test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
        )


class Lookup(torch.nn.Module):
    """A serving lookup: keys -> slots in a hash index (``find``) -> pooled rows (``pooled``);
    absent keys pool nothing."""

    def __init__(self, index: BucketedHashIndex, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("keys", index.keys)
        self.register_buffer("tags", index.tags)
        self.register_buffer("weight", weight)
        self.num_buckets, self.bucket_size = index.num_buckets, index.bucket_size

    def forward(self, query: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        slots, _ = torch.ops.dynarec.find(self.keys, self.tags, self.num_buckets, self.bucket_size, query, False)
        present = (slots >= 0).to(torch.float32)
        return torch.ops.dynarec.pooled(self.weight, slots.clamp(min=0), offsets, present)


def lookup_case():
    index, keys = filled_index(n=30)
    weight = torch.randn(index.capacity, 4)
    query = torch.cat([keys[:9], torch.tensor([-1, 2, 3])])
    offsets = torch.tensor([0, 4, 4, 12])
    return Lookup(index, weight), query, offsets


def test_find_and_pooled_export():
    module, query, offsets = lookup_case()
    dynamic = torch.export.Dim.DYNAMIC
    program = torch.export.export(module, (query, offsets), dynamic_shapes=({0: dynamic}, {0: dynamic}))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"dynarec.find.default", "dynarec.pooled.default"} <= targets
    torch.testing.assert_close(program.module()(query, offsets), module(query, offsets), rtol=0, atol=0)
    other = torch.tensor([7, 8, -1])
    offsets = torch.tensor([0, 1, 3])  # other sizes: the program is dynamic in both
    torch.testing.assert_close(program.module()(other, offsets), module(other, offsets), rtol=0, atol=0)


def test_find_and_pooled_compile_fullgraph():
    module, query, offsets = lookup_case()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(query, offsets), module(query, offsets), rtol=0, atol=0)


def test_an_insert_plan_exports_with_data_dependent_sizes():
    index, _ = filled_index(num_buckets=2, bucket_size=4, n=7)

    class Plan(torch.nn.Module):
        def forward(self, tags, keys, scores, pins, new_keys):
            order = torch.argsort(new_keys, stable=True)
            return torch.ops.dynarec.plan_insert(tags, keys, scores, pins, 2, 4, new_keys, order, None, None, True)

    new = torch.tensor([11, 12, 13, 14])
    args = (index.tags, index.keys, index.scores, index.pins, new)
    program = torch.export.export(Plan(), args)
    for got, want in zip(program.module()(*args), Plan()(*args)):
        assert torch.equal(got, want)


def test_the_plain_exchange_changes_no_cache_row_where_it_raises():
    """Every field is written out before any is read in, and what is read in is gathered first:
    a read that fails (here the second field's host rows are too few) leaves every cache field
    as it was, with every field written out (what a cached store's undo relies on)."""
    caches = [torch.arange(12.0).view(4, 3), torch.arange(100.0, 112.0).view(4, 3)]
    hosts = [torch.zeros(10, 3), torch.zeros(5, 3)]
    before = [c.clone() for c in caches]
    slots, out_rows, in_rows = torch.tensor([0, 2]), torch.tensor([1, 3]), torch.tensor([4, 7])
    with pytest.raises(IndexError):
        reference.exchange_rows(caches, slots, hosts, out_rows, in_rows)
    assert all(torch.equal(c, b) for c, b in zip(caches, before))
    assert all(torch.equal(h[out_rows], c[slots]) for h, c in zip(hosts, caches))
