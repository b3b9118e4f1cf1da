"""float32: speculative vs AR greedy outputs, divergences reported (never asserted) with margins.

Run with -s to see the report. Exactness is asserted in float64 (test_generate.py); here a
flip at a near-tie is expected arithmetic, so only the report's own machinery is checked.
"""

from __future__ import annotations

import random

import torch

from flashdraft.decode import generate
from flashdraft.decode.divergence import find_divergence
from tests.conftest import tiny_drafter, tiny_target


def test_float32_divergence_report():
    lines = []
    for family in ("llama", "qwen3"):
        target = tiny_target(family, dtype=torch.float32, layers=4, seed=11)
        drafter = tiny_drafter(target, layers=1, block_size=8)
        rng = random.Random(0)
        stats = {"chain": [0, 0], "ddtree-8": [0, 0], "ddtree-32": [0, 0]}
        for _ in range(8):
            prompt = [rng.randrange(3, target.vocab_size) for _ in range(rng.randint(2, 12))]
            ar = generate(target, None, prompt, max_new_tokens=16, method="ar").tokens
            for name, method, budget in [("chain", "chain", None), ("ddtree-8", "ddtree", 8),
                                         ("ddtree-32", "ddtree", 32)]:  # fmt: skip
                out = generate(
                    target, drafter, prompt, max_new_tokens=16, method=method, budget=budget
                ).tokens
                stats[name][0] += 1
                d = find_divergence(target, prompt, ar, out)
                if d is not None:
                    stats[name][1] += 1
                    lines.append(f"  {family} {name} prompt {prompt}: {d.describe()}")
                    assert d.top2_margin >= 0 and d.reference_token == ar[d.position]
        for name, (runs, div) in stats.items():
            lines.append(f"{family} float32 {name}: {div}/{runs} outputs diverge from AR")
    print("\n" + "\n".join(lines))


def test_find_divergence_reports_position_and_margin():
    target = tiny_target("llama", layers=2)
    prompt = [4, 5, 6]
    ar = generate(target, None, prompt, max_new_tokens=6, method="ar").tokens
    assert find_divergence(target, prompt, ar, ar) is None
    changed = ar[:3] + [(ar[3] + 1) % target.vocab_size] + ar[4:]
    d = find_divergence(target, prompt, ar, changed)
    assert d is not None and d.position == 3 and d.token == changed[3] and d.top2_margin > 0
