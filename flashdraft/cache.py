"""The target's KV cache and attention masks: the one place that knows transformers' API drift.

transformers 5.x changes here between minor versions: `DynamicCache.crop(n > 0)` is refused
in 5.24, and the forward keyword moved from `past_key_values=` to `cache=`. Everything in
flashdraft that touches a target cache goes through these functions, which only slice the
per-layer `keys`/`values` tensors (present in every 5.x `DynamicLayer`).

    cache = new_cache()
    target.forward(ids, cache=cache)          # TargetModel passes it under the right keyword
    cache = new_cache(capacity=P + N)         # K/V written into preallocated buffers (batched loop decode)
    crop(cache, n)                            # keep the first n positions
    select_rows(cache, rows)                  # keep these batch rows (finished ones dropped)
    keep_positions(cache, start, idx)         # tree: keep rows start+idx (path order), drop the rest
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


def new_cache(capacity: int | None = None) -> Any:
    """A DynamicCache; with `capacity`, each layer writes new K/V into a buffer of that many positions
    (`PreallocatedLayer`) instead of `torch.cat`-ing the whole cache into a new tensor every forward."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if capacity is not None:
        # filled in order of layer_idx as the first forward reaches each layer (as DynamicCache does)
        cache.layer_class_to_replicate = lambda: _preallocated_layer(capacity)
    return cache


@functools.cache  # one class, made on first use: transformers is imported lazily, as in new_cache
def _preallocated_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A DynamicLayer whose `keys`/`values` are leading slices [b, kv, n, hd] of buffers [b, kv, capacity, hd].

        Why: DynamicLayer.update concatenates, copying the whole cache every decode step — on a 2-core CPU a
        32-row SmolLM2 step at ~130 cached positions took 140-190 ms instead of ~130 ms (benchmarks/RESULTS.md,
        "Regeneration on the 2-core CPU"). Here a step writes only its own columns. Attention reads the same
        values at the same length, so outputs are unchanged. Anything that replaces `keys` by another tensor (`crop` keeps a slice of the buffer;
        `keep_positions` or a row selection makes a new one) is copied into a fresh buffer at the next update.
        """

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity
            self._k: torch.Tensor | None = None  # [b, kv, capacity, hd]
            self._v: torch.Tensor | None = None

        def _adopted(self) -> bool:
            """True when keys/values are still leading slices of the buffers (writes may go on in place)."""
            k, buf = self.keys, self._k
            return (
                buf is not None and k is not None and k.data_ptr() == buf.data_ptr()
                and k.stride() == buf.stride() and k.shape[:2] == buf.shape[:2]
                and self.values.data_ptr() == self._v.data_ptr() and self.values.stride() == self._v.stride()
            )  # fmt: skip

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, q = self.get_seq_length(), key_states.shape[-2]
            if not self._adopted() or n + q > self._k.shape[-2]:
                b, kv, _, hd = key_states.shape
                size = max(self.capacity, n + q)
                self._k = key_states.new_empty(b, kv, size, hd)
                self._v = value_states.new_empty(b, kv, size, value_states.shape[-1])
                if n:
                    self._k[..., :n, :] = self.keys
                    self._v[..., :n, :] = self.values
            self._k[..., n : n + q, :] = key_states
            self._v[..., n : n + q, :] = value_states
            self.keys, self.values = self._k[..., : n + q, :], self._v[..., : n + q, :]
            return self.keys, self.values

    return PreallocatedLayer


def _preallocated_layer(capacity: int) -> Any:
    return _preallocated_layer_class()(capacity)


def cache_keyword(fn: Any) -> str:
    """`cache` (transformers >= 5.2x) or `past_key_values` (earlier), read off the signature of `fn` (a model,
    whose forward is read, or a function such as transformers' `create_causal_mask`)."""
    fn = fn.forward if isinstance(fn, torch.nn.Module) else fn
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"


def _layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(
            f"unsupported cache type {type(cache).__name__}: expected a transformers 5 DynamicCache"
        )
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


def select_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep only the batch rows `rows` [m] (in that order) of every layer."""
    for layer in _layers(cache):
        if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
            layer.keys = layer.keys.index_select(0, rows.to(layer.keys.device))
            layer.values = layer.values.index_select(0, rows.to(layer.values.device))


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


def attention_mask_for(allowed: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
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
