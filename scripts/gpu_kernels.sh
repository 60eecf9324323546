#!/usr/bin/env bash
# GPU part of the Triton kernel work, in one device call: the gpu-marked kernel tests (bf16, fp8,
# CUDA-graph replay, side stream), then bench/kernels.py (figures for docs/results.md).
# Usage (device tool): bash scripts/gpu_kernels.sh   -> $OUT/tests.log, bench.log, bench.json, tuned.json
# TUNE=1 also sweeps the MoE launch configs; ONLY (moe,mla,indexer) and BATCHES (1,2,...) limit the benchmarks.
# VS_SGLANG=1 also times SGLang's Triton kernels beside ours (bench --vs-sglang) and runs their
# correctness tests; needs .whl-sglang/ (bash scripts/sglang_wheel.sh here, then carry [".whl-sglang"]).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_kernels}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=. HYPOTHESIS_PROFILE=ci
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
status=0
vs=()
tests=(tests/kernels/test_triton_kernels.py)
if [ "${VS_SGLANG:-0}" = 1 ]; then
    vs=(--vs-sglang)
    tests+=(tests/kernels/test_sglang_kernels.py -s)  # -s: its max |diff| lines go to tests.log
fi
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    timeout "${TEST_S:-200}" python3 -m pytest -p no:cacheprovider "${tests[@]}" -q \
        --run-gpu -x ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" || status=1
fi
tune=()
[ "${TUNE:-0}" = 1 ] && tune=(--tune-out "$OUT/tuned.json")
timeout "${BENCH_S:-300}" python3 -m bench.kernels --json "$OUT/bench.json" --only "${ONLY:-moe,mla,indexer}" \
    --batches "${BATCHES:-1,2,4,8,16,32,64,128}" "${tune[@]}" "${vs[@]}" 2>&1 | tee "$OUT/bench.log" || status=1
exit $status
