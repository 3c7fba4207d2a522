import os
import warnings
from types import SimpleNamespace

import pytest
import torch

from dynarec.config import config_from_dict
from dynarec.data.batch import Batch, DataError
from dynarec.data.reader import DataPosition
from dynarec.distributed.context import single_process
from dynarec.train.input import ReadAhead, TrainInput
from tests.pipeline_fixtures import config_dict, make_data


def epochs_of(tmp_path, workers: int, epochs: int = 3):
    make_data(tmp_path)
    cfg = config_dict(data__num_workers=workers, train__num_epochs=epochs)
    for key in ("train_input_path", "eval_input_path"):
        cfg["data"][key] = str(tmp_path / cfg["data"][key])
    return TrainInput(config_from_dict(cfg), single_process("cpu"), "cpu")


def test_whole_epochs_keep_their_workers_and_their_batches(tmp_path):
    """From one epoch to the next the DataLoader's workers stay (starting them again costs
    seconds on a GPU host); the batches are those of a run without workers."""
    source = epochs_of(tmp_path, 2)
    pids_by_epoch: dict[int, set[int]] = {}
    labels = []
    for batch, position, _ in source.batches(DataPosition()):
        labels.append(batch.labels)
        loader = source._epoch_loader
        assert loader is not None
        workers = loader.loader._iterator._workers  # torch's worker processes of this pass
        pids_by_epoch.setdefault(position.epoch - (position.row == 0), set()).update(w.pid for w in workers)
    assert len(pids_by_epoch) == 3 and len({frozenset(p) for p in pids_by_epoch.values()}) == 1
    assert os.getpid() not in pids_by_epoch[0]
    plain = [b.labels for b, _, _ in epochs_of(tmp_path, 0).batches(DataPosition())]
    assert len(labels) == len(plain) and all(torch.equal(a, b) for a, b in zip(labels, plain))


def test_an_epoch_resumed_mid_way_reads_from_its_row_then_whole_epochs_share_workers(tmp_path):
    source = epochs_of(tmp_path, 2, epochs=2)
    items = list(source.batches(DataPosition(0, 500)))
    plain = list(epochs_of(tmp_path, 0, epochs=2).batches(DataPosition(0, 500)))
    assert [p for _, p, _ in items] == [p for _, p, _ in plain]
    assert all(torch.equal(a.labels, b.labels) for (a, _, _), (b, _, _) in zip(items, plain))
    assert items[0][1] == DataPosition(0, 600) and source._epoch_loader is not None


def test_a_cuda_run_with_workers_starts_their_fork_server_at_once(tmp_path, monkeypatch):
    """On a CUDA device workers come from a fork server (a fork after CUDA's initialization cannot
    use it); the input starts that server when it is made, so the server's imports overlap the
    model's set-up instead of delaying the first batch. Not for no workers, nor on the CPU."""
    import dynarec.train.input as train_input

    make_data(tmp_path)
    started: list[int] = []
    monkeypatch.setattr(train_input, "start_worker_server", lambda: started.append(1))
    for device_type, workers, expected in (("cuda", 2, 1), ("cuda", 0, 0), ("cpu", 2, 0)):
        started.clear()
        TrainInput(config_from_dict(config_dict(data__num_workers=workers)), single_process("cpu"), device_type)
        assert len(started) == expected, (device_type, workers)


def test_the_started_fork_server_serves_the_loaders_workers(tmp_path, monkeypatch):
    """Started ahead of the first loader, the server is the one its workers come from: the batches
    are those of a run without workers."""
    from dynarec.data import reader

    reader.start_worker_server()
    monkeypatch.setattr(reader, "worker_context", lambda n: "forkserver" if n else None)
    served = [b.labels for b, _, _ in epochs_of(tmp_path, 2, epochs=1).batches(DataPosition())]
    plain = [b.labels for b, _, _ in epochs_of(tmp_path, 0, epochs=1).batches(DataPosition())]
    assert len(served) == len(plain) and all(torch.equal(a, b) for a, b in zip(served, plain))


def test_workers_past_the_cpus_are_as_many_as_the_cpus_with_one_line_saying_so(tmp_path, capsys):
    """A config's workers (a TorchEasyRec config's 8) on a host with fewer CPUs: as many as the
    process may use, said in one line, where torch's DataLoader warned in two paragraphs."""
    cpus = len(os.sched_getaffinity(0))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="This DataLoader will create")
        source = epochs_of(tmp_path, cpus + 3, epochs=1)
        assert source.num_workers == cpus
        assert sum(1 for _ in source.batches(DataPosition())) > 0
    err = capsys.readouterr().err
    assert err.count(f"data.num_workers is {cpus + 3}, but this process may use {cpus} CPU(s)") == 1


def test_the_read_ahead_runs_each_batchs_input_stage_for_the_units_its_step_asks():
    """``ReadAhead``: up to ``prefetch_depth`` batches read, each one's input stage run ahead for
    the units ``ahead_units`` names (all where it says None, none where it names none: a step
    replayed from CUDA graphs with every table inside them), and an error reading one raised
    where the loop asks for that batch, after the batches before it."""
    calls = []
    embeddings = SimpleNamespace(prefetch_depth=2, prefetch=lambda kjt, ready, **units: calls.append((kjt, units)))
    batches = [Batch.__new__(Batch) for _ in range(3)]
    for i, batch in enumerate(batches):
        object.__setattr__(batch, "sparse", f"kjt{i}")
        object.__setattr__(batch, "ready", None)
    units = {0: None, 1: [], 2: ["dyn"]}

    def items():
        for i, batch in enumerate(batches):
            yield batch, DataPosition(), i
        raise DataError("row 7: bad")

    ahead = ReadAhead(items(), embeddings, lambda batch, rows: units[rows])
    ahead.read()
    assert calls == [("kjt0", {"units": None})]  # (the second needs none ahead)
    assert ahead.next()[2] == 0 and ahead.next()[2] == 1
    ahead.read()
    assert calls[1:] == [("kjt2", {"units": ["dyn"]})]
    assert ahead.next()[2] == 2
    with pytest.raises(DataError, match="row 7"):
        ahead.next()
