"""Loading an export directory for scoring, without the training code.

Needs torch, safetensors, pyarrow and dynarec's config, data and embedding layers (the same
lookup code training evaluates with, in eval mode: a missing key of a dynamic table reads its
eval initializer). No optimizer state, checkpoint or trainer is involved.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from pydantic import ValidationError

from dynarec.config.load import error_path
from dynarec.config.schema import Config
from dynarec.data.batch import Batch, BatchBuilder, DataError
from dynarec.data.reader import ArrowBatchDataset, file_schema, make_loader, resolve_files
from dynarec.embedding.collection import EmbeddingCollection
from dynarec.export_format import (
    META,
    ExportError,
    export_chain,
    export_tensors,
    exported_config,
    load_export_file,
    materialize,
    merge_tables,
    read_export_meta,
    read_export_tables,
)
from dynarec.models.features import element_poolings, sequence_names
from dynarec.models.inputs import model_inputs
from dynarec.models.retrieval import Retrieval
from dynarec.models.tasks import check_predictions, no_logits, tasks_of
from dynarec.optim.sgd import SGD
from dynarec.planner.plan import plan_from_config

__all__ = ["ExportError", "ExportedModel"]


class ExportedModel:
    """A model loaded from an export directory — a full export, or a delta, with the chain of
    exports it is based on applied in order: every file checked against its export's manifest,
    every key of every table loaded (or an error), the dense program of the last export.
    :meth:`apply_delta` moves a loaded model forward by one delta (online learning)."""

    def __init__(self, export_dir: Union[str, Path], device: str = "cpu"):
        chain = export_chain(export_dir)
        export_dir, meta = chain[-1]
        self.device = torch.device(device)
        self._install(export_dir, meta, materialize(chain), _config_of(export_dir, meta))

    def _install(
        self, export_dir: Path, meta: dict[str, Any], tables: dict[str, dict[str, torch.Tensor]], config: Config
    ) -> None:
        """Serves export ``export_dir`` (``meta``) as its ``config`` says — a delta's own, which
        may process features, pool or initialize differently from its base's (``export --since``
        takes any export with the same tables): a collection of its tables loaded with ``tables``
        (export tensors), and its dense program. Everything is loaded and checked before any of it
        is served: on an error the model serves what it served."""
        embeddings = _serving_tables(config, self.device)
        key_counts: dict[str, int] = {}
        for name, table in embeddings.tables.items():
            if name not in tables:
                raise ExportError(f"{export_dir / META}: no file for table '{name}'")
            tensors = tables[name]
            report = table.load(tensors, weights_only=True, to_read=True)
            exported = meta["keys"].get(name)
            if report["dropped"] or report["loaded"] != exported:
                raise ExportError(
                    f"table '{name}': {export_dir / 'tables' / f'{name}.safetensors'} holds "
                    f"{tensors['keys'].numel()} keys ({META} says {exported}) but the serving table took "
                    f"{report['loaded']}; serving loads every exported key or none"
                )
            key_counts[name] = report["loaded"]
        dense = load_export_file(export_dir / "dense.pt2", lambda p: torch.export.load(p).module())
        self.embeddings, self.key_counts, self.dense = embeddings, key_counts, dense
        self.config = config
        self.sequence_features = sequence_names(config)
        self.element_pooling = element_poolings(config)
        self.tasks = tasks_of(config)
        self.step = meta.get("step")
        self.export_id = meta.get("id")

    def apply_delta(self, delta_dir: Union[str, Path]) -> None:
        """Applies one delta export on top of what this model serves (it must be based on this
        model's export): changed rows replaced, evicted keys removed, the dense program and the
        config (feature processing, poolings, initializers) the delta's. On an error the model
        serves what it served."""
        delta_dir = Path(delta_dir)
        meta = read_export_meta(delta_dir)
        base = meta.get("base") or {}
        if meta.get("kind") != "delta":
            raise ExportError(
                f"{delta_dir} is a full export, not a delta; load it with ExportedModel({str(delta_dir)!r})"
            )
        if base.get("id") != self.export_id:
            raise ExportError(
                f"{delta_dir}: a delta on export {base.get('id')} (step {base.get('step')}), but this model serves "
                f"export {self.export_id} (step {self.step}); apply the deltas of its chain in order"
            )
        config = _config_of(delta_dir, meta)
        names = sorted(t.name for t in plan_from_config(config, check_budgets=False).table_configs())
        if names != sorted(self.embeddings.tables):
            raise ExportError(
                f"{delta_dir}: its model has tables {names}, this model serves {sorted(self.embeddings.tables)}; "
                "a delta applies to a model of the same tables"
            )
        delta = read_export_tables(delta_dir, meta)
        current = {name: export_tensors(t.dump()) for name, t in self.embeddings.tables.items()}
        self._install(delta_dir, meta, {name: merge_tables(current[name], delta[name]) for name in current}, config)

    def _servable(self, files: list[str], builder: BatchBuilder) -> tuple[list[str], frozenset[str]]:
        """``(the outputs served, the features left empty)`` for ``files`` (``builder``: every
        feature's): every output where they hold every column; a retrieval model's tower whose
        columns they hold, otherwise (none: every output, and the missing column is the batches'
        error)."""
        names = self.tasks.served_names()
        if not isinstance(self.tasks, Retrieval):
            return names, frozenset()
        csv_types = builder.csv_column_types()
        present = set.intersection(*(set(file_schema(f, self.config.data.input_type, csv_types).names) for f in files))
        towers = self.tasks.tower_features(self.config)
        missing = {
            n: sorted({c for f in towers[n] for c in self.config.feature(f).columns if c not in present}) for n in names
        }
        readable = [n for n in names if not missing[n]]
        if not readable:
            raise DataError(
                f"{files[0]}: holds the columns of neither tower: "
                + "; ".join(f"{n} needs {cols}" for n, cols in missing.items())
            )
        if len(readable) == len(names):
            return names, frozenset()
        served = set().union(*(towers[n] for n in readable))
        return readable, frozenset(f.feature_name for f in self.config.features() if f.feature_name not in served)

    @torch.no_grad()
    def predict_batch(self, batch: Batch) -> dict[str, torch.Tensor]:
        """``{output name: [B] or [B, C]}`` (``Tasks.served``: the click probability
        ``probability`` of a single-task model; ``probs_<task>`` / ``y_<task>`` of a multi-task
        one; ``user_embedding`` and ``item_embedding`` ``[B, D]`` of a retrieval model)."""
        logits = self.dense(
            *model_inputs(self.embeddings, batch, self.sequence_features, self.device, self.element_pooling)
        )
        return self.tasks.served(logits)

    def predict_files(self, paths, batch_size: int = 4096) -> dict[str, np.ndarray]:
        """:meth:`predict_batch` over every row of ``paths``, in row order. A retrieval model's
        files may hold one tower's columns alone (an item catalog, a table of users): then that
        tower's output is served (the other tower's features are empty, its output not given)."""
        if batch_size < 1:
            raise ValueError(f"predict_files: batch_size is at least 1 row, got {batch_size}")
        files = resolve_files(paths)
        builder = BatchBuilder(self.config, with_labels=False)
        names, empty = self._servable(files, builder)
        if empty:
            builder = BatchBuilder(self.config, with_labels=False, empty_features=empty)
        dataset = ArrowBatchDataset(files, builder, batch_size, self.config.data.input_type)
        dataset.check_files()
        parts = [{k: v.cpu().numpy() for k, v in self.predict_batch(b).items()} for b in make_loader(dataset, 0)]
        if not parts:  # no rows: each output's no rows, of its own shape and type
            parts = [{k: v.numpy() for k, v in self.tasks.served(no_logits(self.tasks)).items()}]
        out = {name: np.concatenate([p[name] for p in parts]) for name in names}
        check_predictions(out, dataset.check_scores)
        return out


def _config_of(export_dir: Path, meta: dict[str, Any]) -> Config:
    """The config export ``export_dir`` (``meta``) was written with; ExportError where invalid."""
    try:
        return Config.model_validate(exported_config(export_dir, meta))
    except ValidationError as e:
        raise ExportError(
            f"{export_dir / META}: its config is invalid ({e.error_count()} error(s), the first at "
            f"{error_path(e.errors()[0])}: {e.errors()[0]['msg']})"
        ) from None


def _serving_tables(config: Config, device: torch.device) -> EmbeddingCollection:
    """``config``'s tables for serving, in eval mode: native backend, no optimizer state (SGD has
    none), no memory budget (a model trained on several ranks is served whole). On the CPU a
    table trained in host memory behind a cache is served whole: its cache would be host memory
    in front of host memory, and would bound the rows a batch may read."""
    whole = device.type == "cpu"
    tables = [
        dataclasses.replace(
            t, backend="native", optimizer=SGD(lr=0.0), cache_load_factor=None if whole else t.cache_load_factor
        )
        for t in plan_from_config(config, check_budgets=False).table_configs()
    ]
    embeddings = EmbeddingCollection(tables, device=device)
    embeddings.eval()
    return embeddings
