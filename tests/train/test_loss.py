"""Decayed hard CE: weights, exactness against a naive full-logits loss, metrics, gradients, inputs left untouched."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashdraft.train.batch import pack_rows
from flashdraft.train.blocks import IGNORE, Anchors, AnchorSampler, build_blocks, dense_block_mask
from flashdraft.train.loss import drafter_loss, loss_denominator, slot_weights
from flashdraft.train.step import micro_step
from tests.conftest import tiny_drafter, tiny_target
from tests.train.helpers import fake_features, features_for, make_docs


def test_slot_weights():
    w = slot_weights(16)
    assert w[0] == 0 and w[1] == 1
    assert math.isclose(float(w[2]), math.exp(-1 / 7), rel_tol=1e-6)
    assert math.isclose(float(w[15]), math.exp(-14 / 7), rel_tol=1e-6)
    assert math.isclose(float(slot_weights(10)[3]), math.exp(-2 / 5), rel_tol=1e-6)
    assert math.isclose(float(slot_weights(8)[7]), math.exp(-6 / 4), rel_tol=1e-6)
    assert math.isclose(float(slot_weights(12, gamma=3.0)[4]), math.exp(-3 / 3), rel_tol=1e-6)
    with pytest.raises(ValueError, match="loss.gamma"):
        slot_weights(12)


def _case(seed: int = 0, b: int = 4):
    docs = make_docs([20, 14, 17], seed=seed)
    fb = fake_features(pack_rows([[docs[0], docs[1]], [docs[2]]], 40))
    draft = build_blocks(fb, AnchorSampler(seed).sample(fb, 5), block_size=b, mask_token_id=96)
    return fb, draft


def test_loss_matches_naive_weighted_ce_and_its_gradient():
    torch.manual_seed(0)
    _, draft = _case()
    r, q = draft.block_ids.shape
    hidden = torch.randn(r, q, 16, dtype=torch.float64, requires_grad=True)
    head = torch.randn(97, 16, dtype=torch.float64)
    w = slot_weights(4, gamma=2.0).double()
    denom = loss_denominator([draft], w)
    out = drafter_loss(hidden, draft, head, w, denom, chunk_tokens=7)  # chunks smaller than T
    out.loss.backward()
    g_chunked = hidden.grad.clone()
    # naive: full logits, per-token CE, weights by slot, normalised by Σw
    hidden.grad = None
    logits = hidden @ head.t()  # [R, Q, V]
    labels = draft.labels
    slots = torch.arange(q) % 4
    tok_w = w[slots][None].expand(r, q) * (labels != IGNORE)
    ce = F.cross_entropy(logits.reshape(-1, 97), labels.reshape(-1).clamp(min=0), reduction="none").view(r, q)
    naive = (tok_w * ce).sum() / tok_w.sum()
    naive.backward()
    torch.testing.assert_close(out.loss, naive, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_chunked, hidden.grad, rtol=1e-10, atol=1e-12)
    # slot 0 never counts; per-slot counts match the labels
    assert out.slot_count[0] == 0
    assert out.slot_count.sum() == (labels != IGNORE).sum()


def test_compiled_loss_chunks_match_eager(monkeypatch):
    """runtime.compile "loss": chunks padded to one static shape and compiled give the eager loss,
    gradient and argmaxes (here on CPU inductor; on CUDA the same code path in bf16)."""
    from flashdraft.train import loss as loss_mod

    torch.manual_seed(0)
    _, draft = _case()
    r, q = draft.block_ids.shape
    hidden = torch.randn(r, q, 16, requires_grad=True)
    head = torch.randn(97, 16)
    w = slot_weights(4, gamma=2.0)
    denom = loss_denominator([draft], w)
    results = []
    for compiled in (False, True):
        if compiled:
            monkeypatch.setattr(loss_mod, "_CHUNK_FN", loss_mod._ce_chunk)
            monkeypatch.setattr(loss_mod, "_FUSED_CHUNK_FN", loss_mod._ce_chunk_fused)
            loss_mod.compile_loss()
            assert loss_mod._CHUNK_FN is not loss_mod._ce_chunk
        hidden.grad = None
        out = drafter_loss(hidden, draft, head, w, denom, chunk_tokens=7)  # T is not a multiple of 7
        out.loss.backward()
        results.append((out.loss.detach(), hidden.grad.clone(), out.slot_correct, out.streak_sum))
    (l0, g0, c0, s0), (l1, g1, c1, s1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-6)
    assert torch.equal(c1, c0) and torch.equal(s1, s0)


def test_fused_ce_matches_the_reference_loss_gradient_and_argmax_in_float64():
    """loss.fused_ce: the two-pass chunk gives the log_softmax chunk's loss, gradient, per-slot accuracy and
    τ proxy (float64, chunks smaller than T and a tied maximum for the argmax)."""
    torch.manual_seed(1)
    _, draft = _case()
    r, q = draft.block_ids.shape
    head = torch.randn(97, 16, dtype=torch.float64)
    head[5] = head[7]  # two identical rows: tied logits, argmax must pick the same index in both paths
    w = slot_weights(4, gamma=2.0).double()
    denom = loss_denominator([draft], w)
    base = torch.randn(r, q, 16, dtype=torch.float64)
    base[0, 1] = head[5] * 3  # a labelled-or-not slot whose top logit is the tie
    results = []
    for fused in (False, True):
        hidden = base.clone().requires_grad_(True)
        out = drafter_loss(hidden, draft, head, w, denom, chunk_tokens=7, fused_ce=fused)
        out.loss.backward()
        results.append((out.loss.detach(), hidden.grad, out.weighted_ce, out.slot_correct, out.streak_sum))
    (l0, g0, ce0, c0, s0), (l1, g1, ce1, c1, s1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(ce1, ce0, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(g1, g0, rtol=1e-12, atol=1e-14)
    assert torch.equal(c1, c0) and torch.equal(s1, s0)


def test_fused_ce_argmax_on_ties_is_the_reference_one():
    from flashdraft.train.loss import _ce_chunk, _ce_chunk_fused

    h = torch.ones(3, 4, dtype=torch.float64)
    w = torch.zeros(6, 4, dtype=torch.float64)
    w[2] = w[4] = 1.0  # logits 0, 0, 4, 0, 4, 0: a tie at the top
    labels, tw = torch.tensor([2, 4, 0]), torch.ones(3, dtype=torch.float64)
    ref = _ce_chunk(h, w, labels, tw, torch.float64, True)
    new = _ce_chunk_fused(h, w, labels, tw, torch.float64, True)
    assert torch.equal(new[1], ref[1])
    torch.testing.assert_close(new[0], ref[0], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(new[2], ref[2], rtol=1e-14, atol=1e-14)


def test_compiled_fused_ce_matches_the_eager_reference(monkeypatch):
    """runtime.compile "loss" with loss.fused_ce: compiled (CPU inductor here), padded chunks, float32 —
    the eager reference loss and gradient."""
    from flashdraft.train import loss as loss_mod

    torch.manual_seed(0)
    _, draft = _case()
    r, q = draft.block_ids.shape
    hidden = torch.randn(r, q, 16, requires_grad=True)
    head = torch.randn(97, 16)
    w = slot_weights(4, gamma=2.0)
    denom = loss_denominator([draft], w)
    ref = drafter_loss(hidden, draft, head, w, denom, chunk_tokens=7)
    ref.loss.backward()
    g_ref, hidden.grad = hidden.grad.clone(), None
    monkeypatch.setattr(loss_mod, "_CHUNK_FN", loss_mod._ce_chunk)
    monkeypatch.setattr(loss_mod, "_FUSED_CHUNK_FN", loss_mod._ce_chunk_fused)
    loss_mod.compile_loss()
    assert loss_mod._FUSED_CHUNK_FN is not loss_mod._ce_chunk_fused
    out = drafter_loss(hidden, draft, head, w, denom, chunk_tokens=7, fused_ce=True)  # T not a multiple of 7
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), ref.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, g_ref, rtol=1e-4, atol=1e-6)
    assert torch.equal(out.slot_correct, ref.slot_correct) and torch.equal(out.streak_sum, ref.streak_sum)


def test_slot_accuracy_and_tau_proxy():
    fb = fake_features(pack_rows([make_docs([12], seed=1, prompt_frac=0.0)], 16))
    anchors = Anchors(torch.tensor([[0, 4]]), torch.tensor([[0, 0]]), torch.tensor([[True, True]]))
    draft = build_blocks(fb, anchors, block_size=4, mask_token_id=96)
    head = torch.eye(97, dtype=torch.float64)[:, :97]  # hidden one-hot → logits one-hot
    hidden = torch.zeros(1, 8, 97, dtype=torch.float64)
    labels = draft.labels[0]
    # block 0: slots 1, 2 correct, slot 3 wrong → streak 2; block 1: slot 1 wrong → streak 0
    for i, ok in zip([1, 2, 3, 5, 6, 7], [True, True, False, False, True, True], strict=True):
        tok = int(labels[i]) if ok else (int(labels[i]) + 1) % 97
        hidden[0, i, tok] = 10.0
    w = slot_weights(4, gamma=4.0).double()
    out = drafter_loss(hidden, draft, head, w, loss_denominator([draft], w))
    assert out.slot_correct.tolist() == [0, 1, 2, 1]
    assert out.slot_count.tolist() == [0, 2, 2, 2]
    assert float(out.streak_sum) == 2 and float(out.num_blocks) == 2  # τ proxy = 2/2 + 1 = 2


def test_every_fused_layer_receives_gradient(family):
    t = tiny_target(family)
    drafter = tiny_drafter(t, layers=2, block_size=4, target_layer_ids=[0, 2, 3, 5]).train()
    docs = make_docs([18, 12], seed=2)
    fb = features_for(t, [[docs[0], docs[1]]], drafter.target_layer_ids, max_length=32)
    draft = build_blocks(fb, AnchorSampler(0).sample(fb, 4), 4, drafter.mask_token_id)
    w = slot_weights(4, gamma=4.0).double()
    out = micro_step(drafter, t, fb, draft, w, loss_denominator([draft], w))
    out.loss.backward()
    g = drafter.fc.weight.grad  # [H, k·H]
    h = t.hidden_size
    for j in range(len(drafter.target_layer_ids)):
        assert g[:, j * h : (j + 1) * h].abs().sum() > 0, f"fused layer {j} got no gradient"
    for name, p in drafter.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_a_micro_step_leaves_the_features_labels_and_target_untouched():
    t = tiny_target("llama")
    drafter = tiny_drafter(t, block_size=4).train()
    docs = make_docs([18, 12], seed=3)
    fb = features_for(t, [[docs[0], docs[1]]], drafter.target_layer_ids, max_length=32)
    feats_before = fb.features.clone()
    ids = fb.input_ids.clone()
    logits_before = t.forward(ids, logits="all").logits.clone()
    draft = build_blocks(fb, AnchorSampler(0).sample(fb, 4), 4, drafter.mask_token_id)
    labels_before = draft.labels.clone()
    w = slot_weights(4, gamma=4.0).double()
    denom = loss_denominator([draft], w)
    micro_step(drafter, t, fb, draft, w, denom).loss.backward()
    assert torch.equal(fb.features, feats_before)
    assert torch.equal(draft.labels, labels_before)
    assert torch.equal(t.forward(ids, logits="all").logits, logits_before)
    assert all(p.grad is None for p in t.model.parameters())
    # and the mask used is the dense one of the batch (sanity: shapes line up)
    assert dense_block_mask(draft).shape[-1] == fb.features.shape[1] + draft.block_ids.shape[1]


def test_frozen_head_cast_is_reused_and_follows_in_place_updates():
    from flashdraft.train.loss import _cast_frozen

    w = torch.randn(50, 8)
    a = _cast_frozen(w, torch.bfloat16)
    assert a.dtype == torch.bfloat16 and torch.equal(a, w.to(torch.bfloat16))
    assert _cast_frozen(w, torch.bfloat16) is a  # no recast while the head is unchanged
    assert _cast_frozen(w, torch.float32) is w
    with torch.no_grad():
        w.mul_(2.0)  # bumps w._version
    b = _cast_frozen(w, torch.bfloat16)
    assert b is not a and torch.equal(b, w.to(torch.bfloat16))
    other = w.clone()  # same values, another tensor: its own cast
    assert _cast_frozen(other, torch.bfloat16) is not b
