"""The training feature pass on the target's own layers: packed rows, each document attending to itself only.

    native = PackedTargetPass(target)                       # runtime.feature_pass=native
    feats = native(input_ids, position_ids, doc_ids, [1, 8, 14, 20, 27])   # [R, S, k·H], on the target's device

The math of `TargetModel.forward` (transformers) over the same modules and weights, written with the decoding
engine's layer primitives (`flashdraft.decode.native`: q/k/v with RoPE, RMSNorm), without what transformers
costs a packed batch: no dense [R, 1, S, S] mask on CUDA (a FlexAttention BlockMask built from the doc ids,
whose fully masked tiles are skipped), no layer after the deepest requested one, no hooks. Positions restart
per document (`TokenBatch.position_ids`), so each document sees what it would see alone. On CPU attention
is SDPA with the dense boolean mask. Features equal the transformers pass in float64
(tests/train/test_target_pass.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from flashdraft.cuda_graphs import capture
from flashdraft.decode.native import (
    attention_geometry,
    fuse_projections,
    native_support_error,
    rms_norm,
    rope_tables,
    target_mlp,
    target_qkv,
)


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[R, S] doc ids → bool [R, 1, S, S]: causal within a document, nothing across documents.

    Padding (-1) attends causally to padding only, so no query row is fully masked (a fully
    masked row gives NaN in sdpa); padding features are never used.
    """
    s = doc_ids.shape[1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # [R, S, S]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    return (same & causal)[:, None]  # [R, 1, S, S]


def document_block_mask(doc_ids: torch.Tensor) -> Any:
    """The same visibility as `document_causal_mask` as a FlexAttention BlockMask (heads broadcast); on CUDA built
    by a compiled kernel, so the dense [R, S, S] mask never exists."""
    from torch.nn.attention.flex_attention import create_block_mask

    r, s = doc_ids.shape

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (kv_idx <= q_idx)

    return create_block_mask(
        mask_mod,
        B=r,
        H=None,
        Q_LEN=s,
        KV_LEN=s,
        device=doc_ids.device,
        _compile=doc_ids.device.type == "cuda",
    )


class PackedTargetPass:
    """Selected-layer features of packed rows through the target's own decoder layers (no weights copied).

    attention: "flex" (a BlockMask; the default on CUDA, where flex_attention runs as a compiled kernel) or
    "dense" (SDPA with a boolean [R, 1, S, S] mask; the default elsewhere).
    compile_shape: when given, [rows, length]: the whole forward runs through torch.compile (fused norms, RoPE,
    SwiGLU, residuals) with every batch padded to this shape, so one graph serves the run (the padding is
    doc −1, which no document attends; it is cut off before returning).
    cuda_graph: with compile_shape on CUDA, the block mask and the compiled forward are captured in one CUDA graph
    over static input buffers and replayed: a micro-batch costs the host three copies and a replay instead of
    launching every kernel (~7 ms of the trainer's host time a micro-batch, H100, 2026-12-07). Features are
    cloned out of the graph's memory, so a batch's features outlive the next replay.
    """

    def __init__(
        self,
        target: Any,  # TargetModel
        *,
        attention: str = "auto",
        compile_shape: tuple[int, int] | None = None,
        cuda_graph: bool = False,
    ) -> None:
        why = native_support_error(target)
        if why is not None:
            raise ValueError(f"runtime.feature_pass=native: {why}; set runtime.feature_pass=hf")
        fuse_projections(target)  # q/k/v and gate/up: one matmul each
        if attention == "auto":
            attention = "flex" if target.device.type == "cuda" else "dense"
        if attention not in ("flex", "dense"):
            raise ValueError(f"feature pass attention {attention!r}: use auto, flex or dense")
        self.target, self.attention, self.compile_shape = target, attention, compile_shape
        self.n_heads, self.n_kv, self.head_dim = attention_geometry(target)
        self.inner = target.model.model  # LlamaModel / Qwen3Model ...: embed_tokens, layers, norm, rotary_emb
        self.layers = list(target.layers)
        self._flex: Any = None
        if attention == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            # eager flex_attention materialises the [R, heads, S, S] scores: on CUDA the kernel is compiled,
            # inside a compiled forward it is fused into that graph anyway
            cuda = target.device.type == "cuda"
            self._flex = torch.compile(flex_attention) if cuda and compile_shape is None else flex_attention
        self._forward = self.forward
        if compile_shape is not None:
            self._forward = torch.compile(self.forward, dynamic=False, fullgraph=True)
        if cuda_graph and (compile_shape is None or target.device.type != "cuda"):
            raise ValueError("the feature pass as a CUDA graph needs CUDA and a compiled static shape")
        self.cuda_graph = cuda_graph
        self._graphs: dict[tuple[int, ...], tuple[Any, dict[str, torch.Tensor], torch.Tensor]] = {}

    @torch.no_grad()
    def __call__(
        self,
        input_ids: torch.Tensor,  # [R, S] on the target's device
        position_ids: torch.Tensor,  # [R, S] restarting at 0 per document
        doc_ids: torch.Tensor,  # [R, S] document index, −1 = padding
        layer_ids: list[int],
    ) -> torch.Tensor:
        """Raw features [R, S, k·H]: the outputs of `layer_ids` concatenated in listed order (the last layer's
        final-normed, as transformers' hidden_states[-1] and TargetModel.forward)."""
        for i in layer_ids:
            if not 0 <= i < len(self.layers):
                raise ValueError(f"target layer id {i} does not exist (target has {len(self.layers)} layers)")
        r, s = input_ids.shape
        if self.compile_shape is not None:
            rows, length = self.compile_shape
            if r > rows or s > length:
                raise ValueError(
                    f"a micro-batch of [{r}, {s}] tokens does not fit the compiled shape [{rows}, {length}]"
                )
            input_ids, position_ids = _pad(input_ids, rows, length, 0), _pad(position_ids, rows, length, 0)
            doc_ids = _pad(doc_ids, rows, length, -1)
        if self.cuda_graph:
            return self._replay(input_ids, position_ids, doc_ids, tuple(layer_ids))[:r, :s]
        return self._masked_forward(input_ids, position_ids, doc_ids, tuple(layer_ids))[:r, :s]

    def _masked_forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor,
        layer_ids: tuple[int, ...],
    ) -> torch.Tensor:
        mask = document_block_mask(doc_ids) if self.attention == "flex" else document_causal_mask(doc_ids)
        return self._forward(input_ids, position_ids, mask, layer_ids)

    def _replay(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        doc_ids: torch.Tensor,
        layer_ids: tuple[int, ...],
    ) -> torch.Tensor:
        """`_masked_forward` replayed from its CUDA graph (captured at the first call for these layer ids, on the
        caller's stream), its features cloned out."""
        if layer_ids not in self._graphs:
            static = {"ids": input_ids.clone(), "pos": position_ids.clone(), "doc": doc_ids.clone()}
            # the warm-up outside the capture compiles the pass
            graph, out = capture(lambda: self._masked_forward(static["ids"], static["pos"], static["doc"], layer_ids))
            self._graphs[layer_ids] = (graph, static, out)
        graph, static, out = self._graphs[layer_ids]
        static["ids"].copy_(input_ids)
        static["pos"].copy_(position_ids)
        static["doc"].copy_(doc_ids)
        graph.replay()
        return out.clone()

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: Any, layer_ids: tuple[int, ...]
    ) -> torch.Tensor:
        """The layers up to the deepest of `layer_ids`; mask: a BlockMask (flex) or bool [R, 1, S, S] (dense)."""
        r, s = input_ids.shape
        h = self.inner.embed_tokens(input_ids)  # [R, S, H]
        cos, sin = self.inner.rotary_emb(h, position_ids)  # [R, S, hd] each, computed as transformers does
        cos, sin = rope_tables(cos[:, None], sin[:, None])  # [R, 1, S, hd]
        captured: dict[int, torch.Tensor] = {}
        for i in range(max(layer_ids) + 1):
            layer = self.layers[i]
            attn = layer.self_attn
            q, k, v = target_qkv(
                layer, h, self.n_heads, self.n_kv, self.head_dim, cos, sin
            )  # [R, heads|kv, S, hd]
            o = self._attend(q, k, v, mask, attn.scaling)  # [R, heads, S, hd]
            h = h + attn.o_proj(o.transpose(1, 2).reshape(r, s, self.n_heads * self.head_dim))
            h = h + target_mlp(layer, h)
            if i in layer_ids:
                captured[i] = h
        last = len(self.layers) - 1
        parts = [rms_norm(self.inner.norm, captured[i]) if i == last else captured[i] for i in layer_ids]
        return torch.cat(parts, dim=-1)  # [R, S, k·H] in listed order, never sorted

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, scale: float
    ) -> torch.Tensor:
        """q [R, heads, S, hd] over k, v [R, kv, S, hd] → [R, heads, S, hd]."""
        if self.attention == "flex":
            return self._flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=self.n_heads != self.n_kv)
        rep = self.n_heads // self.n_kv
        if rep > 1:  # head h reads kv head h // rep
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _pad(t: torch.Tensor, rows: int, length: int, value: int) -> torch.Tensor:
    """[r, s] → [rows, length], the added entries `value`."""
    out = torch.full((rows, length), value, dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t
    return out
