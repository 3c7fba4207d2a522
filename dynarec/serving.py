"""Loading an export directory for scoring, without the training code.

Needs torch, safetensors, pyarrow and dynarec's config, data and embedding layers (the same
lookup code training evaluates with, in eval mode: a missing key of a dynamic table reads its
eval initializer). No optimizer state, checkpoint or trainer is involved.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Union

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

__all__ = ["EXPORT_FORMAT", "META", "ExportError", "ExportedModel"]

# The layout version of an export directory (train/export.py writes it, ExportedModel checks it).
# 2: export.json carries a manifest (size and SHA-256 of every file) and each table's key count;
# dynamic tables carry their slots and bucket layout.
EXPORT_FORMAT = 2
META = "export.json"


class ExportError(ValueError):
    """An export directory cannot be served; the message names the file and why."""


class ExportedModel:
    """A model loaded from an export directory: every file checked against the export's
    manifest, every exported key of every table loaded (or an error), the dense program."""

    def __init__(self, export_dir: Union[str, Path], device: str = "cpu"):
        export_dir = Path(export_dir)
        meta_path = export_dir / META
        if not meta_path.is_file():
            raise ExportError(f"{export_dir} is not an export directory (no {META})")
        meta = read_json(meta_path, ExportError)
        if not isinstance(meta, dict) or not all(k in meta for k in ("format", "config", "files", "keys")):
            raise ExportError(f"{meta_path} is not an export description (format, config, files, keys)")
        if meta["format"] != EXPORT_FORMAT:
            raise ExportError(
                f"{meta_path}: export format {meta['format']!r}, this dynarec reads format {EXPORT_FORMAT}; "
                "export the model again with this version"
            )
        verify_manifest(export_dir, meta["files"], meta_path, ExportError)
        try:
            self.config = Config.model_validate(meta["config"])
        except ValidationError as e:
            raise ExportError(
                f"{meta_path}: its config is invalid ({e.error_count()} error(s): {e.errors()[0]['msg']})"
            ) from None
        self.step = meta.get("step")
        self.device = torch.device(device)
        # Serving tables: native backend, no optimizer state (SGD has none).
        tables = [
            dataclasses.replace(t, backend="native", optimizer=SGD(lr=0.0))
            for t in plan_from_config(self.config).table_configs()
        ]
        self.embeddings = EmbeddingCollection(tables, device=self.device)
        self.embeddings.eval()
        self.key_counts: dict[str, int] = {}
        for name, table in self.embeddings.tables.items():
            path = export_dir / "tables" / f"{name}.safetensors"
            tensors = _load(path, load_file)
            report = table.load(tensors, weights_only=True)
            exported = meta["keys"].get(name)
            if report["dropped"] or report["loaded"] != exported:
                raise ExportError(
                    f"table '{name}': {path} holds {tensors['keys'].numel()} keys ({META} says {exported}) but the "
                    f"serving table took {report['loaded']}; serving loads every exported key or none"
                )
            self.key_counts[name] = report["loaded"]
        self.dense = _load(export_dir / "dense.pt2", lambda p: torch.export.load(p).module())
        self.sequence_features = [f.feature_name for f in self.config.features() if isinstance(f, SequenceFeatureCfg)]

    @torch.no_grad()
    def predict_batch(self, batch: Batch) -> torch.Tensor:
        """Click probabilities ``[B]``."""
        return torch.sigmoid(self.dense(*model_inputs(self.embeddings, batch, self.sequence_features, self.device)))

    def predict_files(self, paths, batch_size: int = 4096) -> np.ndarray:
        builder = BatchBuilder(self.config, with_labels=False)
        dataset = ArrowBatchDataset(resolve_files(paths), builder, batch_size, self.config.data.input_type)
        dataset.check_files()
        out = [self.predict_batch(b).cpu().numpy() for b in make_loader(dataset, 0)]
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)


def _load(path: Path, loader):
    """``loader(str(path))``; an ExportError naming the file when it cannot be read."""
    try:
        return loader(str(path))
    except Exception as e:
        raise ExportError(f"{path} cannot be loaded ({type(e).__name__}: {e})") from None
