#!/usr/bin/env bash
# The decode fast paths in one device call (~6 minutes on an H100 after staging), each part bounded:
#   1. forward_speed.py: the engine's target forward eager vs compiled (AR step, verify, tree phase, kernels,
#      round breakdown), with its token-agreement checks (timed vs rerun vs profiled) and the stale-cache probe;
#   2. `flashdraft bench` with --methods auto beside AR, the chain and fixed DDTree budgets, bf16, batch 1,
#      256 new tokens, τ per budget from a yardstick eval report when TAU_REPORT is given.
#   DRAFTER=models/smollm2-135m-instruct-dflash-b16 TAU_REPORT=<report.json> bash benchmarks/gpu/call6_fast_paths.sh
#   FORWARD_EXTRA=--inductor-deterministic …   # more forward_speed.py flags
#   FORWARD_EXTRA="--variants compiled-drafter,compiled-overlap" BENCH_EXTRA=--compile …   # the compiled engine
# $OUT: forward_speed.json, fast_paths.log, bench/ (bench.json, bench.md).
set -uo pipefail
source benchmarks/gpu/env.sh
DRAFTER=${DRAFTER:-models/smollm2-135m-instruct-dflash-b16}
HE=humaneval:$STAGE/HumanEval.jsonl.gz
{
  timeout "${FORWARD_TIMEOUT:-240}" python3 benchmarks/gpu/forward_speed.py "$TARGET" --drafter "$DRAFTER" \
    --dataset "$HE" --prompts 3 --max-new-tokens 128 --budget 32 --out "$OUT/forward_speed.json" ${FORWARD_EXTRA:-} \
    2>&1 | grep -v "^Convert\|^Loading\|warn"
  tau=()
  [ -n "${TAU_REPORT:-}" ] && tau=(--tau-report "$TAU_REPORT")
  timeout "${BENCH_TIMEOUT:-200}" python3 -m flashdraft.cli bench --target "$TARGET" --drafter "$DRAFTER" \
    --dataset "$HE" --limit "${BENCH_PROMPTS:-8}" --max-new-tokens 256 --device cuda --dtype bfloat16 \
    --methods ar,auto,chain,ddtree:8,ddtree:32,ddtree:128,ddtree:512 "${tau[@]}" ${BENCH_EXTRA:-} --no-progress --out "$OUT/bench" \
    2>&1 | grep -v "^Convert\|^Loading"
} 2>&1 | tee "$OUT/fast_paths.log"
