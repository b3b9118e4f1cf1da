"""flashdraft.decode.backend.pick_engine: which decoder a command runs, and its one-line refusals."""

from __future__ import annotations

import functools

import pytest

import flashdraft.decode.backend as backend
from flashdraft.decode import engine as fast
from flashdraft.decode.generate import generate as reference
from tests.conftest import tiny_drafter, tiny_target


def test_pick_engine_on_a_cpu_target() -> None:
    target = tiny_target("llama", layers=1)
    assert backend.pick_engine(target, "auto") == ("reference", reference)  # no CUDA: the reference decoder
    assert backend.pick_engine(target, "reference") == ("reference", reference)
    assert backend.pick_engine(target, "fast") == ("fast", fast.generate)
    name, gen = backend.pick_engine(target, "fast", compile=True)
    assert name == "fast-compiled" and isinstance(gen, functools.partial) and gen.keywords == {"compile": True}
    with pytest.raises(ValueError, match="--compile: only the fast engine"):
        backend.pick_engine(target, "auto", compile=True)
    with pytest.raises(ValueError, match="--graph-prefill: CUDA graphs need a CUDA target"):
        backend.pick_engine(target, "fast", graph_prefill=True)
    with pytest.raises(ValueError, match="--graph-prefill: only the fast engine"):
        backend.pick_engine(target, "reference", graph_prefill=True)
    with pytest.raises(ValueError, match="--engine 'turbo': use auto, fast, reference"):
        backend.pick_engine(target, "turbo")


def test_pick_engine_where_the_fast_engine_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target outside the native families: auto falls back to the reference decoder, fast says why."""
    target = tiny_target("llama", layers=1)
    monkeypatch.setattr("flashdraft.decode.native.native_support_error", lambda t: "family 'gpt2' is not native")
    assert backend.pick_engine(target, "auto")[0] == "reference"
    with pytest.raises(ValueError, match="--engine fast: family 'gpt2' is not native"):
        backend.pick_engine(target, "fast")


def test_the_fast_engine_picked_decodes_like_the_reference() -> None:
    target = tiny_target("qwen3", layers=2, seed=3)
    drafter = tiny_drafter(target, layers=1, block_size=4, seed=1)
    _, gen = backend.pick_engine(target, "fast")
    got = gen(target, drafter, [5, 9, 11], max_new_tokens=12, method="chain")
    want = reference(target, drafter, [5, 9, 11], max_new_tokens=12, method="chain")
    assert got.tokens == want.tokens and got.acceptance_lengths == want.acceptance_lengths
