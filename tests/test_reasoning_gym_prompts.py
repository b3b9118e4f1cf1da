"""benchmarks/reasoning_gym_prompts.py without the network or reasoning-gym: the curated list and the writer."""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import reasoning_gym_prompts as rgp  # noqa: E402


def test_the_curated_tasks_leave_out_benchmark_and_dataset_generators() -> None:
    assert len(rgp.TASKS) >= 50 and all(reason.strip() for reason in rgp.TASKS.values())
    for name in rgp.TASKS:
        assert not any(bad in name for bad in ("arc", "gsm", "codeio", "acre", "rush_hour", "composite")), (
            name
        )
    assert not set(rgp.TASKS) & set(rgp.EXCLUDED)
    for name in ("arc_1d", "arc_agi", "rearc", "gsm_symbolic", "codeio", "knights_knaves", "spell_backward"):
        assert name in rgp.EXCLUDED
    assert rgp.PINNED[0] == f"reasoning-gym=={rgp.VERSION}" and all("==" in p for p in rgp.PINNED)


def test_the_writer_makes_the_documented_jsonl(tmp_path: Path) -> None:
    fake = [("sum", " What is 1 + 2? "), ("sum", "What is 1 + 2?"), ("sum", "  "), ("sort", "What is 1 + 2?"),
            ("sort", "Sort 3, 1, 2.")]  # fmt: skip
    records, kept = rgp.build_records(fake)
    assert kept == {"sum": 1, "sort": 1}
    out = tmp_path / "p.jsonl.gz"
    rgp.write_prompts(out, records)
    lines = [json.loads(x) for x in gzip.decompress(out.read_bytes()).decode().splitlines()]
    assert [r["prompt"] for r in lines] == ["What is 1 + 2?", "Sort 3, 1, 2."]
    for r, task in zip(lines, ("sum", "sort"), strict=True):
        assert set(r) == {"id", "prompt", "group"} and r["group"] == task
        assert r["id"] == f"rg-{task}-{hashlib.sha256(r['prompt'].encode()).hexdigest()[:16]}"
    first = out.read_bytes()
    with pytest.raises(FileExistsError):
        rgp.write_prompts(out, records)
    rgp.write_prompts(out, records, overwrite=True)
    assert out.read_bytes() == first  # gzip's mtime is 0: the same records give the same bytes
    assert [p.name for p in tmp_path.iterdir()] == ["p.jsonl.gz"]  # no temporary left behind


def test_main_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "p.jsonl.gz"
    out.write_bytes(b"x")
    with pytest.raises(SystemExit, match="--overwrite"):
        rgp.main(["--out", str(out)])
