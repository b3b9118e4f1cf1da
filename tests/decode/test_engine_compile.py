"""FastEngine(compile_target=True, compile_drafter=True): the round phases' target forward and the drafting
step through torch.compile (inductor's CPU backend here), token-identical to greedy AR in float64."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from flashdraft.decode.engine import FastEngine
from flashdraft.decode.generate import GenerationResult
from flashdraft.decode.generate import generate as reference_generate
from flashdraft.decode.native import NativeDrafter, NativeTarget
from flashdraft.decode.sampling import SamplingParams
from tests.conftest import tiny_drafter, tiny_target
from tests.decode.oracle import OracleDrafter
from tests.decode.test_engine import BLOCK, OracleEngine, _prompt, _same


def _compilations(fn: Callable[..., Any]) -> int:
    """The compiled variants dynamo keeps for `fn`'s code (shared by every instance in the process)."""
    return len(_debug_get_cache_entry_list(fn.__code__))


def test_compile_target_is_off_by_default():
    target = tiny_target("llama", layers=1)
    assert FastEngine(target, max_len=16).compile_target is False


@pytest.mark.slow
def test_engine_compiled_target_equals_ar():
    """float64, a mostly-right drafter (deep acceptances): AR, the chain and DDTree-7 with the compiled target
    give greedy AR's tokens, round for round the eager engine's, the rounds attending over spans of 16 to 80
    rows. Two compilations: q = 1 (logits) and q = 8 (logits + features; the chain's block and the 7-node tree
    share it), each serving every span; ~1-2 minutes on 2 cores."""
    target = tiny_target("llama", layers=2, seed=5)
    inner = tiny_drafter(target, layers=1, block_size=BLOCK, seed=0)
    rng = random.Random(3)
    engines = {}
    for compiled in (False, True):
        oracle = OracleDrafter(target, inner, [3], error_rate=0.3, sharpness=8.0, seed=3)
        engines[compiled] = OracleEngine(target, oracle, max_len=64, max_budget=7, compile_target=compiled)
        engines[compiled]._spans = lambda: [16, 32, 48, 64, 80]  # capacity 80: spans the generations cross
    before = _compilations(NativeTarget._run)
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
    assert len({k[-1] for k in engines[True]._phases}) >= 3 and _compilations(NativeTarget._run) - before == 2


def test_compiled_drafter_step_equals_eager():
    """float64: `NativeDrafter.compiled_step` writes the same drafter cache and gives the same logits as `step`,
    round after round with 1..B new context rows and the span moving (one compilation: the span is a symbolic
    size). To float32 precision: the drafter's norms take their statistics in float32 (`drafter.RMSNorm`), a round
    trip inductor fuses away (measured: ≤ 8e-7); a row written to the wrong place or a block that sees the wrong
    context would differ by O(1)."""
    target = tiny_target("qwen3", layers=4, seed=2)
    drafter = tiny_drafter(target, layers=2, block_size=BLOCK, seed=1)
    eager, compiled = (NativeDrafter(drafter, target, capacity=64) for _ in range(2))
    g = torch.Generator().manual_seed(0)
    feat_dim = len(drafter.target_layer_ids) * target.hidden_size
    mask_ids = torch.full((BLOCK - 1,), drafter.mask_token_id)
    seq_len = torch.tensor([3])
    before = _compilations(NativeDrafter._step)
    for n, span in [(3, 16), (1, 32), (BLOCK, None), (2, 48)]:  # seq_len + B: 14, 15, 23, 25
        pending = torch.randn(BLOCK, feat_dim, generator=g, dtype=torch.float64)
        n_pending, bonus = torch.tensor([n]), torch.randint(0, target.vocab_size, (1,), generator=g)
        seq_len = seq_len + n
        args = (pending, n_pending, seq_len, bonus, mask_ids)
        want, got = eager.step(*args, span=span), compiled.compiled_step(*args, span=span)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(compiled.cache, eager.cache, rtol=0, atol=1e-5)
    assert compiled._compiled is not None and eager._compiled is None
    assert _compilations(NativeDrafter._step) - before == 1


def test_engine_compiled_drafter_equals_ar():
    """float64, the real (random) drafter compiled in the drafting phase: AR's tokens, and the reference decoder's
    acceptance round for round, for the chain and DDTree-7."""
    target = tiny_target("llama", layers=4, seed=5)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK, seed=0)
    engine = FastEngine(target, drafter, max_len=64, max_budget=7, compile_drafter=True)
    prompt = [5, 9, 11, 3]
    ar = reference_generate(target, None, prompt, max_new_tokens=20, method="ar").tokens
    for method, budget in [("chain", None), ("ddtree", 7)]:
        got = engine.generate(prompt, max_new_tokens=20, method=method, budget=budget)
        ref = reference_generate(target, drafter, prompt, max_new_tokens=20, method=method, budget=budget)
        assert got.tokens == ar, method
        assert got.acceptance_lengths == ref.acceptance_lengths, method
    assert engine.ndrafter is not None and engine.ndrafter._compiled is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_target_inside_cuda_graphs_on_gpu():
    """On CUDA the compiled forwards (target and drafting step) are compiled in each phase's warm-up and captured in
    its graph: float32, the same tokens as the eager-forward graphs (random tiny targets have no near-ties at this
    precision). The generations cross from the 256-row span to the 512-row one: each compiled forward serves
    every span (one compilation per q, and one of the drafting step), a graph captured per span."""
    target = tiny_target("llama", layers=4, dtype=torch.float32)
    target.model.cuda()
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK).cuda()
    eager = FastEngine(target, drafter, max_len=600, max_budget=32)
    compiled = FastEngine(
        target, drafter, max_len=600, max_budget=32, compile_target=True, compile_drafter=True
    )
    prompt = [3 + (7 * i) % (target.vocab_size - 3) for i in range(230)]
    before = _compilations(NativeTarget._run), _compilations(NativeDrafter._step)
    for method, budget in [("ar", None), ("chain", None), ("ddtree", 8), ("ddtree", 32)]:
        a = compiled.generate(prompt, max_new_tokens=40, method=method, budget=budget)
        b = eager.generate(prompt, max_new_tokens=40, method=method, budget=budget)
        _same(a, b, (method, budget))
    assert all(ph.graph is not None for ph in compiled._phases.values())
    assert {256, 512} <= {k[-1] for k in compiled._phases if k[0] == "verify_chain"}
    after = _compilations(NativeTarget._run), _compilations(NativeDrafter._step)
    # the target at q = 1, 8, 9 and 33; the drafting step
    assert (after[0] - before[0], after[1] - before[1]) == (4, 1)


def _scramble(engine: FastEngine, seed: int) -> None:
    """Every buffer a generate may find left over from the last one, refilled with garbage: the caches, the round
    state, the verify / tree buffers (integers 0 or 1: an index wherever an index is read)."""
    g = torch.Generator().manual_seed(seed)
    bufs = [engine.native.cache, engine.seq_len, engine.bonus, engine.n_pending, engine.out]
    bufs += [t for q in engine._q.values() for t in q.values()]
    bufs += [t for tree in engine._tree.values() for t in (tree["out"].parents, tree["out"].depths)]
    if engine.ndrafter is not None:
        bufs += [engine.ndrafter.cache, engine.pending, engine.draft_logits, engine.draft_tokens]
    for t in bufs:  # drawn on the CPU, copied in place (CUDA graphs keep their addresses)
        if t.dtype == torch.bool:
            t.copy_(torch.rand(t.shape, generator=g) < 0.5)
        elif t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64) * 3)
        else:
            t.copy_(torch.randint(0, 2, t.shape, generator=g))


def _check_request_only(run: Callable[..., GenerationResult], engine: FastEngine, prompt: list[int],
                        other: list[int], methods: list[tuple[str, int | None]]) -> list[GenerationResult]:  # fmt: skip
    """`run(ids, method, budget, **kw)` gives the same tokens and τ per round for `prompt` after `other`, with
    profile=True, and after `_scramble`: nothing of the last call reaches the next. The first results."""
    firsts = []
    for method, budget in methods:
        first = run(prompt, method, budget)
        run(other, method, budget)
        _same(run(prompt, method, budget, profile=True), first, (method, "profiled after another prompt"))
        assert engine.last_profile.rounds == first.rounds
        _scramble(engine, seed=len(first.tokens))
        _same(run(prompt, method, budget), first, (method, "after scrambling"))
        firsts.append(first)
    return firsts


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_engine_generate_depends_on_its_request_only(compiled):
    """float64, a mostly-right drafter: the same prompt gives the same tokens and τ per round after another prompt,
    with profile=True, and after every buffer a generate leaves behind was scrambled — nothing of the last call
    (cache rows, drafter context, verify inputs) reaches the next, with the eager and the compiled target (two
    compilations, q = 1 and q = 8, ~1-2 minutes on 2 cores)."""
    target = tiny_target("llama", layers=2, seed=5)
    inner = tiny_drafter(target, layers=1, block_size=BLOCK, seed=0)
    oracle = OracleDrafter(target, inner, [3], error_rate=0.3, sharpness=8.0, seed=3)
    engine = OracleEngine(target, oracle, max_len=64, max_budget=7, compile_target=compiled)
    rng = random.Random(4)

    def run(ids: list[int], method: str, budget: int | None, **kw: Any) -> GenerationResult:
        engine.oracle = OracleDrafter(target, inner, ids, error_rate=0.3, sharpness=8.0, seed=3)
        return engine.generate(ids, max_new_tokens=24, method=method, budget=budget,
                               on_tokens=engine.oracle.on_tokens, **kw)  # fmt: skip

    methods = [("ar", None), ("chain", None), ("ddtree", BLOCK - 1)]
    firsts = _check_request_only(
        run, engine, _prompt(rng, target.vocab_size), _prompt(rng, target.vocab_size), methods
    )
    assert sum(a > 2 for r in firsts[1:] for a in r.acceptance_lengths) > 0  # commits moved deep paths' K/V
    assert (engine.native._compiled is not None) == compiled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graphs_generate_depends_on_its_request_only_on_gpu(compiled):
    """bf16 on CUDA, the phases as graphs (the compiled target's inside them): a generate replays the same graphs
    from the same state as the last one for that prompt, so its tokens are the same bit for bit — in bf16 too, near
    ties included — after another prompt, profiled (CUDA events between the replays) and after the scrambling."""
    target = tiny_target("llama", layers=4, hidden=64, dtype=torch.bfloat16)
    target.model.cuda()
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK).cuda()
    engine = FastEngine(target, drafter, max_len=96, max_budget=32, compile_target=compiled)

    def run(ids: list[int], method: str, budget: int | None, **kw: Any) -> GenerationResult:
        return engine.generate(ids, max_new_tokens=40, method=method, budget=budget, **kw)

    methods = [("ar", None), ("chain", None), ("ddtree", 8), ("ddtree", 32)]
    _check_request_only(run, engine, [5, 9, 11], [7, 3, 20, 8, 6, 40], methods)
    assert all(ph.graph is not None for ph in engine._phases.values())


def test_one_compilation_per_q_serves_every_span_the_whole_cache_included(monkeypatch):
    """Under CUDA graphs every span's phases run once at an empty state, the whole cache's among them. A mask that
    were the whole `allowed` buffer at that span is contiguous where every other span's slice is strided, and the
    compiled forward guards on that: each q would compile once more (the H100 counted 7 compilations where 4
    serve). The guards are dynamo's, whatever the backend, so the eager backend shows them in seconds."""
    import flashdraft.decode.native as native

    def eager_backend(nt: NativeTarget) -> Callable[..., Any]:
        return torch.compile(nt._run, fullgraph=True, dynamic=False, backend="eager")

    monkeypatch.setattr(native, "compile_native_target", eager_backend)
    target = tiny_target("llama", layers=1, dtype=torch.float32)
    drafter = tiny_drafter(target, layers=1, block_size=BLOCK)
    engine = FastEngine(target, drafter, max_len=64, max_budget=8, compile_target=True)
    spans = [16, 32, engine.capacity]
    torch._dynamo.reset()
    for method, budget in [("ar", None), ("chain", None), ("ddtree", 8)]:
        for span in spans:
            for _, phase in engine._phases_at(method, budget, SamplingParams(), span):
                engine.seq_len.zero_()
                engine.n_pending.zero_()
                phase()
    # the target at q = 1 (AR), BLOCK (the chain's verify) and 9 (the 8-node tree's)
    assert _compilations(NativeTarget._run) == 3
