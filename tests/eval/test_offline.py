"""Offline τ == online τ: the replay commits the same tokens with the same acceptance lengths as
`flashdraft.decode.generate` (chain and DDTree budgets, T=0, float64, tiny Llama/Qwen3 targets)."""

from __future__ import annotations

import pytest
import torch

from flashdraft.decode.generate import generate
from flashdraft.eval.evaluate import evaluate
from flashdraft.eval.offline import ReplayItem, replay_batch, replay_sample, teacher_forced
from flashdraft.eval.replay import Method, build_tree_from_topk, methods_for
from flashdraft.tree import Tree, build_tree
from tests.conftest import tiny_drafter, tiny_target

BUDGETS = [1, 3, 8, 32]
MAX_NEW = 40


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, vocab - 1, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


@pytest.mark.parametrize("stop", [[], [5]])
def test_offline_equals_online(family: str, stop: list[int]) -> None:
    # a small vocabulary makes random drafts match often, so acceptance lengths vary (1..B)
    target = tiny_target(family, vocab=16)
    drafter = tiny_drafter(target, block_size=8)
    methods = methods_for(BUDGETS, 2)
    accepted_more = {m.name: 0 for m in methods if m.kind != "topk"}
    for prompt in _prompts(3, 16, seed=1 if stop else 0):
        ref = generate(target, None, prompt, max_new_tokens=MAX_NEW, method="ar", stop_token_ids=stop).tokens
        tf = teacher_forced(target, prompt + ref, drafter.target_layer_ids)
        res = replay_sample(target, drafter, tf, len(prompt), ref, methods)
        for m in methods:
            if m.kind == "topk":
                continue
            online = generate(
                target,
                drafter,
                prompt,
                max_new_tokens=MAX_NEW,
                method=m.kind,
                budget=m.size if m.kind == "ddtree" else None,
                stop_token_ids=stop,
            )
            assert online.tokens == ref, m.name
            assert res.methods[m.name].acceptance_lengths == online.acceptance_lengths, m.name
            assert sum(online.acceptance_lengths) == len(ref) - 1
            accepted_more[m.name] += sum(t > 1 for t in online.acceptance_lengths)
    # the comparison is only meaningful if drafts were accepted
    assert accepted_more["chain"] > 0 and accepted_more["ddtree-32"] > 5, accepted_more


def test_evaluate_matches_online_mean_tau(tmp_path) -> None:
    target = tiny_target("qwen3", vocab=16)
    drafter = tiny_drafter(target, block_size=8)
    prompts = _prompts(3, 16, seed=2)
    report = evaluate(
        target,
        {"d": drafter},
        prompts,
        budgets=[4, 16],
        topk=[2, 4],
        max_new_tokens=MAX_NEW,
        stop_token_ids=[],
        cache_dir=tmp_path,
        progress=False,
        slot_stride=1,
        group=2,
    )
    d = report.drafters["d"]
    for name, kind, budget in [
        ("chain", "chain", None),
        ("ddtree-4", "ddtree", 4),
        ("ddtree-16", "ddtree", 16),
    ]:
        taus = []
        for p in prompts:
            r = generate(
                target, drafter, p, max_new_tokens=MAX_NEW, method=kind, budget=budget, stop_token_ids=[]
            )
            taus.append(r.mean_acceptance)
        assert d.methods[name].tau == pytest.approx(sum(taus) / len(taus), abs=1e-12), name
    assert sum(d.methods["ddtree-16"].histogram) == d.methods["ddtree-16"].rounds
    assert max(i + 1 for i, c in enumerate(d.methods["ddtree-4"].histogram) if c) <= 5  # τ <= budget + 1
    # top-k streak with k=4 accepts at least what a 4-node tree accepts... per round it dominates chain
    assert d.methods["topk-4"].tau >= d.methods["chain"].tau
    assert d.methods["topk-4"].tau >= d.methods["topk-2"].tau
    assert report.references.agreement_rate == 1.0  # float64: incremental == teacher-forced argmax
    assert len(d.slot_accuracy) == 7 and d.slot_accuracy_conditional[0] == pytest.approx(d.slot_accuracy[0])


@pytest.mark.parametrize("budget", [1, 2, 7, 30, 64])
def test_tree_from_topk_is_build_tree(budget: int) -> None:
    g = torch.Generator().manual_seed(budget)
    logits = torch.randn(7, 80, generator=g, dtype=torch.float64) * 2
    ref = build_tree(logits, budget)
    top_lp, top_ids = torch.log_softmax(logits.float(), -1).topk(64, dim=-1)
    mine = build_tree_from_topk(top_lp, top_ids, budget)
    assert mine.tokens.tolist() == ref.tokens.tolist()
    assert mine.parents == ref.parents
    assert mine.children == ref.children
    assert torch.equal(mine.log_probs, ref.log_probs)


def test_method_names() -> None:
    assert Method.parse("ddtree-8").name == "ddtree-8" and Method.parse("topk-8").kind == "topk"
    with pytest.raises(ValueError, match="ddtree-N"):
        Method.parse("tree8")


def test_lazy_head_slots_change_nothing() -> None:
    """The head on the first slots only (rest on demand) decides every round as the full head does."""
    target = tiny_target("llama", vocab=16)
    drafter = tiny_drafter(target, block_size=8)
    methods = methods_for([2, 8, 32], [2, 4])
    items = []
    for i, prompt in enumerate(_prompts(4, 16, seed=3)):
        ref = generate(target, None, prompt, max_new_tokens=MAX_NEW, method="ar", stop_token_ids=[]).tokens
        items.append(
            ReplayItem(
                f"s{i}", teacher_forced(target, prompt + ref, drafter.target_layer_ids), len(prompt), ref
            )
        )
    full = replay_batch(target, drafter, items, methods, first_slots=7, slot_stride=1)
    lazy = replay_batch(target, drafter, items[:1], methods, first_slots=1, slot_stride=1)
    lazy += replay_batch(target, drafter, items[1:], methods, first_slots=1, slot_stride=1)
    for f, z in zip(full, lazy, strict=True):
        assert f.slot_correct == z.slot_correct and f.slot_cond_total == z.slot_cond_total
        for name in f.methods:
            assert f.methods[name].acceptance_lengths == z.methods[name].acceptance_lengths, name
            assert f.methods[name].predicted == pytest.approx(z.methods[name].predicted, abs=1e-4), name
    assert sum(r.drafter_forwards for r in lazy) > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_smaller_budget_is_a_prefix_of_the_largest(seed: int) -> None:
    """What TreeWalk relies on: build_tree(n) holds exactly nodes 1..n of build_tree(N), N > n."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 40, generator=g) * (1 + seed)
    big = build_tree(logits, 64)
    for n in (1, 3, 8, 20, 40):
        small = build_tree(logits, n)
        assert small.tokens.tolist() == big.tokens[:n].tolist()
        assert small.parents == big.parents[: n + 1]


def test_fast_paths_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager head over all slots, a narrow stored top-K (widened on demand) and the cropped context
    decide every round as the lazy, full-width replay does (the pre-speedup algorithm)."""
    from flashdraft.eval import offline

    widened = []
    real_widen = offline.DrafterRows.widen
    monkeypatch.setattr(
        offline.DrafterRows, "widen", lambda self, st: (widened.append(1), real_widen(self, st))
    )
    target = tiny_target("qwen3", vocab=16)
    drafter = tiny_drafter(target, block_size=8)
    methods = methods_for([2, 8, 32], [2, 3])
    items = []
    for i, prompt in enumerate(_prompts(3, 16, seed=4)):
        ref = generate(target, None, prompt, max_new_tokens=MAX_NEW, method="ar", stop_token_ids=[]).tokens
        tf = teacher_forced(target, prompt + ref, drafter.target_layer_ids, head_from=len(prompt) - 1)
        items.append(ReplayItem(f"s{i}", tf, len(prompt), ref))
    base = replay_batch(target, drafter, items, methods, topk_width=None, eager=False)
    for kw in (
        {"topk_width": 3, "eager": True},
        {"topk_width": 3, "eager": None},
        {"topk_width": None, "eager": True},
    ):
        fast = replay_batch(target, drafter, items, methods, **kw)
        for f, z in zip(base, fast, strict=True):
            assert (f.slot_total, f.slot_correct, f.slot_cond_total, f.slot_cond_correct) == (
                z.slot_total,
                z.slot_correct,
                z.slot_cond_total,
                z.slot_cond_correct,
            ), kw
            for name in f.methods:
                assert f.methods[name].acceptance_lengths == z.methods[name].acceptance_lengths, (kw, name)
                assert f.methods[name].predicted == pytest.approx(z.methods[name].predicted, abs=1e-12), (
                    kw,
                    name,
                )
    assert widened, "the narrow top-K never needed widening: the test does not exercise it"
    assert any(t > 1 for r in base for t in r.methods["ddtree-32"].acceptance_lengths)


def tree_path(tree: Tree, ref: list[int]) -> list[int]:
    """The nodes of `tree` along `ref` from the root, as far as its children hold the reference tokens."""
    path, node = [], 0
    for tok in ref:
        if tok not in tree.children[node]:
            break
        node = tree.children[node][tok]
        path.append(node)
    return path


@pytest.mark.parametrize("seed", range(6))
def test_tree_walk_matches_build_tree(seed: int) -> None:
    """The replay's own best-first walk == build_tree + walk along the reference; a narrow top-K
    gives the same walk or says NEED_WIDTH, never a different answer."""
    from flashdraft.eval.replay import NEED_WIDTH, DraftRows, tree_walk

    g = torch.Generator().manual_seed(seed)
    slots, vocab = 6, 30
    logits = torch.randn(slots, vocab, generator=g, dtype=torch.float64) * (0.5 + seed)
    lp = torch.log_softmax(logits.float(), -1)
    for budget in (1, 4, 16, 64):
        tree = build_tree(logits, budget)
        # a reference that follows the tree for a while (the most probable child), then leaves it
        ref, node = [], 0
        while tree.children[node] and len(ref) < 3:
            tok, node = min(tree.children[node].items(), key=lambda kv: kv[1])
            ref.append(tok)
        ref.append(-1)
        want_path = tree_path(tree, ref)
        want_cum = torch.exp(tree.log_probs.double()).cumsum(0).tolist()
        answers = 0
        for width in (1, 2, 5, min(budget, vocab)):
            top_lp, top_ids = lp.topk(width, dim=-1)
            walk = tree_walk(
                DraftRows(top_lp.max(-1).indices.tolist(), top_lp, top_ids, vocab, slots), ref, budget
            )
            if walk is NEED_WIDTH:
                assert width < min(budget, vocab)
                continue
            assert walk.path == want_path and walk.cum_q == want_cum, (budget, width)
            answers += 1
        assert answers >= 1
        # fewer slots than the tree reaches: None, as best_first answers
        if tree.max_depth > 1:
            top_lp, top_ids = lp.topk(min(budget, vocab), dim=-1)
            rows = DraftRows([0], top_lp[:1], top_ids[:1], vocab, slots)
            assert tree_walk(rows, ref, budget) is None


@pytest.mark.parametrize("seed", range(4))
def test_a_walk_advanced_budget_by_budget_equals_build_tree_at_every_budget(seed: int) -> None:
    """The replay asks one start's walk for its budgets in growing order: popping on from a smaller budget
    gives build_tree's tree of the larger one (path along the reference, surrogate sums), and a narrow top-K
    answers NEED_WIDTH rather than a different tree."""
    from flashdraft.eval.replay import NEED_WIDTH, DraftRows, TreeWalk

    g = torch.Generator().manual_seed(100 + seed)
    slots, vocab, big = 7, 40, 64
    logits = torch.randn(slots, vocab, generator=g, dtype=torch.float64) * (1.0 + seed)
    lp = torch.log_softmax(logits.float(), -1)
    ref = [int(lp[j].topk(2).indices[j % 2]) for j in range(slots)]  # ranks 0, 1, 0, 1, ...: a deep path
    answered = 0
    for width in (3, 8, vocab):
        top_lp, top_ids = lp.topk(width, dim=-1)
        walk = TreeWalk(DraftRows(top_lp[:, 0].tolist(), top_lp, top_ids, vocab, slots), ref, big)
        for budget in (1, 2, 4, 8, 16, 32, 64):
            got = walk.advance(budget)
            if got is NEED_WIDTH:
                assert width < min(big, vocab)
                break
            tree = build_tree(logits, budget)
            assert isinstance(got, TreeWalk) and got.path == tree_path(tree, ref), (width, budget)
            assert got.cum_q == torch.exp(tree.log_probs.double()).cumsum(0).tolist()
            answered += 1
    assert answered > 7  # the full width answers every budget; the narrow ones some
