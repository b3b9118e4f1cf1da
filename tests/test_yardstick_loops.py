"""benchmarks/yardstick_loops.py: per-prompt τ split by how much of the reference loops."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("yardstick_loops", REPO / "benchmarks" / "yardstick_loops.py")
yl = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["yardstick_loops"] = yl
_spec.loader.exec_module(yl)  # type: ignore[union-attr]


def test_loop_share_counts_tokens_that_repeat_an_earlier_8_gram() -> None:
    assert yl.loop_share(list(range(20))) == 0.0
    loop = list(range(8)) * 3  # 24 tokens; the 8-grams starting at 8..16 repeat those at 0..8: tokens 15..23
    assert yl.loop_share(loop) == 9 / 24


def test_split_table_means_and_paired_differences() -> None:
    def drafter(taus: dict[str, float]) -> dict:
        return {"per_sample": [{"id": i, "tau": {"chain": t}} for i, t in taus.items()]}

    report = {"methods": ["chain"], "drafters": {"base": drafter({"a": 5.0, "b": 2.0, "c": 3.0, "d": 6.0}),
                                                 "new": drafter({"a": 4.0, "b": 2.5, "c": 3.5, "d": 4.0})}}  # fmt: skip
    table = yl.split_table(report, {"a": 0.6, "b": 0.1, "c": 0.0, "d": 0.9}, "chain", 0.3)
    assert "(2 prompts), other (2)" in table
    assert "| base | 5.50 | 2.50 | — | — |" in table
    # looping Δ -1, -2: mean -1.50, sd 0.71, SE 0.50, -27% of 5.50; other +0.5, +0.5: SE 0
    assert "| new | 4.00 | 3.00 | -1.50 ± 0.50 (-27%) | +0.50 ± 0.00 (+20%) |" in table
    with pytest.raises(ValueError, match="method 'ddtree-8' is not in the report"):
        yl.split_table(report, {"a": 0.6, "b": 0.1, "c": 0.0, "d": 0.9}, "ddtree-8", 0.3)
    with pytest.raises(ValueError, match="1 of the report's prompts are not in the yardstick file"):
        yl.split_table(report, {"a": 0.6, "b": 0.1, "c": 0.0}, "chain", 0.3)
