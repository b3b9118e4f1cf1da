"""Feature batches: documents packed into rows by a token budget, and one target pass over them.

The target sees each packed document alone (block-diagonal causal mask, positions restarting
at 0 per document), so the features of a packed document equal those of the document run by
itself.

    plan = plan_micro_batches([len(s.input_ids) for s in samples], max_length=3072, token_budget=16384)
    rows = pack_rows([samples[i] for i in plan[0].flat()], ...)       # or pack_plan(samples, plan[0])
    batch = compute_features(target, rows, layer_ids=[1, 8, 14, 20, 27])
    batch = compute_features(target, rows, [1, 8, 14, 20, 27], PackedTargetPass(target))   # runtime.feature_pass=native
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from flashdraft.cache import attention_mask_for
from flashdraft.train.target_pass import PackedTargetPass, document_causal_mask


class Sample(Protocol):
    """What training needs from a dataset sample (`flashdraft.data.dataset` samples have it)."""

    id: str
    input_ids: np.ndarray  # [n] int token ids (prompt + the target's own response)
    loss_mask: np.ndarray  # [n] bool, True on response tokens


@dataclass
class TokenBatch:
    """Packed token rows, before the target pass. All tensors on CPU."""

    input_ids: torch.Tensor  # [R, S] long (padding: 0)
    loss_mask: torch.Tensor  # [R, S] bool (padding: False)
    position_ids: torch.Tensor  # [R, S] long, restarting at 0 per document (padding: 0)
    doc_ids: torch.Tensor  # [R, S] long, document index within the micro-batch, -1 = padding
    sample_ids: list[str] = field(default_factory=list)  # per document index, for debugging

    @property
    def num_tokens(self) -> int:
        return int((self.doc_ids >= 0).sum())


@dataclass
class FeatureBatch:
    """A packed micro-batch with the target's raw selected-layer features.

    Token fields stay on CPU (blocks and anchors are built there, without device syncs);
    `features` lives on the target's device.
    """

    input_ids: torch.Tensor  # [R, S] long
    features: torch.Tensor  # [R, S, k·H] raw concatenation of the selected layers' outputs (not fused)
    loss_mask: torch.Tensor  # [R, S] bool
    position_ids: torch.Tensor  # [R, S] long, restarting at 0 per document
    doc_ids: torch.Tensor  # [R, S] long, -1 = padding
    sample_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int((self.doc_ids >= 0).sum())


# ----------------------------------------------------------------------------- packing


@dataclass
class MicroBatchPlan:
    """Which samples go in which row of one micro-batch (indices into the sample order)."""

    rows: list[list[int]]

    def flat(self) -> list[int]:
        return [i for row in self.rows for i in row]


def plan_micro_batches(lengths: Sequence[int], max_length: int, token_budget: int) -> list[MicroBatchPlan]:
    """Greedy, order-preserving packing: documents fill rows of `max_length` tokens; a micro-batch
    holds `max(1, token_budget // max_length)` rows. Documents longer than `max_length` are
    truncated to it when packed (`pack_rows`). Deterministic: the plan is a function of the order.
    """
    if max_length < 2:
        raise ValueError(f"data.max_length {max_length} must be >= 2")
    rows_per_batch = max(1, token_budget // max_length)
    plans: list[MicroBatchPlan] = []
    rows: list[list[int]] = []
    row: list[int] = []
    fill = 0
    for i, n in enumerate(lengths):
        n = min(int(n), max_length)
        if n == 0:
            continue
        if row and fill + n > max_length:
            rows.append(row)
            row, fill = [], 0
            if len(rows) == rows_per_batch:
                plans.append(MicroBatchPlan(rows))
                rows = []
        row.append(i)
        fill += n
    if row:
        rows.append(row)
    if rows:
        plans.append(MicroBatchPlan(rows))
    return plans


def pack_rows(docs: Sequence[Sequence[Sample]], max_length: int, pad_multiple: int = 1) -> TokenBatch:
    """Lay documents out in rows ([R, S], S = longest row rounded up to `pad_multiple`)."""
    lengths = [sum(min(len(d.input_ids), max_length) for d in row) for row in docs]
    if any(n > max_length for n in lengths):
        raise ValueError(f"a packed row holds {max(lengths)} tokens > data.max_length {max_length}")
    s = max(lengths) if lengths else 0
    s = -(-s // pad_multiple) * pad_multiple
    r = len(docs)
    input_ids = torch.zeros(r, s, dtype=torch.long)
    loss_mask = torch.zeros(r, s, dtype=torch.bool)
    position_ids = torch.zeros(r, s, dtype=torch.long)
    doc_ids = torch.full((r, s), -1, dtype=torch.long)
    sample_ids: list[str] = []
    for ri, row in enumerate(docs):
        at = 0
        for d in row:
            ids = np.asarray(d.input_ids)[:max_length]
            mask = np.asarray(d.loss_mask, dtype=bool)[:max_length]
            if mask.shape != ids.shape:
                raise ValueError(
                    f"sample {d.id!r}: loss_mask has {len(d.loss_mask)} entries for {len(d.input_ids)} tokens"
                )
            n = len(ids)
            input_ids[ri, at : at + n] = torch.from_numpy(ids.astype(np.int64))
            loss_mask[ri, at : at + n] = torch.from_numpy(mask)
            position_ids[ri, at : at + n] = torch.arange(n)
            doc_ids[ri, at : at + n] = len(sample_ids)
            sample_ids.append(str(d.id))
            at += n
    return TokenBatch(input_ids, loss_mask, position_ids, doc_ids, sample_ids)


def pad_feature_batch(batch: FeatureBatch, rows: int, length: int) -> FeatureBatch:
    """The same batch laid out in exactly [rows, length] (static shapes for a whole-drafter compile).

    Added rows and columns are padding (doc id −1, no loss), so anchors, labels and the loss are
    those of the unpadded batch; the features are zero-padded on their own device.
    """
    r, s = batch.input_ids.shape
    if r > rows or s > length:
        raise ValueError(
            f"a micro-batch of [{r}, {s}] tokens does not fit the static shape [{rows}, {length}]"
        )
    if (r, s) == (rows, length):
        return batch

    def pad(t: torch.Tensor, value: int | bool) -> torch.Tensor:  # [r, s, ...] → [rows, length, ...]
        out = torch.full((rows, length, *t.shape[2:]), value, dtype=t.dtype, device=t.device)
        out[:r, :s] = t
        return out

    return FeatureBatch(
        input_ids=pad(batch.input_ids, 0),
        features=pad(batch.features, 0),
        loss_mask=pad(batch.loss_mask, False),
        position_ids=pad(batch.position_ids, 0),
        doc_ids=pad(batch.doc_ids, -1),
        sample_ids=batch.sample_ids,
    )


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """CPU → device without a host sync: pinned memory and non_blocking on CUDA."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@torch.no_grad()
def compute_features(
    target,  # type: ignore[no-untyped-def]
    rows: TokenBatch,
    layer_ids: list[int],
    native: PackedTargetPass | None = None,
) -> FeatureBatch:
    """One target pass over packed rows → raw selected-layer features [R, S, k·H] (no logits): transformers'
    forward with a dense [R, 1, S, S] document mask, or `native` (runtime.feature_pass=native) over the same
    layers and weights."""
    device = target.device
    # only [R, S] tensors cross; masks are built on the device from the doc ids
    input_ids, position_ids = to_device(rows.input_ids, device), to_device(rows.position_ids, device)
    doc_ids = to_device(rows.doc_ids, device)
    if native is not None:
        features = native(input_ids, position_ids, doc_ids, list(layer_ids))
    else:
        mask = attention_mask_for(document_causal_mask(doc_ids), target.attn_implementation, target.dtype)
        out = target.forward(
            input_ids,
            layer_ids=list(layer_ids),
            position_ids=position_ids,
            attention_mask=mask,
            logits="none",
        )
        assert out.features is not None
        features = out.features
    return FeatureBatch(
        input_ids=rows.input_ids,
        features=features,  # [R, S, k·H]
        loss_mask=rows.loss_mask,
        position_ids=rows.position_ids,
        doc_ids=rows.doc_ids,
        sample_ids=rows.sample_ids,
    )
