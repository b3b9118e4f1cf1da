"""The fast single-stream decode engine: static KV caches + CUDA graphs, token-identical to `generate`.

Same call and same `GenerationResult` as the reference decoder (flashdraft/decode/generate.py):

    engine = FastEngine(target, drafter, max_len=4096)
    result = engine.generate(ids, max_new_tokens=256, method="ddtree", budget=64)
    result = flashdraft.decode.engine.generate(target, drafter, ids, max_new_tokens=256)  # cached engine

A round is a fixed sequence of phases over static buffers, each captured once as a CUDA graph
(eager on CPU — the same code):

    draft   feed the pending context rows (≤ B, padded) to the drafter cache, run the block,
            keep the head's logits for slots 1..B−1                       [drafter forward]
            (`NativeDrafter.step`; through torch.compile with `compile_drafter=True`)
    tree    (DDTree) build the tree ON THE DEVICE (flashdraft/decode/device_tree.py, same nodes and order as
            `flashdraft.tree.build_tree`), write tokens / positions / mask in place
            (`write_tree_inputs`; through torch.compile where the phases are CUDA graphs: `compile_tree`)
    verify  the native target forward at q = B (chain), budget+1 (tree) or 1 (AR), then the
            target's token choice (`choose_tokens`, the reference's function); through torch.compile
            with `compile_target=True` (`NativeTarget.compiled_forward`: fused norms, RoPE, SwiGLU)
    commit  acceptance, the path's K/V gathered into place, state advanced — all on the device

The only host read per round is `out.tolist()` (accepted length + committed tokens), in
`_read_round`: stop tokens and `max_new_tokens` are applied on the host afterwards, exactly as
the reference does (generation ends at a truncated round, so the device state past it is moot).
With `overlap_rounds=True` the next round is enqueued before that read (`_decode_overlapped`), the
round's `out` copied to the host asynchronously, so the host's read and bookkeeping overlap the device.
Rows of the static caches past the committed length hold stale K/V; every mask hides them and
the next round overwrites them. A round attends over the smallest span of the cache that holds the committed
length and its own rows (`_span`), not all of it: under CUDA graphs a phase is captured once per span, at its
first use; the host knows the committed length from the rounds it read.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from flashdraft.cuda_graphs import capture
from flashdraft.decode.device_tree import (
    TreeInputs,
    TreePlan,
    compile_tree_writer,
    draft_top,
    write_tree_inputs,
)
from flashdraft.decode.generate import (
    GenerationResult,
    Timings,
    check_request,
    deliver,
    prepare_ids,
    seed_generator,
    truncate_round,
)
from flashdraft.decode.native import SPARE_ROWS, NativeDrafter, NativeTarget, native_support_error
from flashdraft.decode.sampling import SamplingParams, choose_tokens
from flashdraft.drafter import DFlashDrafter
from flashdraft.target import TargetModel, check_pair

# ----------------------------------------------------------------------------- engine


@dataclass
class RoundProfile:
    """Device time per phase (CUDA events; host wall time on CPU), summed over a generation."""

    draft_ms: float = 0.0
    tree_ms: float = 0.0
    verify_ms: float = 0.0
    commit_ms: float = 0.0  # acceptance, K/V gather, state update
    host_ms: float = (
        0.0  # from the last launch to the read done: device time not yet finished + host bookkeeping
    )
    rounds: int = 0
    per_round: list[dict[str, float]] = field(default_factory=list)

    def as_dict(self) -> dict[str, float]:
        return {
            k: getattr(self, k)
            for k in ("draft_ms", "tree_ms", "verify_ms", "commit_ms", "host_ms", "rounds")
        }


class _Phase:
    """A callable over static buffers, run eagerly or replayed from its CUDA graph."""

    def __init__(
        self, fn: Callable[[], None], use_graph: bool, generator: torch.Generator | None, pool: Any = None
    ) -> None:
        self.fn = fn
        self.graph: Any = None
        if use_graph:  # sampling phases draw from our seeded generator
            self.graph, _ = capture(fn, pool=pool, generator=generator)

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


def graph_spans(capacity: int) -> list[int]:
    """The attention spans of an engine under CUDA graphs: 256, 512, 1024, ... and the whole cache."""
    out, s = [], 256
    while s < capacity:
        out.append(s)
        s *= 2
    return [*out, capacity]


class FastEngine:
    """Single-stream AR / chain / DDTree decoding over static caches, with CUDA graphs on CUDA."""

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter | None = None,
        *,
        max_len: int = 2048,
        max_budget: int = 512,
        cuda_graphs: bool | None = None,
        compile_tree: bool | None = None,
        compile_target: bool = False,
        compile_drafter: bool = False,
        overlap_rounds: bool = False,
        graph_prefill: bool = False,
    ) -> None:
        why = native_support_error(target)
        if why is not None:
            raise ValueError(f"FastEngine: {why}")
        if drafter is not None:
            check_pair(target, drafter.config)
        self.target, self.drafter = target, drafter
        self.device = target.device
        self.max_len = max_len
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs a CUDA target")
        # the DDTree phase through torch.compile, one callable per budget (`compile_tree_writer`); by default
        # wherever the phases are CUDA graphs. H200, 2026-12-04 (benchmarks/RESULTS.md "Decode speed"): the phase 1.35-3.55x
        # faster per replay (budget 8: 0.300 -> 0.108 ms, 512: 1.076 -> 0.795), the same trees bit for bit,
        # DDTree-32 1.60x -> 1.72x over engine AR; the price is 6-23 s of compilation per budget, once, at warm-up
        self.compile_tree = self.cuda_graphs if compile_tree is None else compile_tree
        # the target's forward in the round phases (AR step, chain and tree verify) through torch.compile
        # (`NativeTarget.compiled_forward`), compiled in the phase's warm-up and captured in its CUDA graph;
        # the prefill stays eager (variable length). Off until benchmarks/gpu/forward_speed.py has measured
        # it on a GPU; on CPU it runs too (inductor's C++ backend), tens of seconds of compilation per shape
        self.compile_target = compile_target
        # the drafting phase (context write + block forward) through torch.compile the same way
        # (`NativeDrafter.compiled_step`); off until forward_speed.py has measured it on a GPU
        self.compile_drafter = compile_drafter
        # launch the next round before reading this one's tokens (`_decode_overlapped`): the host's read,
        # bookkeeping and launches run while the device works; off until forward_speed.py has measured it on a GPU
        self.overlap_rounds = overlap_rounds
        # a prefill's rows are the prompt's padded to a multiple of this: on CUDA, prompt lengths then share a
        # few shapes, and a shape's first forward (cuBLAS's kernel choice per GEMM shape, the allocator's new
        # blocks) is paid once per bucket rather than per prompt; elsewhere 16, SDPA's alignment (padding costs
        # arithmetic there and buys nothing)
        self.prefill_bucket = 64 if self.device.type == "cuda" else 16
        # the prefill as a CUDA graph, one per power-of-two bucket of rows (64, 128, ...: few graphs, and on a
        # launch-bound target padding costs little), each captured at its bucket's first prompt; off until a GPU has
        # measured it (benchmarks/engine_spans.py reports the prefill)
        self.graph_prefill = graph_prefill and self.cuda_graphs
        self.block = drafter.block_size if drafter is not None else 1
        self.max_budget = max_budget
        self.max_q = max(self.block, max_budget + 1 if drafter is not None else 1)
        # a verify writes up to max_q rows past the committed length. Both caches round up to 16 columns:
        # SDPA's fused kernels want the mask's rows 16-aligned and would copy an unaligned mask in every layer
        self.capacity = -(-(max_len + self.max_q) // 16) * 16
        self.d_capacity = -(-(max_len + self.block) // 16) * 16
        self.native = NativeTarget(target, self.capacity)
        self.ndrafter = NativeDrafter(drafter, target, self.d_capacity) if drafter is not None else None
        self.layer_ids = list(drafter.target_layer_ids) if drafter is not None else []
        dev, long = self.device, dict(dtype=torch.long, device=self.device)
        # -- round state (device scalars): the bonus sits at position seq_len and has no K/V yet
        self.seq_len = torch.zeros(1, **long)
        self.bonus = torch.zeros(1, **long)
        self.n_pending = torch.zeros(1, **long)  # context rows of `pending` the drafter has not seen
        # [accepted, committed tokens... (B), a tree round's path: node indices root first... (B)]
        self.out = torch.zeros(2 * self.block + 1, **long)
        self.kv_idx = torch.arange(self.capacity, **long)
        self.block_ar = torch.arange(self.block, **long)
        self.generator = torch.Generator(device=dev)
        if drafter is not None:
            feat_dim = len(self.layer_ids) * target.hidden_size
            self.pending = torch.zeros(self.block, feat_dim, dtype=target.dtype, device=dev)  # [B, k·H]
            self.mask_ids = torch.full((self.block - 1,), drafter.mask_token_id, **long)
            self.draft_logits = torch.zeros(self.block - 1, target.vocab_size, dtype=target.dtype, device=dev)
            self.draft_tokens = torch.zeros(self.block - 1, **long)
        self._q: dict[int, dict[str, torch.Tensor]] = {}  # verify buffers per q
        self._prefill_in: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}  # prefill buffers per row count
        self._tree: dict[int, dict[str, Any]] = {}  # tree buffers per budget
        self._phases: dict[tuple[Any, ...], _Phase] = {}
        self._captured: set[tuple[Any, ...]] = set()  # (method, budget, params) whose every span is captured
        # one memory pool for every phase graph: a phase leaves nothing in it (its results are copied into the
        # static buffers above), so graphs run in any order can share the memory of their intermediates, where
        # a pool each would hold them all at once (a span's verify graphs keep [q, V] float32 logits)
        self._graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        # the overlapped loop's two host copies of `out` and their events (pinned on CUDA: the copies run async)
        n_slots = 2 if overlap_rounds else 0
        pin = self.device.type == "cuda"
        self._host_out = [
            torch.zeros(self.out.shape, dtype=torch.long, pin_memory=pin) for _ in range(n_slots)
        ]
        self._host_ready = [torch.cuda.Event() for _ in range(n_slots)] if pin else []

    # -- static buffers

    def _qbuf(self, q: int) -> dict[str, torch.Tensor]:
        if q not in self._q:
            long = dict(dtype=torch.long, device=self.device)
            feat_dim = max(1, len(self.layer_ids) * self.target.hidden_size)
            self._q[q] = {
                "tokens": torch.zeros(q, **long),
                "positions": torch.zeros(q, **long),
                "rows": torch.zeros(q, **long),
                # [q, capacity], a view of [q, capacity + SPARE_ROWS]: every span's columns `[:, :span]` are then a
                # strided slice (row stride > span), the whole cache's included. A compiled forward guards on the
                # mask's contiguity (`stride(0) != size(1)`, from `~allowed` in `additive_mask`): a mask that were
                # the whole buffer at the last span would compile each q once more (CUDA graphs capture that span)
                "allowed": torch.zeros(q, self.capacity + SPARE_ROWS, dtype=torch.bool, device=self.device)[
                    :, : self.capacity
                ],
                "choice": torch.zeros(q, **long),
                "features": torch.zeros(q, feat_dim, dtype=self.target.dtype, device=self.device),
            }
        return self._q[q]

    def _treebuf(self, budget: int) -> dict[str, Any]:
        if budget not in self._tree:
            if budget > self.max_budget:
                raise ValueError(
                    f"budget {budget} > max_budget {self.max_budget}: build the engine with max_budget={budget}"
                )
            long = dict(dtype=torch.long, device=self.device)
            q = self._qbuf(budget + 1)
            out = TreeInputs(q["tokens"], q["positions"], q["rows"], q["allowed"],
                             parents=torch.zeros(budget + 1, **long), depths=torch.zeros(budget + 1, **long))  # fmt: skip
            self._tree[budget] = {
                "plan": TreePlan.make(budget, self.block - 1, self.target.vocab_size, self.device),
                "out": out,
                # budget 1 (a one-node tree) stays eager: nothing to fuse, and inductor 2.11 on CUDA fails on its
                # [1, 1] top-k lists ("argument '-1 + ((-1))' is not comparable", H200, 2026-12-04)
                "write": compile_tree_writer() if self.compile_tree and budget > 1 else write_tree_inputs,
            }
        return self._tree[budget]

    def _phase(self, key: tuple[Any, ...], fn: Callable[[], None], sampling: bool = False) -> _Phase:
        ph = self._phases.get(key)
        if ph is None:
            if self.cuda_graphs:
                # a capture's warm-up runs the phase for real: start it from an empty state so its
                # writes stay inside the caches (generate() resets the state after this anyway)
                self.seq_len.zero_()
                self.n_pending.zero_()
            ph = _Phase(fn, self.cuda_graphs, self.generator if sampling else None, self._graph_pool)
            self._phases[key] = ph
        return ph

    # -- attention spans: a round attends over the cache rows it can see, not the whole cache

    def _spans(self) -> list[int]:
        """The target's attention spans a round may use. Under CUDA graphs a short list (a graph per span and phase,
        all captured on a phase's first use, at an empty state): 256, 512, 1024, ... and the whole cache. Eager (no
        graphs): every multiple of 64. A compiled forward takes the span as a symbolic size: one compilation."""
        if self.cuda_graphs:
            return graph_spans(self.capacity)
        return list(range(64, self.capacity, 64)) + [self.capacity]

    def _span(self, need: int | None) -> int:
        """The smallest span holding `need` rows (None: the whole cache)."""
        if need is None:
            return self.capacity
        spans = self._spans()
        return next((s for s in spans if s >= need), spans[-1])

    def whole_cache_key(self, kind: str, q: int | None = None) -> tuple[Any, ...]:
        """The key in `_phases` of the captured phase of `kind` ("ar", "draft", "verify_chain", "verify" of `q`
        tokens) that attends over the whole cache: one is kept per span (its last element; None = the drafter's
        whole cache). For the benchmarks that time phases one by one."""
        keys = [k for k in self._phases if k[0] == kind and (q is None or k[1] == q)]
        return max(keys, key=lambda k: float("inf") if k[-1] is None else k[-1])

    def _drafter_span(self, span: int) -> int | None:
        """The drafter's span for a round of target span `span` (None: its whole cache)."""
        return None if span >= self.d_capacity else span

    # -- phases (fixed shapes, no host reads: each is one CUDA graph)

    def _draft(self, span: int | None = None) -> None:
        nd = self.ndrafter
        assert nd is not None
        args = (self.pending, self.n_pending, self.seq_len, self.bonus, self.mask_ids)
        step = nd.compiled_step if self.compile_drafter else nd.step
        logits = step(*args, span=span)  # [B, V]
        self.draft_logits.copy_(logits[1:])

    def _chain_inputs(self) -> None:
        b = self._qbuf(self.block)
        self.draft_tokens.copy_(self.draft_logits.argmax(dim=-1))  # deterministic drafts, also when sampling
        b["tokens"].copy_(torch.cat([self.bonus, self.draft_tokens]))
        b["positions"].copy_(self.seq_len + self.block_ar)
        b["rows"].copy_(b["positions"])
        b["allowed"].copy_(self.kv_idx[None] <= b["positions"][:, None])  # causal over the cache

    def _tree_inputs(self, budget: int) -> None:
        t = self._treebuf(budget)
        top_lp, top_ids = draft_top(self.draft_logits, t["plan"])  # eager on both paths (its docstring)
        hops = min(self.block, budget + 1)  # depth ≤ B−1, ≤ budget
        t["write"](top_lp, top_ids, t["plan"], self.seq_len, self.bonus, self.kv_idx, hops, t["out"])

    def _verify(self, q: int, params: SamplingParams, features: bool = True, span: int | None = None) -> None:
        b = self._qbuf(q)
        layer_ids = self.layer_ids if features and self.layer_ids else None
        forward = self.native.compiled_forward if self.compile_target else self.native.forward
        allowed = b["allowed"][:, :span]  # the rows < span: every row this round may see
        out = forward(b["tokens"], b["positions"], b["rows"], allowed, layer_ids=layer_ids)
        assert out.logits is not None
        b["choice"].copy_(choose_tokens(out.logits, params, self.generator if not params.greedy else None))
        if out.features is not None:
            b["features"].copy_(out.features)

    def _commit_ar(self) -> None:
        b = self._qbuf(1)
        self.out[:1].zero_()  # (`t[i] = scalar` copies from the host: not capturable)
        self.out[1:2].copy_(b["choice"])
        self.bonus.copy_(b["choice"])
        self.seq_len += 1

    def _ar_inputs(self) -> None:
        b = self._qbuf(1)
        b["tokens"].copy_(self.bonus)
        b["positions"].copy_(self.seq_len)
        b["rows"].copy_(self.seq_len)
        b["allowed"].copy_((self.kv_idx <= self.seq_len)[None])

    def _commit_chain(self) -> None:
        b = self._qbuf(self.block)
        choice = b["choice"]  # [B]
        accepted = (
            (self.draft_tokens == choice[:-1]).long().cumprod(dim=0).sum().view(1)
        )  # longest matching prefix
        self.out[:1].copy_(accepted)
        self.out[1 : self.block + 1].copy_(choice)  # committed: choice[0..a], the accepted drafts and bonus
        self.pending.copy_(b["features"])  # rows 0..a: the old bonus and the accepted drafts
        self.n_pending.fill_(1)
        self.n_pending += accepted
        self.bonus.copy_(choice[accepted])  # a [1] index: a 0-d one would be read on the host
        self.seq_len += self.n_pending

    def _commit_tree(self, budget: int) -> None:
        t = self._treebuf(budget)
        b = self._qbuf(budget + 1)
        parents, depths, choice, tokens = t["out"].parents, t["out"].depths, b["choice"], b["tokens"]
        # a node is accepted when its token is the target's choice after its parent, all the way up
        ok = tokens == choice[parents]  # [N+1]; the root compares its own token: forced True below
        ok[:1].fill_(True)
        hops = min(self.block - 1, budget)  # the deepest node is at depth <= min(B − 1, budget)
        acc, cur = ok.clone(), parents
        for _ in range(hops):
            acc &= ok[cur]
            cur = parents[cur]
        # children of a node carry distinct tokens, so the accepted nodes form one path
        last = (depths * acc).argmax().view(1)  # the deepest accepted node ([1]: 0-d indices sync)
        accepted = depths[last]  # [1]
        anc = [last]  # anc[j] = j-th ancestor of `last`
        for _ in range(hops):
            anc.append(parents[anc[-1]])
        anc_t = torch.cat(anc)  # [hops + 1]
        path = anc_t[(accepted - self.block_ar).clamp(min=0)]  # [B] root first, padded with `last`
        nxt = path[(self.block_ar + 1).clamp(max=self.block - 1)]
        committed = torch.where(self.block_ar == accepted, choice[last], tokens[nxt])  # [B]
        self.out[:1].copy_(accepted)
        self.out[1 : self.block + 1].copy_(committed)
        self.out[self.block + 1 :].copy_(path)  # the accepted nodes in build order: what smaller budgets keep
        # the path's K/V move to sit right after the committed prefix (gather first: rows overlap)
        cache = self.native.cache  # [layers, 2, kv, S, hd]
        kept = cache.index_select(3, self.seq_len + path)
        cache.index_copy_(3, self.seq_len + self.block_ar, kept)
        self.pending.copy_(b["features"][path])  # [B, k·H] in path order
        self.n_pending.copy_(accepted + 1)
        self.bonus.copy_(choice[last])
        self.seq_len += self.n_pending

    # -- the host loop

    def _read_round(self) -> tuple[list[int], list[int]]:
        """The one host read per round (a sync): the committed tokens, and a tree round's accepted nodes (their
        build-order indices, root excluded; meaningless for other rounds)."""
        return self._split_out(self.out.tolist())

    def _split_out(self, host: list[int]) -> tuple[list[int], list[int]]:
        a = host[0]
        return host[1 : a + 2], host[self.block + 2 : self.block + 2 + a]

    @staticmethod
    def _take_round(
        result: GenerationResult,
        committed: list[int],
        nodes: list[int],
        remaining: int,
        stop: set[int],
        on_tokens: Callable[[list[int]], bool | None] | None,
    ) -> bool:
        """A read round into `result` (cut at a stop token or the length, as the reference does) and on to
        `on_tokens`; True when the generation is done."""
        new, reason = truncate_round(committed, remaining, stop)
        result.rounds += 1
        result.acceptance_lengths.append(len(new))
        if result.method == "ddtree":
            result.tree_paths.append(nodes)
        return deliver(result, new, reason, on_tokens)

    def _launch_round(self, round_fns: list[tuple[str, Callable[[], None]]], slot: int) -> None:
        """Enqueue a round's phases, then its `out` into host slot `slot` (async on CUDA)."""
        for _, fn in round_fns:
            fn()
        self._host_out[slot].copy_(self.out, non_blocking=True)
        if self._host_ready:
            self._host_ready[slot].record()

    def _read_slot(self, slot: int) -> tuple[list[int], list[int]]:
        if self._host_ready:
            self._host_ready[slot].synchronize()
        return self._split_out(self._host_out[slot].tolist())

    def _decode_overlapped(
        self,
        phases: Callable[[int], list[tuple[str, Callable[[], None]]]],
        seq: int,
        result: GenerationResult,
        max_new_tokens: int,
        stop: set[int],
        on_tokens: Callable[[list[int]], bool | None] | None,
    ) -> None:
        """The round loop with round k + 1 enqueued before round k's tokens are read, so the host's read and
        bookkeeping of one round overlap the device's next: every phase reads its inputs from the device state
        the last one left, never from the host. The rounds, and so the tokens, are the serial loop's; when a
        round ends the generation, the one enqueued after it is wasted work on state nobody reads. A round is
        enqueued ahead only when it stays inside the caches whatever the unread round commits (≤ B tokens):
        that round ends at seq_len ≤ prompt + tokens so far − 1 + B, which must be ≤ max_len. `phases(seq)`: a
        round's phases when it starts at seq_len ≤ seq; `seq`: the seq_len the first round starts at."""
        slot = 0
        self._launch_round(phases(seq), slot)
        done = False
        while not done:  # `seq`: where the unread round in `slot` started
            n_tokens = len(result.tokens)
            ahead = result.prompt_tokens + n_tokens - 1 + self.block <= self.max_len
            if ahead:  # it starts where the unread round ends: at most B past `seq`
                self._launch_round(phases(seq + self.block), 1 - slot)
            committed, nodes = self._read_slot(slot)
            seq += len(committed)
            done = self._take_round(result, committed, nodes, max_new_tokens - n_tokens, stop, on_tokens)
            if not done and not ahead:
                self._launch_round(phases(seq), 1 - slot)
            slot = 1 - slot

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor | list[int],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        method: str = "chain",
        budget: int | None = None,
        stop_token_ids: Iterable[int] | None = None,
        seed: int | None = None,
        on_tokens: Callable[[list[int]], bool | None] | None = None,
        profile: bool = False,
        policy: Any = None,
    ) -> GenerationResult:
        """Same contract as `flashdraft.decode.generate.generate`; `profile` fills `self.last_profile`.
        Method "auto": `policy` (flashdraft/decode/budget.py) picks the method for the whole call here
        (switching inside a call would need the AR phase to keep features) and learns from its rounds."""
        t_start = time.perf_counter()
        check_request(method, budget, max_new_tokens, self.drafter is not None)
        if method == "auto":
            if self.drafter is None:
                choice: tuple[str, int | None] = ("ar", None)
            elif policy is None:
                raise ValueError("method 'auto' needs policy=flashdraft.decode.budget.auto_policy(...)")
            else:
                choice = policy.choice()
            res = self.generate(
                input_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                method=choice[0], budget=choice[1], stop_token_ids=stop_token_ids, seed=seed, on_tokens=on_tokens,
                profile=profile,
            )  # fmt: skip
            if policy is not None:
                full = (
                    res.acceptance_lengths[:-1] if res.stop_reason != "cancelled" else res.acceptance_lengths
                )
                # the last round may be truncated: it says nothing of the method
                policy.observe(choice, full, res.tree_paths[: len(full)] if choice[0] == "ddtree" else None)
            return res
        if method == "ddtree" and budget == 0:
            raise ValueError("budget 0 is a root-only tree: use method='ar' on the fast engine")
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        ids = prepare_ids(input_ids, self.device)[0]  # [n]
        n = ids.shape[0]
        if n + max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt {n} + max_new_tokens {max_new_tokens} > engine max_len {self.max_len}: "
                f"build FastEngine(..., max_len={n + max_new_tokens})"
            )
        stop = {int(t) for t in (stop_token_ids or [])}
        timings = Timings()
        result = GenerationResult(
            [], [], n, 0, "length", timings, method, budget if method == "ddtree" else None
        )
        if max_new_tokens == 0:
            timings.total_s = time.perf_counter() - t_start
            return result
        if self.ndrafter is not None:
            self.ndrafter.sync_weights()  # the drafter may have been trained since the last call
        if self.cuda_graphs:
            self._round_phases(method, budget, params)  # captures every span's graphs on first use
        # the prefill's graph too, before the seeding: a capture's warm-up draws from the generator
        prefill = self._prefill_phase(n, method != "ar", params)
        if not params.greedy:
            seed_generator(self.generator, seed)
        q_round = self._round_q(method, budget)

        def phases(seq: int) -> list[tuple[str, Callable[[], None]]]:
            """A round's phases when the committed length is at most `seq`: it attends over seq + its q rows."""
            return self._round_phases(method, budget, params, seq + q_round)

        # prefill: the prompt's K/V and features, the first token (`_prefill_phase`)
        t0 = time.perf_counter()
        first = prefill(ids)
        self.bonus.copy_(first)
        self.seq_len.fill_(n)
        self.n_pending.zero_()
        first_tok = int(first.item())  # host read
        timings.prefill_s = time.perf_counter() - t0

        done = deliver(result, *truncate_round([first_tok], max_new_tokens, stop), on_tokens)
        prof = RoundProfile()
        timed = profile and self.device.type == "cuda"
        t_decode = time.perf_counter()
        seq = n  # the engine's seq_len (the bonus's position), followed on the host
        if self.overlap_rounds and not profile:
            if not done:
                self._decode_overlapped(phases, seq, result, max_new_tokens, stop, on_tokens)
        else:  # one round at a time: launch, read, decide
            while not done:
                remaining = max_new_tokens - len(result.tokens)
                round_fns = phases(seq)
                # profiled or not, the same phases (graphs) run in the same order: events or clock reads between
                # them change no token (tests/decode/test_engine_compile.py checks it, CUDA graphs and bf16 too)
                if timed:
                    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(round_fns) + 1)]
                    events[0].record()
                    for (_, fn), ev in zip(round_fns, events[1:], strict=True):
                        fn()
                        ev.record()
                else:
                    marks = [time.perf_counter()]
                    for _, fn in round_fns:
                        fn()
                        marks.append(time.perf_counter())
                t_read = time.perf_counter()
                committed, nodes = self._read_round()
                seq += len(committed)  # what the round moved seq_len by (before any stop or length cut)
                done = self._take_round(result, committed, nodes, remaining, stop, on_tokens)
                if profile:
                    host_ms = (time.perf_counter() - t_read) * 1e3
                    if timed:
                        ms = [events[i].elapsed_time(events[i + 1]) for i in range(len(round_fns))]
                    else:
                        ms = [(marks[i + 1] - marks[i]) * 1e3 for i in range(len(round_fns))]
                    row = {f"{name}_ms": v for (name, _), v in zip(round_fns, ms, strict=True)}
                    row["host_ms"] = host_ms
                    prof.per_round.append(row)
                    for k, v in row.items():
                        setattr(prof, k, getattr(prof, k) + v)
                    prof.rounds += 1
        timings.decode_s = time.perf_counter() - t_decode
        timings.total_s = time.perf_counter() - t_start
        if profile:
            timings.draft_s, timings.tree_s = prof.draft_ms / 1e3, prof.tree_ms / 1e3
            timings.verify_s = (prof.verify_ms + prof.commit_ms) / 1e3
        self.last_profile = prof
        return result

    def _prefill_rows(self, n: int) -> int:
        """The rows a prefill of an n-token prompt runs: n rounded up to `prefill_bucket` (to a power of two of at
        least 64 with `graph_prefill`), within both caches (n + max_new_tokens <= max_len keeps it >= n)."""
        if self.graph_prefill:
            m = 64
            while m < n:
                m *= 2
        else:
            m = -(-n // self.prefill_bucket) * self.prefill_bucket
        return min(m, self.capacity, self.d_capacity if self.ndrafter is not None else self.capacity)

    def _prefill_phase(
        self, n: int, features: bool, params: SamplingParams
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The prefill of an n-token prompt: a function of the prompt's ids [n] that writes their K/V into the cache
        (with `features`, the drafter's context too) and gives the first token [1]. The prompt runs padded to
        `_prefill_rows(n)` rows, so that prompt lengths share a few shapes: the padding's K/V and drafter context
        land past the committed length, where every mask hides them until rounds overwrite them, and only the last
        real row's logits are computed. Over static buffers per row count: a CUDA graph each with `graph_prefill`,
        captured here at its first use."""
        m = self._prefill_rows(n)
        key = ("prefill", m, features, params)
        if key not in self._prefill_in:
            long = dict(dtype=torch.long, device=self.device)
            self._prefill_in[key] = {"tokens": torch.zeros(m, **long), "last": torch.zeros(1, **long),
                                     "first": torch.zeros(1, **long)}  # fmt: skip
        b = self._prefill_in[key]

        def run() -> None:
            pos = self.kv_idx[:m]
            causal = self.kv_idx[None, :m] <= pos[:, None]  # [m, m]
            out = self.native.forward(b["tokens"], pos, pos, causal, layer_ids=self.layer_ids if features else None,
                                      logits_row=b["last"])  # fmt: skip
            assert out.logits is not None
            gen = self.generator if not params.greedy else None
            b["first"].copy_(choose_tokens(out.logits[0], params, gen))
            if features:
                assert self.ndrafter is not None and out.features is not None
                self.ndrafter.write_context(out.features, pos)

        phase = self._phase(key, run, sampling=not params.greedy) if self.graph_prefill else run

        def prefill(ids: torch.Tensor) -> torch.Tensor:
            b["tokens"].zero_()  # token 0 in the padding: any id will do
            b["tokens"][:n].copy_(ids)
            b["last"].fill_(n - 1)
            phase()
            return b["first"]

        return prefill

    def _round_q(self, method: str, budget: int | None) -> int:
        """The cache rows a round writes past the committed length: its verify's tokens (the drafter's block)."""
        if method == "ar":
            return 1
        return max(self.block, (budget or 0) + 1)

    def _round_phases(
        self, method: str, budget: int | None, params: SamplingParams, need: int | None = None
    ) -> list[tuple[str, Callable[[], None]]]:
        """The round's phases in order, as (name, callable), for a round that attends over `need` cache rows
        (None: the whole cache). Under CUDA graphs the first use captures every span's graphs."""
        if self.cuda_graphs and (method, budget, params) not in self._captured:
            self._captured.add((method, budget, params))
            for span in self._spans():  # at an empty state, before any generation uses them
                self._phases_at(method, budget, params, span)
        return self._phases_at(method, budget, params, self._span(need))

    def _phases_at(
        self, method: str, budget: int | None, params: SamplingParams, span: int
    ) -> list[tuple[str, Callable[[], None]]]:
        sampling = not params.greedy
        if method == "ar":
            self._qbuf(1)

            def ar() -> None:
                self._ar_inputs()
                self._verify(1, params, features=False, span=span)
                self._commit_ar()

            return [("verify", self._phase(("ar", params, span), ar, sampling))]
        self._qbuf(self.block)
        d_span = self._drafter_span(span)
        draft = self._phase(("draft", d_span), lambda: self._draft(d_span))
        if method == "chain":

            def verify_chain() -> None:
                self._chain_inputs()
                self._verify(self.block, params, span=span)

            return [
                ("draft", draft),
                ("verify", self._phase(("verify_chain", params, span), verify_chain, sampling)),
                ("commit", self._phase(("commit_chain",), self._commit_chain)),
            ]
        assert budget is not None
        self._treebuf(budget)
        self._qbuf(budget + 1)
        return [
            ("draft", draft),
            ("tree", self._phase(("tree", budget), lambda: self._tree_inputs(budget))),
            (
                "verify",
                self._phase(
                    ("verify", budget + 1, params, span),
                    lambda: self._verify(budget + 1, params, span=span),
                    sampling,
                ),
            ),
            ("commit", self._phase(("commit_tree", budget), lambda: self._commit_tree(budget))),
        ]

    def warmup(self, methods: Iterable[tuple[str, int | None]], temperature: float = 0.0) -> None:
        """Capture the graphs for (method, budget) pairs now, so the first timed call pays nothing."""
        params = SamplingParams(temperature=temperature)
        for method, budget in methods:
            self._round_phases(method, budget, params)


# ----------------------------------------------------------------------------- convenience

_ENGINE: dict[str, Any] = {}  # the last engine built by `generate` (one slot: caches are large)


def generate(
    target: TargetModel,
    drafter: DFlashDrafter | None,
    input_ids: torch.Tensor | list[int],
    *,
    max_new_tokens: int,
    max_len: int | None = None,
    compile: bool = False,
    graph_prefill: bool = False,
    **kwargs: Any,
) -> GenerationResult:
    """`FastEngine(target, drafter).generate(...)` with the engine kept for the next call.

    `compile`: the target's and the drafter's forwards through torch.compile inside the CUDA graphs
    (`compile_target`, `compile_drafter`): faster rounds after a compilation per shape, and in bf16 near-ties
    that may break differently from run to run (benchmarks/RESULTS.md "Decode speed"). `graph_prefill`: the
    prompt's prefill replayed as a CUDA graph per power-of-two row count (`FastEngine(graph_prefill=True)`).
    Targets outside the native families fall back to the reference transformers decoder.
    """
    if native_support_error(target) is not None:
        from flashdraft.decode.generate import generate as reference_generate

        return reference_generate(target, drafter, input_ids, max_new_tokens=max_new_tokens, **kwargs)
    n = torch.as_tensor(input_ids).shape[-1]
    need = max_len or 2048
    # doubling: a run of longer prompts rebuilds it rarely
    while max_len is None and need < n + max_new_tokens:
        need *= 2
    key = (id(target), id(drafter), compile, graph_prefill)
    eng = _ENGINE.get("engine")
    fits = eng is not None and eng.max_len >= n + max_new_tokens
    # AR needs no drafter: a kept engine of this target (built alike) serves it, whichever drafter it holds
    kept_target, _, *kept_build = _ENGINE.get("key", (None, None, None, None))
    ar_reuse = fits and kwargs.get("method") == "ar" and (kept_target, *kept_build) == (id(target), *key[2:])
    if not ar_reuse and (not fits or _ENGINE.get("key") != key):
        _ENGINE.clear()
        # the old engine's phases close over it (a cycle): collected now, its caches and graphs freed before the
        # new engine allocates its own, not at some later collection (on a GPU, possibly during a capture)
        eng = None
        gc.collect()
        eng = FastEngine(target, drafter, max_len=need, compile_target=compile, compile_drafter=compile,
                         graph_prefill=graph_prefill)  # fmt: skip
        _ENGINE.update(engine=eng, key=key)
    return eng.generate(input_ids, max_new_tokens=max_new_tokens, **kwargs)
