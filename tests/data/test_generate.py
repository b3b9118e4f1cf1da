"""Batched generation: the loop and native engines agree with unbatched greedy decoding; batching plan; sampling."""

from __future__ import annotations

import pytest
import torch

from flashdraft.data.generate import LocalGenerator, plan_batches
from flashdraft.data.loop import GenerationParams, cut_at_stop, loop_generate
from tests.conftest import tiny_target


def _reference_greedy(target, prompt: list[int], n: int, stop: list[int]) -> list[int]:
    ids = list(prompt)
    out = []
    for _ in range(n):
        logits = target.forward(torch.tensor([ids]), logits="last").logits[0, -1]
        t = int(logits.argmax())
        out.append(t)
        ids.append(t)
        if t in stop:
            break
    return out


def _prompts(vocab: int, lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def test_loop_matches_unbatched_greedy(family):
    target = tiny_target(family)
    prompts = _prompts(97, [5, 12, 1])
    # pick a stop token the reference actually emits for one row, so both finish kinds are exercised
    free = _reference_greedy(target, prompts[1], 8, [])
    stop = [free[3]]
    params = GenerationParams(max_new_tokens=8, stop_ids=stop)
    ref = [_reference_greedy(target, p, 8, stop) for p in prompts]
    loop = loop_generate(target, prompts, params, seed=0, sync_every=3)
    assert [g.ids for g in loop] == ref
    assert loop[1].finish == "stop" and loop[1].ids[-1] == stop[0]
    assert all(g.finish == ("stop" if g.ids[-1] in stop else "length") for g in loop)


def test_generator_restores_order_and_respects_budget():
    target = tiny_target("llama")
    prompts = _prompts(97, [3, 20, 7, 15, 2, 11, 9])
    params = GenerationParams(max_new_tokens=4, stop_ids=[2])
    whole = loop_generate(target, prompts, params, seed=0)
    gen = LocalGenerator(target, params, batch_size=3, max_batch_tokens=60)
    assert [g.ids for g in gen.generate(prompts, seed=0)] == [g.ids for g in whole]
    batches = plan_batches([len(p) for p in prompts], 3, 60, 4)
    assert sorted(i for b in batches for i in b) == list(range(7))
    for b in batches:
        assert len(b) <= 3 and len(b) * (max(len(prompts[i]) for i in b) + 4) <= 60 or len(b) == 1
        assert [len(prompts[i]) for i in b] == sorted((len(prompts[i]) for i in b), reverse=True)


def test_pack_groups_cuts_in_order_where_an_item_does_not_fit():
    from flashdraft.data.loop import pack_groups

    def under_ten(group: list[int], x: int) -> bool:
        return sum(group) + x <= 10

    # 12 is over on its own, and still a group: a group always takes its first item
    assert pack_groups([4, 5, 2, 9, 12, 1], under_ten) == [[4, 5], [2], [9], [12], [1]]
    assert pack_groups([], under_ten) == []


def test_sampling_is_seeded():
    target = tiny_target("qwen3")
    prompts = _prompts(97, [4, 6])
    params = GenerationParams(max_new_tokens=6, temperature=1.0, stop_ids=[2])
    a = loop_generate(target, prompts, params, seed=7)
    b = loop_generate(target, prompts, params, seed=7)
    c = loop_generate(target, prompts, params, seed=8)
    assert [g.ids for g in a] == [g.ids for g in b]
    assert [g.ids for g in a] != [g.ids for g in c]


def test_cut_at_stop():
    assert cut_at_stop([5, 6, 2, 7], [2]).ids == [5, 6, 2]
    assert cut_at_stop([5, 6], [2]).finish == "length"


def test_native_continuous_batching_matches_unbatched_greedy(family):
    """Fewer rows than prompts forces refills of finished rows; stop tokens and max_new_tokens both end rows."""
    from flashdraft.data.native import native_generate

    target = tiny_target(family)
    prompts = _prompts(97, [5, 12, 1, 9, 3, 17, 7], seed=3)
    free = _reference_greedy(target, prompts[1], 10, [])
    stop = [free[4]]
    params = GenerationParams(max_new_tokens=10, stop_ids=stop)
    ref = [_reference_greedy(target, p, 10, stop) for p in prompts]
    assert any(r[-1] == stop[0] for r in ref) and any(len(r) == 10 and r[-1] != stop[0] for r in ref)
    seen: list[int] = []
    got = native_generate(
        target, prompts, params, seed=0, rows=3, sync_every=3, prefill_tokens=30,
        on_batch=lambda gs: seen.extend(len(g.ids) for g in gs),
    )  # fmt: skip
    assert [g.ids for g in got] == ref
    assert sorted(seen) == sorted(len(r) for r in ref)
    assert all(g.finish == ("stop" if g.ids[-1] in stop else "length") for g in got)
    gen = LocalGenerator(target, params, engine="native", batch_size=4)
    assert [g.ids for g in gen.generate(prompts, seed=0)] == ref


def test_native_varlen_attention_matches_unbatched_greedy(family, monkeypatch):
    """The decode step with `attention="varlen"` (each row reads only its own cache columns through the packed
    cache) gives unbatched greedy decoding's ids, refills and follow-ups included; the flash kernel is replaced by
    its definition (`varlen_reference`), which checks the packing."""
    import flashdraft.data.native as native

    calls = []
    monkeypatch.setattr(native, "varlen_support_error", lambda *a: None)
    monkeypatch.setattr(native, "varlen_attention", lambda *a: calls.append(1) or native.varlen_reference(*a))
    target = tiny_target(family)
    prompts = _prompts(97, [5, 12, 1, 9, 3, 17, 7], seed=3)
    stop = [_reference_greedy(target, prompts[1], 10, [])[4]]
    params = GenerationParams(max_new_tokens=10, stop_ids=stop)
    asked: list[list[int]] = []  # follow-ups in the order they were asked: their results' order

    def follow(i: int, g) -> list[int] | None:
        if i >= 2:
            return None
        asked.append(prompts[i] + g.ids + [7, 8])  # a next turn extending the row's cache
        return asked[-1]

    got = native.native_generate(
        target, prompts, params, seed=0, rows=3, sync_every=3, prefill_tokens=30, attention="varlen",
        follow_up=follow, max_prompt_len=40,
    )  # fmt: skip
    everything = prompts + asked
    assert [g.ids for g in got] == [_reference_greedy(target, p, 10, stop) for p in everything]
    assert calls


def test_varlen_probe_catches_a_kernel_that_reads_past_each_rows_keys(monkeypatch):
    """The probe that admits the flash varlen kernel: its definition passes; a kernel that ignores the per-row key
    counts (reads every column of its slice), or fails, is refused with the reason."""
    import flashdraft.data.native as native

    cpu = torch.device("cpu")
    monkeypatch.setattr(native, "varlen_attention", native.varlen_reference)
    assert native.varlen_probe_error(cpu, torch.float32, 16) is None

    def all_columns(q, k, v, cu_q, cu_k, max_q, max_k, scale, used_k):
        return native.varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale, cu_k[1:] - cu_k[:-1])

    monkeypatch.setattr(native, "varlen_attention", all_columns)
    assert "differs from its definition" in native.varlen_probe_error(cpu, torch.float32, 16)

    def fails(*a):
        raise RuntimeError("seqused_k is not supported\nmore")

    monkeypatch.setattr(native, "varlen_attention", fails)
    assert native.varlen_probe_error(cpu, torch.float32, 16) == (
        "this torch's flash attention failed: seqused_k is not supported"
    )


def test_native_attention_choice():
    """varlen needs CUDA and fp16/bf16: asked for elsewhere it is refused with the reason; auto falls back to sdpa."""
    from flashdraft.data.native import BatchedNativeTarget

    target = tiny_target("llama")
    assert BatchedNativeTarget(target, rows=2, capacity=8).attention == "sdpa"
    with pytest.raises(ValueError, match="attention varlen: needs CUDA"):
        BatchedNativeTarget(target, rows=2, capacity=8, attention="varlen")
    with pytest.raises(ValueError, match="attention 'flash': use auto, sdpa or varlen"):
        BatchedNativeTarget(target, rows=2, capacity=8, attention="flash")


@pytest.mark.parametrize("reuse", [True, False])
def test_native_follow_ups_keep_their_row_cache_with_the_same_ids(family, reuse):
    """A follow-up prompt that extends its row's prompt and answer (a conversation's next turn) stays in that row
    and prefills only its new tokens (`BatchedNativeTarget.extend`); one that does not goes back to the queue.
    Either way every generation equals unbatched greedy decoding of its whole prompt."""
    from flashdraft.data.native import NativeStats, native_generate

    target = tiny_target(family)
    prompts = _prompts(97, [5, 12, 1, 9], seed=4)
    extra = _prompts(97, [3, 6, 2, 4], seed=5)
    stop = [_reference_greedy(target, prompts[1], 8, [])[2]]
    params = GenerationParams(max_new_tokens=8, stop_ids=stop)
    asked: dict[int, list[int]] = {}

    def follow(i: int, g) -> list[int] | None:
        if i >= 4:
            return None
        full = prompts[i] + g.ids + extra[i]  # its next turn: the history as generated, then new tokens
        if i == 3:
            full = [full[0] + 1] + full[1:]  # another history: not an extension of the row's cache
        asked[4 + len(asked)] = full
        return full

    stats = NativeStats()
    got = native_generate(
        target, prompts, params, seed=0, rows=2, sync_every=2, prefill_tokens=40, follow_up=follow,
        max_prompt_len=40, stats=stats, reuse_cache=reuse,
    )  # fmt: skip
    everything = prompts + [asked[k] for k in sorted(asked)]
    assert len(got) == len(everything) == 8
    assert [g.ids for g in got] == [_reference_greedy(target, p, 8, stop) for p in everything]
    kept = [i for i in range(3) if reuse]  # the first three extend their row's cache
    assert stats.extended_rows == len(kept)
    assert stats.reused_tokens == sum(len(prompts[i]) + len(got[i].ids) - 1 for i in kept)


def test_native_kept_rows_wait_for_a_group_refill_with_their_cache_intact():
    """With 16 rows a refill waits for 2 idle rows: a kept follow-up idles through decode steps (which write
    at its length) before its `extend`; its cached prompt and answer must survive them."""
    from flashdraft.data.native import NativeStats, native_generate

    target = tiny_target("llama")
    prompts = _prompts(97, [3 + (7 * i) % 13 for i in range(20)], seed=6)
    stop = [_reference_greedy(target, prompts[0], 6, [])[3]]  # answers end at different steps
    params = GenerationParams(max_new_tokens=6, stop_ids=stop)
    asked: list[int] = []  # the prompt each follow-up continues, in the order they were asked

    def follow(i: int, g) -> list[int] | None:
        if i >= 20:
            return None
        asked.append(i)
        return prompts[i] + g.ids + [5, 6]

    stats = NativeStats()
    got = native_generate(
        target, prompts, params, seed=0, rows=16, sync_every=1, follow_up=follow, max_prompt_len=30, stats=stats
    )  # fmt: skip
    first = [_reference_greedy(target, p, 6, stop) for p in prompts]
    want = first + [_reference_greedy(target, prompts[i] + first[i] + [5, 6], 6, stop) for i in asked]
    assert sorted(asked) == list(range(20)) and [g.ids for g in got] == want
    assert stats.extended_rows == 20


def test_native_stats_count_every_row_step_and_prefill():
    """NativeStats: each generated token after a row's first (which its prefill makes) is one generating
    row-step; rows × steps is the capacity, so the idle share (finished rows waiting for a refill) is the rest."""
    from flashdraft.data.native import NativeStats, native_generate

    target = tiny_target("llama")
    prompts = _prompts(97, [5, 12, 1, 9, 3, 17, 7], seed=3)
    params = GenerationParams(max_new_tokens=10, stop_ids=[])
    stats = NativeStats()
    got = native_generate(
        target, prompts, params, seed=0, rows=3, sync_every=3, prefill_tokens=30, stats=stats
    )
    assert stats.live_row_steps == sum(len(g.ids) - 1 for g in got) == 7 * 9
    assert stats.row_steps == 3 * stats.steps and stats.steps % 3 == 0 and stats.steps >= 7 * 9 / 3
    assert stats.prefill_rows == 7 and 3 <= stats.prefills <= 7 and stats.prefill_s > 0 and stats.decode_s > 0
    assert "decode steps" in stats.line() and "% of their rows generating" in stats.line()
    gen = LocalGenerator(target, params, engine="native", batch_size=3)
    gen.generate(prompts[:2], seed=0)
    gen.generate(prompts[2:4], seed=0)
    assert gen.native_stats is not None and gen.native_stats.prefill_rows == 4  # summed over calls


def test_native_sampling_is_seeded():
    from flashdraft.data.native import native_generate

    target = tiny_target("llama")
    prompts = _prompts(97, [4, 6, 3])
    params = GenerationParams(max_new_tokens=6, temperature=1.0, stop_ids=[2])
    a = native_generate(target, prompts, params, seed=7, rows=2)
    b = native_generate(target, prompts, params, seed=7, rows=2)
    c = native_generate(target, prompts, params, seed=8, rows=2)
    assert [g.ids for g in a] == [g.ids for g in b]
    assert [g.ids for g in a] != [g.ids for g in c]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_native_generation_with_cuda_graphs_matches_eager_steps(monkeypatch):
    """On CUDA the step replays a CUDA graph per span bucket; greedy output must equal the eager step's."""
    from flashdraft.data.native import BatchedNativeTarget, native_generate

    target = tiny_target("qwen3", dtype=torch.float32)
    target.model.to("cuda")
    prompts = _prompts(97, [5, 12, 1, 9, 3, 17, 7, 30, 2], seed=4)
    params = GenerationParams(max_new_tokens=40, stop_ids=[5])
    graphed = native_generate(target, prompts, params, seed=0, rows=4, sync_every=4)
    monkeypatch.setattr(
        BatchedNativeTarget, "step_graphed", lambda self, i, n, s, bucket=256: self.step(i, n, s)
    )
    eager = native_generate(target, prompts, params, seed=0, rows=4, sync_every=4)
    assert [g.ids for g in graphed] == [g.ids for g in eager]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_varlen_step_matches_sdpa_on_gpu(dtype):
    """On CUDA the flash varlen step (each row's own columns) gives the sdpa step's logits (one mask over the span)
    at the same cache state, up to the dtype's rounding: rows at spread lengths, GQA target, CUDA graphs."""
    from flashdraft.data.native import BatchedNativeTarget

    target = tiny_target("qwen3", dtype=dtype)
    target.model.to("cuda")
    rows, cap = 16, 300
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.randint(1, cap - 1, (rows,), generator=g, device="cuda")
    ids = torch.randint(3, 97, (rows,), generator=g, device="cuda")
    out = {}
    for attention in ("sdpa", "varlen"):
        net = BatchedNativeTarget(target, rows, cap, attention=attention)
        net.cache.copy_(torch.randn(net.cache.shape, generator=g.manual_seed(1), device="cuda", dtype=dtype))
        out[attention] = net.step_graphed(ids, lengths, int(lengths.max()) + 1).float().clone()
    scale = out["sdpa"].abs().max()
    assert (out["varlen"] - out["sdpa"]).abs().max() <= 0.02 * scale
    assert (out["varlen"].argmax(-1) == out["sdpa"].argmax(-1)).float().mean() >= 0.9
    # where the flash kernel runs (compute capability 8.0 on), auto takes it: its probe passed
    if torch.cuda.get_device_capability() >= (8, 0):
        from flashdraft.data.native import decode_attention

        assert decode_attention(target, "auto") == "varlen"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_native_generation_frees_its_cuda_cache_and_graphs_on_return():
    """The batch cache and the span buckets' CUDA graphs are freed when `native_generate` returns, with the GC off:
    a reference cycle through the net once kept them until a full collection, and a regeneration's next shard
    allocated its cache beside them (39 GiB twice on an 80 GB H100, 2026-12-06)."""
    import gc

    from flashdraft.data.native import native_generate

    target = tiny_target("qwen3", dtype=torch.float32)
    target.model.to("cuda")
    prompts = _prompts(97, [5, 12, 1, 9, 3, 17, 7, 30, 2], seed=4)
    params = GenerationParams(max_new_tokens=300, stop_ids=[5])
    rows, capacity = 4, 250_000 + 300  # max_prompt_len sizes the cache: 769 MB in float32
    cache_bytes = target.num_layers * 2 * rows * 2 * capacity * (target.hidden_size // 4) * 4
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    enabled = gc.isenabled()
    gc.disable()
    try:
        native_generate(target, prompts, params, seed=0, rows=rows, max_prompt_len=capacity - 300)
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - base
    finally:
        if enabled:
            gc.enable()
    assert left < cache_bytes // 4, (
        f"{left:,} bytes still allocated after return (the cache is {cache_bytes:,})"
    )


def test_the_removed_hf_engine_is_refused_with_the_reason():
    target = tiny_target("llama")
    with pytest.raises(ValueError, match="engine 'hf' was removed .*21 tok/s.*use 'native' or 'loop'"):
        LocalGenerator(target, GenerationParams(max_new_tokens=2), engine="hf")
    with pytest.raises(ValueError, match="unknown engine 'fast': use 'native' or 'loop'"):
        LocalGenerator(target, GenerationParams(max_new_tokens=2), engine="fast")
