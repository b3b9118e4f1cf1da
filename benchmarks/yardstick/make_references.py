"""The frozen yardstick: exact single-sequence greedy AR references, written once and committed.

    python benchmarks/yardstick/make_references.py --dataset humaneval --out benchmarks/yardstick/humaneval-164.jsonl
    python benchmarks/yardstick/make_references.py --dataset sharegpt-heldout --limit 100 \
        --out benchmarks/yardstick/sharegpt-heldout-100.jsonl
    flashdraft eval --drafter models/... --references benchmarks/yardstick/humaneval-164.jsonl

The default target (SmolLM2-135M-Instruct GGUF) in float32 on the CPU, 256 new tokens, one prompt at a
time through the reference decoder (`compute_references(batch_size=1)`, source "local"). Every reference
goes to the reference cache as it is made, so a killed run resumes where it stopped; `--partial` writes
the file from the references present so far without computing more (its lines say nothing of the rest:
the file name's count is what it holds).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from flashdraft.eval.prompts import load_eval_prompts
from flashdraft.eval.references import (
    ReferenceSettings,
    _path,
    _read,
    compute_references,
    default_cache_dir,
    reference_key,
    target_stop_ids,
    write_frozen,
)
from flashdraft.target import load_target, target_fingerprint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", required=True, help="humaneval | sharegpt-heldout (flashdraft eval's names)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cache-dir", type=Path, default=None, help="reference cache (default: flashdraft's)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: exact and polite on a shared CPU)"
    )
    ap.add_argument("--partial", action="store_true", help="write what the cache holds; compute nothing")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target("default", dtype=torch.float32, device="cpu")
    prompts = load_eval_prompts(args.dataset, target, args.limit)
    settings = ReferenceSettings(max_new_tokens=args.max_new_tokens)
    if args.partial:
        cache = args.cache_dir or default_cache_dir()
        fp, stop = target_fingerprint(target), target_stop_ids(target)
        refs = []
        for p in prompts:
            ref = _read(_path(cache, reference_key(fp, p, settings, stop, "local")))
            if ref is None:
                break  # the file holds a prefix of the prompt set, in order
            refs.append(ref)
    else:
        refs = compute_references(
            target, prompts, settings, cache_dir=args.cache_dir, batch_size=1, fast_engine=False
        ).references
    out = write_frozen(args.out, refs, target, settings, overwrite=args.overwrite)
    print(f"{out}: {len(refs)} of {len(prompts)} references, {sum(len(r.tokens) for r in refs)} tokens")


if __name__ == "__main__":
    main()
