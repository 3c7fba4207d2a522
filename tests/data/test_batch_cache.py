import errno
import os
import pickle
import subprocess
import sys
import time

import pytest
import torch

from dynarec.config import ConfigError
from dynarec.config.schema import DataCfg
from dynarec.data import batch_cache as cache_module
from dynarec.data.batch import _unpacked_batch
from dynarec.data.batch_cache import DiskBatchCache, MemoryBatchCache, batch_cache, check_cache_dir
from tests.data.test_transport import assert_same, every_field_batch
from tests.matrix import needs_cuda


def test_the_disk_cache_gives_its_batches_back_in_order_each_time_and_removes_its_files(tmp_path):
    cache = DiskBatchCache(str(tmp_path))
    batches = [every_field_batch() for _ in range(3)]
    for b in batches:
        cache.add(b)
    assert len(cache) == 3 and not cache.failed
    assert cache.directory.parent == tmp_path and len(list(cache.directory.glob("batch-*.bin"))) == 3
    for _ in range(2):  # every epoch reads the same files again
        back = list(cache)
        assert len(back) == 3
        for a, b in zip(batches, back):
            assert_same(a, b)
    cache.close()
    assert list(tmp_path.iterdir()) == []


def test_a_disk_cache_dropped_without_close_removes_its_directory(tmp_path):
    cache = DiskBatchCache(str(tmp_path))
    cache.add(every_field_batch())
    del cache
    assert list(tmp_path.iterdir()) == []


def test_a_killed_runs_cache_is_removed_by_the_next_and_a_live_ones_is_not(tmp_path):
    """A process killed with its cache on disk leaves the directory; the next cache made there
    removes it (its lock is free). A live process's cache stays."""
    code = (
        "import os, sys\n"
        "from dynarec.data.batch_cache import DiskBatchCache\n"
        "c = DiskBatchCache(sys.argv[1])\n"
        "open(c.directory / 'batch-0.bin', 'wb').write(b'x' * 100)\n"
        "print(c.directory, flush=True)\n"
        "sys.stdin.readline()\n"  # lives until told
        "os._exit(0)\n"  # as a kill: no finalizer runs
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdin is not None
    left = child.stdout.readline().strip()
    live = DiskBatchCache(str(tmp_path))  # the child's lock is held: its directory stays
    assert os.path.isdir(left)
    child.stdin.write("\n")
    child.stdin.flush()
    child.wait()
    assert os.path.isdir(left)  # killed: nothing removed it
    DiskBatchCache(str(tmp_path)).close()
    assert not os.path.exists(left) and live.directory.is_dir()
    live.close()


def test_a_batch_that_cannot_be_written_ends_the_cache_with_a_warning(tmp_path, monkeypatch):
    cache = DiskBatchCache(str(tmp_path))
    cache.add(every_field_batch())

    def disk_full(directory, step, batch):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / f"batch-{step}.bin"))

    monkeypatch.setattr(cache_module, "write_batch", disk_full)
    with pytest.warns(UserWarning, match=r"batch 1 could not be written .*disk is full.*build their batches again"):
        cache.add(every_field_batch())
    assert cache.failed and list(tmp_path.iterdir()) == []
    cache.add(every_field_batch())  # nothing more is written
    assert cache.failed


def test_a_cache_directory_that_cannot_be_made_is_a_config_error_at_the_start_and_a_warning_later(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"data.batch_cache_dir: cannot make the batch cache in .*a-file/sub"):
        check_cache_dir(str(blocker / "sub"))
    check_cache_dir(str(tmp_path / "made" / "here"))  # made where it can be
    assert (tmp_path / "made" / "here").is_dir()
    with pytest.warns(UserWarning, match=r"no directory could be made in .*a-file.*build their batches again"):
        cache = DiskBatchCache(str(blocker))
    assert cache.failed
    cache.add(every_field_batch())  # nothing written, nothing raised
    assert len(cache) == 0
    cache.close()


def test_a_scratch_directory_is_locked_before_another_process_can_see_it(tmp_path, monkeypatch):
    """Made under a hidden name and renamed into sight once locked: a scan for stale directories
    (another process starting at once) never finds it unlocked."""
    from dynarec import files

    seen = []
    real_flock = files.fcntl.flock

    def flock(fd, op):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))  # what a scan would glob now
        return real_flock(fd, op)

    monkeypatch.setattr(files.fcntl, "flock", flock)
    root, lock = files.scratch_directory(str(tmp_path), "dynarec-x-")
    assert seen and all(not name.startswith("dynarec-x-") for name in seen[-1])
    assert os.path.basename(root).startswith("dynarec-x-") and os.path.isdir(root)
    files.remove_scratch(root, lock)
    assert list(tmp_path.iterdir()) == []


def test_a_hidden_scratch_directory_left_by_a_kill_is_removed_once_it_is_old(tmp_path):
    """A process killed between making its hidden directory and renaming it leaves it behind:
    the next scratch directory made there removes it once it is 10 minutes old, never a young
    one (another process making its own)."""
    from dynarec import files

    old, young = tmp_path / ".dynarec-x-old", tmp_path / ".dynarec-x-young"
    for d in (old, young):
        d.mkdir()
        (d / ".lock").write_text("")
    stamp = time.time() - 601
    os.utime(old, (stamp, stamp))
    root, lock = files.scratch_directory(str(tmp_path), "dynarec-x-")
    assert not old.exists() and young.is_dir()
    files.remove_scratch(root, lock)


def test_cache_batches_names_memory_or_disk():
    data = {"train_input_path": "x"}
    assert DataCfg(**data).batch_cache is None
    assert DataCfg(**data, cache_batches=False).batch_cache is None
    assert DataCfg(**data, cache_batches=True).batch_cache == "memory"
    assert DataCfg(**data, cache_batches="memory").batch_cache == "memory"
    assert DataCfg(**data, cache_batches="disk").batch_cache == "disk"
    with pytest.raises(ValueError, match="cache_batches"):
        DataCfg(**data, cache_batches="ssd")
    assert isinstance(batch_cache("memory", None, torch.device("cpu")), MemoryBatchCache)


def test_a_memory_cache_for_the_cpu_keeps_the_batches_themselves():
    cache = MemoryBatchCache(torch.device("cpu"))
    batches = [every_field_batch() for _ in range(3)]
    assert all(cache.add(b) is b for b in batches)
    assert all(a is b for a, b in zip(cache, batches)) and len(cache) == 3 and cache.bytes_on_device == 0
    cache.close()
    assert len(cache) == 0


def test_a_batch_counts_its_bytes_packed_or_not():
    batch = every_field_batch()
    tensors = [batch.sparse.values(), batch.sparse.lengths(), batch.sparse.weights_or_none(), batch.labels]
    tensors += [batch.groups, batch.sessions, *batch.dense.values(), *batch.dense_lengths.values()]
    tensors += batch.element_lengths.values()
    assert batch.nbytes == sum(t.numel() * t.element_size() for t in tensors)
    packed = pickle.loads(pickle.dumps(batch))  # one buffer, its tensors aligned in it
    # its lengths (all below 256) travelled as uint8 and were widened out of the buffer
    assert packed._packed[0].numel() == 704 and packed.sparse.lengths().dtype == torch.int64
    assert packed.nbytes == 704 + 4 * 8
    pinned_like = _unpacked_batch(*packed._packed, widen=False)  # as a page-locked batch keeps them: narrow
    assert pinned_like._packed[0].numel() == 704 and pinned_like.sparse.lengths().dtype == torch.uint8
    assert pinned_like.nbytes == 704 + 4 * 8  # (its copy on a device: the lengths widened there)


@needs_cuda
@pytest.mark.parametrize("packed", [False, True])
def test_a_memory_cache_for_a_gpu_keeps_a_device_copy_for_the_steps(packed):
    """On a GPU the cache keeps a copy of each batch in device memory (a packed batch in one
    piece), made on the batch stream; the step trains on it once its event is waited for."""
    cache = MemoryBatchCache(torch.device("cuda"))
    hosts = [every_field_batch() for _ in range(3)]
    if packed:  # as a DataLoader worker's batch arrives: one page-locked buffer
        hosts = [pickle.loads(pickle.dumps(b)).pin_memory() for b in hosts]
    kept = [cache.add(b) for b in hosts]
    assert all(a is b for a, b in zip(cache, kept))
    assert cache.bytes_on_device == sum(k.nbytes for k in kept) > 0
    for host, k in zip(hosts, kept):
        assert k.ready is not None and k.labels.is_cuda and k.sparse.values().is_cuda and k.dense["seq"].is_cuda
        assert (k._packed is not None) == packed
        torch.cuda.current_stream().wait_event(k.ready)
        back = k.to(torch.device("cpu"))
        torch.cuda.synchronize()
        assert_same(host, back)
    cache.close()
    assert len(cache) == 0 and cache.bytes_on_device == 0


@needs_cuda
def test_a_memory_cache_keeps_the_batches_past_its_device_budget_on_the_host():
    size = every_field_batch().nbytes
    cache = MemoryBatchCache(torch.device("cuda"), device_bytes=2 * size)
    kept = [cache.add(every_field_batch()) for _ in range(3)]
    assert [k.labels.is_cuda for k in kept] == [True, True, False]
    assert kept[2].ready is None and cache.bytes_on_device == 2 * size
    default = MemoryBatchCache(torch.device("cuda"))
    assert default.device_bytes == torch.cuda.get_device_properties(0).total_memory // 8
