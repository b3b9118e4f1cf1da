"""The DDTree tree built on the device, for the fast engine's tree phase: fixed shapes, no host read, so the
phase is one CUDA graph. The same nodes, in the same order, with the same parents as
`flashdraft.tree.build_tree` (the host heap the reference decoder uses), bit for bit.

    plan = TreePlan.make(budget, num_slots=B - 1, vocab=V, device=dev)   # once per budget
    tree = build_tree_device(draft_logits, plan)                        # tokens, parents, depths, log-probs
    write_tree_inputs(*draft_top(draft_logits, plan), plan, seq_len, bonus, kv_idx, hops, out)  # the phase

`compile_tree_writer` is the phase through torch.compile (what `FastEngine` runs under CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TreePlan:
    """Fixed index tables for building a `budget`-node tree over `num_slots` slots on the device.

    A node at depth d is (r, t): the r-th best depth-(d−1) prefix extended by the slot's t-th best
    token. Its score is S[r] + lq[t], so every (r', t') with r' ≤ r, t' ≤ t ranks before it:
    only pairs with (r+1)(t+1) ≤ budget can make a depth's top `budget` (≈ budget·ln budget pairs).
    Pairs are listed t-major so a stable sort breaks score ties by (rank, parent), like the heap.
    """

    budget: int
    num_slots: int
    k: int  # tokens kept per slot: min(budget, V)
    pair_t: torch.Tensor  # [M] token rank in its slot
    pair_r: torch.Tensor  # [M] parent position in the previous depth's list

    @classmethod
    def make(cls, budget: int, num_slots: int, vocab: int, device: torch.device) -> TreePlan:
        if budget < 1:
            raise ValueError(f"budget {budget} must be >= 1 for a tree round (use method='chain' or 'ar')")
        k = min(budget, vocab)
        prefixes = sum(k**d for d in range(1, min(num_slots, 12) + 1))  # capped: only "enough?" matters
        if prefixes < budget:
            raise ValueError(
                f"budget {budget} exceeds the {prefixes} prefixes a {num_slots}-slot block over {vocab} tokens "
                "has: lower the budget"
            )
        ts, rs = [], []
        for t in range(k):
            for r in range(budget // (t + 1)):  # (r + 1)(t + 1) <= budget
                ts.append(t)
                rs.append(r)
        as_long = dict(dtype=torch.long, device=device)
        return cls(budget, num_slots, k, torch.tensor(ts, **as_long), torch.tensor(rs, **as_long))


@dataclass
class DeviceTree:
    """The tree as fixed-shape device tensors; node 0 is the root, nodes 1..N in build_tree's order."""

    tokens: torch.Tensor  # [N] node i's token is tokens[i − 1]
    parents: torch.Tensor  # [N+1] parents[0] = 0 (the root points at itself)
    depths: torch.Tensor  # [N+1] root 0
    log_probs: torch.Tensor  # float64 [N] cumulative log Q


def draft_top(draft_logits: torch.Tensor, plan: TreePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Each slot's top k: float32 log-probs [L, k] (descending: rank = column) and token ids [L, k].

    `build_tree`'s own float32 log-softmax, always eager: inductor's log-softmax sums in another order,
    and a last-bit difference in a log-prob can reorder the tree, so the compiled tree phase
    (`compile_tree_writer`) starts from this one too.
    """
    num_slots = min(plan.num_slots, plan.budget)  # a depth-d node needs d nodes on its path: d <= budget
    logp = torch.log_softmax(draft_logits[:num_slots].float(), dim=-1)  # [L, V] as build_tree computes it
    top_lp, top_ids = logp.topk(plan.k, dim=-1)  # [L, k]
    return top_lp, top_ids


def select_tree(top_lp: torch.Tensor, top_ids: torch.Tensor, plan: TreePlan) -> DeviceTree:
    """The tree over `draft_top`'s lists: see `build_tree_device`."""
    n = plan.budget
    num_slots = top_lp.shape[0]
    device = top_lp.device
    lq = top_lp.double()  # [L, k]
    scores = torch.full((num_slots, n), float("nan"), dtype=torch.float64, device=device)  # per-depth lists
    chosen = torch.zeros(num_slots, n, dtype=torch.long, device=device)  # depth >= 2: index into the pairs
    scores[0, : plan.k] = lq[0] + 0.0  # depth 1: the slot's top tokens, already in (score, rank) order
    for d in range(1, num_slots):  # few kernels per depth: this loop is most of the build's time
        cand = scores[d - 1, plan.pair_r] + lq[d, plan.pair_t]  # [M] parent score + token log-prob
        best = torch.sort(-cand, stable=True)  # descending, NaN ("no entry") last
        scores[d] = -best.values[:n]
        chosen[d] = best.indices[:n]
    flat = torch.sort(-scores.view(-1), stable=True).indices[:n]  # [n] flat = depth·n + pos
    depth0 = flat // n  # [n] 0-based depth
    pair = chosen.view(-1)[flat]  # [n] (meaningless at depth 1)
    rank = torch.where(depth0 == 0, flat, plan.pair_t[pair])  # token rank in its slot (depth 1: pos)
    node_of_flat = torch.zeros(num_slots * n, dtype=torch.long, device=device)
    node_of_flat[flat] = torch.arange(1, n + 1, device=device)  # 1-based node index of each selected entry
    parent_flat = (depth0 - 1).clamp(min=0) * n + plan.pair_r[pair]
    parents = torch.where(depth0 == 0, torch.zeros_like(flat), node_of_flat[parent_flat])  # [n]
    tokens = top_ids[depth0, rank]  # [n]
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return DeviceTree(
        tokens=tokens,
        parents=torch.cat([zero, parents]),
        depths=torch.cat([zero, depth0 + 1]),
        log_probs=scores.view(-1)[flat],
    )


def build_tree_device(draft_logits: torch.Tensor, plan: TreePlan) -> DeviceTree:
    """`flashdraft.tree.build_tree` without the host: same nodes, same order, same parents.

    Depth by depth, the best `budget` prefixes of each depth (a stable sort of the candidate
    pairs), then a stable sort of all depths' lists (depth-major, so ties go to the shallower
    node). Scores are float64 sums of float32 log-softmax values, root first — bit-identical to
    the heap's Python floats. No host sync, fixed shapes: capturable in a CUDA graph.
    Where k < budget, depth 1 has budget − k empty places: NaN, which the stable sorts of the
    negated scores put after every real entry, -inf ones (tokens of probability 0) included.
    (Measured on the H200, 2026-12-03, benchmarks/RESULTS.md "Decode speed": counting stable ranks instead of
    sorting was slower at budgets 8/32/512, and inductor could not compile it.)
    """
    return select_tree(*draft_top(draft_logits, plan), plan)


def visibility_device(parents: torch.Tensor, hops: int) -> torch.Tensor:
    """Bool [N+1, N+1] ancestor-or-self (`hops` ≥ max depth + 1), no host sync.

    Row i's ancestors 0..hops−1 (the root is its own parent), compared with every column: hops − 1
    gathers, a stack and a compare-reduction, which inductor can fuse, where writing each hop's
    ancestors into the matrix (pointer jumping with index_put) was two kernels per hop, each scatter
    depending on the last.
    """
    n1 = parents.shape[0]
    cur = torch.arange(n1, device=parents.device)
    anc = [cur]
    for _ in range(hops - 1):
        cur = parents[cur]
        anc.append(cur)
    cols = torch.arange(n1, device=parents.device)
    return (torch.stack(anc)[:, :, None] == cols).any(dim=0)  # [hops, N+1, 1] vs [N+1] -> [N+1, N+1]


@dataclass
class TreeInputs:
    """The tree phase's static outputs, written in place: verify reads the first four, commit the last two."""

    tokens: torch.Tensor  # [N+1] the bonus, then the nodes' tokens
    positions: torch.Tensor  # [N+1] seq_len + depth
    rows: torch.Tensor  # [N+1] cache rows seq_len .. seq_len + N
    allowed: torch.Tensor  # bool [N+1, cap] committed prefix + ancestors-or-self
    parents: torch.Tensor  # [N+1]
    depths: torch.Tensor  # [N+1]


def write_tree_inputs(
    top_lp: torch.Tensor,  # [L, k] `draft_top`'s
    top_ids: torch.Tensor,  # [L, k]
    plan: TreePlan,
    seq_len: torch.Tensor,  # [1] the engine's committed length (the bonus sits there)
    bonus: torch.Tensor,  # [1]
    kv_idx: torch.Tensor,  # [cap] arange
    hops: int,  # >= the deepest node's depth + 1
    out: TreeInputs,
) -> DeviceTree:
    """The DDTree phase after `draft_top`: the tree, its visibility, the verify inputs — fixed shapes, no host read."""
    budget = plan.budget
    tree = select_tree(top_lp, top_ids, plan)
    out.parents.copy_(tree.parents)
    out.depths.copy_(tree.depths)
    vis = visibility_device(tree.parents, hops)  # [N+1, N+1]
    out.tokens.copy_(torch.cat([bonus, tree.tokens]))
    out.positions.copy_(seq_len + tree.depths)
    out.rows.copy_(seq_len + torch.arange(budget + 1, device=kv_idx.device))
    rel = kv_idx - seq_len  # [cap] row index inside the tree block
    in_block = (rel >= 0) & (rel <= budget)
    tree_part = vis[:, rel.clamp(0, budget)] & in_block[None]  # [N+1, cap]
    out.allowed.copy_((rel < 0)[None] | tree_part)
    return tree


# dynamo counts compilations per code object, not per torch.compile call: every new shape (budget, slots,
# cache columns) compiles `write_tree_inputs` once more, and the 9th would pass the default recompile_limit
# (8), a hard error under fullgraph. Each shape compiles once: nothing else it guards on changes between rounds.
TREE_COMPILE_LIMIT = 256


def compile_tree_writer() -> Callable[..., DeviceTree]:
    """`write_tree_inputs` through torch.compile (fullgraph, static shapes), for `FastEngine(compile_tree=True)`.

    The eager phase is launch-bound: several small kernels per depth, up to 15 depths. Compiled, each
    depth's gathers, add and negation fuse into one kernel beside its sort (on CUDA inductor sorts lists of
    <= 512 entries in its own Triton kernel, that prologue included; longer ones stay aten's sort), and
    the bookkeeping, visibility and mask writes after the last sort fuse into a few. Same stable sorts,
    same float64 adds: the same tree bit for bit (the sort-free build of 1668e76 did not compile).
    It compiles on its first call, which must come before a CUDA-graph capture: `_Phase`'s warm-up
    makes that call. `draft_top` stays outside (its docstring).
    """
    compiled = torch.compile(write_tree_inputs, fullgraph=True, dynamic=False)

    def write(*args: Any) -> DeviceTree:
        # no_grad: dynamo guards on the grad mode, and engine.warmup() runs outside generate's no_grad
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=TREE_COMPILE_LIMIT):
            return compiled(*args)

    return write
