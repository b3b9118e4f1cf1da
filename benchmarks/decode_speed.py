"""Decode speed on one GPU: the fast engine (AR, chain, DDTree budgets) against transformers, in one run.

    python benchmarks/decode_speed.py --target default --drafter models/smollm2-135m-instruct-dflash-b16 \
        --max-new-tokens 128 --budgets 8,16,32,64,128,256,512 --out results/decode_speed.json

Measures, at T = 0 and batch 1:
- time per output token and tokens/s for engine AR, chain, DDTree-b (b = budget, root excluded),
  `transformers` generate (eager dynamic cache, and static cache) and prompt-lookup decoding;
- where a round's time goes (CUDA events around each graph replay: draft, tree build, verify,
  commit) and the overhead outside the two model forwards as % of the round's wall time;
- the cost of each fixed shape by graph replay (verify q = 1, B, budget + 1; drafter step; tree
  build), so the speedup for any τ can be computed: τ · t(q=1) / t(round);
- bf16 token agreement of chain / DDTree with the engine's own AR, the first divergent position
  and the target's top-2 logit margin there (teacher-forced on the AR sequence).
`--target random-smollm2` builds a random SmolLM2-shaped Llama (no files) for smoke runs.
`--tree-phase eager|compiled` chooses how the DDTree phase runs (default: the engine's, compiled on CUDA — `FastEngine(compile_tree=...)`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.decode.divergence import engine_next_logits, find_divergence  # noqa: E402
from flashdraft.decode.engine import FastEngine  # noqa: E402
from flashdraft.drafter import DFlashDrafter  # noqa: E402
from flashdraft.target import TargetModel, drafter_config_for, load_target  # noqa: E402

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and two tests.",
    "Explain in a few paragraphs why the sky is blue, for a curious ten-year-old.",
    "Give me a short packing list for a three-day hiking trip in the mountains.",
    "Summarise the plot of Romeo and Juliet in five sentences.",
]


def log(msg: str) -> None:
    print(msg, flush=True)


DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def load(args: argparse.Namespace) -> tuple[TargetModel, DFlashDrafter, str]:
    dev = DEVICE
    if args.target == "random-smollm2":
        from random_targets import random_target  # benchmarks/ (the script folder)

        target = random_target("random-smollm2", dev, torch.bfloat16)
    else:
        target = load_target(args.target, dtype="bfloat16", device=dev)
    if args.drafter and args.drafter != "random":
        drafter = DFlashDrafter.from_pretrained(args.drafter, dtype=torch.bfloat16, device=dev)
        dname = args.drafter
    else:
        torch.manual_seed(1)
        drafter = DFlashDrafter(drafter_config_for(target, num_layers=5, block_size=16))
        drafter.reset_parameters(0.02)
        drafter = drafter.to(torch.bfloat16).to(dev).eval()
        dname = "random 5-layer (tau ~ 1)"
    return target, drafter, dname


def prompt_ids(target: TargetModel, n: int, dataset: str | None = None) -> list[list[int]]:
    """`n` prompts: from an eval set (flashdraft.eval.prompts: humaneval in the published wording, a
    dataset folder's eval split, ...) when given, else the built-in PROMPTS through the chat template."""
    if dataset:
        from flashdraft.eval.prompts import load_eval_prompts

        return [p.input_ids for p in load_eval_prompts(dataset, target, limit=n)]
    out = []
    tok = target.tokenizer
    for i in range(n):
        text = PROMPTS[i % len(PROMPTS)]
        if tok is None:
            g = torch.Generator().manual_seed(i)
            out.append(torch.randint(100, target.vocab_size, (40,), generator=g).tolist())
        else:
            msgs = [{"role": "user", "content": text}]
            try:
                ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
            except Exception:  # no chat template in the GGUF: plain text
                ids = tok(text)["input_ids"]
            out.append(list(ids))
    return out


def time_engine(
    engine: FastEngine, prompts: list[list[int]], method: str, budget: int | None, n_new: int,
    temperature: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    engine.generate(
        prompts[0], max_new_tokens=16, method=method, budget=budget
    )  # warm (graphs exist already)
    rows = []
    for i, p in enumerate(prompts):
        sync()
        t0 = time.perf_counter()
        r = engine.generate(
            p, max_new_tokens=n_new, method=method, budget=budget, temperature=temperature, seed=i
        )
        sync()
        wall = time.perf_counter() - t0
        rows.append({"tokens": r.tokens, "wall_s": wall, "decode_s": r.timings.decode_s, "prefill_s": r.timings.prefill_s,
                     "rounds": r.rounds, "tau": r.mean_acceptance})  # fmt: skip
    n_tok = sum(len(r["tokens"]) for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    decode = sum(r["decode_s"] for r in rows)
    rounds = sum(r["rounds"] for r in rows)
    # a profiled pass on the first prompt: CUDA events between the phase graphs
    engine.generate(prompts[0], max_new_tokens=n_new, method=method, budget=budget, profile=True)
    prof = engine.last_profile
    per = {
        k: getattr(prof, k) / max(prof.rounds, 1) for k in ("draft_ms", "tree_ms", "verify_ms", "commit_ms")
    }
    round_wall_ms = 1e3 * decode / max(rounds, 1)
    return {
        "method": method, "budget": budget, "new_tokens": n_tok, "ms_per_token": 1e3 * wall / n_tok,
        "tokens_per_s": n_tok / wall, "decode_ms_per_token": 1e3 * decode / max(n_tok - len(rows), 1),
        "tau": statistics.mean(r["tau"] for r in rows) if method != "ar" else 1.0, "temperature": temperature,
        "round_wall_ms": round_wall_ms, "phase_ms_per_round": per,
        "overhead_outside_forwards_pct": 100.0 * (1 - (per["draft_ms"] + per["verify_ms"]) / round_wall_ms),
        "tokens": [r["tokens"] for r in rows],
    }  # fmt: skip


def shape_costs(engine: FastEngine, prompt: list[int], budgets: list[int], reps: int) -> dict[str, float]:
    """Median ms of one replay of each phase graph at a fixed state (after a prefill)."""
    out: dict[str, float] = {}
    engine.generate(prompt, max_new_tokens=2, method="chain")  # leaves a real state behind

    def bench(fn) -> float:  # type: ignore[no-untyped-def]
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    ph, whole = engine._phases, engine.whole_cache_key  # the phases attending over the whole cache
    if any(k[0] == "ar" for k in ph):
        out["verify_q1_ar_step"] = bench(ph[whole("ar")])
    out["draft_step"] = bench(ph[whole("draft")])
    out[f"verify_q{engine.block}_chain"] = bench(ph[whole("verify_chain")])
    for b in budgets:
        out[f"tree_build_b{b}"] = bench(ph[("tree", b)])
        out[f"verify_q{b + 1}_tree"] = bench(ph[whole("verify", b + 1)])
    return out


def agreement(
    engine: FastEngine, prompts: list[list[int]], ar: list[list[int]], other: list[list[int]]
) -> dict[str, Any]:
    """bf16: identical sequences, first divergence, and the top-2 margin of the AR-teacher-forced logits there
    (the engine's own forward, `flashdraft.decode.divergence`). A sequence that stops early where the other goes
    on diverges where it ends, with no margin (None)."""
    same, firsts, margins = 0, [], []
    for p, a, o in zip(prompts, ar, other, strict=True):
        if a == o:
            same += 1
            continue
        d = find_divergence(engine.target, p, a, o, next_logits=engine_next_logits(engine))
        firsts.append(d.position if d is not None else min(len(a), len(o)))
        margins.append(d.top2_margin if d is not None else None)
    matched = sum(firsts) + sum(len(a) for a, o in zip(ar, other, strict=True) if a == o)
    return {"identical_sequences": same, "of": len(prompts), "first_divergence": firsts, "top2_margin_at_divergence": margins,
            "tokens_before_divergence_frac": matched / sum(len(a) for a in ar)}  # fmt: skip


def time_hf(target: TargetModel, prompts: list[list[int]], n_new: int, mode: str) -> dict[str, Any]:
    model = target.model
    kw: dict[str, Any] = {"max_new_tokens": n_new, "min_new_tokens": n_new, "do_sample": False}
    if mode == "static":
        kw["cache_implementation"] = "static"
    elif mode == "prompt_lookup":
        kw["prompt_lookup_num_tokens"] = 10
    pad = target.tokenizer.eos_token_id if target.tokenizer is not None else 0
    total_t, total_n = 0.0, 0
    try:
        x = torch.tensor([prompts[0]], device=DEVICE)
        model.generate(
            x,
            attention_mask=torch.ones_like(x),
            pad_token_id=pad,
            **{**kw, "max_new_tokens": 8, "min_new_tokens": 8},
        )
        for p in prompts:
            x = torch.tensor([p], device=DEVICE)
            sync()
            t0 = time.perf_counter()
            y = model.generate(x, attention_mask=torch.ones_like(x), pad_token_id=pad, **kw)
            sync()
            total_t += time.perf_counter() - t0
            total_n += y.shape[1] - x.shape[1]
    except Exception as e:  # report, never hide: a failing baseline is a result too
        return {"mode": mode, "error": f"{type(e).__name__}: {e}"[:400]}
    return {
        "mode": mode,
        "new_tokens": total_n,
        "ms_per_token": 1e3 * total_t / total_n,
        "tokens_per_s": total_n / total_t,
    }


def save(results: dict[str, Any], path: str, t_all: float) -> None:
    """Write the JSON atomically (called after each stage), engine token lists cut to 32 per prompt."""
    results["elapsed_s"] = time.perf_counter() - t_all
    small = dict(results, engine=[dict(r, tokens=[t[:32] for t in r["tokens"]]) for r in results["engine"]])
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(small, indent=1))
    os.replace(tmp, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="random")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--hf-prompts", type=int, default=2)
    ap.add_argument("--budgets", default="8,16,32,64,128,256,512")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default="decode_speed.json")
    ap.add_argument(
        "--dataset", default=None, help="prompts from an eval set, e.g. humaneval or a dataset folder"
    )
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="engine runs at this T (AR and speculative alike)"
    )
    ap.add_argument("--tree-phase", choices=["auto", "eager", "compiled"], default="auto",
                    help="the DDTree phase: eager, or through torch.compile (one compile per budget); auto: the "
                         "engine's default (compiled with CUDA graphs)")  # fmt: skip
    ap.add_argument("--compile-tree", action="store_const", const="compiled", dest="tree_phase",
                    help="= --tree-phase compiled (the form benchmarks/RESULTS.md quotes)")  # fmt: skip
    ap.add_argument(
        "--device", default="cuda", help="cpu: a smoke run of the script itself (no graphs, no shape costs)"
    )
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    budgets = [int(b) for b in args.budgets.split(",") if b]
    t_all = time.perf_counter()
    target, drafter, dname = load(args)
    dev_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    log(f"target {target.name} | drafter {dname} | {dev_name} | torch {torch.__version__}")
    prompts = prompt_ids(target, args.prompts, args.dataset)
    max_len = max(len(p) for p in prompts) + args.max_new_tokens + 32
    engine = FastEngine(
        target,
        drafter,
        max_len=max_len,
        max_budget=max(budgets),
        compile_tree={"auto": None, "eager": False, "compiled": True}[args.tree_phase],
    )
    t0 = time.perf_counter()
    engine.warmup([("ar", None), ("chain", None)] + [("ddtree", b) for b in budgets])
    sync()
    log(f"graphs captured: {len(engine._phases)} in {time.perf_counter() - t0:.1f} s")
    results: dict[str, Any] = {"target": target.name, "drafter": dname, "device": dev_name,
                               "torch": torch.__version__, "max_new_tokens": args.max_new_tokens,
                               "prompts": len(prompts), "block_size": drafter.block_size, "engine": [],
                               "dataset": args.dataset or "built-in prompts", "temperature": args.temperature,
                               "compile_tree": engine.compile_tree}  # fmt: skip
    import transformers

    results["transformers"] = transformers.__version__
    runs = [("ar", None), ("chain", None)] + [("ddtree", b) for b in budgets]
    for method, budget in runs:
        r = time_engine(engine, prompts, method, budget, args.max_new_tokens, args.temperature)
        results["engine"].append(r)
        log(f"engine {method:6s} {budget or '':>4} | {r['ms_per_token']:.2f} ms/tok {r['tokens_per_s']:.0f} tok/s | "
            f"tau {r['tau']:.2f} | round {r['round_wall_ms']:.2f} ms, overhead {r['overhead_outside_forwards_pct']:.1f}% | "
            f"{ {k: round(v, 3) for k, v in r['phase_ms_per_round'].items()} }")  # fmt: skip
    ar_tokens = results["engine"][0]["tokens"]
    results["agreement_with_ar"] = {  # sampled runs differ from AR by design: agreement is a T=0 check
        f"{r['method']}{r['budget'] or ''}": agreement(engine, prompts, ar_tokens, r["tokens"])
        for r in results["engine"][1:]
    } if args.temperature == 0 else {}  # fmt: skip
    for k, v in results["agreement_with_ar"].items():
        log(f"agreement {k}: {v}")
    results["shape_ms"] = shape_costs(engine, prompts[0], budgets, args.reps) if DEVICE == "cuda" else {}
    log(
        f"shape costs (ms, median of {args.reps} graph replays): {json.dumps({k: round(v, 3) for k, v in results['shape_ms'].items()})}"
    )
    save(results, args.out, t_all)  # what is measured so far survives a timeout in the baselines
    if not args.skip_hf and args.temperature == 0:  # the baselines are greedy
        hf_prompts = prompts[: args.hf_prompts]
        results["transformers_generate"] = []
        for mode in ("eager", "static", "prompt_lookup"):
            r = time_hf(target, hf_prompts, args.max_new_tokens, mode)
            results["transformers_generate"].append(r)
            log(f"transformers {mode}: {r}")
            save(results, args.out, t_all)
    ar_ms = results["engine"][0]["ms_per_token"]
    log("\n| method | τ | ms/token | tok/s | speedup vs engine AR | round ms | overhead % |")
    log("|---|---|---|---|---|---|---|")
    for r in results["engine"]:
        name = r["method"] + (f"-{r['budget']}" if r["budget"] else "")
        log(f"| {name} | {r['tau']:.2f} | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.0f} | {ar_ms / r['ms_per_token']:.2f}x | "
            f"{r['round_wall_ms']:.2f} | {r['overhead_outside_forwards_pct']:.1f} |")  # fmt: skip
    for r in results.get("transformers_generate", []):
        if "error" not in r:
            log(
                f"| transformers {r['mode']} | - | {r['ms_per_token']:.2f} | {r['tokens_per_s']:.0f} | {ar_ms / r['ms_per_token']:.2f}x | - | - |"
            )
    save(results, args.out, t_all)
    log(f"wrote {args.out} in {results['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
