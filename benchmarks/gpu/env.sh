# sourced by every call: wheels carried in call 1, the repo on PYTHONPATH, unbuffered logs
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TARGET=/root/stage/SmolLM2-135M-Instruct.Q4_1.gguf
# call 2 saves the dequantized GGUF as a bf16 HF folder (same weights; loads in ~2 s instead of ~40 s)
[ -f /root/work/smollm2-bf16/config.json ] && export TARGET=/root/work/smollm2-bf16
fd() { python3 -m flashdraft.cli "$@"; }
