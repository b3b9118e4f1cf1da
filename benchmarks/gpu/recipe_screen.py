"""A recipe screen inside a campaign stint: variants of the training recipe, each trained from the same weights on the
same data for the same minutes, then scored side by side on the frozen yardstick, paired per prompt against the first
variant and against the weights they started from.

    python3 benchmarks/gpu/recipe_screen.py --stint 8 --minutes 2.6 --budget-min 8.5 --variant base \
        --variant gamma4=loss.gamma=4 --variant anchors1024=data.max_anchors=1024 --out $OUT
    python3 benchmarks/gpu/recipe_screen.py --stint 8 ... --eval --out $OUT    # a later call: the rest, then the eval
    python3 benchmarks/gpu/recipe_screen.py --stint 8 ... --ship gamma4 --out $OUT   # the variant's stint output

Every variant is `campaign_stint.py --stint K --phases train` in a work folder of its own, $WORK/stint-K/screen/NAME,
on $WORK/stint-K/data (the stint's merged set: run `campaign_stint.py --phases regen` and `merge` first) from
--init-from, with --minutes of training (the trainer fits its LR schedule to them) and the variant's overrides after
--train-extra's. A call trains the variants not tried yet, as many as --budget-min holds (a failed one is reported,
not retried). With --eval, once every variant is tried: `flashdraft eval` in float32 of --init-from (the report's
baseline; `--reuse DIR` takes its results from DIR/SET/report.json, an earlier stint's yardstick folder) and every
trained variant, on each --yardstick file. $OUT/screen.md is the table: steps, the trainer's last validation τ, and
per yardstick file the chain and DDTree-512 τ with the chain's paired Δ against the first variant and against the
start; $OUT/screen.tar holds the reports and each variant's stint.json and stint.log. --ship NAME copies NAME's
campaign_stint output (stint.json, stint.log, bundle.tar parts with its drafter and the stint's new data) into
$OUT, for `campaign_ingest.py <that folder> --report <the screen's reports> --report-drafter NAME [--promote]` at
home: the reports' baseline is the shipped drafter, as the gate wants.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from campaign_stint import REPO, SHIP_MIN, gpu_dir  # noqa: E402

from flashdraft.eval.cli import drafter_names  # noqa: E402
from flashdraft.eval.evaluate import paired_comparison  # noqa: E402

# a variant's minutes besides its training: target load, compile, the last checkpoint, shipping
START_MIN = 0.6


class ScreenError(ValueError):
    """A bad flag or a missing input: one line, exit 2."""


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """NAME or NAME=key=value,key=value → (NAME, overrides)."""
    name, _, rest = spec.partition("=")
    overrides = [x for x in rest.split(",") if x] if rest else []
    if not name.isidentifier() or any("=" not in x for x in overrides):
        raise ScreenError(
            f"--variant {spec!r}: use NAME or NAME=key=value,key=value (NAME: letters, digits, _)"
        )
    return name, overrides


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stint", type=int, required=True)
    p.add_argument(
        "--variant", action="append", default=[], help="NAME[=key=value,…]; the first: the baseline"
    )
    p.add_argument("--minutes", type=float, default=2.6, help="training minutes of every variant")
    p.add_argument("--budget-min", type=float, default=8.5, help="minutes this call may use")
    p.add_argument("--init-from", default="models/smollm2-135m-instruct-dflash-b16")
    p.add_argument("--data", default=None, help="the training set (default $WORK/stint-K/data)")
    p.add_argument("--val-references", default=str(REPO / "benchmarks/yardstick/humaneval-164.jsonl"))
    p.add_argument(
        "--train-extra", nargs="*", default=["pipeline.inline_ahead=1"], help="every variant's overrides"
    )
    p.add_argument("--eval", action="store_true", help="once every variant is tried: the yardstick eval")
    p.add_argument(
        "--yardstick", action="append", default=None,
        help="a frozen reference file (repeatable; default: HumanEval-164 and ShareGPT-100)",
    )  # fmt: skip
    p.add_argument("--eval-target", default=str(gpu_dir("work") / "smollm2-fp32"), help="float32 HF folder")
    p.add_argument(
        "--reuse", default=None, help="a folder of SET/report.json with --init-from's yardstick results"
    )
    p.add_argument(
        "--ship", default=None, metavar="NAME", help="copy NAME's campaign_stint output into --out"
    )
    p.add_argument("--out", default=None, help="what comes back (default $OUT)")
    p.add_argument("--dry-run", action="store_true", help="print the variants' commands as JSON; run nothing")
    a = p.parse_args(argv)
    a.variants = dict(parse_variant(v) for v in a.variant)
    if len(a.variants) != len(a.variant) or not (a.variants or a.ship):
        raise ScreenError("--variant: at least one, every NAME once")
    a.yardstick = a.yardstick or [
        str(REPO / "benchmarks/yardstick" / f) for f in ("humaneval-164.jsonl", "sharegpt-heldout-100.jsonl")
    ]
    return a


class Screen:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.stint_work = gpu_dir("work") / f"stint-{a.stint}"
        self.root = self.stint_work / "screen"
        self.data = Path(a.data) if a.data else self.stint_work / "data"
        self.out = Path(a.out or gpu_dir("out"))
        self.t0 = time.perf_counter()

    def work(self, name: str) -> Path:
        return self.root / name

    def train_command(self, name: str) -> list[str]:
        """campaign_stint.py's training phase with --minutes of training (its budget keeps SHIP_MIN for shipping)."""
        return [
            sys.executable, str(REPO / "benchmarks/gpu/campaign_stint.py"), "--stint", str(self.a.stint),
            "--phases", "train", "--data", str(self.data), "--work", str(self.work(name)),
            "--out", str(self.work(name) / "out"), "--init-from", self.a.init_from,
            "--budget-min", str(round(self.a.minutes + SHIP_MIN + 0.1, 2)),
            "--val-references", self.a.val_references,
            "--train-extra", *self.a.train_extra, *self.a.variants[name],
        ]  # fmt: skip

    def tried(self, name: str) -> bool:
        return (self.work(name) / "state.json").is_file()

    def trained(self, name: str) -> bool:
        return (self.work(name) / "drafter-bf16" / "config.json").is_file()

    def train(self) -> None:
        if not (self.data / "manifest.json").is_file():
            raise ScreenError(f"{self.data}: no dataset (run campaign_stint.py --phases regen,merge first)")
        for name in self.a.variants:
            if self.tried(name):
                continue
            elapsed = (time.perf_counter() - self.t0) / 60
            if elapsed + self.a.minutes + START_MIN + SHIP_MIN > self.a.budget_min:
                print(
                    f"screen: {name} waits for the next call (--budget-min {self.a.budget_min})", flush=True
                )
                return
            work = self.work(name)
            work.mkdir(parents=True, exist_ok=True)
            new = self.stint_work / "new"  # the stint's new data rides in each variant's bundle
            if new.is_dir() and not (work / "new").exists():
                (work / "new").symlink_to(new)
            t = time.perf_counter()
            rc = subprocess.run(self.train_command(name), cwd=REPO).returncode
            print(f"screen: {name} exit {rc}, {(time.perf_counter() - t) / 60:.2f} min", flush=True)

    def evaluate(self) -> None:
        left = [n for n in self.a.variants if not self.tried(n)]
        if left:
            print(f"screen: no eval yet, not trained: {', '.join(left)}", flush=True)
            return
        names = [n for n in self.a.variants if self.trained(n)]
        if not names:
            raise ScreenError("no variant trained: nothing to evaluate")
        target = Path(self.a.eval_target)
        if not (target / "config.json").is_file():
            gguf = gpu_dir("stage") / "SmolLM2-135M-Instruct.Q4_1.gguf"
            subprocess.run([sys.executable, str(REPO / "benchmarks/gpu/save_target.py"), str(gguf), str(target),
                            "float32"], cwd=REPO, check=True, capture_output=True)  # fmt: skip
        folders = [self.work(n) / "drafter-bf16" for n in names]
        drafters = ["--drafter", self.a.init_from, *(x for f in folders for x in ("--drafter", str(f)))]
        for ref in map(Path, self.a.yardstick):
            earlier = Path(self.a.reuse or "") / ref.stem / "report.json"
            reuse = ["--reuse", str(earlier)] if self.a.reuse and earlier.is_file() else []
            subprocess.run([sys.executable, "-m", "flashdraft.cli", "eval", "--target", str(target), *drafters,
                            "--references", str(ref), *reuse, "--device", "cuda", "--dtype", "float32",
                            "--no-progress", "--out", str(self.root / "eval" / ref.stem)], cwd=REPO, check=True)  # fmt: skip
        self.out.mkdir(parents=True, exist_ok=True)
        table = screen_table(self.root, list(self.a.variants), self.report_names(names))
        (self.out / "screen.md").write_text(table)
        print(table, flush=True)
        with tarfile.open(self.out / "screen.tar", "w") as tf:
            tf.add(self.root / "eval", arcname="eval")
            for n in self.a.variants:
                for f in ("out/stint.json", "out/stint.log"):
                    if (self.work(n) / f).is_file():
                        tf.add(self.work(n) / f, arcname=f"{n}/{Path(f).name}")

    def report_names(self, names: list[str]) -> dict[str, str]:
        """The name the eval's report gives each variant's drafter: the shortest tail of its folder that the
        other drafters of the call do not share (`base/drafter-bf16` beside `grow3/drafter-bf16`)."""
        found = [(Path(self.a.init_from), None), *((self.work(n) / "drafter-bf16", None) for n in names)]
        return dict(zip(names, drafter_names(found)[1:], strict=True))

    def ship(self, name: str) -> None:
        src = self.work(name) / "out"
        if not (src / "stint.json").is_file():
            raise ScreenError(f"--ship {name}: {src} has no stint.json (not trained?)")
        self.out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            shutil.copy2(f, self.out / f.name)
        print(f"screen: {name}'s campaign_stint output copied into {self.out}", flush=True)


def screen_table(root: Path, names: list[str], in_report: dict[str, str]) -> str:
    """One row per variant: steps, the trainer's last validation chain τ, and per report the chain and DDTree-512 τ
    with the chain's paired Δ (± its standard error) against the first variant and against the report's baseline.
    `in_report`: each evaluated variant's drafter name in the reports."""
    reports = {
        p.parent.name: json.loads(p.read_text()) for p in sorted((root / "eval").glob("*/report.json"))
    }
    head = ["variant", "steps", "val chain τ"]
    for s in reports:
        head += [f"{s} chain", f"{s} DDTree-512", f"chain Δ vs {names[0]}", "chain Δ vs start"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in names:
        summary = root / n / "out" / "stint.json"
        st = json.loads(summary.read_text()) if summary.is_file() else {}
        val = (st.get("val") or {}).get("val/chain_tau")
        row = [n, str(st.get("train_steps") or "failed"), f"{val:.3f}" if val is not None else "—"]
        for r in reports.values():
            d, first = (r["drafters"].get(in_report.get(x, "")) for x in (n, names[0]))
            if d is None:
                row += ["—"] * 4
                continue
            vs_first = "—"
            if first is not None and n != names[0]:
                paired = paired_comparison(names[0], first["per_sample"], d["per_sample"], ["chain"])
                vs_first = _delta(asdict(paired.methods["chain"]))
            start = ((d.get("paired") or {}).get("methods") or {}).get("chain")
            m = d["methods"]
            row += [f"{m['chain']['tau']:.3f}", f"{m['ddtree-512']['tau']:.3f}" if "ddtree-512" in m else "—",
                    vs_first, _delta(start) if start else "—"]  # fmt: skip
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _delta(p: dict) -> str:
    return f"{p['delta']:+.3f} ± {p['se']:.3f} {p['verdict']}" if p.get("se") is not None else "—"


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse_args(argv)
        sc = Screen(a)
        if a.dry_run:
            print(json.dumps({n: sc.train_command(n) for n in a.variants}, indent=1))
            return 0
        if a.ship:
            sc.ship(a.ship)
            return 0
        sc.train()
        if a.eval:
            sc.evaluate()
        return 0
    except (ScreenError, subprocess.CalledProcessError) as e:
        print(f"recipe_screen: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
