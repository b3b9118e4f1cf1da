"""The campaign's learning curve: chain and best-DDTree τ against cumulative GPU training minutes and against
distinct training tokens, from a JSONL of stints (one benchmarks/gpu/campaign_stint.py stint.json per line).

    python benchmarks/plot_learning_curve.py benchmarks/results/campaign/stints.jsonl --out curve.png --table

A row needs "stint", "train_minutes" and "new": {"loss_tokens"} (this stint's training minutes and the train
loss tokens it regenerated; the plot adds both up in stint order) and "eval": {SET: {"chain_tau", "ddtree_tau"}} (the stint's own eval on the GPU) and/or
"yardstick": {FILE_STEM: {"new": {"chain_tau", "ddtree_tau"}}} (benchmarks/campaign_ingest.py's eval on a frozen
yardstick file); a row with neither plots its trainer validation ("val": {"val/chain_tau", "val/ddtree_tau"}) as
the set "val". A starting point (the drafter the campaign began from) is a row like any other, with its own
training minutes and tokens.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class CurvePoint:
    stint: int
    train_minutes: float  # cumulative, up to and including this stint
    loss_tokens: (
        int  # train loss tokens regenerated so far (every stint's new data, up to and including this one)
    )
    tau: dict[str, tuple[float, float | None]]  # set -> (chain τ, best DDTree τ)


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The stints of a stints.jsonl ([] when it does not exist yet); a bad line is a ValueError naming it."""
    path = Path(path)
    rows = []
    for n, line in enumerate(path.read_text().splitlines() if path.is_file() else [], start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg}): fix or remove the line") from None
    return rows


def curve(rows: list[dict[str, Any]]) -> list[CurvePoint]:
    """Rows in stint order, training minutes accumulated, τ per eval set (or the trainer's validation)."""
    out, minutes, tokens = [], 0.0, 0
    for r in sorted(rows, key=lambda r: r["stint"]):
        minutes += float(r.get("train_minutes") or 0.0)
        tokens += int((r.get("new") or {}).get("loss_tokens") or 0)
        tau = {k: (float(v["chain_tau"]), v.get("ddtree_tau")) for k, v in (r.get("eval") or {}).items()}
        for k, v in (r.get("yardstick") or {}).items():  # the stint's drafter on a frozen yardstick file
            tau[k] = (float(v["new"]["chain_tau"]), v["new"].get("ddtree_tau"))
        val = r.get("val") or {}
        if not tau and "val/chain_tau" in val:
            tau["val"] = (float(val["val/chain_tau"]), val.get("val/ddtree_tau"))
        out.append(
            CurvePoint(
                int(r["stint"]),
                round(minutes, 3),
                tokens,
                tau,
            )
        )
    return out


def table(points: list[CurvePoint]) -> str:
    """The results page's table: one row per stint, chain / best DDTree τ per set."""
    sets = sorted({s for p in points for s in p.tau})
    head = "| stint | GPU training min (cumulative) | loss tokens regenerated (cumulative) | " + " | ".join(
        f"{s} chain / DDTree τ" for s in sets) + " |"  # fmt: skip
    lines = [head, "|" + "---:|" * (3 + len(sets))]
    for p in points:
        cells = []
        for s in sets:
            c, d = p.tau.get(s, (None, None))
            cells.append("-" if c is None else f"{c:.2f} / {d:.2f}" if d is not None else f"{c:.2f} / -")
        lines.append(
            f"| {p.stint} | {p.train_minutes:.1f} | {p.loss_tokens / 1e6:.2f}M | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def plot(points: list[CurvePoint], out: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    sets = sorted({s for p in points for s in p.tau})
    for ax, xkey, xlabel in ((axes[0], "train_minutes", "cumulative GPU training minutes"),
                             (axes[1], "loss_tokens", "training (loss) tokens regenerated so far, millions")):  # fmt: skip
        for k, s in enumerate(sets):
            pts = [p for p in points if s in p.tau]
            xs = [getattr(p, xkey) / (1e6 if xkey == "loss_tokens" else 1) for p in pts]
            color = f"C{k}"
            ax.plot(xs, [p.tau[s][0] for p in pts], marker="o", color=color, label=f"{s} chain")
            tree = [(x, p.tau[s][1]) for x, p in zip(xs, pts, strict=True) if p.tau[s][1] is not None]
            if tree:
                ax.plot([x for x, _ in tree], [y for _, y in tree], marker="s", ls="--", color=color,
                        label=f"{s} best DDTree")  # fmt: skip
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("τ (accepted tokens per round)")
    axes[0].legend(fontsize=8)
    fig.suptitle("drafter learning curve (one point per stint)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stints", help="JSONL: one stint.json per line")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--table", action="store_true", help="also print the markdown table")
    a = ap.parse_args(argv)
    try:
        points = curve(read_rows(a.stints))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not points:
        raise SystemExit(f"{a.stints}: no stints")
    plot(points, a.out)
    if a.table:
        print(table(points), end="")
    print(f"wrote {a.out}: {len(points)} stints")


if __name__ == "__main__":
    main()
