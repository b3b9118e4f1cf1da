"""Lossless speculative decoding: DFlash chain, DDTree tree, and plain AR through one code path.

from flashdraft.decode import generate
result = generate(target, drafter, ids, max_new_tokens=128, method="ddtree", budget=8)
"""

from flashdraft.decode.generate import METHODS, GenerationResult, RoundInfo, Timings, generate
from flashdraft.decode.sampling import SamplingParams, choose_tokens, token_probs

__all__ = [
    "METHODS",
    "GenerationResult",
    "RoundInfo",
    "SamplingParams",
    "Timings",
    "choose_tokens",
    "generate",
    "token_probs",
]
