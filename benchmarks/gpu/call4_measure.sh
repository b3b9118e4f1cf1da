#!/usr/bin/env bash
# Call 4: decode speed and τ of the trained drafter on HumanEval (published wording) on the H200:
# engine AR / chain / DDTree budgets and the transformers baselines in one run (T=0), then T=1
# (SKIP_T1=1 leaves it out; T0_SECONDS / T1_SECONDS bound the two runs).
set -uo pipefail
source benchmarks/gpu/env.sh
D=${DRAFTER:-/root/work/drafter-bf16}
HE=humaneval:/root/stage/HumanEval.jsonl.gz
timeout ${T0_SECONDS:-330} python3 benchmarks/decode_speed.py --target $TARGET --drafter $D --dataset $HE --prompts ${PROMPTS_N:-10} \
  --hf-prompts ${HF_PROMPTS:-3} --max-new-tokens 256 --budgets 8,16,32,64,128,256,512 --out $OUT/decode_speed_t0.json 2>&1 \
  | grep -v "^Convert\|^Loading" | tail -22
[ -z "${SKIP_T1:-}" ] && timeout ${T1_SECONDS:-150} python3 benchmarks/decode_speed.py --target $TARGET --drafter $D --dataset $HE --prompts 6 --skip-hf \
  --temperature 1.0 --max-new-tokens 256 --budgets 8,32,128 --reps 5 --out $OUT/decode_speed_t1.json 2>&1 \
  | grep -v "^Convert\|^Loading" | tail -8
