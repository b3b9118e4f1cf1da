"""The DFlash drafter: a small Qwen3-style block-diffusion model conditioned on target features.

Reads top to bottom: config, RoPE, norm, attention with KV injection, decoder layer, model,
checkpoint I/O. docs/method.md §2 is the specification; the checkpoint format is the public
DFlash one (z-lab releases), so SGLang/vLLM load ours and we load theirs.

    drafter = DFlashDrafter.from_pretrained("models/smollm2-135m-instruct-dflash-b16")
    hidden = drafter(target_hidden, noise_embedding, position_ids)   # [b, q, H]
    logits = target.lm_head(hidden)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.files import apply_umask, atomic_folder

# ----------------------------------------------------------------------------- config


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the drafter (docs/method.md §2.2): evenly from 1 to L_t - 3.

    Python's `round` (half-to-even) on purpose: the public releases use it, and a 30-layer
    target must give [1, 8, 14, 20, 27].
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(
            f"need >= 1 target and drafter layer, got {num_target_layers} and {num_draft_layers}"
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# The same target layers in vLLM's numbering, which some vLLM versions read instead of
# dflash_config.target_layer_ids (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py): vLLM
# captures the hidden state *entering* layer k (k = 0 is the embedding output), DFlash names the
# output of layer i, so DFlash layer i is vLLM's i + 1.
VLLM_AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    vocab_size: int  # the target's vocabulary (embedding rows); the drafter has no embedding of its own
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    hidden_act: str = "silu"
    attention_bias: bool = False
    layer_types: list[str] | None = None  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None = None
    torch_dtype: str = "bfloat16"
    # keys of a loaded config.json that this class does not model, written back unchanged
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported: DFlash drafters use 'silu'")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}: pick a divisor"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size {self.block_size} must be >= 2 (slot 0 is the bonus)")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: list at least one target layer")
        for i in self.target_layer_ids:
            if not 0 <= i < self.num_target_layers:
                raise ValueError(
                    f"target layer id {i} does not exist in a {self.num_target_layers}-layer target: "
                    f"use ids in 0..{self.num_target_layers - 1}"
                )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the target embedding ({self.vocab_size} rows): "
                f"pick a row < {self.vocab_size}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
                )
            bad = set(self.layer_types) - {"full_attention", "sliding_attention"}
            if bad:
                raise ValueError(f"unknown layer_types {sorted(bad)}: use full_attention or sliding_attention")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    # -- config.json (public DFlash layout: a Qwen3 config plus dflash fields)

    @classmethod
    def from_json_dict(cls, raw: dict[str, Any], source: str = "config.json") -> DFlashConfig:
        raw = dict(raw)
        dflash = dict(raw.pop("dflash_config", None) or {})
        known = {f.name for f in fields(cls)} - {"extra", "target_layer_ids", "mask_token_id"}
        kw: dict[str, Any] = {}
        for name in known:
            if name in raw:
                kw[name] = raw.pop(name)
        # transformers 5 writes RoPE settings as rope_parameters; public releases write rope_theta
        rope_params = raw.pop("rope_parameters", None)
        if rope_params:
            kw.setdefault("rope_theta", rope_params.get("rope_theta", 1_000_000.0))
            if rope_params.get("rope_type", "default") != "default" and kw.get("rope_scaling") is None:
                kw["rope_scaling"] = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if "dtype" in raw and "torch_dtype" not in kw:
            kw["torch_dtype"] = raw.pop("dtype")
        raw.pop("dtype", None)
        dflash_block = dflash.pop("block_size", None)
        kw.setdefault("block_size", dflash_block if dflash_block is not None else 16)
        for req in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_target_layers"):
            if req not in kw:
                raise ValueError(f"{source}: field {req!r} is missing")
        kw.setdefault("intermediate_size", 3 * kw["hidden_size"])
        kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
        kw.setdefault("head_dim", kw["hidden_size"] // kw["num_attention_heads"])
        if "mask_token_id" not in dflash:
            raise ValueError(f"{source}: field 'dflash_config.mask_token_id' is missing")
        if "vocab_size" not in kw:
            raise ValueError(f"{source}: field 'vocab_size' is missing")
        raw.pop(VLLM_AUX_LAYERS_KEY, None)  # derived from target_layer_ids, written again by to_json_dict
        ids = dflash.pop("target_layer_ids", None)
        if ids is None:
            ids = build_target_layer_ids(kw["num_target_layers"], kw["num_hidden_layers"])
        kw["target_layer_ids"] = [int(i) for i in ids]
        kw["mask_token_id"] = int(dflash.pop("mask_token_id"))
        extra = raw
        if dflash:
            extra["dflash_config"] = dflash  # unmodelled dflash_config keys survive a round trip
        try:
            return cls(**kw, extra=extra)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    def to_json_dict(self) -> dict[str, Any]:
        d = asdict(self)
        extra = d.pop("extra")
        extra_dflash = dict(extra.pop("dflash_config", {}) or {})
        ids, mask = d.pop("target_layer_ids"), d.pop("mask_token_id")
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            **extra,
            **d,
            "dflash_config": {
                **extra_dflash,
                "mask_token_id": mask,
                "target_layer_ids": ids,
                "block_size": self.block_size,
            },
            VLLM_AUX_LAYERS_KEY: [i + 1 for i in ids],
        }
        out.pop("rope_parameters", None)  # we write rope_theta/rope_scaling, as the releases do
        if self.layer_types is None:
            out["layer_types"] = ["full_attention"] * self.num_hidden_layers
        out.setdefault("tie_word_embeddings", False)
        out.setdefault("use_sliding_window", "sliding_attention" in out["layer_types"])
        out.setdefault("attention_dropout", 0.0)
        out.pop("dtype", None)
        out["dtype"] = out.pop("torch_dtype")
        return out


# ----------------------------------------------------------------------------- RoPE


def rope_inv_freq(cfg: DFlashConfig, device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin scale for cfg's RoPE settings."""
    dim = cfg.head_dim
    base = float(cfg.rope_theta)
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(s["factor"]), 1.0
    if kind == "llama3":
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(is_mid, mid, scaled), 1.0
    if kind == "yarn":
        factor = float(s["factor"])
        old = float(s.get("original_max_position_embeddings", cfg.max_position_embeddings))
        beta_fast, beta_slow = float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1))
        scale = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0)

        def corr(rot: float) -> float:
            return (dim * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
        ramp = (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / max(high - low, 1e-3)
        extrap = 1 - ramp.clamp(0, 1)
        return (inv / factor) * (1 - extrap) + inv * extrap, float(scale)
    raise ValueError(f"rope_scaling type {kind!r} is not supported: use default, linear, llama3 or yarn")


_FLEX_KERNEL: Any = None  # set by compile_flex_attention(); None: torch's flex_attention as it is


def compile_flex_attention() -> None:
    """Send every FlexAttention call of the drafter through one torch.compile'd kernel.

    Uncompiled, flex_attention materialises the full score matrix (it OOMs on training shapes);
    compiling only this call gives the fused kernel while the rest of the drafter stays eager —
    the narrow alternative to compiling the whole model (train config runtime.compile).
    """
    global _FLEX_KERNEL
    if _FLEX_KERNEL is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX_KERNEL = torch.compile(flex_attention)


def flex_kernel_options(block_size: tuple[int, int]) -> dict[str, int] | None:
    """Triton tiles for a BlockMask of `block_size` (Q, KV) tiles: each kernel tile must divide the mask's.
    None (torch's defaults) for the default 128 × 128 mask."""
    q, kv = int(block_size[0]), int(block_size[1])
    if (q, kv) == (128, 128):
        return None
    return {
        "fwd_BLOCK_M": q, "fwd_BLOCK_N": kv,
        # backward: dK/dV loop (M1 over queries, N1 over keys), dQ loop (M2, N2); N1 % M1 == M2 % N2 == 0
        "bwd_BLOCK_M1": min(64, q, kv), "bwd_BLOCK_N1": kv, "bwd_BLOCK_M2": q, "bwd_BLOCK_N2": min(64, q, kv),
    }  # fmt: skip


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# ----------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: statistics in float32, the weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class DrafterCache:
    """Context K/V per layer, post-RoPE: [b, kv_heads, ctx_len, head_dim]. Block K/V never enter it."""

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]

    @classmethod
    def empty(cls, num_layers: int) -> DrafterCache:
        return cls([None] * num_layers, [None] * num_layers)

    @property
    def length(self) -> int:
        k = self.keys[0]
        return 0 if k is None else k.shape[2]

    def crop(self, length: int) -> None:
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k is not None and v is not None:
                self.keys[i], self.values[i] = k[:, :, :length], v[:, :, :length]


class Attention(nn.Module):
    """Block queries attend to the injected context K/V and to the whole block (no causal mask)."""

    def __init__(self, cfg: DFlashConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.sliding_window = cfg.sliding_window if cfg.is_sliding(layer) else None

    def forward(
        self,
        x: torch.Tensor,  # [b, q, H], already input-normed
        ctx: torch.Tensor,  # [b, c, H], fused context features (new rows only when a cache is used)
        cos: torch.Tensor,  # [b, c + q, head_dim] for the new context rows then the block
        sin: torch.Tensor,
        mask: torch.Tensor | Any | None,  # bool [b|1, 1|heads, q, kv] (True = attend), a flex BlockMask, or None
        positions: torch.Tensor,  # [b, c + q] absolute positions (for the sliding window)
        cache: DrafterCache | None,
    ) -> torch.Tensor:
        b, q_len, _ = x.shape
        c = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)  # [b, c + q, H]: context rows first, then the block
        k = self.k_norm(self.k_proj(kv_in).view(b, c + q_len, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, c + q_len, self.n_kv, self.head_dim).transpose(1, 2)
        # RoPE: keys at all their absolute positions, queries at the block's positions
        cos_h, sin_h = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, c + q, head_dim]
        k = k * cos_h + rotate_half(k) * sin_h
        q = q * cos_h[:, :, c:] + rotate_half(q) * sin_h[:, :, c:]
        past = 0
        if cache is not None:
            pk, pv = cache.keys[self.layer], cache.values[self.layer]
            new_k, new_v = k[:, :, :c], v[:, :, :c]
            if pk is not None and pv is not None:
                past = pk.shape[2]
                new_k, new_v = torch.cat([pk, new_k], dim=2), torch.cat([pv, new_v], dim=2)
            cache.keys[self.layer], cache.values[self.layer] = new_k, new_v  # context only
            k = torch.cat([new_k, k[:, :, c:]], dim=2)
            v = torch.cat([new_v, v[:, :, c:]], dim=2)
        if self.sliding_window is not None:
            # the window is applied to keys per query, as SGLang/vLLM do: q_pos - k_pos < window
            if past and cache is not None:
                raise NotImplementedError("sliding-window drafter layers with a KV cache are not supported")
            q_pos = positions[:, c:, None]  # [b, q, 1]
            win = (q_pos - positions[:, None, :]) < self.sliding_window  # [b, q, c + q]
            win = win[:, None]
            if mask is None:
                mask = win
            elif isinstance(mask, torch.Tensor):
                mask = mask & win
            else:
                raise NotImplementedError("sliding-window layers with a FlexAttention mask are not supported")
        if mask is not None and not isinstance(mask, torch.Tensor):
            from torch.nn.attention.flex_attention import flex_attention

            # under autocast the fp32-weight q/k norms return fp32 while v is bf16; flex needs one dtype
            q, k = q.to(v.dtype), k.to(v.dtype)
            # inside a whole-model torch.compile, flex_attention is fused into that graph: the compiled kernel's
            # global is not read there (torch 2.11 breaks the graph at `_FLEX_KERNEL or …` once
            # compile_flex_attention() has run in the process, and the graph would guard on it)
            kernel = flex_attention if torch.compiler.is_compiling() or _FLEX_KERNEL is None else _FLEX_KERNEL
            opts = flex_kernel_options(mask.BLOCK_SIZE)  # the mask's tile (plain ints: constant under compile)
            out = kernel(q, k, v, block_mask=mask, enable_gqa=self.n_heads != self.n_kv, kernel_options=opts)
        else:
            if self.n_heads != self.n_kv:
                rep = self.n_heads // self.n_kv
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [b, heads, q, head_dim]
        out = out.transpose(1, 2).reshape(b, q_len, self.n_heads * self.head_dim)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, ctx, cos, sin, mask, positions, cache):  # type: ignore[no-untyped-def]
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, mask, positions, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


# ----------------------------------------------------------------------------- model


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        inv_freq, self.rope_scale = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # RoPE frequencies stay float32 whatever dtype the weights are cast to (as HF keeps them):
        # rounding them to bf16 would shift every angle and break checkpoint compatibility.
        super()._apply(fn, recurse)
        if self.inv_freq.device.type != "meta":
            self.inv_freq = rope_inv_freq(self.config, device=self.inv_freq.device)[0]
        return self

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init (normal(0, std) linears, unit norms), as a fresh drafter is trained from."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def grown(self, extra_layers: int, std: float = 0.02) -> DFlashDrafter:
        """A copy with `extra_layers` new decoder layers after its own (full attention, seeded by the caller's
        torch RNG): random like a fresh drafter's, except their output projections (attention o_proj, MLP
        down_proj), which are zero. Each new layer then adds nothing to the residual stream, so the grown
        drafter computes this one's function exactly until training moves them: a deeper drafter that keeps what
        the trained layers learned (train config model.grow_layers)."""
        if extra_layers < 1:
            raise ValueError(f"extra_layers {extra_layers}: grow by at least one layer")
        c = self.config
        types = None if c.layer_types is None else [*c.layer_types, *["full_attention"] * extra_layers]
        cfg = replace(
            c, num_hidden_layers=c.num_hidden_layers + extra_layers, layer_types=types, extra=dict(c.extra)
        )
        param = next(self.parameters())
        new = DFlashDrafter(cfg)
        new.reset_parameters(std=std)
        new.load_state_dict(self.state_dict(), strict=False)  # every key of self; the new layers' stay
        with torch.no_grad():
            for layer in new.layers[c.num_hidden_layers :]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
                if layer.self_attn.o_proj.bias is not None:
                    layer.self_attn.o_proj.bias.zero_()
        return new.to(device=param.device, dtype=param.dtype).train(self.training)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.float()  # [b, n, head_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[b, c, k·H] raw concatenated target features → [b, c, H] fused context."""
        expected = len(self.config.target_layer_ids) * self.config.hidden_size
        if target_hidden.shape[-1] != expected:
            raise ValueError(
                f"target_hidden has {target_hidden.shape[-1]} features, the drafter expects {expected} "
                f"({len(self.config.target_layer_ids)} layers x hidden {self.config.hidden_size})"
            )
        return self.hidden_norm(self.fc(target_hidden))

    def forward(
        self,
        target_hidden: torch.Tensor,  # [b, c, k·H] raw features of the new context rows
        noise_embedding: torch.Tensor,  # [b, q, H] the embedded block [bonus, MASK...]
        position_ids: torch.Tensor,  # [b, c + q] new context rows, then the block
        attention_mask: torch.Tensor | Any | None = None,  # None = see everything (inference)
        cache: DrafterCache | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states of the block, [b, q, H]."""
        ctx = self.fuse(target_hidden)
        h = noise_embedding
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(h.shape[0], -1)
        if position_ids.shape[1] != ctx.shape[1] + h.shape[1]:
            raise ValueError(
                f"position_ids cover {position_ids.shape[1]} positions, expected context {ctx.shape[1]} "
                f"+ block {h.shape[1]}"
            )
        cos, sin = self.rope(position_ids, h.dtype)
        for layer in self.layers:
            h = layer(h, ctx, cos, sin, attention_mask, position_ids, cache)
        return self.norm(h)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- checkpoints (public DFlash layout; see docs/method.md §3)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> DFlashDrafter:
        from safetensors.torch import load_file

        folder = Path(path)
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{folder}: no config.json (is this a DFlash drafter folder?)")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: line {e.lineno}: invalid JSON ({e.msg})") from None
        cfg = DFlashConfig.from_json_dict(raw, source=str(cfg_path))
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ValueError(
                    f"{index}: not a safetensors index (no weight_map of tensor -> file)"
                ) from None
            files = [folder / s for s in shards]
        elif (folder / "model.safetensors").is_file():
            files = [folder / "model.safetensors"]
        else:
            raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: missing (listed in {index.name})")
            try:
                state.update(load_file(str(f)))
            except Exception as e:  # safetensors' own error class does not say which file
                if type(e).__name__ != "SafetensorError":
                    raise
                raise ValueError(
                    f"{f}: unreadable safetensors file ({e}); it is truncated or corrupt: write or copy it again"
                ) from None
        state = {k.removeprefix("model."): v for k, v in state.items()}
        with torch.device("meta"):
            model = cls(cfg)
        expected = set(model.state_dict().keys())
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise ValueError(
                f"{folder}: checkpoint keys do not match the DFlash layout: "
                f"missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}"
            )
        model.load_state_dict(state, assign=True, strict=True)
        model.inv_freq = rope_inv_freq(cfg)[0]
        if dtype is not None:
            model = model.to(dtype)
        return model.to(device).eval()

    def save_pretrained(self, path: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Path:
        """Write config.json + model.safetensors atomically (a folder staged beside `path`, then renamed;
        an existing `path` is replaced, as `save_pretrained` does in transformers)."""
        from safetensors.torch import save_file

        dest = Path(path)
        with atomic_folder(dest, overwrite=True) as tmp:
            state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in self.state_dict().items()}
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            apply_umask(tmp / "model.safetensors")  # safetensors makes it 0600
            cfg = self.config.to_json_dict()
            cfg["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        return dest
