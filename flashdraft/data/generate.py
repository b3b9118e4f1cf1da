"""Batched response generation for regeneration: local (the target itself) or an OpenAI-compatible server.

    gen = LocalGenerator(target, GenerationParams(max_new_tokens=512), batch_size=256)
    outs = gen.generate([[1, 2, 3], [4, 5]], seed=0)   # [Generation(ids=[...stop], finish="stop"), ...]
    gen = ServerGenerator("http://127.0.0.1:30000", params, concurrency=64)

Local engines, each kept for a measurement (benchmarks/RESULTS.md): "native" — continuous batching over a
static KV cache on the target's own layers (flashdraft/data/native.py; Llama / Qwen2 / Qwen3 / Mistral), the fast
path on a GPU (28K tok/s on an H200); "loop" — our batched greedy/sampling loop over `TargetModel.forward`
(flashdraft/data/loop.py), any family, the CPU's path: with `groups` > 1 and greedy on a Llama-family target,
that many batches share each decode step (flashdraft/data/grouped.py; 175 vs 228 s for 450 prompts on a 2-core
CPU, the same ids). Prompts are sorted by length and cut into batches of at most `batch_size` rows and
`max_batch_tokens` (rows × (longest prompt + max_new_tokens)) tokens: the KV cache's size in tokens. The
native engine sizes its one cache for `max_prompt_len` (regeneration: `--max-length`) instead of the longest
prompt, since later turns join the running batch. Results come back in the order of the prompts, and depend
only on the prompts and the seed.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, Protocol

from flashdraft.data.grouped import grouped_generate, grouped_support_error
from flashdraft.data.loop import Generation, GenerationParams, cut_at_stop, loop_generate, pack_groups
from flashdraft.data.native import NativeStats, check_attention, native_generate
from flashdraft.target import TargetModel

log = logging.getLogger("flashdraft.data")


class Generator(Protocol):
    params: GenerationParams

    def generate(self, prompts: list[list[int]], seed: int) -> list[Generation]: ...


def plan_batches(
    lengths: list[int], batch_size: int, max_batch_tokens: int | None, max_new: int
) -> list[list[int]]:
    """Indices grouped longest first, each batch within `batch_size` rows and the token budget."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))

    def fits(batch: list[int], i: int) -> bool:
        width = lengths[batch[0]] + max_new  # the first (longest) row sets the width
        return len(batch) < batch_size and not (
            max_batch_tokens and (len(batch) + 1) * width > max_batch_tokens
        )

    return pack_groups(order, fits)


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
        attention: str = "auto",
    ) -> None:
        if engine == "hf":
            raise ValueError(
                "engine 'hf' was removed (transformers generate regenerated at 21 tok/s against the loop engine's "
                "86 on a 2-core CPU, 2026-12-03, and native is the GPU's path): use 'native' or 'loop'"
            )
        if engine not in ("native", "loop"):
            raise ValueError(f"unknown engine {engine!r}: use 'native' or 'loop'")
        check_attention(attention)  # before any prompt: the loop engine never reaches the native one's check
        self.target, self.params, self.engine = target, params, engine
        self.batch_size, self.max_batch_tokens = batch_size, max_batch_tokens
        self.attention = attention  # native engine: the decode step's (`BatchedNativeTarget`)
        self.groups = (
            groups  # loop engine: batches decoded together (flashdraft/data/grouped.py); 1 = one at a time
        )
        self.native_stats = NativeStats() if engine == "native" else None  # summed over generate() calls

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
                on_batch=on_batch, stats=self.native_stats, attention=self.attention, **follow,
            )  # fmt: skip
        if follow:
            raise ValueError(f"engine {self.engine!r} does not take follow-up prompts (only 'native' does)")
        out: list[Generation | None] = [None] * len(prompts)
        batches = plan_batches(
            [len(p) for p in prompts], self.batch_size, self.max_batch_tokens, self.params.max_new_tokens
        )
        if self.groups > 1 and grouped_support_error(self.target, self.params) is None:
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
            res = loop_generate(self.target, [prompts[i] for i in idx], self.params, seed * 100_003 + k)
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
