"""Export: a directory a serving process loads without the training code.

::

    export_dir/
      dense.pt2                    the dense model, a torch.export program
                                   (embeddings, sequence lengths, dense features) -> logits [B]
      tables/<table>.safetensors   keys (int64) and weights per table (a fixed table's keys are
                                   0..N-1); a dynamic table adds scores, slots and its bucket
                                   layout, so serving puts every key back in its own slot
      export.json                  format version, the config, the training step, each table's
                                   key count, and every file's size and SHA-256 (checked on load)

The directory is written under a temporary sibling name and renamed into place. An existing
``export_dir`` is replaced only when it is itself an export (it holds ``export.json``) or is
empty: dynarec never deletes a directory it did not write.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from dynarec.data.batch import Batch
from dynarec.embedding.dynamic import DynamicTable
from dynarec.files import file_manifest, fsync_tree, replace_dir
from dynarec.models.inputs import model_inputs
from dynarec.serving import EXPORT_FORMAT, META
from dynarec.train.task import RankingTask

__all__ = ["EXPORT_FORMAT", "export_model"]


def export_model(task: RankingTask, example: Batch, export_dir: str | Path, step: int = 0) -> Path:
    """Exports ``task`` (trained ``step`` steps); ``example`` (>= 2 rows) traces the dense program.

    Raises FileExistsError, before writing anything, when ``export_dir`` is a non-empty
    directory that is not an export (a model directory, a user's own directory) or a file."""
    if example.num_rows < 2:
        raise ValueError("export needs an example batch of at least 2 rows")
    for t in task.embeddings.tables.values():
        if isinstance(t, DynamicTable) and t.eval_initializer.kind != "constant":
            raise ValueError(f"table '{t.name}': export supports constant eval initializers only")
    export_dir = Path(export_dir)
    _check_target(export_dir)
    tmp = export_dir.with_name(f".{export_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "tables").mkdir(parents=True)

    task.eval()
    with torch.no_grad():
        emb, lengths, dense = model_inputs(task.embeddings, example, task.sequence_features, task.device)
    batch_dim = torch.export.Dim("batch", min=1)
    seq_dim = torch.export.Dim("seq", min=2)
    shapes = (
        {k: ({0: batch_dim, 1: seq_dim} if k in task.sequence_features else {0: batch_dim}) for k in emb},
        {k: {0: batch_dim} for k in lengths},
        {k: {0: batch_dim} for k in dense},
    )
    program = torch.export.export(task.dense.eval(), (emb, lengths, dense), dynamic_shapes=shapes)
    torch.export.save(program, str(tmp / "dense.pt2"))
    task.train()

    key_counts = {}
    for name, table in task.embeddings.tables.items():
        dump = table.dump()
        keys = dump["keys"] if "keys" in dump else torch.arange(dump["weight"].shape[0])
        tensors = {"keys": keys, "weight": dump["weight"]}
        for field in ("scores", "slots", "layout"):
            if field in dump:
                tensors[field] = dump[field]
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "tables" / f"{name}.safetensors"))
        key_counts[name] = int(keys.numel())
    files = ["dense.pt2", *(f"tables/{name}.safetensors" for name in task.embeddings.tables)]
    meta = {
        "format": EXPORT_FORMAT,
        "step": step,
        "keys": key_counts,
        "files": file_manifest(tmp, files),
        "config": task.config.model_dump(mode="json"),
    }
    (tmp / META).write_text(json.dumps(meta, indent=1))
    fsync_tree(tmp)
    replace_dir(tmp, export_dir, is_ours=lambda d: (d / META).is_file(), what="export")
    return export_dir


def _check_target(export_dir: Path) -> None:
    """Refuses, before any work, a target that replace_dir would refuse."""
    if export_dir.exists() and not export_dir.is_dir():
        raise FileExistsError(f"{export_dir} exists and is not a directory; choose another export path")
    if export_dir.is_dir() and any(export_dir.iterdir()) and not (export_dir / META).is_file():
        raise FileExistsError(
            f"{export_dir} is a non-empty directory that is not a dynarec export (no {META}); dynarec replaces only "
            "its own exports: choose an empty or new directory"
        )
