#!/usr/bin/env bash
# Training-step throughput per runtime.compile setting, one process each (compile state is global),
# same synthetic SmolLM2-shaped batches and anchors (≤ 3 × 320 per row: every anchor fits 1024 blocks) (random weights: no staged target needed), one call:
#   bash benchmarks/gpu/compare_compile.sh          → $OUT/train_compile_<mode>.json + the printed tables
set -uo pipefail
source benchmarks/gpu/env.sh
for mode in "attention" "attention,loss" "model,loss"; do
  bpr=0; [[ $mode == model* ]] && bpr=${BLOCKS_PER_ROW:-1024}
  tag=${mode//,/_}  # file names kept to [A-Za-z0-9._-]
  echo "== runtime.compile=$mode data.blocks_per_row=$bpr"
  timeout ${COMPARE_SECONDS:-200} python3 benchmarks/train_throughput.py --target random-smollm2 \
    --steps ${STEPS:-12} --warmup-steps 3 --queue-depth 2 --max-anchors 320 --compile "$mode" --blocks-per-row $bpr \
    --json $OUT/train_compile_$tag.json > /tmp/compile_$tag.log 2>&1
  echo "exit $?"; grep -E "tokens_per_s|mfu|drafter_s|step_s|peak_memory|padding" /tmp/compile_$tag.log | head -12
  grep -E "Error|error" /tmp/compile_$tag.log | tail -3; cp /tmp/compile_$tag.log $OUT/
done
