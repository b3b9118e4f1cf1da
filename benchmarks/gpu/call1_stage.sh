#!/usr/bin/env bash
# Call 1: stage GGUF part A and the gguf wheel; run the GPU-only tests while the machine is fresh.
set -uo pipefail
mkdir -p /root/stage /tmp/site
cp .stage/a/* /root/stage/
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/stage/gguf-*.whl
source benchmarks/gpu/env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout ${TEST_SECONDS:-240} python3 -m pytest -q -m gpu ${TESTS:-tests/train tests/decode tests/data} -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.log | tail -25
