#!/usr/bin/env bash
# Drafter-step MFU A/B: the reference measurement (SmolLM2-135M bf16 target, 5-layer b16 drafter, synthetic
# 1,024-token documents, 512 anchors, `--compile model,loss --blocks-per-row 1024`) and each lever switched on
# alone, one process per variant (compile state is global), one table at the end:
#   bash benchmarks/gpu/mfu_ab.sh                      # on a CUDA host, from the repo root (sources env.sh)
#   DRY=1 bash benchmarks/gpu/mfu_ab.sh                # CPU dry run: tiny random target, same code paths
#   VARIANTS="base fused all" bash benchmarks/gpu/mfu_ab.sh
# Variants (flags added to the base command line; H200 figures in benchmarks/RESULTS.md "Training throughput"):
#   base      none (log_softmax loss)
#   fused     --fused-ce                     loss: two passes over bf16 logits, no [chunk, V] float32
#   chunk8k   --fused-ce --chunk-tokens 8192 the same, half as many chunks
#   flex128x64 --flex-block 128,64 --compile-mode max-autotune-no-cudagraphs   BlockMask tiles 128 × 64 (fewer
#             partial tiles), matching kernel tiles. On an H200 (sm90, head dim 64) torch's only default
#             backward config has 128-wide tiles, which must divide the mask's: without max-autotune's extra
#             configs the backward has no choice (NoValidChoicesError for 64 × 64, measured 2026-12-03). Long compile.
#   all       fused + chunk8k
#   all1t     all with OMP_NUM_THREADS=1 (one intra-op CPU thread, torchrun's default). On the H200 the slow
#             steps' extra ~60 ms was host time in anchor sampling + build_blocks with torch's 16 threads
#             (host_blocks_ms_per_step 40-180 ms vs 4.5), not GC; one thread removes it
#   all4t     all with OMP_NUM_THREADS=4
#   allht     all + --host-threads 1 (runtime.host_threads's CUDA default: torch.set_num_threads(1) around the
#             steps, as Trainer.run does; all1t's fix in the config instead of the environment)
# Every variant runs with --host-threads 0 (torch's default intra-op threads) unless it sets its own.
# PROFILE_VARIANT (default all) adds `--profile 2`: its top kernels land in the log.
# Outputs: $OUT/mfu_ab.json (every variant's train_throughput JSON), $OUT/mfu_ab.log (every log),
# $OUT/mfu_ab_table.txt ("slow steps": timed steps over 1.3 × the variant's median; "gc ms (max)": the host's
# cyclic-GC pauses inside the drafter-step windows, summed over the timed steps, and the most in one step;
# "threads": torch.get_num_threads() during the steps).
# Wall: at most TOTAL_S (240) — the first variant compiles cold, the others reuse the inductor cache where
# their graph is the same; order = priority (later ones are skipped when time runs out).
set -uo pipefail
[ -f benchmarks/gpu/env.sh ] && [ -z "${DRY:-}" ] && source benchmarks/gpu/env.sh
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
[ -n "${DRY:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
OUT=${OUT:-/tmp/mfu_ab_out}
mkdir -p "$OUT"
TMPD=$(mktemp -d /tmp/mfu_ab.XXXXXX)  # per-variant JSON, log and exit code
VARIANTS=${VARIANTS:-"base fused all allht chunk8k"}
TOTAL_S=${TOTAL_S:-240}              # the whole A/B: a variant gets at most what is left of this ...
VARIANT_TIMEOUT_S=${VARIANT_TIMEOUT_S:-150}  # ... and at most this (the first compiles cold)
MIN_S=${MIN_S:-35}                  # no variant starts with less than this left (a warm-cache run needs ~30 s)

if [ -n "${DRY:-}" ]; then
  # CPU: eager drafter and loss, dense mask (compile and flex apply on CUDA only): checks the plumbing, flags
  # and the table; 16 blocks a row keep the tiny steps short
  BASE=(--device cpu --tiny --steps 2 --warmup-steps 1 --compile model,loss --blocks-per-row 16
        --host-threads 0)
else
  # the bf16 HF copy stage.sh saves (~2 s a load); not env.sh's GGUF fallback (~20-40 s a load, per variant)
  T=${MFU_TARGET:-${WORK:-}/smollm2-bf16}
  if [ ! -e "$T" ] && [ "$T" != random-smollm2 ]; then  # a bare machine: the same shapes, random weights
    echo "note: target $T not found: random-smollm2 (same shapes; MFU depends on shapes, the loss values do not)"
    T=random-smollm2
  fi
  # 15 warm-up steps: after 5 the same code measured 262-319 ms a drafter step on the H200, after 15 146 ms
  BASE=(--target "$T" --steps ${STEPS:-25} --warmup-steps ${WARMUP:-15} --compile model,loss --blocks-per-row 1024
        --host-threads 0)  # a variant's own --host-threads comes later and wins
fi

flags_of() {
  case $1 in
    base) echo "" ;;
    fused) echo "--fused-ce" ;;
    chunk8k) echo "--fused-ce --chunk-tokens 8192" ;;
    flex128x64) echo "--flex-block 128,64 --compile-mode max-autotune-no-cudagraphs" ;;
    all) echo "--fused-ce --chunk-tokens 8192" ;;
    allht) echo "--fused-ce --chunk-tokens 8192 --host-threads 1" ;;
    all1t|all4t) echo "--fused-ce --chunk-tokens 8192" ;;
    *) echo "unknown variant $1" >&2; return 1 ;;
  esac
}

start=$SECONDS
: > "$OUT/mfu_ab.log"
for v in $VARIANTS; do
  flags=$(flags_of "$v") || continue
  left=$(( TOTAL_S - (SECONDS - start) ))
  if (( left < MIN_S )); then
    echo "== $v: skipped (${left} s left of TOTAL_S=${TOTAL_S})" | tee -a "$OUT/mfu_ab.log"
    continue
  fi
  limit=$(( left < VARIANT_TIMEOUT_S ? left : VARIANT_TIMEOUT_S ))
  echo "== $v: ${BASE[*]} $flags" | tee -a "$OUT/mfu_ab.log"
  t0=$SECONDS
  # one variant also prints torch.profiler's top kernels after its timed steps (timings unaffected)
  [ "$v" = "${PROFILE_VARIANT:-all}" ] && [ -z "${DRY:-}" ] && flags="$flags --profile 2"
  # shellcheck disable=SC2086
  envs=(); [ "$v" = all1t ] && envs=(OMP_NUM_THREADS=1); [ "$v" = all4t ] && envs=(OMP_NUM_THREADS=4)
  env "${envs[@]}" timeout "$limit" $PY benchmarks/train_throughput.py "${BASE[@]}" $flags \
    --json "$TMPD/$v.json" > "$TMPD/$v.log" 2>&1
  rc=$?
  echo "$rc" > "$TMPD/$v.rc"
  echo "== $v: exit $rc, $((SECONDS - t0)) s" | tee -a "$OUT/mfu_ab.log"
  cat "$TMPD/$v.log" >> "$OUT/mfu_ab.log"
  [ "$rc" = 0 ] || grep -E "Error|error|Exception" "$TMPD/$v.log" | tail -4
done

$PY - "$TMPD" "$OUT" $VARIANTS <<'EOF'
import json, sys
from pathlib import Path
work, out, variants = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
rows, results = [], {}
for v in variants:
    j, rc = work / f"{v}.json", work / f"{v}.rc"
    if not j.exists():
        status = "skipped" if not rc.exists() else f"failed (exit {rc.read_text().strip()})"
        rows.append(f"| {v} | {status} | | | | | | | | | | |")
        continue
    r = json.loads(j.read_text())
    results[v] = r
    peak = r["peak_memory_gib"]
    per = r.get("drafter_ms_per_step") or []
    third = max(1, len(per) // 3)  # the drift over the timed steps: first third / last third, median ms
    drift = f"{sorted(per[:third])[third // 2]:.1f} / {sorted(per[-third:])[third // 2]:.1f}" if per else "-"
    median = sorted(per)[len(per) // 2] if per else 0.0
    slow = f"{sum(ms > 1.3 * median for ms in per)} / {len(per)}" if per else "-"
    gc_ms = r.get("gc_ms_per_step")  # absent in files from before the GC fields
    gc = f"{sum(gc_ms):.1f} ({max(gc_ms):.1f})" if gc_ms else "-"
    threads = (r.get("host_threads") or {}).get("torch_threads", "-")  # absent before --host-threads
    rows.append(
        f"| {v} | ok | {1e3 * r['drafter_s']:.1f} | {drift} | {slow} | {gc} | {threads} | {1e3 * r['step_s']:.1f} | {100 * r['drafter_mfu']:.2f}% "
        f"| {r['drafter_tflops_per_s']:.1f} | {'%.2f' % peak if peak is not None else '-'} "
        f"| {r['loss_first_step']:.4f} / {r['loss_last_step']:.4f} |"
    )
base = results.get("base")
table = ["| variant | status | drafter step ms | first / last third ms | slow steps | gc ms (max) | threads | full step ms | drafter MFU | TFLOP/s | peak GiB | loss first / last step |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows]
if base:
    table.append("")
    table += [f"{v}: drafter step {r['drafter_s'] / base['drafter_s']:.3f}x base" for v, r in results.items() if v != "base"]
text = "\n".join(table)
print(text)
(out / "mfu_ab_table.txt").write_text(text + "\n")
(out / "mfu_ab.json").write_text(json.dumps(results, indent=2) + "\n")
EOF
echo "total $((SECONDS - start)) s; files in $OUT"
