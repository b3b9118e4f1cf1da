"""float32: speculative vs AR greedy outputs, divergences reported (never asserted) with margins.

Run with -s to see the report. Exactness is asserted in float64 (test_generate.py); here a
flip at a near-tie is expected arithmetic, so only the report's own machinery is checked.
"""

from __future__ import annotations

import random

import pytest
import torch

from flashdraft.decode import generate
from flashdraft.decode.divergence import find_divergence
from tests.conftest import tiny_drafter, tiny_target


def test_float32_divergence_report():
    lines = []
    for family in ("llama", "qwen3"):
        target = tiny_target(family, dtype=torch.float32, layers=4, seed=11)
        drafter = tiny_drafter(target, layers=1, block_size=8)
        rng = random.Random(0)
        stats = {"chain": [0, 0], "ddtree-8": [0, 0], "ddtree-32": [0, 0]}
        for _ in range(8):
            prompt = [rng.randrange(3, target.vocab_size) for _ in range(rng.randint(2, 12))]
            ar = generate(target, None, prompt, max_new_tokens=16, method="ar").tokens
            for name, method, budget in [("chain", "chain", None), ("ddtree-8", "ddtree", 8),
                                         ("ddtree-32", "ddtree", 32)]:  # fmt: skip
                out = generate(
                    target, drafter, prompt, max_new_tokens=16, method=method, budget=budget
                ).tokens
                stats[name][0] += 1
                d = find_divergence(target, prompt, ar, out)
                if d is not None:
                    stats[name][1] += 1
                    lines.append(f"  {family} {name} prompt {prompt}: {d.describe()}")
                    assert d.top2_margin >= 0 and d.reference_token == ar[d.position]
        for name, (runs, div) in stats.items():
            lines.append(f"{family} float32 {name}: {div}/{runs} outputs diverge from AR")
    print("\n" + "\n".join(lines))


def test_find_divergence_reports_position_and_margin():
    target = tiny_target("llama", layers=2)
    prompt = [4, 5, 6]
    ar = generate(target, None, prompt, max_new_tokens=6, method="ar").tokens
    assert find_divergence(target, prompt, ar, ar) is None
    changed = ar[:3] + [(ar[3] + 1) % target.vocab_size] + ar[4:]
    d = find_divergence(target, prompt, ar, changed)
    assert d is not None and d.position == 3 and d.token == changed[3] and d.top2_margin > 0


def test_divergence_margin_from_the_engine_forward_equals_the_transformers_one_in_float64():
    """benchmarks/decode_speed.py reads the margin from the fast engine's own forward (`engine_next_logits`):
    the same function, the same margin as the transformers forward where both are exact (float64)."""
    from flashdraft.decode.divergence import engine_next_logits
    from flashdraft.decode.engine import FastEngine

    target = tiny_target("llama", layers=2, dtype=torch.float64)
    prompt = [4, 5, 6]
    ar = generate(target, None, prompt, max_new_tokens=6, method="ar").tokens
    changed = ar[:2] + [(ar[2] + 1) % target.vocab_size] + ar[3:]
    engine = FastEngine(target, None, max_len=32, max_budget=8, cuda_graphs=False)
    a = find_divergence(target, prompt, ar, changed)
    b = find_divergence(target, prompt, ar, changed, next_logits=engine_next_logits(engine))
    assert (
        a is not None and b is not None and (a.position, a.token) == (b.position, b.token) == (2, changed[2])
    )
    assert b.top2_margin == pytest.approx(a.top2_margin, rel=1e-9)


def test_decode_speed_agreement_uses_the_module_and_survives_an_early_stop():
    """benchmarks/decode_speed.py's agreement table: first divergence and margin from `find_divergence` with the
    engine's forward; an output that stops early where AR goes on diverges where it ends (no margin)."""
    import importlib.util
    from pathlib import Path

    from flashdraft.decode.engine import FastEngine

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_speed.py"
    spec = importlib.util.spec_from_file_location("decode_speed", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    target = tiny_target("llama", layers=2, dtype=torch.float64)
    prompt = [4, 5, 6]
    ar = generate(target, None, prompt, max_new_tokens=6, method="ar").tokens
    changed = ar[:2] + [(ar[2] + 1) % target.vocab_size] + ar[3:]
    engine = FastEngine(target, None, max_len=32, max_budget=8, cuda_graphs=False)
    got = bench.agreement(engine, [prompt, prompt, prompt], [ar, ar, ar], [ar, changed, ar[:4]])
    want = find_divergence(target, prompt, ar, changed)
    assert want is not None and got["identical_sequences"] == 1 and got["first_divergence"] == [2, 4]
    assert got["top2_margin_at_divergence"][0] == pytest.approx(want.top2_margin, rel=1e-9)
    assert got["top2_margin_at_divergence"][1] is None
