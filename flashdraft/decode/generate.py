"""Lossless speculative decoding on a transformers target: DFlash chain, DDTree, and plain AR.

The reference decode path (docs/method.md §8): correctness first, generic transformers code. The
fast CUDA-graph engine (`flashdraft.decode.engine`) must stay token-identical to it.

    flashdraft generate --drafter RUN/checkpoints/step-00001000/drafter --prompt "Hi" --chat
    result = generate(target, drafter, ids, max_new_tokens=256, method="ddtree", budget=8)
    result.tokens, result.acceptance_lengths, result.mean_acceptance

Round invariants (checked after every round by the tests through `_round_callback`):
- the target KV cache holds the prompt and every committed token except the newest (the
  bonus, which has no KV yet): length == prompt_tokens + committed - 1;
- the drafter KV cache holds context K/V only; the context rows not yet fed to it (features
  of the old bonus and the accepted drafts) wait in `pending`, so
  drafter cache length + pending rows == target cache length.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from flashdraft import cache as kv
from flashdraft.decode.sampling import SamplingParams, choose_tokens
from flashdraft.drafter import DFlashDrafter, DrafterCache
from flashdraft.target import TargetModel, check_pair
from flashdraft.tree import build_tree, tree_positions, tree_visibility, walk_tree

METHODS = ("chain", "ddtree", "ar", "auto")  # auto: flashdraft/decode/budget.py picks among the others


@dataclass
class Timings:
    """Wall-clock seconds per phase. On CUDA the split between phases is only exact with
    `sync_timings=True` (otherwise queued kernels are billed to the next host read)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0  # everything after the prefill
    draft_s: float = 0.0  # drafter forward + head
    tree_s: float = 0.0  # top-k read, heap, visibility mask, positions
    verify_s: float = 0.0  # target forward, token choice, host read, cache commit
    total_s: float = 0.0


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only; the stop token included if hit; never more than max_new_tokens
    acceptance_lengths: list[int]  # tokens committed per round (1..B); sum == len(tokens) - 1
    prompt_tokens: int
    rounds: int
    stop_reason: str  # "stop" | "length" | "cancelled"
    timings: Timings = field(default_factory=Timings)
    method: str = "chain"
    budget: int | None = None
    # per DDTree round, the accepted nodes' build-order indices (root excluded; parents before children): a tree of
    # b smaller than the round's budget holds nodes 1..b, so it would have accepted the path's nodes <= b
    tree_paths: list[list[int]] = field(default_factory=list)

    @property
    def mean_acceptance(self) -> float:
        """τ: mean tokens committed per round (0.0 when no round ran)."""
        if not self.acceptance_lengths:
            return 0.0
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.timings.total_s if self.timings.total_s > 0 else 0.0


@dataclass
class RoundInfo:
    """State after a round (debug/test hook `_round_callback`); round 0 is the prefill."""

    round: int
    committed: int  # new tokens committed so far
    prompt_tokens: int
    accepted: int  # tokens committed in this round (after stop/length truncation)
    target_cache_length: int
    drafter_cache_length: int  # context rows inside the drafter's KV cache
    drafter_pending: int  # context rows waiting to be fed at the next drafter pass


@dataclass
class _State:
    target_cache: Any
    drafter_cache: DrafterCache | None
    pending: torch.Tensor | None  # [1, c, k·H] features of context rows not yet in the drafter cache
    bonus: torch.Tensor  # LongTensor [1] on the target device: the last committed token
    position: int  # the bonus's position == target cache length


def _sync(device: torch.device, enabled: bool) -> None:
    if enabled and device.type == "cuda":
        torch.cuda.synchronize(device)


def prepare_ids(input_ids: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(
                f"input_ids has batch size {ids.shape[0]}: generate decodes one sequence ([n] or [1, n])"
            )
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty [n] or [1, n] tensor, got shape {tuple(ids.shape)}")
    return ids.to(device)[None]  # [1, n]


def check_request(method: str, budget: int | None, max_new_tokens: int, has_drafter: bool) -> None:
    """The checks every decoder makes of a request (this module's `generate` and `FastEngine.generate`)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens {max_new_tokens} must be >= 0")
    if method not in ("ar", "auto") and not has_drafter:  # auto without a drafter is AR
        raise ValueError(f"method {method!r} needs a drafter (pass drafter=..., or use method='ar')")
    if method == "ddtree":
        if budget is None:
            raise ValueError("method 'ddtree' needs budget=N (tree nodes excluding the root), e.g. budget=8")
        if budget < 0:
            raise ValueError(f"budget {budget} must be >= 0")


def seed_generator(generator: torch.Generator, seed: int | None) -> None:
    """A sampled request's generator: `seed` makes the output reproducible, None draws a fresh seed."""
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)


def deliver(
    result: GenerationResult,
    new: list[int],
    reason: str | None,
    on_tokens: Callable[[list[int]], bool | None] | None,
) -> bool:
    """Record a round's tokens in `result` and hand them to `on_tokens`; True when generation must stop: a stop
    token or the length limit (`reason`; those last tokens are delivered whatever the callback answers), or the
    callback returned False ("cancelled")."""
    result.tokens.extend(new)
    answer = on_tokens(new) if on_tokens is not None else None
    if reason is not None:
        result.stop_reason = reason
        return True
    if answer is False:
        result.stop_reason = "cancelled"
        return True
    return False


def _validate(
    target: TargetModel, drafter: DFlashDrafter | None, method: str, budget: int | None, max_new_tokens: int
) -> None:
    check_request(method, budget, max_new_tokens, drafter is not None)
    if method == "ar" or drafter is None:
        return
    check_pair(target, drafter.config)
    try:
        d_device = next(drafter.parameters()).device
    except StopIteration:
        d_device = target.device
    if d_device != target.device:
        raise ValueError(f"drafter is on {d_device}, target on {target.device}: move the drafter with .to()")
    if method == "ddtree" and target.attn_implementation in ("flash_attention_2", "flash_attention_3"):
        raise ValueError(
            f"method 'ddtree' needs a tree attention mask, which {target.attn_implementation} cannot take: "
            "load the target with attn_implementation='sdpa' or 'eager' (or use method='chain')"
        )


def truncate_round(new: list[int], remaining: int, stop: set[int]) -> tuple[list[int], str | None]:
    """Cut a round's tokens at the first stop token (kept) and at the length limit."""
    for i, t in enumerate(new):
        if t in stop and i < remaining:
            return new[: i + 1], "stop"
    if len(new) >= remaining:
        return new[:remaining], "length"
    return new, None


@torch.no_grad()
def generate(
    target: TargetModel | torch.nn.Module,
    drafter: DFlashDrafter | None,
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
    sync_timings: bool = False,
    policy: Any = None,
    _round_callback: Callable[[RoundInfo], None] | None = None,
) -> GenerationResult:
    """Decode up to `max_new_tokens` new tokens after `input_ids`, losslessly.

    target: a TargetModel or a raw Hugging Face causal LM (wrapped). drafter: a DFlashDrafter
    shaped for the target (None for method "ar"). T = 0 is greedy (token-identical to AR in
    exact arithmetic); T > 0 samples the target's token at every verified slot (top-k / top-p
    as in AR) from a generator seeded with `seed`, so the output distribution equals AR's.
    `on_tokens(tokens)` gets the tokens committed after the prefill and after each round;
    returning False stops at once with stop_reason "cancelled" (unless that round already
    ended generation by a stop token or the length limit).
    method "auto": `policy` (`flashdraft.decode.budget.AutoPolicy`) picks AR, the chain or a DDTree
    budget every `policy.period` rounds and learns from each round; AR rounds then also keep the
    drafter's context features, so any switch is lossless. Without a drafter, auto is AR.
    """
    t_start = time.perf_counter()
    if not isinstance(target, TargetModel):
        target = TargetModel(target)
    _validate(target, drafter, method, budget, max_new_tokens)
    if method == "auto" and drafter is None:
        method = "ar"
    if method == "auto" and policy is None:
        raise ValueError("method 'auto' needs policy=flashdraft.decode.budget.auto_policy(...)")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    device = target.device
    ids = prepare_ids(input_ids, device)  # [1, n]
    prompt_len = ids.shape[1]
    stop = {int(t) for t in (stop_token_ids or [])}
    generator: torch.Generator | None = None
    if not params.greedy:
        generator = torch.Generator(device=device)
        seed_generator(generator, seed)
    timings = Timings()
    result = GenerationResult(
        [], [], prompt_len, 0, "length", timings, method, budget if method == "ddtree" else None
    )
    if max_new_tokens == 0:
        timings.total_s = time.perf_counter() - t_start
        return result

    use_drafter = method != "ar"
    layer_ids = list(drafter.target_layer_ids) if use_drafter and drafter is not None else None

    # prefill: the prompt's KV and features; the first new token comes from the target alone
    t0 = time.perf_counter()
    target_cache = kv.new_cache()
    out = target.forward(ids, layer_ids=layer_ids, cache=target_cache, logits="last")
    assert out.logits is not None
    first = choose_tokens(out.logits[0, -1], params, generator).view(1)  # [1]
    first_tok = int(first.item())  # host read
    drafter_cache = (
        DrafterCache.empty(drafter.config.num_hidden_layers) if use_drafter and drafter is not None else None
    )
    state = _State(
        target_cache=target_cache,
        drafter_cache=drafter_cache,
        pending=out.features,
        bonus=first,
        position=prompt_len,
    )
    del out
    timings.prefill_s = time.perf_counter() - t0

    def commit(new: list[int], reason: str | None) -> bool:
        """Record a round's tokens and tell the caller; True when generation must stop."""
        if _round_callback is not None:  # counts this round's tokens as committed
            _round_callback(_round_info(result, state, len(new) if result.rounds else 0, len(new)))
        return deliver(result, new, reason, on_tokens)

    done = commit(*truncate_round([first_tok], max_new_tokens, stop))

    t_decode = time.perf_counter()
    choice: tuple[str, int | None] = (method, budget)
    while not done:
        remaining = max_new_tokens - len(result.tokens)
        if method == "auto" and result.rounds % policy.period == 0:
            choice = policy.choice()
        m, b = choice
        if m == "ar":
            # auto: AR rounds keep the drafter's context features, so a later draft round can follow
            keep = method == "auto" and not getattr(policy, "ar_final", False)
            new = _ar_round(
                target, state, params, generator, timings, sync_timings, layer_ids if keep else None
            )
        else:
            assert drafter is not None and layer_ids is not None
            draft_logits = _draft(target, drafter, state, timings, sync_timings)  # [B-1, V]
            if m == "chain":
                new = _chain_verify(
                    target, layer_ids, state, draft_logits, params, generator, remaining, stop, timings
                )
            else:
                assert b is not None
                new, nodes = _tree_verify(
                    target, layer_ids, state, draft_logits, b, params, generator, remaining, stop, timings,
                    sync_timings,
                )  # fmt: skip
                result.tree_paths.append(nodes)
        new, reason = truncate_round(new, remaining, stop)
        result.rounds += 1
        result.acceptance_lengths.append(len(new))
        if method == "auto" and reason is None:  # a truncated round says nothing of the method
            policy.observe(choice, [len(new)], [result.tree_paths[-1]] if m == "ddtree" else None)
        done = commit(new, reason)
    timings.decode_s = time.perf_counter() - t_decode
    timings.total_s = time.perf_counter() - t_start
    return result


def _round_info(result: GenerationResult, state: _State, accepted: int, committing: int) -> RoundInfo:
    return RoundInfo(
        round=result.rounds,
        committed=len(result.tokens) + committing,
        prompt_tokens=result.prompt_tokens,
        accepted=accepted,
        target_cache_length=kv.length(state.target_cache),
        drafter_cache_length=state.drafter_cache.length if state.drafter_cache is not None else 0,
        drafter_pending=0 if state.pending is None else int(state.pending.shape[1]),
    )


# ----------------------------------------------------------------------------- rounds


def _ar_round(
    target: TargetModel,
    state: _State,
    params: SamplingParams,
    generator: torch.Generator | None,
    timings: Timings,
    sync_timings: bool,
    layer_ids: list[int] | None = None,
) -> list[int]:
    """One target step; with `layer_ids`, its features join the drafter's pending context."""
    t0 = time.perf_counter()
    out = target.forward(state.bonus.view(1, 1), layer_ids=layer_ids, cache=state.target_cache, logits="last")
    assert out.logits is not None
    if layer_ids is not None:
        assert out.features is not None
        state.pending = (
            out.features if state.pending is None else torch.cat([state.pending, out.features], dim=1)
        )
    nxt = choose_tokens(out.logits[0, -1], params, generator).view(1)  # [1]
    tok = int(nxt.item())  # host read, once per round
    state.bonus, state.position = nxt, state.position + 1
    _sync(target.device, sync_timings)
    timings.verify_s += time.perf_counter() - t0
    return [tok]


def _draft(
    target: TargetModel, drafter: DFlashDrafter, state: _State, timings: Timings, sync_timings: bool
) -> torch.Tensor:
    """One drafter pass on [bonus, MASK × (B−1)] with the pending context: logits [B−1, V]."""
    t0 = time.perf_counter()
    assert state.drafter_cache is not None and state.pending is not None
    block = drafter.block_size
    p = state.position
    c = state.pending.shape[1]
    if state.drafter_cache.length + c != p:  # the drafter context must end right before the bonus
        raise RuntimeError(
            f"drafter context out of step: cache {state.drafter_cache.length} + pending {c} != bonus position {p}"
        )
    mask_ids = torch.full((block - 1,), drafter.mask_token_id, dtype=torch.long, device=state.bonus.device)
    block_ids = torch.cat([state.bonus, mask_ids])  # [B]
    d_dtype = next(drafter.parameters()).dtype
    noise = target.embed_tokens(block_ids)[None].to(d_dtype)  # [1, B, H]
    positions = torch.arange(p - c, p + block, device=state.bonus.device)[None]  # [1, c + B]
    hidden = drafter(state.pending.to(d_dtype), noise, positions, cache=state.drafter_cache)  # [1, B, H]
    state.pending = None  # now inside the drafter cache (context only: block K/V is never stored)
    logits = target.lm_head(hidden[0, 1:].to(target.dtype))  # [B−1, V], slots 1..B−1
    _sync(target.device, sync_timings)
    timings.draft_s += time.perf_counter() - t0
    return logits


def _chain_verify(
    target: TargetModel,
    layer_ids: list[int],
    state: _State,
    draft_logits: torch.Tensor,  # [B−1, V]
    params: SamplingParams,
    generator: torch.Generator | None,
    remaining: int,
    stop: set[int],
    timings: Timings,
) -> list[int]:
    t0 = time.perf_counter()
    p = state.position
    drafts = draft_logits.argmax(dim=-1)  # [B−1], deterministic drafts (also when sampling)
    block_ids = torch.cat([state.bonus, drafts])[None]  # [1, B]
    positions = torch.arange(p, p + block_ids.shape[1], device=block_ids.device)[None]
    out = target.forward(block_ids, layer_ids=layer_ids, position_ids=positions, cache=state.target_cache)
    assert out.logits is not None and out.features is not None
    choice = choose_tokens(out.logits[0], params, generator)  # [B]: the target's token after each slot
    accepted = (drafts == choice[:-1]).long().cumprod(dim=0).sum()  # longest matching prefix
    host = torch.cat([accepted.view(1), drafts, choice]).tolist()  # host read, once per round
    a, nd = host[0], drafts.shape[0]
    d_list, c_list = host[1 : 1 + nd], host[1 + nd :]
    new, _ = truncate_round(d_list[:a] + [c_list[a]], remaining, stop)
    m = len(new)  # KV/features kept: the old bonus and the first m − 1 committed drafts
    kv.crop(state.target_cache, p + m)
    state.pending = out.features[:, :m]  # [1, m, k·H]
    state.bonus = choice[m - 1 : m] if m == a + 1 else drafts[m - 1 : m]
    state.position = p + m
    timings.verify_s += time.perf_counter() - t0
    return new


def _tree_verify(
    target: TargetModel,
    layer_ids: list[int],
    state: _State,
    draft_logits: torch.Tensor,  # [B−1, V]
    budget: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    remaining: int,
    stop: set[int],
    timings: Timings,
    sync_timings: bool,
) -> tuple[list[int], list[int]]:
    """One DDTree round: the committed tokens, and the accepted nodes (build order, root excluded)."""
    t0 = time.perf_counter()
    p = state.position
    tree = build_tree(draft_logits, budget)  # host read of the per-slot top-k inside
    n1 = tree.num_nodes + 1
    device = state.bonus.device
    vis = tree_visibility(tree)  # [N+1, N+1]
    allowed = torch.cat([torch.ones(n1, p, dtype=torch.bool, device=device), vis], dim=1)  # [N+1, p+N+1]
    mask = kv.attention_mask_for(allowed[None, None], target.attn_implementation, target.dtype)
    positions = tree_positions(tree, p)[None]  # [1, N+1]
    block_ids = torch.cat([state.bonus, tree.tokens])[None]  # [1, N+1]
    _sync(target.device, sync_timings)
    t1 = time.perf_counter()
    timings.tree_s += t1 - t0
    out = target.forward(
        block_ids, layer_ids=layer_ids, position_ids=positions, attention_mask=mask, cache=state.target_cache
    )
    assert out.logits is not None and out.features is not None
    choice = choose_tokens(out.logits[0], params, generator)  # [N+1]: the target's token after each node
    choice_list: list[int] = choice.tolist()  # host read, once per round
    path = walk_tree(tree, choice_list)
    # the walk moves to the child whose token is the target's choice, so the committed tokens are
    # the target's choices along the path (accepted nodes, then the next bonus)
    new, _ = truncate_round([choice_list[i] for i in path], remaining, stop)
    m = len(new)
    keep = torch.tensor(path[:m], dtype=torch.long, device=device)  # the old bonus + m − 1 accepted nodes
    kv.keep_positions(state.target_cache, p, keep)
    state.pending = out.features[:, keep]  # [1, m, k·H] in path order
    state.bonus = choice[path[m - 1]].view(1)
    state.position = p + m
    timings.verify_s += time.perf_counter() - t1
    return new, path[1:]
