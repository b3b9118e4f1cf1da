"""Save the GGUF target dequantized as a plain HF folder (same weights; loads in ~2 s instead of ~40 s).

    python3 benchmarks/gpu/save_target.py GGUF OUT_DIR bfloat16|float32

stage.sh saves the bf16 copy the GPU scripts run; call5_eval.sh a float32 one (the weights the CPU evals use:
bf16 rounds the dequantized Q4_1 values).
"""

import sys

import torch

from flashdraft.target import load_target

gguf, out, dtype = sys.argv[1:4]
t = load_target(gguf, dtype=getattr(torch, dtype), device="cpu")
# the GGUF weights are already dequantized into plain Linear layers; only the quantizer tag blocks saving
t.model.hf_quantizer, t.model.is_quantized = None, False
if hasattr(t.model.config, "quantization_config"):
    del t.model.config.quantization_config
t.model.save_pretrained(out)
t.tokenizer.save_pretrained(out)
