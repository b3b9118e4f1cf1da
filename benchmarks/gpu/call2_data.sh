#!/usr/bin/env bash
# Call 2: join the GGUF, measure regeneration and training throughput, regenerate the training set.
set -uo pipefail
cp .stage/b/* /root/stage/
(cd /root/stage && bash join-parts SmolLM2-135M-Instruct.Q4_1.gguf SmolLM2-135M-Instruct.Q4_1.gguf.part*) || exit 1
source benchmarks/gpu/env.sh
PROMPTS=sharegpt:.stage/b/sharegpt_compact.json.gz
timeout 100 python3 benchmarks/train_throughput.py --target $TARGET --steps 30 --queue-depth 2 \
  --json $OUT/train_throughput.json 2>&1 | tail -25
timeout 150 python3 benchmarks/regen_throughput.py --target $TARGET --input $PROMPTS --n 2048 --batch-size 1024 \
  --max-new-tokens 256 --methods flashdraft-loop,transformers-generate --out $OUT/regen_throughput.json 2>&1 | tail -12
timeout ${REGEN_SECONDS:-420} python3 -m flashdraft.cli data regenerate --target $TARGET --input $PROMPTS \
  --out /root/work/data --device cuda --dtype bfloat16 --batch-size 1024 --max-new-tokens 384 \
  --limit ${REGEN_LIMIT:-2048} --shard-size 1024 --seed 0 2>&1 | tr '\r' '\n' | tee $OUT/regen.log | tail -15
cp /root/work/data/manifest.json $OUT/ 2>/dev/null || ls /root/work/data.partial | tail -3
