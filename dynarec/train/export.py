"""Export: a directory a serving process loads without the training code.

::

    export_dir/
      dense.pt2                the dense model, a torch.export program
                               (embeddings, sequence lengths, dense features) -> logits [B]
      tables/<table>.safetensors   keys (int64) and weights per table (a fixed table's keys are
                               0..N-1); no optimizer state
      export.json              the config (features, model) and the export format version

The directory is written under a temporary name and renamed into place.
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
from dynarec.models.inputs import model_inputs
from dynarec.serving import EXPORT_FORMAT
from dynarec.train.task import RankingTask

__all__ = ["EXPORT_FORMAT", "export_model"]


def export_model(task: RankingTask, example: Batch, export_dir: str | Path) -> Path:
    """Exports ``task``; ``example`` (>= 2 rows) traces the dense program."""
    if example.num_rows < 2:
        raise ValueError("export needs an example batch of at least 2 rows")
    for t in task.embeddings.tables.values():
        if isinstance(t, DynamicTable) and t.eval_initializer.kind != "constant":
            raise ValueError(f"table '{t.name}': export supports constant eval initializers only")
    export_dir = Path(export_dir)
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

    for name, table in task.embeddings.tables.items():
        dump = table.dump()
        keys = dump["keys"] if "keys" in dump else torch.arange(dump["weight"].shape[0])
        tensors = {"keys": keys.contiguous(), "weight": dump["weight"].contiguous()}
        if "scores" in dump:
            tensors["scores"] = dump["scores"].contiguous()
        save_file(tensors, str(tmp / "tables" / f"{name}.safetensors"))
    meta = {"format": EXPORT_FORMAT, "config": task.config.model_dump(mode="json")}
    (tmp / "export.json").write_text(json.dumps(meta, indent=1))
    if export_dir.exists():
        shutil.rmtree(export_dir)
    os.replace(tmp, export_dir)
    return export_dir
