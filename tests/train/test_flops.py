"""Model FLOPs of a drafter step: a hand-counted batch, and the count against the block mask."""

from __future__ import annotations

import torch

from flashdraft.drafter import DFlashConfig
from flashdraft.train.batch import pack_rows
from flashdraft.train.blocks import Anchors, build_blocks, dense_block_mask
from flashdraft.train.flops import attention_pairs, block_tokens, step_flops, trainable_params
from tests.train.helpers import fake_features, make_docs

B = 4


def two_rows():  # noqa: ANN201
    """Row 0: documents of 10 and 8 tokens packed (the second starts at row index 10), anchors 3 and 5
    overlapping (blocks 3..6 and 5..8), anchor 12 in the second document, one padding block.
    Row 1: one 12-token document, anchor 7, three padding blocks."""
    d = make_docs([10, 8, 12], seed=0)
    fb = fake_features(pack_rows([[d[0], d[1]], [d[2]]], max_length=32))
    anchors = Anchors(
        positions=torch.tensor([[3, 5, 12, 0], [7, 0, 0, 0]]),
        doc_start=torch.tensor([[0, 0, 10, 0], [0, 0, 0, 0]]),
        valid=torch.tensor([[True, True, True, False], [True, False, False, False]]),
    )
    return build_blocks(fb, anchors, block_size=B, mask_token_id=96)


def test_attention_pairs_and_flops_by_hand():
    draft = two_rows()
    # per valid block: B queries × (anchor − doc_start) context rows + B × B in-block pairs
    #   row 0: 4·3 + 16 = 28,  4·5 + 16 = 36,  4·(12 − 10) + 16 = 24;   row 1: 4·7 + 16 = 44
    assert attention_pairs(draft) == 28 + 36 + 24 + 44 == 132
    assert block_tokens(draft) == 4 * B == 16  # 4 valid blocks; padding blocks are not model work
    cfg = DFlashConfig(
        hidden_size=8, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        head_dim=4, num_target_layers=4, target_layer_ids=[1], mask_token_id=96, vocab_size=97, block_size=B,
    )  # fmt: skip
    # 6·P·T = 6·1000·16 = 96,000;  4·H·V·T = 4·8·97·16 = 49,664;  12·L·heads·head_dim·pairs = 12·2·2·4·132 = 25,344
    assert step_flops([draft], cfg, trainable=1000) == 171_008
    assert step_flops([draft, draft], cfg, trainable=1000) == 2 * 171_008  # summed over micro-batches


def test_attention_pairs_are_the_true_entries_of_the_training_mask():
    draft = two_rows()
    mask = dense_block_mask(draft)[:, 0]  # [R, N·B, S + N·B]
    valid_queries = draft.valid.repeat_interleave(B, dim=1)  # [R, N·B]
    assert int(mask[valid_queries].sum()) == attention_pairs(draft)


def test_trainable_params_skip_frozen_ones():
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2, bias=False))  # 16 + 8
    m[1].weight.requires_grad_(False)
    assert trainable_params(m) == 16
