"""The hash index's hashing and find on the device: ``mix64``, a key's tag and its two candidate
buckets, and the two-choice find; and the key-seeded uniform draws of the initializers.

The Triton twins of the plain-torch ``mix64``, ``key_tags``, ``candidate_buckets``, ``find`` and
``uniform01`` (``dynarec.kernels.reference``): the same bits, tested against them. The insert planner's kernels
(:mod:`.plan`) hash with the ``@triton.jit`` helpers here.

A find reads a key's first bucket's 16 tag bytes and only then its second's, and a key only where
a tag matches: an absent key almost never reads a key.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from dynarec.kernels.gpu._triton import HAVE_TRITON
from dynarec.kernels.layout import EMPTY_TAG, NO_SLOT

if HAVE_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "EMPTY_TAG",
    "NO_SLOT",
    "TUNING",
    "Partitions",
    "Tuning",
    "candidate_buckets",
    "find_two_choice",
    "uniform01",
    "uniform_rows",
]


@dataclass(frozen=True)
class Tuning:
    """Launch shapes of this module's kernels: keys a program (``*_block``) and warps a program
    (``*_warps``). Tuning scripts replace :data:`TUNING`; results do not depend on it."""

    find_block: int = 128
    find_warps: int = 4
    buckets_block: int = 512
    uniform_elements: int = 4096  # a uniform01 program's tile of draws (a power of two)
    uniform_cols: int = 512  # its widest tile of a row (wider rows: several tiles, in a loop)


TUNING = Tuning()


class Partitions(NamedTuple):
    """A partitioned index's partitions (``reference.candidate_buckets``): ``starts`` ``[P + 1]``
    int64, partition ``p`` holding the buckets from ``starts[p]`` to ``starts[p + 1]``; ``keys``
    ``[n]`` int64, the partition of each key of the call (query or new keys)."""

    starts: torch.Tensor
    keys: torch.Tensor


def partition_args(parts: Optional[Partitions], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(starts, key partitions, PARTS)``: the kernels' arguments for ``parts`` (None: ``like``,
    unread)."""
    if parts is None:
        return like, like, False
    assert parts.starts.device == parts.keys.device == like.device, "partitions on the keys' device"
    return parts.starts.contiguous(), parts.keys.contiguous(), True


if HAVE_TRITON:
    _NO_SLOT = tl.constexpr(NO_SLOT)
    _EMPTY_TAG = tl.constexpr(EMPTY_TAG)

    @triton.jit
    def mix64(x):
        """SplitMix64's finalizer of uint64 ``x`` (``reference.mix64``'s bits)."""
        x = x ^ (x >> 30)
        x = x * 0xBF58476D1CE4E5B9
        x = x ^ (x >> 27)
        x = x * 0x94D049BB133111EB
        return x ^ (x >> 31)

    @triton.jit
    def key_tag(h):
        """A key's tag from its ``mix64`` hash ``h`` (uint64): the top byte, 1 where it is
        :data:`EMPTY_TAG` (``key_tags``)."""
        t = (h >> 56).to(tl.uint8)
        return tl.where(t == _EMPTY_TAG, 1, t).to(tl.uint8)

    @triton.jit
    def two_buckets(h, num_buckets):
        """The two candidate buckets of a key from its ``mix64`` hash ``h`` (uint64): its 32-bit
        halves modulo ``num_buckets`` (< 2^32), in 32-bit arithmetic (``candidate_buckets``)."""
        nb = num_buckets.to(tl.uint32)
        b1 = ((h & 0xFFFFFFFF).to(tl.uint32) % nb).to(tl.int64)
        b2 = ((h >> 32).to(tl.uint32) % nb).to(tl.int64)
        return b1, b2

    @triton.jit
    def buckets_of(h, k, valid, num_buckets, starts_ptr, parts_ptr, PARTS: tl.constexpr):
        """``(b1, b2, base, count)``: the two candidate buckets of key ``k`` (an index into the
        call's keys, its ``mix64`` hash ``h``), read where ``valid``, and its partition's first
        bucket and bucket count (PARTS: a partitioned index, ``Partitions``; else ``(0,
        num_buckets)``)."""
        if PARTS:
            p = tl.load(parts_ptr + k, mask=valid, other=0)
            base = tl.load(starts_ptr + p, mask=valid, other=0)
            count = tl.load(starts_ptr + p + 1, mask=valid, other=1) - base
            b1, b2 = buckets_in(h, base, count)
        else:
            b1, b2 = two_buckets(h, num_buckets)
            base = tl.zeros_like(b1)
            count = base + num_buckets
        return b1, b2, base, count

    @triton.jit
    def buckets_in(h, base, count):
        """The two candidate buckets of hash ``h`` in the ``count`` buckets from ``base`` (vectors:
        each key's partition's)."""
        nb = count.to(tl.uint32)
        b1 = base + ((h & 0xFFFFFFFF).to(tl.uint32) % nb).to(tl.int64)
        b2 = base + ((h >> 32).to(tl.uint32) % nb).to(tl.int64)
        return b1, b2

    @triton.jit
    def _probe_bucket(keys_ptr, tags_ptr, bucket, q, qtag, need, BS: tl.constexpr, BSP: tl.constexpr):
        """``(found, lane)`` of each query ``q`` in its ``bucket`` (``BS`` slots; ``BSP`` the next
        power of two), read only where ``need``: the bucket's ``BS`` tag bytes, then the keys only
        at the lanes whose tag is the query's ``qtag`` (never :data:`EMPTY_TAG`)."""
        lanes = tl.arange(0, BSP)
        slots = bucket[:, None] * BS + lanes[None, :]
        need2 = need[:, None] & (lanes < BS)[None, :]
        cand = (tl.load(tags_ptr + slots, mask=need2, other=_EMPTY_TAG) == qtag[:, None]) & need2
        hit = cand & (tl.load(keys_ptr + slots, mask=cand, other=0) == q[:, None])
        return tl.max(hit.to(tl.int32), axis=1) > 0, tl.argmax(hit.to(tl.int32), axis=1)

    @triton.jit
    def _find_slot(keys_ptr, tags_ptr, q, h, b1, b2, need, BS: tl.constexpr, BSP: tl.constexpr):
        """Each query's slot, :data:`NO_SLOT` where absent (``h``: its ``mix64`` hash, ``b1`` /
        ``b2``: its buckets), read only where ``need``: its first bucket's tags (16 bytes, one
        sector), the second bucket's only for keys the first lacks, and a key only where a tag
        matches (1 lane in 255 by chance)."""
        t = key_tag(h)
        found1, lane1 = _probe_bucket(keys_ptr, tags_ptr, b1, q, t, need, BS, BSP)
        found2, lane2 = _probe_bucket(keys_ptr, tags_ptr, b2, q, t, need & (found1 == 0), BS, BSP)
        return tl.where(found1, b1 * BS + lane1, tl.where(found2, b2 * BS + lane2, _NO_SLOT))

    # num_buckets not specialized: Triton makes an int argument equal to 1 a constant, which has
    # no .to() (a one-bucket table would not compile). Nor are sizes (``n``, and the plan's ``m``):
    # Triton compiles a variant for a size of 1 and one for multiples of 16, so a size that varies
    # from step to step (new keys, keys left in a plan's round) would compile new variants in the
    # middle of training (about 0.3 s each on an H200: steps of 280-345 ms as a table filled).
    @triton.jit(do_not_specialize=["n", "num_buckets"])
    def _find_kernel(
        keys_ptr, tags_ptr, query_ptr, out_ptr, absent_ptr, starts_ptr, parts_ptr, n, num_buckets, BS: tl.constexpr,
        BSP: tl.constexpr, FLAG: tl.constexpr, PARTS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        q = tl.load(query_ptr + offs, mask=valid, other=0)
        h = mix64(q.to(tl.uint64))
        b1, b2, _, _ = buckets_of(h, offs, valid, num_buckets, starts_ptr, parts_ptr, PARTS)
        slot = _find_slot(keys_ptr, tags_ptr, q, h, b1, b2, valid, BS, BSP)
        tl.store(out_ptr + offs, slot, mask=valid)
        if FLAG:  # a program with an absent key sets the flag (every such store writes 1)
            if PARTS:  # its partition's
                miss = valid & (slot == _NO_SLOT)
                tl.store(absent_ptr + tl.load(parts_ptr + offs, mask=miss, other=0), 1, mask=miss)
            else:
                tl.store(absent_ptr, 1, mask=tl.max((valid & (slot == _NO_SLOT)).to(tl.int32), axis=0) > 0)

    @triton.jit(do_not_specialize=["n", "num_buckets"])
    def _candidate_buckets_kernel(keys_ptr, b1_ptr, b2_ptr, n, num_buckets, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        b1, b2 = two_buckets(mix64(tl.load(keys_ptr + offs, mask=valid, other=0).to(tl.uint64)), num_buckets)
        tl.store(b1_ptr + offs, b1, mask=valid)
        tl.store(b2_ptr + offs, b2, mask=valid)


if HAVE_TRITON:

    @triton.jit
    def _key_draw_bases(keys_ptr, i, valid, salt_hi, salt_lo):
        """Each key's ``mix64(key ^ salt)`` (``reference.uniform01``'s per-key hash), the salt
        given as its two 32-bit halves."""
        salt = (salt_hi.to(tl.uint64) << 32) | salt_lo.to(tl.uint64)
        return mix64(tl.load(keys_ptr + i, mask=valid, other=0).to(tl.uint64) ^ salt)

    @triton.jit
    def _uniform_tile(base, cols):
        """``[ROWS, COLS]`` float64 draws in (0, 1) of columns ``cols`` of the keys of ``base``."""
        h = mix64(base[:, None] + (cols + 1).to(tl.uint64)[None, :] * 0x9E3779B97F4A7C15)
        return ((h >> 11).to(tl.float64) + 0.5) * (1.0 / 9007199254740992.0)  # 2^-53

    # The salt's halves not specialized either: a half equal to 1 would be a constant (no .to()).
    @triton.jit(do_not_specialize=["n", "salt_hi", "salt_lo"])
    def _uniform01_kernel(
        keys_ptr, out_ptr, n, dim, salt_hi, salt_lo, ROWS: tl.constexpr, COLS: tl.constexpr, BLOCKS: tl.constexpr
    ):  # fmt: skip
        """Rows ``ROWS`` a program, each row's ``dim`` columns in ``BLOCKS`` tiles of ``COLS``."""
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        valid = rows < n
        base = _key_draw_bases(keys_ptr, rows, valid, salt_hi, salt_lo)
        for b in range(BLOCKS):
            cols = b * COLS + tl.arange(0, COLS)
            mask = valid[:, None] & (cols < dim)[None, :]
            tl.store(out_ptr + rows[:, None] * dim + cols[None, :], _uniform_tile(base, cols), mask=mask)

    @triton.jit(do_not_specialize=["n", "dim", "row_stride", "salt_hi", "salt_lo", "bound_hi", "bound_lo"])
    def _uniform_rows_kernel(
        keys_ptr, rows_ptr, out_ptr, n, dim, row_stride, salt_hi, salt_lo, bound_hi, bound_lo, ROWS: tl.constexpr,
        COLS: tl.constexpr, BLOCKS: tl.constexpr,
    ):  # fmt: skip
        # out[rows[i], :dim] = float32((2u - 1) * bound) in out's dtype (rounded to nearest), u the
        # float64 draws of _uniform01_kernel; bound a float64 given as its two 32-bit halves (a
        # float argument would be float32).
        i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        valid = i < n
        bound = ((bound_hi.to(tl.uint64) << 32) | bound_lo.to(tl.uint64)).to(tl.float64, bitcast=True)
        base = _key_draw_bases(keys_ptr, i, valid, salt_hi, salt_lo)
        dst = tl.load(rows_ptr + i, mask=valid, other=0).to(tl.int64)
        for b in range(BLOCKS):
            cols = b * COLS + tl.arange(0, COLS)
            u = _uniform_tile(base, cols)
            v = ((u * 2.0 - 1.0) * bound).to(tl.float32)  # 2u is exact: a fused multiply-add rounds as sub does
            if out_ptr.dtype.element_ty == tl.bfloat16:
                # to nearest, ties to even, on the bits (finite values; Triton's interpreter truncates)
                bits = v.to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
                out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
            else:
                out = v.to(out_ptr.dtype.element_ty)
            mask = valid[:, None] & (cols < dim)[None, :]
            tl.store(out_ptr + dst[:, None] * row_stride + cols[None, :], out, mask=mask)


def uniform_rows(out: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor, salt: int, bound: float) -> None:
    """``out[rows[i]] = ((2 * u - 1) * bound).float()`` in ``out``'s dtype (float32, or half
    precision rounded to nearest), ``u = uniform01(keys, dim, salt)[i]`` (float64): the uniform
    initializer's rows written in place, one kernel, no ``[n, dim]`` temporaries. ``out``:
    ``[num_rows, dim]`` with unit column stride; ``rows``: distinct, in range."""
    n, dim = keys.numel(), out.shape[1]
    if not (n and dim):
        return
    assert out.stride(1) == 1, "uniform_rows writes rows of unit column stride"
    (bits,) = struct.unpack("<Q", struct.pack("<d", float(bound)))  # the float64's bits
    salt &= (1 << 64) - 1
    cols = min(triton.next_power_of_2(dim), TUNING.uniform_cols)
    per = max(1, TUNING.uniform_elements // cols)
    _uniform_rows_kernel[(triton.cdiv(n, per),)](
        keys.contiguous(), rows.contiguous(), out, n, dim, out.stride(0), salt >> 32, salt & 0xFFFFFFFF, bits >> 32,
        bits & 0xFFFFFFFF, ROWS=per, COLS=cols, BLOCKS=triton.cdiv(dim, cols),
    )  # fmt: skip


def uniform01(keys: torch.Tensor, dim: int, salt: int) -> torch.Tensor:
    """``[n, dim]`` float64 in (0, 1) for int64 ``keys`` in one kernel: ``reference.uniform01``'s
    bits, given its ``salt`` (the hash of its seed and stream, a Python int, wrapped to 64 bits)."""
    keys = keys.contiguous()
    out = torch.empty((keys.numel(), dim), dtype=torch.float64, device=keys.device)
    n = keys.numel()
    if n and dim:
        cols = min(triton.next_power_of_2(dim), TUNING.uniform_cols)
        rows, salt = max(1, TUNING.uniform_elements // cols), salt & ((1 << 64) - 1)
        _uniform01_kernel[(triton.cdiv(n, rows),)](
            keys, out, n, dim, salt >> 32, salt & 0xFFFFFFFF, ROWS=rows, COLS=cols, BLOCKS=triton.cdiv(dim, cols)
        )  # fmt: skip
    return out


def find_two_choice(
    table_keys: torch.Tensor,
    tags: torch.Tensor,
    num_buckets: int,
    bucket_size: int,
    query: torch.Tensor,
    absent: Optional[torch.Tensor] = None,
    parts: Optional[Partitions] = None,
) -> torch.Tensor:
    """Slot of each query key, :data:`NO_SLOT` where absent (``tags``: the index's uint8 tag per
    slot). ``absent``: a zeroed ``[]`` int32 the same pass sets to 1 if a key is absent (``[P]``
    in a partitioned index, ``parts``: 1 for each partition with an absent key)."""
    query = query.contiguous()
    out = torch.empty_like(query)
    n = query.numel()
    if n:
        t = TUNING
        starts, key_parts, partitioned = partition_args(parts, query)
        _find_kernel[(triton.cdiv(n, t.find_block),)](
            table_keys, tags, query, out, out if absent is None else absent, starts, key_parts, n, num_buckets,
            BS=bucket_size, BSP=triton.next_power_of_2(bucket_size), FLAG=absent is not None, PARTS=partitioned,
            BLOCK=t.find_block, num_warps=t.find_warps,
        )  # fmt: skip
    return out


def candidate_buckets(keys: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two candidate buckets of each key in one kernel: ``(b1, b2)``, ``[n]`` int64 each."""
    keys = keys.contiguous()
    b1, b2 = torch.empty_like(keys), torch.empty_like(keys)
    n = keys.numel()
    if n:
        block = TUNING.buckets_block
        _candidate_buckets_kernel[(triton.cdiv(n, block),)](keys, b1, b2, n, num_buckets, BLOCK=block)
    return b1, b2
