"""Greedy speculative decoding is token-identical to greedy AR (float64), with exact τ and KV bookkeeping.

Random drafters give short acceptances; the oracle drafter (tests/decode/oracle.py) is right,
so full blocks are accepted and stop tokens / max_new_tokens land inside accepted blocks.
Every round's cache state is checked through generate's `_round_callback`.
"""

from __future__ import annotations

import random

import pytest
import torch

from flashdraft.decode import RoundInfo, generate
from tests.conftest import tiny_drafter, tiny_target
from tests.decode.oracle import OracleDrafter

BUDGETS = [1, 4, 8, 15, 32, 64]
METHODS = [("chain", None)] + [("ddtree", b) for b in BUDGETS]
BLOCK = 8


def random_prompt(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(rng.randint(2, 14))]


class RoundChecker:
    """Checks the round invariants after every round (docs/method.md §8.1)."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.rounds: list[RoundInfo] = []

    def __call__(self, info: RoundInfo) -> None:
        self.rounds.append(info)
        # the target cache holds the prompt and every committed token except the newest (the bonus)
        assert info.target_cache_length == info.prompt_tokens + info.committed - 1, info
        # the drafter holds context K/V only: what it has plus what waits == everything before the bonus
        assert info.drafter_cache_length + info.drafter_pending == info.target_cache_length, info
        if info.round == 0:
            assert info.drafter_pending == info.prompt_tokens and info.drafter_cache_length == 0, info
        else:
            assert 1 <= info.accepted <= self.block, info
            assert info.drafter_pending == info.accepted, info  # old bonus + accepted drafts


def check_accounting(res, max_new: int, block: int) -> None:
    assert len(res.tokens) <= max_new
    assert len(res.acceptance_lengths) == res.rounds
    assert all(1 <= a <= block for a in res.acceptance_lengths)
    assert sum(res.acceptance_lengths) == len(res.tokens) - 1  # the first token comes from the prefill


def run_checked(target, drafter, prompt, max_new, method, budget, stop=None, on_tokens=None):
    checker = RoundChecker(BLOCK)
    res = generate(
        target, drafter, prompt, max_new_tokens=max_new, method=method, budget=budget,
        stop_token_ids=stop, on_tokens=on_tokens, _round_callback=checker,
    )  # fmt: skip
    assert len(checker.rounds) == res.rounds + 1  # the prefill, then one call per round
    check_accounting(res, max_new, BLOCK)
    return res


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_identity_random_drafter(family, seed):
    """9 prompts x 3 seeds x 2 families = 54 prompts, each through chain and every budget."""
    target = tiny_target(family, layers=4, seed=seed)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK, seed=seed + 10)
    rng = random.Random(seed)
    for _ in range(9):
        prompt = random_prompt(rng, target.vocab_size)
        max_new = rng.randint(4, 9)
        ar = generate(target, None, prompt, max_new_tokens=max_new, method="ar")
        assert len(ar.tokens) == max_new and ar.acceptance_lengths == [1] * (max_new - 1)
        for method, budget in METHODS:
            res = run_checked(target, drafter, prompt, max_new, method, budget)
            assert res.tokens == ar.tokens, (family, seed, prompt, method, budget)
            assert res.stop_reason == "length"


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_greedy_identity_oracle_drafter(family, seed, error_rate):
    """A drafter that is (mostly) right: full blocks, stops and length limits inside accepted blocks."""
    target = tiny_target(family, layers=4, seed=seed + 5)
    inner = tiny_drafter(target, layers=1, block_size=BLOCK, seed=seed)
    rng = random.Random(100 + seed)
    saw = {"full_block": 0, "stop_in_block": 0, "length_in_block": 0}
    memo: dict = {}  # every committed sequence is a prefix of the greedy output: oracles share work
    for _ in range(3):
        prompt = random_prompt(rng, target.vocab_size)
        max_new = rng.randint(9, 30)
        ar_full = generate(target, None, prompt, max_new_tokens=max_new, method="ar").tokens
        for use_stop in (False, True):
            stop = None
            expected = ar_full
            if use_stop:  # a token that first occurs mid-way through the output
                j = rng.randrange(2, len(ar_full))
                stop = [ar_full[j]]
                expected = ar_full[: ar_full.index(ar_full[j]) + 1]
                ar = generate(target, None, prompt, max_new_tokens=max_new, method="ar", stop_token_ids=stop)
                assert ar.tokens == expected and ar.stop_reason == "stop"
            for method, budget in METHODS:
                oracle = OracleDrafter(
                    target, inner, prompt, error_rate=error_rate, sharpness=8.0, seed=seed, memo=memo
                )
                res = run_checked(target, oracle, prompt, max_new, method, budget, stop, oracle.on_tokens)
                assert res.tokens == expected, (family, seed, prompt, method, budget, stop)
                assert res.stop_reason == ("stop" if use_stop else "length")
                acc = res.acceptance_lengths
                saw["full_block"] += acc.count(BLOCK)
                if acc and acc[-1] < BLOCK and error_rate == 0 and (method == "chain" or budget >= BLOCK - 1):
                    saw["stop_in_block" if use_stop else "length_in_block"] += acc[-1] > 1
                if error_rate == 0 and method == "chain":
                    assert all(a == BLOCK for a in acc[:-1]), acc  # a right drafter: every round a full block
                if error_rate == 0 and method == "ddtree" and budget >= 32:
                    assert all(a == BLOCK for a in acc[:-1]), (budget, acc)  # a sharp, right tree: full depth
    assert all(v > 0 for v in saw.values()) or error_rate > 0, saw


def test_tau_accounting_exact_with_truncation():
    target = tiny_target("llama", layers=4, seed=3)
    inner = tiny_drafter(target, layers=1, block_size=BLOCK)
    prompt = [5, 17, 33, 8]
    ar = generate(target, None, prompt, max_new_tokens=20, method="ar").tokens
    for method, budget in [("chain", None), ("ddtree", 64)]:
        oracle = OracleDrafter(target, inner, prompt, sharpness=8.0)
        res = run_checked(target, oracle, prompt, 20, method, budget, on_tokens=oracle.on_tokens)
        # 1 token from the prefill, then 8 + 8, then the last round cut to the 3 that still fit
        assert res.tokens == ar and res.acceptance_lengths == [8, 8, 3] and res.rounds == 3
        assert res.mean_acceptance == pytest.approx(19 / 3)
        # a stop token as the 11th new token (if it did not occur earlier): 1 + 8 + 2
        stop = ar[10]
        if stop not in ar[:10]:
            oracle = OracleDrafter(target, inner, prompt, sharpness=8.0)
            res = run_checked(target, oracle, prompt, 20, method, budget, [stop], oracle.on_tokens)
            assert res.tokens == ar[:11] and res.acceptance_lengths == [8, 2] and res.stop_reason == "stop"


def test_edge_lengths_and_first_token_stop():
    target = tiny_target("qwen3", layers=4)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK)
    prompt = torch.tensor([[4, 9, 12]])
    res = generate(target, drafter, prompt, max_new_tokens=0)
    assert res.tokens == [] and res.rounds == 0 and res.stop_reason == "length"
    res = generate(target, drafter, prompt, max_new_tokens=1)
    assert (
        len(res.tokens) == 1
        and res.rounds == 0
        and res.acceptance_lengths == []
        and res.mean_acceptance == 0.0
    )
    first = res.tokens[0]
    res = generate(
        target, drafter, prompt[0], max_new_tokens=10, method="ddtree", budget=4, stop_token_ids=[first]
    )
    assert res.tokens == [first] and res.stop_reason == "stop" and res.rounds == 0
    # budget 0: a root-only tree, one token per round, still exact
    ar = generate(target, None, prompt, max_new_tokens=7, method="ar")
    res = run_checked(target, drafter, prompt[0].tolist(), 7, "ddtree", 0)
    assert res.tokens == ar.tokens and res.acceptance_lengths == [1] * 6


def test_on_tokens_streams_exactly_the_committed_tokens_and_can_cancel():
    target = tiny_target("llama", layers=4, seed=1)
    inner = tiny_drafter(target, layers=1, block_size=BLOCK)
    prompt = [7, 8, 9, 10]
    oracle = OracleDrafter(target, inner, prompt, sharpness=8.0)
    chunks: list[list[int]] = []

    def stream(tokens: list[int]) -> None:
        oracle.on_tokens(tokens)
        chunks.append(list(tokens))

    res = generate(target, oracle, prompt, max_new_tokens=20, on_tokens=stream)
    assert [t for c in chunks for t in c] == res.tokens
    assert [len(c) for c in chunks] == [1] + res.acceptance_lengths
    # cancel after the second chunk: generation stops at once, nothing more is committed
    oracle = OracleDrafter(target, inner, prompt, sharpness=8.0)
    chunks.clear()

    def cancel(tokens: list[int]) -> bool:
        stream(tokens)
        return len(chunks) < 2

    res = generate(target, oracle, prompt, max_new_tokens=20, on_tokens=cancel)
    assert res.stop_reason == "cancelled" and res.rounds == 1 and len(chunks) == 2
    assert [t for c in chunks for t in c] == res.tokens and len(res.tokens) == 1 + BLOCK


def test_eager_attention_and_raw_hf_model():
    target = tiny_target("qwen3", layers=4, seed=2, attn_implementation="eager")
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK)
    prompt = [3, 44, 5, 61, 9]
    ar = generate(target.model, None, prompt, max_new_tokens=12, method="ar")  # a raw HF causal LM is wrapped
    for budget in (4, 32):
        res = run_checked(target, drafter, prompt, 12, "ddtree", budget)
        assert res.tokens == ar.tokens
    res = generate(target.model, drafter, torch.tensor(prompt), max_new_tokens=12, method="ddtree", budget=8)
    assert res.tokens == ar.tokens


def test_clear_errors():
    target = tiny_target("llama", layers=4)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK)
    ids = [3, 4, 5]
    with pytest.raises(ValueError, match="unknown method 'beam'"):
        generate(target, drafter, ids, max_new_tokens=4, method="beam")
    with pytest.raises(ValueError, match="needs budget=N"):
        generate(target, drafter, ids, max_new_tokens=4, method="ddtree")
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(target, None, ids, max_new_tokens=4, method="chain")
    with pytest.raises(ValueError, match="batch size 2"):
        generate(target, drafter, torch.tensor([[1, 2], [3, 4]]), max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        generate(target, drafter, ids, max_new_tokens=4, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        generate(target, drafter, ids, max_new_tokens=4, temperature=1.0, top_p=0.0)
    other = tiny_target("llama", layers=6)
    with pytest.raises(ValueError, match="expects a 4-layer target"):
        generate(other, drafter, ids, max_new_tokens=4)
    target.attn_implementation = "flash_attention_2"  # only the name matters: refused before any forward
    with pytest.raises(ValueError, match="cannot take"):
        generate(target, drafter, ids, max_new_tokens=4, method="ddtree", budget=4)
