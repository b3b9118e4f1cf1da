"""The batched loop engine: one batch of prompts decoded together over `TargetModel.forward`.

    gens = loop_generate(target, [[1, 2, 3], [4, 5]], GenerationParams(max_new_tokens=64), seed=0)

Left-padded prefill into a preallocated K/V cache, then one forward per step for every unfinished row,
per-row position ids, one host sync every `sync_every` steps to stop early and drop finished rows. Greedy
or sampled (temperature, top-p), any target family. `flashdraft/data/grouped.py` decodes several such
batches in one forward with the same batch state (`LoopBatch`, `prefill_batch`, `record_token`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from flashdraft.cache import new_cache, select_rows
from flashdraft.target import TargetModel


@dataclass
class GenerationParams:
    max_new_tokens: int = 1024
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    stop_ids: list[int] = field(default_factory=list)


@dataclass
class Generation:
    ids: list[int]  # generated ids, the stop token included when finish == "stop"
    finish: str  # "stop" | "length"


def cut_at_stop(ids: list[int], stop_ids: list[int]) -> Generation:
    for k, t in enumerate(ids):
        if t in stop_ids:
            return Generation(ids[: k + 1], "stop")
    return Generation(ids, "length")


def choose_next(logits: torch.Tensor, params: GenerationParams, gen: torch.Generator | None) -> torch.Tensor:
    """[b, V] → [b] next ids: argmax at T=0, else a sample from softmax(logits / T) (top-p optional)."""
    if params.temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)  # [b, V]
    if params.top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        keep = sp.cumsum(-1) - sp < params.top_p
        probs = torch.zeros_like(probs).scatter(-1, si, sp * keep)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def pad_rows(prompts: list[list[int]], width: int, pad: int, *, left: bool) -> torch.Tensor:
    """[b, width] on the host (one copy to the device later, not one per row), padded on the left or right."""
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    for i, p in enumerate(prompts):
        at = width - len(p) if left else 0
        ids[i, at : at + len(p)] = torch.tensor(p, dtype=torch.long)
    return ids


T = TypeVar("T")


def pack_groups(items: Iterable[T], fits: Callable[[list[T], T], bool]) -> list[list[T]]:
    """`items` in order, cut into consecutive groups: an item joins the last group when `fits(group, item)`, else
    it starts the next one (a group always takes its first item)."""
    groups: list[list[T]] = []
    for item in items:
        if groups and fits(groups[-1], item):
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


# Dropping finished rows changes the matmuls' row count M. On a 2-core AVX-512 EPYC (torch 2.13, float32, 2026-12-04)
# a row's product is bit-identical for M in {4, 8} and every M >= 12, and differs for M in {1, 2, 3, 5, 6, 7, 9,
# 10, 11} (another kernel), so rows are dropped in groups of ROW_QUANTUM and only from batches of such sizes.
ROW_QUANTUM = 4


def compactable(b: int) -> bool:
    return b % ROW_QUANTUM == 0 or b >= 3 * ROW_QUANTUM


def rows_to_keep(done: torch.Tensor, live: int) -> torch.Tensor | None:
    """Indices [m] of the batch rows to keep — every live row, topped up with finished ones to a multiple of
    ROW_QUANTUM, in batch order — or None when that would not drop any row."""
    m = -(-live // ROW_QUANTUM) * ROW_QUANTUM
    if m >= done.shape[0]:
        return None
    return torch.argsort(done.to(torch.int8), stable=True)[:m].sort().values


@dataclass
class LoopBatch:
    """One `loop_generate` batch in flight: its cache, its mask and the rows still decoding."""

    k: int  # index among the batches
    P: int  # padded prompt width
    lens: torch.Tensor  # [m] prompt lengths
    attn: torch.Tensor  # [m, P + N] 1 on real tokens
    cache: object
    tokens: torch.Tensor  # [b, N] generated ids per prompt of the batch
    row: torch.Tensor  # [m] each decoding row's index in the batch
    done: torch.Tensor  # [m]
    nxt: torch.Tensor  # [m] the token just chosen
    t: int = 0  # tokens recorded so far
    n: int = 0  # tokens to keep per row when finished (0 while decoding)
    drop: bool = True


def prefill_batch(
    target: TargetModel, k: int, prompts: list[list[int]], params: GenerationParams,
    gen: torch.Generator | None = None, drop: bool = True,
) -> LoopBatch:  # fmt: skip
    """Left-padded prefill of one batch into a preallocated cache, and its first token (`choose_next`); finished rows
    are dropped later only with `drop`, greedy, and a row count where that keeps every row's bits."""
    dev, N = target.device, params.max_new_tokens
    b = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=dev)  # [b]
    P = int(lens.max())
    ids = pad_rows(prompts, P, 0, left=True).to(dev)  # [b, P]
    attn = torch.zeros((b, P + N), dtype=torch.long, device=dev)  # [b, P + N]
    attn[:, :P] = (torch.arange(P, device=dev)[None, :] >= (P - lens)[:, None]).long()
    pos = (attn[:, :P].cumsum(-1) - 1).clamp(min=0)  # [b, P]
    cache = new_cache(capacity=P + N)
    out = target.forward(ids, attention_mask=attn[:, :P], position_ids=pos, cache=cache, logits="last")
    nxt = choose_next(out.logits[:, -1], params, gen)  # [b]
    tokens = torch.zeros((b, N), dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    drop = drop and params.temperature <= 0 and compactable(b)
    return LoopBatch(k, P, lens, attn, cache, tokens, torch.arange(b, device=dev), done, nxt, drop=drop)


def record_token(g: LoopBatch, stop: torch.Tensor, N: int, sync_every: int) -> None:
    """After a token is chosen: store it, and every `sync_every` tokens (a host sync) finish the batch when every
    row stopped or drop the finished rows; `g.n` > 0 once the batch is finished."""
    g.tokens[g.row, g.t] = g.nxt
    g.done |= torch.isin(g.nxt, stop)
    g.t += 1
    if g.t == N:
        g.n = N
    elif g.t % sync_every == 0:
        live = int((~g.done).sum())
        if live == 0:
            g.n = g.t
        elif g.drop and (keep := rows_to_keep(g.done, live)) is not None:
            g.row, g.nxt, g.done, g.lens, g.attn = (
                g.row[keep],
                g.nxt[keep],
                g.done[keep],
                g.lens[keep],
                g.attn[keep],
            )
            select_rows(g.cache, keep)


@torch.inference_mode()
def loop_generate(
    target: TargetModel, prompts: list[list[int]], params: GenerationParams, seed: int, sync_every: int = 8,
    drop_finished: bool = True,
) -> list[Generation]:  # fmt: skip
    """One batch: left-padded prefill, then one token per step for every unfinished row until all stopped.

    Greedy, every `sync_every` steps, finished rows leave the batch (`drop_finished`; not when sampling,
    whose random draws depend on the row count), and the K/V cache is written in place (`new_cache(capacity)`):
    the same ids as the whole batch to the end (benchmarks/RESULTS.md, "Regeneration on the 2-core CPU")."""
    gen = torch.Generator(device=target.device).manual_seed(seed) if params.temperature > 0 else None
    stop = torch.tensor(params.stop_ids or [-1], device=target.device)
    g = prefill_batch(target, 0, prompts, params, gen, drop=drop_finished)
    record_token(g, stop, params.max_new_tokens, sync_every)
    while not g.n:
        g.attn[:, g.P + g.t - 1] = 1  # the token recorded last goes in
        out = target.forward(
            g.nxt[:, None], attention_mask=g.attn[:, : g.P + g.t], position_ids=(g.lens + g.t - 1)[:, None],
            cache=g.cache, logits="last",
        )  # fmt: skip
        g.nxt = choose_next(out.logits[:, -1], params, gen)
        record_token(g, stop, params.max_new_tokens, sync_every)
    return [cut_at_stop(r, params.stop_ids) for r in g.tokens[:, : g.n].tolist()]
