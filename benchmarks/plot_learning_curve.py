"""The campaign's learning curve: chain and best-DDTree τ against cumulative GPU training minutes and against
distinct training tokens, from a JSONL of stints (one benchmarks/gpu/campaign_stint.py stint.json per line).

    python benchmarks/plot_learning_curve.py benchmarks/results/campaign/stints.jsonl --out curve.png --table

A row needs "stint", "train_minutes" and "new": {"loss_tokens"} (this stint's training minutes and the train
loss tokens it regenerated; the plot adds both up in stint order) and "eval": {SET: {"chain_tau", "ddtree_tau"}} (the stint's own eval on the GPU) and/or
"yardstick": {FILE_STEM: {"new": {"chain_tau", "ddtree_tau"}}} (benchmarks/campaign_ingest.py's eval on a frozen
yardstick file); a row with neither plots its trainer validation ("val": {"val/chain_tau", "val/ddtree_tau"}) as
the set "val". A starting point (the drafter the campaign began from) is a row like any other, with its own
training minutes and tokens.

`--fit-from K` fits τ ≈ a + b·ln(cumulative training minutes) to the stints from K on, per set and for the chain
and the best DDTree, draws it dotted, and prints the gain per doubling of the minutes; each `--goal
SET:chain=4.0` (or `SET:ddtree=8`) adds the minutes at which that fit reaches it. An extrapolation of the recipe
as it ran (its data grew with its minutes), not a measurement.

    python benchmarks/plot_learning_curve.py benchmarks/results/campaign/stints.jsonl --out curve.png --table \
        --fit-from 3 --goal humaneval-164:chain=4 --goal humaneval-164:ddtree=8 --goal sharegpt-heldout-100:chain=5
"""

from __future__ import annotations

import argparse
import json
import math
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


KINDS = ("chain", "ddtree")  # the two τ of a point, in CurvePoint.tau's order


@dataclass(frozen=True)
class Trend:
    """τ ≈ a + b·ln(cumulative training minutes), least squares over the stints from `from_stint` on."""

    set: str
    kind: str  # "chain" | "ddtree"
    from_stint: int
    points: int
    a: float
    b: float

    @property
    def per_doubling(self) -> float:
        return self.b * math.log(2)

    def at(self, minutes: float) -> float:
        return self.a + self.b * math.log(minutes)

    def minutes_for(self, tau: float) -> float:
        """Cumulative training minutes at which the fit reaches `tau` (inf when it does not rise)."""
        return math.exp((tau - self.a) / self.b) if self.b > 0 else math.inf


def trend(points: list[CurvePoint], set_: str, kind: str, from_stint: int) -> Trend | None:
    """The fit for one set and kind, or None with fewer than 3 measured stints or a single minute count."""
    i = KINDS.index(kind)
    xy = [(math.log(p.train_minutes), p.tau[set_][i]) for p in points
          if p.stint >= from_stint and set_ in p.tau and p.tau[set_][i] is not None and p.train_minutes > 0]  # fmt: skip
    if len(xy) < 3:
        return None
    mx, my = sum(x for x, _ in xy) / len(xy), sum(y for _, y in xy) / len(xy)
    sxx = sum((x - mx) ** 2 for x, _ in xy)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in xy) / sxx
    return Trend(set_, kind, from_stint, len(xy), my - b * mx, b)


def parse_goal(text: str) -> tuple[str, str, float]:
    """'SET:chain=4.0' -> (SET, 'chain', 4.0); a ValueError naming what is wrong."""
    head, _, value = text.partition("=")
    set_, _, kind = head.rpartition(":")
    if not set_ or kind not in KINDS or not value:
        raise ValueError(f"--goal {text!r}: expected SET:chain=TAU or SET:ddtree=TAU")
    try:
        return set_, kind, float(value)
    except ValueError:
        raise ValueError(f"--goal {text!r}: {value!r} is not a number") from None


def trend_table(points: list[CurvePoint], from_stint: int, goals: list[tuple[str, str, float]]) -> str:
    """Per set and kind: the fitted gain per doubling of training minutes and, per goal, the minutes it needs."""
    last = points[-1].train_minutes
    lines = [f"fit τ ≈ a + b·ln(cumulative training minutes), stints {from_stint} on (an extrapolation):", "",
             "| set | τ | stints fitted | τ per doubling of minutes | fitted τ now | goal | minutes at goal | more than now |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    sets = sorted({s for p in points for s in p.tau})
    for s in sets:
        for kind in KINDS:
            t = trend(points, s, kind, from_stint)
            if t is None:
                continue
            wanted = [g for gs, gk, g in goals if (gs, gk) == (s, kind)] or [None]
            for g in wanted:
                at = "-" if g is None else f"{t.minutes_for(g):.0f}"
                more = "-" if g is None else f"{t.minutes_for(g) - last:+.0f}"
                lines.append(f"| {s} | {kind} | {t.points} | {t.per_doubling:+.2f} | {t.at(last):.2f} | "
                             f"{'-' if g is None else g} | {at} | {more} |")  # fmt: skip
    return "\n".join(lines) + "\n"


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


def plot(points: list[CurvePoint], out: str | Path, from_stint: int | None = None) -> None:
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
            for kind in KINDS if xkey == "train_minutes" and from_stint is not None else ():
                t = trend(points, s, kind, from_stint)
                if t is not None:  # the fit over its stints, carried on to twice the last minutes
                    lo = min(p.train_minutes for p in pts if p.stint >= from_stint)
                    grid = [lo + (2 * points[-1].train_minutes - lo) * i / 50 for i in range(51)]
                    ax.plot(grid, [t.at(m) for m in grid], ls=":", color=color, alpha=0.6)
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
    ap.add_argument("--fit-from", type=int, default=None, help="fit τ against ln(minutes) from this stint on")
    ap.add_argument(
        "--goal", action="append", default=[], help="SET:chain=TAU or SET:ddtree=TAU (with --fit-from)"
    )
    a = ap.parse_args(argv)
    try:
        points = curve(read_rows(a.stints))
        goals = [parse_goal(g) for g in a.goal]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not points:
        raise SystemExit(f"{a.stints}: no stints")
    if goals and a.fit_from is None:
        raise SystemExit("--goal needs --fit-from: the stint the fit starts at")
    plot(points, a.out, a.fit_from)
    if a.table:
        print(table(points), end="")
    if a.fit_from is not None:
        print(trend_table(points, a.fit_from, goals), end="")
    print(f"wrote {a.out}: {len(points)} stints")


if __name__ == "__main__":
    main()
