"""`evaluate()`: offline τ of one or more drafters on an eval set, as one `EvalReport`.

    report = evaluate(target, {"ours": d1, "z-lab": d2}, prompts, budgets=[8, 32, 128], topk=8,
                      max_new_tokens=256)
    report.drafters["ours"].methods["ddtree-32"].tau

The pipeline per prompt: the cached reference (references.py), one teacher-forced target pass
shared by every drafter (the union of their layer ids), then each drafter's replay
(offline.py). References from a server, a batch (`ref_batch` > 1, the default) or a frozen file
(`frozen=read_frozen(path)`) are not exact AR of this target: they are checked against the local
target's argmax and cut at the first disagreement; exact local AR references are checked too, and any float near-tie divergence
between the incremental and the teacher-forced pass is counted with its top-2 margin, never
hidden.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashdraft.drafter import DFlashDrafter
from flashdraft.eval.offline import ReplayItem, SampleResult, replay_batch, teacher_forced
from flashdraft.eval.prompts import EvalPrompt
from flashdraft.eval.references import (
    FrozenSet,
    Reference,
    ReferenceSettings,
    ServerConfig,
    compute_references,
    cut_at_disagreement,
    default_ref_batch,
)
from flashdraft.eval.replay import Method, methods_for
from flashdraft.files import weights_sha256
from flashdraft.target import TargetModel, check_pair, target_fingerprint


@dataclass
class MethodSummary:
    tau: float  # mean over rounds per sample, then over samples (docs/method.md §8.2)
    tau_token_weighted: float  # Σ committed / Σ rounds over all samples
    predicted_tau: float  # the surrogate 1 + Σ q(u), averaged like tau (calibration)
    rounds: int
    histogram: list[int]  # rounds with τ = 1, 2, ..., B


@dataclass
class PairedMethod:
    """One method's per-prompt τ difference (this drafter minus the baseline) over the prompts both ran."""

    delta: float | None  # mean per-prompt Δτ; None when no prompt is shared
    se: float | None  # sample sd of the Δτ / sqrt(n); None when n < 2
    n: int
    verdict: str | None  # "better" (Δ ≥ 2·SE), "worse" (Δ ≤ −2·SE), "neither"; None when n < 2


@dataclass
class PairedComparison:
    baseline: str  # the first drafter of the report
    methods: dict[str, PairedMethod]


def standard_error(xs: list[float]) -> float | None:
    """Sample sd / √n of per-prompt values; None under two."""
    n = len(xs)
    if n < 2:
        return None
    mean = sum(xs) / n
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1) / n)


def paired_method(deltas: list[float]) -> PairedMethod:
    """Mean, standard error and two-SE verdict of per-prompt differences. A zero mean is "neither" even
    when every difference is 0 (SE 0): the same drafter twice is not better than itself."""
    n = len(deltas)
    if n == 0:
        return PairedMethod(None, None, 0, None)
    mean, se = sum(deltas) / n, standard_error(deltas)
    if se is None:
        return PairedMethod(mean, None, n, None)
    if mean > 0 and mean >= 2 * se:
        return PairedMethod(mean, se, n, "better")
    if mean < 0 and mean <= -2 * se:
        return PairedMethod(mean, se, n, "worse")
    return PairedMethod(mean, se, n, "neither")


def paired_comparison(
    baseline: str, base: list[dict[str, Any]], other: list[dict[str, Any]], methods: list[str]
) -> PairedComparison:
    """Per method, `other`'s per-prompt τ minus `base`'s (DrafterReport.per_sample lists), paired by prompt id
    over the prompts both have a τ for."""
    base_tau = {s["id"]: s["tau"] for s in base}
    out = {}
    for m in methods:
        deltas = [
            float(s["tau"][m]) - float(base_tau[s["id"]][m])
            for s in other
            if m in s["tau"] and m in base_tau.get(s["id"], {})
        ]
        out[m] = paired_method(deltas)
    return PairedComparison(baseline, out)


@dataclass
class DrafterReport:
    name: str
    path: str
    block_size: int
    num_layers: int
    methods: dict[str, MethodSummary]
    slot_accuracy: list[float]  # slots 1..B−1, every slot_stride-th chain round: P(draft == reference)
    slot_accuracy_conditional: list[float]  # P(slot k correct | slots < k correct)
    samples: int  # samples with at least one round
    seconds: float
    drafter_forwards: int
    drafter_blocks: int
    per_sample: list[dict[str, Any]] = field(default_factory=list)  # {"id", "tokens", "tau": {method: τ}}
    target_layer_ids: list[int] = field(default_factory=list)  # the target layers whose features it reads
    paired: PairedComparison | None = None  # per-prompt Δτ vs the report's first drafter (None: the first)
    # of the drafter's model.safetensors: which weights the report scored (None: no such file at its path)
    weights_sha256: str | None = None
    reused_from: str | None = None  # the earlier report its results were taken from (`evaluate(reuse=...)`)


@dataclass
class ReferenceStats:
    count: int
    source: str
    temperature: float
    tokens: int  # reference tokens replayed (after truncation)
    computed: int
    cached: int
    seconds: float
    checked: int  # positions compared with the teacher-forced argmax (T=0 only; server/batched: up to the first miss)
    agreed: int
    agreement_rate: float | None
    truncated_samples: int  # server/batched references cut at their first disagreement
    divergences: list[dict[str, Any]] = field(default_factory=list)  # {"id", "index", "margin"}


@dataclass
class EvalReport:
    target: str
    dataset: str
    template: str
    max_new_tokens: int
    temperature: float
    budgets: list[int]
    topk: list[int]
    methods: list[str]
    device: str
    dtype: str
    references: ReferenceStats
    drafters: dict[str, DrafterReport]
    seconds: float
    teacher_forced_seconds: float
    slot_stride: int = 4  # unconditional per-slot accuracy uses every slot_stride-th chain round
    notes: list[str] = field(default_factory=list)
    target_fingerprint: str | None = None  # flashdraft.target.target_fingerprint of the target replayed on

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ReusableReport:
    """An earlier report (`EvalReport.to_dict()`, read from its report.json) whose drafters' results a new
    evaluation may take instead of replaying them: `evaluate(reuse=[...])`, `flashdraft eval --reuse`."""

    path: str
    report: dict[str, Any]


def reuse_mismatch(old: dict[str, Any], want: dict[str, Any]) -> str | None:
    """Why an earlier report's results cannot stand for this evaluation's (None: they can). Greedy only (a sampled
    eval's references depend on its seed and engine); the same dataset, reference length, methods, slot stride,
    dtype and device type; the same target (by fingerprint, or by name for a report that has none). The replayed
    tokens themselves are compared per prompt once this evaluation has its references (`_reuse_refused`)."""
    if want["temperature"] != 0 or old.get("temperature") != 0:
        return "only greedy (temperature 0) results are reused"
    for key in ("dataset", "max_new_tokens", "dtype", "slot_stride"):
        if old.get(key) != want[key]:
            return f"{key} {old.get(key)!r}, this eval's {want[key]!r}"
    if sorted(old.get("methods", [])) != sorted(want["methods"]):
        return f"methods {','.join(old.get('methods', []))}, this eval's {','.join(want['methods'])}"
    kind = str(old.get("device", "")).split(":")[0]
    if kind != want["device"].split(":")[0]:
        return f"device {old.get('device')!r}, this eval's {want['device']!r} (float results differ between them)"
    if old.get("target_fingerprint") is not None:
        if old["target_fingerprint"] != want["target_fingerprint"]:
            return (
                f"target fingerprint {old['target_fingerprint']}, this target's {want['target_fingerprint']}"
            )
    elif old.get("target") != want["target"]:
        return f"target {old.get('target')!r}, this eval's {want['target']!r}"
    return None


def _reuse_refused(entry: dict[str, Any], replayed: dict[str, int]) -> str | None:
    """Why an earlier report's results were not made on this evaluation's references (None: they were): the
    same prompts must have a round, each with the same number of replayed tokens (`replayed`: id → tokens)."""
    had = {s["id"]: s["tokens"] for s in entry["per_sample"]}
    if had == replayed:
        return None
    pid = sorted(set(had.items()) ^ set(replayed.items()))[0][0]
    return f"prompt {pid!r} replayed {had.get(pid)} reference tokens there, {replayed.get(pid)} here"


def _reused(entry: dict[str, Any], source: str, name: str, path: str) -> DrafterReport:
    """A DrafterReport from an earlier report's entry (report.json: NaN written as null)."""
    nan = lambda xs: [float("nan") if x is None else x for x in xs]  # noqa: E731
    fields = {k: v for k, v in entry.items() if k in DrafterReport.__dataclass_fields__}
    return DrafterReport(**{
        **fields, "name": name, "path": path, "paired": None, "reused_from": source,
        "methods": {m: MethodSummary(**v) for m, v in entry["methods"].items()},
        "slot_accuracy": nan(entry["slot_accuracy"]),
        "slot_accuracy_conditional": nan(entry["slot_accuracy_conditional"]),
    })  # fmt: skip


def _as_prompts(prompts: list[EvalPrompt] | list[list[int]]) -> list[EvalPrompt]:
    out = []
    for i, p in enumerate(prompts):
        out.append(
            p if isinstance(p, EvalPrompt) else EvalPrompt(f"p{i:05d}", [int(t) for t in p], "token ids")
        )
    return out


def summarize(
    name: str,
    path: str,
    drafter: DFlashDrafter,
    results: list[SampleResult],
    methods: list[Method],
    seconds: float,
) -> DrafterReport:
    b = drafter.block_size
    ran = [r for r in results if r.methods and any(mr.acceptance_lengths for mr in r.methods.values())]
    summaries: dict[str, MethodSummary] = {}
    for m in methods:
        per = [r.methods[m.name] for r in ran]
        lengths = [t for mr in per for t in mr.acceptance_lengths]
        hist = [0] * b
        for t in lengths:
            hist[t - 1] += 1
        summaries[m.name] = MethodSummary(
            tau=sum(mr.tau for mr in per) / len(per) if per else 0.0,
            tau_token_weighted=sum(lengths) / len(lengths) if lengths else 0.0,
            predicted_tau=sum(sum(mr.predicted) / len(mr.predicted) for mr in per) / len(per) if per else 0.0,
            rounds=len(lengths),
            histogram=hist,
        )

    def ratio(num: list[int], den: list[int]) -> list[float]:
        return [n / d if d else float("nan") for n, d in zip(num, den, strict=True)]

    tot = [sum(r.slot_total[k] for r in ran) for k in range(b - 1)]
    cor = [sum(r.slot_correct[k] for r in ran) for k in range(b - 1)]
    ctot = [sum(r.slot_cond_total[k] for r in ran) for k in range(b - 1)]
    ccor = [sum(r.slot_cond_correct[k] for r in ran) for k in range(b - 1)]
    return DrafterReport(
        name=name, path=path, block_size=b, num_layers=drafter.config.num_hidden_layers, methods=summaries,
        slot_accuracy=ratio(cor, tot), slot_accuracy_conditional=ratio(ccor, ctot), samples=len(ran),
        seconds=seconds, drafter_forwards=sum(r.drafter_forwards for r in results),
        drafter_blocks=sum(r.drafter_blocks for r in results),
        per_sample=[
            {"id": r.id, "tokens": r.reference_tokens, "tau": {k: v.tau for k, v in r.methods.items()}} for r in ran
        ],
        target_layer_ids=list(drafter.target_layer_ids), weights_sha256=weights_sha256(path),
    )  # fmt: skip


def _checked_item(
    target: TargetModel, ref: Reference, max_new_tokens: int, layer_ids: list[int], stats: ReferenceStats
) -> ReplayItem:
    """The teacher-forced pass of one reference, its argmax check (and cut, for server/batched references)."""
    cont = ref.tokens[:max_new_tokens]
    p = len(ref.prompt_ids)
    t1 = time.perf_counter()
    tf = teacher_forced(
        target, ref.prompt_ids + cont, layer_ids, head_from=p - 1
    )  # only the checked positions
    took = time.perf_counter() - t1
    if ref.temperature == 0 and cont:
        # the target's argmax after position p+j−1 must be reference token j
        choice = tf.choice[p - 1 : p - 1 + len(cont)].tolist()
        agree = [c == r for c, r in zip(choice, cont, strict=True)]
        cut = agree.index(False) if cut_at_disagreement(ref.source) and not all(agree) else None
        if cut is not None:
            agree = agree[: cut + 1]  # past a disagreement the reference's context is not the target's
        stats.checked += len(agree)
        stats.agreed += sum(agree)
        for j, ok in enumerate(agree):
            if not ok:
                stats.divergences.append({"id": ref.id, "index": j, "margin": float(tf.margin[p - 1 + j])})
        if cut is not None:
            cont = cont[:cut]  # replay stops at the first disagreement
            stats.truncated_samples += 1
    stats.tokens += len(cont)
    return ReplayItem(ref.id, tf, p, cont, took)


@torch.no_grad()
def evaluate(
    target: TargetModel,
    drafters: dict[str, DFlashDrafter],
    prompts: list[EvalPrompt] | list[list[int]],
    *,
    budgets: list[int] = (8, 16, 32, 64, 128, 256, 512),  # type: ignore[assignment]
    topk: list[int] | int | None = 8,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    stop_token_ids: list[int] | None = None,
    references: list[Reference] | None = None,
    cache_dir: str | Path | None = None,
    server: ServerConfig | None = None,
    ref_batch: int | None = None,  # rows per batched greedy reference generation (None: default_ref_batch)
    ref_engine: str | None = None,  # batched references: "loop" | "native" (None: native on CUDA)
    frozen: FrozenSet | None = None,  # a frozen reference set (read_frozen): its references, checked and cut
    dataset: str = "",
    drafter_paths: dict[str, str] | None = None,
    progress: bool = True,
    group: int = 16,
    first_slots: int = 2,
    slot_stride: int = 4,
    reuse: list[ReusableReport] | None = None,
) -> EvalReport:
    """Offline τ (chain, each DDTree budget, the top-k streak) of every drafter on `prompts`. `reuse`: earlier
    reports; a drafter whose weights (sha256 of its model.safetensors, `drafter_paths`) one of them scored under
    the same settings (`reuse_mismatch`) is not replayed: its results are taken from there once this evaluation's
    references show they were made on the same ones (the same prompts, the same replayed tokens each); where not,
    it is replayed after all, and the report's notes say why."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    if not drafters:
        raise ValueError("evaluate needs at least one drafter")
    for name, d in drafters.items():
        try:
            check_pair(target, d.config)
        except ValueError as e:
            raise ValueError(f"drafter {name!r}: {e}") from None
    methods = methods_for(sorted(set(budgets)), topk)
    prompts = _as_prompts(prompts)
    frozen_notes: list[str] = []
    if frozen is not None:
        if references is not None:
            raise ValueError("give references or frozen, not both")
        if temperature != 0:
            raise ValueError(f"{frozen.path}: frozen references are greedy; evaluate them at temperature 0")
        if max_new_tokens > frozen.max_new_tokens:
            raise ValueError(
                f"max_new_tokens {max_new_tokens} > the {frozen.max_new_tokens} tokens of {frozen.path}: "
                f"use --max-new-tokens {frozen.max_new_tokens} or less"
            )
        references = frozen.references
        same = frozen.fingerprint == target_fingerprint(target)
        frozen_notes.append(
            f"frozen references {frozen.path.name} ({frozen.target}, {frozen.dtype}, fingerprint "
            f"{frozen.fingerprint}: {'this target' if same else 'another target or dtype than this one'})"
        )
    if references is None:
        settings = ReferenceSettings(max_new_tokens, temperature, seed, stop_token_ids)
        batch = ref_batch if ref_batch is not None else default_ref_batch(target.device)
        rs = compute_references(
            target, prompts, settings, cache_dir=cache_dir, server=server, progress=progress, batch_size=batch,
            batch_engine=ref_engine,
        )  # fmt: skip
        refs, computed, cached, ref_s = rs.references, rs.computed, rs.cached, rs.seconds
    else:
        refs, computed, cached, ref_s = list(references), 0, len(references), 0.0
    source = refs[0].source if refs else "local"
    paths = drafter_paths or {}
    run_fingerprint = target_fingerprint(target)
    want = {
        "temperature": temperature, "dataset": dataset, "max_new_tokens": max_new_tokens, "slot_stride": slot_stride,
        "dtype": str(target.dtype).removeprefix("torch."), "methods": [m.name for m in methods],
        "device": str(target.device), "target": getattr(target, "name", "target"),
        "target_fingerprint": run_fingerprint,
    }  # fmt: skip
    taken = _reusable(reuse or [], drafters, paths, want)  # name -> (report path, its entry)
    union: list[int] = []
    for name, d in drafters.items():
        if name not in taken:
            union += [i for i in d.target_layer_ids if i not in union]
    if not union:  # every drafter reused: the references are still checked
        union = list(next(iter(drafters.values())).target_layer_ids)

    results: dict[str, list[SampleResult]] = {n: [] for n in drafters}
    seconds = dict.fromkeys(drafters, 0.0)
    stats = ReferenceStats(len(refs), source, temperature, 0, computed, cached, ref_s, 0, 0, None, 0)
    replayed: dict[str, int] = {}  # prompt id -> reference tokens replayed (the prompts with a round)

    def replay_pass(names: list[str], layer_ids: list[int], stats: ReferenceStats, desc: str) -> float:
        """Every reference checked (into `stats`), teacher-forced once (features of `layer_ids`), replayed by the
        drafters `names`, in groups; the seconds of the teacher-forced passes."""
        tf_s = 0.0
        bar = tqdm(total=len(refs), desc=desc, disable=not progress, unit="prompt")
        for a in range(0, len(refs), max(1, group)):
            items = [
                _checked_item(target, ref, max_new_tokens, layer_ids, stats) for ref in refs[a : a + group]
            ]
            tf_s += sum(it.tf_seconds for it in items)
            replayed.update({it.id: len(it.reference) for it in items if len(it.reference) >= 2})
            for name in names:
                t1 = time.perf_counter()
                results[name] += replay_batch(
                    target, drafters[name], items, methods, first_slots=first_slots, slot_stride=slot_stride
                )
                seconds[name] += time.perf_counter() - t1
            bar.update(len(items))
        bar.close()
        return tf_s

    tf_s = replay_pass([n for n in drafters if n not in taken], union, stats, "offline τ")
    stats.agreement_rate = stats.agreed / stats.checked if stats.checked else None
    reports: dict[str, DrafterReport] = {}
    reuse_notes = []
    for n, (src, entry) in taken.items():
        why = _reuse_refused(entry, replayed)
        if why is None:
            reports[n] = _reused(entry, src, n, paths.get(n, ""))
            reuse_notes.append(f"{n}: results reused from {src} (the same weights, settings and references)")
        else:
            reuse_notes.append(f"{n}: not reused from {src}, replayed: {why}")
    again = [n for n in taken if n not in reports]
    if again:  # (rare) the same settings, other references: float near-ties on another GPU, say
        layer_ids = list(dict.fromkeys(i for n in again for i in drafters[n].target_layer_ids))
        scratch = ReferenceStats(len(refs), source, temperature, 0, computed, cached, ref_s, 0, 0, None, 0)
        tf_s += replay_pass(again, layer_ids, scratch, "offline τ (not reused)")
    for n, d in drafters.items():
        if n not in reports:
            reports[n] = summarize(n, paths.get(n, ""), d, results[n], methods, seconds[n])
    reports = {n: reports[n] for n in drafters}  # the drafters' order: the first is the baseline
    first, *later = reports
    for n in later:
        reports[n].paired = paired_comparison(
            first, reports[first].per_sample, reports[n].per_sample, [m.name for m in methods]
        )
    notes = [
        "ddtree-N: a DDTree of N nodes (root excluded), tau <= N+1; topk-K: top-k streak (reference token in the "
        "drafter's top-K at every slot, the acceptance of a full top-K-per-slot tree), tau <= B",
    ]
    notes += frozen_notes
    notes += reuse_notes
    if stats.divergences:
        notes.append(
            f"{len(stats.divergences)} reference tokens differ from the teacher-forced argmax "
            f"(float near-ties; smallest margin {min(x['margin'] for x in stats.divergences):.3g})"
        )
    return EvalReport(
        target=getattr(target, "name", "target"), dataset=dataset,
        template=refs[0].template if refs else "", max_new_tokens=max_new_tokens, temperature=temperature,
        budgets=sorted(set(budgets)), topk=[m.size for m in methods if m.kind == "topk"],
        methods=[m.name for m in methods], device=str(target.device), dtype=str(target.dtype).removeprefix("torch."),
        references=stats, drafters=reports, seconds=time.perf_counter() - t0, teacher_forced_seconds=tf_s,
        slot_stride=slot_stride, notes=notes, target_fingerprint=run_fingerprint,
    )  # fmt: skip


def _reusable(
    reuse: list[ReusableReport],
    drafters: dict[str, DFlashDrafter],
    paths: dict[str, str],
    want: dict[str, Any],
) -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (report path, entry) for each drafter an earlier report scored with the same weights and settings
    (the first such report). A report that scored the weights under other settings is passed over."""
    taken: dict[str, tuple[str, dict[str, Any]]] = {}
    if not reuse:  # no weights hashed for nothing (summarize hashes each replayed drafter's once)
        return taken
    for name in drafters:
        sha = weights_sha256(paths[name]) if paths.get(name) else None
        if sha is None:
            continue
        for r in reuse:
            entry = next(
                (e for e in r.report.get("drafters", {}).values() if e.get("weights_sha256") == sha), None
            )
            if entry is not None and reuse_mismatch(r.report, want) is None:
                taken[name] = (r.path, entry)
                break
    return taken
