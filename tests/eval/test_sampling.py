"""T > 0: replaying seeded sampled references reproduces the online τ *distribution* (not each sample).

Acceptance-length histograms of online `generate` (chain, DDTree-4) and of the offline replay are
compared with a chi-square test; as a control, the same test must tell greedy references apart.
"""

from __future__ import annotations

import torch
from scipy.stats import chi2_contingency

from flashdraft.decode.generate import generate
from flashdraft.eval.evaluate import evaluate
from tests.conftest import tiny_drafter, tiny_target

T, NEW, BLOCK = 1.0, 24, 6


def _hist(lengths: list[int]) -> list[int]:
    h = [0] * BLOCK
    for x in lengths:
        h[x - 1] += 1
    return h


def _p_same(a: list[int], b: list[int]) -> float:
    cols = [i for i in range(len(a)) if a[i] + b[i] > 0]
    return float(chi2_contingency([[a[i] for i in cols], [b[i] for i in cols]])[1])


def test_sampled_replay_matches_online_distribution(tmp_path) -> None:
    target = tiny_target("qwen3", vocab=12)  # few tokens: random drafts are often sampled by the target
    drafter = tiny_drafter(target, block_size=BLOCK)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 11, (6,), generator=g).tolist() for _ in range(40)]
    kw = dict(
        budgets=[4], topk=None, max_new_tokens=NEW, stop_token_ids=[], cache_dir=tmp_path, progress=False
    )
    sampled = evaluate(target, {"d": drafter}, prompts, temperature=T, seed=7, **kw).drafters["d"]
    greedy = evaluate(target, {"d": drafter}, prompts, temperature=0.0, **kw).drafters["d"]
    for method, budget, name in [("chain", None, "chain"), ("ddtree", 4, "ddtree-4")]:
        online: list[int] = []
        for i, p in enumerate(prompts):
            online += generate(target, drafter, p, max_new_tokens=NEW, method=method, budget=budget,
                               temperature=T, seed=1000 + i, stop_token_ids=[]).acceptance_lengths  # fmt: skip
        on = _hist(online)
        assert sum(on) > 500 and sum(on[1:]) > 40, on  # enough accepted rounds for the test to have power
        assert _p_same(on, sampled.methods[name].histogram) > 1e-3, (
            name,
            on,
            sampled.methods[name].histogram,
        )
        # control: the test does see a wrong reference distribution
        assert _p_same(on, greedy.methods[name].histogram) < 1e-3, (name, on, greedy.methods[name].histogram)
