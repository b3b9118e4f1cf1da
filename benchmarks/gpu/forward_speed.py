"""The engine's target forward eager vs compiled (`FastEngine(compile_target=True)`), both as CUDA-graph replays, in one run.

    python3 benchmarks/gpu/forward_speed.py $TARGET --drafter models/smollm2-135m-instruct-dflash-b16 \
        --dataset humaneval:$STAGE/HumanEval.jsonl.gz --out $OUT/forward_speed.json
    python benchmarks/gpu/forward_speed.py random-tiny --device cpu --block 4 --budget 3 --out f.json   # smoke run

Engines over the same target and drafter (bf16 on CUDA), the same capacity and the same DDTree phase (the
engine's default: compiled with CUDA graphs); `eager` runs the target's forward eagerly inside its phase graphs,
`compiled` through torch.compile (inductor, default mode) captured inside them, and `compiled-separate` the same
with q/k/v and gate/up as separate matmuls (before `fuse_projections`: what one matmul each saves), and
`compiled-drafter` the compiled target with the drafting phase compiled too (`compile_drafter=True`), and
`compiled-overlap` that engine with round k + 1 enqueued before round k's tokens are read (`overlap_rounds=True`:
the same phases, so the same phase costs; the end-to-end rounds show what hiding the host loop gains). For each:
- the phases' cost by graph replay at a real state after a prefill (median of `--reps`, CUDA events): the AR step
  (inputs + forward q = 1 + token choice + commit), the chain's verify (q = B, 16 for the shipped drafter) and
  its ratio to the AR step, the DDTree phase at `--budget`, the verify at budget + 1, the drafter step; and the
  kernels one run of each phase launches (torch.profiler: what its graph replays);
- AR, chain and DDTree-`budget` generation on `--prompts` prompts (T = 0): tokens/s, τ, speedup over the same
  engine's AR, and where a round's time goes (`FastEngine.generate(profile=True)`: draft, tree, verify,
  commit = acceptance and K/V bookkeeping, host = the round's read and the host loop); whether each prompt's
  timed run, a second timed run and the profiled run give the same tokens (the same graphs replay: they must;
  where not, the first differing token and the eager target's top-2 margin there), and whether the target phases
  write the same K/V, features and choices whatever the cache holds past the committed length (stale rows);
- compiled against eager on the same text (each prompt and its AR continuation, teacher-forced in chunks of
  B after an eager prefill): max |Δlogit|, argmax agreement, the eager top-2 margin where they disagree;
  and whether the AR sequences of the two engines are identical.
The compiled engine compiles once per shape (q = 1, B, budget + 1) in its warm-up; `compile_s` in the JSON.
Expected on an H100/H200 for SmolLM2-135M: tens of seconds per shape (not yet measured). The JSON is written
after each stage, so a run cut by `timeout` keeps what it measured. On CPU the phases run eagerly (perf_counter
medians, no kernel counts): a smoke run of the script's code paths.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # phase_timing, however this file is loaded
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: random_targets, decode_speed

from phase_timing import median_ms  # noqa: E402  (beside this file)

import flashdraft.decode.native as native_forward  # noqa: E402
from flashdraft.decode.engine import FastEngine  # noqa: E402
from flashdraft.drafter import DFlashDrafter  # noqa: E402
from flashdraft.target import TargetModel, drafter_config_for, load_target  # noqa: E402

# compiled-separate: the compiled forward with q/k/v and gate/up as separate matmuls, as before `fuse_projections`
# (run last: it drops the fused buffers, whose storage the other engines' graphs still read through the weights)
VARIANTS = ("eager", "compiled", "compiled-drafter", "compiled-overlap", "compiled-separate")


def log(msg: str) -> None:
    print(msg, flush=True)


def load(args: argparse.Namespace) -> tuple[TargetModel, DFlashDrafter, str]:
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.target.startswith("random-"):
        from random_targets import random_target

        target = random_target(args.target, args.device, dtype)
    else:
        target = load_target(args.target, dtype=str(dtype).removeprefix("torch."), device=args.device)
    if args.drafter != "random":
        return (
            target,
            DFlashDrafter.from_pretrained(args.drafter, dtype=dtype, device=args.device),
            args.drafter,
        )
    torch.manual_seed(1)
    drafter = DFlashDrafter(drafter_config_for(target, num_layers=args.drafter_layers, block_size=args.block))
    drafter.reset_parameters(0.02)
    return (
        target,
        drafter.to(dtype).to(args.device).eval(),
        f"random {args.drafter_layers}-layer, block {args.block}",
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_phase(engine: FastEngine, key: tuple[Any, ...], reps: int) -> float:
    """Median ms of one run of a captured phase (graph replay on CUDA, eager call on CPU) at the engine's
    current state, restored before every run (the AR phase advances it)."""
    seq_len, bonus = engine.seq_len.clone(), engine.bonus.clone()

    def restore() -> None:
        engine.seq_len.copy_(seq_len)
        engine.bonus.copy_(bonus)

    ms = median_ms(engine._phases[key], reps, warmup=3, cuda=engine.device.type == "cuda", before=restore)
    restore()
    return ms


def kernel_profile(engine: FastEngine, key: tuple[Any, ...], top: int = 12) -> tuple[int, list[dict[str, Any]]]:
    """Kernels (memsets and copies too) one eager run of the phase launches, what its graph replays: their number,
    and the `top` kernel names by GPU time with their count and microseconds (where a phase's extra kernels go)."""
    from torch.profiler import ProfilerActivity, profile

    seq_len = engine.seq_len.clone()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine._phases[key].fn()
        torch.cuda.synchronize()
    engine.seq_len.copy_(seq_len)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        n_us = by_name.setdefault(e.name[:120], [0, 0.0])
        n_us[0] += 1
        n_us[1] += e.time_range.elapsed_us()
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return len(kernels), [{"name": n, "count": int(c), "us": round(us, 1)} for n, (c, us) in ranked]


def phase_costs(engine: FastEngine, prompt: list[int], budget: int, reps: int) -> dict[str, Any]:
    engine.generate(prompt, max_new_tokens=2, method="chain")  # a real state: prompt + 2 tokens, features
    keys = {
        "ar_step": engine.whole_cache_key("ar"),
        f"verify_chain_q{engine.block}": engine.whole_cache_key("verify_chain"),
        f"tree_b{budget}": ("tree", budget),
        f"verify_tree_q{budget + 1}": engine.whole_cache_key("verify", budget + 1),
        "draft": engine.whole_cache_key("draft"),
    }
    out: dict[str, Any] = {f"{name}_ms": time_phase(engine, key, reps) for name, key in keys.items()}
    out["verify_chain_to_ar"] = out[f"verify_chain_q{engine.block}_ms"] / out["ar_step_ms"]
    if engine.device.type == "cuda":
        profiles = {name: kernel_profile(engine, key) for name, key in keys.items()}
        out["kernels"] = {name: n for name, (n, _) in profiles.items()}
        out["kernel_names"] = {name: names for name, (_, names) in profiles.items()}
    return out


def first_divergence(
    engine: FastEngine, prompt: list[int], a: list[int], b: list[int]
) -> dict[str, Any] | None:
    """Where two greedy continuations `a`, `b` of `prompt` first differ (None where they are equal): the index,
    both tokens, and the target there by the engine's eager forward over the prompt and the common prefix (its
    logits, float32 at least): the top-2 margin and the logit gap between the two tokens (0 at an exact tie). The forward
    overwrites the cache rows the next generate's prefill writes anyway."""
    j = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    if j == len(a) == len(b):
        return None
    div: dict[str, Any] = {"index": j, "a": a[j] if j < len(a) else None, "b": b[j] if j < len(b) else None}
    ids = torch.tensor(prompt + a[:j], device=engine.device)
    pos = torch.arange(len(ids), device=engine.device)
    logits = engine.native.forward(ids, pos, pos, engine.kv_idx[None] <= pos[:, None]).logits
    assert logits is not None
    last = logits[-1]  # [V] predicts token j (float32 at least: the native head's)
    top2 = last.topk(2)
    div["eager_argmax"] = int(top2.indices[0])
    div["eager_top2_margin"] = float(top2.values[0] - top2.values[1])
    if div["a"] is not None and div["b"] is not None:
        div["gap_a_minus_b"] = float(last[div["a"]] - last[div["b"]])
    return div


def agreement(
    engine: FastEngine, prompts: list[list[int]], ref: list[list[int]], other: list[list[int]]
) -> dict[str, Any]:
    """How many prompts' sequences `other` equal `ref`, and each differing prompt's first divergence."""
    divs = []
    for i, (p, a, b) in enumerate(zip(prompts, ref, other, strict=True)):
        d = first_divergence(engine, p, a, b)
        if d is not None:
            divs.append({"prompt": i, **d})
    return {"identical": len(prompts) - len(divs), "of": len(prompts), "divergences": divs}


def stale_rows_probe(engine: FastEngine, budget: int) -> dict[str, bool]:
    """Whether the target phases read only the cache rows they may, at the engine's state (after a prefill): the
    rows from the committed length on (masked, or written by the phase before it attends) get two different
    random fills, and each phase (AR step; chain verify; tree phase + tree verify) must write bit-identical K/V
    rows, features and choices. False: it reads stale rows, so a generate depends on the one before it."""
    cache, seq = engine.native.cache, int(engine.seq_len)  # cache [layers, 2, kv, S, hd]
    scale = float(cache[:, :, :, :seq].float().std())  # garbage of the real rows' size
    seq_len, bonus = engine.seq_len.clone(), engine.bonus.clone()
    keys = {
        "ar_step": ([engine.whole_cache_key("ar")], 1),
        "verify_chain": ([engine.whole_cache_key("verify_chain")], engine.block),
        "verify_tree": ([("tree", budget), engine.whole_cache_key("verify", budget + 1)], budget + 1),
    }
    out = {}
    for name, (phases, q) in keys.items():
        buf, seen = engine._qbuf(q), []
        for fill in (1, 2):
            g = torch.Generator(device=engine.device).manual_seed(fill)
            rest = cache[:, :, :, seq:]
            rest.copy_(torch.randn(rest.shape, generator=g, device=engine.device) * scale)
            engine.seq_len.copy_(seq_len)  # the AR step advances the state
            engine.bonus.copy_(bonus)
            for k in phases:
                engine._phases[k]()
            seen.append(
                [cache[:, :, :, seq : seq + q].clone(), buf["choice"].clone(), buf["features"].clone()]
            )
        sync(engine.device.type)
        out[name] = all(torch.equal(x, y) for x, y in zip(*seen, strict=True))
    engine.seq_len.copy_(seq_len)
    engine.bonus.copy_(bonus)
    return out


def rounds(
    engine: FastEngine, prompts: list[list[int]], budget: int, n_new: int, device: str
) -> dict[str, Any]:
    """AR, chain, DDTree-budget on every prompt: tokens/s, τ, per-round phase ms (profiled runs). Each prompt
    runs timed, timed again and profiled: the three must give the same tokens (the same graphs replay, at the
    same state after the prefill); where they do not, `rerun_vs_timed` / `profiled_vs_timed` say where."""
    out: dict[str, Any] = {}
    for method, b in [("ar", None), ("chain", None), ("ddtree", budget)]:
        engine.generate(prompts[0], max_new_tokens=8, method=method, budget=b)  # warm
        wall, toks, accepted, sums, n_rounds, seqs, reruns, profiled = 0.0, 0, [], {}, 0, [], [], []
        decode_s, timed_rounds = 0.0, 0
        for p in prompts:
            sync(device)
            t0 = time.perf_counter()
            r = engine.generate(p, max_new_tokens=n_new, method=method, budget=b)
            sync(device)
            wall += time.perf_counter() - t0
            decode_s, timed_rounds = decode_s + r.timings.decode_s, timed_rounds + r.rounds
            toks += len(r.tokens)
            accepted += r.acceptance_lengths
            seqs.append(r.tokens)
            reruns.append(engine.generate(p, max_new_tokens=n_new, method=method, budget=b).tokens)
            profiled.append(
                engine.generate(p, max_new_tokens=n_new, method=method, budget=b, profile=True).tokens
            )
            prof = engine.last_profile
            for k, v in prof.as_dict().items():
                if k != "rounds":
                    sums[k] = sums.get(k, 0.0) + v
            n_rounds += prof.rounds
        name = method if b is None else f"{method}-{b}"
        out[name] = {
            "tokens": toks, "tokens_per_s": toks / wall, "tau": statistics.mean(accepted) if accepted else 0.0,
            "round_ms": {k.removesuffix("_ms"): v / max(n_rounds, 1) for k, v in sums.items()}, "sequences": seqs,
            # a timed (unprofiled) round, wall clock: against the profiled phases' sum, the host's share
            "timed_round_ms": 1e3 * decode_s / max(timed_rounds, 1),
            "rerun_vs_timed": agreement(engine, prompts, seqs, reruns),
            "profiled_vs_timed": agreement(engine, prompts, seqs, profiled),
        }  # fmt: skip
    ar = out["ar"]["tokens_per_s"]
    for row in out.values():
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar
    return out


@torch.no_grad()
def logit_agreement(eager: FastEngine, comp: FastEngine, texts: list[list[int]]) -> dict[str, Any]:
    """The two engines' target forwards over the same text, teacher-forced in chunks of B after an eager
    prefill of the first half: the compiled engine through its compiled shape q = B (with features, as the
    chain's verify), the eager one eagerly. Each engine's cache holds its own K/V, as in decoding."""
    q, kv = eager.block, eager.kv_idx
    max_abs, positions, differ, margins = 0.0, 0, 0, []
    for ids in texts:
        x = torch.tensor(ids, device=eager.device)
        p0 = len(ids) // 2
        p0 = max(1, p0 - (len(ids) - p0) % q)  # the rest in whole chunks
        pos = torch.arange(p0, device=eager.device)
        for e in (eager, comp):
            e.native.forward(x[:p0], pos, pos, kv[None] <= pos[:, None])
        for s in range(p0, len(ids) - q + 1, q):
            pos = torch.arange(s, s + q, device=eager.device)
            # one tensor passed twice would compile a shape of its own (dynamo's alias guard)
            rows = pos.clone()
            allowed = kv[None] <= pos[:, None]
            ids_q = x[s : s + q].clone()  # not a view at an offset: inductor would copy a misaligned input
            a = eager.native.forward(ids_q, pos, rows, allowed, layer_ids=eager.layer_ids).logits
            b = comp.native.compiled_forward(ids_q, pos, rows, allowed, layer_ids=comp.layer_ids).logits
            assert a is not None and b is not None
            max_abs = max(max_abs, float((a - b).abs().max()))
            positions += q
            bad = a.argmax(-1) != b.argmax(-1)
            differ += int(bad.sum())
            top2 = a[bad].topk(2, dim=-1).values
            margins += (top2[:, 0] - top2[:, 1]).tolist()
    return {"positions": positions, "argmax_agree_frac": 1 - differ / max(positions, 1), "argmax_differ": differ,
            "max_abs_dlogit": max_abs, "eager_top2_margin_where_differ": margins}  # fmt: skip


def save(results: dict[str, Any], path: Path) -> None:
    """The JSON, atomically (after every stage): generated sequences cut to 32 tokens each."""
    small = json.loads(json.dumps(results))
    for v in small.get("variants", {}).values():
        for row in v.get("rounds", {}).values():
            row["sequences"] = [s[:32] for s in row["sequences"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(small, indent=1))
    os.replace(tmp, path)


def table(results: dict[str, Any], budget: int, block: int) -> list[str]:
    vs = results["variants"]
    cols = [v for v in VARIANTS if "phases" in vs.get(v, {})]
    lines = ["| | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]

    def row(label: str, get: Any, fmt: str = "{:.3f}") -> None:
        vals = []
        for v in cols:
            try:
                vals.append(fmt.format(get(vs[v])))
            except (KeyError, TypeError):
                vals.append("–")
        lines.append(f"| {label} | " + " | ".join(vals) + " |")

    row("AR step ms", lambda v: v["phases"]["ar_step_ms"])
    row(f"chain verify q={block} ms", lambda v: v["phases"][f"verify_chain_q{block}_ms"])
    row(f"chain verify q={block} / AR step", lambda v: v["phases"]["verify_chain_to_ar"], "{:.2f}")
    row(f"tree phase b={budget} ms", lambda v: v["phases"][f"tree_b{budget}_ms"])
    row(f"tree verify q={budget + 1} ms", lambda v: v["phases"][f"verify_tree_q{budget + 1}_ms"])
    row("draft ms", lambda v: v["phases"]["draft_ms"])
    row("kernels AR step", lambda v: v["phases"]["kernels"]["ar_step"], "{}")
    row(f"kernels chain verify q={block}", lambda v: v["phases"]["kernels"][f"verify_chain_q{block}"], "{}")
    row(f"kernels tree b={budget}", lambda v: v["phases"]["kernels"][f"tree_b{budget}"], "{}")
    row("setup s (compile + capture)", lambda v: v["setup_s"], "{:.1f}")
    for m in ("ar", "chain", f"ddtree-{budget}"):
        row(f"{m} tok/s", lambda v, m=m: v["rounds"][m]["tokens_per_s"], "{:.0f}")
        if m != "ar":
            row(
                f"{m} τ / speedup",
                lambda v, m=m: f"{v['rounds'][m]['tau']:.2f} / {v['rounds'][m]['speedup_vs_ar']:.2f}x",
                "{}",
            )
            for ph in ("draft", "tree", "verify", "commit", "host"):
                row(f"{m} round: {ph} ms", lambda v, m=m, ph=ph: v["rounds"][m]["round_ms"][ph])
        row(f"{m} timed round ms (wall)", lambda v, m=m: v["rounds"][m]["timed_round_ms"])
        for check in ("rerun_vs_timed", "profiled_vs_timed"):
            row(
                f"{m} {check.replace('_vs_', ' = ')}",
                lambda v, m=m, c=check: agreement_cell(v["rounds"][m][c]),
                "{}",
            )
    row("target phases ignore stale cache rows", lambda v: all(v["stale_rows_identical"].values()), "{}")
    return lines


def agreement_cell(a: dict[str, Any]) -> str:
    """'3/3', or '2/3 @57 Δ0.000': identical prompts, then the first divergence's token index and the eager
    top-2 margin there (near 0: a near-tie the two runs broke differently)."""
    cell = f"{a['identical']}/{a['of']}"
    if a["divergences"]:
        d = a["divergences"][0]
        cell += f" @{d['index']} Δ{d['eager_top2_margin']:.3f}"
    return cell


def separate_projections(target: TargetModel) -> None:
    """Undo `fuse_projections`: its buffers dropped (the weights stay views of their storage), so forwards built
    from now on, with its call patched out, run q/k/v and gate/up as separate matmuls."""
    for layer in target.layers:
        for module, name in ((layer.self_attn, "fused_qkv"), (layer.mlp, "fused_gate_up")):
            for suffix in ("_weight", "_bias"):
                if hasattr(module, name + suffix):
                    delattr(module, name + suffix)


def measure_variant(
    v: str, target: TargetModel, drafter: DFlashDrafter, prompts: list[list[int]], max_len: int,
    args: argparse.Namespace, row: dict[str, Any], results: dict[str, Any],
) -> FastEngine:  # fmt: skip
    """One engine (`v`: eager or compiled target, fused projections or separate): setup (compilation + capture),
    phase costs, rounds."""
    t0 = time.perf_counter()
    separate = v.endswith("-separate")
    if separate:
        separate_projections(target)
    with patch.object(native_forward, "fuse_projections", lambda target: None) if separate else nullcontext():
        eng = FastEngine(
            target, drafter, max_len=max_len, max_budget=args.max_budget or args.budget, compile_target=v != "eager",
            compile_drafter=v in ("compiled-drafter", "compiled-overlap"), overlap_rounds=v == "compiled-overlap",
        )  # fmt: skip
    results["capacity"] = eng.capacity
    for method, b in [("ar", None), ("chain", None), ("ddtree", args.budget)]:
        t1 = time.perf_counter()
        eng.warmup([(method, b)])  # graphs: the compiled variant compiles its shapes in their warm-up
        eng.generate(prompts[0], max_new_tokens=4, method=method, budget=b)  # no graphs: here
        sync(args.device)
        log(f"{v}: {method} phases ready in {time.perf_counter() - t1:.1f} s")
    row["setup_s"] = time.perf_counter() - t0
    row["phases"] = phase_costs(eng, prompts[0], args.budget, args.reps)
    log(
        f"{v}: {json.dumps({k: round(x, 4) if isinstance(x, float) else x for k, x in row['phases'].items()})}"
    )
    row["stale_rows_identical"] = stale_rows_probe(eng, args.budget)
    log(f"{v}: target phases independent of stale cache rows: {row['stale_rows_identical']}")
    save(results, args.out)
    row["rounds"] = rounds(eng, prompts, args.budget, args.max_new_tokens, args.device)
    save(results, args.out)
    return eng


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", help="a target folder / GGUF, or random-smollm2 / random-tiny (random weights)")
    ap.add_argument(
        "--drafter", default="random", help="a drafter folder, or random (--block, --drafter-layers)"
    )
    ap.add_argument("--block", type=int, default=16, help="the random drafter's block size")
    ap.add_argument("--drafter-layers", type=int, default=5, help="the random drafter's layers")
    ap.add_argument(
        "--dataset",
        default=None,
        help="prompts, e.g. humaneval:$STAGE/HumanEval.jsonl.gz (default: built-in)",
    )
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=32, help="the DDTree budget measured")
    ap.add_argument("--reps", type=int, default=50, help="replays per phase timing")
    ap.add_argument(
        "--max-len", type=int, default=0, help="engine max_len (0: longest prompt + max-new-tokens + 64)"
    )
    ap.add_argument(
        "--max-budget", type=int, default=0,
        help="engine max_budget (0: --budget); with --max-len 2048 and 512 the cache of `flashdraft bench`'s engine",
    )  # fmt: skip
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    ap.add_argument(
        "--inductor-deterministic", action="store_true",
        help="torch._inductor.config.deterministic: reductions with fixed configs (the compiled AR step gave other "
        "tokens on a rerun at a bf16 near-tie, H100 2026-12-06); recorded in the results",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.inductor_deterministic:
        import torch._inductor.config as inductor_config

        inductor_config.deterministic = True
    if args.out.exists() and not args.overwrite:
        raise SystemExit(f"--out {args.out} exists: pass --overwrite to replace it")
    variants = [v for v in args.variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    from decode_speed import prompt_ids

    t_all = time.perf_counter()
    target, drafter, dname = load(args)
    prompts = prompt_ids(target, args.prompts, args.dataset)
    max_len = args.max_len or max(len(p) for p in prompts) + args.max_new_tokens + 64
    cuda = args.device.startswith("cuda")
    dev_name = torch.cuda.get_device_name() if cuda else "cpu"
    results: dict[str, Any] = {
        "target": target.name, "drafter": dname, "device": dev_name, "torch": torch.__version__,
        "dtype": str(target.dtype), "block": drafter.block_size, "budget": args.budget, "max_len": max_len,
        "max_budget": args.max_budget or args.budget,
        "prompts": len(prompts), "dataset": args.dataset or "built-in prompts", "max_new_tokens": args.max_new_tokens,
        "variants": {}, "inductor_deterministic": args.inductor_deterministic,
    }  # fmt: skip
    log(
        f"target {target.name} | drafter {dname} | {dev_name} | torch {torch.__version__} | max_len {max_len}"
    )
    engines: dict[str, FastEngine] = {}
    for v in variants:
        row = results["variants"].setdefault(v, {})
        try:
            engines[v] = measure_variant(v, target, drafter, prompts, max_len, args, row, results)
        except Exception as e:  # a variant that fails (a compile error on this stack, say) is a result too
            row["error"] = f"{type(e).__name__}: {e}"[:800]
            log(f"{v}: FAILED {row['error']}")
            save(results, args.out)
    if "eager" in engines and "compiled" in engines:
        eager, comp = engines["eager"], engines["compiled"]
        ar_e, ar_c = (
            results["variants"]["eager"]["rounds"]["ar"],
            results["variants"]["compiled"]["rounds"]["ar"],
        )
        texts = [p + s for p, s in zip(prompts, ar_e["sequences"], strict=True)]
        results["compiled_vs_eager"] = {
            "teacher_forced": logit_agreement(eager, comp, texts),
            "ar_identical_sequences": sum(a == b for a, b in zip(ar_e["sequences"], ar_c["sequences"], strict=True)),
            "of": len(prompts),
        }  # fmt: skip
        log(f"compiled vs eager: {json.dumps(results['compiled_vs_eager'])[:600]}")
    results["elapsed_s"] = time.perf_counter() - t_all
    save(results, args.out)
    log("")
    for line in table(results, args.budget, drafter.block_size):
        log(line)
    for v, row in results["variants"].items():
        if "phases" not in row:
            continue
        ph = row["phases"]
        results.setdefault("goals", {})[v] = goals = {
            "ar_step_le_1.5ms": ph["ar_step_ms"] <= 1.5,
            "chain_verify_le_1.25_ar": ph["verify_chain_to_ar"] <= 1.25,
            f"tree_b{args.budget}_le_0.15ms": ph[f"tree_b{args.budget}_ms"] <= 0.15,
        }  # the targets set for SmolLM2-135M in bf16 at batch 1 (block 16, budget 32)
        log(f"goals met ({v}): {goals}")
    save(results, args.out)
    log(f"wrote {args.out} in {results['elapsed_s']:.0f} s")
    return results


if __name__ == "__main__":
    main()
