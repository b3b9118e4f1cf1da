"""DFlash draft model for `transformers.AutoModel`, shipped beside the weights of every flashdraft export.

    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    draft = AutoModel.from_pretrained("out/my-drafter", trust_remote_code=True, dtype="auto").eval()
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype="auto").eval()
    ids = AutoTokenizer.from_pretrained(TARGET).apply_chat_template(messages, add_generation_prompt=True,
                                                                    return_tensors="pt")
    out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=256, temperature=0.0,
                              stop_token_ids=[tokenizer.eos_token_id])

Self-contained: it imports torch and transformers only (the `flashdraft` package is not needed), and
computes what flashdraft's own drafter computes (flashdraft/drafter.py; the equivalence is tested in
tests/serve/test_modeling_dflash.py). The interface is that of the public DFlash reference
implementation: `forward(position_ids, noise_embedding=, target_hidden=, past_key_values=)` returns the
final-normed hidden states of the block; the target's embedding and LM head are used, the drafter has
none. Remote code stays the user's choice: nothing runs unless `trust_remote_code=True` is passed.

config.json is a Qwen3 config plus `dflash_config` ({mask_token_id, target_layer_ids, block_size}), so
SGLang and vLLM read the same file without this code; here it arrives as a `Qwen3Config`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config

# ----------------------------------------------------------------------------- config


@dataclass(frozen=True)
class DFlashSettings:
    """The DFlash fields of config.json (`dflash_config`, with the top-level fallbacks older files use)."""

    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]

    @classmethod
    def from_config(cls, config: Any) -> DFlashSettings:
        d = dict(getattr(config, "dflash_config", None) or {})
        block = d.get("block_size", getattr(config, "block_size", None))
        mask = d.get("mask_token_id", getattr(config, "mask_token_id", None))
        ids = d.get("target_layer_ids")
        for name, value in (("block_size", block), ("mask_token_id", mask), ("target_layer_ids", ids)):
            if value is None:
                raise ValueError(
                    f"config.json: dflash_config.{name} is missing (not a DFlash drafter config?)"
                )
        if int(block) < 2:
            raise ValueError(f"config.json: dflash_config.block_size {block} must be >= 2")
        return cls(int(block), int(mask), [int(i) for i in ids])


def rope_settings(config: Any) -> tuple[float, dict[str, Any]]:
    """(theta, scaling dict) from a config of any transformers version: 5.x keeps both in
    `rope_parameters`, 4.x has `rope_theta` and `rope_scaling`."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params:
        return float(params.get("rope_theta", 10000.0)), {
            k: v for k, v in params.items() if k != "rope_theta"
        }
    return float(getattr(config, "rope_theta", 10000.0)), dict(getattr(config, "rope_scaling", None) or {})


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any],
    max_positions: int,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32) and the cos/sin scale for default / linear / llama3 / yarn RoPE."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor, lo, hi = (
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
        )
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(is_mid, mid, scaled), 1.0
    if kind == "yarn":
        factor = float(scaling["factor"])
        old = float(scaling.get("original_max_position_embeddings", max_positions))
        beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))
        scale = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0)

        def corr(rot: float) -> float:
            return (head_dim * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), head_dim - 1)
        ramp = (torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / max(high - low, 1e-3)
        extrap = 1 - ramp.clamp(0, 1)
        return (inv / factor) * (1 - extrap) + inv * extrap, float(scale)
    raise ValueError(f"config.json: RoPE type {kind!r} is not supported: use default, linear, llama3 or yarn")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# ----------------------------------------------------------------------------- layers


class DFlashRMSNorm(nn.Module):
    """Qwen3 RMSNorm: statistics in float32, the weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"config.json: hidden_act {config.hidden_act!r} is not supported: DFlash uses 'silu'"
            )
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _head_dim(config: Qwen3Config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DFlashAttention(nn.Module):
    """The block's queries attend to the context rows (K/V from the fused target features) and to the
    whole block, without a causal mask."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            _head_dim(config),
        )
        h, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None)
        sliding = bool(layer_types) and layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None

    def forward(
        self,
        x: torch.Tensor,  # [b, q, H], input-normed block
        ctx: torch.Tensor,  # [b, c, H], fused context rows (the new ones only when a cache holds the rest)
        cos: torch.Tensor,  # [b, c + q, head_dim] for the context rows, then the block
        sin: torch.Tensor,
        positions: torch.Tensor,  # [b, c + q]
        attention_mask: torch.Tensor | None,  # bool [b|1, 1|heads, q, kv], True = attend
        cache: Any | None,  # a transformers Cache (or anything with .update(k, v, layer_idx) -> (k, v))
    ) -> torch.Tensor:
        b, q_len, _ = x.shape
        c = ctx.shape[1]
        # q: [b, heads, q, hd]; k, v: [b, kv_heads, c + q, hd] from the context rows, then the block
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], dim=1)  # [b, c + q, H]
        k = self.k_norm(self.k_proj(kv_in).view(b, c + q_len, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, c + q_len, self.n_kv, self.head_dim).transpose(1, 2)
        cos_h, sin_h = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, c + q, hd]
        k = k * cos_h + rotate_half(k) * sin_h  # keys at all their positions
        q = q * cos_h[:, :, c:] + rotate_half(q) * sin_h[:, :, c:]  # queries at the block's positions
        if cache is not None:
            # the reference's protocol: context and block K/V are appended, the caller crops the block off
            # again before the next round (cache.crop(start))
            if self.sliding_window is not None:
                raise NotImplementedError("sliding-window DFlash layers with a KV cache are not supported")
            k, v = cache.update(k, v, self.layer_idx)
        mask = attention_mask
        if self.sliding_window is not None:
            win = (positions[:, c:, None] - positions[:, None, :]) < self.sliding_window  # [b, q, c + q]
            mask = win[:, None] if mask is None else mask & win[:, None]
        if self.n_heads != self.n_kv:
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [b, heads, q, hd]
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.n_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, ctx, cos, sin, positions, attention_mask, cache):  # type: ignore[no-untyped-def]
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, positions, attention_mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


# ----------------------------------------------------------------------------- model


class DFlashDraftModel(PreTrainedModel):
    # AutoModel refuses a model whose config_class differs from the class config.json's model_type
    # ("qwen3") gives, so the DFlash fields are read from the Qwen3Config (DFlashSettings above)
    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        s = DFlashSettings.from_config(config)
        self.block_size, self.mask_token_id = s.block_size, s.mask_token_id
        self.target_layer_ids = s.target_layer_ids
        h = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.post_init()

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [b, n, head_dim] at `positions` [b, n], computed in float32 (frequencies are not a
        buffer: nothing to lose to a dtype cast or a meta-device load)."""
        theta, scaling = rope_settings(self.config)
        inv, scale = rope_inv_freq(
            _head_dim(self.config), theta, scaling, self.config.max_position_embeddings, positions.device
        )
        freqs = positions[..., None].float() * inv  # [b, n, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def forward(
        self,
        position_ids: torch.Tensor,  # [b, c + q] (or [c + q]): the new context rows, then the block
        attention_mask: torch.Tensor | None = None,  # None: every query sees every key (inference)
        noise_embedding: torch.Tensor | None = None,  # [b, q, H] target embedding of [last token, MASK, ...]
        target_hidden: torch.Tensor | None = None,  # [b, c, k·H] target hidden states at target_layer_ids
        past_key_values: Any | None = None,  # context K/V of earlier rounds (see DFlashAttention)
        use_cache: bool = False,  # accepted for the reference's call; the cache is used whenever given
        is_causal: bool = False,
    ) -> torch.Tensor:
        """Final-normed hidden states of the block, [b, q, H]; `target.lm_head` of them gives the draft logits."""
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlashDraftModel.forward needs noise_embedding and target_hidden")
        if is_causal:
            raise ValueError("a DFlash block is drafted without a causal mask: pass is_causal=False")
        expected = len(self.target_layer_ids) * self.config.hidden_size
        if target_hidden.shape[-1] != expected:
            raise ValueError(
                f"target_hidden has {target_hidden.shape[-1]} features, the drafter expects {expected} "
                f"({len(self.target_layer_ids)} target layers x hidden {self.config.hidden_size})"
            )
        ctx = self.hidden_norm(self.fc(target_hidden))  # [b, c, H]
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
            h = layer(h, ctx, cos, sin, position_ids, attention_mask, past_key_values)
        return self.norm(h)

    def target_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """[b, n, k·H] from a transformers target's `output_hidden_states` (entry 0 is the embedding output,
        so the output of layer i is entry i + 1)."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    @torch.inference_mode()
    def spec_generate(
        self,
        target: nn.Module,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
        temperature: float = 0.0,
        mask_token_id: int | None = None,
    ) -> torch.Tensor:
        """Greedy speculative decoding with a transformers causal LM `target`: the prompt followed by the
        target's own greedy continuation (token-identical to greedy decoding without the drafter).

        Reference code, kept simple on purpose: every round runs the target over the whole sequence
        (no target KV cache, whose API changes between transformers versions), so it is slow on long
        outputs; serve with SGLang, vLLM or flashdraft for speed and for sampling.
        """
        if temperature != 0.0:
            raise ValueError(
                "spec_generate decodes greedily: pass temperature=0.0 (SGLang/vLLM/flashdraft sample)"
            )
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(
                f"spec_generate takes one prompt, input_ids [1, n]; got {tuple(input_ids.shape)}"
            )
        self.eval()
        mask_id = self.mask_token_id if mask_token_id is None else int(mask_token_id)
        stops = set(stop_token_ids or [])
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        seq = input_ids  # committed tokens
        out = target(seq, output_hidden_states=True, use_cache=False)
        feats = self.target_features(out.hidden_states)  # [1, n, k·H]
        bonus = out.logits[:, -1:].argmax(-1)  # [1, 1]: the target's next token, committed
        new: list[int] = []  # the continuation: each round's bonus token, then its accepted drafts
        while True:
            new.append(int(bonus))  # host sync: once per round
            if len(new) >= max_new_tokens or new[-1] in stops:
                break
            n = seq.shape[1]
            block = torch.cat([bonus, bonus.new_full((1, self.block_size - 1), mask_id)], dim=1)  # [1, B]
            positions = torch.arange(n + self.block_size, device=seq.device)[None]  # [1, n + B]
            hidden = self(
                position_ids=positions, noise_embedding=embed(block), target_hidden=feats.to(self.dtype)
            )
            draft = head(hidden[:, 1:].to(head.weight.dtype)).argmax(-1)  # [1, B - 1]
            out = target(torch.cat([seq, bonus, draft], dim=1), output_hidden_states=True, use_cache=False)
            pred = out.logits[:, n:].argmax(
                -1
            )  # [1, B]: the target's token after the bonus and after each draft
            accepted = int((draft == pred[:, :-1]).int().cumprod(-1).sum())
            kept = draft[0, :accepted].tolist()
            new += kept
            if len(new) >= max_new_tokens or stops.intersection(kept):
                break
            seq = torch.cat([seq, bonus, draft[:, :accepted]], dim=1)
            feats = self.target_features(out.hidden_states)[:, : seq.shape[1]]
            bonus = pred[:, accepted : accepted + 1]
        new = new[:max_new_tokens]
        first_stop = next((i for i, t in enumerate(new) if t in stops), None)
        if first_stop is not None:
            new = new[: first_stop + 1]
        tail = torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, tail], dim=1)
