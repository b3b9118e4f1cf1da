"""Greedy eval references three ways in one run: exact single-sequence AR, the batched loop, the batched
native engine — seconds and whether the tokens agree.

    OMP_NUM_THREADS=1 python benchmarks/yardstick/reference_engines.py --prompts 12 --max-new-tokens 96

The first HumanEval prompts (published wording), the default target in float32, each producer with an
empty cache. Batched references are not exact AR (a batch sums in another order), so the count of
tokens that differ before the first disagreement is printed too; `flashdraft eval` cuts them there.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from flashdraft.eval.prompts import load_eval_prompts
from flashdraft.eval.references import ReferenceSettings, compute_references
from flashdraft.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    target = load_target("default", dtype=torch.float32, device=args.device)
    prompts = load_eval_prompts("humaneval", target, limit=args.prompts)
    settings = ReferenceSettings(max_new_tokens=args.max_new_tokens)
    runs = {"single (exact AR)": dict(batch_size=1), "batched loop": dict(batch_size=args.batch, batch_engine="loop"),
            "batched native": dict(batch_size=args.batch, batch_engine="native")}  # fmt: skip
    tokens: dict[str, list[list[int]]] = {}
    for name, kw in runs.items():
        t0 = time.perf_counter()
        refs = compute_references(
            target, prompts, settings, cache_dir=tempfile.mkdtemp(), progress=False, **kw
        )
        dt = time.perf_counter() - t0
        tokens[name] = [r.tokens for r in refs.references]
        n = sum(len(t) for t in tokens[name])
        print(f"{name}: {dt:.1f} s for {n} tokens ({n / dt:.1f} tok/s)", flush=True)
    exact = tokens["single (exact AR)"]
    for name in list(runs)[1:]:
        same = sum(a == b for a, b in zip(exact, tokens[name], strict=True))
        print(f"{name}: {same}/{len(exact)} prompts identical to exact AR")


if __name__ == "__main__":
    main()
