"""benchmarks/source_overlap.py: distinct prompts over sources in order, and their overlap with an eval set."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("source_overlap", REPO / "benchmarks" / "source_overlap.py")
so = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["source_overlap"] = so
_spec.loader.exec_module(so)  # type: ignore[union-attr]


def test_distinct_prompts_are_counted_once_and_eval_overlaps_found(tmp_path: Path) -> None:
    words = " ".join(f"w{i}" for i in range(20))  # 20 words: 13-grams to share
    (tmp_path / "eval.txt").write_text(f"an eval prompt {words}\n")
    (tmp_path / "a.txt").write_text(f"first\nsecond copies {words} here\nthird\n")
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in ("first", "fourth")) + "\n")
    table = so.overlap_table([f"prompts:{tmp_path / 'a.txt'}", f"prompts:{tmp_path / 'b.jsonl'}"],
                             [f"prompts:{tmp_path / 'eval.txt'}"], 13)  # fmt: skip
    rows = [[c.strip() for c in r.strip("|").split("|")] for r in table.splitlines()[2:]]
    assert [r[1:] for r in rows[:2]] == [["3", "3", "1"], ["2", "1", "0"]]  # "first" repeats: counted once
    assert rows[2][2] == "4"
