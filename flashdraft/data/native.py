"""The native regeneration engine: continuous batching over a static KV cache on the target's own layers.

    gens = native_generate(target, prompts, GenerationParams(max_new_tokens=256), seed=0, rows=512)

`BatchedNativeTarget` runs many independent sequences through the target's decoder layers (Llama / Qwen2 /
Qwen3 / Mistral: `native_support_error`) with the same layer math as the decoding engine's forward
(`flashdraft.decode.native`'s public primitives); the fast regeneration path on a GPU (28K tok/s on an
H200, benchmarks/RESULTS.md). Greedy output equals `loop_generate`'s (tests/data/test_generate.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F

from flashdraft.cuda_graphs import capture
from flashdraft.data.loop import (
    Generation,
    GenerationParams,
    choose_next,
    cut_at_stop,
    pack_groups,
    pad_rows,
)
from flashdraft.decode.native import (
    COMPILE_RECOMPILE_LIMIT,
    HeadFP32,
    additive_mask,
    attention_geometry,
    fuse_projections,
    native_support_error,
    rms_norm,
    rope_tables,
    target_mlp,
    target_qkv,
)
from flashdraft.target import TargetModel


@dataclass
class NativeStats:
    """Where `native_generate`'s time goes, summed over calls: decode steps and how many of their rows were still
    generating (the rest idle: finished, waiting for a refill, or empty at a shard's tail), and the eager prefills
    that refill rows. Wall seconds; on CUDA each prefill is followed by a synchronize so it is timed alone."""

    steps: int = 0
    row_steps: int = 0  # rows × steps: the decode capacity spent
    live_row_steps: int = 0  # of it, rows still generating: one generated token each
    prefills: int = 0  # prefill forwards (a refill may take several: prefill_tokens per forward)
    prefill_rows: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0  # the decode steps and the host work between them
    extended_rows: int = 0  # of the prefill rows, follow-ups that kept their row's cache (`extend`)
    reused_tokens: int = 0  # the cached tokens those follow-ups did not prefill again

    def line(self) -> str:
        busy = self.live_row_steps / self.row_steps if self.row_steps else 0.0
        total = self.prefill_s + self.decode_s
        return (
            f"native engine: {self.steps:,} decode steps, {busy:.0%} of their rows generating; "
            f"{self.prefills:,} prefills of {self.prefill_rows:,} rows took {self.prefill_s:.1f} s "
            f"({self.prefill_s / total if total else 0.0:.0%}; {self.extended_rows:,} follow-ups kept their row, "
            f"{self.reused_tokens:,} cached tokens reused), decoding {self.decode_s:.1f} s"
            + (f" ({self.decode_s / self.steps * 1e3:.2f} ms a step)" if self.steps else "")
        )


class BatchedNativeTarget:
    """A static-cache forward for many independent sequences at once (regeneration, continuous batching).

    Row r of the cache holds one sequence from column 0: `lengths[r]` tokens so far, the next token
    goes to column `lengths[r]` at RoPE position `lengths[r]`. A finished row is refilled with a new
    prompt by `prefill(slots, ...)`, which overwrites its columns from 0; stale columns past a row's
    length are never attended (the mask is `column <= length`). Nothing is allocated per step, so
    the cache never grows or copies the way a transformers DynamicCache does (torch.cat per step).
    A layer's keys are one packed [rows × capacity, kv_heads, head_dim] buffer (row r's columns at
    r × capacity onwards), so the decode step's attention can read each row's own columns only
    (`attention="varlen"`, flash attention with per-row key counts) instead of every row up to the span.

        net = BatchedNativeTarget(target, rows=512, capacity=longest_prompt + max_new)
        logits = net.prefill(slots, ids_right_padded, prompt_lengths)     # [n, V] at each last prompt token
        logits = net.step(next_ids, lengths, span)                        # [rows, V]
    """

    def __init__(
        self, target: TargetModel, rows: int, capacity: int, *, compile: bool = False, attention: str = "auto"
    ) -> None:
        why = native_support_error(target)
        if why is not None:
            raise ValueError(f"native target forward: {why}")
        fuse_projections(target)  # q/k/v and gate/up: one matmul each
        self.attention = decode_attention(target, attention)
        self.target = target
        self.n_heads, self.n_kv, self.head_dim = attention_geometry(target)
        self.rows, self.capacity = rows, capacity
        self.inner = target.model.model
        self.layers = list(target.layers)
        self.head = HeadFP32(target.lm_head)
        # [layers, 2 (k, v), rows, capacity, kv_heads, head_dim]; zeros so unwritten columns are finite
        self.cache = torch.zeros(
            len(self.layers), 2, rows, capacity, self.n_kv, self.head_dim, dtype=target.dtype, device=target.device
        )  # fmt: skip
        # step_graphed: static inputs, and one CUDA graph (with its static output) per span bucket
        self._ids = torch.zeros(rows, dtype=torch.long, device=target.device)
        self._len = torch.zeros(rows, dtype=torch.long, device=target.device)
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self._pool: Any = None  # one memory pool shared by every span's graph, made at the first capture
        # `step` through torch.compile (fullgraph, static shapes: one compilation per span bucket), captured in
        # the span's graph like the eager one; off by default until measured on a GPU. Hazard: never keep a bound
        # method of this net on it (`self._step = self.step`): that cycle outlives `native_generate`'s return until
        # a full GC, so the next call allocated its 39 GiB cache beside this one on an 80 GB H100 (2026-12-06)
        self.compiled = compile
        self._compiled_step = compile_step() if compile else None  # takes the net as its first argument

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(rms_norm(self.inner.norm, h))  # [n, V], float32 at least

    def step_graphed(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, span: int, bucket: int = 256
    ) -> torch.Tensor:
        """`step` replayed from a CUDA graph (one per span rounded up to `bucket` columns; the mask makes
        the extra columns inert). Eager, a step is ~1,400 small kernels whose host-side dispatch cost
        ~100 ms on the H200 machine whatever the batch (benchmarks/RESULTS.md); a replay launches them
        at once. The returned logits live in the graph's static output: read them before the next call."""
        bucketed = min(self.capacity, -(-span // bucket) * bucket)
        # a local, never an attribute: a bound method stored on the net is a reference cycle (see __init__)
        step = self.step if self._compiled_step is None else partial(self._compiled_step, self)
        if input_ids.device.type != "cuda":  # compiled: one compilation per bucket, not per span
            return step(input_ids, lengths, bucketed if self.compiled else span)
        span = bucketed
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self._ids.copy_(input_ids)
        self._len.copy_(lengths)
        if span not in self._graphs:
            # the warm-up and the capture run the step on the current inputs: its cache writes are the ones the
            # replay below makes anyway
            self._graphs[span] = capture(lambda: step(self._ids, self._len, span), pool=self._pool)
        g, out = self._graphs[span]
        g.replay()
        return out

    @torch.no_grad()
    def prefill(self, slots: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Write prompts into cache rows `slots` [n]; input_ids [n, P] right-padded, lengths [n] (>= 1).
        Returns the logits after each prompt's last token, [n, V]. Padding columns get K/V that no
        query ever attends: causal attention keeps them after every real token of their row."""
        n, p_len = input_ids.shape
        rep = self.n_heads // self.n_kv

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            self.cache[i, 0, slots, :p_len] = k.transpose(1, 2)  # [n, P, kv, hd]
            self.cache[i, 1, slots, :p_len] = v.transpose(1, 2)
            if rep > 1:  # head h reads kv head h // rep
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [n, heads, P, hd]
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

        pos = torch.arange(p_len, device=input_ids.device)[None].expand(n, p_len)  # [n, P]
        return self._new_tokens(input_ids, pos, lengths, attend)

    @torch.no_grad()
    def extend(
        self, slots: torch.Tensor, input_ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        """Append tokens to rows `slots` [n] whose first `starts[r]` cache columns already hold the sequence
        (a conversation's next turn after its previous prompt and answer): input_ids [n, P] right-padded, lengths
        [n] (>= 1) real tokens each, written to columns starts + j at positions starts + j. Each attends to its
        row's columns up to itself. Returns the logits after each row's last token, [n, V]. Padding positions
        write K/V to no column."""
        n, p_len = input_ids.shape
        dev = input_ids.device
        j = torch.arange(p_len, device=dev)
        pos = starts[:, None] + j[None]  # [n, P]
        real = j[None] < lengths[:, None]  # [n, P]
        span = int((starts + lengths).max())
        allowed = torch.arange(span, device=dev)[None, None] <= pos[:, :, None]  # [n, P, span]
        mask = additive_mask(allowed, self.target.dtype)[:, None]  # [n, 1, P, span]
        rows_w, cols_w = slots[:, None].expand(n, p_len)[real], pos[real]  # [M] the real tokens' cells
        rep = self.n_heads // self.n_kv

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            self.cache[i, 0, rows_w, cols_w] = k.transpose(1, 2)[real]  # [M, kv, hd]
            self.cache[i, 1, rows_w, cols_w] = v.transpose(1, 2)[real]
            kc = self.cache[i, 0, slots, :span].transpose(1, 2)  # [n, kv, span, hd]
            vc = self.cache[i, 1, slots, :span].transpose(1, 2)
            if rep > 1:  # head h reads kv head h // rep
                kc, vc = kc.repeat_interleave(rep, dim=1), vc.repeat_interleave(rep, dim=1)
            return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=scale)

        return self._new_tokens(input_ids, pos, lengths, attend)

    def _new_tokens(
        self, input_ids: torch.Tensor, pos: torch.Tensor, lengths: torch.Tensor,
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor],
    ) -> torch.Tensor:  # fmt: skip
        """The layers over n rows of P new tokens at positions `pos` [n, P]; `attend(layer, q, k, v, scale)` writes
        the layer's K/V into the cache and returns the attention output [n, heads, P, hd]. → the logits after each
        row's last real token (`lengths` [n]), [n, V]."""
        n, p_len = input_ids.shape
        h = self.inner.embed_tokens(input_ids)  # [n, P, H]
        cos, sin = self.inner.rotary_emb(h, pos)  # [n, P, hd]
        cos, sin = rope_tables(cos[:, None], sin[:, None])  # [n, 1, P, hd]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = target_qkv(
                layer, h, self.n_heads, self.n_kv, self.head_dim, cos, sin
            )  # [n, heads|kv, P, hd]
            o = attend(i, q, k, v, attn.scaling)  # [n, heads, P, hd]
            h = h + attn.o_proj(o.transpose(1, 2).reshape(n, p_len, self.n_heads * self.head_dim))
            h = h + target_mlp(layer, h)
        last = h[torch.arange(n, device=h.device), lengths - 1]  # [n, H] the last real token of each row
        return self._logits(last)

    def _write_kv(
        self, layer: int, ar: torch.Tensor, lengths: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """k, v [rows, kv, hd] into column `lengths[r]` of each row r of `layer`. Under torch.compile one
        index_put_ on the cache itself (writes into a view of it compile to a copy of the whole cache:
        `flashdraft.decode.native.put_rows`); eager, the two indexed writes it has always made."""
        if torch.compiler.is_compiling():
            dev = lengths.device
            index = (
                torch.full((1, 1), layer, dtype=torch.long, device=dev),
                torch.arange(2, device=dev)[:, None],  # k, v
                ar[None, :],
                lengths[None, :],
            )  # broadcast to [2, rows]
            self.cache.index_put_(index, torch.stack([k, v]))  # [2, rows, kv, hd]
        else:
            kc, vc = self.cache[layer, 0], self.cache[layer, 1]  # [rows, S, kv, hd] views
            kc[ar, lengths] = k  # [rows, kv, hd]
            vc[ar, lengths] = v

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, lengths: torch.Tensor, span: int) -> torch.Tensor:
        """One token for every row: input_ids [rows] go to column / position `lengths` [rows];
        `span` (host int) bounds max(lengths) + 1, so attention reads columns [0, span) only.
        Returns [rows, V]."""
        rows = self.rows
        ar = torch.arange(rows, device=input_ids.device)
        h = self.inner.embed_tokens(input_ids[:, None])  # [rows, 1, H]
        cos, sin = self.inner.rotary_emb(h, lengths[:, None])  # [rows, 1, hd]
        cos, sin = rope_tables(cos[:, None], sin[:, None])  # [rows, 1, 1, hd]
        attend = self._attention(lengths, span, h.dtype)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            q, k, v = target_qkv(
                layer, h, self.n_heads, self.n_kv, self.head_dim, cos, sin
            )  # [rows, heads|kv, 1, hd]
            self._write_kv(i, ar, lengths, k[:, :, 0], v[:, :, 0])
            o = attend(q, self.cache[i, 0], self.cache[i, 1], attn.scaling)  # [rows, heads, hd]
            h = h + attn.o_proj(o.reshape(rows, 1, self.n_heads * self.head_dim))
            h = h + target_mlp(layer, h)
        return self._logits(h[:, 0])

    def _attention(
        self, lengths: torch.Tensor, span: int, dtype: torch.dtype
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]:
        """The step's attention, set up once for every layer: q [rows, heads, 1, hd] over one layer's cache k, v
        [rows, capacity, kv, hd], row r reading columns <= lengths[r] (all < `span`); → [rows, heads, hd]. The rep
        query heads of a kv head ride in the query-length slot, so each kv head's keys are read once for all of
        them. `sdpa`: one additive mask over the first `span` columns of every row ([rows, kv, rep, hd] over
        [rows, kv, span, hd]: a fused kernel, cuDNN's on an H100), so every row reads up to the longest. `varlen`:
        flash attention over the packed cache with each row's own key count (`seqused_k`), reading only the
        columns a row attends. flex_attention over each row's own KV blocks was 1.7–1.8× slower than sdpa on an
        H100 (benchmarks/gpu/regen_step.py, which swaps this method for its variants)."""
        rows, n_kv, hd, cap = self.rows, self.n_kv, self.head_dim, self.capacity
        rep = self.n_heads // n_kv
        if self.attention == "varlen":
            cu_q, cu_k = varlen_offsets(rows, rep, cap, lengths.device)
            used = (lengths + 1).to(torch.int32)

            def attend_varlen(
                q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
            ) -> torch.Tensor:
                q = q.reshape(rows, n_kv, rep, hd).transpose(1, 2).reshape(rows * rep, n_kv, hd)
                o = varlen_attention(q, k.view(rows * cap, n_kv, hd), v.view(rows * cap, n_kv, hd), cu_q, cu_k,
                                     rep, span, scale, used)  # fmt: skip
                return o.view(rows, rep, n_kv, hd).transpose(1, 2).reshape(rows, n_kv * rep, hd)

            return attend_varlen
        allowed = torch.arange(span, device=lengths.device)[None] <= lengths[:, None]  # [rows, span]
        mask = additive_mask(allowed, dtype)[:, None, None]  # [rows, 1, 1, span]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            q = q.reshape(rows, n_kv, rep, hd)
            k, v = k[:, :span].transpose(1, 2), v[:, :span].transpose(1, 2)  # [rows, kv, span, hd]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).reshape(rows, -1, hd)

        return attend


def varlen_offsets(
    rows: int, rep: int, capacity: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`varlen_attention`'s cu_q, cu_k for the decode step's packing: row r is one sequence, its `rep` query heads of
    each kv head in the query slot (queries [r × rep, (r + 1) × rep)) over its own cache columns [r × capacity, …)."""
    cu_q = torch.arange(0, (rows + 1) * rep, rep, dtype=torch.int32, device=device)
    cu_k = torch.arange(0, (rows + 1) * capacity, capacity, dtype=torch.int32, device=device)
    return cu_q, cu_k


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
    max_k: int, scale: float, used_k: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Flash attention over packed sequences: sequence b's queries are q[cu_q[b]:cu_q[b+1]] [Tq, heads, hd], its
    keys and values the first used_k[b] of k, v[cu_k[b]:cu_k[b+1]] [Tk, heads, hd]; no causal mask. → [Tq, heads,
    hd]. PyTorch's own flash kernel (fp16/bf16, CUDA, sm80+), which reads no key past used_k[b]."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False, scale=scale, seqused_k=used_k
    )[0]


def check_attention(attention: str) -> None:
    """ValueError (one line) unless `attention` names a decode-step attention: auto, sdpa or varlen."""
    if attention not in ("auto", "sdpa", "varlen"):
        raise ValueError(f"attention {attention!r}: use auto, sdpa or varlen")


def decode_attention(target: TargetModel, attention: str) -> str:
    """The decode step's attention for `attention` ("auto", "sdpa" or "varlen") on this target's device and dtype:
    auto is varlen where it runs, else sdpa. ValueError (one line) for a name it does not know or varlen where it
    cannot run."""
    check_attention(attention)
    if attention == "sdpa":
        return attention
    why_not = varlen_support_error(target.device, target.dtype, attention_geometry(target)[2])
    if why_not and attention == "varlen":
        raise ValueError(f"attention varlen: {why_not}")
    return "sdpa" if why_not else "varlen"


def varlen_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
    max_k: int, scale: float, used_k: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """What `varlen_attention` computes, one sequence at a time in the inputs' dtype (any device), and the packing
    its kernel needs checked: ValueError where a sequence's queries exceed max_q or its used keys leave its own
    slice of k or exceed max_k."""
    out = torch.empty_like(q)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, n = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(used_k[b])
        if not (1 <= n <= min(max_k, int(cu_k[b + 1]) - k0) and q1 - q0 <= max_q):
            raise ValueError(f"sequence {b}: {q1 - q0} queries, {n} of keys [{k0}, {int(cu_k[b + 1])})")
        w = torch.einsum("qhd,khd->hqk", q[q0:q1], k[k0 : k0 + n]) * scale
        out[q0:q1] = torch.einsum("hqk,khd->qhd", w.softmax(-1), v[k0 : k0 + n])
    return out


@cache
def varlen_support_error(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why `varlen_attention` cannot serve the decode step here (None: it can): the kernel's requirements, then
    `varlen_probe_error` (this torch's flash kernel may lack `seqused_k`, or read past it)."""
    if device.type != "cuda":
        return f"needs CUDA (device {device.type})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"needs float16 or bfloat16 (dtype {dtype})"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim}: flash attention takes multiples of 8 up to 256"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "flash attention needs compute capability 8.0 or newer"
    return varlen_probe_error(device, dtype, head_dim)


def varlen_probe_error(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """`varlen_attention` run as the decode step runs it (three query heads per kv head in the query slot, rows of
    1, 9 and 24 used columns, every column past a row's count set to 50 so that reading one shows) against
    `varlen_reference` in float32: a message if it fails or differs by more than 0.05, else None."""
    rows, cap, n_kv, rep, scale = 3, 24, 2, 3, head_dim**-0.5
    g = torch.Generator().manual_seed(0)
    used = torch.tensor([1, 9, 24], dtype=torch.int32)
    q = torch.randn(rows * rep, n_kv, head_dim, generator=g)
    k, v = torch.randn(2, rows, cap, n_kv, head_dim, generator=g)
    stale = torch.arange(cap)[None] >= used[:, None]  # [rows, cap]
    k[stale], v[stale] = 50.0, 50.0
    cu_q, cu_k = varlen_offsets(rows, rep, cap, torch.device("cpu"))
    k, v = k.view(rows * cap, n_kv, head_dim), v.view(rows * cap, n_kv, head_dim)
    ref = varlen_reference(q, k, v, cu_q, cu_k, rep, cap, scale, used)
    on = [x.to(device) for x in (cu_q, cu_k, used)]
    try:
        out = varlen_attention(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), on[0], on[1], rep, cap,
                               scale, on[2])  # fmt: skip
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return f"this torch's flash attention failed: {str(e).splitlines()[0][:200]}"
    err = float((out.float().cpu() - ref).abs().max())
    if not err <= 0.05:
        return f"flash attention with per-row key counts differs from its definition here (max |Δ| {err:.3g})"
    return None


@torch.inference_mode()
def native_generate(
    target: TargetModel, prompts: list[list[int]], params: GenerationParams, seed: int, *, rows: int = 256,
    max_batch_tokens: int | None = None, sync_every: int = 8, prefill_tokens: int = 65536, on_batch: Any = None,
    follow_up: Callable[[int, Generation], list[int] | None] | None = None, priority: list[int] | None = None,
    max_prompt_len: int | None = None, compile_step: bool = False, stats: NativeStats | None = None,
    deadline: float | None = None, reuse_cache: bool = True, attention: str = "auto",
) -> list[Generation | None]:  # fmt: skip
    """Continuous batching over a static cache (`BatchedNativeTarget`): `rows` sequences decode together;
    every `sync_every` steps the host reads which rows finished (the only host sync), collects them
    and refills their rows with the next prompts (highest `priority`, then longest, first). Finished
    rows idle until then. `follow_up(i, generation)` may return a new prompt when prompt i is done
    (a conversation's next turn): it goes to the front of the queue and its generation is appended
    to the result; with `reuse_cache` a follow-up that extends its row's cached tokens (the previous prompt and
    answer, the template's history) stays in that row and prefills only what is new (`BatchedNativeTarget.extend`).
    `max_prompt_len` must then bound every prompt (it sizes the cache). `max_batch_tokens` caps
    the cache's tokens, rows × (max_prompt_len + max_new_tokens), at layers × 2 × kv_heads × head_dim × dtype
    bytes each; the cache is freed when the call returns. `compile_step`: the decode step through torch.compile
    (`BatchedNativeTarget(compile=True)`); `attention`: the decode step's (`BatchedNativeTarget`: auto is varlen
    where it runs, else sdpa). `stats` (a NativeStats) adds up where the time went. `deadline` (a
    `time.perf_counter()` value): the call returns at the first host sync after it, with None for every prompt
    not finished by then. Greedy output equals `loop_generate`'s; sampled output depends only on the prompts and
    the seed."""
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
    net = BatchedNativeTarget(target, rows, capacity, compile=compile_step, attention=attention)
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
    # follow-ups kept in their row, prefilled at the next refill: (row, prompt index, cached tokens kept)
    extend: list[tuple[int, int, int]] = []
    live_steps = torch.zeros((), dtype=torch.long, device=dev)  # stats: generating rows summed over steps
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def begin(slots: torch.Tensor, logits: torch.Tensor, filled: torch.Tensor) -> None:
        """Rows `slots` start an answer: its first token from `logits` [n, V], their caches `filled` [n] long."""
        first = choose_next(logits, params, gen)  # [n]
        tokens[slots, 0], nxt[slots], count[slots], lengths[slots] = first, first, 1, filled
        done[slots] = torch.isin(first, stop) | (n_new == 1)

    while True:
        t0 = time.perf_counter()
        if deadline is not None and t0 >= deadline:
            break  # what is unfinished stays None
        n_prefills = 0
        free = [r for r in range(rows) if owner[r] < 0]
        idle = len(free) + len(extend)  # rows waiting for a refill
        if idle < min(refill_at, len(order) + len(extend)) and idle < rows:
            # refill in groups: a prefill is one eager forward, too slow to run for every row
            free, batch = [], []
        else:
            batch, extend = extend, []
        for chunk in _extend_chunks(batch, prefill_tokens):  # follow-ups that keep their row's cache
            slots = torch.tensor([r for r, _, _ in chunk], device=dev)
            starts = torch.tensor([c for _, _, c in chunk], device=dev)
            new_ids = [prompts[i][c:] for _, i, c in chunk]
            lens = torch.tensor([len(x) for x in new_ids], device=dev)
            ids = pad_rows(new_ids, max(len(x) for x in new_ids), 0, left=False)  # [n, P]
            begin(slots, net.extend(slots, ids.to(dev), starts, lens), starts + lens)
            span = max(span, max(len(prompts[i]) for _, i, _ in chunk) + 1)
            n_prefills += 1
            if stats is not None:
                stats.prefill_rows += len(chunk)
                stats.extended_rows += len(chunk)
                stats.reused_tokens += sum(c for _, _, c in chunk)
        for chunk in _prefill_chunks(free, order, prompts, prefill_tokens):  # refill finished rows
            slots = torch.tensor([r for r, _ in chunk], device=dev)
            lens = torch.tensor([len(prompts[i]) for _, i in chunk], device=dev)
            width = max(len(prompts[i]) for _, i in chunk)
            ids = pad_rows([prompts[i] for _, i in chunk], width, 0, left=False)  # [n, P]
            for r, i in chunk:
                owner[r] = i
            begin(slots, net.prefill(slots, ids.to(dev), lens), lens)
            span = max(span, width + 1)
            n_prefills += 1
            if stats is not None:
                stats.prefill_rows += len(chunk)
        if stats is not None and n_prefills:
            sync()
            stats.prefills += n_prefills
            stats.prefill_s += time.perf_counter() - t0
        if all(o < 0 for o in owner):
            break
        t0 = time.perf_counter()
        for _ in range(sync_every):
            span = min(span + 1, capacity)
            new = choose_next(net.step_graphed(nxt, lengths, span), params, gen)  # [rows]
            live = ~done
            col = count.clamp(max=n_new - 1)  # [rows] where each row's token goes (done rows rewrite theirs)
            tokens[ar, col] = torch.where(live, new, tokens[ar, col])
            count += live
            lengths += live
            nxt = torch.where(live, new, nxt)
            done |= live & (torch.isin(new, stop) | (count >= n_new))
            if stats is not None:
                live_steps += live.sum()
        waiting = {r for r, _, _ in extend}  # finished before, kept for their follow-up
        flags = done.tolist()  # host sync
        fin = [r for r, f in enumerate(flags) if f and owner[r] >= 0 and r not in waiting]
        if stats is not None:
            stats.steps += sync_every
            stats.row_steps += sync_every * rows
            stats.decode_s += time.perf_counter() - t0
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
                    # row r's cache holds its prompt and answer but the answer's last token (never fed)
                    kept = _common_prefix(prompts[owner[r]] + ids_r[:-1], nxt_prompt) if reuse_cache else 0
                    if 0 < kept < len(nxt_prompt):
                        extend.append((r, len(prompts) - 1, kept))
                        owner[r] = len(prompts) - 1
                        continue
                    order.appendleft(len(prompts) - 1)  # the conversation's next turn: its critical path
                owner[r] = -1
            # freed rows restart at column 0; a kept row keeps its length, so the steps it idles through until
            # `extend` rewrite only the column after its answer (never its cached prompt and answer)
            freed = [r for r in fin if owner[r] < 0]
            if freed:
                lengths[torch.tensor(freed, device=dev)] = 0
            if on_batch is not None:
                on_batch(finished)
            span = int(lengths.max()) + 1
    if stats is not None:
        stats.live_row_steps += int(live_steps)
    return out


def compile_step() -> Callable[[BatchedNativeTarget, torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """`BatchedNativeTarget.step` through torch.compile (fullgraph, static shapes, inductor's default mode: no CUDA
    graphs of its own, `step_graphed` captures it), as `flashdraft.decode.native.compile_native_target` does for
    the engine. It takes the net as an argument rather than closing over `net.step`, so the net it is stored on
    holds no reference to itself (see `BatchedNativeTarget.__init__`)."""
    compiled = torch.compile(BatchedNativeTarget.step, fullgraph=True, dynamic=False)

    def step(
        net: BatchedNativeTarget, input_ids: torch.Tensor, lengths: torch.Tensor, span: int
    ) -> torch.Tensor:
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=COMPILE_RECOMPILE_LIMIT):
            return compiled(net, input_ids, lengths, span)

    return step


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _extend_chunks(
    extend: list[tuple[int, int, int]], prefill_tokens: int
) -> list[list[tuple[int, int, int]]]:
    """The kept follow-ups, shortest cache first, in groups whose rows × cached columns stay <= 4 ×
    prefill_tokens (each group's forward reads every row's cache up to the longest)."""
    return pack_groups(
        sorted(extend, key=lambda e: e[2]), lambda group, e: (len(group) + 1) * e[2] <= 4 * prefill_tokens
    )


def _prefill_chunks(
    free: list[int], order: Any, prompts: list[list[int]], prefill_tokens: int
) -> list[list[tuple[int, int]]]:
    """Pop prompts for the free rows; group them so each prefill forward holds <= prefill_tokens (rows × width)."""
    pairs = [(r, order.popleft()) for r in free[: len(order)]]

    def fits(group: list[tuple[int, int]], pair: tuple[int, int]) -> bool:
        width = max(len(prompts[i]) for _, i in [*group, pair])
        return (len(group) + 1) * width <= prefill_tokens

    return pack_groups(pairs, fits)
