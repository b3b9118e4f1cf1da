"""Speed benchmark: real generation, AR vs chain vs DDTree budgets, on one engine.

    flashdraft bench --drafter runs/x --dataset humaneval --limit 8 --methods ar,chain,ddtree:16,ddtree:64
    flashdraft bench --drafter runs/x --methods auto,ar,chain,ddtree:8 --tau-report eval-reports/humaneval
    report = bench(target, drafter, prompts, methods=["ar", "chain", "ddtree:64"], max_new_tokens=128)

Time per output token (TPOT), tokens/s, speedup over AR *on the same engine*, and τ, as a
table and JSON (docs/method.md §11.5: speedup and τ are always reported together). The engine is
`flashdraft.decode.generate` (reference, transformers) or, when importable and asked for (the
default on CUDA), the fast CUDA-graph engine `flashdraft.decode.engine`; a target the fast
engine cannot run falls back to the reference one, and the report says which ran. At T=0 every
speculative output is also compared with AR's, token for token (`identical_to_ar`). Methods take turns
on each prompt (after every method's untimed warm-up), so a drift of the machine during the run reaches
all of them alike.
Method "auto" (flashdraft/decode/budget.py) is calibrated before any timing and keeps learning from
prompt to prompt; the report's notes say what it ran.
"""

from __future__ import annotations

import copy
import functools
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from flashdraft.decode.backend import pick_engine
from flashdraft.drafter import DFlashDrafter
from flashdraft.eval.prompts import EvalPrompt
from flashdraft.target import TargetModel, check_pair


@dataclass
class BenchRow:
    method: str  # "ar" | "chain" | "ddtree:N" | "auto"
    engine: str
    prompts: int
    tokens: int
    seconds: float
    tpot_ms: float  # time per output token
    tokens_per_s: float
    speedup: float | None  # AR TPOT / this TPOT on the same engine (None without an AR row)
    tau: float | None  # mean over prompts of the mean tokens per round (None for AR)
    identical_to_ar: int | None = None  # prompts whose tokens equal AR's (T=0 only)
    # where the time went, from the decoders' own timings: the prefill per prompt, a decoding round, and per prompt
    # what is neither (request checks, engine lookup and set-up, the result's assembly)
    prefill_ms: float | None = None
    round_ms: float | None = None
    other_ms: float | None = None


@dataclass
class BenchReport:
    target: str
    drafter: str
    dataset: str
    template: str
    device: str
    dtype: str
    max_new_tokens: int
    temperature: float
    engine: str
    rows: list[BenchRow]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_methods(text: str) -> list[tuple[str, int | None]]:
    out: list[tuple[str, int | None]] = []
    for part in text.split(","):
        p = part.strip().lower()
        if p in ("ar", "chain", "auto"):
            out.append((p, None))
        elif p.startswith("ddtree:") and p[7:].isdigit():
            out.append(("ddtree", int(p[7:])))
        else:
            raise ValueError(
                f"--methods: unknown method {part!r}: use ar, chain, auto or ddtree:N (e.g. ddtree:64)"
            )
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def bench(
    target: TargetModel,
    drafter: DFlashDrafter | None,
    prompts: list[EvalPrompt],
    *,
    methods: list[tuple[str, int | None]] | str = "ar,chain,ddtree:16,ddtree:64",
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    stop_token_ids: list[int] | None = None,
    engine: str = "auto",
    warmup: int = 1,
    seed: int = 0,
    dataset: str = "",
    drafter_name: str = "",
    progress: bool = True,
    tau_report: str | None = None,  # method auto: an eval report with the drafter's τ per budget
    compile: bool = False,  # the fast engine's forwards through torch.compile
    graph_prefill: bool = False,  # the fast engine's prefill as a CUDA graph per prompt-length bucket
) -> BenchReport:
    from tqdm import tqdm

    from flashdraft.eval.references import target_stop_ids

    todo = parse_methods(methods) if isinstance(methods, str) else list(methods)
    if drafter is not None:
        check_pair(target, drafter.config)
    elif any(m != "ar" for m, _ in todo):
        raise ValueError("chain / ddtree methods need a drafter (--drafter)")
    stop = stop_token_ids if stop_token_ids is not None else target_stop_ids(target)
    engine_name, gen = pick_engine(target, engine, compile, graph_prefill)  # raises ValueError: one line
    if engine_name != "reference":
        # one engine for every prompt, built (and its graphs captured) in the warm-up
        longest = max((len(p.input_ids) for p in prompts), default=0) + max_new_tokens
        gen = functools.partial(gen, max_len=max(2048, longest))
    policy = None
    if any(m == "auto" for m, _ in todo):
        from flashdraft.decode.budget import auto_policy

        policy = auto_policy(
            target, drafter, gen, engine=engine_name, tau_report=tau_report, report_drafter=drafter_name or None
        )
    kws: dict[str, dict[str, Any]] = {}
    for method, budget in todo:
        label = method if budget is None else f"{method}:{budget}"
        kws[label] = dict(
            max_new_tokens=max_new_tokens, method=method, budget=budget, temperature=temperature,
            stop_token_ids=stop, **({"policy": policy} if method == "auto" else {}),
        )  # fmt: skip
    # AR gets the drafter too (it ignores it): the fast engine keeps one engine per (target, drafter), and AR on
    # an engine of its own would rebuild it, and recapture every method's CUDA graphs, twice per prompt below
    for kw in kws.values():  # CUDA-graph capture, allocator warm-up: not timed
        for p in prompts[:warmup]:
            # auto warms up on a copy: what its policy learns (and explores) counts only in the timed runs
            warm = {**kw, "policy": copy.deepcopy(policy)} if kw["method"] == "auto" else kw
            gen(target, drafter, p.input_ids, **warm, seed=seed)
    if graph_prefill:  # each prompt length bucket's prefill graph captured here, not in a timed run
        # AR's prefill and the drafted methods' (which also writes the drafter's context) are graphs of their own
        for method in ["ar"] + (["chain"] if any(m != "ar" for m, _ in todo) else []):
            for p in prompts[warmup:]:
                gen(target, drafter, p.input_ids, max_new_tokens=1, method=method, temperature=temperature,
                    stop_token_ids=stop, seed=seed)  # fmt: skip
    # prompt by prompt, every method in turn: a clock or thermal drift during the run reaches all methods alike
    seconds = dict.fromkeys(kws, 0.0)
    parts = {label: [0.0, 0.0, 0] for label in kws}  # prefill s, decode s, rounds
    outs: dict[str, list[list[int]]] = {label: [] for label in kws}
    taus: dict[str, list[float]] = {label: [] for label in kws}
    bar = tqdm(
        total=len(kws) * len(prompts), desc=f"bench ({engine_name})", disable=not progress, unit="run"
    )
    labels = list(kws)
    for i, p in enumerate(prompts):
        # each method in turn goes first on a prompt: what a prompt's first run pays (a new prompt length's first
        # kernels) falls on every method alike
        for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
            kw = kws[label]
            _sync(target.device)
            t0 = time.perf_counter()
            res = gen(target, drafter, p.input_ids, **kw, seed=seed)
            _sync(target.device)
            seconds[label] += time.perf_counter() - t0
            part = parts[label]
            part[0] += res.timings.prefill_s
            part[1] += res.timings.decode_s
            part[2] += res.rounds
            outs[label].append(res.tokens)
            if kw["method"] != "ar" and res.acceptance_lengths:
                taus[label].append(res.mean_acceptance)
            bar.update(1)
    ar_tokens = outs.get("ar")
    rows: list[BenchRow] = []
    for label in kws:
        tokens, secs = sum(len(o) for o in outs[label]), seconds[label]
        same = None
        if label != "ar" and ar_tokens is not None and temperature == 0:
            same = sum(a == b for a, b in zip(ar_tokens, outs[label], strict=True))
        prefill_s, decode_s, rounds = parts[label]
        n = max(len(prompts), 1)
        rows.append(BenchRow(label, engine_name, len(prompts), tokens, secs,
                             secs / tokens * 1e3 if tokens else float("nan"), tokens / secs if secs else 0.0, None,
                             sum(taus[label]) / len(taus[label]) if taus[label] else None, same,
                             prefill_ms=prefill_s / n * 1e3, round_ms=decode_s / rounds * 1e3 if rounds else None,
                             other_ms=(secs - prefill_s - decode_s) / n * 1e3))  # fmt: skip
    bar.close()
    ar = next((r for r in rows if r.method == "ar"), None)
    for r in rows:
        if ar is not None and r.tpot_ms > 0:
            r.speedup = ar.tpot_ms / r.tpot_ms
    notes = []
    if policy is not None:
        ran = ", ".join(f"{k} ×{n}" for k, n in policy.counts.items())
        cost = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in policy.seconds.items())
        notes.append(f"auto chose (per choice): {ran}; calibrated round cost: {cost}")
        auto = next((r for r in rows if r.method == "auto"), None)
        fixed = [r for r in rows if r.method != "auto"]
        if auto is not None and fixed:
            best = max(fixed, key=lambda r: r.tokens_per_s)
            notes.append(
                f"auto: {auto.tokens_per_s / best.tokens_per_s:.1%} of the best fixed method's tokens/s "
                f"({best.method}, {best.tokens_per_s:.1f})"
            )
    if engine == "fast" or (engine == "auto" and target.device.type == "cuda"):
        if engine_name == "reference":
            notes.append("the fast engine could not run this target: the reference engine was used")
    return BenchReport(
        target=getattr(target, "name", "target"), drafter=drafter_name, dataset=dataset,
        template=prompts[0].template if prompts else "", device=str(target.device),
        dtype=str(target.dtype).removeprefix("torch."), max_new_tokens=max_new_tokens, temperature=temperature,
        engine=engine_name, rows=rows, notes=notes,
    )  # fmt: skip


def bench_table(report: BenchReport) -> str:
    lines = [
        f"**target** {report.target} · **drafter** {report.drafter or '—'} · **dataset** {report.dataset} "
        f"({report.rows[0].prompts if report.rows else 0} prompts, {report.template}) · **engine** {report.engine} "
        f"on {report.device} ({report.dtype}) · **max_new_tokens** {report.max_new_tokens} · **T** {report.temperature:g}",
        "",
        "| method | tokens | TPOT ms | tokens/s | speedup vs AR | τ | identical to AR "
        "| prefill ms | round ms | other ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report.rows:
        sp = "—" if r.speedup is None else f"{r.speedup:.2f}×"
        tau = "—" if r.tau is None else f"{r.tau:.2f}"
        same = "—" if r.identical_to_ar is None else f"{r.identical_to_ar}/{r.prompts}"
        split = " | ".join("—" if v is None else f"{v:.2f}" for v in (r.prefill_ms, r.round_ms, r.other_ms))
        lines.append(
            f"| {r.method} | {r.tokens} | {r.tpot_ms:.2f} | {r.tokens_per_s:.1f} | {sp} | {tau} | {same} | {split} |"
        )
    lines.append(
        "\n_prefill ms and other ms: per prompt (other: request checks, engine set-up, the result's assembly); "
        "round ms: a decoding round, the host's reads included_"
    )
    lines += [f"\n_{n}_" for n in report.notes]
    return "\n".join(lines) + "\n"
