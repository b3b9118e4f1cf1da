"""build_tree vs brute-force enumeration; hand-made trees for nodes, masks, positions and the walk."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from flashdraft.tree import build_tree, tree_positions, tree_visibility, walk_tree


def brute_force_top(draft_logits: torch.Tensor, budget: int) -> list[tuple[int, ...]]:
    """Every prefix of every length, scored like build_tree (float32 log-softmax, summed root first)."""
    logp = torch.log_softmax(draft_logits.float(), dim=-1).tolist()
    num_slots, vocab = draft_logits.shape
    scored = []
    for depth in range(1, num_slots + 1):
        for prefix in itertools.product(range(vocab), repeat=depth):
            s = 0.0
            for i, t in enumerate(prefix):
                s += logp[i][t]
            scored.append((-s, depth, prefix))
    scored.sort()
    return [p for _, _, p in scored[:budget]]


def node_prefixes(tree) -> list[tuple[int, ...]]:
    toks = [None] + tree.tokens.tolist()
    out = []
    for i in range(1, tree.num_nodes + 1):
        path, n = [], i
        while n != 0:
            path.append(toks[n])
            n = tree.parents[n]
        out.append(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("num_slots, vocab", [(3, 7), (4, 5), (2, 12)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_build_tree_equals_brute_force(num_slots, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_slots, vocab, generator=g) * 2.0
    total = sum(vocab**d for d in range(1, num_slots + 1))
    for budget in [0, 1, 2, 4, 8, 15, 32, 64, 100, 128, 200, 256]:
        budget = min(budget, total)
        tree = build_tree(logits, budget)
        assert tree.num_nodes == budget
        got = node_prefixes(tree)
        want = brute_force_top(logits, budget)
        assert got == want, f"budget {budget}: tree differs from brute force"
        # structure invariants
        assert tree.parents[0] == -1
        assert all(0 <= tree.parents[i] < i for i in range(1, budget + 1))
        assert tree.tokens.shape == (budget,) and tree.depths.shape == (budget,)
        assert [len(p) for p in got] == tree.depths.tolist()
        # log_probs are the cumulative scores, non-increasing in node order
        lp = torch.log_softmax(logits.float(), -1)
        for i, p in enumerate(got):
            expect = sum(lp[d, t].item() for d, t in enumerate(p))
            assert math.isclose(tree.log_probs[i].item(), expect, rel_tol=1e-6, abs_tol=1e-6)
        assert (tree.log_probs[1:] <= tree.log_probs[:-1] + 1e-7).all()


def test_budget_larger_than_vocab_and_all_prefixes():
    logits = torch.randn(2, 3)
    tree = build_tree(logits, 50)  # only 3 + 9 prefixes exist
    assert tree.num_nodes == 12
    assert sorted(node_prefixes(tree)) == sorted(brute_force_top(logits, 12))


def test_budget_zero_is_root_only():
    tree = build_tree(torch.randn(5, 11), 0)
    assert tree.parents == [-1] and tree.num_nodes == 0 and tree.tokens.numel() == 0
    assert tree_visibility(tree).tolist() == [[True]]
    assert tree_positions(tree, 7).tolist() == [7]
    assert walk_tree(tree, torch.tensor([3])) == [0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="budget"):
        build_tree(torch.randn(3, 5), -1)
    with pytest.raises(ValueError, match=r"\[L, V\]"):
        build_tree(torch.randn(1, 3, 5), 4)


def test_ties_go_to_shallower_node_then_lower_rank():
    neg = -1e9
    # slot 1: tokens 0 and 1 each have probability 1/2 (identical logits); slot 2: token 3 is certain
    logits = torch.tensor([[0.0, 0.0, neg, neg], [neg, neg, neg, 0.0]])
    tree = build_tree(logits, 2)
    # after the rank-0 node, its child (score log 1/2 + 0) ties with the rank-1 sibling: shallower wins
    assert tree.depths.tolist() == [1, 1]
    assert tree.slot_ranks.tolist() == [0, 1]
    assert tree.parents == [-1, 0, 0]
    tree = build_tree(logits, 4)
    assert tree.depths.tolist() == [1, 1, 2, 2]
    assert tree.parents == [-1, 0, 0, 1, 2]  # the child of the rank-0 node comes first
    assert tree.tokens[2:].tolist() == [3, 3]


def test_hand_made_tree_nodes_mask_positions_and_walk():
    # slot 1: p(5)=.6 p(2)=.3 p(else) small; slot 2: p(7)=.7 p(1)=.2
    lp1 = torch.full((9,), -12.0)
    lp1[5], lp1[2] = math.log(0.6), math.log(0.3)
    lp2 = torch.full((9,), -12.0)
    lp2[7], lp2[1] = math.log(0.7), math.log(0.2)
    tree = build_tree(torch.stack([lp1, lp2]), 4)
    # prefixes by probability: (5)=.6, (5,7)=.42, (2)=.3, (2,7)=.21, then (5,1)=.12
    assert node_prefixes(tree) == [(5,), (5, 7), (2,), (2, 7)]
    assert tree.tokens.tolist() == [5, 7, 2, 7]
    assert tree.parents == [-1, 0, 1, 0, 3]
    assert tree.depths.tolist() == [1, 2, 1, 2]
    assert tree.slot_ranks.tolist() == [0, 0, 1, 0]
    vis = tree_visibility(tree).int().tolist()
    assert vis == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 0, 0, 1, 0],
        [1, 0, 0, 1, 1],
    ]
    assert tree_positions(tree, 10).tolist() == [10, 11, 12, 11, 12]
    # walk: target picks 2 at the root, 7 after 2, then 4 (no such child) -> path root, node 3, node 4
    assert walk_tree(tree, torch.tensor([2, 0, 0, 7, 4])) == [0, 3, 4]
    assert walk_tree(tree, [5, 1, 0, 0, 0]) == [0, 1]  # (5, 1) is not in the tree
    assert walk_tree(tree, [8, 7, 0, 7, 0]) == [0]
    with pytest.raises(ValueError, match="entries"):
        walk_tree(tree, [1, 2])


def test_visibility_matches_parent_chain_on_random_trees():
    g = torch.Generator().manual_seed(5)
    for budget in (1, 7, 33, 90):
        tree = build_tree(torch.randn(6, 9, generator=g), budget)
        vis = tree_visibility(tree)
        for i in range(tree.num_nodes + 1):
            anc, n = {i}, i
            while n > 0:
                n = tree.parents[n]
                anc.add(n)
            assert set(torch.nonzero(vis[i]).flatten().tolist()) == anc
        pos = tree_positions(tree, 3)
        assert (pos == vis.sum(-1) - 1 + 3).all()  # depth == number of strict ancestors
