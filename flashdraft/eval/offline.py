"""Exact offline τ: one teacher-forced target pass, packed drafter passes, replayed rounds.

    tf = teacher_forced(target, prompt_ids + reference, layer_ids)
    result = replay_sample(target, drafter, tf, prompt_len, reference, methods)

Why it is exact (DESIGN.md §4): at a round starting at position s (the bonus X[s]), the
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
import torch.nn.functional as F

from flashdraft.drafter import DFlashDrafter, DrafterCache
from flashdraft.eval.replay import DraftRows, Method, Outcome, accept
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
    target: TargetModel, ids: list[int] | torch.Tensor, layer_ids: list[int], chunk: int = 512
) -> TeacherForced:
    """Features of `layer_ids` and the target's argmax at every position, in one target forward.

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
    choices, margins = [], []
    for a in range(0, final.shape[0], chunk):
        logits = target.lm_head(final[a : a + chunk])  # [c, V]
        top2 = logits.topk(2, dim=-1).values  # [c, 2]
        choices.append(logits.argmax(dim=-1))
        margins.append(top2[:, 0] - top2[:, 1])
    return TeacherForced(x[0], feats, list(layer_ids), torch.cat(choices), torch.cat(margins).float())


class DrafterRows:
    """The drafter's reduced output at any round start of a group of samples, computed on demand.

    The context K/V of every sample's positions is computed once (one drafter cache, batch =
    samples, zero-padded to the longest); `compute` then packs the requested blocks of every
    sample into one forward: block [X[s], MASK × (B−1)] at positions s..s+B−1 sees the context
    keys < s of its own sample and its own block only. The head (the target's lm_head, the
    largest cost) runs on the first `first_slots` slots; `complete` adds the rest for the
    blocks that need them (`extend`, doubling the slots each time).
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter,
        features: list[torch.Tensor],  # per sample [1, c_i, k·H]
        tokens: list[torch.Tensor],  # per sample LongTensor [n_i] prompt + reference
        width: int,
        first_slots: int = 2,
    ) -> None:
        self.target, self.drafter = target, drafter
        self.tokens = tokens
        self.width = width
        self.dtype = next(drafter.parameters()).dtype
        self.block = drafter.block_size
        self.first = max(1, min(first_slots, self.block - 1))
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
    def compute(self, requests: dict[int, list[int]]) -> dict[int, dict[int, tuple[DraftRows, torch.Tensor]]]:
        """{sample: [starts]} -> {sample: {start: (rows of the first slots, hidden [B−1, H])}}."""
        samples = sorted(i for i, st in requests.items() if st)
        g, b, c = len(samples), self.block, self.context
        m = max(len(requests[i]) for i in samples)
        device = self.target.device
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
        ctx_ok = (torch.arange(c, device=device) < starts[..., None]) & real[..., None]  # [g, m, C]
        ctx_ok = ctx_ok.repeat_interleave(b, dim=1)  # [g, m·B, C]
        own = torch.block_diag(*[torch.ones(b, b, dtype=torch.bool, device=device)] * m)  # [m·B, m·B]
        mask = torch.cat([ctx_ok, own.expand(g, -1, -1)], dim=2)[:, None]  # [g, 1, m·B, C + m·B]
        idx = torch.tensor(samples, dtype=torch.long, device=device)
        sub = DrafterCache(  # this forward's samples only; the drafter adds no context rows to it
            [k.index_select(0, idx) for k in self.cache.keys],  # type: ignore[union-attr]
            [v.index_select(0, idx) for v in self.cache.values],  # type: ignore[union-attr]
        )
        empty = torch.zeros(g, 0, self.drafter.fc.in_features, dtype=self.dtype, device=device)
        hidden = self.drafter(empty, noise, positions, attention_mask=mask, cache=sub)  # [g, m·B, H]
        hidden = hidden.view(g, m, b, -1)[:, :, 1:].to(self.target.dtype)  # [g, m, B−1, H]: slots 1..B−1
        rows = self._head(hidden[real][:, : self.first])  # for the R real blocks, slots 1..first
        out: dict[int, dict[int, tuple[DraftRows, torch.Tensor]]] = {}
        flat = hidden[real]  # [R, B−1, H]
        k = 0
        for i in samples:
            out[i] = {}
            for st in requests[i]:
                out[i][st] = (rows[k], flat[k])
                k += 1
            self.forwards[i] += 1
            self.blocks[i] += len(requests[i])
        return out

    def _head(self, hidden: torch.Tensor) -> list[DraftRows]:
        """hidden [R, S, H] (slots 1..S) -> per block: argmax, top-K log-probs, as generate/build_tree compute them."""
        logits = self.target.lm_head(hidden)  # [R, S, V]
        argmax = logits.argmax(dim=-1).tolist()  # [R][S]
        lp = torch.log_softmax(logits.float(), dim=-1)  # float32, as build_tree normalises
        top_lp, top_ids = lp.topk(min(self.width, lp.shape[-1]), dim=-1)  # [R, S, K]
        top_lp, top_ids = top_lp.cpu(), top_ids.cpu()
        v = lp.shape[-1]
        return [DraftRows(argmax[r], top_lp[r], top_ids[r], v, self.block - 1) for r in range(len(argmax))]

    @torch.no_grad()
    def extend(self, partial: list[tuple[DraftRows, torch.Tensor]], upto: list[int]) -> list[DraftRows]:
        """More slots for these blocks (block i up to slot upto[i]), in one head pass."""
        have = [len(p.argmax) for p, _ in partial]
        n = max(u - h for u, h in zip(upto, have, strict=True))
        hidden = torch.stack(
            [
                F.pad(h[a : a + n], (0, 0, 0, n - len(h[a : a + n])))
                for (_, h), a in zip(partial, have, strict=True)
            ]
        )  # [R, n, H]: the next n slots of each block (zero rows past the block's end are dropped below)
        more = self._head(hidden)
        out = []
        for (p, _), q, a, u in zip(partial, more, have, upto, strict=True):
            k = u - a
            out.append(DraftRows(
                p.argmax + q.argmax[:k], torch.cat([p.top_lp, q.top_lp[:k]]), torch.cat([p.top_ids, q.top_ids[:k]]),
                p.vocab, p.num_slots,
            ))  # fmt: skip
        return out


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
) -> list[SampleResult]:
    """Replay every method's rounds over a group of references, drafter passes shared.

    Rounds are decided exactly as generate decides them; the lm_head runs on slots beyond
    `first_slots` only for blocks whose outcome needs them, and for every `slot_stride`-th
    chain round of a sample (those rounds give the unconditional per-slot accuracy).
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
    rows_of = DrafterRows(target, drafter, feats, [items[k].tf.tokens for k in live], max(m.width for m in methods),
                          first_slots)  # fmt: skip
    slot = {k: r for r, k in enumerate(live)}  # sample -> its row in the drafter batch
    pos = {k: {m.name: items[k].prompt_len for m in methods} for k in live}
    memo: dict[int, dict[int, tuple[DraftRows, torch.Tensor]]] = {k: {} for k in live}
    walks: dict[tuple[int, int], dict] = {}  # (sample, start) -> the start's shared tree walk
    tree_budget = max((m.size for m in methods if m.kind == "ddtree"), default=0)
    chain_rounds = dict.fromkeys(live, 0)
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
        # decide every (sample, method) round; rounds whose outcome needs more slots wait for one batched head pass
        pending: list[tuple[int, Method]] = []
        decided: list[tuple[int, Method, Outcome]] = []
        for k, ms in active.items():
            for m in ms:
                s = pos[k][m.name]
                rows = memo[k][s][0]
                sampled = m.kind == "chain" and chain_rounds[k] % slot_stride == 0
                shared = walks.setdefault((k, s), {})
                ref = _ref(toks[k], s, ends[k], b)
                out = None if (sampled and not rows.complete) else accept(m, rows, ref, shared, tree_budget)
                if out is None:
                    pending.append((k, m))
                else:
                    decided.append((k, m, out))
        while pending:
            # the head on more slots (doubling) for the starts whose rounds are still undecided
            keys = sorted({(k, pos[k][m.name]) for k, m in pending})
            todo = [(k, s) for k, s in keys if not memo[k][s][0].complete]
            assert todo, "complete rows always decide"
            upto = [min(2 * len(memo[k][s][0].argmax), b - 1) for k, s in todo]
            grown = rows_of.extend([memo[k][s] for k, s in todo], upto)  # type: ignore[misc]
            for (k, s), rows in zip(todo, grown, strict=True):
                memo[k][s] = (rows, memo[k][s][1])
            still: list[tuple[int, Method]] = []
            for k, m in pending:
                s = pos[k][m.name]
                rows = memo[k][s][0]
                sampled = m.kind == "chain" and chain_rounds[k] % slot_stride == 0
                ref = _ref(toks[k], s, ends[k], b)
                out = (
                    None
                    if (sampled and not rows.complete)
                    else accept(m, rows, ref, walks.setdefault((k, s), {}), tree_budget)
                )
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
