"""Replaying decode rounds against a reference: chain, DDTree budgets and the top-k streak.

Given the drafter's per-slot argmax and top-K log-probs at a round start s (offline.py
computes them), the reference decides every round exactly as `flashdraft.decode.generate`
would at T=0 (the reference token *is* the target's choice) and in distribution at T>0:

    method = Method.parse("ddtree-64")
    outcome = accept(method, rows, reference_slots)       # accepted drafts + the surrogate's prediction

Method names (never confuse the last two — docs/method.md §9.3):
    chain       vanilla DFlash: accept the longest prefix where draft == reference token
    ddtree-N    a DDTree of N nodes (root excluded), built exactly as `flashdraft.tree.build_tree`
                builds it online, so τ <= N + 1
    topk-K      the top-k streak: a reference token only has to be in the drafter's top-K at its
                slot (the acceptance of a *full* top-K-per-slot tree; τ can reach B)
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import torch

from flashdraft.tree import Tree, best_first


@dataclass(frozen=True)
class Method:
    kind: str  # "chain" | "ddtree" | "topk"
    size: int = 0  # DDTree budget or top-k width

    @property
    def name(self) -> str:
        return "chain" if self.kind == "chain" else f"{self.kind}-{self.size}"

    @classmethod
    def parse(cls, text: str) -> Method:
        t = text.strip().lower()
        if t == "chain":
            return cls("chain")
        kind, _, num = t.partition("-")
        if kind in ("ddtree", "topk") and num.isdigit() and int(num) > 0:
            return cls(kind, int(num))
        raise ValueError(f"unknown replay method {text!r}: use chain, ddtree-N (budget N) or topk-K")

    @property
    def width(self) -> int:
        """Per-slot top-k entries this method reads."""
        return 1 if self.kind == "chain" else self.size


def methods_for(budgets: list[int], topk: list[int] | int | None) -> list[Method]:
    ks = [topk] if isinstance(topk, int) else list(topk or [])
    return [Method("chain"), *(Method("ddtree", b) for b in budgets), *(Method("topk", k) for k in ks)]


@dataclass
class DraftRows:
    """The drafter's output at one round start, reduced to what every replay needs.

    May hold only the first S of the B−1 slots (offline.py computes the head lazily: most rounds
    of a weak drafter end at slot 1 or 2); `accept` returns None when it needs the rest.
    """

    argmax: list[int]  # [S] argmax of the logits per slot (the chain's drafts)
    top_lp: torch.Tensor  # float32 [S, K] full-vocabulary log-softmax, sorted descending
    top_ids: torch.Tensor  # int64 [S, K]
    vocab: int  # the full vocabulary size (K == vocab means the lists are complete)
    num_slots: int  # B − 1, the slots the block has (S <= num_slots)

    @property
    def complete(self) -> bool:
        return len(self.argmax) == self.num_slots


# a chain/top-k surrogate tail below this (slots not computed, each under the last computed
# prefix probability) is dropped instead of computing the missing slots: |error| < 1e-4 per round
SURROGATE_TAIL = 1e-4


@dataclass
class Outcome:
    accepted: int  # drafts accepted (before the length/stop clip); τ = min(accepted + 1, remaining)
    predicted: float  # surrogate τ: 1 + Σ over drafted prefixes of their probability under the drafter
    slot_correct: list[bool] | None = None  # chain only: draft == reference at each comparable slot


def build_tree_from_topk(
    top_lp: torch.Tensor,
    top_ids: torch.Tensor,
    budget: int,
    vocab: int | None = None,
    num_slots: int | None = None,
) -> Tree | None:
    """The tree `flashdraft.tree.build_tree(logits, budget)` builds, from stored top-K (K >= budget).

    Same scores (float32 log-softmax values summed as Python floats) and the same tie order
    (score, then depth, then rank in the slot, then parent), so offline and online trees are
    identical node for node. `top_lp` may hold only the first S of `num_slots` slots: the
    result is None when the tree takes a node at slot S and would need slot S+1.
    """
    have, width = top_lp.shape
    num_slots = have if num_slots is None else num_slots
    k = min(budget, width)
    if budget > width and width != vocab:
        raise ValueError(f"budget {budget} needs the top-{budget} per slot, only {width} were stored")
    return best_first(top_lp[:, :k].tolist(), top_ids[:, :k].tolist(), budget, num_slots)


def _surrogate_chain(lps: list[float], complete: bool) -> float | None:
    """1 + Σ_k Π_{i<=k} p_i over the computed slots; None when the missing tail could matter."""
    cum, pred = 1.0, 1.0
    for p in lps:
        cum *= p
        pred += cum
    if not complete and cum > SURROGATE_TAIL / 16:
        return None
    return pred


class NeedWidth:
    """`accept`'s answer when the stored top-K per slot is too narrow for the tree (see `TreeWalk`)."""


NEED_WIDTH = NeedWidth()


class TreeWalk:
    """The best-first DDTree search of one round start along its reference, popped only as far as the
    largest budget asked so far: one search answers every budget (`build_tree` emits nodes in pop order,
    and a budget-n build pops exactly the first n nodes of a larger one), and a start only the small
    budgets reach costs only their pops.

    The same search as `flashdraft.tree.best_first` (same heap keys, so the same nodes in the same order;
    tested against `build_tree`), reduced to what the replay needs: no Tree tensors or child maps, the
    reference path followed while nodes are popped (a node is on it when its parent is the path's tip and
    it holds the reference token's rank in its slot). Its lists are cut at `max_budget` ranks per slot,
    the largest budget any caller may ask.

    The stored top-K may be narrower than min(max_budget, vocab) (most trees use only the first few ranks
    of each slot): the search is then exact until a node of the last stored rank is popped, because only
    that pop would push a sibling the lists do not hold; popping past it answers NEED_WIDTH (the caller
    stores the full top-K and walks again). None means the tree needs the next slot, as in `best_first`.
    After either answer the walk is spent: the caller walks again on the grown rows.
    """

    def __init__(self, rows: DraftRows, ref: list[int], max_budget: int) -> None:
        self.have, width = rows.top_lp.shape
        self.max_budget = max_budget
        self.k = min(max_budget, width)
        self.narrow = width < min(max_budget, rows.vocab)
        self.lp = rows.top_lp[:, : self.k].tolist()  # [S][k]
        self.num_slots = rows.num_slots
        # the rank of the reference token in each slot's list (-1: not there), instead of every slot's ids
        self.n_ref = min(len(ref), self.have)
        hit = (
            rows.top_ids[: self.n_ref, : self.k]
            == torch.tensor(ref[: self.n_ref], dtype=rows.top_ids.dtype)[:, None]
        )
        self.ref_rank: list[int] = torch.where(hit.any(-1), hit.int().argmax(-1), -1).tolist()
        self.scores: list[float] = []
        self.path: list[int] = []  # node indices (pop order) of the reference path, root excluded; increasing
        self.tip = 0  # node index of the path's last node (0 = root)
        self.edge = False  # a node of the last stored rank was popped: exact so far, not one pop further
        # entries (−score, depth, rank, parent, −parent score): the keys are distinct, so the pop order is the
        # key order whatever sequence of pushes built the heap, and a sibling can replace its elder in one sift
        self.heap: list[tuple[float, int, int, int, float]] = (
            [(-self.lp[0][0], 1, 0, 0, -0.0)] if max_budget and self.k and self.have else []
        )
        self._cum: list[float] = []

    def advance(self, budget: int) -> TreeWalk | NeedWidth | None:
        """Pop until `budget` nodes (or the whole tree) are out; self, or NEED_WIDTH / None as above."""
        heap, lp, scores, k = self.heap, self.lp, self.scores, self.k
        pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
        while heap and len(scores) < budget:
            if self.edge:  # the full lists would have pushed a sibling of rank k: later pops may differ
                return NEED_WIDTH
            neg, depth, rank, parent, parent_neg = heap[0]
            if rank + 1 < k:  # the next sibling: −(parent score + lp) as −parent score − lp, the same float
                replace(heap, (parent_neg - lp[depth - 1][rank + 1], depth, rank + 1, parent, parent_neg))
            else:
                pop(heap)
            scores.append(-neg)
            node = len(scores)
            if parent == self.tip and depth <= self.n_ref and rank == self.ref_rank[depth - 1]:
                self.path.append(node)
                self.tip = node
            if depth < self.num_slots:
                if depth >= self.have:
                    return None  # identical to the full-width search up to here: it needs the next slot too
                push(heap, (neg - lp[depth][0], depth + 1, 0, node, neg))
            self.edge = self.narrow and rank == k - 1
        return self

    @property
    def cum_q(self) -> list[float]:
        """cum_q[i] = Σ_{j <= i} Q(node j+1) over the nodes popped so far, as Tree.log_probs sums them."""
        if len(self._cum) != len(self.scores):
            self._cum = torch.tensor(self.scores, dtype=torch.float32).double().exp().cumsum(0).tolist()
        return self._cum

    def accepted(self, budget: int) -> int:
        a = 0
        while a < len(self.path) and self.path[a] <= budget:
            a += 1
        return a

    def predicted(self, budget: int) -> float:
        n = min(budget, len(self.scores))
        return 1.0 + (self.cum_q[n - 1] if n else 0.0)


def tree_walk(rows: DraftRows, ref: list[int], budget: int) -> TreeWalk | NeedWidth | None:
    """The budget-`budget` tree's walk along `ref`, from the stored top-K per slot (see TreeWalk)."""
    return TreeWalk(rows, ref, budget).advance(budget)


def accept(
    method: Method,
    rows: DraftRows,
    ref: list[int],
    shared: dict[str, Any] | None = None,
    tree_budget: int = 0,
) -> Outcome | NeedWidth | None:
    """Drafts accepted at this round start; `ref` = the reference tokens after the bonus (<= B-1 of them).

    None when `rows` holds too few slots to decide, NEED_WIDTH when a DDTree needs more of each
    slot's top-K than `rows` holds (the caller computes the rest and asks again).
    DDTree methods of one start share one TreeWalk through `shared`, its lists cut at `tree_budget` (>= every
    budget) ranks, popped as far as the largest budget that has asked.
    """
    have = len(rows.argmax)
    comparable = min(len(ref), rows.num_slots)
    if method.kind == "chain":
        correct = [d == r for d, r in zip(rows.argmax, ref, strict=False)]
        a = 0
        while a < len(correct) and correct[a]:
            a += 1
        if a == have < comparable:
            return None  # every computed draft matched: the next slot decides
        # surrogate: P(first k drafts all accepted) under the drafter's own distribution
        pred = _surrogate_chain(torch.exp(rows.top_lp[:, 0].double()).tolist(), rows.complete)
        if pred is None:
            return None
        return Outcome(a, pred, correct[: a + 1] if not rows.complete else correct)
    if method.kind == "ddtree":
        big = max(tree_budget, method.size)
        share = shared if shared is not None and big == tree_budget else None
        short = share.get("short") if share is not None else None
        if short is not None and short[0] == len(rows.argmax) and method.size >= short[1]:
            return None  # this budget's tree already asked for more slots than these rows hold
        walk = share.get("tree") if share is not None else None
        if walk is None or walk.have != len(rows.argmax) or walk.k != min(big, rows.top_lp.shape[1]):
            walk = TreeWalk(rows, ref, big)  # a first walk, or the rows grew (more slots, or widened)
        got = walk.advance(method.size)
        if share is not None:
            share["tree"] = walk if isinstance(got, TreeWalk) else None
            if got is None:
                share["short"] = (len(rows.argmax), method.size)
        if not isinstance(got, TreeWalk):
            return got
        return Outcome(walk.accepted(method.size), walk.predicted(method.size))
    if method.kind == "topk":
        k = method.size
        if k > rows.top_ids.shape[1] and rows.top_ids.shape[1] != rows.vocab:
            raise ValueError(
                f"{method.name} needs the top-{k} per slot, only {rows.top_ids.shape[1]} were stored"
            )
        ids = rows.top_ids[:, :k].tolist()
        a = 0
        while a < min(len(ref), have) and ref[a] in ids[a]:
            a += 1
        if a == have < comparable:
            return None
        pred = _surrogate_chain(torch.exp(rows.top_lp[:, :k].double()).sum(-1).tolist(), rows.complete)
        if pred is None:
            return None
        return Outcome(a, pred)
    raise ValueError(f"unknown method kind {method.kind!r}")
