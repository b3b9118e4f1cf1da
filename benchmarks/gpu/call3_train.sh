#!/usr/bin/env bash
# Call 3: train the default drafter on the regenerated set; the drafter comes back in $OUT.
#   bash benchmarks/gpu/call3_train.sh STEPS
set -uo pipefail
source benchmarks/gpu/env.sh
STEPS=${1:?optimizer steps}
timeout ${TRAIN_SECONDS:-540} python3 -m flashdraft.cli train configs/smollm2-b16.yaml run_dir=/root/work/run \
  model.target=$TARGET data.dataset=/root/work/data optim.max_steps=$STEPS checkpoint.every=${CKPT_EVERY:-200} \
  telemetry.progress=false 2>&1 | tail -40
ck=$(ls -d /root/work/run/checkpoints/step-* | tail -1)
# files come back at <= 16 MiB each: save the drafter in bf16 (as releases are) and split it
python3 - "$ck/drafter" /root/work/drafter-bf16 <<'PY'
import sys, torch
from flashdraft.drafter import DFlashDrafter
DFlashDrafter.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2], dtype=torch.bfloat16)
PY
mkdir -p $OUT/drafter
cp /root/work/drafter-bf16/config.json $OUT/drafter/
bash benchmarks/gpu/split15.sh /root/work/drafter-bf16/model.safetensors $OUT/drafter
cp /root/work/run/metrics.jsonl /root/work/run/config.yaml $OUT/
ls -la $OUT/drafter
