"""Packing, target features, anchors, block labels and the block attention mask."""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_mask

from flashdraft.train.batch import pack_rows, plan_micro_batches
from flashdraft.train.blocks import (
    IGNORE,
    Anchors,
    AnchorSampler,
    block_mask_mod,
    build_blocks,
    dense_block_mask,
    flex_block_mask,
    looping_labels,
    valid_anchor_positions,
)
from tests.conftest import tiny_drafter, tiny_target
from tests.train.helpers import Doc, fake_features, features_for, make_docs

MASK = 96


def test_plan_packs_in_order_within_budget():
    plans = plan_micro_batches([20, 13, 30, 9, 25, 100], max_length=40, token_budget=80)
    assert [p.rows for p in plans] == [[[0, 1], [2, 3]], [[4], [5]]]
    for p in plans:
        assert len(p.rows) <= 2


def test_pack_rows_positions_restart_per_document():
    docs = make_docs([5, 4, 6])
    tb = pack_rows([[docs[0], docs[1]], [docs[2]]], max_length=16)
    assert tb.position_ids[0, :9].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3]
    assert tb.doc_ids[0].tolist() == [0] * 5 + [1] * 4  # S = the longest row
    assert tb.doc_ids[1].tolist() == [2] * 6 + [-1] * 3
    assert tb.input_ids[0, 5:9].tolist() == docs[1].input_ids.tolist()
    assert not tb.loss_mask[1, 6:].any()


def test_packed_features_equal_single_document_features(family):
    """The target never attends across packed documents: features match a solo pass."""
    t = tiny_target(family)
    docs = make_docs([11, 7, 9], seed=3)
    layers = [0, 2, 5]
    packed = features_for(t, [[docs[0], docs[1], docs[2]]], layers)
    at = 0
    for d in docs:
        solo = features_for(t, [[d]], layers)
        n = len(d.input_ids)
        torch.testing.assert_close(packed.features[0, at : at + n], solo.features[0], rtol=0, atol=1e-12)
        at += n


def test_anchor_validity_and_sampling_are_per_document_and_seeded():
    docs = make_docs([30, 20], seed=1)
    fb = fake_features(pack_rows([[docs[0], docs[1]]], 64))
    ok = valid_anchor_positions(fb.loss_mask, fb.doc_ids)
    # last token of each document and the last prompt token are never anchors
    assert not ok[0, 29] and not ok[0, 49] and ok[0, 9] and not ok[0, 8]
    a1 = AnchorSampler(7).sample(fb, max_anchors=4)
    a2 = AnchorSampler(7).sample(fb, max_anchors=4)
    assert torch.equal(a1.positions, a2.positions)
    pos = a1.positions[0][a1.valid[0]]
    assert len(pos) == 8 and len(set(pos.tolist())) == 8  # 4 per document, distinct
    assert ok[0, pos].all()
    assert ((pos < 30) == (a1.doc_start[0][a1.valid[0]] == 0)).all()
    # the generator advances: the next epoch's anchors differ
    s = AnchorSampler(7)
    first, second = s.sample(fb, 4), s.sample(fb, 4)
    assert not torch.equal(first.positions, second.positions)


def test_blocks_per_row_fixes_the_shape_and_keeps_a_valid_subset():
    docs = make_docs([30, 20, 40], seed=1)
    fb = fake_features(pack_rows([[docs[0], docs[1]], [docs[2]]], 64))
    ok = valid_anchor_positions(fb.loss_mask, fb.doc_ids)
    dynamic = AnchorSampler(3).sample(fb, max_anchors=6)
    # room for every anchor: the same anchors as the dynamic sampler, padded to the fixed count
    roomy = AnchorSampler(3).sample(fb, max_anchors=6, blocks_per_row=16)
    assert roomy.positions.shape == (2, 16)
    for r in range(2):
        assert torch.equal(roomy.positions[r][roomy.valid[r]], dynamic.positions[r][dynamic.valid[r]])
    # too little room: exactly blocks_per_row distinct valid anchors, still ≤ max_anchors per document
    tight = AnchorSampler(3).sample(fb, max_anchors=6, blocks_per_row=5)
    assert tight.positions.shape == (2, 5) and bool(tight.valid.all())
    for r in range(2):
        pos = tight.positions[r]
        assert ok[r, pos].all() and len(set(pos.tolist())) == 5
        assert torch.equal(pos, pos.sort().values)
        assert int((pos < 30).sum()) <= 6 if r == 0 else True
        starts = tight.doc_start[r]
        assert torch.equal(starts, fb.doc_ids[r, pos].clamp(min=0).new_tensor(
            [int((fb.doc_ids[r] == fb.doc_ids[r, a]).nonzero()[0]) for a in pos.tolist()]))  # fmt: skip


def _looping_doc(name: str, seed: int) -> Doc:
    """A 20-token prompt, then an answer of 60 fresh tokens followed by a 5-token phrase repeated 12 times."""
    rng = np.random.default_rng(seed)
    ids = np.r_[rng.integers(3, 97, 20), rng.integers(3, 97, 60), np.tile(rng.integers(3, 97, 5), 12)]
    return Doc(name, ids, np.r_[np.zeros(20, bool), np.ones(120, bool)])


def test_looping_labels_are_the_answers_repeated_8_grams():
    from flashdraft.data.inspect import repeated_tokens

    docs = [_looping_doc("a", 1), _looping_doc("b", 2)]
    fb = fake_features(pack_rows([docs], 320))
    loops = looping_labels(fb.input_ids, fb.loss_mask)
    # each document's answer alone: an 8-gram of the first answer does not count in the next
    for start in (0, 140):
        want = repeated_tokens(fb.input_ids[0, start + 20 : start + 140].numpy())
        assert loops[0, start + 20 : start + 140].tolist() == want.tolist()
        assert not loops[0, start : start + 20].any()  # prompts are no loop
    assert int(loops[0, 20:140].sum()) == (60 - 7) - 5  # the loop's 53 8-grams but the first of each of its 5


def test_loop_anchor_weight_keeps_fewer_anchors_inside_loops():
    docs = [_looping_doc(f"d{i}", i) for i in range(4)]
    fb = fake_features(pack_rows([docs[:2], docs[2:]], 320))
    ok = valid_anchor_positions(fb.loss_mask, fb.doc_ids)
    loops = torch.zeros_like(ok)
    loops[:, :-1] = looping_labels(fb.input_ids, fb.loss_mask)[:, 1:]
    share = float(loops[ok].float().mean())  # about half of the candidates draft inside the loop

    def kept_share(weight: float, **kw: int) -> float:
        s, got = AnchorSampler(5), []
        for _ in range(20):
            a = s.sample(fb, loop_weight=weight, **kw)
            got.append(loops.gather(1, a.positions)[a.valid].float())
        return float(torch.cat(got).mean())

    for kw in ({"max_anchors": 24}, {"max_anchors": 512, "blocks_per_row": 24}):
        assert abs(kept_share(1.0, **kw) - share) < 0.1
        assert kept_share(0.05, **kw) < share / 4
    # weight 1 is the uniform sampler itself: the same anchors, draw for draw
    a, b = AnchorSampler(9).sample(fb, 24), AnchorSampler(9).sample(fb, 24, loop_weight=1.0)
    assert torch.equal(a.positions, b.positions)


def test_labels_are_same_position_not_shifted_and_dropped_outside_mask():
    docs = make_docs([12, 10], seed=2, prompt_frac=0.25)  # doc0: prompt 3, doc1: prompt 2
    fb = fake_features(pack_rows([[docs[0], docs[1]]], 64))
    x = fb.input_ids[0]
    anchors = Anchors(
        torch.tensor([[4, 9, 14]]), torch.tensor([[0, 0, 12]]), torch.tensor([[True, True, True]])
    )
    d = build_blocks(fb, anchors, block_size=4, mask_token_id=MASK)
    blocks = d.block_ids.view(3, 4)
    labels = d.labels.view(3, 4)
    pos = d.position_ids[0, fb.input_ids.shape[1] :].view(3, 4)
    assert blocks[:, 0].tolist() == [x[4], x[9], x[14]] and (blocks[:, 1:] == MASK).all()
    # block at 4: slot k predicts x[4 + k] (same position), slot 0 has no loss
    assert labels[0].tolist() == [IGNORE, x[5], x[6], x[7]]
    assert pos[0].tolist() == [4, 5, 6, 7]
    # block at 9 in a 12-token document: slots past the document end are dropped
    assert labels[1].tolist() == [IGNORE, x[10], x[11], IGNORE]
    # block in the second document: positions are document-relative
    assert pos[2].tolist() == [2, 3, 4, 5]
    assert labels[2].tolist() == [IGNORE, x[15], x[16], x[17]]
    assert d.label_index.tolist() == (d.labels.flatten() != IGNORE).nonzero().flatten().tolist()


def _mask_case():
    docs = make_docs([14, 9, 16, 12], seed=4)
    fb = fake_features(pack_rows([[docs[0], docs[1]], [docs[2], docs[3]]], 32))
    # overlapping anchors (6, 7) in one document, anchors in the second document, padding blocks
    anchors = Anchors(
        torch.tensor([[6, 7, 16, 0], [5, 20, 22, 0]]),
        torch.tensor([[0, 0, 14, 0], [0, 16, 16, 0]]),
        torch.tensor([[True, True, True, False], [True, True, True, False]]),
    )
    return fb, build_blocks(fb, anchors, block_size=4, mask_token_id=MASK)


def test_dense_mask_semantics():
    fb, d = _mask_case()
    m = dense_block_mask(d)[:, 0]  # [R, N·B, S + N·B]
    s, b = d.context_len, 4
    # block 0 (anchor 6): context rows 0..5 only — the anchor's own feature (6) is not visible
    q0 = m[0, 0:4]
    assert q0[:, :6].all() and not q0[:, 6:s].any()
    # block 1 (anchor 7, overlaps block 0 in position): sees 0..6, its own block, not block 0
    q1 = m[0, 4:8]
    assert q1[:, :7].all() and not q1[:, 7:s].any()
    assert q1[:, s + 4 : s + 8].all() and not q1[:, s : s + 4].any() and not q1[:, s + 8 :].any()
    # block 2 (anchor 16 in the second packed document starting at 14): sees 14, 15 only
    q2 = m[0, 8:12]
    assert q2[:, 14:16].all() and not q2[:, :14].any() and not q2[:, 16:s].any()
    # every query sees its whole block (bidirectional), padding blocks included
    for n in range(4):
        assert m[:, n * b : (n + 1) * b, s + n * b : s + (n + 1) * b].all()
    assert m.any(-1).all()  # no fully masked query row (would be NaN)


def test_flex_mask_equals_dense_mask_with_packing():
    fb, d = _mask_case()
    dense = dense_block_mask(d)
    r, q = d.block_ids.shape
    flex = create_mask(block_mask_mod(d), r, 1, q, d.context_len + q, device="cpu")
    assert torch.equal(flex, dense)
    # and with sampled anchors on a larger packed batch
    docs = make_docs([40, 25, 33, 50, 8], seed=5)
    fb = fake_features(pack_rows([[docs[0], docs[1], docs[4]], [docs[2], docs[3]]], 96))
    d = build_blocks(fb, AnchorSampler(0).sample(fb, 6), block_size=8, mask_token_id=MASK)
    r, q = d.block_ids.shape
    flex = create_mask(block_mask_mod(d), r, 1, q, d.context_len + q, device="cpu")
    assert torch.equal(flex, dense_block_mask(d))


def test_drafter_output_same_with_flex_and_dense_mask():
    t = tiny_target("llama")
    drafter = tiny_drafter(t, block_size=4)
    docs = make_docs([14, 9, 16, 12], seed=4)
    fb = features_for(t, [[docs[0], docs[1]], [docs[2], docs[3]]], drafter.target_layer_ids, max_length=32)
    d = build_blocks(fb, AnchorSampler(1).sample(fb, 3), block_size=4, mask_token_id=drafter.mask_token_id)
    emb = t.embed_tokens(d.block_ids)
    with torch.no_grad():  # flex_attention has no backward on CPU; the forward is what must agree
        dense_out = drafter(fb.features, emb, d.position_ids, dense_block_mask(d))
        flex_out = drafter(fb.features, emb, d.position_ids, flex_block_mask(d, "cpu"))
    torch.testing.assert_close(flex_out, dense_out, rtol=1e-9, atol=1e-9)


def test_smaller_flex_tiles_give_the_same_mask_and_output():
    """runtime.flex_block_size: a BlockMask with (16, 32) tiles is the same mask (its dense form equals the
    rule's), and the drafter through it (with the matching kernel options) gives the dense output."""
    from flashdraft.drafter import flex_kernel_options

    t = tiny_target("llama")
    drafter = tiny_drafter(t, block_size=4)
    docs = make_docs([40, 25, 33, 50], seed=4)
    fb = features_for(t, [[docs[0], docs[1]], [docs[2], docs[3]]], drafter.target_layer_ids, max_length=96)
    d = build_blocks(fb, AnchorSampler(1).sample(fb, 6), block_size=4, mask_token_id=drafter.mask_token_id)
    small = flex_block_mask(d, "cpu", (16, 32))
    assert small.BLOCK_SIZE == (16, 32)
    r, q = d.block_ids.shape
    dense = dense_block_mask(d)
    # every unmasked pair lies in a tile the BlockMask visits (partial or full): no attention is skipped
    tiles = small.to_dense().bool()  # [R, 1, Q/16, KV/32] visited tiles
    cover = tiles.repeat_interleave(16, 2).repeat_interleave(32, 3)[:, :, :q, : dense.shape[-1]]
    assert not (dense & ~cover).any()
    assert flex_kernel_options((128, 128)) is None
    opts = flex_kernel_options((64, 32))
    assert opts["fwd_BLOCK_M"] == 64 and opts["bwd_BLOCK_N1"] % opts["bwd_BLOCK_M1"] == 0
    assert opts["bwd_BLOCK_M2"] % opts["bwd_BLOCK_N2"] == 0
    emb = t.embed_tokens(d.block_ids)
    with torch.no_grad():
        dense_out = drafter(fb.features, emb, d.position_ids, dense)
        small_out = drafter(fb.features, emb, d.position_ids, small)
    torch.testing.assert_close(small_out, dense_out, rtol=1e-9, atol=1e-9)


def test_no_leak_between_blocks_and_from_future_context():
    """Changing a block, or context at/after the anchor, must not change another block's output."""
    t = tiny_target("qwen3")
    drafter = tiny_drafter(t, block_size=4)
    docs = make_docs([24], seed=6)
    fb = features_for(t, [[docs[0]]], drafter.target_layer_ids, max_length=32)
    anchors = Anchors(torch.tensor([[10, 11]]), torch.tensor([[0, 0]]), torch.tensor([[True, True]]))
    d = build_blocks(fb, anchors, block_size=4, mask_token_id=drafter.mask_token_id)
    mask = dense_block_mask(d)
    emb = t.embed_tokens(d.block_ids)
    base = drafter(fb.features, emb, d.position_ids, mask)
    emb2 = emb.clone()
    emb2[:, 4:] += 1.0  # perturb block 1 only
    feats2 = fb.features.clone()
    feats2[:, 10:] += 1.0  # perturb the anchor's own feature and everything after it
    out = drafter(feats2, emb2, d.position_ids, mask)
    torch.testing.assert_close(out[:, :4], base[:, :4], rtol=0, atol=1e-12)
    assert (out[:, 4:] - base[:, 4:]).abs().max() > 1e-3  # the perturbation is visible where allowed


def test_flex_and_dense_agree_under_bf16_autocast_with_fp32_weights():
    """The GPU recipe (fp32 master weights, bf16 autocast) through both attention paths."""
    t = tiny_target("llama", dtype=torch.bfloat16)
    drafter = tiny_drafter(t, block_size=4).float()
    docs = make_docs([14, 9, 16], seed=7)
    fb = features_for(t, [[docs[0], docs[1]], [docs[2]]], drafter.target_layer_ids, max_length=32)
    d = build_blocks(fb, AnchorSampler(2).sample(fb, 3), block_size=4, mask_token_id=drafter.mask_token_id)
    emb = t.embed_tokens(d.block_ids)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        dense_out = drafter(fb.features, emb, d.position_ids, dense_block_mask(d))
        flex_out = drafter(fb.features, emb, d.position_ids, flex_block_mask(d, "cpu"))
    torch.testing.assert_close(flex_out.float(), dense_out.float(), rtol=0.05, atol=0.05)
