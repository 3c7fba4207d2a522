"""Export: a directory a serving process loads without the training code (its layout:
:mod:`dynarec.export_format`).

A **delta** (``since=`` a previous export, full or delta) holds the dense program and, per table,
only the rows that changed since that export — weights (and, for a dynamic table, slots or
scores: a row touched by training) — plus ``tombstones``, the keys gone since (evicted); its
export.json names the export it is based on. ``serving.ExportedModel`` applies the chain in
order; the result equals a full export at the delta's step, row for row. A table that grew
(another bucket layout) since its base carries every row in the delta.

The directory is written under a temporary sibling name and renamed into place. An existing
``export_dir`` is replaced only when it is itself an export (it holds ``export.json``) or is
empty: dynarec never deletes a directory it did not write.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

from dynarec.data.batch import Batch
from dynarec.data.tdm_sampler import tree_files
from dynarec.embedding.dynamic import DynamicTable
from dynarec.export_format import (
    EXPORT_FORMAT,
    META,
    TREE_FILES,
    asset_files,
    export_chain,
    export_tensors,
    materialize,
)
from dynarec.files import check_replaceable, file_manifest, fsync_tree, replace_dir, write_bytes, write_error
from dynarec.models.inputs import model_inputs
from dynarec.train.task import RankingTask, check_servable

__all__ = ["EXPORT_FORMAT", "diff_tables", "export_model"]


def export_model(
    task: RankingTask,
    example: Batch,
    export_dir: str | Path,
    step: int = 0,
    since: Optional[str | Path] = None,
) -> Path:
    """Exports ``task`` (trained ``step`` steps); ``example`` (>= 2 rows) traces the dense program.
    ``since``: a previous export (full or delta) of this model; write a delta on top of it.

    Raises FileExistsError, before writing anything, when ``export_dir`` is a non-empty
    directory that is not an export (a model directory, a user's own directory) or holds files
    its export's manifest does not list, or a file."""
    if task.config.candidate_feature() is not None and task.config.model.hstu_match is None:
        raise ValueError(
            f"export: model.{task.config.model.name} scores each row's candidates; exporting it (a list of "
            "scores a row) is not supported yet — score it with `dynarec evaluate` or `dynarec predict --model-dir`"
        )
    check_servable(task)
    if example.num_rows < 2:
        raise ValueError("export needs an example batch of at least 2 rows")
    if example.sampled_rows:
        raise ValueError(
            "export traces the model on the data's rows alone: give an example batch without sampled items"
        )
    for t in task.embeddings.tables.values():
        if isinstance(t, DynamicTable) and t.eval_initializer.kind != "constant":
            raise ValueError(f"table '{t.name}': export supports constant eval initializers only")
    export_dir = Path(export_dir)
    _check_target(export_dir)
    base = _delta_base(Path(since), export_dir, task) if since is not None else None
    export_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(export_dir.parent)
    tmp = export_dir.with_name(f".{export_dir.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "tables").mkdir(parents=True)
    try:
        _write_export(task, example, tmp, export_dir, step, since, base)
        fsync_tree(tmp)
        replace_dir(tmp, export_dir, META, "export")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk, a Ctrl-C: nothing half-written stays
        raise
    return export_dir


# An export is written as ``.<name>.tmp-<host>-<pid>`` beside its target, then renamed; the export
# it replaces is moved aside as ``.<name>.old-<host>-<pid>`` (files.replace_dir) and deleted.
_TMP_NAME = re.compile(r"^\..+\.(?:tmp|old)-(?P<host>.+)-(?P<pid>\d+)$")


def remove_stale_temporaries(parent: Path) -> list[Path]:
    """Removes the temporary directories of exports into ``parent`` whose writer is gone (killed
    or failed mid-export): only names dynarec gives them, of this host, holding an export's
    files, whose process no longer runs. Returns what was removed."""
    removed = []
    host = socket.gethostname()
    for d in parent.iterdir() if parent.is_dir() else ():
        m = _TMP_NAME.match(d.name)
        if m is None or m["host"] != host or not d.is_dir() or _alive(int(m["pid"])):
            continue
        if (d / "tables").is_dir() or (d / META).is_file():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    except Exception as e:  # safetensors reports a failed write (a full disk) as its own error
        raise write_error(path, str(e)) from None
    # safetensors creates its files readable by their owner alone: a serving host's other account
    # could read the export's manifest and dense model, not its tables. The process's umask rules.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _write_export(
    task: RankingTask,
    example: Batch,
    tmp: Path,
    export_dir: Path,
    step: int,
    since: Optional[str | Path],
    base: Optional[tuple],
) -> None:
    """Writes the files of the export bound for ``export_dir`` into the directory ``tmp``."""
    task.eval()
    try:  # (the task trains again whatever happens: a lookup that fails, a cache too small for the example)
        with torch.no_grad():
            emb, lengths, dense = model_inputs(
                task.embeddings, example, task.sequence_features, task.device, task.element_pooling
            )
        batch_dim = torch.export.Dim("batch", min=1)
        seq_dim = torch.export.Dim("seq", min=2)
        shapes = (
            {k: ({0: batch_dim, 1: seq_dim} if k in task.sequence_features else {0: batch_dim}) for k in emb},
            {k: {0: batch_dim} for k in lengths},
            {k: ({0: batch_dim, 1: seq_dim} if k in task.sequence_features else {0: batch_dim}) for k in dense},
        )
        # What a row is served (a model may serve another function of its weights: HSTUMatch its towers).
        serving = getattr(task.dense, "serving", None)
        served: torch.nn.Module = serving() if callable(serving) else task.dense
        program = torch.export.export(served.eval(), (emb, lengths, dense), dynamic_shapes=shapes)
    finally:
        task.train()
    # Serialized in memory first: torch's file writer aborts the process on a failed write (a
    # full disk), where Python's raises an OSError that names the file.
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    write_bytes(tmp / "dense.pt2", buffer.getvalue())

    key_counts, rows, tombstones = {}, {}, {}
    for name, table in task.embeddings.tables.items():
        tensors = export_tensors(table.dump())
        key_counts[name] = int(tensors["keys"].numel())
        if base is not None:
            tensors = diff_tables(base[1][name], tensors, f"table '{name}'")
            rows[name], tombstones[name] = int(tensors["keys"].numel()), int(tensors["tombstones"].numel())
        _save_tensors(tensors, tmp / "tables" / f"{name}.safetensors")
    files = ["dense.pt2", *(f"tables/{name}.safetensors" for name in task.embeddings.tables)]
    tdm = task.config.data.tdm_sampler
    if tdm is not None:  # the tree the model's node ids mean, copied (tdm retrieve reads the copy)
        for role, path in tree_files(tdm).items():
            target = tmp / TREE_FILES[role]
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        files += list(TREE_FILES.values())
    config = task.config.model_dump(mode="json")
    # The files the features read (vocabularies, tokenizers), copied: serving reads the copies,
    # whatever is written later where the config points (a vocabulary regenerated in place).
    assets: list[dict[str, Any]] = []
    for i, (where, path) in enumerate(asset_files(config)):
        name = f"assets/{i:02d}-{Path(path).name}"
        (tmp / "assets").mkdir(exist_ok=True)
        shutil.copyfile(path, tmp / name)
        assets.append({"where": where, "file": name})
        files.append(name)
    meta: dict[str, Any] = {
        "format": EXPORT_FORMAT,
        "id": uuid.uuid4().hex,
        "kind": "full" if base is None else "delta",
        "step": step,
        "keys": key_counts,
    }
    if base is not None:
        assert since is not None
        base_meta = base[0]
        # Relative to the delta: a chain moved or copied as a whole still resolves (export_format.find_base).
        relative = os.path.relpath(Path(since).resolve(), export_dir.resolve())
        meta["base"] = {"id": base_meta["id"], "step": base_meta["step"], "path": relative}
        meta["rows"], meta["tombstones"] = rows, tombstones
    if tdm is not None:
        meta["tree"] = dict(TREE_FILES)
    if assets:
        meta["assets"] = assets
    meta["files"] = file_manifest(tmp, files)
    meta["config"] = config
    (tmp / META).write_text(json.dumps(meta, indent=1))


def _delta_base(since: Path, export_dir: Path, task: RankingTask):
    """``(meta, tables)`` of the export a delta is computed from, checked to be this model's."""
    if export_dir.resolve() == since.resolve():
        raise ValueError(f"--since {since} is the export directory itself; write the delta to a new directory")
    chain = export_chain(since)
    target = export_dir.resolve()
    for directory, _ in chain:
        if directory.resolve() == target:
            raise ValueError(
                f"--export-dir {export_dir} holds an export that the delta's base chain ({since}) depends on; "
                "replacing it would break that chain: write the delta to a new directory"
            )
    meta = chain[-1][1]
    tables = materialize(chain)
    ours = sorted(task.embeddings.tables)
    if sorted(tables) != ours:
        raise ValueError(f"{since}: its tables {sorted(tables)} are not this model's {ours}; write a full export")
    return meta, tables


def diff_tables(base: dict[str, torch.Tensor], current: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """The delta of one table from ``base`` to ``current`` (export tensors): the rows whose
    weight — or, in a dynamic table, slot or score — changed, new keys, and the ``tombstones``
    of keys gone. Weights are compared bit for bit."""
    kinds = ["dynamic" if "slots" in t else "fixed" for t in (base, current)]
    if kinds[0] != kinds[1] or base["weight"].shape[1:] != current["weight"].shape[1:]:
        raise ValueError(
            f"{where}: a {kinds[0]} table of dim {tuple(base['weight'].shape[1:])} in the base export, a {kinds[1]} "
            f"table of dim {tuple(current['weight'].shape[1:])} now; write a full export"
        )
    if base["weight"].dtype != current["weight"].dtype:
        # A dynamic table's base written before dumps kept the storage dtype holds its half-precision
        # rows widened to float32: exactly the rows, compared as such. Any other pair is refused.
        narrowed = base["weight"].to(current["weight"].dtype)
        legacy = "slots" in current and base["weight"].dtype == torch.float32 and current["weight"].element_size() == 2
        if not legacy or not torch.equal(_bits(narrowed.to(base["weight"].dtype)), _bits(base["weight"])):
            raise ValueError(
                f"{where}: rows of {base['weight'].dtype} in the base export, {current['weight'].dtype} now; "
                "write a full export"
            )
        base = {**base, "weight": narrowed}
    if "slots" not in current:
        if base["weight"].shape != current["weight"].shape:
            raise ValueError(
                f"{where}: {tuple(base['weight'].shape)} rows x dim in the base export, "
                f"{tuple(current['weight'].shape)} now; write a full export"
            )
        changed = (_bits(base["weight"]) != _bits(current["weight"])).any(1)
        keys = changed.nonzero().flatten()
        return {"keys": keys, "weight": current["weight"][keys], "tombstones": torch.empty(0, dtype=torch.int64)}
    kb, kc = base["keys"], current["keys"]
    if kb.numel():
        pos = torch.searchsorted(kb, kc).clamp(max=kb.numel() - 1)
        same = kb[pos] == kc
        changed = (
            ~same
            | (_bits(base["weight"][pos]) != _bits(current["weight"])).any(1)
            | (base["slots"][pos] != current["slots"])
            | (base["scores"][pos] != current["scores"])
        )
    else:
        changed = torch.ones_like(kc, dtype=torch.bool)
    out = {f: current[f][changed] for f in ("keys", "weight", "scores", "slots")}
    out["layout"] = current["layout"]
    out["tombstones"] = kb[~torch.isin(kb, kc)]
    return out


_SAME_WIDTH_INT = {4: torch.int32, 2: torch.int16, 8: torch.int64}


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values as integers of the same width (fp16/bf16 rows of any dim: int16), compared
    bit for bit (a NaN equals itself, -0.0 differs from 0.0)."""
    return x.contiguous().view(_SAME_WIDTH_INT[x.element_size()])


def _check_target(export_dir: Path) -> None:
    """Refuses, before any work, a target that replace_dir would refuse (an export whose manifest
    lists no files is checked by replace_dir only)."""
    check_replaceable(export_dir, META, "export")
