#!/usr/bin/env bash
# Call 3: train the default drafter on the regenerated set for TRAIN_MIN minutes (the LR schedule
# follows STEPS; runtime.time_limit_min stops with a checkpoint); the drafter comes back in $OUT.
#   bash benchmarks/gpu/call3_train.sh STEPS        (again in the next call to continue the same run)
#   INIT_FROM=models/smollm2-135m-instruct-dflash-b16 bash benchmarks/gpu/call3_train.sh STEPS   # start from the shipped drafter
set -uo pipefail
source benchmarks/gpu/env.sh
STEPS=${1:?optimizer steps}
T0=$(date +%s)
RUN=${RUN_DIR:-/root/work/run}  # a new RUN_DIR with INIT_FROM=<an earlier checkpoint>/drafter: a second schedule
# telemetry.peak_tflops: the H200's measured dense bf16 ceiling, so metrics.jsonl carries mfu
ARGS="run_dir=$RUN model.target=$TARGET data.dataset=/root/work/data optim.max_steps=$STEPS
  checkpoint.every=${CKPT_EVERY:-200} telemetry.progress=false telemetry.peak_tflops=790 ${INIT_FROM:+model.init_from=$INIT_FROM}
  eval.dataset=humaneval:/root/stage/HumanEval.jsonl.gz ${EXTRA:-}"
# the whole drafter compiled at static shapes (one graph) unless COMPILE says otherwise
COMPILE=${COMPILE:-"runtime.compile=model,loss data.blocks_per_row=${BLOCKS_PER_ROW:-1024}"}
# a second call continues the run of the first (the machine stays warm between back-to-back calls)
R0=""; ls -d $RUN/checkpoints/step-* >/dev/null 2>&1 && R0="--resume"
timeout 560 python3 -m flashdraft.cli train configs/smollm2-b16.yaml $ARGS $COMPILE $R0 runtime.time_limit_min=${TRAIN_MIN:-7.5} \
  2>&1 | grep -v "^Convert\|^Loading" | tail -30
rc=${PIPESTATUS[0]}
left=$(( 540 - ($(date +%s) - T0) ))
if [ "$rc" != "0" ] && [ "$left" -gt 90 ]; then  # fallback: the eager drafter (compiled attention + loss)
  echo "train exited $rc; retrying with runtime.compile=attention,loss for $left s"
  R=""; ls -d $RUN/checkpoints/step-* >/dev/null 2>&1 && R="--resume" || rm -rf $RUN
  timeout $left python3 -m flashdraft.cli train configs/smollm2-b16.yaml $ARGS runtime.compile=attention,loss $R \
    runtime.time_limit_min=$(python3 -c "print(($left - 60) / 60)") 2>&1 | grep -v "^Convert\|^Loading" | tail -20
fi
ck=$(ls -d $RUN/checkpoints/step-* | tail -1)
# files come back at <= 16 MiB each: save the drafter in bf16 (as releases are) and split it
python3 - "$ck/drafter" /root/work/drafter-bf16 <<'PY'
import sys, torch
from flashdraft.drafter import DFlashDrafter
DFlashDrafter.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2], dtype=torch.bfloat16)
PY
mkdir -p $OUT/drafter
cp /root/work/drafter-bf16/config.json $OUT/drafter/
bash benchmarks/gpu/split15.sh /root/work/drafter-bf16/model.safetensors $OUT/drafter
cp $RUN/metrics.jsonl $RUN/config.yaml $RUN/command.txt $OUT/
echo "checkpoint $ck"; ls -la $OUT/drafter
