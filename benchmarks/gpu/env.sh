# sourced by every call: wheels carried in call 1, the repo on PYTHONPATH, unbuffered logs
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TARGET=/root/stage/SmolLM2-135M-Instruct.Q4_1.gguf
fd() { python3 -m flashdraft.cli "$@"; }
