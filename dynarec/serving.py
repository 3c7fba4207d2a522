"""Loading an export directory for scoring, without the training code.

Needs torch, safetensors, pyarrow and dynarec's config, data and embedding layers (the same
lookup code training evaluates with, in eval mode: a missing key of a dynamic table reads its
eval initializer). No optimizer state, checkpoint or trainer is involved.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from dynarec.config.schema import Config, SequenceFeatureCfg
from dynarec.data.batch import Batch, BatchBuilder
from dynarec.data.reader import ArrowBatchDataset, make_loader, resolve_files
from dynarec.embedding.collection import EmbeddingCollection
from dynarec.files import read_json, verify_manifest
from dynarec.models.inputs import model_inputs
from dynarec.optim.sgd import SGD
from dynarec.planner.plan import plan_from_config

__all__ = [
    "EXPORT_FORMAT",
    "META",
    "ExportError",
    "ExportedModel",
    "export_chain",
    "export_tensors",
    "materialize",
    "merge_tables",
    "read_export_meta",
]

# The layout version of an export directory (train/export.py writes it, ExportedModel checks it).
# 2: export.json carries a manifest (size and SHA-256 of every file) and each table's key count;
# dynamic tables carry their slots and bucket layout. 3: every export has an id; a delta export
# (kind "delta") names the export it is based on. Format 2 exports still load (as full ones).
EXPORT_FORMAT = 3
READABLE_FORMATS = (2, 3)
META = "export.json"
# The tensors of a table in an export (a fixed table's keys are 0..N-1); a delta adds tombstones.
TABLE_FIELDS = ("keys", "weight", "scores", "slots", "layout")


class ExportError(ValueError):
    """An export directory cannot be served; the message names the file and why."""


def read_export_meta(export_dir: Union[str, Path]) -> dict[str, Any]:
    """``export.json`` of an export directory, its files checked against the manifest."""
    export_dir = Path(export_dir)
    meta_path = export_dir / META
    if not meta_path.is_file():
        raise ExportError(f"{export_dir} is not an export directory (no {META})")
    meta = read_json(meta_path, ExportError)
    if not isinstance(meta, dict) or not all(k in meta for k in ("format", "config", "files", "keys")):
        raise ExportError(f"{meta_path} is not an export description (format, config, files, keys)")
    if meta["format"] not in READABLE_FORMATS:
        raise ExportError(
            f"{meta_path}: export format {meta['format']!r}, this dynarec reads formats {list(READABLE_FORMATS)}; "
            "export the model again with this version"
        )
    verify_manifest(export_dir, meta["files"], meta_path, ExportError)
    return meta


def _export_id(directory: Path) -> Any:
    """The id in ``directory/export.json`` (unverified), or None where there is none."""
    try:
        meta = json.loads((directory / META).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return meta.get("id") if isinstance(meta, dict) else None


def find_base(delta_dir: Path, base: dict[str, Any]) -> Path:
    """Where the export a delta names (``base``: its id, step, and path relative to the delta)
    is: at that path when it holds that id, else the sibling export of the delta that holds it
    (a chain copied or moved as a whole); ExportError naming the id and step otherwise."""
    recorded = delta_dir / str(base.get("path", ""))
    if base.get("path") and _export_id(recorded) == base.get("id"):
        return recorded
    if base.get("id") is not None and delta_dir.parent.is_dir():
        for sibling in sorted(delta_dir.parent.iterdir()):
            if sibling.is_dir() and _export_id(sibling) == base.get("id"):
                return sibling
    where = (
        f"{recorded} holds export {_export_id(recorded)}" if (recorded / META).is_file() else f"nothing at {recorded}"
    )
    raise ExportError(
        f"{delta_dir}: a delta on export {base.get('id')} (step {base.get('step')}), which is neither where it was "
        f"written ({where}) nor beside the delta; keep a delta chain's exports together"
    )


def export_chain(export_dir: Union[str, Path]) -> list[tuple[Path, dict[str, Any]]]:
    """``[(directory, meta), ...]`` from the full export a delta is based on, through every delta,
    to ``export_dir``: each delta's base is found by :func:`find_base` (its recorded relative
    path, else among the delta's siblings by id)."""
    chain = [(Path(export_dir), read_export_meta(export_dir))]
    while chain[0][1].get("kind") == "delta":
        directory, meta = chain[0]
        base = meta.get("base") or {}
        base_dir = find_base(directory, base)
        if any(base_dir.resolve() == d.resolve() for d, _ in chain):
            raise ExportError(f"{directory}: its base chain loops back to {base_dir}")
        base_meta = read_export_meta(base_dir)
        if base_meta.get("id") != base.get("id"):
            raise ExportError(
                f"{directory}: a delta on export {base.get('id')} (step {base.get('step')}), but {base_dir} holds "
                f"export {base_meta.get('id')} (step {base_meta.get('step')}); apply a delta to the export it was "
                "computed from"
            )
        chain.insert(0, (base_dir, base_meta))
    return chain


def read_export_tables(export_dir: Path, meta: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """The table files of one export (full or delta), by table name."""
    names = [n[len("tables/") : -len(".safetensors")] for n in meta["files"] if n.startswith("tables/")]
    return {name: _load(export_dir / "tables" / f"{name}.safetensors", load_file) for name in names}


def merge_tables(base: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A table's export tensors after a delta: its rows replace the base's rows of the same keys
    (new keys are added), its tombstones remove keys; dynamic tables stay ordered by key and take
    the delta's bucket layout."""
    if "slots" not in base:  # a fixed table: keys are row ids
        weight = base["weight"].clone()
        weight[delta["keys"]] = delta["weight"]
        return {"keys": base["keys"], "weight": weight}
    gone = torch.isin(base["keys"], torch.cat([delta["keys"], delta["tombstones"]]))
    fields = ("keys", "weight", "scores", "slots")
    merged = {f: torch.cat([base[f][~gone], delta[f]]) for f in fields}
    order = torch.argsort(merged["keys"])
    out = {f: merged[f][order] for f in fields}
    out["layout"] = delta["layout"]
    return out


def materialize(chain: list[tuple[Path, dict[str, Any]]]) -> dict[str, dict[str, torch.Tensor]]:
    """Every table of the last export of ``chain`` (full export + deltas, in order)."""
    tables = read_export_tables(*chain[0])
    for directory, meta in chain[1:]:
        delta = read_export_tables(directory, meta)
        if set(delta) != set(tables):
            raise ExportError(f"{directory}: its tables {sorted(delta)} differ from its base's {sorted(tables)}")
        tables = {name: merge_tables(tables[name], delta[name]) for name in tables}
    return tables


class ExportedModel:
    """A model loaded from an export directory — a full export, or a delta, with the chain of
    exports it is based on applied in order: every file checked against its export's manifest,
    every key of every table loaded (or an error), the dense program of the last export.
    :meth:`apply_delta` moves a loaded model forward by one delta (online learning)."""

    def __init__(self, export_dir: Union[str, Path], device: str = "cpu"):
        chain = export_chain(export_dir)
        export_dir, meta = chain[-1]
        try:
            self.config = Config.model_validate(meta["config"])
        except ValidationError as e:
            raise ExportError(
                f"{export_dir / META}: its config is invalid ({e.error_count()} error(s): {e.errors()[0]['msg']})"
            ) from None
        self.device = torch.device(device)
        # Serving tables: native backend, no optimizer state (SGD has none).
        tables = [
            dataclasses.replace(t, backend="native", optimizer=SGD(lr=0.0))
            for t in plan_from_config(self.config).table_configs()
        ]
        self.embeddings = EmbeddingCollection(tables, device=self.device)
        self.embeddings.eval()
        self.key_counts: dict[str, int] = {}
        self._install(export_dir, meta, materialize(chain))
        self.sequence_features = [f.feature_name for f in self.config.features() if isinstance(f, SequenceFeatureCfg)]

    def _install(self, export_dir: Path, meta: dict[str, Any], tables: dict[str, dict[str, torch.Tensor]]) -> None:
        for name, table in self.embeddings.tables.items():
            if name not in tables:
                raise ExportError(f"{export_dir / META}: no file for table '{name}'")
            tensors = tables[name]
            report = table.load(tensors, weights_only=True)
            exported = meta["keys"].get(name)
            if report["dropped"] or report["loaded"] != exported:
                raise ExportError(
                    f"table '{name}': {export_dir / 'tables' / f'{name}.safetensors'} holds "
                    f"{tensors['keys'].numel()} keys ({META} says {exported}) but the serving table took "
                    f"{report['loaded']}; serving loads every exported key or none"
                )
            self.key_counts[name] = report["loaded"]
        self.dense = _load(export_dir / "dense.pt2", lambda p: torch.export.load(p).module())
        self.step = meta.get("step")
        self.export_id = meta.get("id")

    def apply_delta(self, delta_dir: Union[str, Path]) -> None:
        """Applies one delta export on top of what this model serves (it must be based on this
        model's export): changed rows replaced, evicted keys removed, the dense program swapped."""
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
        delta = read_export_tables(delta_dir, meta)
        current = {name: export_tensors(t.dump()) for name, t in self.embeddings.tables.items()}
        self._install(delta_dir, meta, {name: merge_tables(current[name], delta[name]) for name in current})

    @torch.no_grad()
    def predict_batch(self, batch: Batch) -> torch.Tensor:
        """Click probabilities ``[B]``."""
        return torch.sigmoid(self.dense(*model_inputs(self.embeddings, batch, self.sequence_features, self.device)))

    def predict_files(self, paths, batch_size: int = 4096) -> np.ndarray:
        builder = BatchBuilder(self.config, with_labels=False)
        dataset = ArrowBatchDataset(resolve_files(paths), builder, batch_size, self.config.data.input_type)
        dataset.check_files()
        out = [self.predict_batch(b).cpu().numpy() for b in make_loader(dataset, 0)]
        probs = np.concatenate(out) if out else np.zeros(0, dtype=np.float32)
        dataset.check_scores(probs, "click probability")
        return probs


def export_tensors(dump: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A table dump's export tensors (a fixed table's keys are its row ids)."""
    out = {k: dump[k] for k in TABLE_FIELDS if k in dump}
    if "keys" not in out:
        out["keys"] = torch.arange(dump["weight"].shape[0])
    return out


def _load(path: Path, loader):
    """``loader(str(path))``; an ExportError naming the file when it cannot be read."""
    try:
        return loader(str(path))
    except Exception as e:
        raise ExportError(f"{path} cannot be loaded ({type(e).__name__}: {e})") from None
