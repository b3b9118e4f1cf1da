"""loss.softmax_vocab: the loss's softmax over the most frequent label tokens (flashdraft.train.vocab)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashdraft.train.batch import pack_rows
from flashdraft.train.blocks import IGNORE, AnchorSampler, build_blocks
from flashdraft.train.loss import drafter_loss, slot_weights
from flashdraft.train.vocab import label_vocab, restrict_labels
from tests.train.helpers import Doc, fake_features, make_docs


def test_the_most_frequent_label_tokens_ties_by_id():
    docs = [Doc("a", np.array([9, 5, 5, 7, 7, 7, 2]), np.array([0, 1, 1, 1, 1, 1, 1], bool)),
            Doc("b", np.array([9, 9, 2, 8]), np.array([0, 0, 1, 1], bool))]  # fmt: skip
    v = label_vocab(docs, vocab_size=12, size=3)
    assert v.ids.tolist() == [7, 2, 5]  # 7 ×3, then 2 and 5 ×2 each (lower id first); 9 is prompt only
    assert v.coverage == pytest.approx(7 / 8)
    assert v.row_of[7] == 0 and v.row_of[5] == 2 and v.row_of[9] == -1 and v.size == 3
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        label_vocab(docs, vocab_size=8, size=3)


def test_restricted_labels_index_the_subset_and_drop_the_rest():
    docs = make_docs([30, 25], vocab=40, seed=1)
    fb = fake_features(pack_rows([docs], 64))
    draft = build_blocks(fb, AnchorSampler(0).sample(fb, max_anchors=50), 4, 96)
    v = label_vocab(docs, vocab_size=40, size=20)
    r = restrict_labels(draft, v)
    kept = r.labels != IGNORE
    assert 0 < int(kept.sum()) < int((draft.labels != IGNORE).sum())
    assert torch.equal(v.ids[r.labels[kept]], draft.labels[kept])  # the same tokens, as rows of the subset
    outside = v.row_of[draft.labels.clamp(min=0)] < 0
    assert torch.equal((draft.labels != IGNORE) & ~kept, (draft.labels != IGNORE) & outside)
    assert torch.equal(r.label_index, kept.flatten().nonzero().flatten())


def test_the_restricted_loss_is_the_cross_entropy_over_the_subset_rows():
    torch.manual_seed(0)
    docs = make_docs([30, 25], vocab=40, seed=2)
    fb = fake_features(pack_rows([docs], 64))
    draft = build_blocks(fb, AnchorSampler(0).sample(fb, max_anchors=50), 4, 96)
    v = label_vocab(docs, vocab_size=40, size=16)
    r = restrict_labels(draft, v)
    head = torch.randn(40, 8, dtype=torch.float64)
    hidden = torch.randn(*draft.block_ids.shape, 8, dtype=torch.float64)
    w = slot_weights(4, 2.0).double()
    out = drafter_loss(hidden, r, head[v.ids], w, 1.0)
    kept = r.labels.flatten() != IGNORE
    logits = hidden.reshape(-1, 8)[kept] @ head[v.ids].t()  # the subset's logits only
    slot = (torch.arange(r.labels.numel()) % 4)[kept]
    want = (
        torch.nn.functional.cross_entropy(logits, r.labels.flatten()[kept], reduction="none") * w[slot]
    ).sum()
    torch.testing.assert_close(out.weighted_ce, want)


def test_training_with_a_restricted_softmax(tmp_path, capsys):
    """loss.softmax_vocab through `flashdraft train`'s code path: the coverage is reported, and the first step's
    loss is the subset's CE — lower than the full softmax's at the same (seeded) starting weights."""
    from flashdraft.config import ConfigError, load_config
    from flashdraft.train.config import TrainConfig
    from flashdraft.train.launch import train
    from flashdraft.train.metrics import read_metrics
    from tests.conftest import tiny_target

    t = tiny_target("llama", dtype=torch.float32)
    docs = make_docs([40, 30, 20, 45, 25, 33], vocab=60, seed=0)
    first = {}
    for v in (0, 16):
        cfg = load_config(TrainConfig, None, [
            f"run_dir={tmp_path / str(v)}", "model.num_layers=1", "model.block_size=4", "loss.gamma=4",
            "data.max_length=48", "data.token_budget=96", "data.max_anchors=6", "data.pad_multiple=1",
            "telemetry.log_every=1", "telemetry.tensorboard=false", "telemetry.progress=false",
            "runtime.dtype=float32", "optim.max_steps=2", f"loss.softmax_vocab={v}"])  # fmt: skip
        res = train(cfg, target=t, samples=docs)
        first[v] = read_metrics(tmp_path / str(v))[0]["loss"]
    assert res.steps == 2 and first[16] < first[0]
    err = capsys.readouterr().err
    assert "loss.softmax_vocab=16:" in err and "of the training labels are inside it" in err
    with pytest.raises(ConfigError, match="loss.softmax_vocab -1 must be >= 0"):
        load_config(TrainConfig, None, ["data.dataset=x", "loss.softmax_vocab=-1"]).validate()
