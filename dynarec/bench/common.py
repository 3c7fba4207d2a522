"""What every benchmark shares: workloads, interleaved timing, the roofline accounting."""

from __future__ import annotations

import functools
import gc
import hashlib
import inspect
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from dynarec.data import generate, synthetic
from dynarec.data.generate import GenerateSpec
from dynarec.embedding import DynamicTableOptions, EmbeddingCollection, JaggedBatch, TableConfig
from dynarec.embedding.config import Backend, ScoreStrategy
from dynarec.embedding.hash_index import BucketedHashIndex
from dynarec.embedding.initializers import mix64

__all__ = [
    "Workload",
    "cached_click_log",
    "copy_bandwidth",
    "filled_hash_index",
    "insert_keys",
    "make_table",
    "make_tables",
    "measure",
    "ratio",
    "roofline_bytes_per_id",
    "same_dynarec",
    "set_field",
    "synchronizer",
]

HBM_ROOFLINE_GBPS = 4300.0  # H200 HBM3e as measured by a device-to-device copy here (docs/benchmarks.md)


@dataclass
class Workload:
    """``bags`` bags of ``pooling_factor`` ids a step over a table of ``num_embeddings`` rows
    (``dim`` wide), drawn from Zipf(``zipf_a``) in ``num_batches`` draws. ``zipf_bounded``:
    rank ``k`` of ``0 .. num_embeddings - 1`` drawn with probability proportional to
    ``(k + 1) ** -zipf_a`` (Zipf over the table's rows); else numpy's unbounded Zipf draw modulo
    ``num_embeddings``, as the step benchmarks have drawn since they began: its tail past the
    rows lands nearly uniformly over them (at ``zipf_a`` = 1.05 and 40M rows, 40% of the ids)."""

    num_embeddings: int = 1_000_000
    dim: int = 64
    bags: int = 4096
    pooling_factor: int = 20
    zipf_a: float = 1.05
    num_batches: int = 8
    seed: int = 0
    zipf_bounded: bool = False
    #: Tables the bags are dealt to: feature ``f{i}`` of table ``t{i}`` takes bags
    #: ``[i * bags / tables, (i + 1) * bags / tables)``, each table ``num_embeddings`` rows (1:
    #: table ``t``, feature ``f``).
    tables: int = 1

    @property
    def features(self) -> list[str]:
        return ["f"] if self.tables == 1 else [f"f{i}" for i in range(self.tables)]

    @property
    def ids_per_step(self) -> int:
        return self.bags * self.pooling_factor

    def batches(
        self,
        keys_over_int64: bool = False,
        scatter_rows: bool = False,
        device: str = "cpu",
        new_keys: float = 0.0,
        count: Optional[int] = None,
    ) -> list[JaggedBatch]:
        """Batches on the host (pinned where ``device`` is CUDA: the collection validates them
        there, with no device sync, and copies them over asynchronously, as in training), with
        their ids' range computed, as the trainer's data stage computes it in its workers.
        ``keys_over_int64``: ids hashed over the int64 range (dynamic tables);
        ``scatter_rows``: ids hashed over ``[0, num_embeddings)`` (a fixed table whose hot rows
        are spread like a dynamic table's slots, not packed at the low ids).

        ``count`` batches (default ``num_batches``): batch ``k`` holds the ids of the
        ``k % num_batches``-th Zipf draw, and where ``new_keys`` > 0 that share of its positions
        holds ids seen in no other batch: with ``keys_over_int64``, keys of ids
        ``num_embeddings`` and up, each used once (a dynamic table's new keys); otherwise rows
        drawn uniformly (a fixed table's cold rows). A draw gives up the same positions in every
        batch made of it (whatever the flags), so the Zipf ids it keeps are the same: a warm-up
        over the first ``num_batches`` batches has seen every one of them, and each later batch
        holds exactly that share of new keys."""
        rng = np.random.default_rng(self.seed)
        draws = [self._zipf_draw(rng) for _ in range(self.num_batches)]
        fresh = round(new_keys * self.ids_per_step)
        out = []
        for k in range(self.num_batches if count is None else count):
            ids = torch.from_numpy(draws[k % self.num_batches]).long()
            if keys_over_int64:
                ids = mix64(ids)  # a bijection: same duplicate structure, keys spread over int64
            elif scatter_rows:
                ids = (mix64(ids) & ((1 << 63) - 1)) % self.num_embeddings
            if fresh:
                draw_rng = np.random.default_rng((self.seed, k % self.num_batches))
                at = torch.from_numpy(draw_rng.choice(self.ids_per_step, fresh, replace=False))
                if keys_over_int64:
                    new = mix64(torch.arange(fresh, dtype=torch.int64) + self.num_embeddings + k * fresh)
                else:
                    new = torch.from_numpy(
                        np.random.default_rng((self.seed, k)).integers(0, self.num_embeddings, fresh)
                    )
                ids = ids.clone()
                ids[at] = new
            lengths = torch.full((self.bags,), self.pooling_factor, dtype=torch.int64)
            # the ids' range as the data stage's workers give it (a fixed table's range check reads it)
            per_feature = ids.view(self.tables, -1)
            ranges = [(int(x.min()), int(x.max())) for x in per_feature]
            batch = JaggedBatch(self.features, ids, lengths).with_id_ranges(ranges)
            out.append(batch.pin_memory() if device.startswith("cuda") else batch)  # pinned: as the DataLoader's
        return out

    def _zipf_draw(self, rng: np.random.Generator) -> np.ndarray:
        """One step's ids, int64 in ``[0, num_embeddings)`` (see the class doc)."""
        if not self.zipf_bounded:
            return (rng.zipf(self.zipf_a, size=self.ids_per_step) - 1) % self.num_embeddings
        cdf = _zipf_cdf(self.zipf_a, self.num_embeddings)
        ranks = np.searchsorted(cdf, rng.random(self.ids_per_step) * cdf[-1], side="right")
        return np.minimum(ranks, self.num_embeddings - 1).astype(np.int64)  # (a draw rounded up to cdf[-1])

    def unique_fraction(self, batches: list[JaggedBatch]) -> float:
        return statistics.mean(torch.unique(b.values()).numel() / b.values().numel() for b in batches)


@functools.lru_cache(maxsize=1)
def _zipf_cdf(a: float, n: int) -> np.ndarray:
    """``cdf[k] = sum_{j <= k} (j + 1) ** -a``, float64 ``[n]`` (unnormalized)."""
    return np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -a)


def synchronizer(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def insert_keys(index: BucketedHashIndex, keys: torch.Tensor) -> None:
    """Inserts ``keys`` (distinct, ascending, absent) into free slots, 4M at a time, score 0."""
    for chunk in keys.split(1 << 22):
        index.commit(index.plan_insert(chunk, allow_evict=False, keys_ascending=True), torch.zeros_like(chunk))


def filled_hash_index(
    slots: int, load: float, device: str | torch.device, generator: torch.Generator
) -> tuple[BucketedHashIndex, torch.Tensor]:
    """The hash benchmarks' table: ``slots`` slots in 16-slot buckets holding the distinct keys of
    ``slots * load`` uniform int64 draws (on the host, from ``generator``). Returns the index and
    its keys, ascending."""
    index = BucketedHashIndex(slots // 16, 16, device)
    keys = torch.unique(torch.randint(-(2**62), 2**62, (int(slots * load),), generator=generator)).to(device)
    insert_keys(index, keys)
    return index, keys


def make_table(
    kind: str,
    backend: Backend,
    w: Workload,
    score_strategy: ScoreStrategy = "step",
    name: str = "t",
    feature: str = "f",
) -> TableConfig:
    if kind == "fixed":
        return TableConfig(name=name, dim=w.dim, num_embeddings=w.num_embeddings, features=[feature], backend=backend)
    # The same ids must all get rows, or every timed step retries inserting the rest. A step that
    # touches most rows pins them all, and a pinned row cannot move to make room: at 90% load
    # (max_capacity's promise for keys spread over steps) such a step leaves a few hundred keys
    # of 100k without a slot. Sized for 80% load at most.
    cap = 16 * -(-w.num_embeddings * 5 // (4 * 16))
    return TableConfig(
        name=name,
        dim=w.dim,
        dynamic=DynamicTableOptions(cap, init_capacity=cap, score_strategy=score_strategy),
        features=[feature],
        backend=backend,
    )


def make_tables(kind: str, backend: Backend, w: Workload, score_strategy: ScoreStrategy = "step") -> list[TableConfig]:
    """:func:`make_table` for each of ``w``'s tables (``t``, or ``t0`` .. with features ``f0`` ..)."""
    if w.tables == 1:
        return [make_table(kind, backend, w, score_strategy)]
    return [make_table(kind, backend, w, score_strategy, f"t{i}", f) for i, f in enumerate(w.features)]


def _time_steps(
    coll: EmbeddingCollection, batches: list[JaggedBatch], steps: int, sync: Callable[[], None], first: int = 0
) -> tuple[float, float]:
    """Runs ``steps`` training steps as the trainer does (the input stage of the batch
    ``prefetch_depth`` steps ahead once the backward is queued), on ``batches`` from index
    ``first`` on, cyclically; returns ``(host, total)`` seconds: the host's loop alone, and until
    the device finished. ``host / total`` near 1: the host bounds the step (or waits in it)."""
    depth = coll.prefetch_depth
    n = len(batches)
    for i in range(depth):  # ready as the step before would have left them
        coll.prefetch(batches[(first + i) % n])
    sync()
    start = time.perf_counter()
    for i in range(first, first + steps):
        sum(out.sum() for out in coll(batches[i % n]).values()).backward()
        coll.prefetch(batches[(i + depth) % n])
    host = time.perf_counter() - start
    sync()
    return host, time.perf_counter() - start


def measure(
    makers: dict[str, Callable[[], EmbeddingCollection]],
    batches: dict[str, list[JaggedBatch]],
    steps: int,
    runs: int,
    warmup: int,
    device: str,
    stream: int = 0,
) -> dict[str, dict[str, Any]]:
    """Times several setups with their timed runs interleaved (a, b, a, b, ...), so that every
    setup sees the same machine state; reports each one's median and per-run rates (ids/s), and
    the median share of a run's time the host's loop took (``host_share``). Warm-up covers every
    batch once, so a dynamic table's timed steps meet no new key — unless ``stream`` (at least
    ``warmup_steps`` of them): then the batches are a sequence run through once, the warm-up its
    first ``warmup_steps`` and each timed run the next ``steps`` (the stream needs
    ``warmup_steps + runs * steps`` batches, and the collection's prefetch depth beyond)."""
    sync = synchronizer(device)
    gc.collect()  # the previous measurement's tables, before this one's are allocated
    colls = {}
    warm = {name: stream or max(warmup, len(b)) for name, b in batches.items()}
    for name, make in makers.items():
        colls[name] = make()
        need = warm[name] + runs * steps + colls[name].prefetch_depth
        if stream and len(batches[name]) < need:
            raise ValueError(f"{name}: a stream of {len(batches[name])} batches; its runs read {need}")
        _time_steps(colls[name], batches[name], warm[name], sync)
    rates: dict[str, list[float]] = {name: [] for name in makers}
    shares: dict[str, list[float]] = {name: [] for name in makers}
    for run in range(runs):
        for name, coll in colls.items():
            ids = batches[name][0].values().numel()
            first = warm[name] + run * steps if stream else 0
            host, total = _time_steps(coll, batches[name], steps, sync, first)
            rates[name].append(ids * steps / total)
            shares[name].append(host / total)
    return {
        name: {
            "ids_per_s_median": statistics.median(rates[name]),
            "ids_per_s_runs": rates[name],
            "host_share": statistics.median(shares[name]),
            "coll": colls[name],
        }
        for name in makers
    }


def ratio(results: dict, a: str, b: str) -> float:
    """Median over runs of a's rate / b's rate in the same (interleaved) run."""
    return statistics.median(x / y for x, y in zip(results[a]["ids_per_s_runs"], results[b]["ids_per_s_runs"]))


def roofline_bytes_per_id(w: Workload, unique_fraction: float, state_floats: Optional[int] = None) -> float:
    """docs/benchmarks.md's byte count of a fused fp32 step, per looked-up id: forward 4D per id
    + 4D per pooled output; backward 4D per output gradient + 8D per id + per unique row the weight
    and the optimizer state read and written (16D for Adagrad; ``state_floats`` per row)."""
    d = w.dim
    per_output = (4 * d + 4 * d) / w.pooling_factor
    state = d if state_floats is None else state_floats
    return 4 * d + 8 * d + per_output + 8 * (d + state) * unique_fraction


def copy_bandwidth(device: str, nbytes: int = 1 << 31) -> float:
    """GB/s of a device-to-device copy (bytes read + written), median of 5 — the ceiling to quote."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    sync = synchronizer(device)
    y.copy_(x)
    times = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        y.copy_(x)
        sync()
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times) / 1e9


def same_dynarec() -> dict[str, str]:
    """The environment of a child process that imports the ``dynarec`` this process runs: its
    package's parent directory first on ``PYTHONPATH`` (a checkout run in place, or another
    revision's worktree, is not on the child's path when it starts elsewhere)."""
    import dynarec

    root = str(Path(dynarec.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root if not path else os.pathsep.join([root, path])}


def set_field(raw: dict[str, Any], assignment: str) -> None:
    """``raw`` (a config's dict) with the field of ``assignment``, ``dotted.key=value`` (the
    value read as YAML: ``true``, ``4096``, ``[64, 32]``), set in place; ValueError naming it
    where it is not of that form or a parent on the way is not a section."""
    import yaml

    key, sep, value = assignment.partition("=")
    if not sep or not key:
        raise ValueError(f"--set {assignment!r}: give KEY=VALUE, the key dotted (train.whole_step_graphs=true)")
    *parents, last = key.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"--set {assignment!r}: {part} is not a section of the config")
    node[last] = yaml.safe_load(value)


def cached_click_log(spec: synthetic.SyntheticSpec) -> Path:
    """The click log of ``spec`` in the temp directory, generated on first use. Its directory is
    named by a hash of the spec and of the generator's source, so a changed generator or spec
    never reads another's data (and concurrent first uses each write whole, then rename)."""
    key = json.dumps(asdict(spec), sort_keys=True) + inspect.getsource(synthetic)
    path = _cache_path("dynarec-click-log", key)
    if not (path / "meta.json").is_file():
        synthetic.make_click_log(path, spec)
    return path


def cached_config_data(raw: dict[str, Any], spec: GenerateSpec) -> Path:
    """``dynarec make-data --config`` of the config ``raw`` (its dict form) at ``spec``, in the
    temp directory, generated on first use and named by a hash of both and of the generator's
    source, as :func:`cached_click_log`."""
    from dynarec.config import config_from_dict

    key = json.dumps(raw, sort_keys=True) + json.dumps(asdict(spec), sort_keys=True) + inspect.getsource(generate)
    path = _cache_path("dynarec-config-data", key)
    if not (path / "meta.json").is_file():
        generate.make_config_data(config_from_dict(raw), path, spec)
    return path


def _cache_path(prefix: str, key: str) -> Path:
    return Path(tempfile.gettempdir()) / f"{prefix}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
