"""Eval reports: JSON with every number, a Markdown table, PNG plots (matplotlib, Agg).

    files = write_report(report, "out/eval")           # report.json, report.md, *.png
    print(markdown_table(report))
    plot_watch_log("RUN/eval/log.jsonl", "RUN/eval/tau_over_steps.png")

Labels follow docs/method.md §9.3: `ddtree-N` is a DDTree of N nodes (τ ≤ N+1); `topk-K` is the
top-k streak (τ ≤ B). The prompt formatting and max_new_tokens are written into every report.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashdraft.eval.evaluate import EvalReport
from flashdraft.files import atomic_write_text  # also imported from here by eval/cli.py and eval/watch.py


@dataclass
class ReportFiles:
    json: Path
    markdown: Path
    plots: list[Path]


def _clean(x: Any) -> Any:
    """JSON has no NaN: write null (a slot never compared)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def report_json(report: EvalReport | dict[str, Any]) -> str:
    d = report.to_dict() if isinstance(report, EvalReport) else report
    return json.dumps(_clean(d), indent=1) + "\n"


def _fmt(x: float | None, nd: int = 2) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def markdown_table(report: EvalReport) -> str:
    """τ per drafter (rows) and method (columns), then calibration and per-slot accuracy."""
    r = report
    lines = [
        f"**target** {r.target} · **dataset** {r.dataset or '—'} ({r.references.count} prompts, "
        f"{r.references.tokens} reference tokens) · **prompt format** {r.template} · "
        f"**max_new_tokens** {r.max_new_tokens} · **T** {r.temperature:g} · references {r.references.source}",
        "",
        "τ = tokens committed per round, mean over rounds per prompt then over prompts. "
        "`ddtree-N`: DDTree with N nodes (root excluded, τ ≤ N+1). "
        "`topk-K`: top-k streak (reference token within the drafter's top-K at every slot; τ ≤ B) — not a DDTree budget.",
        "",
        "| drafter | block size | layers | feature layers | path |",
        "|---|---:|---:|---|---|",
    ]
    for name, d in r.drafters.items():
        layers = ",".join(str(i) for i in d.target_layer_ids) or "—"
        lines.append(f"| {name} | {d.block_size} | {d.num_layers} | {layers} | {d.path or '—'} |")
    lines += ["", "| drafter | " + " | ".join(r.methods) + " |", "|---|" + "---:|" * len(r.methods)]
    for name, d in r.drafters.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(d.methods[m].tau) for m in r.methods) + " |")
    lines += paired_table(report)
    lines += ["", "Surrogate τ (1 + Σ q over drafted prefixes) vs measured:", "",
              "| drafter | " + " | ".join(r.methods) + " |", "|---|" + "---:|" * len(r.methods)]  # fmt: skip
    for name, d in r.drafters.items():
        cells = [f"{_fmt(d.methods[m].predicted_tau)} / {_fmt(d.methods[m].tau)}" for m in r.methods]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    b = max(d.block_size for d in r.drafters.values())
    lines += ["", f"Per-slot accuracy: unconditional over every {r.slot_stride}th chain round (conditional on all earlier slots correct, over all chain rounds):", "",
              "| drafter | " + " | ".join(f"s{k}" for k in range(1, b)) + " |", "|---|" + "---:|" * (b - 1)]  # fmt: skip
    for name, d in r.drafters.items():
        cells = [
            f"{_fmt(u)} ({_fmt(c)})"
            for u, c in zip(d.slot_accuracy, d.slot_accuracy_conditional, strict=True)
        ]
        cells += [""] * (b - 1 - len(cells))  # a smaller block has no such slot: blank, not a short row
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ref = r.references
    if ref.agreement_rate is not None:
        lines += ["", f"Reference vs teacher-forced argmax: {ref.agreed}/{ref.checked} agree "
                  f"({100 * ref.agreement_rate:.2f}%), {ref.truncated_samples} server/batched references cut at the first "
                  f"disagreement, {len(ref.divergences)} divergences."]  # fmt: skip
    replays = ", ".join(
        f"{d.name} {'reused' if d.reused_from else f'{d.seconds:.1f} s'}" for d in r.drafters.values()
    )
    lines += ["", f"Time: {r.seconds:.1f} s in all after the target loaded; references {ref.seconds:.1f} s "
              f"({ref.computed} computed, {ref.cached} read), teacher-forced passes {r.teacher_forced_seconds:.1f} s, "
              f"replays: {replays}."]  # fmt: skip
    for note in r.notes:
        lines.append(f"\n_{note}_")
    return "\n".join(lines) + "\n"


def paired_table(report: EvalReport) -> list[str]:
    """Markdown lines: each later drafter's mean per-prompt Δτ ± SE against the first drafter, per method, with
    the two-SE verdict (n < 2: no verdict). No lines for a single drafter."""
    rows = [(name, d.paired) for name, d in report.drafters.items() if d.paired is not None]
    if not rows:
        return []
    lines = ["", f"Paired per prompt against {rows[0][1].baseline}: mean Δτ ± SE (sample sd / √n) over the prompts "
             "both ran; better / worse when |Δ| ≥ 2 SE:", "",
             "| drafter | n | " + " | ".join(report.methods) + " |", "|---|---:|" + "---:|" * len(report.methods)]  # fmt: skip
    for name, p in rows:
        cells = []
        for m in report.methods:
            pm = p.methods.get(m)
            if pm is None or pm.delta is None:
                cells.append("—")
                continue
            cell = f"{pm.delta:+.2f}" + (f" ± {pm.se:.2f}" if pm.se is not None else "")
            cells.append(cell + (f" {pm.verdict}" if pm.verdict in ("better", "worse") else ""))
        n = max((pm.n for pm in p.methods.values()), default=0)
        lines.append(f"| {name} | {n} | " + " | ".join(cells) + " |")
    return lines


def _plt():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:  # type: ignore[no-untyped-def]
    """Write a finished figure as PNG (folder created) and free it."""
    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def plot_tau(report: EvalReport, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, d) in enumerate(report.drafters.items()):
        color = f"C{i}"
        xs = report.budgets
        ax.plot(xs, [d.methods[f"ddtree-{b}"].tau for b in xs], "o-", color=color, label=f"{name}: DDTree-N")
        ax.plot(xs, [d.methods[f"ddtree-{b}"].predicted_tau for b in xs], "x:", color=color, alpha=0.6,
                label=f"{name}: surrogate 1+Σq")  # fmt: skip
        ax.axhline(
            d.methods["chain"].tau,
            color=color,
            ls="--",
            lw=1,
            label=f"{name}: chain {d.methods['chain'].tau:.2f}",
        )
        for k in report.topk:
            ax.axhline(d.methods[f"topk-{k}"].tau, color=color, ls="-.", lw=0.8, alpha=0.6)
            ax.text(
                xs[0] if xs else 1,
                d.methods[f"topk-{k}"].tau,
                f" top-{k} streak",
                color=color,
                fontsize=7,
                va="bottom",
            )
    if report.budgets:
        ax.set_xscale("log", base=2)
        ax.set_xticks(report.budgets, [str(b) for b in report.budgets])
    ax.set_xlabel("DDTree budget (nodes, root excluded)")
    ax.set_ylabel("τ (tokens per round)")
    ax.set_title(
        f"{report.dataset}: τ at T={report.temperature:g}, max_new_tokens={report.max_new_tokens}",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def plot_slots(report: EvalReport, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (name, d) in enumerate(report.drafters.items()):
        xs = list(range(1, d.block_size))
        ax.plot(xs, d.slot_accuracy, "o-", color=f"C{i}", label=f"{name}: unconditional")
        ax.plot(
            xs,
            d.slot_accuracy_conditional,
            "s--",
            color=f"C{i}",
            alpha=0.7,
            label=f"{name}: given earlier slots correct",
        )
    ax.set_xlabel("block slot k")
    ax.set_ylabel("P(draft == reference)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Per-slot accuracy (chain rounds)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_histograms(report: EvalReport, path: Path) -> Path:
    plt = _plt()
    shown = ["chain"] + ([f"ddtree-{max(report.budgets)}"] if report.budgets else [])
    fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 3.6), squeeze=False)
    n = len(report.drafters)
    for j, m in enumerate(shown):
        ax = axes[0][j]
        for i, (name, d) in enumerate(report.drafters.items()):
            h = d.methods[m].histogram
            tot = max(sum(h), 1)
            xs = [t + 1 + (i - (n - 1) / 2) * 0.8 / n for t in range(len(h))]
            ax.bar(xs, [c / tot for c in h], width=0.8 / n, color=f"C{i}", label=name)
        ax.set_xlabel("τ (tokens committed in a round)")
        ax.set_ylabel("fraction of rounds")
        ax.set_title(f"Acceptance histogram: {m}", fontsize=10)
        ax.legend(fontsize=7)
    return _save(fig, path)


def write_report(report: EvalReport, out_dir: str | Path, stem: str = "report") -> ReportFiles:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    j, md = out / f"{stem}.json", out / f"{stem}.md"
    atomic_write_text(j, report_json(report))
    atomic_write_text(md, markdown_table(report))
    plots = [
        plot_tau(report, out / f"{stem}_tau.png"),
        plot_slots(report, out / f"{stem}_slots.png"),
        plot_histograms(report, out / f"{stem}_histogram.png"),
    ]
    return ReportFiles(j, md, plots)


def plot_watch_log(log_path: str | Path, path: str | Path) -> Path | None:
    """τ over training steps from RUN/eval/log.jsonl (chain and every DDTree budget)."""
    rows = [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
    if not rows:
        return None
    rows.sort(key=lambda r: r["step"])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["tau_chain"] for r in rows], "o-", label="chain")
    budgets = sorted({int(b) for r in rows for b in r.get("tau_ddtree", {})})
    for b in budgets:
        ax.plot(
            steps, [r.get("tau_ddtree", {}).get(str(b)) for r in rows], ".-", label=f"DDTree-{b}", alpha=0.8
        )
    ax.set_xlabel("training step")
    ax.set_ylabel("τ (offline replay)")
    ax.set_title("τ over training", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)
