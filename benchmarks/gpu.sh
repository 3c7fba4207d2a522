#!/usr/bin/env bash
# On a GPU machine, from anywhere: the CUDA tests, then `dynarec bench suite --device cuda` (one
# results file under benchmarks/results/). Arguments go to the suite (e.g. --cases e2e sweep);
# GPU_TESTS_ONLY=1 stops after the tests, GPU_SUITE_ONLY=1 skips them.
#
# The GPU machines' python3 has torch and Triton but not every dependency of dynarec (no
# pydantic, no pyfarmhash, no faiss): wheels of the missing packages, put in .whl/ at the checkout's root,
# are installed offline into /tmp/site first (docs/benchmarks.md says how to make them).
#
# The test files run in six shards side by side (the machines have 16 cores and one GPU; a shard
# is a few CUDA contexts' worth of memory), each logging to $LOGS/<shard>.log (default
# /tmp/dynarec-gpu-tests): one after another they took two to three 10-minute calls. Side by side
# they are slow too: at f51adf2 five of the six were cut off by a 200 s limit (one shard's two
# files took 35 s alone), so give the whole run more than one 10-minute call, or run a shard alone.
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
        exit 1
    export PYTHONPATH=/tmp/site
fi
tests=0
if [ -z "${GPU_SUITE_ONLY:-}" ]; then
    LOGS=${LOGS:-/tmp/dynarec-gpu-tests}
    mkdir -p "$LOGS"
    # Every test file with CUDA cases (kept with tests/matrix.py's DEVICES and needs_cuda users).
    shards=(
        "kernels tests/kernels/test_gpu_kernels.py"
        "kernels2 tests/kernels/test_gpu_compile.py tests/kernels/test_gpu_specialization.py tests/kernels/test_packed.py
            tests/kernels/test_static_update.py tests/kernels/test_ops.py tests/kernels/test_kernel_table.py
            tests/kernels/test_cpu_kernels.py tests/kernels/test_triton_interpreter.py"
        "dynamic tests/embedding/test_hash_index.py tests/embedding/test_grouped.py tests/embedding/test_dynamic_parts.py"
        "embedding tests/embedding/test_cuda.py tests/embedding/test_prefetch.py tests/embedding/test_cached_store.py
            tests/embedding/test_initializers_and_index.py
            tests/embedding/test_half_rows.py"
        "train tests/test_devices.py tests/config/test_tzrec_smoke_train.py tests/train/test_cuda_training.py
            tests/train/test_cuda_graphs.py tests/train/test_loss_scaling.py tests/train/test_optimizer_graph.py
            tests/train/test_step_graph.py"
        "data tests/data/test_transport.py tests/data/test_batch_cache.py tests/data/test_shared_decode.py tests/models/test_sid.py
            tests/distributed/test_nccl.py"
    )
    pids=()
    for shard in "${shards[@]}"; do
        files=($shard) # (paths without spaces: word splitting over the lines)
        name=${files[0]}
        python3 -m pytest -q -rs -p no:cacheprovider "${files[@]:1}" >"$LOGS/$name.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || tests=1
        files=(${shards[$i]})
        echo "== ${files[0]}: $(tail -n 1 "$LOGS/${files[0]}.log")"
        grep -E "^(FAILED|ERROR) " "$LOGS/${files[0]}.log" | head -20
    done
fi
[ -n "${GPU_TESTS_ONLY:-}" ] && exit $tests
python3 -m dynarec bench suite --device cuda "$@"
suite=$?
exit $((tests || suite))
