"""Where a speculative output departs from the AR reference, and how close the call was.

A verify pass sums in a different order than a one-token step, so in float32/bf16 an argmax
can flip at a near-tie (DESIGN.md §3). These outputs are reported, not failed: the report
gives the first divergent position and the reference's top-2 logit margin there (a tiny
margin means rounding; a large one means a bug).

    d = find_divergence(target, prompt_ids, ar.tokens, spec.tokens)
    if d: print(d.describe())
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.target import TargetModel


@dataclass
class Divergence:
    position: int  # index into the new tokens of the first difference
    reference_token: int
    token: int
    top2_margin: float  # reference logits at that position: top-1 minus top-2 (teacher-forced, float32)

    def describe(self) -> str:
        return (
            f"diverged at new token {self.position}: reference {self.reference_token}, got {self.token}, "
            f"reference top-2 margin {self.top2_margin:.3g}"
        )


@torch.no_grad()
def find_divergence(
    target: TargetModel, prompt: list[int] | torch.Tensor, reference: list[int], tokens: list[int]
) -> Divergence | None:
    """None when `tokens` agrees with `reference` on their common length."""
    pos = next((i for i, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a != b), None)
    if pos is None:
        return None
    prompt_ids = torch.as_tensor(prompt, dtype=torch.long).flatten().tolist()
    ids = torch.tensor([prompt_ids + list(reference[:pos])], device=target.device)  # [1, n + pos]
    out = target.forward(ids, logits="last")
    assert out.logits is not None
    top2 = out.logits[0, -1].float().topk(2).values  # [2]
    return Divergence(pos, int(reference[pos]), int(tokens[pos]), float(top2[0] - top2[1]))
