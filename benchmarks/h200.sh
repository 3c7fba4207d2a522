#!/usr/bin/env bash
# The GPU runs behind benchmarks/results/*-h200*.txt, as they were made on an H200 machine with
# the image's python3 (torch + Triton). Usage: benchmarks/h200.sh STAGE OUT_DIR
#   tests    CUDA tests (Triton kernels and GPU insert plans vs the plain-torch code, CUDA vs CPU runs); hash-find
#   before   hash-find / fused-step / dynamic-step of the pre-kernel revision (copied to .before/)
#   compare  the same three of the previous revision (copied to .prev/) then of this one; the
#            fused update alone by tile height (benchmarks/tune_update.py)
#   steps    fused-step / dynamic-step on one GPU; the profile of a fixed and a dynamic step
#   sweep    the GPU sweep (optimizers x D x ids per step)
#   train    train-step on one GPU (dynarec vs plain torch)
#   nccl     two GPUs: the NCCL equality test, train-step weak scaling 1 -> 2 GPUs
#   demo2    two GPUs: the demo config trained on 2 GPUs (NCCL) and on 1, evaluated
#   round3   hash-find, fused-step, dynamic-step (twice) and the GPU sweep of this revision
#   round4   the prefetch tests; fused-step and dynamic-step (30 steps a run, 7 runs) of the
#            previous revision (.prev/) and of this one, in turn; the host side of a step
#   round4b  dynamic-step at 4.2M ids a step (where the GPU, not the host, bounds the step);
#            the GPU sweep
#   round4c  the prefetch tests; fused-step and dynamic-step of .prev/ and of this revision;
#            dynamic-step at 4.2M ids; train-step
#   round5a  the CUDA tests; hash-find of .prev/ and of this revision; the profile of an insert
#   round5b  fused-step and dynamic-step (1M ids a step), then dynamic-step at 4.2M ids, of .prev/
#            and of this revision in turn
#   round6a  the CUDA tests of the hash index, insert plans, dynamic tables and training (not the
#            fused-update kernels'); hash-find of .prev/ and of this revision, twice in turn; the profile of
#            an insert; the find and place kernels by block size
#   round6b  every CUDA test; hash-find of .prev/ and of this revision, twice in turn; the profile
#            of an insert
#   round6c  the CUDA tests but the fused update's; the host syncs of a step with new keys
#            (benchmarks/host_syncs.py) of .prev/ and of this revision, twice in turn
#   round7   the CUDA tests but the fused update's; hash-find three times (each run times insert_absent
#            and the unique + plan + commit baseline in turn); the profile of both inserts
#   round8   the CUDA tests but the fused update's; hash-find of .prev/ and of this revision, twice in
#            turn; the profile of find_or_insert and of find + insert_absent; dynamic-step at 4.2M ids
#            of .prev/ and of this revision in turn; the profile of a dynamic step at 4.2M ids
#   round8b  the CUDA tests but the fused update's; hash-find of .prev/ and of this revision, twice in
#            turn; the profile of find_or_insert; dynamic-step at 4.2M ids with score_strategy step,
#            then none (what the fused update's score writes cost)
#   round8c  (since removed, with what it compared) the find kernel's two other ways to probe, by
#            tune_index.py and dynamic-step at 4.2M ids: both slower
#   round8d  (since removed, with what it compared) a capped-grid find looping over blocks, the
#            same way: slower; then hash-find of .prev/ and of this revision, the profile and host
#            timeline of find_or_insert (benchmarks/profile_insert.py --timeline)
#   round8e  the CUDA tests but the fused update's; hash-find of .prev/ and of this revision, twice
#            in turn; dynamic-step at 4.2M ids; the profile and host timeline of find_or_insert
#   round9b  the CUDA tests but the fused update's; tune_index.py and hash-find of .prev/ and of this
#            revision in turn; the insert's kernels under Nsight Compute (benchmarks/ncu_insert.py)
#   round9c  the CUDA tests but the fused update's; hash-find three times; the host's costs; dynamic-step
#            at 4.2M ids
#   round10  the CUDA tests but the fused update's; hash-find of .prev/ and of this revision, twice
#            in turn; the host's costs; the insert's kernels of .prev/ and of this revision under
#            Nsight Compute at its locked base clocks (stable durations to compare)
#   round10b the CUDA tests but the fused update's; the insert's kernels of .prev/ and of this revision
#            by occurrences a program and warps under Nsight Compute (tune_index.py --insert-only);
#            hash-find of .prev/ and of this revision, twice in turn
#   round10c the CUDA tests but the fused update's; the insert's kernels of this revision by
#            occurrences a program and warps under Nsight Compute; hash-find of .prev/ and of this
#            revision, twice in turn; dynamic-step at 4.2M ids of .prev/ and of this revision (whose
#            device batches come with their ready event); the dynamic step's profile and overlap
#   round10d the CUDA tests but the fused update's; the insert's kernels of this revision by
#            occurrences a program and warps under Nsight Compute; hash-find of .prev/ and of this
#            revision, twice in turn; the host's costs; the fixed step's profile and overlap
#   round10e the CUDA tests but the fused update's; hash-find of .prev/ and of this revision, three times
#            in turn; the host's costs
#   round11  the CUDA tests but the fused update's; the insert's kernels of .prev/ and of this revision under
#            Nsight Compute; hash-find of .prev/, of .dbg/pack/ (one output copy, the counts read while it runs)
#            and of this revision (also the contest's hint to the rank kernel), twice in turn; the host's costs
#   round11b the CUDA tests but the fused update's; the insert's kernels of .dbg/pack/ and of this revision (the
#            rank kernel writing the placed slots, the write kernel only moving keys) under Nsight Compute;
#            hash-find of .dbg/pack/, of this revision and of .prev/ in turns; dynamic-step at 4.2M ids of this
#            revision and of .dbg/prio/ (the input stream at the main stream's priority), twice in turn
#   round11c the CUDA tests but the fused update's; the write kernel by block and warps under Nsight Compute
#            (.dbg/tune_write.py, not kept: it set the module's WRITE_BLOCK / WRITE_WARPS); hash-find of .dbg/pack/
#            and of this revision, twice in turn; the host's costs
#   round11d the device timeline of the graphed find_or_insert (.dbg/timeline.py, not kept: CUDA events around the
#            graph's replay, real clocks, warm caches) of .prev/, .dbg/pack/, .dbg/hint/ (the contest's hint to the
#            rank kernel) and .dbg/rankw/ (the rank kernel writing the placed slots), twice in turn; hash-find of each
#   round11e the CUDA tests but the fused update's; hash-find of .prev/ and of this revision (also the current
#            stream's wrapper made once), three times in turn; the host's costs (with the graphed call's timeline)
#   round11f fused-step and dynamic-step (1M ids a step, where the host bounds the step) of .prev/ and of this revision
#   round11g the CUDA tests but the fused update's; hash-find three times; the host's costs (the final code)
#   round11h dynamic-step at 4.2M ids of this revision, of .dbg/after/ (the input stage waits for the last step's
#            update-run kernel: its finds run beside the crossing kernel and the next forward, not the update) and
#            of .dbg/after1/ (the same, one batch prefetched instead of two), twice in turn
#   round12  (since removed, with what it measured: commit 93f314d) the kernels' CUDA tests; a dynamic table's
#            find + update at 4.2M ids, per occurrence against each distinct key found once and the update
#            handed its grouping (benchmarks/grouped_find.py): slower
#   round12b the CUDA tests but the fused update's; hash-find of .prev/ and of this revision (steps 2-3 of an insert
#            plan by the GPU kernels), twice in turn; the profile of find_or_insert at load 0.9 of each
#   round12c hash-find of .prev/ and of this revision, twice in turn, and dynamic-step at 4.2M ids of this revision and
#            of .dbg/prio/ (the input stream at the main stream's priority), twice in turn: with -P, each of its code
#   round12d the CUDA tests but the fused update's; hash-find of .prev/ and of this revision, twice in turn
#   round9d  the CUDA tests but the fused update's; hash-find three times (its new keys now drawn on the
#            device, which keeps the GPU from idling ~10 ms before each timed call)
#   round9   the CUDA tests but the fused update's; hash-find three times (find_or_insert eager and
#            as a replayed CUDA graph, the planned baseline, in turns); the host's costs
#            (benchmarks/host_costs.py); the insert's kernels by block and warps (tune_index.py); the
#            profile and host timeline of the graphed find_or_insert
# Packages missing from the image (pydantic, pyfarmhash) come as wheels in .whl/.
set -uo pipefail
stage=$1
out=$2
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
dyn=(python3 -m dynarec bench)
before=(env -C .before PYTHONPATH=/tmp/site:$PWD/.before python3 -m dynarec.cli bench)
shape=(--rows 10000000 --dim 128 --bags 65536 --pooling-factor 16)

# the CUDA tests of the input stage, prefetch and training
prefetch_tests() {
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/embedding/test_prefetch.py tests/embedding/test_cuda.py \
        tests/train/test_cuda_training.py 2>&1 | tail -3 | tee "$out/tests-h200.txt"
}

# fused-step and dynamic-step (30 steps a run, 7 runs) of the previous revision (.prev/) or of
# this one, in the order given ("prev" / "now"), in one call: both see the same machine state
steps_prev_now() {
    local prev=(env -C .prev PYTHONPATH=/tmp/site:$PWD/.prev python3 -m dynarec bench) cmd who
    for who in "$@"; do
        if [ "$who" = prev ]; then cmd=("${prev[@]}"); else cmd=("${dyn[@]}"); fi
        echo "## $who"
        timeout 90 "${cmd[@]}" fused-step --device cuda "${shape[@]}" --steps 30 --runs 7 --optimizer adagrad
        timeout 110 "${cmd[@]}" dynamic-step --device cuda "${shape[@]}" --steps 30 --runs 7
    done
}

# the dynamic step at 4.2M ids a step (the GPU, not the host, bounds it) of the revisions given (site_of's names)
dynamic_4m() {
    local who
    for who in "$@"; do
        code_of "$who"
        PYTHONPATH=$(site_of "$who") timeout 100 python3 -P -m dynarec bench dynamic-step --device cuda \
            --rows 10000000 --dim 128 --bags 262144 --pooling-factor 16 --steps 10 --runs 7
    done
}

# the CUDA tests of the kernels, the hash index, dynamic tables, the input stage and training
# ("index": all but the fused update kernel's, unchanged by an index round)
cuda_tests() {
    local kernels=(tests/kernels)
    if [ "${1:-}" = index ]; then kernels=(tests/kernels/test_gpu_kernels.py -k "not fused_update"); fi
    timeout 400 python3 -m pytest -q -rs -p no:cacheprovider "${kernels[@]}" tests/embedding/test_hash_index.py \
        tests/embedding/test_cuda.py tests/embedding/test_prefetch.py tests/train/test_cuda_training.py 2>&1 |
        tail -15 | tee "$out/tests-h200.txt"
}

# hash-find of .prev/ or of this revision in the order given ("prev" / "now"), then the profile of
# an insert of this revision
hash_find_prev_now() {
    local prev=(env -C .prev PYTHONPATH=/tmp/site:$PWD/.prev python3 -m dynarec bench) cmd who
    for who in "$@"; do
        if [ "$who" = prev ]; then cmd=("${prev[@]}"); else cmd=("${dyn[@]}"); fi
        echo "## $who"
        timeout 100 "${cmd[@]}" hash-find --device cuda --slots $((1 << 26))
    done
    timeout 60 python3 benchmarks/profile_insert.py --device cuda --slots $((1 << 26)) --load 0.5 --rows-shown 30
}

insert_kernels='_contest_kernel|_rank_kernel|_write_claims_kernel'
# site_of NAME: the PYTHONPATH of this revision ("now"), of .prev/ ("prev"), or of a variant copied to .dbg/NAME/.
# A script (python3 benchmarks/x.py) then imports that dynarec; "python3 -m dynarec" needs -P, or it puts the working
# directory (this revision) ahead of PYTHONPATH: before round 12 it did, and every "-m dynarec" run of site_of's
# names measured this revision, whatever the name (benchmarks/results/issue12-round12-h200.txt, c3).
site_of() {
    case $1 in
    now) echo "/tmp/site:$PWD" ;;
    prev) echo "/tmp/site:$PWD/.prev" ;;
    *) echo "/tmp/site:$PWD/.dbg/$1" ;;
    esac
}

# which dynarec site_of's name imports (a line of the results)
code_of() {
    PYTHONPATH=$(site_of "$1") python3 -P -c "import dynarec; print('## $1: dynarec from', dynarec.__path__[0])"
}

# hash-find's load lines of the revisions given, in that order (site_of's names)
hash_find_turns() {
    local who
    for who in "$@"; do
        code_of "$who"
        PYTHONPATH=$(site_of "$who") timeout 100 python3 -P -m dynarec bench hash-find --device cuda --slots $((1 << 26)) |
            grep "^load"
    done 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/hash-find-h200.txt"
}

# the insert's kernels of .prev/ or of this revision ($1) by keys a program and warps, under Nsight Compute at its
# locked clocks (benchmarks/tune_index.py --insert-only): each kernel's grid and block, duration, registers, occupancy
ncu_tune_insert() {
    PYTHONPATH=$(site_of "$1") timeout 200 ncu -k regex:"$insert_kernels" \
        --section SpeedOfLight --section Occupancy --section LaunchStats \
        python3 benchmarks/tune_index.py --insert-only --reps 1 2>&1 |
        grep -E "_kernel \(|Duration|Registers Per Thread|Achieved Occupancy"
}

# the insert's kernels (the second to fourth call of ncu_insert.py) of the revisions given (site_of's names) under
# Nsight Compute: each kernel's duration, registers and occupancy
ncu_insert_turns() {
    local who
    for who in "$@"; do
        echo "## $who"
        PYTHONPATH=$(site_of "$who") timeout 120 ncu -k regex:"$insert_kernels" -s 3 -c 9 \
            --section SpeedOfLight --section Occupancy --section LaunchStats \
            python3 benchmarks/ncu_insert.py --calls 4 2>&1 |
            grep -E "_kernel|Duration|Registers Per Thread|Achieved Occupancy"
    done 2>&1 | tee "$out/ncu-insert-h200.txt"
}

case $stage in
tests)
    python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
    timeout 400 python3 -m pytest -q -rs -p no:cacheprovider tests/kernels tests/embedding/test_hash_index.py tests/embedding/test_cuda.py \
        tests/embedding/test_prefetch.py tests/train/test_cuda_training.py 2>&1 | tee "$out/tests-h200.txt"
    {
        timeout 120 "${dyn[@]}" hash-find --device cuda --slots $((1 << 26))
    } 2>&1 | tee "$out/hash-find-h200.txt"
    ;;
steps)
    {
        timeout 90 "${dyn[@]}" fused-step --device cuda "${shape[@]}" --optimizer adagrad
        timeout 120 "${dyn[@]}" dynamic-step --device cuda "${shape[@]}"
    } 2>&1 | tee "$out/steps-h200.txt"
    for kind in fixed dynamic; do
        timeout 90 python3 benchmarks/profile_step.py --device cuda --kind $kind --rows 10000000 --dim 128
    done 2>&1 | tee "$out/profile-h200.txt"
    ;;
before)
    {
        timeout 120 "${before[@]}" hash-find --device cuda --slots $((1 << 26))
        timeout 90 "${before[@]}" fused-step --device cuda "${shape[@]}"
        timeout 120 "${before[@]}" dynamic-step --device cuda "${shape[@]}"
    } 2>&1 | tee "$out/before-h200.txt"
    ;;
compare)
    prev=(env -C .prev PYTHONPATH=/tmp/site:$PWD/.prev python3 -m dynarec bench)
    {
        for who in prev now prev now; do
            if [ $who = prev ]; then cmd=("${prev[@]}"); else cmd=("${dyn[@]}"); fi
            echo "## $who"
            timeout 100 "${cmd[@]}" hash-find --device cuda --slots $((1 << 26))
            timeout 90 "${cmd[@]}" fused-step --device cuda "${shape[@]}" --optimizer adagrad
            timeout 110 "${cmd[@]}" dynamic-step --device cuda "${shape[@]}"
        done
        timeout 120 python3 benchmarks/tune_update.py
    } 2>&1 | tee "$out/compare-h200.txt"
    ;;
sweep)
    timeout 300 "${dyn[@]}" sweep --device cuda --json "$out/sweep-h200.json" 2>&1 | tee "$out/sweep-h200.txt"
    ;;
train)
    # 14 DataLoader workers of the machine's 16 cores: the data pipeline bounds the step (with
    # 8 workers it gives 2.78x, with 0 1.03x: benchmarks/results/issue12-round2-h200.txt)
    timeout 400 "${dyn[@]}" train-step --device cuda --batch 16384 --workers 14 --runs 5 --steps 20 \
        --json "$out/train-step-h200.json" 2>&1 | tee "$out/train-step-h200.txt"
    ;;
nccl)
    nvidia-smi topo -m
    timeout 60 python3 benchmarks/profile_step.py --device cuda --rows 10000000 --dim 128 --bags 4096 \
        --steps 50 --host --rows-shown 30 2>&1 | tee "$out/profile-host-h200.txt"
    timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/distributed/test_nccl.py 2>&1 | tee "$out/nccl-h200x2.txt"
    {
        timeout 150 "${dyn[@]}" train-step --device cuda --batch 16384 --workers 8 --runs 3 --steps 10
        timeout 200 torchrun --standalone --nproc-per-node 2 -m dynarec bench train-step --device cuda \
            --batch 16384 --workers 8 --runs 3 --steps 10
    } 2>&1 | tee "$out/train-step-h200x2.txt"
    ;;
round3)
    # issue 12, round 3: the step figures after the input stream and the run kernel, the dynamic
    # step twice (its fixed baseline is noisy), and the GPU sweep
    {
        timeout 100 "${dyn[@]}" hash-find --device cuda --slots $((1 << 26))
        timeout 90 "${dyn[@]}" fused-step --device cuda "${shape[@]}" --optimizer adagrad
        for _ in 1 2; do timeout 110 "${dyn[@]}" dynamic-step --device cuda "${shape[@]}"; done
    } 2>&1 | tee "$out/steps-h200.txt"
    timeout 300 "${dyn[@]}" sweep --device cuda --json "$out/sweep-h200.json" 2>&1 | tee "$out/sweep-h200.txt"
    ;;
round4)
    prefetch_tests
    steps_prev_now prev now now 2>&1 | grep -v -e Warning -e sparse_coo | tee "$out/steps-h200.txt"
    for kind in fixed dynamic; do
        timeout 60 python3 benchmarks/profile_step.py --device cuda --kind $kind --rows 10000000 --dim 128 \
            --steps 30 --host --rows-shown 25
    done 2>&1 | tee "$out/profile-host-h200.txt"
    ;;
round4b)
    {
        timeout 150 "${dyn[@]}" dynamic-step --device cuda --rows 10000000 --dim 128 --bags 262144 \
            --pooling-factor 16 --steps 10 --runs 7
    } 2>&1 | grep -v -e Warning -e sparse_coo | tee "$out/steps-4m-h200.txt"
    timeout 300 "${dyn[@]}" sweep --device cuda --json "$out/sweep-h200.json" 2>&1 | tee "$out/sweep-h200.txt"
    ;;
round4c)
    prefetch_tests
    {
        steps_prev_now prev now
        timeout 90 "${dyn[@]}" dynamic-step --device cuda --rows 10000000 --dim 128 --bags 262144 \
            --pooling-factor 16 --steps 10 --runs 7
    } 2>&1 | grep -v -e Warning -e sparse_coo | tee "$out/steps-h200.txt"
    timeout 100 "${dyn[@]}" train-step --device cuda --batch 16384 --workers 14 --runs 3 --steps 20 \
        --json "$out/train-step-h200.json" 2>&1 | grep -v -e Warning -e sparse_coo | tee "$out/train-step-h200.txt"
    ;;
round5a)
    cuda_tests
    hash_find_prev_now prev now 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/hash-find-h200.txt"
    ;;
round6a)
    cuda_tests index
    {
        hash_find_prev_now prev now prev now
        timeout 60 python3 benchmarks/tune_index.py
    } 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/hash-find-h200.txt"
    ;;
round6b)
    cuda_tests
    hash_find_prev_now prev now prev now 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/hash-find-h200.txt"
    ;;
round7)
    cuda_tests index
    {
        for run in 1 2 3; do timeout 100 "${dyn[@]}" hash-find --device cuda --slots $((1 << 26)); done
        for path in absent planned; do
            timeout 60 python3 benchmarks/profile_insert.py --device cuda --slots $((1 << 26)) --load 0.5 \
                --path $path --rows-shown 20
        done
    } 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/hash-find-h200.txt"
    ;;
round8)
    cuda_tests index
    {
        hash_find_prev_now prev now prev now
        for path in fused absent; do
            timeout 60 python3 benchmarks/profile_insert.py --device cuda --slots $((1 << 26)) --load 0.5 \
                --path $path --rows-shown 20
        done
    } 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/hash-find-h200.txt"
    {
        dynamic_4m prev now
        timeout 100 python3 benchmarks/profile_step.py --device cuda --kind dynamic --rows 10000000 --dim 128 \
            --bags 262144 --pooling-factor 16
    } 2>&1 | grep -v -e Warning -e sparse_coo | tee "$out/steps-h200.txt"
    ;;
round8b)
    cuda_tests index
    {
        hash_find_prev_now prev now prev now
        timeout 60 python3 benchmarks/profile_insert.py --device cuda --slots $((1 << 26)) --load 0.5 \
            --path fused --rows-shown 12
    } 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/hash-find-h200.txt"
    for strategy in step none; do
        timeout 120 "${dyn[@]}" dynamic-step --device cuda --rows 10000000 --dim 128 --bags 262144 \
            --pooling-factor 16 --steps 10 --runs 7 --score-strategy $strategy
    done 2>&1 | grep -v -e Warning -e sparse_coo | tee "$out/steps-h200.txt"
    ;;
round8e)
    cuda_tests index
    {
        hash_find_prev_now prev now prev now
        timeout 60 python3 benchmarks/profile_insert.py --device cuda --slots $((1 << 26)) --load 0.5 \
            --path fused --rows-shown 12 --timeline
    } 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/hash-find-h200.txt"
    dynamic_4m now 2>&1 | grep -v -e Warning -e sparse_coo | tee "$out/steps-h200.txt"
    ;;
round9)
    cuda_tests index
    {
        for run in 1 2 3; do timeout 100 "${dyn[@]}" hash-find --device cuda --slots $((1 << 26)); done
        timeout 100 python3 benchmarks/host_costs.py
        timeout 150 python3 benchmarks/tune_index.py
        timeout 60 python3 benchmarks/profile_insert.py --device cuda --slots $((1 << 26)) --load 0.5 \
            --path graphed --rows-shown 12 --timeline
    } 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/hash-find-h200.txt"
    ;;
round9b)
    cuda_tests index
    for who in prev now prev now; do
        echo "## $who"
        if [ $who = prev ]; then path=/tmp/site:$PWD/.prev; else path=/tmp/site:$PWD; fi
        PYTHONPATH=$path timeout 150 python3 benchmarks/tune_index.py | sed -n '/insert_free/,$p'
        PYTHONPATH=$path timeout 100 python3 -m dynarec bench hash-find --device cuda --slots $((1 << 26)) | grep "load 0.5"
    done 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/hash-find-h200.txt"
    timeout 200 ncu --clock-control none -k regex:'_contest_kernel|_rank_kernel|_write_claims_kernel' -s 3 -c 3 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        python3 benchmarks/ncu_insert.py 2>&1 | grep -v -e "^==PROF==" | tee "$out/ncu-insert-h200.txt" | tail -150
    ;;
round9c)
    cuda_tests index
    {
        for run in 1 2 3; do timeout 100 "${dyn[@]}" hash-find --device cuda --slots $((1 << 26)); done
        timeout 100 python3 benchmarks/host_costs.py
    } 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/hash-find-h200.txt"
    dynamic_4m now 2>&1 | grep -v -e Warning -e sparse_coo | tee "$out/steps-h200.txt"
    ;;
round10)
    cuda_tests index
    hash_find_turns prev now prev now
    timeout 100 python3 benchmarks/host_costs.py 2>&1 | grep -v -e Warning -e _warn_once | tee -a "$out/hash-find-h200.txt"
    for who in prev now; do
        echo "## $who"
        PYTHONPATH=$(site_of $who) timeout 120 ncu -k regex:"$insert_kernels" -s 3 -c 9 \
            --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
            python3 benchmarks/ncu_insert.py --calls 4 2>&1 |
            grep -E "_kernel|Duration|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|DRAM Throughput|L2 Hit Rate"
    done 2>&1 | tee "$out/ncu-insert-h200.txt"
    ;;
round10b)
    cuda_tests index
    for who in prev now; do
        echo "## $who"
        ncu_tune_insert "$who"
    done 2>&1 | tee "$out/ncu-tune-h200.txt" | tail -4
    hash_find_turns prev now prev now
    ;;
round10c)
    cuda_tests index
    ncu_tune_insert now > "$out/ncu-tune-h200.txt"
    hash_find_turns prev now prev now
    {
        dynamic_4m prev now
        timeout 100 python3 benchmarks/profile_step.py --device cuda --kind dynamic --rows 10000000 --dim 128 \
            --bags 262144 --pooling-factor 16 --rows-shown 12
    } 2>&1 | grep -v -e Warning -e sparse_coo | tee "$out/steps-h200.txt"
    ;;
round10d)
    cuda_tests index
    ncu_tune_insert now > "$out/ncu-tune-h200.txt"
    hash_find_turns prev now prev now
    timeout 100 python3 benchmarks/host_costs.py 2>&1 | grep -v -e Warning -e _warn_once | tee -a "$out/hash-find-h200.txt"
    timeout 100 python3 benchmarks/profile_step.py --device cuda --kind fixed --rows 10000000 --dim 128 \
        --bags 262144 --pooling-factor 16 --rows-shown 12 2>&1 | grep -v -e Warning -e sparse_coo |
        tee "$out/steps-h200.txt"
    ;;
round10e)
    cuda_tests index
    hash_find_turns prev now prev now prev now
    timeout 100 python3 benchmarks/host_costs.py 2>&1 | grep -v -e Warning -e _warn_once | tee -a "$out/hash-find-h200.txt"
    ;;
round11)
    cuda_tests index
    ncu_insert_turns prev now
    hash_find_turns prev pack now prev pack now
    timeout 100 python3 benchmarks/host_costs.py 2>&1 | grep -v -e Warning -e _warn_once | tee -a "$out/hash-find-h200.txt"
    ;;
round11b)
    cuda_tests index
    ncu_insert_turns pack now
    hash_find_turns pack now pack now prev now
    dynamic_4m now prio now prio 2>&1 | grep -v -e Warning -e sparse_coo | tee "$out/steps-h200.txt"
    ;;
round11c)
    cuda_tests index
    PYTHONPATH=$(site_of now) timeout 150 ncu -k regex:_write_claims_kernel --section SpeedOfLight \
        python3 .dbg/tune_write.py 2>&1 | grep -E "^CONFIG|Duration" | tee "$out/ncu-write-h200.txt"
    hash_find_turns pack now pack now
    timeout 100 python3 benchmarks/host_costs.py 2>&1 | grep -v -e Warning -e _warn_once | tee -a "$out/hash-find-h200.txt"
    ;;
round11d)
    for run in 1 2; do
        for who in prev pack hint rankw; do
            PYTHONPATH=$(site_of $who) timeout 100 python3 .dbg/timeline.py $who
        done
    done 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/timeline-h200.txt"
    hash_find_turns prev pack hint rankw
    ;;
round11e)
    cuda_tests index
    hash_find_turns prev now prev now prev now
    timeout 100 python3 benchmarks/host_costs.py 2>&1 | grep -v -e Warning -e _warn_once | tee -a "$out/hash-find-h200.txt"
    ;;
round11f)
    steps_prev_now prev now 2>&1 | grep -v -e Warning -e sparse_coo | tee "$out/steps-h200.txt"
    ;;
round11g)
    cuda_tests index
    for run in 1 2 3; do timeout 100 "${dyn[@]}" hash-find --device cuda --slots $((1 << 26)); done 2>&1 |
        grep -v -e Warning -e _warn_once | tee "$out/hash-find-h200.txt"
    timeout 100 python3 benchmarks/host_costs.py 2>&1 | grep -v -e Warning -e _warn_once | tee -a "$out/hash-find-h200.txt"
    ;;
round11h)
    dynamic_4m now after after1 now after after1 2>&1 | grep -e "^## " -e dynamic -e "fixed " |
        grep -v -e Warning -e sparse_coo | tee "$out/steps-h200.txt"
    ;;
round12b)
    cuda_tests index
    for who in prev now prev now; do
        echo "## $who"
        PYTHONPATH=$(site_of $who) timeout 120 python3 -P -m dynarec bench hash-find --device cuda --slots $((1 << 26))
    done 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/hash-find-h200.txt"
    for who in prev now; do
        echo "## $who"
        PYTHONPATH=$(site_of $who) timeout 120 python3 benchmarks/profile_insert.py --device cuda \
            --slots $((1 << 26)) --load 0.9 --path fused --rows-shown 12
    done 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/profile-h200.txt"
    ;;
round12c)
    hash_find_turns prev now prev now
    dynamic_4m now prio now prio 2>&1 | grep -e "^## " -e dynamic -e "fixed " | grep -v -e Warning -e sparse_coo |
        tee "$out/steps-h200.txt"
    ;;
round12d)
    cuda_tests index
    hash_find_turns prev now prev now
    ;;
round9d)
    cuda_tests index
    for run in 1 2 3; do
        timeout 100 "${dyn[@]}" hash-find --device cuda --slots $((1 << 26))
    done 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/hash-find-h200.txt"
    ;;
round6c)
    cuda_tests index
    for who in prev now prev now; do
        echo "## $who"
        if [ $who = prev ]; then path=/tmp/site:$PWD/.prev; else path=/tmp/site:$PWD; fi
        PYTHONPATH=$path timeout 120 python3 benchmarks/host_syncs.py --ids 1048576 --new 4096
    done 2>&1 | grep -v -e Warning -e _warn_once | tee "$out/host-syncs-h200.txt"
    ;;
round5b)
    {
        steps_prev_now prev now
        dynamic_4m prev now
    } 2>&1 | grep -v -e Warning -e sparse_coo | tee "$out/steps-h200.txt"
    ;;
demo2)
    {
        mkdir -p /tmp/demo && cp dynarec/resources/demo.yaml /tmp/demo/demo.yaml
        python3 -m dynarec make-data --output-dir /tmp/demo/data
        for n in 2 1; do
            echo "## dynarec train --config demo.yaml --nproc $n --device cuda (data.batch_size 512 per rank)"
            start=$SECONDS
            timeout 240 python3 -m dynarec train --config /tmp/demo/demo.yaml \
                --model-dir /tmp/demo/m$n --nproc $n --device cuda --no-progress | grep -v '^ ' | tail -3
            echo "wall $((SECONDS - start)) s (process start, data checks and final eval included)"
            timeout 60 python3 -m dynarec evaluate --model-dir /tmp/demo/m$n --device cuda
        done
    } 2>&1 | tee "$out/demo-h200x2.txt"
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
