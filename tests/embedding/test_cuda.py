"""The native backend on CUDA equals the CPU run, also through a dynamic table's growth and
evictions: the same keys in the same slots (skipped where no GPU is present)."""

import numpy as np
import pytest
import torch

from dynarec import DynamicTableOptions, EmbeddingCollection, FeatureConfig, Initializer, JaggedBatch, TableConfig
from dynarec.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from tests.matrix import needs_cuda
from tests.reference_model import zipf_batch

pytestmark = needs_cuda

SPECS = [
    SGD(lr=0.3),
    Adagrad(lr=0.2, initial_accumulator_value=0.1),
    RowWiseAdagrad(lr=0.2, initial_accumulator_value=0.1, weight_decay=0.1, weight_decay_mode="l2"),
    Adam(lr=0.05, weight_decay=0.01),
]


VOCAB = {"fixed": 60, "dynamic": 60, "dynamic_evicting": 2000}
TABLE = {
    "fixed": dict(num_embeddings=60),
    "dynamic": dict(dynamic=DynamicTableOptions(512, init_capacity=32, bucket_size=8)),
    # 2000 ids through 256 slots: grows 64 -> 256, then evicts the coldest every step.
    "dynamic_evicting": dict(dynamic=DynamicTableOptions(256, init_capacity=64, bucket_size=8)),
}


def build(kind, spec, device):
    features = ["item_id", FeatureConfig("hist", pooling="none"), FeatureConfig("m", pooling="mean")]
    extra = TABLE[kind]
    return EmbeddingCollection(
        [
            TableConfig(
                name="t", dim=8, features=features, seed=3, initializer=Initializer("uniform", bound=0.5), **extra
            )
        ],
        spec,
        device=device,
    )


@pytest.mark.parametrize("batch_on", ["device", "pinned"])
@pytest.mark.parametrize("kind", list(TABLE))
@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_cuda_matches_cpu(kind, spec, batch_on):
    """``pinned``: the batch comes from page-locked host memory (the trainer's), copied and
    found on the input stream; ``device``: made on the device, so the input stream waits for it."""
    cpu, gpu = build(kind, spec, "cpu"), build(kind, spec, "cuda")
    rng = np.random.default_rng(0)
    for step in range(4 if kind != "dynamic_evicting" else 12):
        # at most 8 x 4 x 3 = 96 ids a step, so that a step's rows always fit the 256 slots
        feats = {f: zipf_batch(rng, 8, 4, VOCAB[kind], a=1.1) for f in ("item_id", "hist", "m")}
        weights = {f: [[0.5 + 0.1 * j for j in range(len(s))] for s in v] for f, v in feats.items()}
        kjt = JaggedBatch.from_lists(feats, weights)
        g = torch.Generator().manual_seed(step)
        out_c = cpu(kjt)
        out_g = gpu(kjt.to("cuda") if batch_on == "device" else kjt.pin_memory())
        grads = {k: torch.randn(v.shape, generator=g) for k, v in out_c.items()}
        sum((out_c[k] * grads[k]).sum() for k in out_c).backward()
        sum((out_g[k] * grads[k].cuda()).sum() for k in out_g).backward()
        for k in out_c:
            torch.testing.assert_close(out_g[k].detach().cpu(), out_c[k].detach(), rtol=1e-5, atol=1e-6)
    keys = torch.arange(VOCAB[kind])
    rc, rg = cpu.read_rows("t", keys), gpu.read_rows("t", keys.cuda())
    for k in rc:
        torch.testing.assert_close(rg[k].cpu(), rc[k], rtol=1e-5, atol=1e-6)
    if kind != "fixed":
        dc, dg = cpu.tables["t"].dump(), gpu.tables["t"].dump()
        for field in ("keys", "scores", "slots", "layout"):
            assert torch.equal(dc[field], dg[field]), field
        assert cpu.tables["t"].report() == gpu.tables["t"].report()
    if kind == "dynamic_evicting":
        report = gpu.tables["t"].report()
        assert report["capacity"] == 256 and report["evicted_keys"] > 100, report


@pytest.mark.parametrize("kind", list(TABLE))
def test_a_state_dict_saved_on_the_gpu_loads_on_the_cpu_and_back(kind):
    """A collection's ``state_dict()`` holds CPU copies: the tables a GPU trained load into a CPU
    collection of the same config bit for bit, and back into a fresh GPU one."""
    spec = Adagrad(lr=0.2, initial_accumulator_value=0.1)
    gpu = build(kind, spec, "cuda")
    rng = np.random.default_rng(1)
    for _ in range(6 if kind != "dynamic_evicting" else 12):
        feats = {f: zipf_batch(rng, 8, 4, VOCAB[kind], a=1.1) for f in ("item_id", "hist", "m")}
        out = gpu(JaggedBatch.from_lists(feats).to("cuda"))
        sum(v.sum() for v in out.values()).backward()
    state = gpu.state_dict()
    assert all(v.device.type == "cpu" for v in state.values())
    cpu, again = build(kind, spec, "cpu"), build(kind, spec, "cuda")
    cpu.load_state_dict(state)
    again.load_state_dict(cpu.state_dict())
    want = gpu.tables["t"].dump()
    for other in (cpu, again):
        got = other.tables["t"].dump()
        assert want.keys() == got.keys()
        for field in want:
            assert torch.equal(want[field], got[field]), field


def _dynamic_collection(spec=SGD(lr=0.1)):
    table = TableConfig(
        name="t",
        dim=4,
        features=["f"],
        dynamic=DynamicTableOptions(64, bucket_size=8),
        initializer=Initializer("constant", value=1.0),
    )
    return EmbeddingCollection([table], spec, device="cuda")


def test_current_stream_is_torchs_current_stream_wrapped_once():
    """The per-call current stream (no new Stream object each call) is torch's current stream, on
    the main stream and inside ``torch.cuda.stream(side)``, for ``cuda`` and ``cuda:0``."""
    from dynarec.embedding.streams import current_stream

    dev = torch.device("cuda")
    main = current_stream(dev)
    assert main == torch.cuda.current_stream() and current_stream(dev) is main
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current_stream(dev) == side and current_stream(torch.device("cuda", 0)) == side
        assert current_stream(dev).cuda_stream == side.cuda_stream
    assert current_stream(dev) is main


def test_input_stream_find_waits_for_the_index_writes_queued_on_the_main_stream():
    """An aborted step's undo (removing the key it created) is queued behind a long kernel on the
    main stream; the next lookup's find, on the input stream, must wait for it and see no key."""
    coll = _dynamic_collection()
    batch = JaggedBatch.from_lists({"f": [[7]]}).pin_memory()
    coll(batch)  # creates key 7 (a training step, never backpropagated)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of the main stream
    coll.abort_step()  # the index writes that remove key 7 queue behind the sleep
    assert not torch.cuda.current_stream().query(), "the undo must still be queued for this test to mean anything"
    coll.eval()
    out = coll(batch)["f"]
    assert torch.equal(out.cpu(), torch.zeros(1, 4))  # key 7 is gone: the eval initializer (zeros)
    assert coll.tables["t"].size == 0


def test_an_insert_waits_for_a_find_still_running_on_another_stream():
    """A find queued behind a long kernel on a side stream (a batch prefetched two steps ahead),
    then an insert of its key on the main stream: the insert waits, and the find sees the index
    as it was when the find was queued (the key absent), not a half-written slot."""
    from dynarec.embedding.hash_index import BucketedHashIndex

    keys = torch.tensor([7, 11], device="cuda")
    warm = BucketedHashIndex(4, 8, "cuda")  # compiles the find, plan and commit kernels first
    warm.commit(warm.plan_insert(keys, allow_evict=False), torch.zeros_like(keys))
    warm.find(keys)
    torch.cuda.synchronize()
    index = BucketedHashIndex(4, 8, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the side stream
        slots = index.find(keys)
    index.commit(index.plan_insert(keys, allow_evict=False), torch.zeros_like(keys))  # on the main stream
    assert not side.query(), "the find must still be queued for this test to mean anything"
    torch.cuda.synchronize()
    assert slots.tolist() == [-1, -1]
    assert (index.find(keys) >= 0).all()


def test_a_warm_lookup_does_not_wait_for_the_main_stream():
    """The find's host read waits only for the input stream: with the main stream busy, a
    training forward of a warm dynamic table returns before the main stream is done."""
    coll = _dynamic_collection()
    batch = JaggedBatch.from_lists({"f": [[1, 2], [3]]}).pin_memory()
    coll(batch)["f"].sum().backward()  # every key now has a row
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    out = coll(batch)["f"]
    assert not torch.cuda.current_stream().query(), "the forward waited for the main stream"
    out.sum().backward()
    expected = torch.full((2, 4), 1.0)
    expected[0] = 2 * (1.0 - 0.1)  # bag 0 sums rows 1 and 2, each stepped once by SGD
    expected[1] = 1.0 - 0.1
    assert torch.equal(out.detach().cpu(), expected)


def test_a_prefetched_lookup_reads_its_answer_without_waiting():
    """With the main stream busy, prefetch and the forward that takes it both return at once:
    the find's answer was copied to pinned memory behind the find, on the input stream."""
    coll = _dynamic_collection()
    batch = JaggedBatch.from_lists({"f": [[1, 2], [3]]}).pin_memory()
    coll(batch)["f"].sum().backward()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    coll.prefetch(batch)
    out = coll(batch)["f"]
    assert not torch.cuda.current_stream().query(), "prefetch or the forward waited for the main stream"
    out.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), torch.tensor([[1.8] * 4, [0.9] * 4]))


@pytest.mark.parametrize("with_ready", [True, False], ids=["ready", "no_ready"])
def test_a_device_batch_is_prefetched_beside_the_main_stream_given_its_ready_event(with_ready):
    """A batch already on the GPU, made before an event: prefetched with that event, its input
    stage (the find) runs beside a long kernel queued on the main stream, and the forward
    returns while that kernel still runs; without it the stage waits for all the main stream's
    work (the forward returns after the kernel). The outputs are the same."""
    coll = _dynamic_collection()
    batch = JaggedBatch.from_lists({"f": [[1, 2], [3]]}).to("cuda")
    coll(batch)["f"].sum().backward()  # every key now has a row
    made = torch.cuda.Event()
    made.record()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of the main stream
    slept = torch.cuda.Event()
    slept.record()
    coll.prefetch(batch, made if with_ready else None)
    out = coll(batch)["f"]
    assert slept.query() != with_ready  # with the event, the forward returned during the sleep
    out.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), torch.tensor([[1.8] * 4, [0.9] * 4]))


def test_a_device_batch_made_on_another_stream_is_read_after_its_ready_event():
    """A batch on the GPU whose ids and weights a producer stream writes behind a long kernel there
    (int32 ids and lengths, float64 weights: its checks convert them), prefetched with the event
    after those writes: its checks, conversions and find run on the input stream after that
    event, and the step (outputs, keys, weights) equals the same batch's from the host. The
    main stream filled the ids with 77s first: a stage that read them early would insert 77."""
    ids, weights = (
        torch.tensor([5, 9, 5, 11], dtype=torch.int32),
        torch.tensor([0.5, 2.0, 1.5, 3.0], dtype=torch.float64),
    )
    host = JaggedBatch(["f"], ids, torch.tensor([3, 1], dtype=torch.int32), weights)
    coll, ref = _dynamic_collection(), _dynamic_collection()
    warm = JaggedBatch(["f"], ids + 100, host.lengths(), weights)  # a first step: every kernel loaded
    coll(warm.to("cuda"))["f"].sum().backward()
    ref(warm)["f"].sum().backward()
    values = torch.full((4,), 77, dtype=torch.int32, device="cuda")
    dev_weights = torch.ones(4, dtype=torch.float64, device="cuda")
    batch = JaggedBatch(["f"], values, host.lengths().cuda(), dev_weights)
    pinned = host.pin_memory()
    producer = torch.cuda.Stream()
    producer.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(producer):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the producer stream
        values.copy_(pinned.values(), non_blocking=True)
        dev_weights.copy_(weights.pin_memory(), non_blocking=True)
        made = torch.cuda.Event()
        made.record()
    coll.prefetch(batch, made)
    out = coll(batch)["f"]
    want = ref(host)["f"]
    out.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(out, want)
    got, expected = coll.tables["t"].dump(), ref.tables["t"].dump()
    assert got["keys"].tolist() == expected["keys"].tolist() == [5, 9, 11, 105, 109, 111]
    assert torch.equal(got["weight"], expected["weight"])


def test_a_sequence_tables_captured_update_recurs_whatever_the_samples_lengths():
    """A sequence's bags are the padded ``[B, L]`` positions (``dynarec.embedding.pack``), so a
    table's bag count stays while its samples' lengths change from step to step and its update
    is captured once and replayed (when every id was a bag, the count changed with the lengths
    and no update recurred); the steps equal the CPU's."""
    from dynarec.kernels.gpu import update as gpu_update

    def make(device):
        features = ["item_id", FeatureConfig("hist", pooling="none")]
        table = TableConfig(name="t", dim=8, num_embeddings=50, features=features, seed=3)
        return EmbeddingCollection([table], Adagrad(lr=0.2), device=device)

    cpu, gpu = make("cpu"), make("cuda")
    gpu_update._CAPTURED.clear()
    before = gpu_update._CAPTURED.captures
    rng = np.random.default_rng(0)
    for step in range(6):
        lengths = [6, *((step + j) % 6 for j in range(7))]  # 8 samples, the longest 6; 21 + step ids
        hist = [rng.integers(0, 50, size=n).tolist() for n in lengths]
        kjt = JaggedBatch.from_lists({"item_id": [[i] for i in range(8)], "hist": hist})
        outs = [coll(batch) for coll, batch in ((cpu, kjt), (gpu, kjt.pin_memory()))]
        for out in outs:
            assert out["hist"].shape == (8, 6, 8)
            grad = torch.linspace(-1, 1, out["hist"].numel()).view(8, 6, 8).to(out["hist"].device)
            ((out["hist"] * grad).sum() + out["item_id"].sum()).backward()
    assert gpu_update._CAPTURED.captures == before + 1  # captured on its second step, replayed after
    keys = torch.arange(50)
    rc, rg = cpu.read_rows("t", keys), gpu.read_rows("t", keys.cuda())
    for k in rc:
        torch.testing.assert_close(rg[k].cpu(), rc[k], rtol=1e-5, atol=1e-6)
