"""``dynarec verify --config C``: the optimizer contract, checked on the user's own config.

For every table of the config's plan, a few training steps run on synthetic ids through a copy
of the table with its real kind, backend, features and poolings, dim, initializer and optimizer
spec (a fixed table on at most ``MAX_ROWS`` rows; a dynamic table at a capacity of 8 buckets, so
that it grows, fills, evicts and sees evicted keys come back). After every step each row's
weight and optimizer states are compared with a plain per-row reference (``reference_update`` of
the optimizer registry, ``docs/optimizers.md``'s formulas): fresh rows start from the
initializer and the spec's initial state values (``initial_accumulator_value``), evicted rows
are forgotten, and a returning key starts fresh again. Where the other row-store backend can run
the spec (FBGEMM's TBE where installed), its twin runs the same steps against the same reference.
A table whose rows live in host memory (``cache_load_factor``) runs as such, its cache just
large enough for a step's ids (whatever share the config gives: the rows do not depend on it),
so that rows are evicted, written back and loaded again between the steps.

This is the check of the bug class dynarec exists to prevent — a setting that reaches one kind of
table and not another — runnable by any user, on any config, in seconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from dynarec.config.schema import Config
from dynarec.embedding import EmbeddingCollection, JaggedBatch
from dynarec.embedding.cached_store import CachedRowStore
from dynarec.embedding.config import Backend, FeatureConfig, TableConfig
from dynarec.embedding.dynamic import DynamicTable
from dynarec.embedding.fbgemm_store import fbgemm_available
from dynarec.embedding.initializers import mix64
from dynarec.optim.base import OptimizerSpec
from dynarec.optim.registry import definition, initial_states
from dynarec.optim.rounding import ROW_DTYPES, rounded_match, rounding_noise, stochastic_round
from dynarec.planner import plan_from_config

__all__ = ["MAX_ROWS", "TableVerdict", "verify_config", "verify_table"]

MAX_ROWS = 1000  # rows of a fixed table's copy (the optimizer does not depend on the row count)
RTOL, ATOL = 1e-5, 1e-6  # DESIGN.md's tolerance for float32 weights and states
BATCH, MAX_LEN = 16, 4


@dataclass
class TableVerdict:
    """The outcome of one table (and its other-backend twin, where it ran)."""

    table: str
    kind: str
    backend: str
    optimizer: str
    ok: bool
    max_dw: float = 0.0
    max_dstate: float = 0.0
    fresh_rows: int = 0
    returned_keys: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    mismatched: set[str] = field(default_factory=set)  # the fields (weight, state names) found wrong

    def line(self) -> str:
        status = "ok" if self.ok else "MISMATCH"
        parts = [
            f"{self.table}",
            f"{self.kind}/{self.backend}",
            self.optimizer,
            status,
            f"max|dw| {self.max_dw:.1e}",
            f"max|dstate| {self.max_dstate:.1e}",
        ]
        if self.kind == "dynamic":
            parts.append(f"fresh rows {self.fresh_rows}, evicted-and-returned keys {self.returned_keys}")
        return "  ".join(parts + self.notes + self.problems)


def verify_config(config: Config, device: str = "cpu", steps: int = 8, seed: int = 0) -> list[TableVerdict]:
    """One verdict per table of ``config``'s (single-process) plan, in plan order."""
    return [
        verify_table(t, device=device, steps=steps, seed=seed)
        for t in plan_from_config(config, check_budgets=False).table_configs()
    ]


def verify_table(table: TableConfig, device: str = "cpu", steps: int = 8, seed: int = 0) -> TableVerdict:
    """Runs ``steps`` training steps on a copy of ``table`` (and of its other-backend twin) and
    compares every row with the plain reference after each step."""
    spec = table.optimizer
    assert spec is not None, "a planned table always carries its optimizer spec"
    copy = _small_copy(table)
    kind = "dynamic" if table.dynamic is not None else "fixed"
    rows = "" if table.data_type == "fp32" else f" {table.data_type} rows"
    if copy.cache_load_factor is not None:
        rows += " in host memory"
    verdict = TableVerdict(table.name, kind, table.backend + rows, repr(spec), ok=True)
    _run(copy, spec, device, steps, seed, verdict, record=True)
    other: Backend = "fbgemm" if table.backend == "native" else "native"
    if other == "fbgemm" and not fbgemm_available():
        verdict.notes.append("(fbgemm twin: FBGEMM not installed)")
    elif other == "fbgemm" and isinstance(definition(spec).fbgemm, str):
        verdict.notes.append(f"(fbgemm twin: refused, {definition(spec).fbgemm})")
    else:
        twin = TableVerdict(table.name, kind, other, repr(spec), ok=True)
        try:
            # (the twin keeps every row on the device: a cache is the native backend's)
            twin_table = dataclasses.replace(copy, backend=other, cache_load_factor=None)
            _run(twin_table, spec, device, steps, seed, twin, record=False)
        except ValueError as e:  # the other backend refuses this table (a setting it cannot take)
            verdict.notes.append(f"({other} twin: refused, {e})")
        else:
            verdict.notes.append(f"({other} twin {'ok' if twin.ok else 'MISMATCH'}, max|dw| {twin.max_dw:.1e})")
            verdict.ok &= twin.ok
            verdict.problems += [f"[{other}] {p}" for p in twin.problems]
    return verdict


def _step_cache(table: TableConfig, rows: int) -> float:
    """The cache of a copy of ``rows`` rows of a table kept in host memory: room for a step's ids
    (at most BATCH x MAX_LEN a feature) and no more, whatever share the config gives (the rows do
    not depend on it), so that rows are evicted, written back and loaded again between steps."""
    return min(1.0, BATCH * MAX_LEN * len(table.features) / rows)


def _small_copy(table: TableConfig) -> TableConfig:
    if table.dynamic is None:
        assert table.num_embeddings is not None
        rows = min(table.num_embeddings, MAX_ROWS)
        cache = None if table.cache_load_factor is None else _step_cache(table, rows)
        return dataclasses.replace(table, num_embeddings=rows, sharding=None, cache_load_factor=cache)
    d = table.dynamic
    bs = d.bucket_size
    admission = d.admission
    if admission is not None and admission.capacity is not None:
        admission = dataclasses.replace(admission, capacity=min(admission.capacity, 64 * bs))
    # 8 buckets per feature: a step's ids (at most BATCH x MAX_LEN a feature) always fit, as in its
    # cache. Under admission a step admits at most BATCH x MAX_LEN / threshold keys a feature: 4
    # buckets, which the flood of admitted keys fills (at 8 it evicted nothing).
    buckets = 4 if admission is not None and admission.threshold > 1 else 8
    capacity = buckets * bs * len(table.features)
    cache = None if table.cache_load_factor is None else _step_cache(table, capacity)
    # check_mode 'ignore': a key the small copy's full buckets leave without a row (its own sizing,
    # not the config's) reads the eval initializer, as the reference expects, and is counted.
    return dataclasses.replace(
        table,
        dynamic=dataclasses.replace(
            d, max_capacity=capacity, init_capacity=2 * bs, admission=admission, check_mode="ignore"
        ),
        sharding=None,
        cache_load_factor=cache,
    )


def _step_ids(table: TableConfig, step: int, rng: np.random.Generator) -> list[list[list[int]]]:
    """Per feature, ``BATCH`` samples of up to ``MAX_LEN`` ids (duplicates included).

    Fixed: Zipf-distributed rows. Dynamic: a warm set ``A`` of keys, then (steps 2-4) a flood of
    new keys that fills the table and evicts ``A`` (where the table evicts), then ``A`` again.
    Under admission (threshold ``T`` > 1) the flood's every sample holds ``MAX_LEN`` ids, each
    new key ``T`` times in the step: admitted at once, they fill the table as a flood does."""
    admission = table.dynamic.admission if table.dynamic is not None else None
    repeat = admission.threshold if admission is not None else 1
    samples = []
    for _ in table.features:
        flood = table.dynamic is not None and 2 <= step <= 4 and table.dynamic.score_strategy != "none"
        if flood and repeat > 1:
            keys = rng.choice(
                np.arange(1000 + 1000 * step, 2000 + 1000 * step), BATCH * MAX_LEN // repeat, replace=False
            )
            flat = rng.permutation(np.resize(np.repeat(keys, repeat), BATCH * MAX_LEN)).tolist()
            samples.append([flat[i : i + MAX_LEN] for i in range(0, BATCH * MAX_LEN, MAX_LEN)])
            continue
        feature = []
        for _ in range(BATCH):
            n = int(rng.integers(1, MAX_LEN + 1))
            if table.dynamic is None:
                assert table.num_embeddings is not None
                ids = [int(x - 1) % table.num_embeddings for x in rng.zipf(1.3, size=n)]
            elif flood:
                ids = [int(x) for x in rng.integers(1000 + 1000 * step, 2000 + 1000 * step, size=n)]
            else:
                ids = [int(x) for x in rng.integers(0, 24, size=n)]
            feature.append(ids)
        samples.append(feature)
    if table.dynamic is not None:  # keys spread over the int64 range, as real ids are hashed
        samples = [[[int(mix64(torch.tensor(i))) for i in s] for s in f] for f in samples]
    return samples


class _Reference:
    """Every row the table holds, as the plain reference computes it: ``{key: (w, states)}``."""

    def __init__(self, coll: EmbeddingCollection, name: str, spec: OptimizerSpec):
        self.table = coll.tables[name]
        self.spec = spec
        self.dtype = ROW_DTYPES[self.table.config.data_type]
        # half-precision rows updated this step: key -> (the float32 update, its rounding draws)
        self.unrounded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rows: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self.fresh = 0
        self.returned = 0
        self._evicted: set[int] = set()
        if coll.tables[name].config.dynamic is None:
            self._create(range(len(coll.tables[name].dump()["weight"])))

    def _create(self, keys) -> None:
        """Fresh rows: the table's key-seeded initial weights, the spec's initial state values."""
        keys = list(keys)
        if not keys:
            return
        weights = self.table.initial_weights(torch.tensor(keys, dtype=torch.int64, device=self.table.device)).cpu()
        weights = weights.to(self.dtype).float()  # half-precision rows start at the nearest value
        states = initial_states(self.spec, len(keys), weights.shape[1])
        for i, key in enumerate(keys):
            self.rows[key] = (weights[i].clone(), {name: v[i].clone() for name, v in states.items()})

    def step(self, held: set[int], grads: dict[int, torch.Tensor]) -> None:
        """One step: rows that left the table are forgotten, new ones start fresh, and every
        held row with a gradient is updated (the table's step counter after the step)."""
        for key in list(self.rows):
            if key not in held:
                del self.rows[key]
                self._evicted.add(key)
        new = sorted(held - set(self.rows))
        self._create(new)
        self.fresh += len(new)
        self.returned += len(self._evicted.intersection(new))
        update = definition(self.spec).reference_update
        updated = [key for key in sorted(grads) if key in self.rows]
        for key in updated:
            w, states = self.rows[key]
            update(self.spec, lr=self.spec.lr, step=self.table.step, w=w, states=states, g=grads[key].clone())
        self.unrounded = {}
        if self.dtype != torch.float32 and updated:  # half-precision rows: stored by stochastic rounding
            w = torch.stack([self.rows[k][0] for k in updated])
            noise = rounding_noise(int(self.table.config.seed or 0), self.table.step, torch.tensor(updated), w.shape[1])
            for i, (k, row) in enumerate(zip(updated, stochastic_round(w, self.dtype, noise).float())):
                self.unrounded[k] = (w[i].clone(), noise[i])
                self.rows[k][0].copy_(row)


def _run(
    table: TableConfig,
    spec: OptimizerSpec,
    device: str,
    steps: int,
    seed: int,
    verdict: TableVerdict,
    record: bool,
) -> None:
    coll = EmbeddingCollection([table], spec, device=device)
    coll.train()
    ref = _Reference(coll, table.name, spec)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    features = [f for f in table.features if isinstance(f, FeatureConfig)]  # (__post_init__ made them so)
    poolings = {f.name: f.pooling or table.pooling for f in features}
    for step in range(steps):
        samples = _step_ids(table, step, rng)
        batch = JaggedBatch.from_lists({f.name: s for f, s in zip(features, samples)})
        out = coll(batch.to(device) if device != "cpu" else batch)
        upstream = {name: torch.randn(v.shape, generator=gen) for name, v in out.items()}
        sum((out[n] * upstream[n].to(out[n].device)).sum() for n in out).backward()
        table_spec = coll.tables[table.name].spec
        clip = table_spec.max_gradient if table_spec.gradient_clipping else None
        grads = _row_gradients(features, samples, poolings, upstream, clip)
        ref.step(_held_keys(coll, table), grads)
        _compare(coll, table, ref, verdict, step)
    if record:
        verdict.fresh_rows, verdict.returned_keys = ref.fresh, ref.returned
        held = coll.tables[table.name]
        dropped = held.report()["dropped_keys"] if isinstance(held, DynamicTable) else 0
        if dropped:
            verdict.notes.append(f"({dropped} new key(s) found no row in the small copy's full buckets)")
        store = coll.tables[table.name].store
        if isinstance(store, CachedRowStore):
            verdict.notes.append(
                f"(cache of {store.cache_rows} of {store.num_rows} rows: {store.counters['loaded']} loaded, "
                f"{store.counters['written_back']} written back)"
            )


def _row_gradients(features, samples, poolings, upstream, clip: float | None = None) -> dict[int, torch.Tensor]:
    """d loss / d row of every looked-up id, for ``loss = sum_f (out_f * upstream_f).sum()``;
    with ``clip`` (gradient_clipping's max_gradient) each bag's output gradient clamped to
    ``[-clip, clip]`` first, as FBGEMM's TBE and every dynarec backend do (docs/optimizers.md)."""
    grads: dict[int, torch.Tensor] = {}
    for f, feature in zip(features, samples):
        g = upstream[f.name] if clip is None else upstream[f.name].clamp(-clip, clip)
        for b, ids in enumerate(feature):
            for j, key in enumerate(ids):
                if poolings[f.name] == "none":
                    contrib = g[b, j]  # (each position of a sequence its own bag)
                elif poolings[f.name] == "mean":
                    contrib = g[b] / len(ids)
                else:
                    contrib = g[b]
                grads[key] = grads[key] + contrib if key in grads else contrib.clone()
    return grads


def _held_keys(coll: EmbeddingCollection, table: TableConfig) -> set[int]:
    t = coll.tables[table.name]
    if table.dynamic is None:
        return set(range(table.num_embeddings or 0))
    return set(t.dump()["keys"].tolist())


def _compare(coll: EmbeddingCollection, table: TableConfig, ref: _Reference, verdict: TableVerdict, step: int) -> None:
    keys = sorted(ref.rows)
    if not keys:
        return
    got = coll.read_rows(table.name, torch.tensor(keys, dtype=torch.int64, device=coll.device))
    want_w = torch.stack([ref.rows[k][0] for k in keys])
    checks = [("weight", got["weight"].cpu(), want_w)]
    for name in ref.rows[keys[0]][1]:
        checks.append((name, got[name].cpu(), torch.stack([ref.rows[k][1][name] for k in keys])))
    for name, a, b in checks:
        diff = (a - b).abs()
        worst = float(diff.max()) if diff.numel() else 0.0
        if name == "weight":
            verdict.max_dw = max(verdict.max_dw, worst)
        else:
            verdict.max_dstate = max(verdict.max_dstate, worst)
        bad = diff > ATOL + RTOL * b.abs()
        if name == "weight" and ref.unrounded:  # a rounded row: its draw may straddle two close updates
            for i in (i for i, k in enumerate(keys) if k in ref.unrounded):
                x, noise = ref.unrounded[keys[i]]
                bad[i] = ~rounded_match(a[i], x, ref.dtype, noise, RTOL, ATOL)
        if bool(bad.any()) and name not in verdict.mismatched:  # the first step each field went wrong
            i = int(bad.nonzero()[0, 0])
            verdict.ok = False
            verdict.mismatched.add(name)
            verdict.problems.append(
                f"step {step + 1}: {name} of id {keys[i]} is {a[i].tolist()[:4]}..., the reference "
                f"{b[i].tolist()[:4]}..."
            )


def main(args) -> int:
    """The ``dynarec verify`` command: one line per table; 1 when any table mismatches."""
    from dynarec.config import load_config

    config = load_config(args.config)
    verdicts = verify_config(config, device=args.device, steps=args.steps)
    for v in verdicts:
        print(v.line())
    bad = [v.table for v in verdicts if not v.ok]
    if bad:
        print(f"verify: the optimizer contract does not hold on table(s) {bad}")
        return 1
    print(f"verify: {len(verdicts)} table(s) ok")
    return 0
