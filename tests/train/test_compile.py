"""runtime.compile=model: the drafter's training forward is one torch.compile graph (CPU, dynamo only).

pytest tests/train/test_compile.py
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter
from torch.nn.attention.flex_attention import flex_attention

from flashdraft import drafter as drafter_mod
from flashdraft.train.blocks import AnchorSampler, build_blocks
from flashdraft.train.step import block_attention_mask
from tests.conftest import tiny_drafter, tiny_target
from tests.train.helpers import features_for, make_docs


@pytest.mark.parametrize("attention", ["dense", "flex"])
def test_whole_drafter_forward_is_one_graph(attention, monkeypatch):
    """The training forward (fp32 weights, bf16 autocast, frozen embeddings as the block input) compiles to
    one frame with no graph break, whether or not compile_flex_attention() (runtime.compile=attention) ran
    earlier in the process. It had broken at `_FLEX_KERNEL or flex_attention` under torch 2.11: every
    DecoderLayer.forward then compiled on its own, and layer 1's grad-requiring input recompiled layer 0's
    frame (the GPU test's RecompileError on the H200)."""
    t = tiny_target("llama", dtype=torch.bfloat16, hidden=64)
    drafter = tiny_drafter(t, layers=2, block_size=8).float().train()
    if attention == "flex":
        drafter.requires_grad_(False)  # FlexAttention has no backward on CPU (torch raises while tracing)
    docs = make_docs([150, 90, 200, 120], seed=0)
    fb = features_for(t, [[docs[0], docs[1]], [docs[2], docs[3]]], drafter.target_layer_ids, max_length=320)
    d = build_blocks(fb, AnchorSampler(0).sample(fb, 32, block_multiple=16), 8, drafter.mask_token_id)
    with torch.no_grad():
        emb = t.embed_tokens(d.block_ids)  # [R, N·B, H] no grad, as in micro_step
    mask = block_attention_mask(d, attention, torch.device("cpu"))

    torch._dynamo.reset()
    counter = CompileCounter()  # dynamo's graphs handed to a backend that runs them eagerly: no inductor
    compiled = torch.compile(drafter, backend=counter, dynamic=False)
    # after runtime.compile=attention's compiled kernel was made in this process, then without it
    for kernel in (torch.compile(flex_attention), None):
        monkeypatch.setattr(drafter_mod, "_FLEX_KERNEL", kernel)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = compiled(fb.features, emb, d.position_ids, mask)  # [R, N·B, H]
        assert hidden.requires_grad == (attention == "dense")
    torch._dynamo.reset()
    assert counter.frame_count == 1, (
        f"{counter.frame_count} frames compiled: a graph break or a recompile in DFlashDrafter.forward "
        "(TORCH_LOGS=graph_breaks,recompiles shows where)"
    )
