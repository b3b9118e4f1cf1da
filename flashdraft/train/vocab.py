"""loss.softmax_vocab: the training loss's softmax over the most frequent label tokens only.

The drafter's loss is a hard cross-entropy through the target's frozen head over the whole vocabulary (49K
rows for SmolLM2, 150K for Qwen3). On a CPU that head is most of a small drafter's step: every labelled slot
multiplies by the whole [V, H] matrix and runs ~8 float32 passes over V logits. With `loss.softmax_vocab=N`
the softmax runs over the N token ids most frequent among the training split's labels (counted once, a pure
function of the dataset, so a resumed run gets the same set); labels outside them carry no loss. It is still
a hard CE on the target's tokens (the same labels, the same head rows), normalised over fewer competitors:
tokens outside the set are never pushed down, which the offline τ (always drafted over the full vocabulary,
`flashdraft eval`) measures. Checkpoints and decoding are unchanged: the drafter drafts from every token; the
training metrics (slot accuracy, τ proxy) take the argmax over the subset.
EAGLE-3 restricts its drafter's vocabulary the same way, at inference too; here only the loss is restricted.

    vocab = label_vocab(samples, vocab_size=49152, size=8192)   # the quickstart's split: coverage 1.00
    draft = restrict_labels(build_blocks(...), vocab)           # labels → row indices into vocab.ids
    head = lm_head.weight[vocab.ids]                            # [N, H], what the loss multiplies by
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashdraft.train.blocks import IGNORE, DraftBatch


@dataclass
class LabelVocab:
    ids: torch.Tensor  # [N] long token ids, most frequent first (ties: lower id first)
    row_of: torch.Tensor  # [V] long: the row of each token id in `ids`, −1 outside
    coverage: float  # fraction of the training labels inside the set

    @property
    def size(self) -> int:
        return int(self.ids.numel())


def label_vocab(samples: Sequence[Any], vocab_size: int, size: int) -> LabelVocab:
    """The `size` most frequent label tokens of `samples` (their response tokens)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i in range(len(samples)):
        s = samples[i]
        ids = np.asarray(s.input_ids, dtype=np.int64)[np.asarray(s.loss_mask, dtype=bool)]
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"sample {s.id!r}: token ids outside the target's vocabulary of {vocab_size}")
        counts += np.bincount(ids, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))[:size]  # by count, descending; ties by id
    ids = torch.from_numpy(order.copy())
    row_of = torch.full((vocab_size,), -1, dtype=torch.long)
    row_of[ids] = torch.arange(len(ids))
    total = int(counts.sum())
    return LabelVocab(ids, row_of, float(counts[order].sum()) / total if total else 1.0)


def restrict_labels(draft: DraftBatch, vocab: LabelVocab) -> DraftBatch:
    """The same blocks with labels as rows of `vocab.ids`; a label outside the set becomes IGNORE."""
    labels = draft.labels
    rows = vocab.row_of[labels.clamp(min=0)]
    labels = torch.where((labels != IGNORE) & (rows >= 0), rows, torch.full_like(labels, IGNORE))
    return dataclasses.replace(
        draft, labels=labels, label_index=(labels.flatten() != IGNORE).nonzero().flatten()
    )
