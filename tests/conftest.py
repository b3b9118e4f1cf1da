"""Shared fixtures: tiny random Llama / Qwen3 targets and drafters shaped for them."""

from __future__ import annotations

import pytest
import torch

from flashdraft.drafter import DFlashDrafter
from flashdraft.target import TargetModel, drafter_config_for


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """typer's error panels (rich) wrap at the terminal width, 80 columns when output is not a terminal: in a
    clean-clone CI run a long pytest tmp path split the message a CLI test matched. Every test (and every
    CliRunner in it) sees a wide terminal; pytest's own output keeps the real width."""
    monkeypatch.setenv("COLUMNS", "1000")


def tiny_target(
    family: str = "llama",
    *,
    dtype: torch.dtype = torch.float64,
    vocab: int = 97,
    hidden: int = 32,
    layers: int = 6,
    seed: int = 0,
    attn_implementation: str = "sdpa",
) -> TargetModel:
    """A randomly initialised causal LM built in-process (no files, no hub)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    if family == "llama":
        cfg = LlamaConfig(**common)
        model = LlamaForCausalLM(cfg)
    elif family == "qwen3":
        cfg = Qwen3Config(**common, head_dim=hidden // 4)
        model = Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(family)
    model.config._attn_implementation = attn_implementation
    # a larger init than HF's 0.02 so random targets have peaked, varied distributions
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.25 if "embed" in name or "lm_head" in name else 0.12)
    return TargetModel(model.to(dtype), tokenizer=None, name=f"tiny-{family}")


def tiny_drafter(target: TargetModel, *, layers: int = 2, block_size: int = 8, seed: int = 1, **kw) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = drafter_config_for(target, num_layers=layers, block_size=block_size, **kw)
    d = DFlashDrafter(cfg)
    d.reset_parameters(std=0.1)
    return d.to(target.dtype).eval()


@pytest.fixture
def fast_engine_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per FastEngine that `flashdraft.decode.engine.generate` builds from here on (CUDA graphs off),
    starting from no kept engine."""
    from flashdraft.decode import engine as fast

    built: list[int] = []

    class Counting(fast.FastEngine):
        def __init__(self, *args: object, **kwargs: object) -> None:
            built.append(1)
            super().__init__(*args, **{**kwargs, "cuda_graphs": False})  # type: ignore[arg-type]

    monkeypatch.setattr(fast, "FastEngine", Counting)
    monkeypatch.setattr(fast, "_ENGINE", {})
    return built


@pytest.fixture(params=["llama", "qwen3"])
def family(request: pytest.FixtureRequest) -> str:
    return request.param
