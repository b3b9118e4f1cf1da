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

from flashdraft.drafter import DFlashDrafter, DrafterCache
from flashdraft.eval.replay import DraftRows, Method, accept
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
    """The drafter's reduced output at any round start of one sample, computed on demand.

    The context K/V of every position is computed once (the drafter cache); each call then
    packs the requested blocks into one forward: block i = [X[s_i], MASK × (B−1)] at
    positions s_i..s_i+B−1, seeing context keys < s_i and its own block only.
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter,
        features: torch.Tensor,
        tokens: torch.Tensor,
        width: int,
    ) -> None:
        self.target, self.drafter = target, drafter
        self.tokens = tokens  # LongTensor [n] prompt + reference
        self.width = width
        self.dtype = next(drafter.parameters()).dtype
        self.block = drafter.block_size
        device = target.device
        n = features.shape[1]
        self.cache = DrafterCache.empty(drafter.config.num_hidden_layers)
        dummy = target.embed_tokens(torch.tensor([drafter.mask_token_id], device=device))[None].to(self.dtype)
        positions = torch.arange(n + 1, device=device)[None]  # [1, n + 1]
        with torch.no_grad():  # fills the cache with the context K/V of all n positions; the output is unused
            drafter(features.to(self.dtype), dummy, positions, cache=self.cache)
        self.context = n
        self.forwards = 0
        self.blocks = 0

    @torch.no_grad()
    def compute(self, starts: list[int]) -> dict[int, DraftRows]:
        m, b, c = len(starts), self.block, self.context
        device = self.target.device
        s = torch.tensor(starts, dtype=torch.long, device=device)  # [m]
        block_ids = torch.full((m, b), self.drafter.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, 0] = self.tokens[s]  # the bonus of each round
        noise = self.target.embed_tokens(block_ids).reshape(1, m * b, -1).to(self.dtype)  # [1, m·B, H]
        positions = (s[:, None] + torch.arange(b, device=device)).reshape(1, m * b)  # [1, m·B]
        ctx_ok = torch.arange(c, device=device)[None, :] < s[:, None]  # [m, c]: context strictly before s
        ctx_ok = ctx_ok.repeat_interleave(b, dim=0)  # [m·B, c]
        own = torch.block_diag(*[torch.ones(b, b, dtype=torch.bool, device=device)] * m)  # [m·B, m·B]
        mask = torch.cat([ctx_ok, own], dim=1)[None, None]  # [1, 1, m·B, c + m·B]
        empty = torch.zeros(1, 0, self.drafter.fc.in_features, dtype=self.dtype, device=device)
        hidden = self.drafter(empty, noise, positions, attention_mask=mask, cache=self.cache)  # [1, m·B, H]
        self.cache.crop(c)  # nothing was added (no new context rows), but keep the invariant explicit
        hidden = hidden.view(m, b, -1)[:, 1:]  # [m, B−1, H]: slots 1..B−1
        logits = self.target.lm_head(hidden.to(self.target.dtype))  # [m, B−1, V], as generate computes them
        argmax = logits.argmax(dim=-1).tolist()  # [m][B−1]
        lp = torch.log_softmax(logits.float(), dim=-1)  # float32, as build_tree normalises
        top_lp, top_ids = lp.topk(min(self.width, lp.shape[-1]), dim=-1)  # [m, B−1, K]
        self.forwards += 1
        self.blocks += m
        return {
            st: DraftRows(argmax[i], top_lp[i].cpu(), top_ids[i].cpu(), lp.shape[-1])
            for i, st in enumerate(starts)
        }


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


def replay_sample(
    target: TargetModel,
    drafter: DFlashDrafter,
    tf: TeacherForced,
    prompt_len: int,
    reference: list[int],
    methods: list[Method],
    sample_id: str = "",
) -> SampleResult:
    """Replay every method's rounds over one reference (new tokens only, within max_new_tokens/stop)."""
    b = drafter.block_size
    n_ref = len(reference)
    tokens = tf.tokens[: prompt_len + n_ref]  # [prompt_len + n_ref]
    if tokens[prompt_len:].tolist() != list(reference):
        raise ValueError(
            f"sample {sample_id}: the reference is not the continuation the teacher-forced pass ran on"
        )
    end = prompt_len + n_ref - 1  # the last committed token's position; the prefill committed X[prompt_len]
    feats = tf.features_for(drafter.target_layer_ids, target.hidden_size)[
        :, : max(end, 0)
    ]  # context < end suffices
    result = SampleResult(
        sample_id, prompt_len, n_ref, {m.name: MethodRounds() for m in methods},
        [0] * (b - 1), [0] * (b - 1), [0] * (b - 1), [0] * (b - 1),
    )  # fmt: skip
    if n_ref < 2:
        return result  # no round: the prefill alone commits the only token
    width = max(m.width for m in methods)
    rows_of = DrafterRows(target, drafter, feats, tokens, width)
    ref_list = tokens.tolist()
    pos = {m.name: prompt_len for m in methods}
    memo: dict[int, DraftRows] = {}
    while True:
        active = [m for m in methods if pos[m.name] < end]
        if not active:
            break
        need = sorted({pos[m.name] for m in active} - memo.keys())
        if need:
            memo.update(rows_of.compute(need))
        for m in active:
            s = pos[m.name]
            remaining = end - s
            ref = ref_list[s + 1 : s + 1 + min(b - 1, remaining)]
            out = accept(m, memo[s], ref)
            tau = min(out.accepted + 1, remaining)
            rounds = result.methods[m.name]
            rounds.acceptance_lengths.append(tau)
            rounds.predicted.append(out.predicted)
            if out.slot_correct is not None:
                earlier = True
                for k, ok in enumerate(out.slot_correct):
                    result.slot_total[k] += 1
                    result.slot_correct[k] += ok
                    if earlier:
                        result.slot_cond_total[k] += 1
                        result.slot_cond_correct[k] += ok
                    earlier = earlier and ok
            pos[m.name] = s + tau
        low = min(pos.values())
        for st in [st for st in memo if st < low]:  # no method goes back: bounded memory
            del memo[st]
    result.drafter_forwards, result.drafter_blocks = rows_of.forwards, rows_of.blocks
    return result
