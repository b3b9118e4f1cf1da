"""Screen the CPU quickstart's training recipe on a GPU, as the CPU would run it.

    python3 benchmarks/gpu/qs_screen.py --prompts .stage/qs --budget-s 520 --out screen-out

The quickstart (`flashdraft quickstart`, preset `cpu-fp32`) trains a 4-layer b4 drafter for a few hundred steps
on a few hundred regenerated answers; which recipe gives the best held-out τ at its sizes does not depend on the
device, only the minutes do. This regenerates the quickstart's data on the GPU (the same prompt lists, float32
target, 96 new tokens), dumps the layer-15 features, trains each variant with the quickstart's own
`train_overrides` in float32 with the CPU's code paths (eager drafter, dense mask, the log_softmax loss), several
variants at a time, and evaluates all of them side by side in one `flashdraft eval` on the largest set's held-out
split (the split is a hash of the conversation, so it is held out from every smaller set too).

Every variant is `name: (prompts, steps, [key=value ...])` in VARIANTS; the prompt list is read from `--prompts`
as `p3000.jsonl.gz` (`flashdraft.quickstart.write_first_turns(path, 3000)`, gzipped; its first N lines are
`write_first_turns(path, N)`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flashdraft.quickstart import CONFIG, SIZES, features_args, regenerate_args, train_overrides  # noqa: E402

# where benchmarks/gpu/env.sh puts the staged inputs and the host's work (the same defaults)
GPU_DIR = Path(os.environ.get("GPU_DIR", Path.home() / "flashdraft-gpu"))
STAGE = Path(os.environ.get("STAGE", GPU_DIR / "stage"))
WORK = Path(os.environ.get("WORK", GPU_DIR / "work"))

# The screened base recipe: the cpu-fp32 preset of 2026-12-03 (the bf16 preset's 4-layer b4 drafter in float32), pinned
# here so a rerun reproduces RESULTS "Recipe screens" screen A after the preset itself changed (450 prompts, 2 layers, b3).
SCREEN_BASE = dataclasses.replace(SIZES["cpu"], prompts=300, layers=4, block_size=4, steps=460, lr=4e-3, ema_decay=0.0,
                                  softmax_vocab=0, train_minutes=None, total_minutes=None,
                                  eval_prompts=12, dtype="float32")  # fmt: skip

# name -> (prompts, steps, extra overrides) on top of SCREEN_BASE
VARIANTS: dict[str, tuple[int, int, list[str]]] = {
    "base": (300, 460, []),
    "base-seed1": (300, 460, ["runtime.seed=1"]),
    "lr6e-3": (300, 460, ["optim.lr=0.006"]),
    "lr2.5e-3": (300, 460, ["optim.lr=0.0025"]),
    "gamma0.5": (300, 460, ["loss.gamma=0.5"]),
    "wd0.1": (300, 460, ["optim.weight_decay=0.1"]),
    "fnoise0.1": (300, 460, ["loss.feature_noise=0.1"]),
    "enoise0.1": (300, 460, ["loss.embedding_noise=0.1"]),
    "anchors32-230": (300, 230, ["data.max_anchors=32", "checkpoint.every=230"]),
    "b3": (300, 460, ["model.block_size=3"]),
    "b3-690": (300, 690, ["model.block_size=3", "checkpoint.every=690"]),
    "layers2": (300, 460, ["model.num_layers=2"]),
    "d600": (600, 460, []),
    "d600-700": (600, 700, ["checkpoint.every=700"]),
    "d1500-1400": (1500, 1400, ["checkpoint.every=1400"]),
    # the same CPU minutes spent differently: 2 layers and b3 cost ~half a step of the preset's 4 layers and b4
    # (its step: ~half the lm_head CE over 3 labelled slots, ~half the drafter body over 4 slots)
    "l2b3-1500": (300, 1500, ["model.num_layers=2", "model.block_size=3", "checkpoint.every=1500"]),
    "d450-l2b3-1000": (450, 1000, ["model.num_layers=2", "model.block_size=3", "checkpoint.every=1000"]),
    "d600-l2b3-600": (600, 600, ["model.num_layers=2", "model.block_size=3", "checkpoint.every=600"]),
    "d450-l2b3-1000-seed1": (
        450,
        1000,
        ["model.num_layers=2", "model.block_size=3", "checkpoint.every=1000", "runtime.seed=1"],
    ),
    "d600-l2b3-900": (600, 900, ["model.num_layers=2", "model.block_size=3", "checkpoint.every=900"]),
    "d450-l1b3-1300": (450, 1300, ["model.num_layers=1", "model.block_size=3", "checkpoint.every=1300"]),
    "d450-l2b4-800": (450, 800, ["model.num_layers=2", "checkpoint.every=800"]),
    "d450-l4b3-700": (450, 700, ["model.block_size=3", "checkpoint.every=700"]),
    # what more compute buys (the bf16 preset's size and beyond)
    "d1500-l2b3-2800": (1500, 2800, ["model.num_layers=2", "model.block_size=3", "checkpoint.every=2800"]),
    "d3000-3000": (3000, 3000, ["checkpoint.every=3000"]),
}

REGEN_TOKENS = "regen.max_new_tokens="  # not a train override: the variant's data answers this many tokens

# Screen B: which target layers feed the 2-layer b3 drafter (the cpu-fp32 preset: feature layer 15, drafter
# started from target layers 16-17) at the preset's CPU cost (450 prompts, 1,000 steps). A deeper
# feature layer costs the CPU only a longer features pass; the drafter's step is the same.
L2B3 = ["model.num_layers=2", "model.block_size=3"]
VARIANTS |= {
    f"d450-l2b3-1000{tag}": (450, 1000, [*L2B3, "checkpoint.every=1000", *extra])
    for tag, extra in {
        "-s2": ["runtime.seed=2"],
        "-f27": ["model.target_layer_ids=[27]"],
        "-f27-s1": ["model.target_layer_ids=[27]", "runtime.seed=1"],
        "-f22": ["model.target_layer_ids=[22]"],
        "-f15last": ["model.init_from_target=last"],
        "-f15-27": ["model.target_layer_ids=[15,27]"],
        "-f1-27": ["model.target_layer_ids=[1,27]"],
        "-f8-15-22-27": ["model.target_layer_ids=[8,15,22,27]"],
        "-f20": ["model.target_layer_ids=[20]"],
        "-f25": ["model.target_layer_ids=[25]"],
        # shallower features: a cheaper features pass on the CPU (layer 8 runs 9 of the 30 layers, 15 runs 16)
        "-f5": ["model.target_layer_ids=[5]"],
        "-f8": ["model.target_layer_ids=[8]"],
        "-f10": ["model.target_layer_ids=[10]"],
        "-f12": ["model.target_layer_ids=[12]"],
    }.items()
}
# the same decode steps of regeneration spread over more prompts (shorter answers: more contexts per CPU minute)
VARIANTS["d900m48-l2b3-1000"] = (900, 1000, [*L2B3, "checkpoint.every=1000", f"{REGEN_TOKENS}48"])
VARIANTS["d675m64-l2b3-1000"] = (675, 1000, [*L2B3, "checkpoint.every=1000", f"{REGEN_TOKENS}64"])
VARIANTS["d1350m32-l2b3-1000"] = (1350, 1000, [*L2B3, "checkpoint.every=1000", f"{REGEN_TOKENS}32"])
VARIANTS["d450-l1b3-1300-f28"] = (450, 1300, ["model.num_layers=1", "model.block_size=3", "checkpoint.every=1300",
                                           "model.target_layer_ids=[28]"])  # fmt: skip

# Screen C: the bf16 cpu preset of 2026-12-04 (1,500 prompts, 2,200 steps of the 2-layer b3) against a moving average of its
# weights (optim.ema_decay) and against more data at the same steps (what a faster data stage would buy)
VARIANTS |= {
    f"d{n}-l2b3-{steps}{tag}": (n, steps, [*L2B3, f"checkpoint.every={steps}", *extra])
    for n, steps, tag, extra in [
        (1500, 2200, "", []), (1500, 2200, "-s1", ["runtime.seed=1"]), (1500, 2200, "-ema0.99", ["optim.ema_decay=0.99"]),
        (1500, 2200, "-ema0.995", ["optim.ema_decay=0.995"]), (1500, 2200, "-ema0.998", ["optim.ema_decay=0.998"]),
        (2000, 2200, "", []), (2500, 2200, "", []), (2000, 2200, "-ema0.995", ["optim.ema_decay=0.995"]),
        # screen 2: the best average with more data and steps
        (2000, 2200, "-ema0.998", ["optim.ema_decay=0.998"]), (2500, 2200, "-ema0.998", ["optim.ema_decay=0.998"]),
        (2500, 2200, "-s1", ["runtime.seed=1"]), (2500, 2800, "-ema0.998", ["optim.ema_decay=0.998"]),
        (2000, 2800, "-ema0.998", ["optim.ema_decay=0.998"]), (3000, 2200, "-ema0.998", ["optim.ema_decay=0.998"]),
        # screen 3: the preset's 1,500 prompts for 2,800 steps (the CPU minutes left over), the average and the lr
        (1500, 2800, "", []), (1500, 2800, "-ema0.998", ["optim.ema_decay=0.998"]),
        (1500, 2800, "-ema0.998-s1", ["optim.ema_decay=0.998", "runtime.seed=1"]),
        (1500, 2800, "-ema0.998-lr2.5e-3", ["optim.ema_decay=0.998", "optim.lr=0.0025"]),
        (1500, 2800, "-ema0.998-lr7e-3", ["optim.ema_decay=0.998", "optim.lr=0.007"]),
        (1500, 2800, "-ema0.998-g0.6", ["optim.ema_decay=0.998", "loss.gamma=0.6"]),
        (1500, 1400, "-ema0.998-a32", ["optim.ema_decay=0.998", "data.max_anchors=32"]),
    ]
}  # fmt: skip

# the cpu preset's recipe (lr 2.5e-3, EMA 0.998) at its 2-layer b3 size, two seeds
PRESET = ["optim.ema_decay=0.998", "optim.lr=0.0025"]
VARIANTS |= {
    f"d{n}-l2b3-{steps}{tag}": (n, steps, [*L2B3, f"checkpoint.every={steps}", *PRESET, *extra])
    for n, steps, tag, extra in [(1500, 2800, "-preset", []), (1500, 2800, "-preset-s1", ["runtime.seed=1"])]
}  # fmt: skip


def answer_tokens(extra: list[str]) -> int:
    """The regenerated answers' length for a variant: its `regen.max_new_tokens=N`, else the base's."""
    given = [int(kv[len(REGEN_TOKENS) :]) for kv in extra if kv.startswith(REGEN_TOKENS)]
    return given[-1] if given else SCREEN_BASE.max_new_tokens


def data_name(n: int, answer: int) -> str:
    """`d{name}` holds the data and `f{name}-l…` the features: "450", or "900-m48" for 48-token answers."""
    return str(n) if answer == SCREEN_BASE.max_new_tokens else f"{n}-m{answer}"


def feature_layers(extra: list[str]) -> list[int]:
    """The target layers a variant's drafter reads: its `model.target_layer_ids=[...]` override, else the base's."""
    for kv in extra:
        if kv.startswith("model.target_layer_ids="):
            return [int(x) for x in kv.split("=", 1)[1].strip("[]").split(",")]
    return list(SCREEN_BASE.target_layer_ids or [])


def features_dir(work: Path, key: str, layers: list[int]) -> Path:
    return work / f"f{key}-l{'-'.join(map(str, layers))}"


def sh(args: list[str], log: Path) -> int:
    with log.open("a") as f:
        f.write("$ " + " ".join(args) + "\n")
        f.flush()
        return subprocess.call(args, stdout=f, stderr=subprocess.STDOUT)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--target", default=str(WORK / "smollm2-fp32"), help="call5_eval.sh saves this float32 copy"
    )
    ap.add_argument("--prompts", type=Path, default=Path(".stage/qs"))
    ap.add_argument("--work", type=Path, default=WORK / "qs")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=520.0, help="the whole screen, eval included")
    ap.add_argument("--eval-s", type=float, default=150.0, help="kept for the eval at the end")
    ap.add_argument("--contamination", default=f"humaneval:{STAGE / 'HumanEval.jsonl.gz'}")
    ap.add_argument("--parallel", type=int, default=5)
    ap.add_argument("--eval-prompts", type=int, default=60)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--eval-size", type=int, default=None,
                    help="evaluate on this prompt set's held-out split (default: the largest variant's; the screens used 3000)")  # fmt: skip
    a = ap.parse_args()
    t0 = time.time()
    a.work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)
    log = a.out / "screen.log"
    fd = [sys.executable, "-m", "flashdraft.cli"]
    names = [n for n in a.variants.split(",") if n]
    eval_size = a.eval_size or max(VARIANTS[n][0] for n in names)
    base = SCREEN_BASE
    datasets = {(VARIANTS[v][0], answer_tokens(VARIANTS[v][2])) for v in names}
    datasets.add((eval_size, base.max_new_tokens))
    for n, m in sorted(datasets):  # the quickstart's data and features commands, on the GPU in float32
        key = data_name(n, m)
        data = a.work / f"d{key}"
        if not (data / "manifest.json").is_file():
            with gzip.open(
                a.prompts / "p3000.jsonl.gz", "rt"
            ) as f:  # the first N lines = write_first_turns(N)
                (a.work / f"p{n}.jsonl").write_text("".join(f.readlines()[:n]))
            regen = regenerate_args(dataclasses.replace(base, max_new_tokens=m), a.work / f"p{n}.jsonl", data, "cuda",
                                    "float32", batch_size=512, target=a.target,
                                    extra=["--engine", "native", "--contamination", a.contamination])  # fmt: skip
            sh([*fd, *regen], log)
        for layers in sorted({tuple(feature_layers(VARIANTS[v][2])) for v in names
                              if (VARIANTS[v][0], answer_tokens(VARIANTS[v][2])) == (n, m)}):  # fmt: skip
            feats = features_dir(a.work, key, list(layers))
            if not (feats / "manifest.json").is_file():
                sizes = dataclasses.replace(base, target_layer_ids=list(layers))
                dump = features_args(sizes, data, feats, "cuda", "float32", target=a.target, extra=["--yes"])
                sh([*fd, *dump], log)
    print(f"data + features: {time.time() - t0:.0f} s", flush=True)

    # the CPU's code paths: eager drafter, dense bool mask, log_softmax CE, float32 target head
    cpu_like = ["runtime.compile=none", "runtime.attention=dense", "loss.fused_ce=false",
                f"model.target={a.target}", "model.target_dtype=float32"]  # fmt: skip

    def ran(name: str) -> bool:
        return any((a.work / "runs" / name / "checkpoints").glob("step-*"))

    queue = [n for n in names if not ran(n)]  # a rerun on a warm machine trains only the new variants
    running: dict[str, tuple[subprocess.Popen, float, Any]] = {}
    done: dict[str, float] = {}
    deadline = t0 + a.budget_s - a.eval_s
    while queue or running:
        while queue and len(running) < a.parallel and time.time() < deadline - 30:
            name = queue.pop(0)
            n, steps, extra = VARIANTS[name]
            sizes = dataclasses.replace(base, steps=steps)
            run = a.work / "runs" / name
            key = data_name(n, answer_tokens(extra))
            feats = features_dir(a.work, key, feature_layers(extra))
            args = [*fd, "train", str(CONFIG), *train_overrides(sizes, run, a.work / f"d{key}", feats, "cuda"),
                    *cpu_like, *[kv for kv in extra if not kv.startswith(REGEN_TOKENS)]]  # fmt: skip
            f = (a.out / f"train-{name}.log").open("w")
            f.write("$ " + " ".join(args) + "\n")
            f.flush()
            running[name] = (subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT), time.time(), f)
        for name, (p, ts, f) in list(running.items()):
            if p.poll() is None and time.time() > deadline:
                p.kill()
                p.wait()
                print(f"{name}: killed at the deadline", flush=True)
            elif p.poll() is not None:
                done[name] = time.time() - ts
                print(f"{name}: exit {p.returncode} in {done[name]:.0f} s", flush=True)
            else:
                continue
            f.close()
            del running[name]
        if not running and queue and time.time() >= deadline - 30:
            print(f"skipped for time: {queue}", flush=True)
            queue = []
        time.sleep(1)

    drafters = [a.work / "runs" / n for n in names if ran(n)]
    cmd = [*fd, "eval", "--target", a.target, "--dataset", str(a.work / f"d{eval_size}"),
           "--limit", str(a.eval_prompts), "--max-new-tokens", str(base.eval_tokens), "--budgets", "8,32",
           "--device", "cuda", "--dtype", "float32", "--no-progress", "--out", str(a.out / "eval")]  # fmt: skip
    for d in drafters:
        cmd += ["--drafter", str(d)]
    rc = sh(cmd, log)
    print(f"eval exit {rc}; total {time.time() - t0:.0f} s", flush=True)
    summary = {"train_s": done, "variants": {n: VARIANTS[n] for n in names}, "total_s": time.time() - t0}
    (a.out / "screen.json").write_text(json.dumps(summary, indent=1))
    for name in names:  # the last training metrics line: training slot accuracies next to held-out τ
        m = a.work / "runs" / name / "metrics.jsonl"
        if m.is_file():
            last = m.read_text().strip().splitlines()[-1]
            with (a.out / "last_metrics.jsonl").open("a") as f:
                f.write(json.dumps({"variant": name, **json.loads(last)}) + "\n")


if __name__ == "__main__":
    main()
