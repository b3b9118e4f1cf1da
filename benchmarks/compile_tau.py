"""Why the compiled engine drafts worse: τ and tokens of `FastEngine` eager / compile_drafter only / compile_target
only / both, and the compiled forwards against eager and float32 ones, teacher-forced on a fixed text.

1. End to end, greedy, chain and DDTree-32 (and AR): per variant τ (mean tokens per round per prompt, then over
   prompts, as `flashdraft bench` reports it), and per prompt the first position where its tokens leave the eager
   variant's (same method), the eager engine's AR tokens and its own AR tokens (None: equal). The target is eager in
   compile_drafter only, so that variant must keep eager's tokens (`compile_drafter_keeps_tokens`).
2. The target's forward, teacher-forced on the eager engine's AR text of each prompt, in chunks of q rows starting
   every --stride rows (a verify's shape; the chunk's K/V rewritten in each cache, as a verify does): eager,
   compiled (`NativeTarget.compiled_forward`) and, unless --dtype is float32, a float32 copy of the target. Argmax
   agreement, max |Δlogit|, and per captured layer max |Δfeature| / max |feature| and RMS(Δ) / RMS(feature).
3. The drafting step (`NativeDrafter.step` / `compiled_step`) along the same text, fed the eager target's features
   (1-9 new context rows a step): τ of each against the text, argmax agreement per slot, against a float32 step too;
   and the eager step fed the compiled target's features (`eager_on_compiled_features`: each row's from a compiled
   forward of q rows, as a compiled engine's verify gives them), which is what the compiled engine's drafter reads.

    python benchmarks/compile_tau.py --device cpu --dtype bfloat16 --threads 2 --prompts 1 --max-new-tokens 48
    python benchmarks/compile_tau.py --target <bf16 folder> --drafter <folder> --dataset humaneval:<HumanEval.jsonl.gz> \
        --device cuda --dtype bfloat16 --out compile_tau.json

On CUDA the engines run their phases as CUDA graphs (the compiled forwards inside them, as `flashdraft bench
--compile` does); parts 2 and 3 call the forwards directly, no graphs.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from engine_spans import engine_args, open_engine_inputs  # noqa: E402

from flashdraft.decode.engine import FastEngine, graph_spans  # noqa: E402
from flashdraft.decode.native import NativeDrafter, NativeTarget  # noqa: E402
from flashdraft.drafter import DFlashDrafter  # noqa: E402
from flashdraft.eval.prompts import load_eval_prompts  # noqa: E402
from flashdraft.files import atomic_write_text  # noqa: E402
from flashdraft.target import TargetModel, load_target  # noqa: E402

# name: (compile_target, compile_drafter)
VARIANTS = {"eager": (False, False), "compile_drafter": (False, True), "compile_target": (True, False),
            "both": (True, True)}  # fmt: skip
METHODS: list[tuple[str, int | None]] = [("chain", None), ("ddtree", 32)]


def first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's length if one is a prefix); None: equal."""
    if list(a) == list(b):
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _span(need: int, capacity: int) -> int:
    """The smallest of the engine's spans under CUDA graphs that holds `need` rows."""
    return next((s for s in graph_spans(capacity) if s >= need), capacity)


def end_to_end(target: TargetModel, drafter: DFlashDrafter, prompts: list[list[int]], n_new: int, *,
               stop: list[int], max_len: int, max_budget: int = 512,
               methods: list[tuple[str, int | None]] = METHODS) -> dict[str, Any]:  # fmt: skip
    """Part 1: every variant's AR and methods on every prompt; rows per (variant, method) and the eager AR texts."""
    outs: dict[str, dict[str, list[list[int]]]] = {}
    rows = []
    for name, (ct, cd) in VARIANTS.items():
        engine = FastEngine(target, drafter, max_len=max_len, max_budget=max_budget, compile_target=ct,
                            compile_drafter=cd)  # fmt: skip
        outs[name] = {}
        for method, budget in [("ar", None), *methods]:
            label = method if budget is None else f"{method}:{budget}"
            res = [engine.generate(p, max_new_tokens=n_new, method=method, budget=budget, stop_token_ids=stop)
                   for p in prompts]  # fmt: skip
            toks = outs[name][label] = [r.tokens for r in res]
            taus = [r.mean_acceptance for r in res if r.acceptance_lengths] if method != "ar" else []
            rows.append({
                "variant": name, "method": label, "tau": sum(taus) / len(taus) if taus else None, "taus": taus,
                "tokens": sum(map(len, toks)), "rounds": sum(r.rounds for r in res),
                "diff_vs_eager": [first_diff(t, e) for t, e in zip(toks, outs["eager"][label], strict=True)],
                "diff_vs_eager_ar": [first_diff(t, e) for t, e in zip(toks, outs["eager"]["ar"], strict=True)],
                "diff_vs_own_ar": [first_diff(t, e) for t, e in zip(toks, outs[name]["ar"], strict=True)],
            })  # fmt: skip
        compiled = {"target_compiled": engine.native._compiled is not None,  # what the engine compiled, all told
                    "drafter_compiled": engine.ndrafter is not None and engine.ndrafter._compiled is not None}  # fmt: skip
        for r in rows[-1 - len(methods) :]:
            r.update(compiled)
        del engine
        gc.collect()
    keeps = all(all(d is None for d in r["diff_vs_eager"]) for r in rows if r["variant"] == "compile_drafter")
    return {"rows": rows, "compile_drafter_keeps_tokens": keeps, "eager_ar": outs["eager"]["ar"]}


class _Stats:
    """Running argmax agreement / max |Δ| / sums of squares."""

    def __init__(self) -> None:
        self.agree = self.n = 0
        self.max_abs = self.sq = 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor, argmax: bool = True) -> None:
        d = a.float() - b.float()
        self.max_abs = max(self.max_abs, d.abs().max().item())
        self.sq += d.double().square().sum().item()
        if argmax:
            self.agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
            self.n += a.shape[0]

    def as_dict(self) -> dict[str, float]:
        return {"argmax_agree": self.agree / max(self.n, 1), "max_abs": self.max_abs, "rows": self.n}


def target_forced(target: TargetModel, target32: TargetModel | None, texts: list[list[int]], starts: list[int],
                  layer_ids: list[int], q: int = 16, stride: int = 8) -> dict[str, Any]:  # fmt: skip
    """Part 2: eager vs compiled (vs float32) target forwards, chunks of q rows from each text's `start` on."""
    cap = _span(max(map(len, texts)), 1 << 30)
    dev = target.device
    models = {"eager": NativeTarget(target, cap), "compiled": NativeTarget(target, cap)}
    if target32 is not None:
        models["fp32"] = NativeTarget(target32, cap)
    pairs = [("eager", "compiled"), ("eager", "fp32"), ("compiled", "fp32")]
    pairs = [p for p in pairs if p[1] in models]
    logit = {p: _Stats() for p in pairs}
    feat = {p: [_Stats() for _ in layer_ids] for p in pairs}
    scale = [[0.0, 0.0, 0] for _ in layer_ids]  # eager features per layer: max |value|, sum of squares, count
    for seq_list, start in zip(texts, starts, strict=True):
        seq = torch.tensor(seq_list, device=dev)
        n = len(seq)
        ar = torch.arange(n, device=dev)
        for nt in models.values():  # every row's K/V once (eager); each chunk then rewrites its own rows
            nt.forward(seq, ar, ar, ar[None] <= ar[:, None], logits=False)
        for c in range(start, n - q + 1, stride):
            pos = ar[c : c + q]
            span = _span(c + q, cap)
            allowed = torch.arange(span, device=dev)[None] <= pos[:, None]
            outs = {}
            for name, nt in models.items():
                fwd = nt.compiled_forward if name == "compiled" else nt.forward
                outs[name] = fwd(seq[c : c + q], pos, pos, allowed, layer_ids=layer_ids)
            h = target.hidden_size
            for i in range(len(layer_ids)):
                f = outs["eager"].features[:, i * h : (i + 1) * h].float()
                scale[i][0] = max(scale[i][0], f.abs().max().item())
                scale[i][1] += f.double().square().sum().item()
                scale[i][2] += f.numel()
            for a, b in pairs:
                logit[(a, b)].add(outs[a].logits, outs[b].logits)
                for i, st in enumerate(feat[(a, b)]):
                    sl = slice(i * h, (i + 1) * h)
                    st.add(outs[a].features[:, sl], outs[b].features[:, sl], argmax=False)
    layers = []
    for i, lid in enumerate(layer_ids):
        mx, sq, cnt = scale[i]
        row: dict[str, Any] = {"layer": lid, "max_abs_feature": mx, "rms_feature": (sq / max(cnt, 1)) ** 0.5}
        for p in pairs:
            st = feat[p][i]
            row[f"{p[0]}_vs_{p[1]}"] = {"max_abs": st.max_abs, "max_rel": st.max_abs / mx if mx else None,
                                        "rms_rel": (st.sq / sq) ** 0.5 if sq else None}  # fmt: skip
        layers.append(row)
    return {"q": q, "stride": stride, "logits": {f"{a}_vs_{b}": s.as_dict() for (a, b), s in logit.items()},
            "features": layers}  # fmt: skip


def compiled_features(native: NativeTarget, seq: torch.Tensor, layer_ids: list[int], q: int = 16) -> torch.Tensor:
    """Every row's features from the compiled target forward, q rows at a time (the last chunk ends at the text's
    end, overlapping the one before: one shape), each chunk attending to the K/V the chunks before it wrote, as in a
    compiled engine's verifies."""
    n, dev = len(seq), seq.device
    ar = torch.arange(n, device=dev)
    native.forward(seq, ar, ar, ar[None] <= ar[:, None], logits=False)  # every row's K/V (eager) first
    out = torch.empty(n, len(layer_ids) * native.target.hidden_size, dtype=native.target.dtype, device=dev)
    for c in range(0, n, q):
        c = max(0, min(c, n - q))
        pos = ar[c : c + q]
        allowed = torch.arange(_span(c + len(pos), native.capacity), device=dev)[None] <= pos[:, None]
        got = native.compiled_forward(seq[c : c + q], pos, pos, allowed, layer_ids=layer_ids).features
        assert got is not None
        out[c : c + q] = got
    return out


def drafter_forced(target: TargetModel, drafter: DFlashDrafter, target32: TargetModel | None,
                   drafter32: DFlashDrafter | None, texts: list[list[int]], starts: list[int],
                   stride: int = 4, q: int = 16) -> dict[str, Any]:  # fmt: skip
    """Part 3: eager vs compiled (vs float32) drafting steps along each text, fed the eager target's features, and
    the eager step fed the compiled target's."""
    b = drafter.block_size
    cap = _span(max(map(len, texts)) + b, 1 << 30)
    dev = target.device
    native = NativeTarget(target, cap)
    steps = {"eager": NativeDrafter(drafter, target, cap), "compiled": NativeDrafter(drafter, target, cap),
             "eager_on_compiled_features": NativeDrafter(drafter, target, cap)}  # fmt: skip
    if drafter32 is not None and target32 is not None:
        steps["fp32"] = NativeDrafter(drafter32, target32, cap)
    pairs = [("eager", "compiled"), ("eager", "fp32"), ("compiled", "fp32"), ("eager", "eager_on_compiled_features")]
    pairs = [p for p in pairs if p[1] in steps]
    ids = list(drafter.target_layer_ids)
    stats = {p: _Stats() for p in pairs}
    slot_agree = [0] * (b - 1)
    accepted: dict[str, list[int]] = {k: [] for k in steps}
    mask_ids = torch.full((b - 1,), drafter.mask_token_id, device=dev)
    for seq_list, start in zip(texts, starts, strict=True):
        seq = torch.tensor(seq_list, device=dev)
        n = len(seq)
        ar = torch.arange(n, device=dev)
        feats = native.forward(seq, ar, ar, ar[None] <= ar[:, None], layer_ids=ids, logits=False).features
        assert feats is not None
        by_step = {"fp32": feats.float(), "eager_on_compiled_features": compiled_features(native, seq, ids, q)}
        for c in range(start + 1, n - b + 1, stride):  # the bonus at c; slots 1..b-1 against seq[c+1 : c+b]
            # new context rows in the pending block, as after a round that accepted m
            m = min(c, 1 + c % min(9, b))
            span = _span(c + b, cap)
            outs = {}
            for name, nd in steps.items():
                f = by_step.get(name, feats)
                nd.cache.zero_()
                nd.write_context(f[: c - m], ar[: c - m])
                args = (f[c - m : c - m + b], ar[m : m + 1], ar[c : c + 1], seq[c : c + 1], mask_ids)
                step = nd.compiled_step if name == "compiled" else nd.step
                outs[name] = step(*args, span=None if span >= cap else span)[1:].float()
            truth = seq[c + 1 : c + b]
            for name, lg in outs.items():
                accepted[name].append(int((lg.argmax(-1) == truth).long().cumprod(0).sum().item()) + 1)
            for p in pairs:
                stats[p].add(outs[p[0]], outs[p[1]])
            same = (outs["eager"].argmax(-1) == outs["compiled"].argmax(-1)).tolist()
            slot_agree = [s + int(x) for s, x in zip(slot_agree, same, strict=True)]
    n_steps = len(accepted["eager"])
    return {"stride": stride, "steps": n_steps,
            "tau": {k: sum(v) / max(len(v), 1) for k, v in accepted.items()},
            "logits": {f"{a}_vs_{b_}": s.as_dict() for (a, b_), s in stats.items()},
            "slot_agree_eager_vs_compiled": [s / max(n_steps, 1) for s in slot_agree]}  # fmt: skip


def run(target: TargetModel, drafter: DFlashDrafter, prompts: list[list[int]], n_new: int, *,
        target32: TargetModel | None = None, drafter32: DFlashDrafter | None = None, stop: list[int] | None = None,
        max_len: int = 2048, max_budget: int = 512, methods: list[tuple[str, int | None]] = METHODS, q: int = 16,
        stride: int = 8, draft_stride: int = 4, save: Any = None) -> dict[str, Any]:  # fmt: skip
    """All three parts; `save(result)` after each (the parts so far survive a later one's failure)."""
    result: dict[str, Any] = {"device": str(target.device), "dtype": str(target.dtype).removeprefix("torch."),
                              "torch": torch.__version__, "prompts": len(prompts), "max_new_tokens": n_new}  # fmt: skip
    longest = max(map(len, prompts)) + n_new
    e2e = end_to_end(target, drafter, prompts, n_new, stop=stop or [], max_len=max(max_len, longest),
                     max_budget=max_budget, methods=methods)  # fmt: skip
    texts = [p + t for p, t in zip(prompts, e2e.pop("eager_ar"), strict=True)]
    result["end_to_end"] = e2e
    if save:
        save(result)
    starts = [len(p) for p in prompts]
    result["target_forced"] = target_forced(target, target32, texts, starts, list(drafter.target_layer_ids), q,
                                            stride)  # fmt: skip
    if save:
        save(result)
    result["drafter_forced"] = drafter_forced(
        target, drafter, target32, drafter32, texts, starts, draft_stride, q
    )
    if save:
        save(result)
    return result


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "—" if x is None else format(x, fmt)


def report(result: dict[str, Any]) -> str:
    """The markdown tables."""
    e2e, tf, df = result["end_to_end"], result["target_forced"], result["drafter_forced"]
    n = result["prompts"]
    lines = [f"{n} prompts x {result['max_new_tokens']} tokens, {result['device']} {result['dtype']}, torch "
             f"{result['torch']}", "",
             "| variant | method | τ | tokens | = eager | = eager AR | = own AR | first diff vs eager AR |",
             "|---|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in e2e["rows"]:
        keys = ("diff_vs_eager", "diff_vs_eager_ar", "diff_vs_own_ar")
        same = [f"{sum(d is None for d in r[k])}/{n}" for k in keys]
        lines.append(f"| {r['variant']} | {r['method']} | {_f(r['tau'], '.2f')} | {r['tokens']} | {' | '.join(same)} | "
                     f"{', '.join('=' if d is None else str(d) for d in r['diff_vs_eager_ar'])} |")  # fmt: skip
    lines += ["", f"compile_drafter only keeps eager's tokens: {e2e['compile_drafter_keeps_tokens']}", "",
              f"target teacher-forced, q={tf['q']} every {tf['stride']} rows:", "",
              "| pair | rows | argmax agree | max abs Δlogit |", "|---|---:|---:|---:|"]  # fmt: skip
    for k, s in tf["logits"].items():
        lines.append(f"| {k} | {s['rows']} | {s['argmax_agree']:.4f} | {s['max_abs']:.4g} |")
    pairs = [k for k in tf["features"][0] if "_vs_" in k] if tf["features"] else []
    lines += ["", "| layer | max abs feature | " + " | ".join(f"{p} max Δ/max, rms Δ/rms" for p in pairs) + " |",
              "|---:|---:|" + "---:|" * len(pairs)]  # fmt: skip
    for r in tf["features"]:
        cells = [f"{_f(r[p]['max_rel'], '.2e')}, {_f(r[p]['rms_rel'], '.2e')}" for p in pairs]
        lines.append(f"| {r['layer']} | {r['max_abs_feature']:.4g} | " + " | ".join(cells) + " |")
    lines += ["", f"drafting step teacher-forced, {df['steps']} steps (every {df['stride']} rows):", "",
              "| step | τ vs text |", "|---|---:|"] + [f"| {k} | {v:.3f} |" for k, v in df["tau"].items()]  # fmt: skip
    lines += ["", "| pair | argmax agree | max abs Δlogit |", "|---|---:|---:|"]
    lines += [f"| {k} | {s['argmax_agree']:.4f} | {s['max_abs']:.4g} |" for k, s in df["logits"].items()]
    slots = " ".join(f"{x:.3f}" for x in df["slot_agree_eager_vs_compiled"])
    lines += ["", f"argmax agreement eager vs compiled per slot 1..B-1: {slots}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    engine_args(ap, prompts=4, max_new_tokens=128, dtype="bfloat16")
    ap.add_argument("--max-len", type=int, default=2048, help="the engines' max_len (as flashdraft bench)")
    ap.add_argument("--q", type=int, default=16, help="rows per teacher-forced target forward")
    ap.add_argument("--stride", type=int, default=8, help="a target chunk starts every this many rows")
    ap.add_argument("--draft-stride", type=int, default=4, help="a drafting step every this many rows")
    a = ap.parse_args(argv)
    from flashdraft.eval.references import target_stop_ids

    target, drafter = open_engine_inputs(a)
    target32 = drafter32 = None
    if target.dtype != torch.float32:
        target32 = load_target(a.target, dtype="float32", device=a.device)
        drafter32 = DFlashDrafter.from_pretrained(a.drafter, dtype=torch.float32, device=a.device).eval()
    prompts = [list(map(int, p.input_ids)) for p in load_eval_prompts(a.dataset, target, a.prompts)]

    def save(result: dict[str, Any]) -> None:
        if a.out:
            atomic_write_text(a.out, json.dumps(result, indent=1))

    result = run(target, drafter, prompts, a.max_new_tokens, target32=target32, drafter32=drafter32,
                 stop=target_stop_ids(target), max_len=a.max_len, max_budget=a.max_budget, q=a.q, stride=a.stride,
                 draft_stride=a.draft_stride, save=save)  # fmt: skip
    print(report(result))
    return result


if __name__ == "__main__":
    main()
