"""One LR schedule split over chained runs against runs that each warm up and decay again, on the CPU
quickstart's data and features.

    python benchmarks/schedule_parts.py --work QS --steps 1400 --runs RUNS --out benchmarks/results/cpu-DATE-schedule-parts

QS: a `flashdraft quickstart --work QS` folder (its data/ and features/). Three drafters of the quickstart's `cpu`
sizes (EMA off, no time limit), each trained for 2 × --steps optimizer steps in all:

- `whole`: one run of 2N steps, one warmup and one cosine;
- `rewarm`: N steps, then N more from those weights with a schedule of their own, warmup and cosine again (how the
  campaign's stints have trained, each from the last one's weights);
- `parts`: the same two runs as the two halves of one 2N-step schedule (`optim.schedule_steps`, the second from
  `optim.schedule_start=N`, ramping up over its first 4% with fresh optimizer moments).

The second runs of `rewarm` and `parts` use another seed than the first (other batches, as a later stint reads
other data). Then one `flashdraft eval` of the three side by side (the first named is the paired baseline) on the
quickstart's held-out prompts, into --out. Each training run's folder goes under RUNS (not the repository).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from flashdraft.quickstart import CONFIG, SIZES, train_overrides


def train(steps: int, run: Path, qs: Path, extra: list[str]) -> float:
    """`flashdraft train` of the quickstart's cpu sizes for `steps` steps; returns its wall seconds."""
    sizes = dataclasses.replace(SIZES["cpu"], steps=steps, train_minutes=None, ema_decay=0.0)
    args = [sys.executable, "-m", "flashdraft.cli", "train", str(CONFIG),
            *train_overrides(sizes, run, qs / "data", qs / "features", "cpu"), *extra]  # fmt: skip
    t = time.perf_counter()
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def drafter_of(run: Path) -> str:
    return str(sorted((run / "checkpoints").glob("step-*"))[-1] / "drafter")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="a flashdraft quickstart --work folder")
    ap.add_argument("--steps", type=int, default=1400, help="N: each half's optimizer steps")
    ap.add_argument("--runs", type=Path, required=True, help="where the training runs go")
    ap.add_argument("--eval-prompts", type=int, default=100)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    n, runs = a.steps, a.runs
    if runs.exists():
        raise SystemExit(f"--runs {runs}: exists (a fresh folder keeps runs from resuming each other)")
    seconds = {"whole": train(2 * n, runs / "whole", a.work, [])}
    first = runs / "first-half"  # the first half of rewarm (its own schedule of N steps)
    seconds["rewarm"] = train(n, first, a.work, [])
    again = ["model.init_from_target=none", "runtime.seed=1"]
    seconds["rewarm"] += train(n, runs / "rewarm", a.work, [*again, f"model.init_from={drafter_of(first)}"])
    part1 = runs / "parts-1"
    seconds["parts"] = train(n, part1, a.work, [f"optim.schedule_steps={2 * n}"])
    seconds["parts"] += train(n, runs / "parts", a.work, [*again, f"model.init_from={drafter_of(part1)}",
                                                          f"optim.schedule_steps={2 * n}", f"optim.schedule_start={n}"])  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    drafters = [x for name in ("whole", "rewarm", "parts") for x in ("--drafter", drafter_of(runs / name))]
    sizes = SIZES["cpu"]
    subprocess.run([sys.executable, "-m", "flashdraft.cli", "eval", "--target", "default", *drafters,
                    "--dataset", str(a.work / "data"), "--limit", str(a.eval_prompts),
                    "--max-new-tokens", str(sizes.eval_tokens), "--budgets", sizes.budgets, "--device", "cpu",
                    "--no-progress", "--out", str(a.out)], check=True)  # fmt: skip
    record = {"steps_per_half": n, "seconds": seconds}
    (a.out / "train_seconds.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
