"""The target's token choice — argmax, or a sample under temperature / top-k / top-p.

One function for every decode path (AR, chain, tree, the eval harness, the fast engine's
reference), so "top-p applied identically to the baseline" holds by construction.

    params = SamplingParams(temperature=0.7, top_p=0.9)
    tokens = choose_tokens(logits, params, generator)    # logits [..., V] -> [...]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature {self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} must be >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p {self.top_p} must be in (0, 1] (1 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sample is drawn from: softmax(logits / T) after top-k and top-p, [..., V].

    float64 logits stay float64 (exactness tests); anything else is computed in float32.
    """
    if params.greedy:
        raise ValueError("token_probs needs temperature > 0 (greedy has no distribution)")
    x = logits.double() if logits.dtype == torch.float64 else logits.float()
    x = x / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)  # [..., V]
        sorted_p = sorted_x.softmax(dim=-1)
        # drop a token when the tokens ranked before it already reach top_p (the first always stays)
        before = sorted_p.cumsum(dim=-1) - sorted_p
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(dim=-1)


def choose_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The target's token at every row of `logits` [..., V] -> LongTensor [...]; no host sync.

    Sampling uses the exponential-race trick (argmax of p / E, E ~ Exp(1)), which draws exactly
    from p, keeps shapes fixed, and takes a generator so runs are reproducible.
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = token_probs(logits, params)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(dim=-1)
