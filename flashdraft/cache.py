"""The target's KV cache and attention masks: the one place that knows transformers' API drift.

transformers 5.x changes here between minor versions: `DynamicCache.crop(n > 0)` is refused
in 5.24, and the forward keyword moved from `past_key_values=` to `cache=`. Everything in
flashdraft that touches a target cache goes through these functions, which only slice the
per-layer `keys`/`values` tensors (present in every 5.x `DynamicLayer`).

    cache = new_cache()
    target.forward(ids, cache=cache)          # TargetModel passes it under the right keyword
    crop(cache, n)                            # keep the first n positions
    keep_positions(cache, start, idx)         # tree: keep rows start+idx (path order), drop the rest
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def new_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


def cache_keyword(model: torch.nn.Module) -> str:
    """`cache` (transformers >= 5.2x) or `past_key_values` (earlier), read off the forward signature."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"unsupported cache type {type(cache).__name__}: expected a transformers 5 DynamicCache")
    return layers


def length(cache: Any) -> int:
    for layer in _layers(cache):
        k = getattr(layer, "keys", None)
        if k is not None and k.numel() > 0:
            return int(k.shape[-2])
    return 0


def crop(cache: Any, n: int) -> None:
    """Keep the first `n` positions of every layer."""
    if n < 0:
        raise ValueError(f"cannot crop a cache to {n} positions")
    for layer in _layers(cache):
        if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
            layer.keys = layer.keys[..., :n, :]
            layer.values = layer.values[..., :n, :]


def keep_positions(cache: Any, start: int, rows: torch.Tensor) -> None:
    """Tree commit: positions >= start are replaced by the rows `start + rows` (in the given order).

    After a tree verify the cache holds [committed..., bonus, node1..nodeN] from `start`; the
    accepted path's entries are gathered to sit contiguously after the committed prefix.
    """
    for layer in _layers(cache):
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        idx = rows.to(layer.keys.device) + start
        layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, idx)], dim=-2)
        layer.values = torch.cat([layer.values[..., :start, :], layer.values.index_select(-2, idx)], dim=-2)


def attention_mask_for(
    allowed: torch.Tensor, attn_implementation: str, dtype: torch.dtype
) -> torch.Tensor:
    """A custom 4-D mask [b, 1, q, kv] (True = may attend) in the form the backend takes.

    sdpa takes booleans; eager adds the mask to the scores, so it needs 0 / -inf floats.
    flash-attention-2 cannot take an arbitrary (tree) mask at all: refused.
    """
    if allowed.dim() != 4:
        raise ValueError(f"attention mask must be 4-D [b, 1, q, kv], got shape {tuple(allowed.shape)}")
    if attn_implementation in ("flash_attention_2", "flash_attention_3"):
        raise ValueError(
            f"{attn_implementation} cannot take a tree attention mask: load the target with "
            "attn_implementation='sdpa' or 'eager'"
        )
    if attn_implementation == "eager":
        out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return out.masked_fill(~allowed, torch.finfo(dtype).min)
    return allowed
