#!/usr/bin/env bash
# Train the canary model (golden/models/canary-moe-v1) on one lent GPU.
# Usage (device tool): bash scripts/gpu_train_canary.sh   -> writes the model dir into $OUT.
# BUDGET_S bounds the training loop's wall time; the LR schedule and the dense->sparse switch
# follow progress through that budget, so a slower GPU trains fewer steps but a complete schedule.
set -euo pipefail
OUT=${OUT:-/tmp/canary-moe-v1}
BUDGET_S=${BUDGET_S:-330}
WORKERS=${WORKERS:-$(( $(nproc) - 2 ))}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
python3 -m runtime.train --out "$OUT" --preset canary --device cuda --workers "$WORKERS" \
    --time-budget-s "$BUDGET_S" 2>&1 | tee "$OUT/train_stdout.log"
ls -la "$OUT"
