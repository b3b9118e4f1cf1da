"""Eval references on the CPU: the reference decoder vs AR on the fast engine (`compute_references(fast_engine=)`).

    python benchmarks/reference_speed.py [--prompts 4] [--max-new-tokens 96]

Times greedy references for the first HumanEval prompts (published wording, float32 default target), each
producer twice alternately with an empty cache, and checks that both give the same tokens. This is why
`compute_references` uses the fast engine only where the target is on CUDA.
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
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    target = load_target("default", dtype=torch.float32, device="cpu")
    prompts = load_eval_prompts("humaneval", target, limit=args.prompts)
    settings = ReferenceSettings(max_new_tokens=args.max_new_tokens)
    tokens: dict[bool, list[list[int]]] = {}
    for fast in (False, True, False, True):
        t0 = time.perf_counter()
        refs = compute_references(
            target, prompts, settings, cache_dir=tempfile.mkdtemp(), progress=False, fast_engine=fast
        )
        dt = time.perf_counter() - t0
        n = sum(len(r.tokens) for r in refs.references)
        print(
            f"{'fast engine' if fast else 'reference decoder'}: {dt:.1f} s for {n} tokens ({n / dt:.1f} tok/s)"
        )
        tokens[fast] = [r.tokens for r in refs.references]
    print("same tokens:", tokens[False] == tokens[True])


if __name__ == "__main__":
    main()
