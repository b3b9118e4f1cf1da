"""Small in-memory samples and batches for the training tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashdraft.train.batch import FeatureBatch, TokenBatch, compute_features, pack_rows


@dataclass
class Doc:
    id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray


def make_docs(lengths: list[int], vocab: int = 97, seed: int = 0, prompt_frac: float = 0.3) -> list[Doc]:
    rng = np.random.default_rng(seed)
    docs = []
    for i, n in enumerate(lengths):
        p = int(n * prompt_frac)
        docs.append(Doc(f"doc{i}", rng.integers(3, vocab, n), np.r_[np.zeros(p, bool), np.ones(n - p, bool)]))
    return docs


def token_batch(rows: list[list[Doc]], max_length: int = 64) -> TokenBatch:
    return pack_rows(rows, max_length)


def fake_features(tb: TokenBatch, width: int = 8) -> FeatureBatch:
    """A FeatureBatch without a target: features encode (row, index) so leaks are traceable."""
    r, s = tb.input_ids.shape
    feats = torch.randn(r, s, width, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return FeatureBatch(tb.input_ids, feats, tb.loss_mask, tb.position_ids, tb.doc_ids, tb.sample_ids)


def features_for(target, rows: list[list[Doc]], layer_ids: list[int], max_length: int = 64) -> FeatureBatch:  # type: ignore[no-untyped-def]
    return compute_features(target, pack_rows(rows, max_length), layer_ids)
