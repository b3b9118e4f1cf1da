#!/usr/bin/env bash
# After stage.sh: regeneration throughput (native engine vs plain transformers generate, same prompts, same
# run), then regenerate the ShareGPT training set into $WORK/data for REGEN_MIN minutes.
# REGEN_BATCH rows decode together; REGEN_TOKENS bounds rows × (3072 + 512) cache tokens (~23 KB each).
# MAX_TURNS=1 answers only each conversation's first user turn (the most distinct prompts per minute).
# TEMPERATURE=0.8 SEED=1 samples the answers instead (ids get "@T0.8s1": `flashdraft data merge` keeps them
# beside the greedy set's answers to the same prompts — more distinct training tokens from the same prompts).
# DATA_BACK=1 also puts the train split in $OUT (a tar in 15 MiB parts, at most 4 of them) so that it can be
# kept off the host and brought back later instead of regenerated.
#   SKIP_BENCH=1 MAX_TURNS=1 REGEN_MIN=3.6 SHARD=2048 bash benchmarks/gpu/call2_data.sh
set -uo pipefail
source benchmarks/gpu/env.sh
echo "target: $TARGET"
PROMPTS=sharegpt:$STAGE/sharegpt_compact.json.gz
[ -z "${SKIP_BENCH:-}" ] && timeout 150 python3 benchmarks/regen_throughput.py --target $TARGET --input $PROMPTS --n ${BENCH_N:-512} \
  --batch-size 512 --max-new-tokens 256 --methods flashdraft-native,transformers-generate \
  --out $OUT/regen_throughput.json 2>&1 | grep -v "^Convert\|^Loading" | tail -8
timeout ${REGEN_TIMEOUT:-480} python3 -m flashdraft.cli data regenerate --target $TARGET --input $PROMPTS \
  --out $WORK/data --device cuda --dtype bfloat16 --engine native --batch-size ${REGEN_BATCH:-512} \
  --max-batch-tokens ${REGEN_TOKENS:-2500000} --max-new-tokens 512 --shard-size ${SHARD:-4096} ${MAX_TURNS:+--max-turns $MAX_TURNS} --time-limit ${REGEN_MIN:-3.5} \
  --temperature ${TEMPERATURE:-0} --seed ${SEED:-0} \
  --contamination humaneval:$STAGE/HumanEval.jsonl.gz 2>&1 | tr '\r' '\n' | grep -v "skipped bad" > $WORK/regen.log
grep -v "regenerate:" $WORK/regen.log | tail -6; grep "regenerate:" $WORK/regen.log | awk 'NR % 50 == 0' | tail -4
cp $WORK/regen.log $OUT/
cp $WORK/data/manifest.json $OUT/ && mkdir -p $OUT/data_eval && cp -r $WORK/data/eval $OUT/data_eval/ \
  && cp $WORK/data/manifest.json $OUT/data_eval/
du -sh $WORK/data
if [ -n "${DATA_BACK:-}" ]; then
  tar -C $WORK -cf $WORK/data-train.tar data/manifest.json data/train
  ls -la $WORK/data-train.tar
  mkdir -p $OUT/data_train && bash benchmarks/gpu/parts.sh split $WORK/data-train.tar $OUT/data_train 15
  n=$(ls $OUT/data_train/*.part* | wc -l)
  if [ "$n" -gt 4 ]; then echo "train split is $n parts (> 4): not put in \$OUT"; rm -rf $OUT/data_train; fi
fi
