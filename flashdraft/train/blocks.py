"""Anchors, training blocks and the block attention mask (docs/method.md §5).

For anchor `a` in a document starting at row index `d`, the block is `[x[a], MASK × (B−1)]`
at document positions `pos[a] .. pos[a]+B−1`; slot k (1..B−1) is trained to predict `x[a+k]`
(same position, not shifted); slot 0 and labels outside the loss mask or past the document
are dropped. Block n's queries see context rows `d ≤ kv < a` (strict: the anchor's own target feature does
not exist at inference) and their own block, nothing from other blocks.

    anchors = AnchorSampler(seed=0).sample(batch, max_anchors=512)
    draft = build_blocks(batch, anchors, block_size=16, mask_token_id=...)
    mask = dense_block_mask(draft)            # CPU: bool [R, 1, N·B, S + N·B]
    mask = flex_block_mask(draft, device)     # GPU: FlexAttention BlockMask, the same mask
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flashdraft.train.batch import FeatureBatch, to_device

IGNORE = -100  # label of a slot without loss


@dataclass
class Anchors:
    positions: torch.Tensor  # [R, N] long row index of each anchor (padding: 0)
    doc_start: torch.Tensor  # [R, N] long row index where the anchor's document starts (padding: 0)
    valid: torch.Tensor  # [R, N] bool, False for padding blocks

    @property
    def count(self) -> int:
        return int(self.valid.sum())


def looping_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """bool [R, S]: the answer tokens that end an 8-gram already ended earlier in their answer (a loss run: one
    generated answer), as `flashdraft data inspect` counts the repetition share; an anchor at a whose a+1 is
    one drafts inside a loop."""
    from flashdraft.data.dataset import loss_runs
    from flashdraft.data.inspect import repeated_tokens

    out = torch.zeros_like(loss_mask)
    ids = input_ids.numpy()
    for r in range(loss_mask.shape[0]):
        for a, b in loss_runs(loss_mask[r].numpy()):
            out[r, a:b] = torch.from_numpy(repeated_tokens(ids[r, a:b]))
    return out


def valid_anchor_positions(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """bool [R, S]: a with loss_mask[a] and loss_mask[a+1], both in the same (real) document."""
    ok = torch.zeros_like(loss_mask)
    ok[:, :-1] = (
        loss_mask[:, :-1] & loss_mask[:, 1:] & (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] >= 0)
    )
    return ok


class AnchorSampler:
    """Samples ≤ max_anchors distinct valid anchors per document from its own seeded generator.

    The generator advances with every batch, so each epoch sees fresh anchors; its state is
    part of a checkpoint (exact resume). Use a different seed per data-parallel rank.
    """

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(int(seed))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])

    def sample(
        self, batch: FeatureBatch, max_anchors: int, block_multiple: int = 1, blocks_per_row: int = 0,
        loop_weight: float = 1.0,
    ) -> Anchors:  # fmt: skip
        """Anchors per row, padded to the row maximum rounded up to `block_multiple` blocks
        (few distinct query lengths for compiled kernels; padding blocks carry no loss).

        `blocks_per_row > 0` fixes the shape instead: every row gets exactly that many blocks; a row
        whose documents offer more anchors keeps a uniform random subset of them.
        `loop_weight` < 1: where there are more anchors than kept, an anchor whose next token repeats an earlier
        8-gram of its answer (`looping_labels`) is kept with that weight against 1 for the others (weighted
        sampling without replacement); 1 is uniform (and draws the same anchors as before the knob).
        """
        ok = valid_anchor_positions(batch.loss_mask, batch.doc_ids)  # [R, S]
        weight = None
        if loop_weight != 1.0:
            loops = torch.zeros_like(ok)
            loops[:, :-1] = looping_labels(batch.input_ids, batch.loss_mask)[:, 1:]  # the anchor's a+1
            weight = torch.where(loops, loop_weight, 1.0)  # [R, S]
        per_row: list[torch.Tensor] = []
        starts: list[torch.Tensor] = []
        for r in range(ok.shape[0]):
            doc = batch.doc_ids[r]
            picked: list[torch.Tensor] = []
            picked_start: list[torch.Tensor] = []
            for d in torch.unique(doc[doc >= 0]).tolist():
                in_doc = (doc == d).nonzero().flatten()
                cand = ok[r, in_doc].nonzero().flatten() + in_doc[0]
                if len(cand) > max_anchors:
                    keep = self._subset(len(cand), max_anchors, None if weight is None else weight[r, cand])
                    cand = cand[keep.sort().values]
                picked.append(cand)
                picked_start.append(torch.full_like(cand, int(in_doc[0])))
            row_anchors = torch.cat(picked) if picked else torch.zeros(0, dtype=torch.long)
            row_starts = torch.cat(picked_start) if picked_start else torch.zeros(0, dtype=torch.long)
            if 0 < blocks_per_row < len(row_anchors):
                w = None if weight is None else weight[r, row_anchors]
                keep = self._subset(len(row_anchors), blocks_per_row, w).sort().values
                row_anchors, row_starts = row_anchors[keep], row_starts[keep]
            per_row.append(row_anchors)
            starts.append(row_starts)
        if blocks_per_row > 0:
            n = blocks_per_row
        else:
            n = max(1, max(len(p) for p in per_row))  # >= 1 block per row keeps shapes non-empty
            n = -(-n // block_multiple) * block_multiple
        r_count = len(per_row)
        positions = torch.zeros(r_count, n, dtype=torch.long)
        doc_start = torch.zeros(r_count, n, dtype=torch.long)
        valid = torch.zeros(r_count, n, dtype=torch.bool)
        for r, (p, s) in enumerate(zip(per_row, starts, strict=True)):
            positions[r, : len(p)] = p
            doc_start[r, : len(p)] = s
            valid[r, : len(p)] = True
        return Anchors(positions, doc_start, valid)

    def _subset(self, n: int, k: int, weight: torch.Tensor | None) -> torch.Tensor:
        """k of range(n): uniform, or weighted without replacement."""
        if weight is None:
            return torch.randperm(n, generator=self.generator)[:k]
        return torch.multinomial(weight, k, replacement=False, generator=self.generator)


@dataclass
class DraftBatch:
    """Everything the drafter step needs besides the features. CPU tensors; `.to(device)` moves them."""

    block_ids: torch.Tensor  # [R, N·B] long: [x[a], MASK × (B−1)] per block
    position_ids: torch.Tensor  # [R, S + N·B] long: context row positions, then block positions
    labels: torch.Tensor  # [R, N·B] long, IGNORE where there is no loss (slot 0, outside mask/doc)
    label_index: torch.Tensor  # [T] long flat indices into R·N·B of the labelled slots (no device sync later)
    anchors: torch.Tensor  # [R, N] row index of each anchor
    doc_start: torch.Tensor  # [R, N]
    valid: torch.Tensor  # [R, N] bool
    block_size: int
    context_len: int  # S

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]

    @property
    def slots(self) -> torch.Tensor:
        """[N·B] slot index of every query position."""
        return torch.arange(self.num_blocks * self.block_size, device=self.block_ids.device) % self.block_size

    def to(self, device: torch.device | str) -> DraftBatch:
        mv = {k: to_device(getattr(self, k), device) for k in
              ("block_ids", "position_ids", "labels", "label_index", "anchors", "doc_start", "valid")}  # fmt: skip
        return DraftBatch(**mv, block_size=self.block_size, context_len=self.context_len)


def build_blocks(batch: FeatureBatch, anchors: Anchors, block_size: int, mask_token_id: int) -> DraftBatch:
    """Block inputs, positions and same-position labels for every anchor (docs/method.md §5)."""
    r, s = batch.input_ids.shape
    n, b = anchors.positions.shape[1], block_size
    k = torch.arange(b)
    idx = anchors.positions[:, :, None] + k  # [R, N, B] row index of the token slot k stands for
    inside = idx < s
    idx_c = idx.clamp(max=s - 1)
    gather = lambda t: torch.gather(t, 1, idx_c.view(r, n * b)).view(r, n, b)  # noqa: E731  [R, N, B]
    same_doc = gather(batch.doc_ids) == batch.doc_ids.gather(1, anchors.positions)[:, :, None]
    has_label = inside & same_doc & gather(batch.loss_mask) & anchors.valid[:, :, None] & (k > 0)
    labels = torch.where(has_label, gather(batch.input_ids), torch.full_like(idx, IGNORE))  # [R, N, B]
    block_ids = torch.full((r, n, b), mask_token_id, dtype=torch.long)
    block_ids[:, :, 0] = batch.input_ids.gather(1, anchors.positions)  # slot 0 = the anchor token x[a]
    block_pos = (
        batch.position_ids.gather(1, anchors.positions)[:, :, None] + k
    )  # [R, N, B] document positions
    position_ids = torch.cat([batch.position_ids, block_pos.view(r, n * b)], dim=1)  # [R, S + N·B]
    labels = labels.view(r, n * b)
    return DraftBatch(
        block_ids=block_ids.view(r, n * b),
        position_ids=position_ids,
        labels=labels,
        label_index=(labels.flatten() != IGNORE).nonzero().flatten(),
        anchors=anchors.positions,
        doc_start=anchors.doc_start,
        valid=anchors.valid,
        block_size=b,
        context_len=s,
    )


# ----------------------------------------------------------------------------- masks


def dense_block_mask(draft: DraftBatch) -> torch.Tensor:
    """bool [R, 1, N·B, S + N·B] (True = attend), built directly from the rule."""
    r, n = draft.anchors.shape
    b, s = draft.block_size, draft.context_len
    device = draft.anchors.device
    kv = torch.arange(s, device=device)
    # context part: block n sees rows doc_start ≤ kv < anchor (strict)
    ctx = (kv >= draft.doc_start[:, :, None]) & (kv < draft.anchors[:, :, None])  # [R, N, S]
    ctx = ctx[:, :, None, :].expand(r, n, b, s).reshape(r, n * b, s)  # [R, N·B, S]
    # block part: block n sees its own B slots (bidirectional), no other block
    eye = torch.eye(n, dtype=torch.bool, device=device)
    blk = eye[:, None, :, None].expand(n, b, n, b).reshape(n * b, n * b)  # [N·B, N·B]
    blk = blk[None].expand(r, -1, -1)
    return torch.cat([ctx, blk], dim=2)[:, None]  # [R, 1, N·B, S + N·B]


def block_mask_mod(draft: DraftBatch) -> Any:
    """FlexAttention mask_mod(b, h, q_idx, kv_idx) for the same rule (indices into `draft` tensors)."""
    b_size, s = draft.block_size, draft.context_len
    anchors, doc_start = draft.anchors, draft.doc_start

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        n = q_idx // b_size
        a = anchors[b, n]
        in_ctx = (kv_idx >= doc_start[b, n]) & (kv_idx < a)
        in_block = (kv_idx >= s) & ((kv_idx - s) // b_size == n)
        return torch.where(kv_idx < s, in_ctx, in_block)

    return mask_mod


def flex_block_mask(
    draft: DraftBatch, device: torch.device | str | None = None, block_size: tuple[int, int] = (128, 128)
) -> Any:
    """A FlexAttention BlockMask for the drafter step (heads broadcast).

    On CUDA the mask is built by a compiled kernel: uncompiled, create_block_mask materialises
    the dense [R, Q, KV] mask first, which for thousands of blocks per row is gigabytes.
    `block_size` (Q, KV) is the mask's tile (runtime.flex_block_size): with 16-token blocks a 128 × 128
    tile is partial at every anchor run's edge and on the diagonal (1/8 useful there); smaller tiles
    skip more masked work. The drafter picks matching kernel tiles (`flashdraft.drafter.flex_kernel_options`).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    r, q = draft.block_ids.shape
    dev = torch.device(device if device is not None else draft.anchors.device)
    return create_block_mask(
        block_mask_mod(draft), B=r, H=None, Q_LEN=q, KV_LEN=draft.context_len + q, device=dev,
        BLOCK_SIZE=tuple(block_size), _compile=dev.type == "cuda",
    )  # fmt: skip
