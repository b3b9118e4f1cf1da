"""How much of a yardstick τ comes from references that loop: an eval report's per-prompt τ split by the share of
the reference's tokens that repeat an earlier 8-gram of the same answer (`flashdraft data inspect`'s measure).

    python benchmarks/yardstick_loops.py benchmarks/results/campaign/stint-2/yardstick/sharegpt-heldout-100/report.json \
        benchmarks/yardstick/sharegpt-heldout-100.jsonl --method chain --threshold 0.3

A greedy answer of a small target often falls into a loop, and a loop is easy to draft: τ on such prompts says
little about the drafter's quality on text that goes somewhere. One row per drafter: mean τ over looping and
other prompts, and (for every drafter after the first) the mean per-prompt Δτ against the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from flashdraft.data.inspect import repeated_tokens
from flashdraft.eval.frozen import read_frozen_records


def loop_share(tokens: list[int]) -> float:
    return float(repeated_tokens(np.asarray(tokens)).mean()) if tokens else 0.0


def split_table(report: dict, shares: dict[str, float], method: str, threshold: float) -> str:
    drafters = report["drafters"]
    taus = {name: {s["id"]: s["tau"].get(method) for s in d["per_sample"]} for name, d in drafters.items()}
    base_name = next(iter(taus))
    base = taus[base_name]
    if None in base.values():
        raise ValueError(
            f"method {method!r} is not in the report (its methods: {', '.join(report['methods'])})"
        )
    if set(base) - set(shares):
        raise ValueError(
            f"{len(set(base) - set(shares))} of the report's prompts are not in the yardstick file"
        )
    looping = sorted(i for i in base if shares[i] >= threshold)
    other = sorted(i for i in base if shares[i] < threshold)
    rows = [
        f"{method} τ by reference: looping = at least {threshold:.0%} of its tokens repeat an earlier 8-gram "
        f"({len(looping)} prompts), other ({len(other)}); Δ: mean per-prompt difference from {base_name} ± its "
        "standard error (and relative to its mean τ)",
        "",
        "| drafter | looping τ | other τ | looping Δ | other Δ |",
        "|---|---:|---:|---:|---:|",
    ]

    def mean(xs: list[float]) -> str:
        return f"{statistics.mean(xs):.2f}" if xs else "—"

    def delta(xs: list[float], base_taus: list[float]) -> str:
        """mean ± standard error, and relative to the base's mean τ"""
        if len(xs) < 2:
            return "—"
        se = statistics.stdev(xs) / len(xs) ** 0.5
        return (
            f"{statistics.mean(xs):+.2f} ± {se:.2f} ({statistics.mean(xs) / statistics.mean(base_taus):+.0%})"
        )

    for name, t in taus.items():
        d_loop = [t[i] - base[i] for i in looping] if name != base_name else []
        d_other = [t[i] - base[i] for i in other] if name != base_name else []
        rows.append(
            f"| {name} | {mean([t[i] for i in looping])} | {mean([t[i] for i in other])} | "
            f"{delta(d_loop, [base[i] for i in looping])} | {delta(d_other, [base[i] for i in other])} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", type=Path, help="an eval report.json made on the yardstick file")
    p.add_argument("yardstick", type=Path, help="the frozen reference file (benchmarks/yardstick/*.jsonl)")
    p.add_argument("--method", default="chain", help="chain, ddtree-N or topk-K")
    p.add_argument("--threshold", type=float, default=0.3, help="repeated-token share that counts as looping")
    a = p.parse_args(argv)
    try:
        report = json.loads(a.report.read_text())
        _, records = read_frozen_records(a.yardstick)
        shares = {r["id"]: loop_share(r["tokens"]) for r in records}
        print(split_table(report, shares, a.method, a.threshold))
    except (OSError, ValueError, KeyError) as e:
        print(f"yardstick_loops: {a.report} / {a.yardstick}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
