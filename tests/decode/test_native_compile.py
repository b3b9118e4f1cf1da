"""The compiled native target forward (`NativeTarget.compiled_forward`) equals the eager one, and keeps the
static cache's writes in place. Inductor's CPU backend here: each test compiles once (~30-50 s on 2 cores)."""

from __future__ import annotations

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from flashdraft.decode.native import NativeTarget
from tests.conftest import tiny_target

CAP = 48


def _buffers(code: list[str]) -> set[tuple[int, ...]]:
    """Shapes of the buffers inductor's output code allocates."""
    shapes = re.findall(r"empty_strided_\w+\(\(([\d, ]+)\)", "\n".join(code))
    return {tuple(int(x) for x in s.split(",") if x.strip()) for s in shapes}


@pytest.mark.slow
def test_compiled_forward_matches_eager(family):
    """float32: logits and features within 1e-4 of eager, the same argmax, the same cache; the compiled code
    allocates no copy of the cache (an index_copy_ into `cache[i, 0]` compiled to a whole-cache copy per
    forward, written back at its end)."""
    target = tiny_target(family, layers=2, dtype=torch.float32, seed=3)
    ids = torch.randint(3, target.vocab_size, (27,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(27)
    causal = torch.arange(CAP)[None] <= pos[:, None]  # [27, CAP]
    eager, comp = NativeTarget(target, CAP), NativeTarget(target, CAP)
    for n in (eager, comp):  # the same eager prefill of 11 tokens
        n.forward(ids[:11], pos[:11], pos[:11], causal[:11])
    layer_ids = [1, 0]  # unsorted; 1 is the last layer (final-normed)
    with torch._inductor.config.patch(fx_graph_cache=False):  # the output code, not a cached graph's
        got, code = run_and_get_code(comp.compiled_forward, ids[11:19], pos[11:19], pos[11:19], causal[11:19],
                                     layer_ids=layer_ids)  # fmt: skip
    want = eager.forward(ids[11:19], pos[11:19], pos[11:19], causal[11:19], layer_ids=layer_ids)
    cache_shapes = {tuple(eager.cache.shape), tuple(eager.cache.shape[1:]), tuple(eager.cache.shape[2:])}
    assert code and not (_buffers(code) & cache_shapes), _buffers(code)

    def check(got, want) -> None:  # type: ignore[no-untyped-def]
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-4)
        torch.testing.assert_close(got.features, want.features, rtol=0, atol=1e-4)
        assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
        torch.testing.assert_close(comp.cache, eager.cache, rtol=0, atol=1e-5)

    check(got, want)
    # the same shape again, out-of-order rows and a tree mask (no recompilation): it reads the K/V the
    # compiled call above wrote into the real cache
    rows = torch.tensor([19, 21, 20, 22, 23, 24, 25, 26])
    allowed = (torch.arange(CAP)[None] < 19).repeat(8, 1)
    allowed[torch.arange(8), rows] = True
    allowed[1:, 19] = True  # every node below the first
    args = (ids[19:27], pos[19:27] - 1, rows, allowed)
    check(comp.compiled_forward(*args, layer_ids=layer_ids), eager.forward(*args, layer_ids=layer_ids))


@pytest.mark.slow
def test_batched_compiled_step_equals_eager():
    """Regeneration's batched step through torch.compile (`native_generate(compile_step=True)`): the same greedy
    tokens as the eager step, rows refilled mid-run, and no cache-sized buffer in the compiled code (one
    compilation: on CPU the compiled step's span is bucketed like the graphed one's, here to the capacity)."""
    from flashdraft.data.loop import GenerationParams
    from flashdraft.data.native import native_generate

    target = tiny_target("qwen3", layers=2, dtype=torch.float32, seed=2)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, target.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    params = GenerationParams(max_new_tokens=10)
    want = native_generate(target, prompts, params, seed=0, rows=2, sync_every=3)
    with torch._inductor.config.patch(fx_graph_cache=False):
        got, code = run_and_get_code(native_generate, target, prompts, params, seed=0, rows=2, sync_every=3,
                                     compile_step=True)  # fmt: skip
    assert got == want
    n_kv, hd = 2, target.hidden_size // 4
    per_layer = (2, n_kv, 9 + 10, hd)  # [rows, kv, capacity, hd]: longest prompt + max_new_tokens
    shapes = _buffers(code)
    assert (
        code
        and per_layer not in shapes
        and (2, *per_layer) not in shapes
        and (2, 2, *per_layer) not in shapes
    ), shapes
