#!/usr/bin/env bash
# On a GPU machine, from anywhere: the CUDA tests, then `dynarec bench suite --device cuda` (one
# results file under benchmarks/results/). Arguments go to the suite (e.g. --cases e2e sweep).
#
# The GPU machines' python3 has torch and Triton but not every dependency of dynarec (no
# pydantic, no pyfarmhash, no faiss): wheels of the missing packages, put in .whl/ at the checkout's root,
# are installed offline into /tmp/site first (docs/benchmarks.md says how to make them).
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
        exit 1
    export PYTHONPATH=/tmp/site
fi
# Every test file with CUDA cases (kept with tests/matrix.py's DEVICES and needs_cuda users).
python3 -m pytest -q -rs -p no:cacheprovider tests/kernels tests/embedding/test_hash_index.py \
    tests/embedding/test_cuda.py tests/embedding/test_prefetch.py tests/embedding/test_cached_store.py \
    tests/embedding/test_grouped.py tests/embedding/test_dynamic_parts.py tests/embedding/test_half_rows.py \
    tests/test_devices.py tests/config/test_tzrec_smoke_train.py \
    tests/train/test_cuda_training.py tests/train/test_cuda_graphs.py tests/train/test_loss_scaling.py \
    tests/data/test_transport.py tests/data/test_shared_decode.py tests/models/test_sid.py \
    tests/distributed/test_nccl.py
tests=$?
python3 -m dynarec bench suite --device cuda "$@"
suite=$?
exit $((tests || suite))
