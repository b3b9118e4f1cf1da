"""One micro-batch through the drafter: block embeddings, mask, forward, loss.

    draft = build_blocks(batch, anchors, B, mask_token_id).to(device)
    out = micro_step(drafter, target, batch, draft, weights, denom, attention="dense")
    out.loss.backward()

The target is only read here (frozen embedding and head); `batch.features` is never modified.
"""

from __future__ import annotations

from typing import Any

import torch

from flashdraft.train.batch import FeatureBatch
from flashdraft.train.blocks import DraftBatch, dense_block_mask, flex_block_mask
from flashdraft.train.loss import LossOutput, drafter_loss


def block_attention_mask(
    draft: DraftBatch, attention: str, device: torch.device, flex_block_size: tuple[int, int] = (128, 128)
) -> Any:
    """The drafter step's mask in the form the attention path takes ("flex" or "dense")."""
    if attention == "flex":
        return flex_block_mask(draft, device, flex_block_size)
    return dense_block_mask(draft)


def micro_step(
    drafter: torch.nn.Module,  # DFlashDrafter, or the same wrapped in DDP/FSDP/compile
    target: Any,  # TargetModel (frozen embed_tokens and lm_head)
    batch: FeatureBatch,
    draft: DraftBatch,  # already on the drafter's device
    weights: torch.Tensor,  # [B] slot weights
    denominator: torch.Tensor,  # Σw over the global batch
    *,
    attention: str = "dense",
    chunk_tokens: int = 4096,
    fused_ce: bool = False,  # loss.fused_ce
    flex_block_size: tuple[int, int] = (128, 128),  # runtime.flex_block_size: the BlockMask's (Q, KV) tile
    compute_dtype: torch.dtype | None = None,  # bf16 → autocast (fp32 master weights stay in the optimizer)
    head_weight: torch.Tensor | None = None,  # [N, H] rows of the head the labels index (loss.softmax_vocab)
) -> LossOutput:
    device = draft.block_ids.device
    with torch.no_grad():
        emb = target.embed_tokens(draft.block_ids)  # [R, N·B, H] frozen target embedding
    feats = batch.features.to(device, non_blocking=True)  # [R, S, k·H]
    param_dtype = next(drafter.parameters()).dtype
    if compute_dtype is None or compute_dtype == param_dtype:
        # no autocast: the drafter's weights and inputs share one dtype
        feats, emb = feats.to(param_dtype), emb.to(param_dtype)
    mask = block_attention_mask(draft, attention, device, flex_block_size)
    use_autocast = compute_dtype is not None and compute_dtype != param_dtype
    with torch.autocast(device.type, dtype=compute_dtype or param_dtype, enabled=use_autocast):
        hidden = drafter(feats, emb, draft.position_ids, mask)  # [R, N·B, H]
        return drafter_loss(
            hidden, draft, target.lm_head.weight if head_weight is None else head_weight, weights, denominator,
            chunk_tokens, fused_ce=fused_ce,
        )  # fmt: skip
