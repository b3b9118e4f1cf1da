"""Sampling is lossless: chain and DDTree draw the first k tokens from exactly AR's distribution.

The exact AR distribution of the first K tokens is computed by enumeration on a tiny target with
an 8-token vocabulary; generate()'s empirical distribution is compared with a chi-square
goodness-of-fit test (fixed seeds, cells with expected count < 5 merged). The drafter is the
oracle (the target's own greedy continuation), which the target's samples often match, so
both acceptance and rejection paths run (checked). A negative control shows the same number
of samples rejects a distribution at the wrong temperature.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from flashdraft.decode import SamplingParams, choose_tokens, generate, token_probs
from tests.conftest import tiny_drafter, tiny_target
from tests.decode.oracle import OracleDrafter

K = 4  # tokens compared: the prefill's token, then one round of a block of 4
BLOCK = 4
PROMPT = [3, 5, 1, 6]


def peaked_target():
    target = tiny_target("llama", vocab=8, hidden=16, layers=2, seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(2.5)  # peaked distributions: the greedy drafter is often right
    return target


def exact_distribution(target, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(x1..xK | prompt) under AR sampling with `params`, by enumerating every prefix."""
    vocab = target.vocab_size
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for depth in range(K):
        prefixes = list(itertools.product(range(vocab), repeat=depth))
        ids = torch.tensor([prompt + list(p) for p in prefixes])  # [vocab^depth, n + depth]
        logits = target.forward(ids, logits="last").logits[:, -1]  # [vocab^depth, V]
        step = token_probs(logits, params).tolist()
        probs = {p + (x,): probs[p] * step[i][x] for i, p in enumerate(prefixes) for x in range(vocab)}
    return probs


def chi_square_p(samples: Counter, expected: dict[tuple[int, ...], float]) -> float:
    n = sum(samples.values())
    big = [c for c, p in expected.items() if p * n >= 5]
    obs = [samples.get(c, 0) for c in big]
    exp = [expected[c] * n for c in big]
    rest_exp = n - sum(exp)
    if rest_exp <= 1e-9 and sum(obs) < n:
        return 0.0  # samples where the distribution puts no mass at all
    if rest_exp > 1e-9:
        obs.append(n - sum(obs))
        exp.append(rest_exp)
    return float(chisquare(obs, exp).pvalue)


def sample_many(target, inner, method, budget, params, n, memo):
    seqs: Counter = Counter()
    acc: Counter = Counter()
    for seed in range(n):
        oracle = OracleDrafter(target, inner, PROMPT, memo=memo)
        res = generate(
            target, oracle, PROMPT, max_new_tokens=K, method=method, budget=budget, temperature=params.temperature,
            top_k=params.top_k, top_p=params.top_p, seed=seed, on_tokens=oracle.on_tokens,
        )  # fmt: skip
        assert len(res.tokens) == K and sum(res.acceptance_lengths) == K - 1
        seqs[tuple(res.tokens)] += 1
        acc.update(res.acceptance_lengths)
    return seqs, acc


CONFIGS = [
    ("chain", None, SamplingParams(0.7)),
    ("ddtree", 4, SamplingParams(0.7)),
    ("chain", None, SamplingParams(1.0)),
    ("ddtree", 6, SamplingParams(1.0)),
    ("ddtree", 3, SamplingParams(1.0, top_k=5, top_p=0.9)),
]


@pytest.mark.parametrize("method, budget, params", CONFIGS)
def test_sampling_matches_ar_distribution(method, budget, params):
    target = peaked_target()
    inner = tiny_drafter(target, layers=1, block_size=BLOCK)
    memo: dict = {}
    n = 400
    seqs, acc = sample_many(target, inner, method, budget, params, n, memo)
    expected = exact_distribution(target, PROMPT, params)
    assert sum(expected.values()) == pytest.approx(1.0)
    p = chi_square_p(seqs, expected)
    assert p > 1e-3, f"{method} budget={budget} {params}: chi-square p = {p:.2e}, acceptance {dict(acc)}"
    # both paths ran: rounds with a rejection at the first draft and rounds accepting drafts
    assert acc[1] > 0.05 * n and sum(acc[a] for a in range(2, K)) > 0.05 * n, dict(acc)
    # negative control: the same samples clearly reject a distribution at another temperature
    other = SamplingParams(1.6 if params.temperature < 1 else 0.5, params.top_k, params.top_p)
    assert chi_square_p(seqs, exact_distribution(target, PROMPT, other)) < 1e-3


def test_ar_sampling_matches_exact_distribution():
    """The reference computation itself: AR sampling through generate() fits it."""
    target = peaked_target()
    params = SamplingParams(1.0, top_p=0.8)
    seqs: Counter = Counter()
    for seed in range(400):
        res = generate(
            target, None, PROMPT, max_new_tokens=K, method="ar", temperature=1.0, top_p=0.8, seed=seed
        )
        seqs[tuple(res.tokens)] += 1
    assert chi_square_p(seqs, exact_distribution(target, PROMPT, params)) > 1e-3


def test_token_probs_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]], dtype=torch.float64)
    p = token_probs(logits, SamplingParams(1.0))
    assert torch.allclose(p, logits.softmax(-1))
    p = token_probs(logits, SamplingParams(0.5))
    assert torch.allclose(p, (logits / 0.5).softmax(-1))
    p = token_probs(logits, SamplingParams(1.0, top_k=2))  # tokens 4 and 0 survive
    ref = torch.zeros(5, dtype=torch.float64)
    ref[[4, 0]] = torch.tensor([3.0, 2.0], dtype=torch.float64).softmax(-1)
    assert torch.allclose(p[0], ref)
    full = logits.softmax(-1)[0]  # sorted: 4 (.636), 0 (.234), 1 (.086), 2, 3
    p = token_probs(logits, SamplingParams(1.0, top_p=0.8))  # .636 < .8, .636 + .234 >= .8: keep {4, 0}
    assert torch.allclose(p[0], ref)
    p = token_probs(logits, SamplingParams(1.0, top_p=0.5))  # the top token alone already reaches .5
    assert p[0].tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]
    p = token_probs(logits, SamplingParams(1.0, top_p=0.9))  # .870 < .9: add token 1
    keep = torch.tensor([4, 0, 1])
    assert torch.allclose(p[0, keep], full[keep] / full[keep].sum()) and p[0, [2, 3]].sum() == 0
    assert choose_tokens(logits, SamplingParams()).tolist() == [4]
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(1.0, top_k=-1)


def test_choose_tokens_is_reproducible_and_follows_the_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, -5.0])
    params = SamplingParams(1.0)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    rows = logits.expand(20000, 4)
    a, b = choose_tokens(rows, params, g1), choose_tokens(rows, params, g2)
    assert torch.equal(a, b)
    freq = torch.bincount(a, minlength=4).double() / a.numel()
    assert torch.allclose(freq, logits.double().softmax(-1), atol=0.015)


def test_generate_sampling_is_seeded():
    target = peaked_target()
    inner = tiny_drafter(target, layers=1, block_size=BLOCK)
    runs = [
        generate(
            target, inner, PROMPT, max_new_tokens=12, temperature=1.0, seed=s, method="ddtree", budget=4
        ).tokens
        for s in (1, 1, 2, 3, 4)
    ]
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[1:]}) > 1


@pytest.mark.slow
@pytest.mark.parametrize("method, budget, params", [CONFIGS[0], CONFIGS[3]])
def test_sampling_matches_ar_distribution_high_power(method, budget, params):
    """2000 samples: enough to catch a subtle bias (a verify temperature 15% too low gave p < 1e-10 when tried)."""
    target = peaked_target()
    inner = tiny_drafter(target, layers=1, block_size=BLOCK)
    seqs, acc = sample_many(target, inner, method, budget, params, 2000, {})
    p = chi_square_p(seqs, exact_distribution(target, PROMPT, params))
    assert p > 1e-3, f"{method} budget={budget} {params}: chi-square p = {p:.2e}, acceptance {dict(acc)}"
