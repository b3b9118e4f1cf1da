"""Random-weight targets with real shapes, for speed measurements that need no model files
(speed depends on shapes, not on weights): `random_target("random-smollm2", device, dtype)`."""

from __future__ import annotations

import torch

from flashdraft.target import TargetModel

SHAPES = {
    # SmolLM2-135M-Instruct: the default target
    "random-smollm2": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # a tiny Llama for CPU smoke runs of the benchmark code paths
    "random-tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
}  # fmt: skip


def random_target(
    name: str, device: torch.device | str, dtype: torch.dtype, layers: int | None = None
) -> TargetModel:
    """`name`'s shape with random weights; `layers`: that many decoder layers instead of the shape's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**SHAPES[name], **({"num_hidden_layers": layers} if layers else {})})
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    return TargetModel(model, None, name=f"{name} (random weights)")
