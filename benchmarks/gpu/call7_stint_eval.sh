#!/usr/bin/env bash
# A campaign stint's measurements in one device call (~5 min on an H100), each part bounded by a timeout:
#   1. the frozen yardstick (benchmarks/yardstick/, T = 0, float32, chain + DDTree 8…512 + top-8 streak): the shipped
#      drafter and NEW side by side, HumanEval-164 then held-out ShareGPT-100 (82 s + 61 s on an H100, 2026-12-06);
#   2. HumanEval at T = 1 (the first T1_LIMIT=32 problems, seeded sampled references computed in one batch; all 164
#      did not finish in 120 s on an H100, 2026-12-06), DDTree-32 and -512;
#   3. `flashdraft bench`: AR, auto, the chain and DDTree budgets, bf16, batch 1, 256 new tokens, BENCH_PROMPTS=24
#      HumanEval problems (8 until stint 7, whose bench spent ~12 of its 116 s timing them: the rest is start-up,
#      so three times the prompts cost ~25 s; on 8 the best budget moved between stints 6 and 7 by bf16 near-ties),
#      NEW's τ per budget from step 1's report (the entry of NEW's weights);
#      REUSE=<a folder of earlier yardstick reports, FOLDER/NAME/report.json> takes the shipped drafter's results
#      from there when its weights, the settings and the references are the same (`flashdraft eval --reuse`):
#      REUSE=benchmarks/results/campaign/stint-4/yardstick after stint 4's drafter was shipped;
#   T1_LIMIT=0 or BENCH_PROMPTS=0 leaves step 2 or 3 out (a call that trains first has room for step 1 only);
#   BENCH_EXTRA=--compile benches the engine with its forwards compiled (`fast-compiled`), BENCH_EXTRA=--graph-prefill
#   with each prompt's prefill replayed as a CUDA graph (`fast-graph-prefill`); BENCH_SHAREGPT=N benches
#   the first N held-out ShareGPT yardstick prompts too (bench/sharegpt/);
#   4. with WALKS=N: benchmarks/eval_tree_walks.py on the first N HumanEval yardstick problems (the replay's DDTree
#      walks popped to the largest budget at every start vs only as far as asked, in one run).
# The target is the GGUF dequantized to float32 for 1–2 (save_target.py, once per machine), bf16 for 3.
#   NEW=$WORK/stint-K/drafter-bf16 bash benchmarks/gpu/call7_stint_eval.sh
# $OUT/stint_eval.tar (evals/{humaneval-164,sharegpt-heldout-100,humaneval-164-t1}/report.{json,md}, bench/) and
# $OUT/stint_eval.log. At home: tar -xf stint_eval.tar, then campaign_ingest.py FOLDER --report
# evals/humaneval-164/report.json --report evals/sharegpt-heldout-100/report.json --report-drafter <NEW's folder name>.
set -uo pipefail
source benchmarks/gpu/env.sh
OLD=${OLD:-models/smollm2-135m-instruct-dflash-b16}
NEW=${NEW:?NEW=<the stint drafter folder>}
# the shipped drafter before anything runs: a tree slimmed without models/ (slim_tree.sh aside DIR models yardstick)
[ -f "$OLD/config.json" ] || { echo "call7: no drafter at $OLD (slim_tree.sh aside DIR models ...?)" >&2; exit 2; }
HE=humaneval:$STAGE/HumanEval.jsonl.gz
F32=$WORK/smollm2-fp32
[ -f $F32/config.json ] || python3 benchmarks/gpu/save_target.py $STAGE/SmolLM2-135M-Instruct.Q4_1.gguf $F32 float32 \
  >/dev/null 2>&1
E=$OUT/evals
ev() {  # name, timeout, then eval flags
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" python3 -m flashdraft.cli eval --target $F32 --drafter $OLD --drafter $NEW --device cuda \
    --dtype float32 --no-progress --out $E/$name "$@" 2>&1 | grep -v "^Convert\|^Loading" | tail -14
  echo "[$name: $((SECONDS - t0)) s]"
}
{
  for f in humaneval-164 sharegpt-heldout-100; do
    reuse=()
    [ -n "${REUSE:-}" ] && [ -f "$REUSE/$f/report.json" ] && reuse=(--reuse "$REUSE/$f/report.json")
    ev $f "${YARDSTICK_TIMEOUT:-150}" --references benchmarks/yardstick/$f.jsonl "${reuse[@]}"
  done
  [ "${T1_LIMIT:-32}" != 0 ] && ev humaneval-164-t1 "${T1_TIMEOUT:-120}" --dataset $HE --limit "${T1_LIMIT:-32}" \
    --temperature 1.0 --budgets 32,512 --topk 8
  if [ "${BENCH_PROMPTS:-24}" != 0 ]; then
    t0=$SECONDS
    timeout "${BENCH_TIMEOUT:-210}" python3 -m flashdraft.cli bench --target "$TARGET" --drafter $NEW --dataset $HE \
      --limit "${BENCH_PROMPTS:-24}" --max-new-tokens 256 --device cuda --dtype bfloat16 \
      --methods ar,auto,chain,ddtree:8,ddtree:32,ddtree:128,ddtree:512 --tau-report $E/humaneval-164/report.json ${BENCH_EXTRA:-} \
      --no-progress --out $OUT/bench 2>&1 | grep -v "^Convert\|^Loading"
    echo "[bench: $((SECONDS - t0)) s]"
  fi
  if [ "${BENCH_SHAREGPT:-0}" != 0 ]; then  # the same on the first N held-out ShareGPT yardstick prompts
    t0=$SECONDS
    timeout "${BENCH_TIMEOUT:-210}" python3 -m flashdraft.cli bench --target "$TARGET" --drafter $NEW \
      --dataset benchmarks/yardstick/sharegpt-heldout-100.jsonl --limit "$BENCH_SHAREGPT" --max-new-tokens 256 \
      --device cuda --dtype bfloat16 --methods ar,auto,chain,ddtree:8,ddtree:32,ddtree:128,ddtree:512 \
      --tau-report $E/sharegpt-heldout-100/report.json ${BENCH_EXTRA:-} --no-progress --out $OUT/bench/sharegpt \
      2>&1 | grep -v "^Convert\|^Loading"
    echo "[bench sharegpt: $((SECONDS - t0)) s]"
  fi
  if [ -n "${WALKS:-}" ]; then  # the replay's DDTree walks both ways, NEW on the first WALKS HumanEval problems
    t0=$SECONDS
    timeout "${WALKS_TIMEOUT:-240}" python3 benchmarks/eval_tree_walks.py --target $F32 --drafter $NEW \
      --limit "$WALKS" --device cuda 2>&1 | grep -v "^Convert\|^Loading"
    echo "[walks: $((SECONDS - t0)) s]"
  fi
} 2>&1 | tee $OUT/stint_eval.log
# a device call sends back at most 8 files: the reports travel as one tar (the plots stay behind)
mkdir -p $E $OUT/bench
rm -f $E/*/*.png
tar -C $OUT -cf $OUT/stint_eval.tar evals bench && rm -rf $E $OUT/bench
