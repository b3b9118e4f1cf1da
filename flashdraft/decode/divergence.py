"""Where a speculative output departs from the AR reference, and how close the call was.

A verify pass sums in a different order than a one-token step, so in float32/bf16 an argmax
can flip at a near-tie (docs/method.md §8.3). These outputs are reported, not failed: the report
gives the first divergent position and the reference's top-2 logit margin there (a tiny
margin means rounding; a large one means a bug).

    d = find_divergence(target, prompt_ids, ar.tokens, spec.tokens)
    if d: print(d.describe())
    d = find_divergence(target, prompt_ids, ar, out, next_logits=engine_next_logits(engine))  # the engine's forward

The margin is read from the transformers forward by default; `next_logits` takes another forward of the same
target (the fast engine's static-cache one, whose kernels produced the tokens: benchmarks/decode_speed.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flashdraft.target import TargetModel

NextLogits = Callable[[list[int]], torch.Tensor]  # ids → [V] logits predicting the token after them


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


def target_next_logits(target: TargetModel) -> NextLogits:
    """The transformers forward's last logits [V] after `ids`."""

    def run(ids: list[int]) -> torch.Tensor:
        out = target.forward(torch.tensor([ids], device=target.device), logits="last")  # [1, n, V]
        assert out.logits is not None
        return out.logits[0, -1]

    return run


def engine_next_logits(engine: Any) -> NextLogits:
    """The fast engine's static-cache target forward (`FastEngine.native`): last logits [V] after `ids`."""

    def run(ids: list[int]) -> torch.Tensor:
        pos = torch.arange(len(ids), device=engine.device)  # [n]
        x = torch.tensor(ids, device=engine.device)
        out = engine.native.forward(x, pos, pos, engine.kv_idx[None] <= pos[:, None])  # logits [n, V]
        return out.logits[-1]

    return run


@torch.no_grad()
def find_divergence(
    target: TargetModel, prompt: list[int] | torch.Tensor, reference: list[int], tokens: list[int], *,
    next_logits: NextLogits | None = None,
) -> Divergence | None:  # fmt: skip
    """None when `tokens` agrees with `reference` on their common length."""
    pos = next((i for i, (a, b) in enumerate(zip(reference, tokens, strict=False)) if a != b), None)
    if pos is None:
        return None
    prompt_ids = torch.as_tensor(prompt, dtype=torch.long).flatten().tolist()
    logits = (next_logits or target_next_logits(target))(prompt_ids + list(reference[:pos]))  # [V]
    top2 = logits.float().topk(2).values  # [2]
    return Divergence(pos, int(reference[pos]), int(tokens[pos]), float(top2[0] - top2[1]))
