#!/usr/bin/env bash
# Train the default drafter on the regenerated set ($WORK/data) for TRAIN_MIN minutes (the LR schedule
# follows STEPS; runtime.time_limit_min stops with a checkpoint); the drafter lands in $OUT/drafter (bf16,
# in 15 MiB parts: join with parts.sh), with the run's metrics.jsonl, config.yaml and command.txt.
#   bash benchmarks/gpu/call3_train.sh STEPS        (run it again to continue the same run)
#   INIT_FROM=models/smollm2-135m-instruct-dflash-b16 bash benchmarks/gpu/call3_train.sh STEPS   # start from the shipped drafter
set -uo pipefail
source benchmarks/gpu/env.sh
STEPS=${1:?optimizer steps}
T0=$(date +%s)
LIMIT_S=${LIMIT_S:-560}  # wall-clock bound of the whole script (the training, a fallback and the bf16 save)
RUN=${RUN_DIR:-$WORK/run}  # a new RUN_DIR with INIT_FROM=<an earlier checkpoint>/drafter: a second schedule
# telemetry.peak_tflops: the H200's measured dense bf16 ceiling, so metrics.jsonl carries mfu
ARGS="run_dir=$RUN model.target=$TARGET data.dataset=${DATA:-$WORK/data} optim.max_steps=$STEPS
  checkpoint.every=${CKPT_EVERY:-200} telemetry.progress=false telemetry.peak_tflops=790 ${INIT_FROM:+model.init_from=$INIT_FROM}
  eval.dataset=humaneval:$STAGE/HumanEval.jsonl.gz ${EXTRA:-}"
# the whole drafter compiled at static shapes (one graph) unless COMPILE says otherwise
COMPILE=${COMPILE:-"runtime.compile=model,loss data.blocks_per_row=${BLOCKS_PER_ROW:-1024}"}
# a second invocation continues the run of the first
R0=""; ls -d $RUN/checkpoints/step-* >/dev/null 2>&1 && R0="--resume"
timeout $LIMIT_S python3 -m flashdraft.cli train configs/smollm2-b16.yaml $ARGS $COMPILE $R0 runtime.time_limit_min=${TRAIN_MIN:-7.5} \
  2>&1 | grep -v "^Convert\|^Loading" | tail -30
rc=${PIPESTATUS[0]}
left=$(( LIMIT_S - 20 - ($(date +%s) - T0) ))
if [ "$rc" != "0" ] && [ "$left" -gt 90 ]; then  # fallback: the eager drafter (compiled attention + loss)
  echo "train exited $rc; retrying with runtime.compile=attention,loss for $left s"
  R=""; ls -d $RUN/checkpoints/step-* >/dev/null 2>&1 && R="--resume" || rm -rf $RUN
  timeout $left python3 -m flashdraft.cli train configs/smollm2-b16.yaml $ARGS runtime.compile=attention,loss $R \
    runtime.time_limit_min=$(python3 -c "print(($left - 60) / 60)") 2>&1 | grep -v "^Convert\|^Loading" | tail -20
fi
ck=$(ls -d $RUN/checkpoints/step-* | tail -1)
# save the drafter in bf16 (as releases are) and split it into 15 MiB parts (SPLIT_MIB) for size-limited channels
python3 - "$ck/drafter" $WORK/drafter-bf16 <<'PY'
import sys, torch
from flashdraft.drafter import DFlashDrafter
DFlashDrafter.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2], dtype=torch.bfloat16)
PY
mkdir -p $OUT/drafter
cp $WORK/drafter-bf16/config.json $OUT/drafter/
bash benchmarks/gpu/parts.sh split $WORK/drafter-bf16/model.safetensors $OUT/drafter ${SPLIT_MIB:-15}
cp $RUN/metrics.jsonl $RUN/config.yaml $RUN/command.txt $OUT/
echo "checkpoint $ck"; ls -la $OUT/drafter
