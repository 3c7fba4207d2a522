"""Loading an export directory for scoring, without the training code.

Needs torch, safetensors, pyarrow and dynarec's config, data and embedding layers (the same
lookup code training evaluates with, in eval mode: a missing key of a dynamic table reads its
eval initializer). No optimizer state, checkpoint or trainer is involved.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Union

import numpy as np
import torch
from safetensors.torch import load_file

from dynarec.config.schema import Config, SequenceFeatureCfg
from dynarec.data.batch import Batch, BatchBuilder
from dynarec.data.reader import ArrowBatchDataset, make_loader, resolve_files
from dynarec.embedding.collection import EmbeddingCollection
from dynarec.models.inputs import model_inputs
from dynarec.optim.sgd import SGD
from dynarec.planner.plan import plan_from_config

__all__ = ["EXPORT_FORMAT", "ExportedModel"]

# The layout version of an export directory (train/export.py writes it, ExportedModel checks it).
EXPORT_FORMAT = 1


class ExportedModel:
    def __init__(self, export_dir: Union[str, Path], device: str = "cpu"):
        export_dir = Path(export_dir)
        meta_path = export_dir / "export.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{export_dir} is not an export directory (no export.json)")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != EXPORT_FORMAT:
            raise ValueError(
                f"{meta_path}: export format {meta.get('format')!r}, this dynarec reads format {EXPORT_FORMAT}"
            )
        self.config = Config.model_validate(meta["config"])
        self.device = torch.device(device)
        # Serving tables: native backend, no optimizer state (SGD has none).
        tables = [
            dataclasses.replace(t, backend="native", optimizer=SGD(lr=0.0))
            for t in plan_from_config(self.config).table_configs()
        ]
        self.embeddings = EmbeddingCollection(tables, device=self.device)
        self.embeddings.eval()
        for name, table in self.embeddings.tables.items():
            tensors = load_file(str(export_dir / "tables" / f"{name}.safetensors"))
            if "scores" in tensors:  # dynamic
                table.load(
                    {"keys": tensors["keys"], "scores": tensors["scores"], "weight": tensors["weight"]},
                    weights_only=True,
                )
            else:
                table.load({"weight": tensors["weight"]}, weights_only=True)
        self.dense = torch.export.load(str(export_dir / "dense.pt2")).module()
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
