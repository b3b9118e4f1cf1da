"""Batched references against exact ones: the tokens, prompt by prompt, and the τ a drafter gets on each.

    python benchmarks/yardstick/compare_references.py --frozen benchmarks/yardstick/humaneval-164.jsonl \
        --cache REFCACHE --reports COMPUTED/report.json FROZEN/report.json [--json OUT.json]

`--cache`: a reference cache folder (`flashdraft eval --cache-dir`), e.g. the batched native engine's references
on a GPU; each of its references is matched to the frozen file's by prompt id and prompt tokens, and compared token
by token (equal, or the first position where they part). `--reports`: two `flashdraft eval` report.json files of the
same drafter, one scored on each reference set: every method's τ paired per prompt (how many prompts differ, the
largest difference, the mean). `benchmarks/gpu/call9_goals.sh eval` makes all three on a GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from flashdraft.eval.frozen import read_frozen_records
from flashdraft.eval.references import Reference, _read


def read_cache(folder: Path) -> list[Reference]:
    """Every reference in a reference cache folder (`flashdraft eval --cache-dir`), read as the eval reads them."""
    refs = [r for p in sorted(folder.glob("*/*.json")) if (r := _read(p)) is not None]
    if not refs:
        raise SystemExit(f"{folder}: no cached references (<key[:2]>/<key>.json files)")
    return refs


def compare_tokens(frozen: list[dict[str, Any]], cached: list[Reference]) -> dict[str, Any]:
    by_id: dict[tuple[str, tuple[int, ...]], Reference] = {}
    for r in cached:
        if r.temperature != 0:
            continue  # sampled references are not the greedy ones a frozen file holds
        key = (r.id, tuple(r.prompt_ids))
        if key in by_id and by_id[key].tokens != r.tokens:
            raise SystemExit(
                f"the cache holds two greedy references of prompt {r.id} (other settings?): "
                "point --cache at one run's cache folder"
            )
        by_id[key] = r
    equal, parted, missing = 0, [], []
    for f in frozen:
        c = by_id.get((f["id"], tuple(f["prompt_ids"])))
        if c is None:
            missing.append(f["id"])
            continue
        a, b = f["tokens"], c.tokens
        if a == b:
            equal += 1
            continue
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        parted.append(
            {"id": f["id"], "first_difference": first, "exact_tokens": len(a), "batched_tokens": len(b)}
        )
    return {"prompts": len(frozen), "equal": equal, "parted": parted, "missing": missing,
            "tokens_exact": sum(len(f["tokens"]) for f in frozen),
            "tokens_batched": sum(len(c.tokens) for c in cached)}  # fmt: skip


def per_sample(report: Path) -> tuple[str, dict[str, dict[str, float]]]:
    rep = json.loads(report.read_text())
    if len(rep["drafters"]) != 1:
        raise SystemExit(f"{report}: {len(rep['drafters'])} drafters; compare reports of one drafter")
    ((name, d),) = rep["drafters"].items()
    return name, {s["id"]: s["tau"] for s in d["per_sample"]}


def compare_tau(a: Path, b: Path) -> dict[str, dict[str, float]]:
    """Per method: prompts whose τ differs, the largest |Δ|, the mean Δ (b − a), over the prompts in both."""
    (_, ta), (_, tb) = per_sample(a), per_sample(b)
    ids = [i for i in ta if i in tb]
    out = {}
    for m in ta[ids[0]]:
        deltas = [tb[i][m] - ta[i][m] for i in ids]
        out[m] = {"prompts": len(ids), "differ": sum(abs(d) > 1e-12 for d in deltas),
                  "max_abs": max(map(abs, deltas)), "mean": sum(deltas) / len(deltas)}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--frozen", type=Path, required=True, help="exact references (a make_references.py file)")
    ap.add_argument("--cache", type=Path, help="a reference cache folder to compare token by token")
    ap.add_argument(
        "--reports", type=Path, nargs=2, metavar=("A", "B"), help="report.json of one drafter, twice"
    )
    ap.add_argument("--json", type=Path, help="write the comparison here")
    args = ap.parse_args()
    result: dict[str, Any] = {}
    _, frozen = read_frozen_records(args.frozen)
    if args.cache:
        t = result["tokens"] = compare_tokens(frozen, read_cache(args.cache))
        print(f"references: {t['equal']} of {t['prompts']} prompts token-identical "
              f"({t['tokens_exact']:,} exact tokens, {t['tokens_batched']:,} batched); "
              f"{len(t['parted'])} part, {len(t['missing'])} missing")  # fmt: skip
        for p in t["parted"]:
            print(f"  {p['id']}: first difference at token {p['first_difference']}")
    if args.reports:
        tau = result["tau"] = compare_tau(*args.reports)
        print("| method | prompts | τ differs on | max |Δτ| | mean Δτ |\n|---|---:|---:|---:|---:|")
        for m, r in tau.items():
            print(f"| {m} | {r['prompts']} | {r['differ']} | {r['max_abs']:.2e} | {r['mean']:+.2e} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
