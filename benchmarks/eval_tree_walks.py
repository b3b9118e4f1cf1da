"""What the DDTree walks of an offline eval cost, popped only as far as each start's largest asking budget (the
replay's way) against popped to the largest budget at every start, in one run: the same eval twice, the frozen
yardstick references, the shipped drafter, float32.

    python benchmarks/eval_tree_walks.py --limit 12                 # the first 12 HumanEval yardstick problems
    python benchmarks/eval_tree_walks.py --references benchmarks/yardstick/sharegpt-heldout-100.jsonl --limit 8
    WALKS=164 NEW=… bash benchmarks/gpu/call7_stint_eval.sh      # on a CUDA host, after a stint's evals

On a GPU the drafter and target passes are cheap and the walks (host Python) are a large part of an eval; on a CPU
the passes dominate, so read the walk seconds, not the totals. Every τ and surrogate must agree between the two.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.drafter import DFlashDrafter  # noqa: E402
from flashdraft.eval import replay  # noqa: E402
from flashdraft.eval.evaluate import evaluate  # noqa: E402
from flashdraft.eval.prompts import EvalPrompt  # noqa: E402
from flashdraft.eval.references import read_frozen  # noqa: E402
from flashdraft.target import load_target  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def timed_eval(target, drafter, frozen, full_depth: bool) -> tuple[dict, float, int, float]:
    """(τ and surrogate per method, walk seconds, walks, eval seconds)."""
    spent, walks = [0.0], [0]
    init, advance = replay.TreeWalk.__init__, replay.TreeWalk.advance

    def timed_init(self, *a):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        init(self, *a)
        spent[0] += time.perf_counter() - t0
        walks[0] += 1

    def timed_advance(self, budget):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        got = advance(self, self.max_budget if full_depth else budget)
        spent[0] += time.perf_counter() - t0
        return got

    replay.TreeWalk.__init__, replay.TreeWalk.advance = timed_init, timed_advance
    try:
        prompts = [EvalPrompt(r.id, r.prompt_ids, r.template) for r in frozen.references]
        t0 = time.perf_counter()
        rep = evaluate(target, {"d": drafter}, prompts, frozen=frozen, progress=False)
        total = time.perf_counter() - t0
    finally:
        replay.TreeWalk.__init__, replay.TreeWalk.advance = init, advance
    taus = {k: (v.tau, v.predicted_tau) for k, v in rep.drafters["d"].methods.items()}
    return taus, spent[0], walks[0], total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="default", help="a target folder (default: the GGUF default target)")
    ap.add_argument("--references", default=str(REPO / "benchmarks/yardstick/humaneval-164.jsonl"))
    ap.add_argument("--drafter", default=str(REPO / "models/smollm2-135m-instruct-dflash-b16"))
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    target = load_target(a.target, dtype=torch.float32, device=a.device)
    drafter = DFlashDrafter.from_pretrained(a.drafter).to(device=a.device, dtype=torch.float32).eval()
    frozen = read_frozen(a.references, a.limit)
    rows = []
    for full in (True, False):
        taus, walk_s, walks, total = timed_eval(target, drafter, frozen, full)
        rows.append((full, taus, walk_s, walks, total))
    assert rows[0][1] == rows[1][1], "the two ways gave different τ"
    print(f"{Path(a.references).name}, {a.limit} prompts, {a.device}; every τ and surrogate equal in both\n")
    print("| walks popped | walks | walk seconds | eval seconds |\n|---|---:|---:|---:|")
    for full, _, walk_s, walks, total in rows:
        print(
            f"| {'to the largest budget' if full else 'to the largest asking budget'} | {walks:,} | {walk_s:.2f} | {total:.1f} |"
        )


if __name__ == "__main__":
    main()
