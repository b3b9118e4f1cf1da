# Sourced by every GPU script: where things live on the CUDA host, the repo on PYTHONPATH, unbuffered logs.
#   STAGE  the staged inputs (make_stage.py's files: GGUF parts, gguf wheel, ShareGPT user turns, HumanEval)
#   WORK   targets, datasets and runs written on the host
#   OUT    what a script hands back: logs, manifests, JSON results, the trained drafter
# All three default under $GPU_DIR ($HOME/flashdraft-gpu); set any of them to put it elsewhere.
GPU_DIR=${GPU_DIR:-$HOME/flashdraft-gpu}
export STAGE=${STAGE:-$GPU_DIR/stage} WORK=${WORK:-$GPU_DIR/work} OUT=${OUT:-$GPU_DIR/out}
mkdir -p "$STAGE" "$WORK" "$OUT"
# the gguf wheel (the GGUF loader's one extra package) is installed under $WORK/site by stage.sh
export PYTHONPATH=$WORK/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TARGET=$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf
# stage.sh saves the dequantized GGUF as a bf16 HF folder (same weights; loads in ~2 s instead of ~40 s)
[ -f "$WORK/smollm2-bf16/config.json" ] && export TARGET=$WORK/smollm2-bf16
fd() { python3 -m flashdraft.cli "$@"; }
