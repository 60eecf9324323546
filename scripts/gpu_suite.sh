#!/usr/bin/env bash
# One device call: every GPU test and benchmark of the suite, logs under $OUT.
# Sections may be appended by other issues; each runs under its own timeout so one hang cannot eat
# the whole call, and a failing section does not stop the next (the exit status is the worst one).
set -u
OUT=${OUT:-/tmp/gpu_suite_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Deterministic cuBLAS (also across streams): graph-vs-eager comparisons are bit for bit.
export CUBLAS_WORKSPACE_CONFIG=:4096:8
PY=${PY:-python}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
status=0
section() {  # section NAME TIMEOUT_S COMMAND...
    local name=$1 limit=$2; shift 2
    echo "=== $name ($(date +%T))"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc"; tail -n 15 "$OUT/$name.log"
    [ $rc -ne 0 ] && status=$rc
    return 0
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null

# ---- issue 7: CUDA-graph runner, multi-stream, eager-vs-graph equivalence
section graph_tests "${GRAPH_TEST_TIMEOUT:-150}" $PY -m pytest -q -p no:cacheprovider --run-gpu \
    tests/kernels/test_graph_gpu.py tests/kernels/test_graph_static.py
section bench_decode_canary "${BENCH_TIMEOUT:-90}" $PY bench/decode_step.py --model canary \
    --sawtooth 1,16,17,32,33,48,49,64,65,96,97,128 --out "$OUT/decode_canary.json"
section bench_decode_slice "${BENCH_TIMEOUT:-90}" $PY bench/decode_step.py --model dsv4-slice \
    --batch-sizes 1,8,16,32,64,128 --iters 10 --out "$OUT/decode_slice.json"
exit $status
