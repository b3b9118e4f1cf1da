#!/usr/bin/env bash
# The offline τ of two drafters side by side on a GPU (~4.5 min on an H200; ~40 min on a 2-core CPU):
# the three `flashdraft eval` commands of benchmarks/RESULTS.md "The shipped drafter" — HumanEval-48 and
# held-out ShareGPT-40 at T=0 (budgets 8…512, top-8 streak), HumanEval-16 at T=1 — float32 target and
# drafters, references by AR on the fast engine (flashdraft.eval.references). The target is the GGUF
# dequantized to float32 (the weights the CPU evals used; the bf16 copy of env.sh rounds them).
# Then optionally the decode speed of NEW (DECODE=1; give it ≥ 240 s: the transformers baselines are slow;
# decode_speed.py saves its JSON after each stage).
#   OLD=models/smollm2-135m-instruct-dflash-b16 NEW=$WORK/drafter-bf16 bash benchmarks/gpu/call5_eval.sh
# $OUT: evals.tgz (three report folders), eval.log, and decode_speed_t0.json when asked.
set -uo pipefail
source benchmarks/gpu/env.sh
OLD=${OLD:-models/smollm2-135m-instruct-dflash-b16}
NEW=${NEW:-$WORK/drafter-bf16}
HE=humaneval:$STAGE/HumanEval.jsonl.gz
SG=benchmarks/results/h200-2026-12-02-sharegpt-heldout-split  # held-out ShareGPT (hashes to eval: in no training set)
F32=$WORK/smollm2-fp32
[ -f $F32/config.json ] || python3 benchmarks/gpu/save_target.py $STAGE/SmolLM2-135M-Instruct.Q4_1.gguf $F32 float32
E=$WORK/evals; mkdir -p $E
ev() {  # name, then eval flags
  local name=$1; shift
  timeout ${EVAL_TIMEOUT:-200} python3 -m flashdraft.cli eval --target $F32 --drafter $OLD --drafter $NEW --device cuda \
    --dtype float32 --no-progress --out $E/$name "$@" 2>&1 | grep -v "^Convert\|^Loading" | tail -12
}
{
  ev humaneval48 --dataset $HE --limit 48 --max-new-tokens 256 --budgets 8,16,32,64,128,256,512 --topk 8
  ev sharegpt-heldout40 --dataset $SG --limit 40 --max-new-tokens 256 --budgets 8,16,32,64,128,256,512 --topk 8
  ev humaneval16-t1 --dataset $HE --limit 16 --max-new-tokens 256 --temperature 1.0 --budgets 8,32,128,512 --topk 8
} 2>&1 | tee $OUT/eval.log
tar -czf $OUT/evals.tgz -C $WORK evals
if [ -n "${DECODE:-}" ]; then
  timeout ${DECODE_TIMEOUT:-240} python3 benchmarks/decode_speed.py --target $TARGET --drafter $NEW --dataset $HE \
    --prompts ${PROMPTS_N:-5} --hf-prompts ${HF_PROMPTS:-1} --max-new-tokens 256 --budgets 8,16,32,64,128,256,512 \
    --out $OUT/decode_speed_t0.json 2>&1 | grep -v "^Convert\|^Loading" | tail -24
fi
