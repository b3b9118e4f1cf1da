"""Exact offline τ: one teacher-forced target pass, packed drafter passes, replayed rounds.

    tf = teacher_forced(target, prompt_ids + reference, layer_ids)
    result = replay_sample(target, drafter, tf, prompt_len, reference, methods)

Why it is exact (docs/method.md §11.1): at a round starting at position s (the bonus X[s]), the
drafter sees the target features of positions < s and the block [X[s], MASK × (B−1)] —
nothing else. With the target's own continuation as reference, those features are the
teacher-forced ones, and the target's choice at each verified slot is the reference token.
So the drafter's output at every round start can be computed without decoding, and the
rounds replayed: the same committed tokens and acceptance lengths as
`flashdraft.decode.generate` at T=0 (tested in float64), the same distribution at T>0.

Cost: the drafter runs only at round starts some method actually reaches. All methods advance
together; each step packs the blocks of their current starts (deduplicated) into one drafter
forward over the cached context K/V, with a mask where each block sees context < its start
and its own block. Only per-slot argmaxes and top-K log-probs are kept (K = the largest
budget / top-k), never full logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashdraft.drafter import DFlashDrafter, DrafterCache
from flashdraft.eval.replay import DraftRows, Method, NeedWidth, Outcome, accept
from flashdraft.target import TargetModel


@dataclass
class TeacherForced:
    """The target's pass over prompt + reference."""

    tokens: torch.Tensor  # LongTensor [n]: prompt + reference, the ids the pass ran on
    features: torch.Tensor  # [1, n, k·H] outputs of `layer_ids`, concatenated in listed order
    layer_ids: list[int]
    choice: torch.Tensor  # LongTensor [n]: the target's argmax after each position
    margin: torch.Tensor  # float [n]: top-1 minus top-2 logit at each position (near-tie detector)

    def features_for(self, layer_ids: list[int], hidden: int) -> torch.Tensor:
        """[1, n, len(layer_ids)·H] for one drafter, sliced out of the union pass."""
        cols = []
        for i in layer_ids:
            j = self.layer_ids.index(i)
            cols.append(self.features[..., j * hidden : (j + 1) * hidden])
        return torch.cat(cols, dim=-1)


@torch.no_grad()
def teacher_forced(
    target: TargetModel,
    ids: list[int] | torch.Tensor,
    layer_ids: list[int],
    chunk: int = 512,
    head_from: int = 0,
) -> TeacherForced:
    """Features of `layer_ids` and the target's argmax at every position from `head_from` on, in
    one target forward (positions before `head_from` get choice −1 and margin NaN: the eval only
    checks the reference's positions, and the head is a large share of the pass).

    Logits are never held for the whole sequence: the final hidden state is captured and the
    head applied in chunks of `chunk` positions (a 2K-token, 150K-vocab pass is 1.2 GB of logits).
    """
    x = torch.as_tensor(ids, dtype=torch.long, device=target.device).view(1, -1)  # [1, n]
    last = target.num_layers - 1
    out = target.forward(x, layer_ids=[*layer_ids, last], logits="none")
    assert out.features is not None
    h = target.hidden_size
    feats = out.features[..., : len(layer_ids) * h]  # [1, n, k·H]
    final = out.features[0, :, len(layer_ids) * h :]  # [n, H], final-normed (HF hidden_states[-1])
    skip = min(max(head_from, 0), final.shape[0])
    choices = [torch.full((skip,), -1, dtype=torch.long, device=final.device)]
    margins = [torch.full((skip,), float("nan"), dtype=final.dtype, device=final.device)]
    for a in range(skip, final.shape[0], chunk):
        logits = target.lm_head(final[a : a + chunk])  # [c, V]
        top2 = logits.topk(2, dim=-1).values  # [c, 2]
        choices.append(logits.argmax(dim=-1))
        margins.append(top2[:, 0] - top2[:, 1])
    return TeacherForced(x[0], feats, list(layer_ids), torch.cat(choices), torch.cat(margins).float())


@dataclass
class StartRows:
    """The drafter's output at one round start: the slots computed so far and the slots the replay sees.

    The replay reads `visible` slots, on the same lazy schedule whatever was computed (first_slots,
    then doubling on demand), so every round is decided from the same rows however the head
    was batched; `computed` >= `visible` slots of argmax / top-K exist.
    """

    hidden: torch.Tensor  # [B−1, H] the drafter's final hidden at slots 1..B−1 (for more slots or width)
    argmax: list[int]  # [P] per computed slot
    top_lp: torch.Tensor  # float32 [P, W] full-vocabulary log-softmax, sorted descending
    top_ids: torch.Tensor  # int64 [P, W]
    visible: int
    vocab: int
    num_slots: int  # B − 1
    _view: DraftRows | None = None

    @property
    def computed(self) -> int:
        return len(self.argmax)

    def rows(self) -> DraftRows:
        """The visible slots as `accept` reads them."""
        v = self.visible
        if self._view is None or len(self._view.argmax) != v:  # grow/widen reset it
            self._view = DraftRows(
                self.argmax[:v], self.top_lp[:v], self.top_ids[:v], self.vocab, self.num_slots
            )
        return self._view


@dataclass
class HeadRows:
    argmax: list[list[int]]  # [R][S]
    top_lp: torch.Tensor  # float32 [R, S, W]
    top_ids: torch.Tensor  # int64 [R, S, W]


class DrafterRows:
    """The drafter's reduced output at any round start of a group of samples, computed on demand.

    The context K/V of every sample's positions is computed once (one drafter cache, batch =
    samples, zero-padded to the longest); `compute` then packs the requested blocks of every
    sample into one forward: block [X[s], MASK × (B−1)] at positions s..s+B−1 sees the context
    keys < s of its own sample and its own block only (keys at or past the step's latest start
    are cut off before the forward). The head (the target's lm_head over the whole vocabulary,
    the largest cost) runs on the first `first_slots` slots, or on all B−1 when most recent
    rounds needed them (`eager`); `grow` adds the rest for the blocks whose rounds need them, in
    one batched pass. Only the top-`width` log-probs per slot are kept (`widen` stores the
    full top-`full_width` for a start whose tree needs more).
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter,
        features: list[torch.Tensor],  # per sample [1, c_i, k·H]
        tokens: list[torch.Tensor],  # per sample LongTensor [n_i] prompt + reference
        full_width: int,
        first_slots: int = 2,
        width: int | None = None,
        eager: bool | None = None,
    ) -> None:
        self.target, self.drafter = target, drafter
        self.tokens = tokens
        self.full_width = full_width
        self.width = min(full_width, width) if width else full_width
        self.dtype = next(drafter.parameters()).dtype
        self.block = drafter.block_size
        self.first = max(1, min(first_slots, self.block - 1))
        self.eager_setting = eager
        self.eager = bool(eager)
        self._made = self._needed = 0  # blocks of the last forward / how many of them needed more slots
        self.vocab = target.lm_head.weight.shape[0]
        device = target.device
        g = len(features)
        self.context = max(1, max(f.shape[1] for f in features))
        feats = torch.zeros(
            g, self.context, features[0].shape[-1], dtype=self.dtype, device=device
        )  # [g, C, k·H]
        for i, f in enumerate(features):
            feats[i, : f.shape[1]] = f[0].to(self.dtype)  # padding rows are never attended to
        self.cache = DrafterCache.empty(drafter.config.num_hidden_layers)
        dummy = target.embed_tokens(torch.full((g, 1), drafter.mask_token_id, device=device)).to(self.dtype)
        positions = torch.arange(self.context + 1, device=device)[None].expand(g, -1)  # [g, C + 1]
        with torch.no_grad():  # fills the cache with every sample's context K/V; the output is unused
            drafter(feats, dummy, positions, cache=self.cache)
        self.forwards = [0] * g
        self.blocks = [0] * g

    @torch.no_grad()
    def compute(self, requests: dict[int, list[int]]) -> dict[int, dict[int, StartRows]]:
        """{sample: [starts]} -> {sample: {start: StartRows with `first_slots` visible}}."""
        if self.eager_setting is None:  # most rounds of the last forward needed more slots: compute all
            self.eager = self._needed * 2 > self._made
        samples = sorted(i for i, st in requests.items() if st)
        g, b = len(samples), self.block
        m = max(len(requests[i]) for i in samples)
        device = self.target.device
        # keys at or past the latest start are masked for every block of this forward: leave them out
        c = min(self.context, max(max(requests[i]) for i in samples))
        starts = torch.zeros(g, m, dtype=torch.long, device=device)  # padding blocks sit at 0
        real = torch.zeros(g, m, dtype=torch.bool, device=device)
        block_ids = torch.full((g, m, b), self.drafter.mask_token_id, dtype=torch.long, device=device)
        for r, i in enumerate(samples):
            st = torch.tensor(requests[i], dtype=torch.long, device=device)
            starts[r, : len(st)] = st
            real[r, : len(st)] = True
            block_ids[r, : len(st), 0] = self.tokens[i][st]  # the bonus of each round
        noise = self.target.embed_tokens(block_ids).reshape(g, m * b, -1).to(self.dtype)  # [g, m·B, H]
        positions = (starts[..., None] + torch.arange(b, device=device)).reshape(g, m * b)  # [g, m·B]
        # context keys strictly before the block's start, of real blocks only
        ctx_ok = (torch.arange(c, device=device) < starts[..., None]) & real[..., None]  # [g, m, C']
        ctx_ok = ctx_ok[:, :, None].expand(g, m, b, c).reshape(g, m * b, c)  # [g, m·B, C']
        blk = torch.arange(m * b, device=device) // b  # [m·B] block of each query/key slot
        own = blk[:, None] == blk[None, :]  # [m·B, m·B]: a block sees its own slots only
        mask = torch.cat([ctx_ok, own.expand(g, -1, -1)], dim=2)[:, None]  # [g, 1, m·B, C' + m·B]
        if g == len(self.forwards):  # every sample: slices of the cache (the drafter adds no rows to it)
            keys = [k[:, :, :c] for k in self.cache.keys]  # type: ignore[index]
            values = [v[:, :, :c] for v in self.cache.values]  # type: ignore[index]
        else:
            idx = torch.tensor(samples, dtype=torch.long, device=device)
            keys = [k[:, :, :c].index_select(0, idx) for k in self.cache.keys]  # type: ignore[index]
            values = [v[:, :, :c].index_select(0, idx) for v in self.cache.values]  # type: ignore[index]
        sub = DrafterCache(keys, values)  # type: ignore[arg-type]
        empty = torch.zeros(g, 0, self.drafter.fc.in_features, dtype=self.dtype, device=device)
        hidden = self.drafter(empty, noise, positions, attention_mask=mask, cache=sub)  # [g, m·B, H]
        hidden = hidden.view(g, m, b, -1)[:, :, 1:].to(self.target.dtype)  # [g, m, B−1, H]: slots 1..B−1
        flat = hidden[real]  # [R, B−1, H] the R real blocks
        self._made, self._needed = len(flat), 0
        n = b - 1 if self.eager else self.first
        head = self._head(flat[:, :n], self.width)
        out: dict[int, dict[int, StartRows]] = {}
        j = 0
        for i in samples:
            out[i] = {}
            for st in requests[i]:
                out[i][st] = StartRows(flat[j], head.argmax[j], head.top_lp[j], head.top_ids[j], self.first,
                                       self.vocab, b - 1)  # fmt: skip
                j += 1
            self.forwards[i] += 1
            self.blocks[i] += len(requests[i])
        return out

    def _head(self, hidden: torch.Tensor, width: int) -> HeadRows:
        """hidden [R, S, H] (slots 1..S) -> argmax and top-`width` log-probs, as generate/build_tree compute them."""
        r, n, h = hidden.shape
        x = hidden.reshape(r * n, h)  # one 2-D contiguous matmul: a strided 3-D input is ~9x slower on CPU
        logits, lp = self._logits(x)  # [R·S, V] each; float32 log-softmax, as build_tree normalises
        top_lp, top_ids = lp.topk(min(width, lp.shape[-1]), dim=-1)  # [R·S, W]
        # rounding is monotone, so a strict maximum of the log-probs is the logits' strict maximum:
        # only rows whose top two log-probs tie need the logits' own argmax (what generate takes)
        if top_lp.shape[1] >= 2:
            argmax = top_ids[:, 0].clone()
            tie = (top_lp[:, 0] == top_lp[:, 1]).nonzero().flatten()
            if len(tie):
                argmax[tie] = logits[tie].argmax(dim=-1)
        else:
            argmax = logits.argmax(dim=-1)
        return HeadRows(argmax.view(r, n).tolist(), top_lp.view(r, n, -1).cpu(), top_ids.view(r, n, -1).cpu())

    def _logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [N, V], float32 log-softmax [N, V]) of the target's head; on CPU into reused buffers
        with the head's weight transposed once (fresh 50 MB outputs per call cost page faults, and the
        NN matmul is faster than F.linear's NT one). Both may be overwritten by the next call."""
        head = self.target.lm_head
        if x.device.type != "cpu" or getattr(head, "bias", None) is not None:
            logits = head(x)
            return logits, torch.log_softmax(logits.float(), dim=-1)
        if getattr(self, "_w_t", None) is None:
            self._w_t = head.weight.detach().t().contiguous()  # [H, V]
            self._buf: dict[str, torch.Tensor] = {}
        rows, v = x.shape[0], self._w_t.shape[1]

        def buf(name: str, dtype: torch.dtype) -> torch.Tensor:
            b = self._buf.get(name)
            if b is None or b.shape[0] < rows:
                b = self._buf[name] = torch.empty(max(rows, 256), v, dtype=dtype)
            return b[:rows]

        logits = torch.mm(x.to(self._w_t.dtype), self._w_t, out=buf("logits", self._w_t.dtype))
        lp = torch.log_softmax(logits.float(), dim=-1, out=buf("lp", torch.float32))
        return logits, lp

    @torch.no_grad()
    def grow(self, starts: list[StartRows], upto: list[int]) -> None:
        """Let these starts' rounds see `upto` slots; the blocks that lack them get all B−1, in one head pass."""
        todo = [st for st, u in zip(starts, upto, strict=True) if st.computed < u]
        if todo:
            a = min(st.computed for st in todo)
            w = max(st.top_lp.shape[1] for st in todo)  # a widened start keeps its width
            head = self._head(torch.stack([st.hidden[a:] for st in todo]), w)  # [R, B−1−a, H]
            for j, st in enumerate(todo):
                k, sw = st.computed - a, st.top_lp.shape[1]  # rows of this pass the start already has
                st.argmax = st.argmax + head.argmax[j][k:]
                st.top_lp = torch.cat([st.top_lp, head.top_lp[j, k:, :sw]])
                st.top_ids = torch.cat([st.top_ids, head.top_ids[j, k:, :sw]])
        for st, u in zip(starts, upto, strict=True):
            self._needed += st.visible == self.first < u
            st.visible, st._view = u, None

    @torch.no_grad()
    def widen(self, st: StartRows) -> None:
        """Store the full top-`full_width` of every computed slot of this start (a tree needs more ranks)."""
        head = self._head(st.hidden[None, : st.computed], self.full_width)
        st.top_lp, st.top_ids, st._view = head.top_lp[0], head.top_ids[0], None


@dataclass
class MethodRounds:
    acceptance_lengths: list[int] = field(default_factory=list)  # τ per round (clipped as generate clips)
    predicted: list[float] = field(default_factory=list)  # surrogate τ per round

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0


@dataclass
class SampleResult:
    id: str
    prompt_tokens: int
    reference_tokens: int  # tokens replayed (after any truncation)
    methods: dict[str, MethodRounds]
    # chain rounds, slots 1..B−1: comparisons made / correct, unconditional and given all earlier correct
    slot_total: list[int]
    slot_correct: list[int]
    slot_cond_total: list[int]
    slot_cond_correct: list[int]
    drafter_forwards: int = 0
    drafter_blocks: int = 0


@dataclass
class ReplayItem:
    id: str
    tf: TeacherForced
    prompt_len: int
    reference: list[int]  # new tokens only, within max_new_tokens/stop (after any truncation)
    tf_seconds: float = 0.0  # time of the teacher-forced pass (reported separately)


def replay_sample(
    target: TargetModel,
    drafter: DFlashDrafter,
    tf: TeacherForced,
    prompt_len: int,
    reference: list[int],
    methods: list[Method],
    sample_id: str = "",
    **kw: int,
) -> SampleResult:
    """Replay every method's rounds over one reference (see `replay_batch`)."""
    return replay_batch(target, drafter, [ReplayItem(sample_id, tf, prompt_len, reference)], methods, **kw)[0]


def replay_batch(
    target: TargetModel,
    drafter: DFlashDrafter,
    items: list[ReplayItem],
    methods: list[Method],
    *,
    first_slots: int = 2,
    slot_stride: int = 4,
    topk_width: int | None = 32,
    eager: bool | None = None,
) -> list[SampleResult]:
    """Replay every method's rounds over a group of references, drafter passes shared.

    Rounds are decided exactly as generate decides them. What a round reads follows one lazy
    schedule: the first `first_slots` slots, more (doubling) only when its outcome needs them,
    and every slot for every `slot_stride`-th chain round of a sample (those rounds give the
    unconditional per-slot accuracy). What is computed is a speed choice that changes no
    result: `eager` (None = adaptive) runs the head on all slots at once when most rounds need
    them; `topk_width` keeps only the top-`topk_width` log-probs per slot (None: the largest
    budget's) and stores the full top-`budget` for the rare start whose tree needs more.
    """
    b = drafter.block_size
    results = [
        SampleResult(
            it.id, it.prompt_len, len(it.reference), {m.name: MethodRounds() for m in methods},
            [0] * (b - 1), [0] * (b - 1), [0] * (b - 1), [0] * (b - 1),
        )
        for it in items
    ]  # fmt: skip
    live = [
        k for k, it in enumerate(items) if len(it.reference) >= 2
    ]  # one token: the prefill commits it, no round
    if not live:
        return results
    ends, toks, feats = {}, {}, []
    for k in live:
        it = items[k]
        n = it.prompt_len + len(it.reference)
        tokens = it.tf.tokens[:n]  # [n]
        if tokens[it.prompt_len :].tolist() != list(it.reference):
            raise ValueError(
                f"sample {it.id}: the reference is not the continuation the teacher-forced pass ran on"
            )
        ends[k] = n - 1  # the last committed token's position; the prefill committed X[prompt_len]
        toks[k] = tokens.tolist()
        feats.append(it.tf.features_for(drafter.target_layer_ids, target.hidden_size)[:, : ends[k]])
    full_width = max(m.width for m in methods)
    narrow = max([topk_width or full_width, *(m.width for m in methods if m.kind != "ddtree")])
    rows_of = DrafterRows(target, drafter, feats, [items[k].tf.tokens for k in live], full_width, first_slots,
                          width=narrow, eager=eager)  # fmt: skip
    slot = {k: r for r, k in enumerate(live)}  # sample -> its row in the drafter batch
    pos = {k: {m.name: items[k].prompt_len for m in methods} for k in live}
    memo: dict[int, dict[int, StartRows]] = {k: {} for k in live}
    walks: dict[tuple[int, int], dict] = {}  # (sample, start) -> the start's shared tree walk
    tree_budget = max((m.size for m in methods if m.kind == "ddtree"), default=0)
    chain_rounds = dict.fromkeys(live, 0)

    def decide(k: int, m: Method) -> Outcome | None:
        """The round of method m at its current start, or None when it needs more visible slots."""
        s = pos[k][m.name]
        st = memo[k][s]
        sampled = m.kind == "chain" and chain_rounds[k] % slot_stride == 0
        while True:
            rows = st.rows()
            if sampled and not rows.complete:
                return None
            out = accept(m, rows, _ref(toks[k], s, ends[k], b), walks.setdefault((k, s), {}), tree_budget)
            if not isinstance(out, NeedWidth):
                return out
            rows_of.widen(st)  # rare: the tree uses more ranks of a slot than were kept

    while True:
        active = {k: [m for m in methods if pos[k][m.name] < ends[k]] for k in live}
        active = {k: ms for k, ms in active.items() if ms}
        if not active:
            break
        need = {slot[k]: sorted({pos[k][m.name] for m in ms} - memo[k].keys()) for k, ms in active.items()}
        if any(need.values()):
            got = rows_of.compute({r: st for r, st in need.items() if st})
            for k in active:
                memo[k].update(got.get(slot[k], {}))
        # decide every (sample, method) round; rounds whose outcome needs more slots wait for one batched pass
        pending: list[tuple[int, Method]] = []
        decided: list[tuple[int, Method, Outcome]] = []
        for k, ms in active.items():
            for m in ms:
                out = decide(k, m)
                if out is None:
                    pending.append((k, m))
                else:
                    decided.append((k, m, out))
        while pending:
            # more visible slots (doubling) for the starts whose rounds are still undecided
            keys = sorted({(k, pos[k][m.name]) for k, m in pending})
            todo = [memo[k][s] for k, s in keys if not memo[k][s].rows().complete]
            assert todo, "complete rows always decide"
            rows_of.grow(todo, [min(2 * st.visible, b - 1) for st in todo])
            still: list[tuple[int, Method]] = []
            for k, m in pending:
                out = decide(k, m)
                if out is None:
                    still.append((k, m))
                else:
                    decided.append((k, m, out))
            pending = still
        for k, m, out in decided:
            s = pos[k][m.name]
            res = results[k]
            tau = min(out.accepted + 1, ends[k] - s)
            mr = res.methods[m.name]
            mr.acceptance_lengths.append(tau)
            mr.predicted.append(out.predicted)
            if out.slot_correct is not None:
                unconditional = chain_rounds[k] % slot_stride == 0
                earlier = True
                for j, ok in enumerate(out.slot_correct):
                    if unconditional:
                        res.slot_total[j] += 1
                        res.slot_correct[j] += ok
                    if earlier:
                        res.slot_cond_total[j] += 1
                        res.slot_cond_correct[j] += ok
                    earlier = earlier and ok
                chain_rounds[k] += 1
            pos[k][m.name] = s + tau
        for k in active:
            low = min(pos[k].values())
            for st in [st for st in memo[k] if st < low]:  # no method goes back: bounded memory
                del memo[k][st]
                walks.pop((k, st), None)
    for k in live:
        results[k].drafter_forwards = rows_of.forwards[slot[k]]
        results[k].drafter_blocks = rows_of.blocks[slot[k]]
    return results


def _ref(tokens: list[int], s: int, end: int, block: int) -> list[int]:
    """The reference tokens a round at s compares with: after the bonus, at most B−1, none past the end."""
    return tokens[s + 1 : s + 1 + min(block - 1, end - s)]
