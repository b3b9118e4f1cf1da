#!/usr/bin/env bash
# One staging call per folder that make_carry.py wrote: carry ".stage/K" and run this. It copies the
# folder to /root/stage; once every GGUF part is there it joins them (sha256 checked) and saves the
# dequantized target once as a bf16 HF folder (same weights; loads in ~2 s instead of ~40 s).
# TESTS="tests/data" also runs those GPU tests (on the first call, while the machine is fresh).
set -uo pipefail
mkdir -p /root/stage /tmp/site /root/work
cp .stage/*/* /root/stage/
ls /root/stage/gguf-*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/gguf ] && \
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/stage/gguf-*.whl
source benchmarks/gpu/env.sh
have=$(ls /root/stage/*.gguf.part* 2>/dev/null | wc -l); want=$(cat /root/stage/PARTS 2>/dev/null || echo "?")
echo "staged: $(ls /root/stage | tr '\n' ' '); GGUF parts $have / $want"
if [ "$have" = "$want" ] && [ ! -f /root/work/smollm2-bf16/config.json ]; then
  (cd /root/stage && bash join-parts SmolLM2-135M-Instruct.Q4_1.gguf SmolLM2-135M-Instruct.Q4_1.gguf.part*) || exit 1
  python3 benchmarks/gpu/save_target.py /root/stage/SmolLM2-135M-Instruct.Q4_1.gguf /root/work/smollm2-bf16 bfloat16
  echo "target ready: /root/work/smollm2-bf16"
fi
if [ -n "${TESTS:-}" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  timeout ${TEST_SECONDS:-240} python3 -m pytest -q -rs -m gpu $TESTS -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.log | tail -25
fi
