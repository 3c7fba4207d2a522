"""What a checkpoint holds besides the tables, and whether a run may continue from it.

A training run's state: its step and data position, the global batch it was cut into, the dense
model and optimizer, the config fingerprint, the log's history, the plan that wrote it and the
files a ``--follow`` run consumed, and the random stream of its steps (:class:`StepRng`).
:func:`check_resumable` refuses, before anything is loaded, a checkpoint another config, batch
size, set of tables or dense optimizer wrote.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch

from dynarec.config.load import config_differences, without_placement
from dynarec.train.checkpoint import CheckpointError

__all__ = ["StepRng", "check_resumable", "dense_optimizer_matches"]


def check_resumable(
    state: dict[str, Any],
    where: Path,
    fingerprint: dict[str, str],
    sections: dict[str, Any],
    tree: Optional[dict[str, str]],
    global_batch_size: int,
    tables: dict[str, str],
    saved_tables: dict[str, dict[str, Any]],
    dense_optimizer: torch.optim.Optimizer,
    training: bool,
    world_size: int = 1,
) -> None:
    """CheckpointError naming what differs between the checkpoint at ``where`` and this run:
    the config's features or model (``fingerprint``; by config path where the checkpoint keeps
    its config's ``sections``), a TDM model's tree (``tree``: its files and their SHA-256; node
    ids mean that tree's nodes), the global batch (when ``training``: the data position counts
    its rows; ``world_size`` ranks share it), the tables (``tables``: each one's sparse optimizer;
    ``saved_tables``: the checkpoint's plan of each), and, when ``training``, the sparse and dense
    optimizers (a run that only reads the weights takes them from any optimizer)."""
    theirs = state.get("fingerprint", {})
    differ = [k for k in fingerprint if theirs.get(k) != fingerprint[k]]
    saved = state.get("config_sections")  # (not kept before 2026-12-05)
    if differ and isinstance(saved, dict):  # where only a table's placement changed, the rows are the same
        # (and a placement differing beside another change is not named: it is not in the way)
        was = {k: without_placement(k, saved.get(k)) for k in differ}
        now = {k: without_placement(k, sections[k]) for k in differ}
        differ = [k for k in differ if was[k] != now[k]]
    if differ:
        if isinstance(saved, dict):
            found = config_differences({k: was[k] for k in differ}, {k: now[k] for k in differ})
            what = "; ".join(found) or f"its {' and '.join(differ)}"
        else:
            what = f"its {' and '.join(differ)} section{'s differ' if len(differ) > 1 else ' differs'}"
        raise CheckpointError(
            f"{where} was written with a different config ({what}); use the config it was trained with, or "
            "another model_dir"
        )
    saved_tree = state.get("tdm_tree")  # (not kept before 2026-12-05)
    if tree is not None and isinstance(saved_tree, dict) and saved_tree.get("sha256") != tree["sha256"]:
        raise CheckpointError(
            f"{where} was trained on the TDM tree {saved_tree.get('node_table')} + {saved_tree.get('edge_table')} "
            f"(SHA-256 {str(saved_tree.get('sha256'))[:16]}...), and {tree['node_table']} + {tree['edge_table']} hold "
            f"another tree now ({tree['sha256'][:16]}...): its node ids mean its own tree's nodes; give it that tree "
            "again, or train a new model on this one"
        )
    if training and state.get("global_batch_size", global_batch_size) != global_batch_size:
        raise CheckpointError(f"{where} {_batch_mismatch(state, global_batch_size, world_size)}")
    if set(saved_tables) != set(tables):
        raise CheckpointError(f"{where}: holds tables {sorted(saved_tables)}, the config has {sorted(tables)}")
    if not training:  # (evaluate, export and predict read the weights: any optimizer's will do)
        return
    for name, optimizer in tables.items():
        theirs = saved_tables[name].get("optimizer", optimizer)  # (not recorded before 2026-12-05)
        if theirs != optimizer:
            raise CheckpointError(
                f"{where}: table '{name}' was trained with {theirs}, this config gives it {optimizer}; its optimizer "
                f"states cannot carry over: resume with {theirs}, or train into another model_dir"
            )
    if not dense_optimizer_matches(state, dense_optimizer):
        theirs_name = state.get("dense_optimizer_class") or "its settings differ"
        raise CheckpointError(
            f"{where} was trained with another dense optimizer ({theirs_name}) than this config's "
            f"train.dense_optimizer ({type(dense_optimizer).__name__}); its state cannot carry over: resume with "
            "the dense optimizer it was trained with, or train into another model_dir"
        )


def _batch_mismatch(state: dict[str, Any], global_batch_size: int, world_size: int) -> str:
    """Why a checkpoint's global batch is not this run's, and the ``data.batch_size`` (a rank's)
    that would resume it at this world size."""
    theirs = int(state["global_batch_size"])
    saved_world = int(state.get("plan", {}).get("world_size", 1))

    def ranks(n: int) -> str:
        return f"{n} rank{'s' if n > 1 else ''}"

    def split(rows: int, n: int) -> str:
        return f"{ranks(n)} x data.batch_size {rows // n}"

    if theirs % world_size == 0:
        advice = f"resume with data.batch_size {theirs // world_size} at {ranks(world_size)}"
    else:
        advice = f"{world_size} ranks cannot share it: resume at a world size that divides {theirs}"
    return (
        f"was trained with a global batch of {theirs} rows ({split(theirs, saved_world)}), this run's is "
        f"{global_batch_size} ({split(global_batch_size, world_size)}); {advice}"
    )


def dense_optimizer_matches(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> bool:
    """Whether the checkpoint's dense optimizer state is ``optimizer``'s kind (another kind's state
    cannot carry over, and would fail at the first step)."""
    saved = state.get("dense_optimizer", {}).get("param_groups") or [{}]
    theirs = state.get("dense_optimizer_class")
    if theirs is not None and theirs != type(optimizer).__name__:
        return False
    return set(saved[0]) - {"params"} == set(optimizer.param_groups[0]) - {"params"}


class StepRng:
    """The random stream the training steps' forward draws from (dropout masks), seeded by
    ``train.seed`` and kept apart from the process's global generator: a run draws the same masks
    whatever else the process does, and a checkpoint carries the stream so a resumed run draws
    what an uninterrupted one would. Every rank runs the same stream.

    ``draws``: whether the forward draws at all; a model without dropout skips switching
    generators every step (a host cost on the step's path)."""

    def __init__(self, seed: int, device: torch.device, draws: bool = True):
        self.draws = draws
        self._devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=self._devices):
            torch.manual_seed(seed + 1)  # not the stream the initial weights came from
            self._cpu, self._cuda = self._capture()

    def _capture(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        cuda = torch.cuda.get_rng_state(self._devices[0]) if self._devices else None
        return torch.get_rng_state(), cuda

    @contextmanager
    def active(self) -> Iterator[None]:
        """Runs the block on this stream (the global generators restored after it)."""
        if not self.draws:
            yield
            return
        with torch.random.fork_rng(devices=self._devices):
            torch.set_rng_state(self._cpu)
            if self._devices and self._cuda is not None:
                torch.cuda.set_rng_state(self._cuda, self._devices[0])
            yield
            self._cpu, self._cuda = self._capture()

    def state(self) -> dict[str, Optional[torch.Tensor]]:
        return {"cpu": self._cpu, "cuda": self._cuda}

    def load_state(self, state: dict[str, Optional[torch.Tensor]]) -> None:
        cpu = state.get("cpu")
        if cpu is not None:
            self._cpu = cpu
        if state.get("cuda") is not None and self._devices:
            self._cuda = state["cuda"]
