"""dynarec's operators: every kernel of the embedding layer as a ``torch.library`` op,
``torch.ops.dynarec.<name>``, and the one place where an implementation is chosen by device.

| op | what | CPU | CUDA |
|---|---|---|---|
| ``find`` | two-choice bucketed find, optionally flagging an absent key | C++ | Triton |
| ``candidate_buckets`` | a key's two buckets | C++ | Triton |
| ``plan_insert`` | an insert plan's three steps (free slot, one cuckoo move, eviction) | C++ | Triton |
| ``place_keys`` | a commit of new keys into free slots | C++ | Triton |
| ``fill_at`` | ``t[idx] = value`` (a step's scores) | C++ | torch |
| ``fill_slots`` | ``t[slots + offset] = value`` (a step's pins) | C++ | torch |
| ``absent_keys`` | the keys a find left without a row: positions, unique keys, inverse, counts | C++ | torch |
| ``follow_moves`` | slots following a plan's cuckoo moves | C++ | torch |
| ``fill_rows`` | ``t[rows, :] = value`` (fresh optimizer states) | C++ | torch |
| ``uniform01`` | key-seeded uniform draws | C++ | Triton |
| ``uniform_rows`` | the uniform initializer's rows, written in place | C++ | Triton |
| ``pooled`` | weighted-sum bags | torch (fp32 rows), C++ (half rows) | Triton |
| ``bag_update`` | the fused backward + optimizer update (mutates weight, states, scores) | C++ | Triton |
| ``exchange_rows`` | rows written back from a device cache to host memory, and read into it | torch | Triton |

``pooled`` and ``bag_update`` also take packed rows of several tables of different dims (a
``layout``, :mod:`dynarec.kernels.packed`): one launch for a whole group on a GPU (Triton); on a
CPU the plain-torch twin serves them (a collection packs tables of different dims only where the
Triton kernels run: on a CPU, tables of one dim share rows ``[num_rows, D]`` instead).

Every op has four implementations:

- the default: its plain-torch twin (:mod:`dynarec.kernels.reference`), on any device; the
  reference the tests hold the others to, which they call directly;
- CPU: the C++ extension (:mod:`dynarec.kernels.cpu`) where it is built, else the default;
- CUDA: the Triton kernels (:mod:`dynarec.kernels.gpu`) where Triton is installed, else the
  default; under Triton's interpreter (``TRITON_INTERPRET=1``) they serve CPU tensors too, as the
  kernels' test lane needs;
- fake: output shapes and dtypes without computing (data-dependent sizes through the fake
  context's dynamic sizes), so the ops trace under ``torch.compile`` and ``torch.export``.

``find`` and ``plan_insert`` also serve a partitioned index (``part_starts`` and each key's
partition: ``reference.candidate_buckets``), the hash index of a group of dynamic tables, each
table a partition: one find and one plan a step for all of them.

Where the table says ``torch``, that device runs the default. The C++ and Triton planners hold a
bucket's claims in one 64-bit mask: a bucket of more than 64 slots is planned by the default.

Defined with ``torch.library.define``, ``impl`` and ``register_fake`` rather than
``torch.library.custom_op``: the same dispatcher registrations, without the Python wrapper
custom_op adds around every call (several times the dispatch itself; a GPU step is host-bound,
and a dynamic table makes several of these calls a step).

Schemas: ints are int64, floats float64 (the kernels round them to float32 as torch does); every
tensor argument is documented by the reference function of the same name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from dynarec.kernels import cpu, reference
from dynarec.kernels.gpu import _triton
from dynarec.kernels.layout import NO_SLOT
from dynarec.optim.kernel import KernelArgs, KernelCode, WeightDecayCode

__all__ = ["SCHEMAS", "packs_rows", "takes_half_rows"]

_MAX_KERNEL_BUCKET = 64  # the C++ and Triton planners keep a bucket's claims in one 64-bit mask

SCHEMAS = {
    "find": "(Tensor table_keys, Tensor tags, int num_buckets, int bucket_size, Tensor query, bool flag,"
    " Tensor? part_starts=None, Tensor? query_parts=None) -> (Tensor, Tensor)",
    "candidate_buckets": "(Tensor keys, int num_buckets) -> (Tensor, Tensor)",
    "plan_insert": "(Tensor tags, Tensor keys, Tensor scores, Tensor pins, int num_buckets, int bucket_size,"
    " Tensor new_keys, Tensor order, Tensor? move_pins, Tensor? evict_pins, bool allow_evict, int free_slots=-1,"
    " Tensor? part_starts=None, Tensor? key_parts=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "place_keys": "(Tensor(a!) keys, Tensor(b!) scores, Tensor(c!) tags, Tensor slots, Tensor new_keys,"
    " Tensor new_scores) -> ()",
    "fill_at": "(Tensor(a!) t, Tensor idx, int value) -> ()",
    "fill_slots": "(Tensor(a!) t, Tensor slots, int value, int offset=0) -> ()",
    "absent_keys": "(Tensor keys, Tensor slots) -> (Tensor, Tensor, Tensor, Tensor)",
    "follow_moves": "(Tensor slots, Tensor moved_from, Tensor moved_to) -> Tensor",
    "fill_rows": "(Tensor(a!) t, Tensor rows, float value) -> ()",
    "uniform01": "(Tensor keys, int dim, int seed, int stream) -> Tensor",
    "uniform_rows": "(Tensor(a!) out, Tensor rows, Tensor keys, int seed, int stream, float bound) -> ()",
    "pooled": "(Tensor weight, Tensor rows, Tensor offsets, Tensor? per_sample_weights, Tensor? layout=None,"
    " int width=0) -> Tensor",
    "bag_update": "(Tensor(a!) weight, Tensor(b!)? momentum1, Tensor(c!)? momentum2, Tensor grad_out, Tensor rows,"
    " Tensor offsets, Tensor? per_sample_weights, Tensor(d!)? scores, int score, int code, int weight_decay_mode,"
    " float lr, float eps, float weight_decay, float beta1, float beta2, float bias1, float bias2,"
    " Tensor? row_keys=None, int key_offset=0, int rounding_base=0, Tensor? layout=None, Tensor? hyper=None) -> ()",
    "exchange_rows": "(Tensor(a!)[] caches, Tensor slots, Tensor(b!)[] hosts, Tensor? out_rows, Tensor? in_rows) -> ()",
}


# -- CPU: the C++ extension where it is built ----------------------------------------------------


def _find_cpu(table_keys, tags, num_buckets, bucket_size, query, flag, part_starts=None, query_parts=None):
    k = cpu.ops()
    if k is None:
        return reference.find(table_keys, tags, num_buckets, bucket_size, query, flag, part_starts, query_parts)
    slots, absent = k.find_two_choice(
        table_keys, tags, num_buckets, bucket_size, query.contiguous(), flag, *_parts_args(part_starts, query_parts)
    )
    return slots, absent


def _parts_args(part_starts: Optional[torch.Tensor], key_parts: Optional[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A partitioned index's ``(part_starts, key_parts)`` as the C++ ops take them (empty: none)."""
    if part_starts is None:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty
    assert key_parts is not None, "a partitioned index's keys need their partitions"
    return part_starts.long().contiguous(), key_parts.long().contiguous()


def _candidate_buckets_cpu(keys, num_buckets):
    k = cpu.ops()
    if k is None:
        return reference.candidate_buckets(keys, num_buckets)
    b1, b2 = k.candidate_buckets(keys.contiguous(), num_buckets)
    return b1, b2


def _plan_insert_cpu(
    tags, keys, scores, pins, num_buckets, bucket_size, new_keys, order, move_pins, evict_pins, allow_evict,
    free_slots=-1, part_starts=None, key_parts=None,
):  # fmt: skip
    k = cpu.ops()
    if k is None or bucket_size > _MAX_KERNEL_BUCKET:
        return reference.plan_insert(
            tags, keys, scores, pins, num_buckets, bucket_size, new_keys, order, move_pins, evict_pins, allow_evict,
            free_slots, part_starts, key_parts,
        )  # fmt: skip
    out = torch.full((new_keys.numel(),), NO_SLOT, dtype=torch.int64)
    empty = torch.empty(0, dtype=torch.int64)
    left, moved_from, moved_to, evicted = k.plan_insert(
        tags, keys, scores, pins, num_buckets, bucket_size, new_keys.contiguous(), order, out,
        empty if move_pins is None else move_pins.to("cpu", torch.int64).contiguous(),
        empty if evict_pins is None else evict_pins.to("cpu", torch.int64).contiguous(), allow_evict, free_slots,
        *_parts_args(part_starts, key_parts),
    )  # fmt: skip
    return out, left, moved_from, moved_to, evicted


def _place_keys_cpu(keys, scores, tags, slots, new_keys, new_scores):
    k = cpu.ops()
    if k is None or not keys.is_contiguous() or not scores.is_contiguous():
        return reference.place_keys(keys, scores, tags, slots, new_keys, new_scores)
    bad = k.place_keys(
        keys, scores, tags, slots.long().contiguous(), new_keys.long().contiguous(), new_scores.long().contiguous()
    )  # (int64 as the index's arrays: the twin's indexed writes cast too)
    if bad >= 0:
        raise IndexError(f"place_keys: slot {int(slots[bad])} at position {bad} is outside [0, {keys.numel()})")


def _fill_at_cpu(t, idx, value):
    k = cpu.ops()
    if k is None:
        return reference.fill_at(t, idx, value)
    bad = k.fill_at(t, idx.contiguous(), int(value))
    if bad >= 0:
        raise IndexError(f"fill_at: index {int(idx[bad])} at position {bad} is outside [0, {t.numel()})")


def _fill_slots_cpu(t, slots, value, offset=0):
    k = cpu.ops()
    if k is None or t.dtype not in (torch.int32, torch.int64) or not t.is_contiguous():
        return reference.fill_slots(t, slots, value, offset)
    bad = k.fill_slots(t, slots.long().contiguous(), int(value), int(offset))
    if bad >= 0:
        raise IndexError(
            f"fill_slots: slot {int(slots[bad])} at position {bad} (+ {offset}) is outside [0, {t.numel() - 1})"
        )


def _absent_keys_cpu(keys, slots):
    k = cpu.ops()
    if k is None:
        return reference.absent_keys(keys, slots)
    positions, unique, inverse, counts = k.absent_keys(keys.long().contiguous(), slots.long().contiguous())
    return positions, unique, inverse, counts


def _follow_moves_cpu(slots, moved_from, moved_to):
    k = cpu.ops()
    if k is None:
        return reference.follow_moves(slots, moved_from, moved_to)
    return k.follow_moves(slots.long().contiguous(), moved_from.long().contiguous(), moved_to.long().contiguous())


def _fill_rows_cpu(t, rows, value):
    k = cpu.ops()
    if k is None or t.dtype != torch.float32 or t.dim() != 2 or t.stride(1) != 1:
        return reference.fill_rows(t, rows, value)
    bad = k.fill_rows(t, rows.long().contiguous(), float(value))
    if bad >= 0:
        raise IndexError(f"fill_rows: row {int(rows[bad])} at position {bad} is outside [0, {t.shape[0]})")


def _uniform_rows_cpu(out, rows, keys, seed, stream, bound):
    k = cpu.ops()
    if k is None or out.dim() != 2 or out.stride(1) != 1:
        return reference.uniform_rows(out, rows, keys, seed, stream, bound)
    bad = k.uniform_rows(out, rows.long().contiguous(), keys.long().contiguous(), seed, stream, float(bound))
    if bad >= 0:
        raise IndexError(f"uniform_rows: row {int(rows[bad])} at position {bad} is outside [0, {out.shape[0]})")


def _uniform01_cpu(keys, dim, seed, stream):
    k = cpu.ops()
    if k is None:
        return reference.uniform01(keys, dim, seed, stream)
    return k.uniform01(keys.contiguous(), dim, seed, stream)


def _kernel_args(code, weight_decay_mode, eps, weight_decay, beta1, beta2, bias1, bias2) -> KernelArgs:
    """The op's optimizer arguments as the kernels take them. A code or mode the table lacks stays
    an int: each kernel refuses it in its own words."""
    try:
        code, weight_decay_mode = KernelCode(code), WeightDecayCode(weight_decay_mode)
    except ValueError:
        pass
    return KernelArgs(code, eps, weight_decay, weight_decay_mode, beta1, beta2, bias1, bias2)


def _fresh(t: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy where it shares memory with one of ``inputs`` (an op's outputs never alias
    its inputs)."""
    ptr = t.untyped_storage().data_ptr()
    return t.clone() if any(ptr == i.untyped_storage().data_ptr() for i in inputs) else t


def _no_device_hyper(hyper: Optional[torch.Tensor], weight: torch.Tensor) -> None:
    """``bag_update``'s ``hyper`` (the scalars of a step captured in a CUDA graph) is the Triton
    kernels' alone: elsewhere nothing is captured, and the float arguments are the scalars."""
    if hyper is not None:
        raise ValueError(
            f"dynarec::bag_update: hyper (a captured step's scalars on the device) is read by the Triton kernels "
            f"only; rows on {weight.device} take the float arguments"
        )


def _states(momentum1: Optional[torch.Tensor], momentum2: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t for name, t in (("momentum1", momentum1), ("momentum2", momentum2)) if t is not None}


def _bag_update_cpu(weight, momentum1, momentum2, grad_out, rows, offsets, psw, scores, score, code, wd_mode, lr,
                    eps, wd, beta1, beta2, bias1, bias2, row_keys=None, key_offset=0, rounding_base=0,
                    layout=None, hyper=None):  # fmt: skip
    _no_device_hyper(hyper, weight)
    if cpu.ops() is None or layout is not None:  # (float32 rows only: the reference refuses half ones)
        return reference.bag_update(weight, momentum1, momentum2, grad_out, rows, offsets, psw, scores, score, code,
                                    wd_mode, lr, eps, wd, beta1, beta2, bias1, bias2, layout=layout)  # fmt: skip
    cpu.bag_update(
        _kernel_args(code, wd_mode, eps, wd, beta1, beta2, bias1, bias2), lr=lr, weight=weight,
        states=_states(momentum1, momentum2), rows=rows, offsets=offsets, per_sample_weights=psw, grad_out=grad_out,
        scores=scores, score=score, row_keys=row_keys, key_offset=key_offset, rounding_base=rounding_base,
    )  # fmt: skip


def _pooled_cpu(weight, rows, offsets, psw, layout=None, width=0):
    kernels = cpu.ops()
    if weight.dtype == torch.float32 or kernels is None:
        return reference.pooled(weight, rows, offsets, psw, layout, width)
    return kernels.pooled_half(weight.contiguous(), rows.contiguous(), offsets.contiguous(), psw)


def takes_half_rows(device: torch.device) -> bool:
    """Whether ``dynarec::pooled`` reads and ``dynarec::bag_update`` stores float16 / bfloat16
    rows on ``device``: Triton's kernels (CUDA, or the CPU under Triton's interpreter) and the
    C++ extension do; elsewhere the callers convert the touched rows to float32 first."""
    if device.type == "cuda":
        return _triton.HAVE_TRITON
    return device.type == "cpu" and (_TRITON_ON_CPU or cpu.ops() is not None)


def packs_rows(device: torch.device) -> bool:
    """Whether ``dynarec::pooled`` and ``dynarec::bag_update`` run packed rows
    (:mod:`dynarec.kernels.packed`) in kernels on ``device``: Triton's (CUDA, or the CPU under
    Triton's interpreter); elsewhere their plain-torch twin does, table by table."""
    return _triton.HAVE_TRITON and (device.type == "cuda" or (device.type == "cpu" and _TRITON_ON_CPU))


# -- CUDA (and CPU under Triton's interpreter): the Triton kernels ------------------------------


def _find_triton(table_keys, tags, num_buckets, bucket_size, query, flag, part_starts=None, query_parts=None):
    from dynarec.kernels.gpu import hashing

    absent = None
    if flag:
        shape = () if part_starts is None else (part_starts.numel() - 1,)
        absent = torch.zeros(shape, dtype=torch.int32, device=query.device)
    parts = None if part_starts is None else hashing.Partitions(part_starts, query_parts)
    slots = hashing.find_two_choice(table_keys, tags, num_buckets, bucket_size, query, absent, parts)
    return slots, (query.new_zeros(0, dtype=torch.int32) if absent is None else absent)


def _candidate_buckets_triton(keys, num_buckets):
    from dynarec.kernels.gpu import hashing

    return hashing.candidate_buckets(keys, num_buckets)


def _uniform01_triton(keys, dim, seed, stream):
    from dynarec.kernels.gpu import hashing

    return hashing.uniform01(keys.long(), dim, reference.uniform_salt(seed, stream))


def _uniform_rows_triton(out, rows, keys, seed, stream, bound):
    if out.dim() != 2 or out.stride(1) != 1:
        return reference.uniform_rows(out, rows, keys, seed, stream, bound)
    from dynarec.kernels.gpu import hashing

    hashing.uniform_rows(out, rows, keys.long(), reference.uniform_salt(seed, stream), float(bound))


def _plan_insert_triton(
    tags, keys, scores, pins, num_buckets, bucket_size, new_keys, order, move_pins, evict_pins, allow_evict,
    free_slots=-1, part_starts=None, key_parts=None,
):  # fmt: skip
    if bucket_size > _MAX_KERNEL_BUCKET:
        return reference.plan_insert(
            tags, keys, scores, pins, num_buckets, bucket_size, new_keys, order, move_pins, evict_pins, allow_evict,
            free_slots, part_starts, key_parts,
        )  # fmt: skip
    from dynarec.kernels.gpu import hashing, plan

    parts = None if part_starts is None else hashing.Partitions(part_starts, key_parts)
    state = plan.PlanState.fresh(keys, tags, scores, pins, num_buckets, bucket_size, parts)
    out = torch.full((new_keys.numel(),), NO_SLOT, dtype=torch.int64, device=tags.device)
    left, moved_from, moved_to, evicted = plan.plan_insert(
        state, new_keys, order, out, move_pins, evict_pins, allow_evict, free_slots
    )
    return out, _fresh(left, order), moved_from, moved_to, evicted


def _place_keys_triton(keys, scores, tags, slots, new_keys, new_scores):
    from dynarec.kernels.gpu import plan

    plan.place_keys(keys, scores, tags, slots, new_keys, new_scores)


def _pooled_triton(weight, rows, offsets, psw, layout=None, width=0):
    from dynarec.kernels.gpu import lookup

    return lookup.pooled_forward(weight, rows, offsets, psw, layout, width)


def _bag_update_triton(weight, momentum1, momentum2, grad_out, rows, offsets, psw, scores, score, code, wd_mode, lr,
                       eps, wd, beta1, beta2, bias1, bias2, row_keys=None, key_offset=0, rounding_base=0,
                       layout=None, hyper=None):  # fmt: skip
    from dynarec.kernels.gpu import update

    update.bag_update(
        _kernel_args(code, wd_mode, eps, wd, beta1, beta2, bias1, bias2), lr=lr, weight=weight,
        states=_states(momentum1, momentum2), rows=rows, offsets=offsets, per_sample_weights=psw, grad_out=grad_out,
        scores=scores, score=score, row_keys=row_keys, key_offset=key_offset, rounding_base=rounding_base,
        layout=layout, hyper=hyper,
    )  # fmt: skip


def _exchange_rows_triton(caches, slots, hosts, out_rows, in_rows):
    from dynarec.kernels.gpu import rows

    reached = [_TRITON_ON_CPU or h.device.type != "cpu" or h.is_pinned() for h in hosts]
    if not all(reached):  # the device cannot reach some host field
        return reference.exchange_rows(caches, slots, hosts, out_rows, in_rows)
    rows.exchange_rows(caches, slots, hosts, out_rows, in_rows)


# -- fake: shapes and dtypes -----------------------------------------------------------------------


def _dynamic_int64(like: torch.Tensor) -> torch.Tensor:
    """A ``[u]`` int64 of a data-dependent size ``u``."""
    return like.new_empty(torch.library.get_ctx().new_dynamic_size(), dtype=torch.int64)


def _find_fake(table_keys, tags, num_buckets, bucket_size, query, flag, part_starts=None, query_parts=None):
    shape = (0,) if not flag else () if part_starts is None else (part_starts.shape[0] - 1,)
    return torch.empty_like(query), query.new_empty(shape, dtype=torch.int32)


def _candidate_buckets_fake(keys, num_buckets):
    return torch.empty_like(keys), torch.empty_like(keys)


def _plan_insert_fake(
    tags, keys, scores, pins, num_buckets, bucket_size, new_keys, order, move_pins, evict_pins, allow_evict,
    free_slots=-1, part_starts=None, key_parts=None,
):  # fmt: skip
    slots = new_keys.new_empty(new_keys.shape, dtype=torch.int64)
    return slots, _dynamic_int64(tags), _dynamic_int64(tags), _dynamic_int64(tags), _dynamic_int64(tags)


def _absent_keys_fake(keys, slots):
    return _dynamic_int64(keys), _dynamic_int64(keys), _dynamic_int64(keys), _dynamic_int64(keys)


def _follow_moves_fake(slots, moved_from, moved_to):
    return torch.empty_like(slots)


def _returns_none(*args: Any) -> None:
    return None


def _uniform01_fake(keys, dim, seed, stream):
    return keys.new_empty((keys.shape[0], dim), dtype=torch.float64)


def _pooled_fake(weight, rows, offsets, psw, layout=None, width=0):
    dim = width if layout is not None else weight.shape[1]
    return weight.new_empty((offsets.shape[0] - 1, dim), dtype=torch.float32)


# -- registration ----------------------------------------------------------------------------------

_Impl = Callable[..., Any]
_TRITON_ON_CPU = _triton.HAVE_TRITON and _triton.INTERPRETED

_IMPLS: dict[str, tuple[_Impl, _Impl, Optional[_Impl], Optional[_Impl]]] = {
    # name: (default, fake, CPU, Triton)
    "find": (reference.find, _find_fake, _find_cpu, _find_triton),
    "candidate_buckets": (
        reference.candidate_buckets,
        _candidate_buckets_fake,
        _candidate_buckets_cpu,
        _candidate_buckets_triton,
    ),
    "plan_insert": (reference.plan_insert, _plan_insert_fake, _plan_insert_cpu, _plan_insert_triton),
    "place_keys": (reference.place_keys, _returns_none, _place_keys_cpu, _place_keys_triton),
    "fill_at": (reference.fill_at, _returns_none, _fill_at_cpu, None),
    "fill_slots": (reference.fill_slots, _returns_none, _fill_slots_cpu, None),
    "absent_keys": (reference.absent_keys, _absent_keys_fake, _absent_keys_cpu, None),
    "follow_moves": (reference.follow_moves, _follow_moves_fake, _follow_moves_cpu, None),
    "fill_rows": (reference.fill_rows, _returns_none, _fill_rows_cpu, None),
    "uniform01": (reference.uniform01, _uniform01_fake, _uniform01_cpu, _uniform01_triton),
    "uniform_rows": (reference.uniform_rows, _returns_none, _uniform_rows_cpu, _uniform_rows_triton),
    "pooled": (reference.pooled, _pooled_fake, _pooled_cpu, _pooled_triton),
    "bag_update": (reference.bag_update, _returns_none, _bag_update_cpu, _bag_update_triton),
    "exchange_rows": (reference.exchange_rows, _returns_none, None, _exchange_rows_triton),
}


def _register() -> None:
    for name, (default, fake, on_cpu, triton) in _IMPLS.items():
        qualname = f"dynarec::{name}"
        torch.library.define(qualname, SCHEMAS[name])
        torch.library.impl(qualname, "default", default)
        torch.library.register_fake(qualname, fake)
        if triton is not None and _TRITON_ON_CPU:
            on_cpu = triton
        # torch.library.impl, not register_kernel: register_kernel wraps the kernel in
        # torch._disable_dynamo, whose first call imports torch._dynamo (seconds, once a
        # process) and whose every call sets and resets the frame evaluator.
        if on_cpu is not None:
            torch.library.impl(qualname, "cpu", on_cpu)
        if triton is not None and _triton.HAVE_TRITON:
            torch.library.impl(qualname, "cuda", triton)


_register()
