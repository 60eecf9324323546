#!/usr/bin/env bash
# One device call on the nvidia-h200-x2 kind (issue 10): TP=2 tests over NCCL and the 80-session
# gate against `runtime.serve --tp 2`. Logs under $OUT. NVLink multicast stays off (KINDS.md).
set -u
OUT=${OUT:-/tmp/gpu_tp_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$(pwd)
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
status=0
echo "=== NCCL startup probe (every rank's stage, timestamped)"
timeout 90 python3 scripts/diag_tp_nccl.py > "$OUT/diag_tp_nccl.log" 2>&1 || status=1
tail -n 20 "$OUT/diag_tp_nccl.log"
echo "=== tp tests"
timeout "${TP_TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider --run-gpu tests/gpu/test_tp_gpu.py -rA -s \
    > "$OUT/tp_tests.log" 2>&1 || status=1
grep -E "passed|failed|PASSED|FAILED|storm:|near-tie|Error" "$OUT/tp_tests.log" | tail -20
echo "=== gate --tp 2"
timeout "${GATE_TIMEOUT:-240}" python3 -m pytest -m stress --sessions 80 -p no:cacheprovider tests/stress/test_canary_gate.py \
    --server-arg=--dtype=float32 --server-arg=--tp=2 --perf-tolerance 0.5 --report-dir "$OUT/gate_tp2" \
    > "$OUT/gate_tp2.log" 2>&1 || status=1
grep -a -E "passed|failed|\[golden\]|\[[a-z-]+\] session|canary:" "$OUT/gate_tp2.log" | head -20 | cut -c1-300
exit $status
