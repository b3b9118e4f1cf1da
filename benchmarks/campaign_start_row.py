"""The learning curve's starting point: the drafter the campaign began from, as stint 0 of
benchmarks/results/campaign/stints.jsonl.

    python benchmarks/campaign_start_row.py --stints benchmarks/results/campaign/stints.jsonl \
        --train-minutes 5.3 5.8 8.1 7.0 5.0 5.0 --card "NVIDIA H200" --date 2026-12-03 \
        --manifest benchmarks/results/shipped-drafter-history/1-2026-12-02/manifest.json ...

Its training minutes are the schedules' (the model card lists them); its regenerated loss tokens are the sum over the
manifests of the datasets the target regenerated for it (each dataset once: pass every regeneration's manifest, not
a merge's); its yardstick τ is the "shipped" side of the first stint whose paired yardstick eval (by
benchmarks/campaign_ingest.py) ran beside it. The row replaces an earlier stint-0 row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts beside this one
import campaign_ingest as ci  # noqa: E402  (benchmarks/campaign_ingest.py: its stints.jsonl reader and upsert)


def start_row(
    rows: list[dict[str, Any]], minutes: list[float], manifests: list[Path], card: str, date: str
) -> dict[str, Any]:
    tokens = sum(int(json.loads(m.read_text())["tokens"]["train"]["loss"]) for m in manifests)
    samples = sum(int(json.loads(m.read_text())["counts"]["train"]) for m in manifests)
    yard: dict[str, Any] = {}
    for r in sorted((r for r in rows if r["stint"] > 0), key=lambda r: r["stint"]):
        for stem, v in (r.get("yardstick") or {}).items():
            yard.setdefault(stem, {"new": v["shipped"], "measured_in_stint": r["stint"]})
    return {
        "stint": 0, "date": date, "card": card, "train_minutes": round(sum(minutes), 3),
        "train_schedules_minutes": minutes, "new": {"samples": samples, "loss_tokens": tokens},
        "manifests": [str(m) for m in manifests], "yardstick": yard,
        "note": "the drafter the campaign started from (models/smollm2-135m-instruct-dflash-b16 as of 2026-12-03)",
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stints", type=Path, required=True)
    ap.add_argument("--train-minutes", type=float, nargs="+", required=True)
    ap.add_argument("--manifest", type=Path, action="append", required=True)
    ap.add_argument("--card", required=True)
    ap.add_argument("--date", required=True)
    a = ap.parse_args(argv)
    row = start_row(ci.read_lines(a.stints), a.train_minutes, a.manifest, a.card, a.date)
    ci.upsert(a.stints, row)  # replaces an earlier stint-0 line; lines in stint order
    print(f"{a.stints}: stint 0 = {row['train_minutes']} min, {row['new']['loss_tokens']:,} loss tokens, "
          f"yardstick {sorted(row['yardstick'])}")  # fmt: skip


if __name__ == "__main__":
    main()
