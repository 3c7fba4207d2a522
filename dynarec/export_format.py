"""The export directory's format, written by ``dynarec export`` (:mod:`dynarec.train.export`)
and read by serving (:mod:`dynarec.serving`)::

    export_dir/
      dense.pt2                    the dense model, a torch.export program
                                   (embeddings, sequence lengths, dense features) -> logits [B]
      tables/<table>.safetensors   keys (int64) and weights per table (a fixed table's keys are
                                   0..N-1); a dynamic table adds scores, slots and its bucket
                                   layout, so serving puts every key back in its own slot; a
                                   delta adds tombstones (keys gone since its base)
      tree/<table>.txt             a TDM model's tree (node_table, edge_table), copied: its node ids
                                   mean that tree's nodes, whatever is written later where the
                                   config's data.tdm_sampler points
      export.json                  format version, id, kind (full | delta), the config, the training
                                   step, each table's key count, and every file's size and SHA-256;
                                   a delta names its base (id, step, path relative to the delta);
                                   a TDM model's tree files

A chain is a full export and the deltas on it: :func:`export_chain` finds each delta's base (its
recorded relative path, else the sibling holding its id), :func:`materialize` applies the chain.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Union

import torch
from safetensors.torch import load_file

from dynarec.files import read_json, verify_manifest

__all__ = [
    "EXPORT_FORMAT",
    "META",
    "TABLE_FIELDS",
    "TREE_FILES",
    "ExportError",
    "asset_files",
    "export_chain",
    "export_tensors",
    "exported_config",
    "find_base",
    "load_export_file",
    "materialize",
    "merge_tables",
    "read_export_meta",
    "read_export_tables",
]

# The version of this layout; an export of another version is refused by name.
EXPORT_FORMAT = 3
META = "export.json"
# The tensors of a table in an export (a fixed table's keys are 0..N-1); a delta adds tombstones.
TABLE_FIELDS = ("keys", "weight", "scores", "slots", "layout")


# A TDM model's tree files in its export, by role.
TREE_FILES = {"node_table": "tree/node_table.txt", "edge_table": "tree/edge_table.txt"}


# The settings of a feature (at any depth of its config) that name a file its values are read with.
ASSET_SETTINGS = ("vocab_file", "stop_char_file")


def asset_files(config: dict[str, Any]) -> list[tuple[list[Union[str, int]], str]]:
    """``(where, path)`` of every file the features of ``config`` (a config's JSON dump) read:
    ``where`` the keys and indices to the setting (:data:`ASSET_SETTINGS`), ``path`` its value."""
    found: list[tuple[list[Union[str, int]], str]] = []

    def walk(node: Any, where: list[Union[str, int]]) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ASSET_SETTINGS and isinstance(value, str):
                    found.append(([*where, key], value))
                else:
                    walk(value, [*where, key])
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, [*where, i])

    walk(config.get("feature_configs"), ["feature_configs"])
    return found


def exported_config(export_dir: Path, meta: dict[str, Any]) -> Any:
    """The config an export was written with (``meta["config"]``), the files its features read
    (vocabularies, tokenizers, stop characters) and a TDM model's tree those of the export's own
    copies (where it holds them: exports before 2026-12-06 hold no features' files, before
    2026-12-05 no tree)."""
    config = meta.get("config")
    assets = meta.get("assets")
    if isinstance(config, dict) and isinstance(assets, list):
        config = copy.deepcopy(config)
        for entry in assets:
            *parents, last = entry["where"]
            node = config
            for key in parents:
                node = node[key]
            node[last] = str(export_dir / str(entry["file"]))
    tree = meta.get("tree")
    if not isinstance(config, dict) or not isinstance(tree, dict):
        return config
    sampler = dict(config.get("data", {}).get("tdm_sampler") or {})
    sampler["item_input_path"] = str(export_dir / str(tree.get("node_table")))
    sampler["edge_input_path"] = str(export_dir / str(tree.get("edge_table")))
    return {**config, "data": {**config["data"], "tdm_sampler": sampler}}


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
    if meta["format"] != EXPORT_FORMAT:
        raise ExportError(
            f"{meta_path}: export format {meta['format']!r}, this dynarec reads format {EXPORT_FORMAT}; "
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
    shown = os.path.normpath(recorded)
    where = (
        f"{shown} holds export {_export_id(recorded)}: another export was written there since"
        if (recorded / META).is_file()
        else f"nothing at {shown}"
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
    return {name: load_export_file(export_dir / "tables" / f"{name}.safetensors", load_file) for name in names}


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


def export_tensors(dump: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A table dump's export tensors (a fixed table's keys are its row ids)."""
    out = {k: dump[k] for k in TABLE_FIELDS if k in dump}
    if "keys" not in out:
        out["keys"] = torch.arange(dump["weight"].shape[0])
    return out


def load_export_file(path: Path, loader):
    """``loader(str(path))``; an ExportError naming the file when it cannot be read."""
    try:
        return loader(str(path))
    except Exception as e:
        raise ExportError(f"{path} cannot be loaded ({type(e).__name__}: {e})") from None
