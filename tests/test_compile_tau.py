"""benchmarks/compile_tau.py's measurements on tiny random models in float32 (inductor's CPU backend): the facts
that hold whatever the numbers, and the JSON's shape."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_drafter, tiny_target

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("compile_tau", REPO / "benchmarks" / "compile_tau.py")
assert _spec is not None and _spec.loader is not None
compile_tau = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compile_tau)


def test_first_diff() -> None:
    assert compile_tau.first_diff([1, 2, 3], [1, 2, 3]) is None
    assert compile_tau.first_diff([1, 2, 3], [1, 5, 3]) == 1
    assert compile_tau.first_diff([1, 2], [1, 2, 3]) == 2


@pytest.mark.slow
def test_compile_tau_on_tiny_models(tmp_path: Path) -> None:
    """One prompt of 20 random tokens, 12 new ones, chain and DDTree-4: the compile_drafter-only engine keeps the
    eager engine's tokens (its target is eager), every engine compiled what it says, the compiled target's argmaxes
    are eager's in float32, and the JSON holds every part."""
    target = tiny_target("llama", layers=2, seed=3, dtype=torch.float32)
    drafter = tiny_drafter(target, layers=1, block_size=8, seed=1)
    rng = random.Random(0)
    prompt = [rng.randrange(3, target.vocab_size) for _ in range(20)]
    saved: list[str] = []
    out = tmp_path / "r.json"

    def save(result: dict) -> None:
        saved.append(json.dumps(result))
        out.write_text(saved[-1])

    result = compile_tau.run(target, drafter, [prompt], 12, max_len=64, max_budget=4,
                             methods=[("chain", None), ("ddtree", 4)], q=8, stride=4, draft_stride=2,
                             save=save)  # fmt: skip
    assert len(saved) == 3
    data = json.loads(out.read_text())
    assert {"device", "dtype", "torch", "prompts", "max_new_tokens", "end_to_end", "target_forced",
            "drafter_forced"} <= data.keys()  # fmt: skip
    e2e = data["end_to_end"]
    rows = {(r["variant"], r["method"]): r for r in e2e["rows"]}
    assert set(rows) == {(v, m) for v in compile_tau.VARIANTS for m in ("ar", "chain", "ddtree:4")}
    assert e2e["compile_drafter_keeps_tokens"] is True
    for (variant, _), r in rows.items():
        ct, cd = compile_tau.VARIANTS[variant]
        assert (r["target_compiled"], r["drafter_compiled"]) == (ct, cd)
        assert r["tokens"] == 12
        if variant in ("eager", "compile_drafter"):  # an eager target: greedy speculative decoding is its AR
            assert r["diff_vs_eager"] == r["diff_vs_eager_ar"] == r["diff_vs_own_ar"] == [None]
    assert all(rows[(v, m)]["tau"] >= 1.0 for v in compile_tau.VARIANTS for m in ("chain", "ddtree:4"))
    tf = data["target_forced"]
    assert set(tf["logits"]) == {"eager_vs_compiled"}  # float32: no float32 copy to compare against
    assert tf["logits"]["eager_vs_compiled"]["rows"] > 0
    assert tf["logits"]["eager_vs_compiled"]["argmax_agree"] == 1.0
    assert [r["layer"] for r in tf["features"]] == list(drafter.target_layer_ids)
    assert all(r["eager_vs_compiled"]["max_rel"] < 1e-3 for r in tf["features"])
    df = data["drafter_forced"]
    assert df["steps"] > 0 and set(df["tau"]) == {"eager", "compiled", "eager_on_compiled_features"}
    # float32: the compiled target's features are eager's to rounding, so the eager step reads the same tokens
    assert df["tau"]["eager_on_compiled_features"] == df["tau"]["eager"]
    assert df["logits"]["eager_vs_eager_on_compiled_features"]["argmax_agree"] == 1.0
    assert len(df["slot_agree_eager_vs_compiled"]) == drafter.block_size - 1
    assert "| variant | method |" in compile_tau.report(result)
