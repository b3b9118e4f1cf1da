"""What the fast engine's static cache size costs a round: the same prompts decoded by engines built for a short and
a long `max_len`, each with its rounds attending over the rows they can see (`FastEngine._span`) and over the whole
cache (as the engine did before 2026-12-07), and on CUDA with the prefill as a CUDA graph per power-of-two row count
(`FastEngine(graph_prefill=True)`). Prefill ms per prompt and ms per decoding round, per method, after a warm-up on
every prompt (each prompt length's first forward pays for its shapes once).

    python benchmarks/engine_spans.py --device cpu --dtype float32 --threads 2
    python benchmarks/engine_spans.py --target <bf16 folder> --device cuda --dtype bfloat16 --out spans.json

Every engine gives the same tokens (checked: float32 and bf16 may break near-ties differently, reported).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flashdraft.decode.engine import FastEngine  # noqa: E402
from flashdraft.drafter import DFlashDrafter  # noqa: E402
from flashdraft.eval.prompts import load_eval_prompts  # noqa: E402
from flashdraft.files import atomic_write_text  # noqa: E402
from flashdraft.target import TargetModel, load_target  # noqa: E402

METHODS = [("ar", None), ("chain", None), ("ddtree", 16)]


def engine_args(ap: argparse.ArgumentParser, *, prompts: int, max_new_tokens: int, dtype: str) -> None:
    """The flags of a benchmark of the fast engine on eval prompts (this script and compile_tau.py)."""
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="models/smollm2-135m-instruct-dflash-b16")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--max-budget", type=int, default=512, help="the engines' largest DDTree budget")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=dtype)
    ap.add_argument("--threads", type=int, default=0, help="torch threads on a CPU (0: torch's default)")
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")


def open_engine_inputs(a: argparse.Namespace) -> tuple[TargetModel, DFlashDrafter]:
    """engine_args' target and drafter (in the target's dtype), after refusing an existing --out and setting
    --threads."""
    if a.out is not None and a.out.exists() and not a.overwrite:
        raise SystemExit(f"--out {a.out} exists: pass --overwrite to replace it")
    if a.threads:
        torch.set_num_threads(a.threads)
    target = load_target(a.target, dtype=a.dtype, device=a.device)
    return target, DFlashDrafter.from_pretrained(a.drafter, dtype=target.dtype, device=a.device).eval()


def measure(engine: FastEngine, prompts: list[Any], method: str, budget: int | None, n_new: int) -> dict:
    """Prefill ms per prompt, ms per decoding round and the tokens, after a warm-up (graphs, caches, shapes)."""
    engine.generate(prompts[0].input_ids, max_new_tokens=8, method=method, budget=budget)
    for p in prompts[1:]:
        engine.generate(p.input_ids, max_new_tokens=1, method=method, budget=budget)
    prefill = decode = 0.0
    rounds, tokens = 0, []
    for p in prompts:
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        res = engine.generate(p.input_ids, max_new_tokens=n_new, method=method, budget=budget)
        prefill += res.timings.prefill_s
        decode += res.timings.decode_s
        rounds += res.rounds
        tokens.append(res.tokens)
    n = len(prompts)
    return {"prefill_ms": 1e3 * prefill / n, "round_ms": 1e3 * decode / max(rounds, 1), "tokens": tokens}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    engine_args(ap, prompts=2, max_new_tokens=64, dtype="float32")
    ap.add_argument("--max-lens", default="400,2048", help="engine max_len values (the short one first)")
    a = ap.parse_args(argv)
    target, drafter = open_engine_inputs(a)
    prompts = load_eval_prompts(a.dataset, target, a.prompts)
    rows, reference = [], {}
    print(f"{a.prompts} {a.dataset} prompts x {a.max_new_tokens} tokens, {a.device} {a.dtype}")
    print("| max_len | cache rows | attention over | method | prefill ms | round ms | same tokens |")
    print("|---:|---:|---|---|---:|---:|---|")
    max_lens = list(map(int, a.max_lens.split(",")))
    runs = [(m, over) for over in ("its span", "the whole cache") for m in max_lens]
    # the graphed prefills last: after a graphed-prefill engine was deleted, the next engine failed to capture once
    if a.device == "cuda":
        runs += [(m, "its span, prefill graphed") for m in max_lens]
    result = {"device": a.device, "dtype": a.dtype, "torch": torch.__version__, "prompts": a.prompts,
              "max_new_tokens": a.max_new_tokens, "rows": rows}  # fmt: skip
    for max_len, over in runs:
        whole = over == "the whole cache"
        engine = FastEngine(target, drafter, max_len=max_len, max_budget=a.max_budget,
                            graph_prefill=over.endswith("graphed"))  # fmt: skip
        if whole:  # the engine as it was: every round over the whole static cache
            engine._spans = lambda engine=engine: [engine.capacity]  # type: ignore[method-assign]
        for method, budget in METHODS:
            label = method if budget is None else f"{method}:{budget}"
            r = measure(engine, prompts, method, budget, a.max_new_tokens)
            same = reference.setdefault(label, r["tokens"]) == r["tokens"]
            rows.append({"max_len": max_len, "capacity": engine.capacity, "whole_cache": whole,
                         "graph_prefill": engine.graph_prefill, "method": label, "prefill_ms": r["prefill_ms"],
                         "round_ms": r["round_ms"], "same_tokens": same})  # fmt: skip
            print(f"| {max_len} | {engine.capacity} | {over} | {label} | {r['prefill_ms']:.1f} | "
                  f"{r['round_ms']:.2f} | {same} |")  # fmt: skip
        del engine
        gc.collect()  # its phases close over it: freed now, before the next engine allocates and captures
        if a.out:  # after every engine: the rows so far survive a later engine's failure
            atomic_write_text(a.out, json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
