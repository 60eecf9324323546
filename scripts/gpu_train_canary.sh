#!/usr/bin/env bash
# Train the canary model (golden/models/canary-moe-v2) on one lent GPU.
# Usage (device tool): bash scripts/gpu_train_canary.sh   -> writes the model dir into $OUT.
# BUDGET_S bounds the training loop's wall time; the LR schedule and the dense->sparse switch
# follow progress through that budget, so a slower GPU trains fewer steps but a complete schedule.
# TRAIN_ARGS: more `python -m runtime.train` arguments, e.g. a continued run that must fit one device
# call: TRAIN_ARGS="--init golden/models/canary-moe-v2 --seed 1 --dense-fraction 0 --lr 8e-4".
set -euo pipefail
OUT=${OUT:-/tmp/canary-moe-v2}
BUDGET_S=${BUDGET_S:-330}
WORKERS=${WORKERS:-$(( $(nproc) - 2 ))}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
python3 -m runtime.train --out "$OUT" --preset canary --device cuda --workers "$WORKERS" \
    --time-budget-s "$BUDGET_S" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train_stdout.log"
ls -la "$OUT"
