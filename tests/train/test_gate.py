"""The end-to-end gate: training and inference agree.

A tiny drafter overfits one sample — the tiny target's own greedy continuation of a prompt —
until chain decoding (`flashdraft.decode.generate`) accepts a full block (τ = B) on it. Any
disagreement between the training mask/labels/positions and what decoding feeds the drafter
(shifted labels, a visible anchor feature, wrong positions) keeps τ far below B.
"""

from __future__ import annotations

import numpy as np
import torch

from flashdraft.config import load_config
from flashdraft.decode.generate import generate
from flashdraft.train.config import TrainConfig
from flashdraft.train.launch import build_drafter
from flashdraft.train.source import InProcessSource
from flashdraft.train.trainer import Trainer
from tests.conftest import tiny_target
from tests.train.helpers import Doc

B = 8


def test_overfit_one_sample_until_a_full_block_is_accepted(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, and robust on a busy 2-core box
    try:
        t = tiny_target("llama", dtype=torch.float64)
        prompt = torch.tensor([5, 17, 42, 8, 63, 21, 9, 77, 30, 11])
        ref = generate(t, None, prompt, max_new_tokens=32, method="ar").tokens
        doc = Doc(
            "gate",
            np.array(prompt.tolist() + ref),
            np.r_[np.zeros(len(prompt), bool), np.ones(len(ref), bool)],
        )
        cfg = load_config(
            TrainConfig, None,
            [f"run_dir={tmp_path}", "model.num_layers=2", f"model.block_size={B}", "model.init_std=0.05",
             "data.dataset=<in-memory>", "data.max_length=64", "data.token_budget=64", "data.max_anchors=64",
             "data.pad_multiple=1", "optim.max_steps=120", "optim.lr=2e-2", "optim.warmup_ratio=0.05",
             "runtime.dtype=float64", "telemetry.log_every=40", "telemetry.tensorboard=false",
             "telemetry.progress=false", "checkpoint.every=100000"],
        )  # fmt: skip
        drafter = build_drafter(cfg, t, torch.device("cpu"), torch.float64)
        before = generate(t, drafter.eval(), prompt, max_new_tokens=len(ref), method="chain")
        assert max(before.acceptance_lengths) < B  # an untrained drafter does not pass the gate by luck
        source = InProcessSource(
            [doc], t, drafter.target_layer_ids, max_length=64, token_budget=64, epochs=None
        )
        result = Trainer(cfg, t, drafter.train(), source, run_dir=tmp_path).run()
        out = generate(t, drafter.eval(), prompt, max_new_tokens=len(ref), method="chain")
    finally:
        torch.set_num_threads(threads)
    assert out.tokens == ref  # lossless, whatever the drafter
    assert out.acceptance_lengths[0] == B, (out.acceptance_lengths, result.last_metrics)
    assert max(out.acceptance_lengths) == B
