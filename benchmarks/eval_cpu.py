"""Time to evaluate HumanEval (164 prompts, 256-token cached references) for one drafter on CPU:
chain + 7 DDTree budgets + the top-8 streak, with the default SmolLM2-135M-Instruct target.

    python benchmarks/eval_cpu.py                          # random 5-layer drafter (worst case: τ ≈ 1)
    python benchmarks/eval_cpu.py --drafter runs/x         # a trained one (newest checkpoint of a run)
    python benchmarks/eval_cpu.py --refs-only              # only build the reference cache (one-off)

The reference continuations are built first (once, cached) and timed separately; the figure
that matters is the `evaluate` time with references cached. Results go to
benchmarks/results/eval_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--drafter", default=None, help="drafter/checkpoint/run folder; default a random 5-layer drafter"
    )
    ap.add_argument("--limit", type=int, default=164)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--budgets", default="8,16,32,64,128,256,512")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument(
        "--ref-batch", type=int, default=16, help="prompts per batched greedy reference generation"
    )
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--refs-only", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/eval_cpu.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from flashdraft.drafter import DFlashDrafter
    from flashdraft.eval.evaluate import evaluate
    from flashdraft.eval.prompts import load_eval_prompts
    from flashdraft.eval.references import ReferenceSettings, compute_references
    from flashdraft.eval.watch import resolve_drafter
    from flashdraft.target import drafter_config_for, load_target

    t0 = time.perf_counter()
    target = load_target("default")
    load_s = time.perf_counter() - t0
    prompts = load_eval_prompts("humaneval", target, args.limit)
    settings = ReferenceSettings(max_new_tokens=args.max_new_tokens)
    refs = compute_references(target, prompts, settings, cache_dir=args.cache_dir, batch_size=args.ref_batch)
    print(f"references: {refs.computed} computed, {refs.cached} cached in {refs.seconds:.1f}s")
    if args.refs_only:
        return
    if args.drafter:
        folder, _ = resolve_drafter(args.drafter)
        drafter, name = DFlashDrafter.from_pretrained(folder), str(folder)
    else:
        torch.manual_seed(0)
        drafter = DFlashDrafter(drafter_config_for(target, num_layers=5, block_size=16))
        drafter.reset_parameters(0.02)
        drafter, name = drafter.eval(), "random 5-layer b16 (untrained)"
    budgets = [int(b) for b in args.budgets.split(",")]
    load_before = os.getloadavg()
    t1 = time.perf_counter()
    report = evaluate(target, {"d": drafter}, prompts, budgets=budgets, topk=args.topk,
                      max_new_tokens=args.max_new_tokens, references=refs.references, dataset="humaneval")  # fmt: skip
    eval_s = time.perf_counter() - t1
    d = report.drafters["d"]
    result = {
        "what": "flashdraft evaluate(): HumanEval offline tau, chain + DDTree budgets + top-k streak, references cached",
        "drafter": name, "prompts": len(prompts), "reference_tokens": report.references.tokens,
        "max_new_tokens": args.max_new_tokens, "budgets": budgets, "topk": args.topk,
        "eval_seconds": round(eval_s, 1), "teacher_forced_seconds": round(report.teacher_forced_seconds, 1),
        "drafter_replay_seconds": round(d.seconds, 1), "drafter_forwards": d.drafter_forwards,
        "drafter_blocks": d.drafter_blocks, "reference_seconds": round(refs.seconds, 1),
        "references_computed": refs.computed, "target_load_seconds": round(load_s, 1),
        "tau": {m: round(s.tau, 3) for m, s in d.methods.items()},
        "agreement_rate": report.references.agreement_rate, "divergences": len(report.references.divergences),
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "load_avg_before": [round(x, 2) for x in load_before], "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
