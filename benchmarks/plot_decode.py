"""Plot τ and speedup over the engine's AR per method from decode_speed.py JSON files (one line per file).

    D=benchmarks/results/h200-2026-12-04-decode-speed
    python benchmarks/plot_decode.py $D/decode_compiled.json $D/decode_eager.json \
        --labels "tree phase compiled" "tree phase eager" --out $D/decode.png
    python benchmarks/plot_decode.py OLD.json NEW.json --labels "1,100 steps" "+2,200 steps" --out cmp.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--labels", nargs="+", help="one per file, in front of the T / prompts label")
    args = ap.parse_args()
    if args.labels and len(args.labels) != len(args.files):
        raise SystemExit(f"--labels: {len(args.labels)} labels for {len(args.files)} files")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tau, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    titles = []
    for k, f in enumerate(args.files):
        d = json.loads(Path(f).read_text())
        rows = [r for r in d["engine"] if r["method"] != "ar"]
        ar_ms = next(r["ms_per_token"] for r in d["engine"] if r["method"] == "ar")
        names = [r["method"] + (f"-{r['budget']}" if r["budget"] else "") for r in rows]
        label = f"T={d.get('temperature', 0.0):g}, {d['prompts']} prompts × {d['max_new_tokens']} tokens"
        if args.labels:
            label = f"{args.labels[k]}: {label}"
        titles.append(f"{d['drafter']} on {d['device']} ({d.get('dataset', '')})")
        ax_tau.plot(names, [r["tau"] for r in rows], marker="o", label=label)
        ax_speed.plot(names, [ar_ms / r["ms_per_token"] for r in rows], marker="o", label=label)
    ax_tau.set_ylabel("τ (tokens per target forward)")
    ax_speed.set_ylabel("speedup over the engine's AR (same CUDA graphs)")
    ax_speed.axhline(1.0, color="grey", lw=0.8, ls="--")
    for ax in (ax_tau, ax_speed):
        ax.tick_params(axis="x", rotation=45)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(" | ".join(dict.fromkeys(titles)), fontsize=9)
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
