"""Model FLOPs of a drafter training step, counted from the CPU-side blocks: no device sync.

    params = trainable_params(drafter)                         # once, at setup
    flops = step_flops(drafts, drafter.config, params)         # per optimizer step, host int
    mfu = flops / step_seconds / (peak_tflops * 1e12)

The count is the issue's definition, summed over an optimizer step's micro-batches:

    6 × P × T  +  4 × H × V × T  +  12 × L × heads × head_dim × pairs

- P: trainable drafter parameters (forward 2, backward 4 FLOPs per parameter and token);
- T: block tokens of valid blocks = #valid blocks × B (padding blocks are overhead, not model work);
- 4 × H × V: the frozen lm_head (target vocabulary V) per block token, forward and input gradient;
- pairs: unmasked query–key pairs of valid blocks (`attention_pairs`): QKᵀ and PV, forward and
  backward, per layer and head. Sliding-window layers are counted as full attention (an upper bound
  for them; no shipped drafter has any).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from flashdraft.train.blocks import DraftBatch

if TYPE_CHECKING:
    from flashdraft.drafter import DFlashConfig


def attention_pairs(d: DraftBatch) -> int:
    """Unmasked query–key pairs of the valid blocks (the mask of `dense_block_mask`, padding blocks left out):
    each of a block's B queries sees its context rows doc_start ≤ kv < anchor and the block's own B slots,
    so a block contributes B × (anchor − doc_start) + B × B pairs. Host int: call it on CPU tensors."""
    context_rows = int(((d.anchors - d.doc_start) * d.valid).sum())
    return d.block_size * context_rows + d.block_size * d.block_size * int(d.valid.sum())


def block_tokens(d: DraftBatch) -> int:
    """Query tokens of the valid blocks: #valid × B."""
    return int(d.valid.sum()) * d.block_size


def step_flops(drafts: Sequence[DraftBatch], cfg: DFlashConfig, trainable: int) -> int:
    """Model FLOPs of one optimizer step over its micro-batches' blocks (the module docstring's formula).

    `cfg` is the drafter's config (H = hidden_size, V = vocab_size, L, heads, head_dim); `trainable` the
    full count of trainable drafter parameters (`trainable_params`)."""
    tokens = sum(block_tokens(d) for d in drafts)
    pairs = sum(attention_pairs(d) for d in drafts)
    return (
        6 * trainable * tokens
        + 4 * cfg.hidden_size * cfg.vocab_size * tokens
        + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * pairs
    )


def trainable_params(module: torch.nn.Module) -> int:
    """Parameters with requires_grad, counted in full: an FSDP2-sharded module's parameters are DTensors,
    whose numel() is the global tensor's, not the local shard's (tests/train/test_distributed.py checks it)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
