#!/usr/bin/env bash
# Call 4: τ of the trained drafter (HumanEval, held-out ShareGPT) and decode speed on the H200.
set -uo pipefail
source benchmarks/gpu/env.sh
D=${DRAFTER:-/root/work/run/checkpoints/$(ls /root/work/run/checkpoints | tail -1)/drafter}
timeout 200 python3 benchmarks/decode_speed.py --target $TARGET --drafter $D --out $OUT/decode_speed.json 2>&1 | tail -40
timeout 300 python3 -m flashdraft.cli eval --target $TARGET --drafter $D --dataset humaneval:/root/stage/HumanEval.jsonl.gz --device cuda \
  --max-new-tokens 256 --budgets 8,16,32,64,128,256,512 --out $OUT/eval_humaneval 2>&1 | tail -30
timeout 200 python3 -m flashdraft.cli eval --target $TARGET --drafter $D --dataset /root/work/data --limit 100 --device cuda \
  --max-new-tokens 256 --budgets 8,32,128,512 --out $OUT/eval_sharegpt 2>&1 | tail -20
