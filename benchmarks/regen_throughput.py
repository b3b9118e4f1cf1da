"""Regeneration throughput (generated tokens/s): flashdraft's regenerator against transformers' plain generate.

On a CUDA GPU (the H200 figure: benchmarks/RESULTS.md, "Regeneration"):

    python benchmarks/regen_throughput.py --device cuda --dtype bfloat16 --n 4096 --batch-size 2048 \
        --max-new-tokens 256 --out benchmarks/results/regen_throughput.json

A CPU check with a handful of prompts:

    python benchmarks/regen_throughput.py --device cpu --n 8 --batch-size 4 --max-new-tokens 16

Same N ShareGPT prompts (the first user turn of the first N usable conversations, rendered with the
target's chat template, prompts longer than --max-prompt-tokens skipped), greedy, same batch size,
all in one run (after a small warm-up batch per method):
- `flashdraft-native`: the regenerator's default GPU engine: continuous batching over a static KV cache
  on the target's own layers (`--batch-size` rows decode together, finished rows are refilled);
  (`flashdraft-native-sdpa` / `flashdraft-native-varlen`: its decode step's attention pinned, `--attention`;
  the plain name takes `auto`, varlen where its probe passes);
- `flashdraft-loop`: the regenerator's batched loop over TargetModel (length-sorted batches, left
  padding, one host sync every 8 steps);
- `transformers-generate`: plain `model.generate` (default dynamic cache) on the same prompts in
  the given order, same batch size, left padded, stopping at the same stop ids.
Generated tokens are counted up to and including the stop token. Prints a table and writes JSON
(per-method tokens, seconds, tokens/s, peak GPU memory, and token agreement with plain generate; where a method's
outputs differ from generate's, the target's float32 top-2 logit margin at the first difference, `--margins` of
them: whether they differ at near-ties only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.data.generate import GenerationParams, LocalGenerator, cut_at_stop  # noqa: E402
from flashdraft.data.sources import load_conversations  # noqa: E402
from flashdraft.data.template import ChatTemplate, stop_token_ids  # noqa: E402
from flashdraft.decode.divergence import find_divergence  # noqa: E402
from flashdraft.target import load_target  # noqa: E402

# the native engine with its decode attention pinned
NATIVE_ATTENTION = ("flashdraft-native-sdpa", "flashdraft-native-varlen")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def divergence_margins(
    target: Any, prompts: list[list[int]], outs: list[list[int]], ref: list[list[int]], limit: int
) -> dict[str, Any]:
    """Where `outs` first departs from `ref` (generate's), the top-2 logit margin of `target` (float32, teacher-forced
    on the prompt and the shared prefix) there, for at most `limit` of the differing outputs: near-ties (small
    margins) are rounding, a large margin would be a bug. Outputs where one is a prefix of the other (a stop) do not
    differ here."""
    margins = []
    for p, a, b in zip(prompts, outs, ref, strict=True):
        if len(margins) == limit:
            break
        d = find_divergence(target, p, b, a)
        if d is not None:
            margins.append(d.top2_margin)
    m = sorted(margins)
    q = lambda f: round(m[min(len(m) - 1, int(f * len(m)))], 4) if m else None  # noqa: E731
    return {"checked": len(m), "median": q(0.5), "p90": q(0.9), "max": q(1.0),
            "under_0.25": sum(x < 0.25 for x in m), "under_1": sum(x < 1.0 for x in m)}  # fmt: skip


def plain_generate(
    target: Any, prompts: list[list[int]], params: GenerationParams, batch_size: int
) -> list[list[int]]:
    """transformers' generate as a user would call it: batches in the given order, left padding."""
    out = []
    dev = target.device
    for k in range(0, len(prompts), batch_size):
        chunk = prompts[k : k + batch_size]
        P = max(len(p) for p in chunk)
        ids = torch.zeros((len(chunk), P), dtype=torch.long, device=dev)  # [b, P] left padded
        attn = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, P - len(p) :] = torch.tensor(p, device=dev)
            attn[i, P - len(p) :] = 1
        with torch.inference_mode():
            res = target.model.generate(
                input_ids=ids, attention_mask=attn, max_new_tokens=params.max_new_tokens, do_sample=False,
                eos_token_id=params.stop_ids, pad_token_id=0,
            )  # fmt: skip
        out += [cut_at_stop(r, params.stop_ids).ids for r in res[:, P:].tolist()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--n", type=int, default=4096, help="number of ShareGPT prompts")
    ap.add_argument(
        "--input", default="sharegpt", help="prompt source (flashdraft.data.sources name or path)"
    )
    ap.add_argument("--batch-size", type=int, default=2048)
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--methods", default="flashdraft-native,transformers-generate")
    ap.add_argument("--margins", type=int, default=128,
                    help="per method, the float32 target's top-2 margin where this many outputs first differ from "
                    "generate's (0: none)")  # fmt: skip
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()

    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    t0 = time.perf_counter()
    target = load_target(args.target, dtype=dtype, device=args.device)
    load_s = time.perf_counter() - t0
    tpl = ChatTemplate(target.tokenizer)
    stops = stop_token_ids(target.tokenizer, getattr(target.model, "generation_config", None))
    params = GenerationParams(max_new_tokens=args.max_new_tokens, stop_ids=stops)

    prompts: list[list[int]] = []
    for conv in load_conversations(args.input, limit=4 * args.n + 100):
        ids = tpl.prompt_ids(conv.system, [], conv.user_turns[0])
        if len(ids) <= args.max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == args.n:
            break
    dev = target.device
    warm = prompts[: min(8, len(prompts))]
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for method in args.methods.split(","):
        if method in ("flashdraft-native", "flashdraft-loop", *NATIVE_ATTENTION):
            engine, _, attention = method.removeprefix("flashdraft-").partition("-")
            gen = LocalGenerator(target, params, engine=engine, batch_size=args.batch_size,
                                 max_batch_tokens=args.max_batch_tokens, attention=attention or "auto")  # fmt: skip
            run = lambda ps, g=gen: [x.ids for x in g.generate(ps, seed=0)]  # noqa: E731
        elif method == "transformers-generate":
            run = lambda ps: plain_generate(target, ps, params, args.batch_size)  # noqa: E731
        else:
            raise SystemExit(f"unknown method {method!r}")
        run(warm)  # warm-up: kernels, allocator, static-cache compile paths
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        _sync(dev)
        t = time.perf_counter()
        outs = run(prompts)
        _sync(dev)
        dt = time.perf_counter() - t
        toks = sum(len(o) for o in outs)
        outputs[method] = outs
        results[method] = {
            "generated_tokens": toks, "seconds": round(dt, 3), "tokens_per_s": round(toks / dt, 1),
            "stopped": sum(1 for o in outs if o and o[-1] in stops),
            "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None,
        }  # fmt: skip
        # print as each method finishes, so a run cut short by a time limit still reports
        print(f"{method}: {toks:,} tokens in {dt:.2f} s = {toks / dt:,.0f} tok/s", flush=True)
    ref = outputs.get("transformers-generate")
    if ref is not None:
        for m, outs in outputs.items():
            results[m]["identical_to_generate"] = sum(a == b for a, b in zip(outs, ref, strict=True))
            # bf16 near-ties make long greedy continuations drift apart; the shared prefix says how far they agree
            prefix = [next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                      for a, b in zip(outs, ref, strict=True)]  # fmt: skip
            results[m]["tokens_before_first_divergence_frac"] = round(
                sum(prefix) / max(1, sum(len(b) for b in ref)), 4
            )
        differ = [
            m
            for m in outputs
            if m != "transformers-generate" and results[m]["identical_to_generate"] < len(ref)
        ]
        if args.margins and differ:
            exact = load_target(args.target, dtype="float32", device=args.device)  # the same weights, float32
            for m in differ:
                results[m]["first_divergence_margins"] = divergence_margins(
                    exact, prompts, outputs[m], ref, args.margins
                )
                print(f"{m}: float32 top-2 margin where outputs first differ from generate's: "
                      f"{results[m]['first_divergence_margins']}", flush=True)  # fmt: skip

    meta = {
        "target": target.name, "device": str(dev), "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "dtype": dtype, "n_prompts": len(prompts), "prompt_tokens": sum(len(p) for p in prompts),
        "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "python": platform.python_version(), "load_s": round(load_s, 1), "command": " ".join(["python", *sys.argv]),
    }  # fmt: skip
    print(f"{meta['n_prompts']} ShareGPT prompts ({meta['prompt_tokens']:,} prompt tokens), batch {args.batch_size}, "
          f"max_new_tokens {args.max_new_tokens}, {dtype} on {meta['gpu'] or dev}")  # fmt: skip
    print(f"{'method':24s} {'tokens':>10s} {'seconds':>9s} {'tok/s':>10s} {'same as generate':>17s}")
    for m, r in results.items():
        same = f"{r.get('identical_to_generate', '-')}/{len(prompts)}" if ref is not None else "-"
        print(
            f"{m:24s} {r['generated_tokens']:>10,} {r['seconds']:>9.2f} {r['tokens_per_s']:>10,.0f} {same:>17s}"
        )
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
        os.replace(tmp, path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
