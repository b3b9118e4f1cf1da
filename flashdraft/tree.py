"""DDTree: the draft tree built from one drafter pass, its verify mask/positions, and the walk.

docs/method.md §9. From the drafter's per-slot distributions q_1..q_L the tree holds the `budget`
most likely prefixes under Q(y) = Π q_i(y_i); the target verifies `[bonus] + nodes` in one
forward with an ancestor-only mask at positions start + depth, and the walk follows the
target's choice from the root while it matches a child. Used by `flashdraft generate
--method ddtree`, the eval harness and the fast engine, so all of them build the same tree.

    tree = build_tree(draft_logits, budget=8)           # draft_logits [L, V] for slots 1..L
    vis = tree_visibility(tree)                         # [N+1, N+1] ancestor-or-self
    pos = tree_positions(tree, start)                   # [N+1] start + depth
    path = walk_tree(tree, target_choice)               # accepted node indices, root first

Node numbering: node 0 is the root (the bonus token), nodes 1..N are the drafted tokens in
the order the heap popped them, so every parent index is smaller than its child's and the
nodes are sorted by (score desc, depth, rank). `tokens`/`depths`/`log_probs` are indexed from
node 1 (node i is `tokens[i - 1]`); `parents` is indexed from the root.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch


@dataclass
class Tree:
    tokens: torch.Tensor  # LongTensor [N], node i's token is tokens[i - 1]
    parents: list[int]  # N + 1 entries; parents[0] == -1 (root); parents[i] < i
    depths: torch.Tensor  # LongTensor [N], 1-based (a child of the root has depth 1 = block slot 1)
    log_probs: torch.Tensor  # float32 [N], cumulative log Q of the prefix ending at the node
    slot_ranks: torch.Tensor  # LongTensor [N], rank of the node's token in its slot's top-k (0 = argmax)
    # children[i] maps token id -> child node index of node i (N + 1 dicts, root first)
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])

    @property
    def num_nodes(self) -> int:
        """N, the nodes excluding the root (the budget actually used)."""
        return len(self.parents) - 1

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if self.num_nodes else 0


def build_tree(draft_logits: torch.Tensor, budget: int) -> Tree:
    """The `budget` most probable prefixes of the drafter's block, as a prefix-closed tree.

    draft_logits: [L, V], the drafter's logits for block slots 1..L (slot 0, the bonus, excluded).
    Scores are sums of float32 full-vocabulary log-softmax values (accumulated in Python floats,
    so every caller gets the same tree). Ties go to the shallower node, then the lower rank in
    its slot, then the earlier parent. One top-k per slot, then a best-first heap: popping a
    node pushes its next sibling and its first child, both of which score no better than it,
    so nodes come out in exactly the sorted order (O(budget · log budget)).
    """
    if draft_logits.dim() != 2:
        raise ValueError(f"draft_logits must be [L, V] (slots 1..L), got shape {tuple(draft_logits.shape)}")
    if budget < 0:
        raise ValueError(f"budget {budget} must be >= 0 (nodes excluding the root)")
    num_slots, vocab = draft_logits.shape
    device = draft_logits.device
    if budget == 0 or num_slots == 0:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return Tree(
            empty, [-1], empty.clone(), torch.empty(0, dtype=torch.float32, device=device), empty.clone()
        )
    k = min(budget, vocab)  # no path holds more than `budget` nodes, so per-slot top-budget suffices
    logp = torch.log_softmax(draft_logits.float(), dim=-1)  # [L, V] full-vocabulary normalisation
    top_lp, top_ids = logp.topk(k, dim=-1)  # [L, k], sorted descending
    # host sync: the one read of the drafter's distributions per round
    lp_rows: list[list[float]] = top_lp.tolist()
    id_rows: list[list[int]] = top_ids.tolist()

    return best_first(lp_rows, id_rows, budget, num_slots, device=device)  # type: ignore[return-value]


def best_first(
    lp_rows: list[list[float]],  # [S][k] per-slot top-k log-probs, sorted descending (S <= num_slots)
    id_rows: list[list[int]],  # [S][k] their token ids
    budget: int,
    num_slots: int,
    device: torch.device | str = "cpu",
) -> Tree | None:
    """The heap search behind `build_tree`, over per-slot top-k lists (the eval replay calls it
    with stored top-k). Only the first S = len(lp_rows) slots may be given: the result is None
    when the tree takes a node at slot S and so would need slot S+1."""
    have = len(lp_rows)
    k = len(lp_rows[0]) if have else 0
    tokens: list[int] = []
    parents: list[int] = [-1]
    depths: list[int] = []
    scores: list[float] = []
    ranks: list[int] = []
    children: list[dict[int, int]] = [{}]
    # heap entry: (-score, depth, rank, parent node, parent score); the first four order the nodes
    heap: list[tuple[float, int, int, int, float]] = [(-lp_rows[0][0], 1, 0, 0, 0.0)] if budget and k else []
    while heap and len(tokens) < budget:
        neg, depth, rank, parent, parent_score = heapq.heappop(heap)
        node = len(parents)
        tok = id_rows[depth - 1][rank]
        tokens.append(tok)
        parents.append(parent)
        depths.append(depth)
        scores.append(-neg)
        ranks.append(rank)
        children.append({})
        children[parent][tok] = node
        if rank + 1 < k:  # next sibling: same parent, next token of the same slot
            s = parent_score + lp_rows[depth - 1][rank + 1]
            heapq.heappush(heap, (-s, depth, rank + 1, parent, parent_score))
        if depth < num_slots:  # first child: the best token of the next slot
            if depth >= have:
                return None  # a node at the last given slot was taken: its first child needs the next slot
            s = -neg + lp_rows[depth][0]
            heapq.heappush(heap, (-s, depth + 1, 0, node, -neg))
    return Tree(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        parents=parents,
        depths=torch.tensor(depths, dtype=torch.long, device=device),
        log_probs=torch.tensor(scores, dtype=torch.float32, device=device),
        slot_ranks=torch.tensor(ranks, dtype=torch.long, device=device),
        children=children,
    )


def tree_visibility(tree: Tree) -> torch.Tensor:
    """BoolTensor [N+1, N+1]: row i is True at i and at each of its ancestors (root included)."""
    n1 = tree.num_nodes + 1
    device = tree.tokens.device
    par = torch.tensor([0] + tree.parents[1:], dtype=torch.long, device=device)  # root points to itself
    rows = torch.arange(n1, device=device)
    cur = rows.clone()
    vis = torch.zeros(n1, n1, dtype=torch.bool, device=device)
    for _ in range(tree.max_depth + 1):  # pointer jumping, one ancestor level per step
        vis[rows, cur] = True
        cur = par[cur]
    return vis


def tree_positions(tree: Tree, start: int) -> torch.Tensor:
    """LongTensor [N+1]: the root (bonus) at `start`, node i at start + depth(i)."""
    zero = torch.zeros(1, dtype=torch.long, device=tree.depths.device)
    return torch.cat([zero, tree.depths]) + start


def walk_tree(tree: Tree, target_choice: torch.Tensor | list[int]) -> list[int]:
    """Accepted node indices, root first: follow the target's choice while it matches a child.

    target_choice: [N+1], the target's token after the prefix ending at each node (root first).
    The target's choice at the last returned node is the next bonus.
    """
    choice = target_choice.tolist() if isinstance(target_choice, torch.Tensor) else list(target_choice)
    if len(choice) != tree.num_nodes + 1:
        raise ValueError(
            f"target_choice has {len(choice)} entries for a tree of {tree.num_nodes} nodes + root"
        )
    path = [0]
    node = 0
    while True:
        child = tree.children[node].get(int(choice[node]))
        if child is None:
            return path
        path.append(child)
        node = child
