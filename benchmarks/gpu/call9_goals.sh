#!/usr/bin/env bash
# The fast-path goals on a GPU, one part per device call (run from the repository root, after
# stage.sh; each part writes under $OUT and a line per figure to $OUT/goals.log):
#
#   bash benchmarks/gpu/call9_goals.sh train       # flashdraft train on a campaign pack, target pass compiled vs
#                                                  # compiled + replayed as a CUDA graph (runtime.compile's
#                                                  # target_graph), TRAIN_MIN minutes each; needs PACK (a .fdpack)
#   bash benchmarks/gpu/call9_goals.sh eval        # flashdraft eval --device cuda on all 164 HumanEval problems:
#                                                  # EVAL_RUNS (default "computed cached frozen"): references
#                                                  # computed by the batched native engine, then cached, the frozen
#                                                  # exact ones; group-N: frozen, --group N. DRAFTER; → evals.tgz
#                                                  # (EVAL_PROFILE=1: each run under cProfile too)
#   bash benchmarks/gpu/call9_goals.sh bench-he    # flashdraft bench over HumanEval-164 (AR, auto, chain, DDTree
#   bash benchmarks/gpu/call9_goals.sh bench-sg    # 8/32/128/512), or the 100 held-out ShareGPT prompts; needs
#                                                  # DRAFTER and TAU_DIR (its yardstick reports, for auto's τ)
#
# benchmarks/yardstick/compare_references.py reads what `eval` brings back (evals.tgz: the reports and refcache/).
set -uo pipefail
source benchmarks/gpu/env.sh
part=${1:?part: train | eval | bench-he | bench-sg}
DRAFTER=${DRAFTER:-models/smollm2-135m-instruct-dflash-b16}
GGUF=$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf
log() { echo "$*" | tee -a "$OUT/goals.log"; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(now)"; }

summary() {  # a training run's metrics.jsonl: throughput and MFU, median of the logged windows after the first fifth
  python3 - "$1" <<'PY'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "tokens_per_s" in r]
rows = rows[len(rows) // 5:]
med = lambda k: statistics.median(r[k] for r in rows if k in r)
print(f"  {rows[-1]['step']} steps; median of {len(rows)} windows: {med('tokens_per_s'):,.0f} target tok/s, "
      f"MFU {med('mfu'):.1%}, stream idle {med('pipeline/stream_idle_frac'):.1%}, "
      f"host target pass {med('pipeline/host_target_ms'):.1f} ms")
PY
}
eval_seconds() {  # an eval report's own timing: evaluate() after the target loaded, and its parts
  python3 -c 'import json, sys
r = json.load(open(sys.argv[1] + "/report.json"))
parts = (r["seconds"], r["references"]["seconds"], r["teacher_forced_seconds"], sum(v["seconds"] for v in r["drafters"].values()))
print("evaluate %.1f s: references %.1f, teacher-forced %.1f, replay %.1f" % parts)' "$1" 2>&1
}

case $part in
train)
  data=$WORK/pack-data
  [ -d "$data" ] || fd data unpack "${PACK:?PACK: a campaign .fdpack}" --out "$data" || exit 1
  for parts in model,loss,target model,loss,target,target_graph; do
    name=${parts//,/-}
    run=$WORK/train-$name
    t0=$(now)
    timeout $(( ${LIMIT_S:-270} )) python3 -m flashdraft.cli train configs/smollm2-b16.yaml run_dir="$run" \
      model.target="$TARGET" data.dataset="$data" optim.max_steps=1000000 runtime.time_limit_min="${TRAIN_MIN:-2.5}" \
      runtime.fit_steps_to_time_limit=true checkpoint.every=1000000 telemetry.progress=false telemetry.peak_tflops=790 \
      runtime.feature_pass=native runtime.compile="$parts" data.blocks_per_row=1024 pipeline.inline_ahead=1 \
      eval.every=0 > "$OUT/train-$name.log" 2>&1
    log "train $parts: exit $? after $(since "$t0") s"
    mkdir -p "$OUT/train-$name"
    cp "$run"/metrics.jsonl "$run"/config.yaml "$OUT/train-$name/" 2>/dev/null
    summary "$run/metrics.jsonl" | tee -a "$OUT/goals.log"
  done
  ;;
eval)
  [ -f "$WORK/smollm2-fp32/config.json" ] || python3 benchmarks/gpu/save_target.py "$GGUF" "$WORK/smollm2-fp32" float32
  common=(--target "$WORK/smollm2-fp32" --drafter "$DRAFTER" --limit 164 --max-new-tokens 256
          --budgets 8,16,32,64,128,256,512 --topk 8 --device cuda --dtype float32 --no-progress)
  evals=$WORK/evals
  rm -rf "$evals" "$WORK/refcache"  # this script's own folders: the first run computes every reference
  for run in ${EVAL_RUNS:-computed cached frozen}; do
    case $run in
    computed | cached) src=(--dataset "humaneval:$STAGE/HumanEval.jsonl.gz" --cache-dir "$WORK/refcache") ;;
    frozen) src=(--references benchmarks/yardstick/humaneval-164.jsonl) ;;
    group-*) src=(--references benchmarks/yardstick/humaneval-164.jsonl --group "${run#group-}") ;;
    esac
    prof=()  # EVAL_PROFILE=1: the host's profile of each run (where the replay's seconds go), its top in RUN.prof.txt
    [ -n "${EVAL_PROFILE:-}" ] && prof=(-m cProfile -o "$evals-$run.prof")
    t0=$(now)
    python3 "${prof[@]}" -m flashdraft.cli eval "${common[@]}" "${src[@]}" --out "$evals/$run" > "$evals-$run.log" 2>&1
    log "eval $run: exit $? after $(since "$t0") s (the process, target load included); $(eval_seconds "$evals/$run")"
    [ -f "$evals-$run.prof" ] && python3 -c 'import pstats, sys
pstats.Stats(sys.argv[1]).sort_stats("tottime").print_stats(30)' "$evals-$run.prof" > "$evals-$run.prof.txt" 2>&1
  done
  mv "$evals"-*.log "$evals"-*.prof* "$evals"/ 2>/dev/null
  tar czf "$OUT/evals.tgz" -C "$WORK" evals $(cd "$WORK" && ls -d refcache 2>/dev/null)  # one file: a call brings back a limited number
  ;;
bench-he | bench-sg)
  if [ "$part" = bench-he ]; then set=humaneval-164; else set=sharegpt-heldout-100; fi
  limit=${set##*-}
  t0=$(now)
  timeout "${LIMIT_S:-560}" python3 -m flashdraft.cli bench --target "$TARGET" --drafter "$DRAFTER" \
    --dataset "benchmarks/yardstick/$set.jsonl" --limit "$limit" --max-new-tokens 256 --device cuda --dtype bfloat16 \
    --methods "${METHODS:-ar,auto,chain,ddtree:8,ddtree:32,ddtree:128,ddtree:512}" \
    --tau-report "${TAU_DIR:?TAU_DIR: the yardstick folder of the drafter}/$set/report.json" --graph-prefill --no-progress \
    --out "$OUT/$part" > "$OUT/$part.log" 2>&1
  log "$part: exit $? after $(since "$t0") s"
  tail -20 "$OUT/$part.log"
  ;;
*)
  echo "call9_goals: unknown part $part" >&2
  exit 2
  ;;
esac
