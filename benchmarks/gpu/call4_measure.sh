#!/usr/bin/env bash
# Decode speed and τ of a trained drafter (DRAFTER, default $WORK/drafter-bf16) on HumanEval (published wording):
# engine AR / chain / DDTree budgets and the transformers baselines in one run (T=0), then T=1
# (SKIP_T1=1 leaves it out; T0_SECONDS / T1_SECONDS bound the two runs).
set -uo pipefail
source benchmarks/gpu/env.sh
D=${DRAFTER:-$WORK/drafter-bf16}
HE=humaneval:$STAGE/HumanEval.jsonl.gz
timeout ${T0_SECONDS:-330} python3 benchmarks/decode_speed.py --target $TARGET --drafter $D --dataset $HE --prompts ${PROMPTS_N:-10} \
  --hf-prompts ${HF_PROMPTS:-3} --max-new-tokens 256 --budgets 8,16,32,64,128,256,512 --out $OUT/decode_speed_t0.json 2>&1 \
  | grep -v "^Convert\|^Loading" | tail -22
[ -z "${SKIP_T1:-}" ] && timeout ${T1_SECONDS:-150} python3 benchmarks/decode_speed.py --target $TARGET --drafter $D --dataset $HE --prompts 6 --skip-hf \
  --temperature 1.0 --max-new-tokens 256 --budgets 8,32,128 --reps 5 --out $OUT/decode_speed_t1.json 2>&1 \
  | grep -v "^Convert\|^Loading" | tail -8
