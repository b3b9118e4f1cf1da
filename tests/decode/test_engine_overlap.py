"""FastEngine(overlap_rounds=True): round k + 1 enqueued before round k's tokens are read. The same rounds as the
serial loop, so the same tokens, τ per round and tree paths; float64 on CPU (the logic: which round may go ahead,
the host slots), and under CUDA graphs in bf16 where there is a GPU (the asynchronous copies)."""

from __future__ import annotations

import random

import pytest
import torch

from flashdraft.decode.engine import FastEngine
from flashdraft.decode.generate import generate as reference_generate
from tests.conftest import tiny_drafter, tiny_target
from tests.decode.test_engine import BLOCK, _prompt, _same

METHODS = [("ar", None), ("chain", None), ("ddtree", 4), ("ddtree", 15)]


def _engines(target, drafter, **kw) -> tuple[FastEngine, FastEngine]:
    return (FastEngine(target, drafter, overlap_rounds=True, **kw), FastEngine(target, drafter, **kw))


def test_overlapped_rounds_equal_the_serial_loop(family):
    """A random drafter, lengths from 1 token to several rounds, stop tokens inside a round, and the same prompt
    again after another: the overlapped loop's results are the serial loop's, and AR's tokens."""
    target = tiny_target(family, layers=2, seed=3)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK, seed=4)
    overlap, serial = _engines(target, drafter, max_len=64, max_budget=15)
    rng = random.Random(5)
    prompts = [_prompt(rng, target.vocab_size) for _ in range(2)]
    for prompt in prompts + prompts[:1]:
        ar = reference_generate(target, None, prompt, max_new_tokens=30, method="ar").tokens
        for max_new, stop in [(1, None), (2, None), (30, None), (30, [ar[11]])]:
            for method, budget in METHODS:
                kw = dict(max_new_tokens=max_new, method=method, budget=budget, stop_token_ids=stop)
                got = overlap.generate(prompt, **kw)
                _same(got, serial.generate(prompt, **kw), (method, budget, max_new, stop))
                want = ar[:max_new] if stop is None else ar[: ar.index(stop[0]) + 1]
                assert got.tokens == want, (method, budget, max_new, stop)


def test_overlapped_rounds_stop_where_the_callback_cancels():
    """`on_tokens` returning False after its third call (a client gone): the overlapped loop stops at the same round
    as the serial one, "cancelled", with the same tokens, although it had already enqueued the round after."""
    target = tiny_target("llama", layers=2, seed=3)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK, seed=4)
    overlap, serial = _engines(target, drafter, max_len=64, max_budget=15)
    for method, budget in METHODS:
        results = []
        for engine in (overlap, serial):
            calls: list[list[int]] = []
            results.append(engine.generate([5, 9, 11], max_new_tokens=30, method=method, budget=budget,
                                           on_tokens=lambda new, calls=calls: calls.append(new) or len(calls) < 3))  # fmt: skip
        _same(*results, (method, budget))
        assert results[0].stop_reason == "cancelled" and results[0].rounds == 2, (method, budget)


def test_overlapped_rounds_stay_inside_the_caches_with_full_blocks(monkeypatch):
    """Every logit 0 (the LM head zeroed): greedy picks token 0 and the drafter, sharing the head, drafts it, so
    every chain round commits a full block. With max_len exactly prompt + max_new_tokens, a round may go ahead only while
    it stays inside the caches (an index past them raises on CPU): the last rounds run one at a time, and at most
    one round is launched that nobody reads."""
    target = tiny_target("llama", layers=2, seed=1)
    with torch.no_grad():
        target.lm_head.weight.zero_()
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK, seed=2)
    # max_len 40: both caches end at 48 rows (max_len + B, 16-aligned), no slack
    prompt, max_new = [5, 9, 11], 37
    launches: list[int] = []
    launch = FastEngine._launch_round
    monkeypatch.setattr(FastEngine, "_launch_round", lambda self, *a: (launches.append(1), launch(self, *a)))
    overlap, serial = _engines(target, drafter, max_len=len(prompt) + max_new, max_budget=BLOCK - 1)
    assert overlap.capacity == len(prompt) + max_new + BLOCK
    for method, budget in [("chain", None), ("ddtree", BLOCK - 1), ("ar", None)]:
        launches.clear()
        got = overlap.generate(prompt, max_new_tokens=max_new, method=method, budget=budget)
        _same(got, serial.generate(prompt, max_new_tokens=max_new, method=method, budget=budget), method)
        assert got.tokens == [0] * max_new
        if method == "chain":  # (a DDTree of tied log-probs is wide, not deep)
            assert got.acceptance_lengths[:-1] == [BLOCK] * (got.rounds - 1)  # full blocks
        assert got.rounds <= len(launches) <= got.rounds + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlapped_rounds_under_cuda_graphs_on_gpu():
    """bf16, the phases as CUDA graphs, the host copies asynchronous: the overlapped loop replays the same graphs in
    the same order as the serial one, so its tokens are the same bit for bit, near-ties included."""
    target = tiny_target("llama", layers=4, hidden=64, dtype=torch.bfloat16)
    target.model.cuda()
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK).cuda()
    overlap, serial = _engines(target, drafter, max_len=96, max_budget=32)
    for method, budget in [("ar", None), ("chain", None), ("ddtree", 8), ("ddtree", 32)]:
        for prompt in ([5, 9, 11], [7, 3, 20, 8, 6, 40]):
            kw = dict(max_new_tokens=40, method=method, budget=budget)
            _same(overlap.generate(prompt, **kw), serial.generate(prompt, **kw), (method, budget))
    assert all(ph.graph is not None for ph in overlap._phases.values())
