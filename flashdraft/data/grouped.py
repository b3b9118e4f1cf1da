"""Several `loop_generate` batches decoded together: one forward per step for all of them, the same ids.

    outs = grouped_generate(target, batches, params, groups=5)   # one list of Generation per batch

On a CPU a decode step streams every weight of the target from memory whatever the row count, and small
row counts run the matmuls below their best rate (SmolLM2, 2-core AVX-512 EPYC, ~250 cached positions: a step of
1 row 55 ms, 32 rows 168 ms, 64 rows 262 ms, 96 rows 345 ms).
So up to `groups` batches share each step: the projections, MLP and LM head run once over all their rows,
while attention runs per batch over that batch's own cache, padding and mask, built by the same
transformers functions as a lone batch's forward (`create_causal_mask`, the model's attention interface).
Each batch is prefilled alone, exactly as `loop_generate` does, and joins when a slot frees. Rows keep
their values bit for bit as long as the matmuls' row count stays in the sizes where a row's product does
not depend on it (`ROW_QUANTUM`, flashdraft/data/loop.py): batches of other sizes run alone.
Llama-family decoder layers only (`grouped_support_error`); greedy only.
"""

from __future__ import annotations

import importlib

import torch

from flashdraft.cache import cache_keyword
from flashdraft.data.loop import (
    Generation,
    GenerationParams,
    LoopBatch,
    compactable,
    cut_at_stop,
    loop_generate,
    prefill_batch,
    record_token,
)
from flashdraft.target import TargetModel

# decoder layers that are exactly: input norm → q/k/v → RoPE → cache → attention → o_proj → residual →
# post norm → MLP → residual (transformers' LlamaDecoderLayer / LlamaAttention)
GROUPED_FAMILIES = ("llama",)


def grouped_support_error(target: TargetModel, params: GenerationParams) -> str | None:
    mt = getattr(target.config, "model_type", "?")
    if mt not in GROUPED_FAMILIES:
        return f"model_type {mt!r}: grouped decoding replays Llama decoder layers only"
    if params.temperature > 0:
        return "sampling: each batch's random draws depend on its own row count"
    return None


@torch.inference_mode()
def grouped_step(target: TargetModel, batches: list[LoopBatch]) -> list[torch.Tensor]:
    """One decode token for every row of `batches` in one pass over the layers; the next ids [m] per batch.

    Per row, the same operations on the same values as `TargetModel.forward(..., logits="last")` on its
    batch alone: only the row count of the projections, MLP and head changes."""
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner, cfg = target.model.model, target.config
    rope = importlib.import_module(type(target.layers[0].self_attn).__module__)  # modeling_llama
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(cfg._attn_implementation, rope.eager_attention_forward)
    sizes = [g.row.shape[0] for g in batches]
    ids = torch.cat([g.nxt for g in batches])[:, None]  # [M, 1]
    pos = torch.cat([g.lens + g.t - 1 for g in batches])[:, None]  # [M, 1]: the token recorded last
    h = inner.embed_tokens(ids)  # [M, 1, H]
    cos, sin = inner.rotary_emb(h, position_ids=pos)  # [M, 1, hd]
    kw = cache_keyword(create_causal_mask)  # `cache=` since transformers 5.2x, `past_key_values=` before
    masks = []
    for g, part, p in zip(batches, h.split(sizes), pos.split(sizes), strict=True):
        g.attn[:, g.P + g.t - 1] = 1
        masks.append(create_causal_mask(config=cfg, inputs_embeds=part, attention_mask=g.attn[:, : g.P + g.t],
                                        position_ids=p, **{kw: g.cache}))  # fmt: skip
    for i, layer in enumerate(target.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        shape = (h.shape[0], 1, -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)  # [M, heads, 1, hd]
        k = attn.k_proj(x).view(shape).transpose(1, 2)  # [M, kv, 1, hd]
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = rope.apply_rotary_pos_emb(q, k, cos, sin)
        outs = []
        for g, qg, kg, vg, mask in zip(
            batches, q.split(sizes), k.split(sizes), v.split(sizes), masks, strict=True
        ):
            kg, vg = g.cache.update(kg, vg, i)  # [m, kv, S, hd] this batch's whole cache
            outs.append(
                attend(attn, qg, kg, vg, mask, dropout=0.0, scaling=attn.scaling)[0]
            )  # [m, 1, heads, hd]
        o = torch.cat(outs).reshape(h.shape[0], 1, -1).contiguous()  # [M, 1, heads·hd]
        h = h + attn.o_proj(o)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    logits = target.lm_head(inner.norm(h)[:, -1:])  # [M, 1, V]
    return list(logits[:, -1].argmax(-1).split(sizes))


def grouped_generate(
    target: TargetModel, batches: list[list[list[int]]], params: GenerationParams, *, groups: int = 5,
    sync_every: int = 8, on_batch=None,
) -> list[list[Generation]]:  # fmt: skip
    """Greedy generations for every batch (as `loop_generate` on each batch alone), `groups` batches at a time."""
    why = grouped_support_error(target, params)
    if why is not None:
        raise ValueError(f"grouped decoding: {why}")
    N = params.max_new_tokens
    stop = torch.tensor(params.stop_ids or [-1], device=target.device)
    out: list[list[Generation] | None] = [None] * len(batches)
    waiting = list(range(len(batches)))
    active: list[LoopBatch] = []

    def finish(g: LoopBatch) -> None:
        out[g.k] = [cut_at_stop(r, params.stop_ids) for r in g.tokens[:, : g.n].tolist()]
        if on_batch is not None:
            on_batch(g.k, out[g.k])

    with torch.inference_mode():
        while waiting or active:
            while waiting and len(active) < groups:
                k = waiting.pop(0)
                if not compactable(len(batches[k])):  # its matmul row count must not change: alone
                    out[k] = loop_generate(target, batches[k], params, seed=0, sync_every=sync_every)
                    if on_batch is not None:
                        on_batch(k, out[k])
                    continue
                g = prefill_batch(target, k, batches[k], params)
                record_token(g, stop, N, sync_every)
                if g.n:
                    finish(g)
                else:
                    active.append(g)
            if not active:
                continue
            for g, nxt in zip(active, grouped_step(target, active), strict=True):
                g.nxt = nxt
                record_token(g, stop, N, sync_every)
            for g in [g for g in active if g.n]:
                finish(g)
                active.remove(g)
    return out  # type: ignore[return-value]
