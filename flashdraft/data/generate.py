"""Batched response generation for regeneration: local (the target itself) or an OpenAI-compatible server.

    gen = LocalGenerator(target, GenerationParams(max_new_tokens=512), batch_size=256)
    outs = gen.generate([[1, 2, 3], [4, 5]], seed=0)   # [Generation(ids=[...stop], finish="stop"), ...]
    gen = ServerGenerator("http://127.0.0.1:30000", params, concurrency=64)

Local engines: "native" — continuous batching over a static KV cache on the target's own layers
(`flashdraft.decode.native.BatchedNativeTarget`; Llama / Qwen2 / Qwen3 / Mistral), the fast path on a GPU;
"loop" — our batched greedy/sampling loop over `TargetModel.forward` (left padding,
one host sync every `sync_every` steps to stop early and drop finished rows, per-row position ids; with
`groups` > 1 and greedy, that many batches share each decode step, flashdraft/data/grouped.py); "hf" — transformers'
`generate` (static cache on CUDA). Prompts are sorted by length and cut into batches of at most
`batch_size` rows and `max_batch_tokens` (rows × (longest prompt + max_new_tokens)) tokens.
Results come back in the order of the prompts, and depend only on the prompts and the seed.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from flashdraft.cache import new_cache, select_rows
from flashdraft.target import TargetModel

log = logging.getLogger("flashdraft.data")


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


class Generator(Protocol):
    params: GenerationParams

    def generate(self, prompts: list[list[int]], seed: int) -> list[Generation]: ...


def cut_at_stop(ids: list[int], stop_ids: list[int]) -> Generation:
    for k, t in enumerate(ids):
        if t in stop_ids:
            return Generation(ids[: k + 1], "stop")
    return Generation(ids, "length")


def _choose(logits: torch.Tensor, params: GenerationParams, gen: torch.Generator | None) -> torch.Tensor:
    """[b, V] → [b] next ids: argmax at T=0, else a sample from softmax(logits / T) (top-p optional)."""
    if params.temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)  # [b, V]
    if params.top_p < 1.0:
        sp, si = probs.sort(-1, descending=True)
        keep = sp.cumsum(-1) - sp < params.top_p
        probs = torch.zeros_like(probs).scatter(-1, si, sp * keep)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def _pad_rows(prompts: list[list[int]], width: int, pad: int, *, left: bool) -> torch.Tensor:
    """[b, width] on the host (one copy to the device later, not one per row), padded on the left or right."""
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    for i, p in enumerate(prompts):
        at = width - len(p) if left else 0
        ids[i, at : at + len(p)] = torch.tensor(p, dtype=torch.long)
    return ids


# Dropping finished rows changes the matmuls' row count M. On session 11's 2-core AVX-512 CPU (torch 2.13, float32)
# a row's product is bit-identical for M in {4, 8} and every M >= 12, and differs for M in {1, 2, 3, 5, 6, 7, 9,
# 10, 11} (another kernel), so rows are dropped in groups of ROW_QUANTUM and only from batches of such sizes.
ROW_QUANTUM = 4


def _compactable(b: int) -> bool:
    return b % ROW_QUANTUM == 0 or b >= 3 * ROW_QUANTUM


def _rows_to_keep(done: torch.Tensor, live: int) -> torch.Tensor | None:
    """Indices [m] of the batch rows to keep — every live row, topped up with finished ones to a multiple of
    ROW_QUANTUM, in batch order — or None when that would not drop any row."""
    m = -(-live // ROW_QUANTUM) * ROW_QUANTUM
    if m >= done.shape[0]:
        return None
    return torch.argsort(done.to(torch.int8), stable=True)[:m].sort().values


@dataclass
class _Batch:
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


def _prefill(
    target: TargetModel, k: int, prompts: list[list[int]], params: GenerationParams,
    gen: torch.Generator | None = None, drop: bool = True,
) -> _Batch:  # fmt: skip
    """Left-padded prefill of one batch into a preallocated cache, and its first token (`_choose`); finished rows
    are dropped later only with `drop`, greedy, and a row count where that keeps every row's bits."""
    dev, N = target.device, params.max_new_tokens
    b = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=dev)  # [b]
    P = int(lens.max())
    ids = _pad_rows(prompts, P, 0, left=True).to(dev)  # [b, P]
    attn = torch.zeros((b, P + N), dtype=torch.long, device=dev)  # [b, P + N]
    attn[:, :P] = (torch.arange(P, device=dev)[None, :] >= (P - lens)[:, None]).long()
    pos = (attn[:, :P].cumsum(-1) - 1).clamp(min=0)  # [b, P]
    cache = new_cache(capacity=P + N)
    out = target.forward(ids, attention_mask=attn[:, :P], position_ids=pos, cache=cache, logits="last")
    nxt = _choose(out.logits[:, -1], params, gen)  # [b]
    tokens = torch.zeros((b, N), dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    drop = drop and params.temperature <= 0 and _compactable(b)
    return _Batch(k, P, lens, attn, cache, tokens, torch.arange(b, device=dev), done, nxt, drop=drop)


def _record(g: _Batch, stop: torch.Tensor, N: int, sync_every: int) -> None:
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
        elif g.drop and (keep := _rows_to_keep(g.done, live)) is not None:
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
    g = _prefill(target, 0, prompts, params, gen, drop=drop_finished)
    _record(g, stop, params.max_new_tokens, sync_every)
    while not g.n:
        g.attn[:, g.P + g.t - 1] = 1  # the token recorded last goes in
        out = target.forward(
            g.nxt[:, None], attention_mask=g.attn[:, : g.P + g.t], position_ids=(g.lens + g.t - 1)[:, None],
            cache=g.cache, logits="last",
        )  # fmt: skip
        g.nxt = _choose(out.logits[:, -1], params, gen)
        _record(g, stop, params.max_new_tokens, sync_every)
    return [cut_at_stop(r, params.stop_ids) for r in g.tokens[:, : g.n].tolist()]


@torch.inference_mode()
def native_generate(
    target: TargetModel, prompts: list[list[int]], params: GenerationParams, seed: int, *, rows: int = 256,
    max_batch_tokens: int | None = None, sync_every: int = 8, prefill_tokens: int = 65536, on_batch: Any = None,
    follow_up: Callable[[int, Generation], list[int] | None] | None = None, priority: list[int] | None = None,
    max_prompt_len: int | None = None,
) -> list[Generation]:  # fmt: skip
    """Continuous batching over a static cache (`BatchedNativeTarget`): `rows` sequences decode together;
    every `sync_every` steps the host reads which rows finished (the only host sync), collects them
    and refills their rows with the next prompts (highest `priority`, then longest, first). Finished
    rows idle until then. `follow_up(i, generation)` may return a new prompt when prompt i is done
    (a conversation's next turn): it goes to the front of the queue and its generation is appended
    to the result; `max_prompt_len` must then bound every prompt (it sizes the cache).
    Greedy output equals `loop_generate`'s; sampled output depends only on the prompts and the seed."""
    from collections import deque

    from flashdraft.decode.native import BatchedNativeTarget

    dev, n_new = target.device, params.max_new_tokens
    prompts = list(prompts)  # follow-ups are appended
    prio = priority or [0] * len(prompts)
    order = deque(sorted(range(len(prompts)), key=lambda i: (-prio[i], -len(prompts[i]), i)))
    longest = max_prompt_len or max(len(p) for p in prompts)
    capacity = longest + n_new
    if max_batch_tokens:
        rows = min(rows, max(1, max_batch_tokens // capacity))
    rows = max(1, min(rows, len(prompts)))
    refill_at = max(1, rows // 8)  # free rows that trigger a refill (while prompts are waiting)
    net = BatchedNativeTarget(target, rows, capacity)
    stop = torch.tensor(params.stop_ids or [-1], device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed) if params.temperature > 0 else None
    ar = torch.arange(rows, device=dev)
    tokens = torch.zeros(rows, n_new, dtype=torch.long, device=dev)  # [rows, N] generated ids per row
    count = torch.zeros(rows, dtype=torch.long, device=dev)  # generated so far per row
    lengths = torch.zeros(rows, dtype=torch.long, device=dev)  # cache columns filled per row
    nxt = torch.zeros(rows, dtype=torch.long, device=dev)  # each row's next input id
    done = torch.ones(rows, dtype=torch.bool, device=dev)  # empty rows count as done
    owner = [-1] * rows  # prompt index held by each row (host)
    out: list[Generation | None] = [None] * len(prompts)
    span = 1  # host bound on max(lengths) + 1 over the rows
    while True:
        free = [r for r in range(rows) if owner[r] < 0]
        if len(free) < min(refill_at, len(order)) and len(free) < rows:
            free = []  # refill in groups: a prefill is one eager forward, too slow to run for every row
        for chunk in _prefill_chunks(free, order, prompts, prefill_tokens):  # refill finished rows
            slots = torch.tensor([r for r, _ in chunk], device=dev)
            lens = torch.tensor([len(prompts[i]) for _, i in chunk], device=dev)
            width = max(len(prompts[i]) for _, i in chunk)
            ids = _pad_rows([prompts[i] for _, i in chunk], width, 0, left=False)  # [n, P]
            for r, i in chunk:
                owner[r] = i
            first = _choose(net.prefill(slots, ids.to(dev), lens), params, gen)  # [n]
            tokens[slots, 0], nxt[slots], count[slots], lengths[slots] = first, first, 1, lens
            done[slots] = torch.isin(first, stop) | (n_new == 1)
            span = max(span, width + 1)
        if all(o < 0 for o in owner):
            break
        for _ in range(sync_every):
            span = min(span + 1, capacity)
            new = _choose(net.step_graphed(nxt, lengths, span), params, gen)  # [rows]
            live = ~done
            col = count.clamp(max=n_new - 1)  # [rows] where each row's token goes (done rows rewrite theirs)
            tokens[ar, col] = torch.where(live, new, tokens[ar, col])
            count += live
            lengths += live
            nxt = torch.where(live, new, nxt)
            done |= live & (torch.isin(new, stop) | (count >= n_new))
        fin = [r for r, f in enumerate(done.tolist()) if f and owner[r] >= 0]  # host sync
        if fin:
            idx = torch.tensor(fin, device=dev)
            got = [row[:c] for row, c in zip(tokens[idx].tolist(), count[idx].tolist(), strict=True)]
            finished = []
            for r, ids_r in zip(fin, got, strict=True):
                g = cut_at_stop(ids_r, params.stop_ids)
                out[owner[r]] = g
                finished.append(g)
                nxt_prompt = follow_up(owner[r], g) if follow_up is not None else None
                if nxt_prompt is not None:
                    if len(nxt_prompt) > longest:
                        raise ValueError(
                            f"follow-up prompt of {len(nxt_prompt)} tokens > max_prompt_len {longest}"
                        )
                    prompts.append(nxt_prompt)
                    out.append(None)
                    order.appendleft(len(prompts) - 1)  # the conversation's next turn: its critical path
                owner[r] = -1
            lengths[idx] = 0
            if on_batch is not None:
                on_batch(finished)
            span = int(lengths.max()) + 1
    return out  # type: ignore[return-value]


def _prefill_chunks(
    free: list[int], order: Any, prompts: list[list[int]], prefill_tokens: int
) -> list[list[tuple[int, int]]]:
    """Pop prompts for the free rows; group them so each prefill forward holds <= prefill_tokens (rows × width)."""
    chunks: list[list[tuple[int, int]]] = []
    cur: list[tuple[int, int]] = []
    for r in free:
        if not order:
            break
        i = order.popleft()
        width = max([len(prompts[j]) for _, j in cur] + [len(prompts[i])])
        if cur and (len(cur) + 1) * width > prefill_tokens:
            chunks.append(cur)
            cur = []
        cur.append((r, i))
    if cur:
        chunks.append(cur)
    return chunks


@torch.inference_mode()
def hf_generate(
    target: TargetModel, prompts: list[list[int]], params: GenerationParams, seed: int
) -> list[Generation]:
    """One batch through transformers' `generate` (left padding; static cache on CUDA)."""
    from transformers import GenerationConfig

    dev = target.device
    P = max(len(p) for p in prompts)
    ids = _pad_rows(prompts, P, 0, left=True).to(dev)  # [b, P]
    lens = torch.tensor([len(p) for p in prompts], device=dev)  # [b]
    attn = (torch.arange(P, device=dev)[None, :] >= (P - lens)[:, None]).long()  # [b, P] 1 on real tokens
    cfg = GenerationConfig(
        max_new_tokens=params.max_new_tokens, do_sample=params.temperature > 0,
        temperature=params.temperature if params.temperature > 0 else None, top_p=params.top_p if params.temperature > 0 else None,
        top_k=None, eos_token_id=params.stop_ids or None, pad_token_id=0,
        cache_implementation="static" if dev.type == "cuda" else None,
        # generate auto-compiles (CUDA graphs) with a static cache; that fails in transformers 5.17
        # (DESIGN §7: CUDA-graph output overwritten), so keep the static cache eager
        disable_compile=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    out = target.model.generate(input_ids=ids, attention_mask=attn, generation_config=cfg)  # [b, P + n]
    return [cut_at_stop(r, params.stop_ids) for r in out[:, P:].tolist()]


def plan_batches(
    lengths: list[int], batch_size: int, max_batch_tokens: int | None, max_new: int
) -> list[list[int]]:
    """Indices grouped longest first, each batch within `batch_size` rows and the token budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = (lengths[cur[0]] if cur else lengths[i]) + max_new  # the first (longest) row sets the width
        if cur and (
            len(cur) >= batch_size or (max_batch_tokens and (len(cur) + 1) * width > max_batch_tokens)
        ):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


class LocalGenerator:
    def __init__(
        self,
        target: TargetModel,
        params: GenerationParams,
        *,
        engine: str = "loop",
        batch_size: int = 64,
        max_batch_tokens: int | None = None,
        groups: int = 1,
    ) -> None:
        if engine not in ("native", "loop", "hf"):
            raise ValueError(f"unknown engine {engine!r}: use 'native', 'loop' or 'hf'")
        self.target, self.params, self.engine = target, params, engine
        self.batch_size, self.max_batch_tokens = batch_size, max_batch_tokens
        self.groups = (
            groups  # loop engine: batches decoded together (flashdraft/data/grouped.py); 1 = one at a time
        )

    @property
    def follows_up(self) -> bool:
        """True when `generate` takes `follow_up=` (conversations advance turn by turn inside one call)."""
        return self.engine == "native"

    def generate(
        self, prompts: list[list[int]], seed: int, on_batch: Any = None, **follow: Any
    ) -> list[Generation]:  # fmt: skip
        if self.engine == "native":  # schedules its own rows (continuous batching)
            return native_generate(
                self.target, prompts, self.params, seed, rows=self.batch_size, max_batch_tokens=self.max_batch_tokens,
                on_batch=on_batch, **follow,
            )  # fmt: skip
        if follow:
            raise ValueError(f"engine {self.engine!r} does not take follow-up prompts (only 'native' does)")
        out: list[Generation | None] = [None] * len(prompts)
        from flashdraft.data.grouped import grouped_generate, grouped_support_error

        fn = loop_generate if self.engine == "loop" else hf_generate
        batches = plan_batches(
            [len(p) for p in prompts], self.batch_size, self.max_batch_tokens, self.params.max_new_tokens
        )
        if (
            self.engine == "loop"
            and self.groups > 1
            and grouped_support_error(self.target, self.params) is None
        ):
            # the same ids as one batch at a time (flashdraft/data/grouped.py), fewer passes over the weights

            def done(k: int, res: list[Generation]) -> None:
                for i, g in zip(batches[k], res, strict=True):
                    out[i] = g
                if on_batch is not None:
                    on_batch(res)

            grouped_generate(
                self.target, [[prompts[i] for i in idx] for idx in batches], self.params, groups=self.groups,
                on_batch=done,
            )  # fmt: skip
            return out  # type: ignore[return-value]
        for k, idx in enumerate(batches):
            res = fn(self.target, [prompts[i] for i in idx], self.params, seed * 100_003 + k)
            for i, g in zip(idx, res, strict=True):
                out[i] = g
            if on_batch is not None:
                on_batch(res)
        return out  # type: ignore[return-value]


class ServerError(RuntimeError):
    pass


class ServerGenerator:
    """Completions from an OpenAI-compatible server (vLLM / SGLang) given token-id prompts.

    The server must return the generated token ids (vLLM: `return_token_ids`); text is never
    re-tokenized. Requests run with bounded concurrency; 429 / 5xx / connection errors are retried with
    exponential backoff.
    """

    def __init__(
        self,
        url: str,
        params: GenerationParams,
        *,
        model: str | None = None,
        concurrency: int = 64,
        retries: int = 5,
        timeout_s: float = 600.0,
        backoff_s: float = 1.0,
    ) -> None:
        self.url, self.params, self.model = url.rstrip("/"), params, model
        self.concurrency, self.retries, self.timeout_s, self.backoff_s = (
            concurrency,
            retries,
            timeout_s,
            backoff_s,
        )

    async def _model_name(self, client: Any) -> str:
        if self.model is None:
            r = await client.get(f"{self.url}/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self.model

    async def _one(self, client: Any, sem: asyncio.Semaphore, prompt: list[int], seed: int) -> Generation:
        import httpx

        body = {
            "model": await self._model_name(client), "prompt": prompt, "max_tokens": self.params.max_new_tokens,
            "temperature": self.params.temperature, "top_p": self.params.top_p, "seed": seed,
            "stop_token_ids": self.params.stop_ids, "skip_special_tokens": False, "return_token_ids": True,
        }  # fmt: skip
        last = ""
        for attempt in range(self.retries + 1):
            async with sem:
                try:
                    r = await client.post(f"{self.url}/v1/completions", json=body)
                except httpx.TransportError as e:
                    last = f"{type(e).__name__}: {e}"
                else:
                    if r.status_code == 200:
                        return self._parse(r.json())
                    last = f"HTTP {r.status_code}: {r.text[:200]}"
                    if r.status_code != 429 and r.status_code < 500:
                        raise ServerError(f"{self.url}/v1/completions refused the request ({last})")
            await asyncio.sleep(self.backoff_s * 2**attempt * (0.5 + random.random()))
        raise ServerError(f"{self.url}/v1/completions failed {self.retries + 1} times; last error: {last}")

    def _parse(self, resp: dict) -> Generation:
        ch = resp["choices"][0]
        ids = ch.get("token_ids")
        if ids is None:
            raise ServerError(
                f"{self.url} returned no token ids (choices[0].token_ids): flashdraft never re-tokenizes text; "
                "use a server that honours return_token_ids (vLLM >= 0.10.2)"
            )
        ids = [int(x) for x in ids]
        if ch.get("finish_reason") == "stop":
            if not ids or ids[-1] not in self.params.stop_ids:
                reason = ch.get("stop_reason")
                if not isinstance(reason, int) or reason not in self.params.stop_ids:
                    reason = self.params.stop_ids[0]
                ids.append(reason)  # servers may leave the stop token out of the ids
            return Generation(ids, "stop")
        return cut_at_stop(ids, self.params.stop_ids)

    async def _all(self, prompts: list[list[int]], seed: int, on_batch: Any) -> list[Generation]:
        import httpx

        sem = asyncio.Semaphore(self.concurrency)
        limits = httpx.Limits(max_connections=self.concurrency)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:

            async def run(i: int) -> Generation:
                g = await self._one(client, sem, prompts[i], seed * 100_003 + i)
                if on_batch is not None:
                    on_batch([g])
                return g

            return list(await asyncio.gather(*(run(i) for i in range(len(prompts)))))

    def generate(self, prompts: list[list[int]], seed: int, on_batch: Any = None) -> list[Generation]:
        t = time.perf_counter()
        out = asyncio.run(self._all(prompts, seed, on_batch))
        log.debug("server generation: %d prompts in %.1f s", len(prompts), time.perf_counter() - t)
        return out
