"""FastEngine(compile_target=True): the round phases' target forward through torch.compile (inductor's CPU
backend here), token-identical to greedy AR in float64."""

from __future__ import annotations

import random

import pytest
import torch

from flashdraft.decode.engine import FastEngine
from flashdraft.decode.generate import generate as reference_generate
from tests.conftest import tiny_drafter, tiny_target
from tests.decode.oracle import OracleDrafter
from tests.decode.test_engine import BLOCK, OracleEngine, _prompt, _same


def test_compile_target_is_off_by_default():
    target = tiny_target("llama", layers=1)
    assert FastEngine(target, max_len=16).compile_target is False


@pytest.mark.slow
def test_engine_compiled_target_equals_ar():
    """float64, a mostly-right drafter (deep acceptances): AR, the chain and DDTree-7 with the compiled target
    give greedy AR's tokens, round for round the eager engine's. Two compilations: q = 1 (logits) and
    q = 8 (logits + features; the chain's block and the 7-node tree share it), ~1-2 minutes on 2 cores."""
    target = tiny_target("llama", layers=2, seed=5)
    inner = tiny_drafter(target, layers=1, block_size=BLOCK, seed=0)
    rng = random.Random(3)
    engines = {}
    for compiled in (False, True):
        oracle = OracleDrafter(target, inner, [3], error_rate=0.3, sharpness=8.0, seed=3)
        engines[compiled] = OracleEngine(target, oracle, max_len=64, max_budget=7, compile_target=compiled)
    deep = 0
    for _ in range(2):
        prompt = _prompt(rng, target.vocab_size)
        max_new = rng.randint(16, 30)
        ar = reference_generate(target, None, prompt, max_new_tokens=max_new, method="ar").tokens
        for method, budget in [("ar", None), ("chain", None), ("ddtree", BLOCK - 1)]:
            results = []
            for engine in engines.values():
                engine.oracle = OracleDrafter(target, inner, prompt, error_rate=0.3, sharpness=8.0, seed=3)
                results.append(engine.generate(prompt, max_new_tokens=max_new, method=method, budget=budget,
                                               on_tokens=engine.oracle.on_tokens))  # fmt: skip
            eager, compiled_res = results
            _same(compiled_res, eager, (method, budget))
            assert compiled_res.tokens == ar, (method, budget)
            deep += sum(a > 2 for a in compiled_res.acceptance_lengths) if method != "ar" else 0
    assert deep > 0
    assert engines[True].native._compiled is not None and engines[False].native._compiled is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_target_inside_cuda_graphs_on_gpu():
    """On CUDA the compiled forward is compiled in each phase's warm-up and captured in its graph: float32, the
    same tokens as the eager-forward graphs (random tiny targets have no near-ties at this precision)."""
    target = tiny_target("llama", layers=4, dtype=torch.float32)
    target.model.cuda()
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK).cuda()
    eager = FastEngine(target, drafter, max_len=96, max_budget=32)
    compiled = FastEngine(target, drafter, max_len=96, max_budget=32, compile_target=True)
    for method, budget in [("ar", None), ("chain", None), ("ddtree", 8), ("ddtree", 32)]:
        a = compiled.generate([5, 9, 11], max_new_tokens=40, method=method, budget=budget)
        b = eager.generate([5, 9, 11], max_new_tokens=40, method=method, budget=budget)
        _same(a, b, (method, budget))
    assert all(ph.graph is not None for ph in compiled._phases.values())
