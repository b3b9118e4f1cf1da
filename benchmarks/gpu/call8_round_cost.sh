#!/usr/bin/env bash
# Where a decoding round's time goes, at the cache size `flashdraft bench` and `generate` use, in one device call
# (~6-7 min on an H100 after staging), each part bounded by a timeout:
#   1. benchmarks/gqa_attention.py: one attention call, the cache copied per query head vs the query groups folded
#      (the engine's attention since 2026-12-07), bf16, 384 and 2,048 cache slots;
#   2. benchmarks/engine_spans.py: rounds of CUDA-graph engines for max_len 400 and 2,048, attending over their
#      spans and over the whole cache (bf16, 2 HumanEval prompts x 64 tokens);
#   3. forward_speed.py (eager target, and target + drafting step compiled, both over spans) at
#      bench's cache size (--max-len 2048 --max-budget 512): phases, timed rounds, tokens/s;
#   4. `flashdraft bench` AR, chain, DDTree-32 with the engine `fast` and `fast-compiled`, 8 HumanEval problems x 256
#      tokens: tokens/s with each method's prefill, round and other milliseconds.
#   DRAFTER=$WORK/stint-K/drafter-bf16 bash benchmarks/gpu/call8_round_cost.sh
# $OUT: gqa_attention.json, engine_spans.json, forward_speed_bench.json, bench_fast/, bench_compiled/,
# round_cost.log.
set -uo pipefail
source benchmarks/gpu/env.sh
DRAFTER=${DRAFTER:-models/smollm2-135m-instruct-dflash-b16}
HE=humaneval:$STAGE/HumanEval.jsonl.gz
quiet() { grep -v "^Convert\|^Loading\|warn"; }
{
  timeout 30 python3 benchmarks/gqa_attention.py --device cuda --dtypes bfloat16 --queries 1,16,33,129 \
    --out "$OUT/gqa_attention.json" 2>&1 | quiet
  timeout "${SPANS_TIMEOUT:-150}" python3 benchmarks/engine_spans.py --target "$TARGET" --drafter "$DRAFTER" \
    --dataset "$HE" --device cuda --dtype bfloat16 --out "$OUT/engine_spans.json" 2>&1 | quiet
  timeout "${FORWARD_TIMEOUT:-180}" python3 benchmarks/gpu/forward_speed.py "$TARGET" --drafter "$DRAFTER" \
    --dataset "$HE" --prompts 3 --max-new-tokens 128 --budget 32 --variants eager,compiled-drafter \
    --max-len 2048 --max-budget 512 --out "$OUT/forward_speed_bench.json" 2>&1 | quiet
  for engine in fast compiled; do
    flag=()
    [ "$engine" = compiled ] && flag=(--compile)
    limit=${BENCH_TIMEOUT:-80}
    [ "$engine" = compiled ] && limit=${BENCH_COMPILED_TIMEOUT:-240}  # a compilation per phase first (110 s: too few)
    timeout "$limit" python3 -m flashdraft.cli bench --target "$TARGET" --drafter "$DRAFTER" \
      --dataset "$HE" --limit 8 --max-new-tokens 256 --device cuda --dtype bfloat16 --methods ar,chain,ddtree:32 \
      "${flag[@]}" --no-progress --out "$OUT/bench_$engine" 2>&1 | quiet
  done
} 2>&1 | tee "$OUT/round_cost.log"
