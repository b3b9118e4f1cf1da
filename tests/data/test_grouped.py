"""The faster loop paths give the reference's ids: preallocated K/V, finished rows dropped, batches decoded together."""

from __future__ import annotations

import pytest
import torch

from flashdraft.cache import crop, new_cache, select_rows
from flashdraft.data.generate import GenerationParams, LocalGenerator, loop_generate
from flashdraft.data.grouped import grouped_generate, grouped_support_error
from tests.conftest import tiny_target


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 30, (n,), generator=g).tolist()
    return [torch.randint(3, 97, (k,), generator=g).tolist() for k in lens]


def _frequent_stops(target, prompts: list[list[int]], n: int) -> list[int]:
    """Two ids the target emits often, so that rows stop at many different steps (rows get dropped)."""
    free = loop_generate(target, prompts, GenerationParams(max_new_tokens=n), seed=0)
    counts = torch.bincount(torch.tensor([t for g in free for t in g.ids]), minlength=97)
    return counts.topk(2).indices.tolist()


def _reference(target, batches, params) -> list[list[list[int]]]:
    """One batch at a time, whole batch to the end, a DynamicCache that concatenates (the old loop)."""
    return [[g.ids for g in loop_generate(target, b, params, seed=0, drop_finished=False)] for b in batches]


def test_preallocated_cache_matches_dynamic_cache():
    target = tiny_target("llama")
    ids = torch.randint(3, 97, (4, 9))
    a, b = new_cache(), new_cache(capacity=10)
    for cache in (a, b):
        target.forward(ids, cache=cache, logits="none")
    x = torch.randint(3, 97, (4, 1))
    for step in range(6):  # past the capacity: the buffer grows
        if step == 2:
            crop(a, 8), crop(b, 8)  # a slice of the buffer: written on in place
        if step == 4:
            rows = torch.tensor([0, 3])
            select_rows(a, rows), select_rows(b, rows)  # a new tensor: copied into a fresh buffer
            x = x[rows]
        pos = torch.full((x.shape[0], 1), a.get_seq_length())
        la = target.forward(x, position_ids=pos, cache=a, logits="last").logits
        lb = target.forward(x, position_ids=pos, cache=b, logits="last").logits
        assert torch.equal(la, lb)
        for p, q in zip(a.layers, b.layers, strict=True):
            assert torch.equal(p.keys, q.keys) and torch.equal(p.values, q.values)
        x = la[:, -1].argmax(-1, keepdim=True)


@pytest.mark.parametrize("batch", [8, 12, 5])  # 5: rows are never dropped (ROW_QUANTUM), still the same ids
def test_loop_dropping_finished_rows_keeps_ids(batch):
    target = tiny_target("llama")
    prompts = _prompts(batch)
    params = GenerationParams(max_new_tokens=24, stop_ids=_frequent_stops(target, prompts, 24))
    got = [g.ids for g in loop_generate(target, prompts, params, seed=0, sync_every=2)]
    want = [g.ids for g in loop_generate(target, prompts, params, seed=0, sync_every=2, drop_finished=False)]
    assert got == want
    stopped = sum(g[-1] in params.stop_ids for g in want)
    assert 0 < stopped < batch or batch == 5  # both kinds of rows, so rows were dropped mid-way


@pytest.mark.parametrize("groups", [2, 3, 7])
def test_grouped_generate_equals_one_batch_at_a_time(groups):
    target = tiny_target("llama")
    prompts = _prompts(45, seed=1)
    params = GenerationParams(max_new_tokens=20, stop_ids=_frequent_stops(target, prompts, 20))
    # batches of 8 and one of 5 (alone: its row count is not one that may change); stops at many steps
    batches = [prompts[i : i + 8] for i in range(0, 45, 8)]
    want = _reference(target, batches, params)
    seen: list[int] = []
    got = grouped_generate(
        target, batches, params, groups=groups, sync_every=3, on_batch=lambda k, _: seen.append(k)
    )
    assert [[g.ids for g in b] for b in got] == want
    assert sorted(seen) == list(range(len(batches)))
    assert any(g[-1] in params.stop_ids for b in want for g in b)


def test_local_generator_groups_equal_one_at_a_time():
    target = tiny_target("llama")
    prompts = _prompts(30, seed=2)
    params = GenerationParams(max_new_tokens=12, stop_ids=_frequent_stops(target, prompts, 12))
    one = LocalGenerator(target, params, batch_size=4).generate(prompts, seed=0)
    batches: list[int] = []
    three = LocalGenerator(target, params, batch_size=4, groups=3).generate(
        prompts, seed=0, on_batch=lambda res: batches.append(len(res))
    )
    assert [g.ids for g in three] == [g.ids for g in one]
    assert sum(batches) == 30


def test_grouped_support():
    params = GenerationParams(max_new_tokens=4)
    assert grouped_support_error(tiny_target("llama"), params) is None
    assert "Llama" in grouped_support_error(tiny_target("qwen3"), params)
    sampled = GenerationParams(max_new_tokens=4, temperature=1.0)
    assert "sampling" in grouped_support_error(tiny_target("llama"), sampled)
    with pytest.raises(ValueError, match="sampling"):
        grouped_generate(tiny_target("llama"), [[[3, 4]]], sampled)
    # LocalGenerator falls back to one batch at a time where grouping does not apply
    out = LocalGenerator(tiny_target("qwen3"), params, batch_size=2, groups=3).generate([[3, 4], [5]], seed=0)
    assert [len(g.ids) for g in out] == [4, 4]


def test_cache_keyword_reads_either_transformers_spelling():
    """transformers 5.2x passes the cache as `cache=`, 5.17 (the GPU image) as `past_key_values=`: the grouped
    step's `create_causal_mask` call and TargetModel's forward read the spelling off the signature."""
    from flashdraft.cache import cache_keyword

    def mask_new(config, inputs_embeds, attention_mask, cache, position_ids=None): ...

    def mask_old(config, inputs_embeds, attention_mask, past_key_values, position_ids=None): ...

    assert (cache_keyword(mask_new), cache_keyword(mask_old)) == ("cache", "past_key_values")
    target = tiny_target("llama")
    assert cache_keyword(target.model) in ("cache", "past_key_values")
