#!/usr/bin/env bash
# Stage the inputs on the CUDA host, from the repository root: copies every folder under .stage/ that
# make_stage.py wrote (all of them at once, or one at a time if they arrive one at a time) to $STAGE; once every
# GGUF part is there it joins them (sha256 checked) and saves the dequantized target once as a bf16 HF folder
# in $WORK (same weights; loads in ~2 s instead of ~40 s). Rerunning it is cheap: finished steps are skipped.
#   bash benchmarks/gpu/stage.sh
#   TESTS="tests/train/test_gpu.py" bash benchmarks/gpu/stage.sh     # also runs those GPU tests → $OUT/gpu_tests.log
set -uo pipefail
source benchmarks/gpu/env.sh
cp "${STAGE_FROM:-.stage}"/*/* "$STAGE"/ 2>/dev/null   # STAGE_FROM: make_stage.py's folder (default .stage)
ls "$STAGE"/gguf-*.whl >/dev/null 2>&1 && [ ! -d "$WORK/site/gguf" ] && \
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$STAGE"/gguf-*.whl
have=$(ls "$STAGE"/*.gguf.part* 2>/dev/null | wc -l); want=$(cat "$STAGE/PARTS" 2>/dev/null || echo "?")
echo "staged: $(ls "$STAGE" | tr '\n' ' '); GGUF parts $have / $want"
G=SmolLM2-135M-Instruct.Q4_1.gguf
if [ "$have" = "$want" ] && [ ! -f "$WORK/smollm2-bf16/config.json" ]; then
  [ -f "$STAGE/$G" ] || bash benchmarks/gpu/parts.sh join "$STAGE/$G" "$STAGE/$G".part* || exit 1
  python3 benchmarks/gpu/save_target.py "$STAGE/$G" "$WORK/smollm2-bf16" bfloat16
  echo "target ready: $WORK/smollm2-bf16"
fi
if [ -n "${TESTS:-}" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  timeout ${TEST_SECONDS:-240} python3 -m pytest -q -rs -m gpu $TESTS -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
