"""One campaign stint on a warm CUDA host: fresh data, merged with what earlier stints made, training from the
last weights, an eval — the weights (and the new data when it fits) sent back after every phase.

    python3 benchmarks/gpu/campaign_stint.py --stint 3 --init-from models/smollm2-135m-instruct-dflash-b16 \
        --prev-data .data/campaign-s2 --budget-min 9.0 --regen-min 3 --eval-min 0
    python3 benchmarks/gpu/campaign_stint.py --stint 3 --phases train --budget-min 9.0              # the next call
    python3 benchmarks/gpu/campaign_stint.py --stint 3 --phases train,eval --budget-min 9.0 --eval-min 3
    python3 benchmarks/gpu/campaign_stint.py --stint 3 ... --dry-run        # the command lines as JSON, nothing run

A device call runs at most 10 minutes, so a 30-minute stint is three calls on the same warm machine (its work
folder, $WORK/stint-K, survives between back-to-back calls): the first regenerates for --regen-min minutes,
merges and trains; the next ones train further (each call's training is one LR schedule, warm-up included, from
the previous call's last weights: `runtime.fit_steps_to_time_limit` fits a schedule to the minutes a call has);
the last also evaluates. With --schedule-steps S --schedule-start N the calls instead train their parts of one
schedule S steps long, from its step N on (optim.schedule_steps; stint.json's "schedule" says where the stint
ended, the next stint's --schedule-start). Training takes every minute the other phases leave (--budget-min
minus regen, eval and the minute kept for shipping). Before stage.sh: `benchmarks/gpu/README.md`. Two failures
are recovered from in the same call, with the minutes left: a regeneration out of GPU memory goes on with half --max-batch-tokens (its
finished shards resumed), and a training run with --feature-pass native that fails before its first checkpoint
runs again with transformers' pass.

Fresh data each stint (`plan_for`): the stint index picks the sampling seed, the temperature and how many user
turns of each ShareGPT conversation are answered, so sample ids (`…@T0.9s103`) never repeat an earlier
stint's and `data merge` keeps every stint's answers. Only ShareGPT-layout chats, the CodeI/O coding tasks of
`reasoning-gym` (`codeio:`) and the `prompts:` files whose sha256 is in REVIEWED_PROMPT_FILES (the prompts other
wheels ship, `benchmarks/pypi_prompts.py`; the questions of reasoning-gym's procedural generators,
`benchmarks/reasoning_gym_prompts.py`), all staged by make_stage.py, are trained on (`check_training_input`):
HumanEval is the eval, and other user files (`messages:`, `prompts:`) could hold prompts derived from the Python
standard library's documentation or source; every regeneration and merge drops training prompts sharing a word
13-gram with HumanEval (`--contamination`). With --self-prompts N the target first writes N user messages itself
(`flashdraft data self-prompts`, seeded by the stint: no document behind them), which the regeneration answers.

What comes back in --out ($OUT, at most 8 files): stint.json (minutes per phase, training minutes and steps,
new and cumulative samples / loss tokens, the last validation τ, the eval's τ; one line of
benchmarks/results/campaign/stints.jsonl, which benchmarks/plot_learning_curve.py draws), stint.log, and
bundle.tar in 15 MiB parts with SHA256 (join with `bash benchmarks/gpu/parts.sh join bundle.tar bundle.tar.part*`): drafter/ (bf16), the last
training run's metrics.jsonl, config.yaml and val_references.jsonl, the eval reports, and new-data/ (this
stint's regenerated dataset) when the bundle stays under --bundle-mib.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "smollm2-b16.yaml"
# the sources the campaign trains on: ShareGPT-layout chats (users' conversations, none generated from the Python
# standard library's docs or source). `flashdraft data sources` lists the others: humaneval (the eval itself),
# messages / prompts (user files of unknown provenance)
CAMPAIGN_SOURCES = ("sharegpt", "sharegpt-turns", "codeio")
# `prompts:` files reviewed by content: sha256 → what made them (the same wheels give the same bytes)
REVIEWED_PROMPT_FILES = {
    "d1bbf7dd1292629694908dfb199cfd38af87ba0eb59069e4402417175e33904c":
        "benchmarks/pypi_prompts.py: 7,310 prompts eight pinned wheels ship (licences in its table)",
    "30b1276dbf0115f6e8833659e41ffaf6625863b11a5900d90f0e951eed5bd0ef":
        "benchmarks/pypi_prompts.py --set 2: 8,446 prompts four more pinned wheels ship (benchmark test splits)",
    "33282732233ac68832c1cbbf7de6e902cd6cbfdc3068476764468d0443483268":
        "benchmarks/pypi_prompts.py --set 3: 7,627 prompts of three wheels of sets 1-2 and two more (test splits)",
    "c31aba1b32c3c4b7677856f1749a2abda9d1eceb5f8f0089e3b8571d7119868d":
        "benchmarks/reasoning_gym_prompts.py: 9,929 questions of 81 procedural reasoning-gym 0.1.25 generators, "
        "grouped by generator",
}  # fmt: skip
TEMPERATURES = (0.7, 0.9, 1.0)  # sampled answers: other answers to the same prompts at every stint
SELF_PROMPTS = "self-prompts.jsonl.gz"  # in the stint's work folder: --self-prompts' messages
SEED_BASE = 100  # the shipped drafter's data used seeds 0..2: stint seeds start above them
SHIP_MIN = 0.4  # minutes kept at the end of a call for the bf16 drafter, the tar and its parts (0.10-0.15 in stints 1-3)
# of the training phase's minutes, those before the trainer's clock starts (target load, validation references,
# the teacher-forced pass) and after it stops (the last checkpoint); runtime.time_limit_min gets the rest.
# Stints 1 and 3 (H100) spent 0.22 and 0.23 minutes so, compiling included
TRAIN_OVERHEAD_MIN = 0.5


def gpu_dir(name: str) -> Path:
    """env.sh's folders: $STAGE / $WORK when set, else under $GPU_DIR (default ~/flashdraft-gpu)."""
    root = Path(os.environ.get("GPU_DIR", Path.home() / "flashdraft-gpu"))
    return Path(os.environ.get(name.upper(), root / name))


class StintError(ValueError):
    pass


@dataclass(frozen=True)
class StintPlan:
    temperature: float
    seed: int
    max_turns: int  # user turns answered per conversation (1: first turns; more: later turns too)
    # the inputs' first conversations passed over: a later slice (e.g. past those the shipped data answered)
    skip: int = 0


def plan_for(stint: int) -> StintPlan:
    """The data of stint `stint`: a new seed every stint, temperatures and answered turns in rotation."""
    if stint < 0:
        raise StintError(f"--stint {stint} must be >= 0")
    return StintPlan(TEMPERATURES[stint % len(TEMPERATURES)], SEED_BASE + stint, 1 + stint % 3)


def stint_plan(a: argparse.Namespace) -> StintPlan:
    """`plan_for(--stint)`, with --temperature / --max-turns when given (e.g. greedy later turns: T 0, 3 turns)."""
    p = plan_for(a.stint)
    t = p.temperature if a.temperature is None else a.temperature
    return StintPlan(t, p.seed, p.max_turns if a.max_turns is None else a.max_turns, a.skip)


def check_training_input(spec: str) -> str:
    """`spec` unchanged when the campaign may train on it; else a StintError saying why."""
    name = spec.partition(":")[0] if ":" in spec else spec
    if name in CAMPAIGN_SOURCES:
        return spec
    if name == "humaneval":
        raise StintError(f"--input {spec}: HumanEval is the eval set, never training data")
    path = Path(spec.partition(":")[2])
    if name == "prompts" and path.is_file():
        from flashdraft.files import file_sha256

        if file_sha256(path) in REVIEWED_PROMPT_FILES:
            return spec
    raise StintError(
        f"--input {spec}: the campaign trains only on {', '.join(CAMPAIGN_SOURCES)} sources (NAME or NAME:PATH) "
        "and on the prompts: files of REVIEWED_PROMPT_FILES. Other user files (messages:, prompts:, a bare path) may "
        "hold prompts derived from the Python standard library's documentation or source, which no training prompt "
        "may be; review such a file, then add its sha256 to REVIEWED_PROMPT_FILES"
    )


@dataclass(frozen=True)
class Budget:
    regen: float
    eval: float
    train: float  # the rest

    @classmethod
    def split(cls, total: float, regen: float, eval_: float, elapsed: float = 0.0) -> Budget:
        train = total - elapsed - regen - eval_ - SHIP_MIN
        if train < 1.0:
            raise StintError(
                f"--budget-min {total:g} leaves {train:.1f} training minutes after {elapsed:.1f} spent, regen "
                f"{regen:g}, eval {eval_:g} and {SHIP_MIN:g} for shipping: lower --regen-min / --eval-min"
            )
        return cls(regen, eval_, round(train, 2))


def generation_args(a: argparse.Namespace) -> list[str]:
    """How the stint's target generates (regeneration and self-prompts alike): the native engine on the GPU, bf16."""
    return [
        "--target", a.target, "--device", "cuda", "--dtype", "bfloat16", "--engine", "native", "--batch-size", "512",
        "--max-batch-tokens", str(a.max_batch_tokens), "--attention", a.attention,
    ]  # fmt: skip


def self_prompts_args(a: argparse.Namespace, plan: StintPlan, out: Path) -> list[str]:
    """`flashdraft data self-prompts`: --self-prompts messages the target writes, seeded by the stint."""
    args = [
        "data", "self-prompts", *generation_args(a), "--out", str(out), "--n", str(a.self_prompts), "--seed",
        str(plan.seed), "--overwrite",
    ]  # fmt: skip
    for opening in a.self_opening:
        args += ["--opening", opening]
    return args


def regen_args(a: argparse.Namespace, plan: StintPlan, out: Path, minutes: float) -> list[str]:
    # greedy runs stream every shard through one native call and stop at --time-limit, keeping the finished
    # shards and the turns the others had answered (sampled runs go shard by shard, starting none that would end
    # after the limit: a 4,096-conversation shard of three turns took 3 minutes on an H100, 2026-12-06)
    args = [
        "data", "regenerate", *generation_args(a), "--out", str(out), "--max-new-tokens", str(a.max_new_tokens),
        "--shard-size", "256", "--max-turns", str(plan.max_turns), "--skip", str(plan.skip),
        "--temperature", str(plan.temperature), "--seed", str(plan.seed), "--time-limit", str(minutes),
        "--contamination", f"humaneval:{a.humaneval}",
    ]  # fmt: skip
    for spec in a.input:
        args += ["--input", check_training_input(spec)]
    if a.self_prompts:  # written by the target itself in this stint (self_prompts_args): no document behind them
        args += ["--input", f"prompts:{out.parent / SELF_PROMPTS}"]
    for spec in a.continue_from:  # a pack as the folder Stint.unpack puts it in
        args += ["--continue-from", str(prev_dataset(spec, out.parent))]
    if a.limit is not None:
        args += ["--limit", str(a.limit)]
    return args


def prev_dataset(spec: str, work: Path) -> Path:
    """A --prev-data dataset folder as given; a pack file (`flashdraft data pack`: what campaign_ingest.py keeps of
    each stint's data in benchmarks/results/campaign/stint-K/new-data.fdpack) as the folder it unpacks to, under
    WORK/prev/ (named after the pack's folder and file)."""
    p = Path(spec)
    if p.suffix != ".fdpack":
        return p
    return work / "prev" / f"{p.parent.name}-{p.stem}"


def staged_packs(folder: Path) -> list[Path]:
    """The campaign's packs that make_stage.py --packs staged in `folder` (campaign-stint-K.fdpack), in stint order."""
    packs = sorted(folder.glob("campaign-stint-*.fdpack"), key=lambda p: int(p.stem.removeprefix("campaign-stint-")))
    if not packs:
        raise StintError(f"--prev-packs {folder}: no campaign-stint-K.fdpack there (make_stage.py --packs stages them)")
    return packs


def last_step(metrics: list[dict[str, Any]]) -> int:
    """The last optimizer step a training run's metrics.jsonl lines log (0 for none)."""
    return max((int(m["step"]) for m in metrics), default=0)


def merge_sources(prev: list[Path], new: Path, regenerating: bool = False) -> list[Path]:
    """The datasets a stint merges: the earlier stints', then its own regeneration when it has one (or, in a
    dry run, is about to make one); a stint may train on earlier stints' data alone."""
    return [*prev, *([new] if regenerating or (new / "manifest.json").is_file() else [])]


def merge_args(a: argparse.Namespace, sources: list[Path], out: Path) -> list[str]:
    return [
        "data",
        "merge",
        *map(str, sources),
        "--out",
        str(out),
        "--contamination",
        f"humaneval:{a.humaneval}",
    ]


def train_args(
    a: argparse.Namespace, data: Path, run: Path, init_from: str, minutes: float, val_refs: str | None = None
) -> list[str]:
    """A fresh LR schedule from `init_from`, fitted to the phase's `minutes` less TRAIN_OVERHEAD_MIN (warm-up
    included); validated on `val_refs` (a val_references.jsonl) or on HumanEval references computed at start-up.
    The target's feature pass is --feature-pass: with transformers' (hf) the first stint's trainer (H100,
    2026-12-06) waited for features 58-68% of the time (producer 110-114K target tok/s, trainer 260-350K); the
    native pass, compiled, took 0.43x its time (benchmarks/results/h100-2026-12-06-feature-pass), but in the
    second stint it stopped the trainer in its first steps (a compiled call in the producer thread while the
    trainer compiled); it now runs in the trainer's thread (flashdraft.train.pipeline.inline_reason), which
    tests/train/test_gpu.py checks on CUDA (passed on the H100, 2026-12-06), and stint 3 trained with it at
    121K target tok/s against stint 2's 105K with hf: native is the default, hf the fallback. The native pass is also
    replayed as a CUDA graph (runtime.compile's target_graph): the same losses to five digits, 154.5K against 151.9K
    target tok/s and 0.8 against 14.6 ms of host time a batch (H200, 2026-12-07, benchmarks/gpu/call9_goals.sh train)."""
    refs = val_refs or a.val_references
    val = [f"eval.references={refs}", "eval.dataset="] if refs else [f"eval.dataset=humaneval:{a.humaneval}"]
    return [
        "train", str(CONFIG), f"run_dir={run}", f"model.target={a.target}", f"data.dataset={data}",
        f"model.init_from={init_from}", "optim.max_steps=1000000", f"runtime.time_limit_min={round(max(0.5, minutes - TRAIN_OVERHEAD_MIN), 2)}",
        "runtime.fit_steps_to_time_limit=true", "checkpoint.every=200", "telemetry.progress=false",
        "telemetry.peak_tflops=790", f"runtime.feature_pass={a.feature_pass}",
        "runtime.compile=model,loss" + (",target,target_graph" if a.feature_pass == "native" else ""),
        "data.blocks_per_row=1024",
        f"eval.every={a.val_every}", *val, *a.train_extra,
    ]  # fmt: skip


def eval_args(a: argparse.Namespace, drafter: Path, dataset: str, limit: int, out: Path) -> list[str]:
    return [
        "eval", "--target", a.eval_target or a.target, "--drafter", str(drafter), "--dataset", dataset,
        "--limit", str(limit), "--max-new-tokens", "256", "--budgets", "8,16,32,64,128,256,512", "--topk", "8",
        "--device", "cuda", "--dtype", "float32", "--no-progress", "--out", str(out),
    ]  # fmt: skip


def eval_sets(a: argparse.Namespace) -> dict[str, tuple[str, int]]:
    """--eval-set NAME=SPEC@LIMIT, or HumanEval and the committed held-out ShareGPT split."""
    if not a.eval_set:
        return {
            "humaneval": (f"humaneval:{a.humaneval}", 48),
            "sharegpt": (str(REPO / "benchmarks/results/h200-2026-12-02-sharegpt-heldout-split"), 40),
        }
    out = {}
    for item in a.eval_set:
        name, _, rest = item.partition("=")
        spec, _, limit = rest.rpartition("@")
        if not name or not spec or not limit.isdigit():
            raise StintError(
                f"--eval-set {item!r}: use NAME=SPEC@LIMIT, e.g. humaneval=humaneval:HE.jsonl.gz@164"
            )
        out[name] = (spec, int(limit))
    return out


# ----------------------------------------------------------------------------- the stint


class Stint:
    """Phases on the work folder; the state (minutes, what is done) in WORK/state.json, so a later call goes on."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work = Path(a.work or gpu_dir("work") / f"stint-{a.stint}")
        self.out = Path(a.out or os.environ.get("OUT", "out"))
        self.state_path = self.work / "state.json"
        self.state: dict[str, Any] = {"stint": a.stint, "plan": asdict(stint_plan(a)), "minutes": {},
                                      "done": [], "train_runs": [], "calls": 0}  # fmt: skip
        if self.state_path.is_file():
            self.state = json.loads(self.state_path.read_text())
        self.t0 = time.perf_counter()
        self.log = self.out / "stint.log"

    def elapsed_min(self) -> float:
        return (time.perf_counter() - self.t0) / 60

    def save_state(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        tmp.replace(self.state_path)

    def run(self, phase: str, args: list[str], timeout_min: float) -> int:
        """`python -m flashdraft.cli ARGS`, its output appended to stint.log; its minutes counted for `phase`."""
        t = time.perf_counter()
        with self.log.open("a") as f:
            f.write(f"\n$ flashdraft {' '.join(args)}\n")
            f.flush()
            try:
                rc = subprocess.run([sys.executable, "-m", "flashdraft.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                                    timeout=timeout_min * 60, cwd=REPO).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rc = 124
            f.write(f"[{phase}: exit {rc}, {(time.perf_counter() - t) / 60:.2f} min]\n")
        m = self.state["minutes"]
        m[phase] = round(m.get(phase, 0.0) + (time.perf_counter() - t) / 60, 3)
        return rc

    def log_size(self) -> int:
        return self.log.stat().st_size if self.log.is_file() else 0

    def log_since(self, offset: int) -> str:
        """stint.log from byte `offset` on: one command's output."""
        if not self.log.is_file():
            return ""
        with self.log.open("rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def note(self, text: str) -> None:
        """A line in stint.log and on stdout: what the stint decided on its own."""
        with self.log.open("a") as f:
            f.write(f"[campaign_stint: {text}]\n")
        print(f"campaign_stint: {text}", flush=True)

    @property
    def data(self) -> Path:
        return self.work / "data"

    def regen(self, minutes: float) -> None:
        new = self.work / "new"
        if "regen" in self.state["done"]:
            return
        self.unpack(self.a.continue_from)
        if self.a.self_prompts and "self-prompts" not in self.state["done"]:
            t = time.perf_counter()
            rc = self.run("self-prompts", self_prompts_args(self.a, stint_plan(self.a), self.work / SELF_PROMPTS), minutes)
            if rc != 0:
                raise StintError(f"self-prompts failed (exit {rc}): see stint.log")
            self.state["done"].append("self-prompts")
            minutes = round(minutes - (time.perf_counter() - t) / 60, 2)
            if minutes < 0.3:
                raise StintError("self-prompts took the regeneration's minutes: raise --regen-min or lower --self-prompts")
        t, start = time.perf_counter(), self.log_size()
        rc = self.run("regen", regen_args(self.a, stint_plan(self.a), new, minutes), minutes + 2.5)
        left = minutes - (time.perf_counter() - t) / 60
        if rc != 0 and "out of memory" in self.log_since(start).lower() and left >= 1.0:
            # the finished shards are kept (new.partial/) and resumed: only the batch layout changes
            self.note(
                f"regeneration ran out of GPU memory; again with --max-batch-tokens {self.a.max_batch_tokens // 2}"
            )
            half = argparse.Namespace(**{**vars(self.a), "max_batch_tokens": self.a.max_batch_tokens // 2})
            rc = self.run("regen", regen_args(half, stint_plan(self.a), new, round(left, 2)), left + 2.5)
        if rc != 0 or not (new / "manifest.json").is_file():
            raise StintError(f"regeneration failed (exit {rc}): see stint.log")
        self.state["done"].append("regen")

    def unpack(self, specs: list[str]) -> list[Path]:
        """The dataset folders of --prev-data / --continue-from: packs unpacked under WORK/prev/ (once)."""
        folders = [prev_dataset(p, self.work) for p in specs]
        for spec, folder in zip(specs, folders, strict=True):
            if folder != Path(spec) and not (folder / "manifest.json").is_file():
                from flashdraft.data.pack import unpack_dataset

                unpack_dataset(spec, folder, overwrite=True)
                self.note(f"unpacked {spec} into {folder}")
        return folders

    def merge(self) -> None:
        if "merge" in self.state["done"]:
            return
        new, prev = self.work / "new", self.unpack(self.a.prev_data)
        sources = merge_sources(prev, new)
        if not sources:
            raise StintError("nothing to merge: no regeneration in this stint's folder and no --prev-data")
        if sources == [new]:
            shutil.copytree(new, self.data, dirs_exist_ok=False)
        elif self.run("merge", merge_args(self.a, sources, self.data), 5.0) != 0:
            raise StintError("data merge failed: see stint.log")
        self.state["done"].append("merge")

    def train(self, minutes: float) -> None:
        runs = self.state["train_runs"]
        init, refs = self.a.init_from, None
        # a later call: the newest weights of any earlier run (a failed run has none)
        ck = self.last_checkpoint()
        if ck is not None:
            init = str(ck / "drafter")
            saved = ck.parent.parent / "val_references.jsonl"
            refs = str(saved) if saved.is_file() else None
        data = Path(self.a.data) if self.a.data else self.data
        a = self.a
        # this call's part of the long schedule: on from the steps the stint's earlier runs took
        if a.schedule_steps is not None:
            start = a.schedule_start + sum(self.steps_of(r) for r in runs)
            if start >= a.schedule_steps:
                self.note(f"the {a.schedule_steps}-step LR schedule is done (step {start}): nothing to train")
                return
            extra = [f"optim.schedule_steps={a.schedule_steps}", f"optim.schedule_start={start}"]
            a = argparse.Namespace(**{**vars(a), "train_extra": [*a.train_extra, *extra]})
        run = self.work / f"train-{len(runs) + 1}"
        runs.append(run.name)
        self.save_state()
        # the trainer stops itself at its time limit; the timeout is only a guard (checkpoints every 200 steps)
        t = time.perf_counter()
        rc = self.run("train", train_args(a, data, run, init, minutes, refs), minutes + 0.5)
        left = minutes - (time.perf_counter() - t) / 60
        if (
            rc != 0
            and self.a.feature_pass == "native"
            and not list(run.glob("checkpoints/step-*"))
            and left >= 2.0
        ):
            self.note(
                "training with the native feature pass failed before its first checkpoint; again with hf"
            )
            native = ("runtime.feature_pass=", "runtime.compile=")
            extra = [x for x in a.train_extra if not x.startswith(native)]
            hf = argparse.Namespace(**{**vars(a), "feature_pass": "hf", "train_extra": extra})
            run = self.work / f"train-{len(runs) + 1}"
            runs.append(run.name)
            self.save_state()
            self.run("train", train_args(hf, data, run, init, round(left, 2), refs), left + 0.5)

    def evaluate(self, minutes: float, drafter: Path) -> None:
        sets = eval_sets(self.a)
        for name, (spec, limit) in sets.items():
            left = minutes - self.state["minutes"].get("eval", 0.0)
            if left <= 0.2:
                break
            self.run("eval", eval_args(self.a, drafter, spec, limit, self.work / "eval" / name), left)

    # ------------------------------------------------------------------ what comes back

    def last_checkpoint(self) -> Path | None:
        for name in reversed(self.state["train_runs"]):
            cks = sorted((self.work / name / "checkpoints").glob("step-*"))
            if cks:
                return cks[-1]
        return None

    def metrics(self, run: str) -> list[dict[str, Any]]:
        f = self.work / run / "metrics.jsonl"
        return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.is_file() else []

    def steps_of(self, run: str) -> int:
        """The optimizer steps training run `run` (a folder of this stint's) logged."""
        return last_step(self.metrics(run))

    def summary(self) -> dict[str, Any]:
        def manifest(p: Path) -> dict[str, Any]:
            f = p / "manifest.json"
            return json.loads(f.read_text()) if f.is_file() else {}

        new, cum = manifest(self.work / "new"), manifest(Path(self.a.data) if self.a.data else self.data)
        steps, loop_s, val_s, val = 0, 0.0, 0.0, {}
        for name in self.state["train_runs"]:
            lines = self.metrics(name)
            steps += last_step(lines)
            prev = 0
            for m in lines:  # the optimizer steps' own time (no start-up, compile or validation)
                loop_s += float(m.get("step_time_s", 0.0)) * (int(m["step"]) - prev)
                val_s += float(m.get("val/seconds", 0.0))
                prev = int(m["step"])
            val = next(({k: v for k, v in m.items() if k.startswith("val/")} for m in reversed(lines)
                        if "val/chain_tau" in m), val)  # fmt: skip
        evals = {}
        for rep in sorted((self.work / "eval").glob("*/report.json")):
            r = json.loads(rep.read_text())
            d = next(iter(r["drafters"].values()))
            trees = {k: v["tau"] for k, v in d["methods"].items() if k.startswith("ddtree-")}
            best = max(trees, key=trees.get) if trees else None
            evals[rep.parent.name] = {"prompts": d["samples"], "chain_tau": d["methods"]["chain"]["tau"],
                                      "ddtree_tau": trees.get(best), "ddtree_budget": best,
                                      "topk8_streak": d["methods"].get("topk-8", {}).get("tau")}  # fmt: skip
        m = self.state["minutes"]
        return {
            "stint": self.a.stint, "date": time.strftime("%Y-%m-%d", time.gmtime()), "card": _card(),
            "plan": self.state["plan"], "minutes": m, "train_minutes": m.get("train", 0.0),
            "train_loop_minutes": round(loop_s / 60, 3), "val_minutes": round(val_s / 60, 3),
            "gpu_minutes": round(sum(m.values()), 3), "train_steps": steps, "calls": self.state["calls"],
            "init_from": self.a.init_from,
            "new": {"samples": (new.get("counts") or {}).get("train"),
                    "loss_tokens": ((new.get("tokens") or {}).get("train") or {}).get("loss")},
            "cumulative": {"samples": (cum.get("counts") or {}).get("train"),
                           "loss_tokens": ((cum.get("tokens") or {}).get("train") or {}).get("loss")},
            "val": val, "eval": evals,
            **({"schedule": {"steps": self.a.schedule_steps, "start": self.a.schedule_start,
                             "end": self.a.schedule_start + steps}} if self.a.schedule_steps is not None else {}),
        }  # fmt: skip

    def write_summary(self) -> None:
        """The state (for a later call) and stint.json (in --out) as they stand now."""
        self.save_state()
        (self.out / "stint.json").write_text(json.dumps(self.summary(), indent=1) + "\n")

    def ship(self) -> None:
        """stint.json and bundle.tar's parts into --out, replacing the ones an earlier phase of this call wrote."""
        t = time.perf_counter()
        self.out.mkdir(parents=True, exist_ok=True)
        for p in self.out.glob("bundle.tar.part*"):
            p.unlink()
        members: list[tuple[Path, str]] = []
        ck = self.last_checkpoint()
        if ck is not None:
            bf16 = self.work / "drafter-bf16"
            subprocess.run(
                [sys.executable, "-c", _SAVE_BF16, str(ck / "drafter"), str(bf16)], check=True, cwd=REPO
            )
            members.append((bf16, "drafter"))
            run = ck.parent.parent
            members += [(run / n, n) for n in ("metrics.jsonl", "config.yaml", "val_references.jsonl")
                        if (run / n).is_file()]  # fmt: skip
        if (self.work / "eval").is_dir():
            members.append((self.work / "eval", "eval"))
        size = sum(_size(p) for p, _ in members)
        new = self.work / "new"
        if new.is_dir() and size + _size(new) <= self.a.bundle_mib * 2**20:
            members.append((new, "new-data"))
        self.state["minutes"]["ship"] = round(
            self.state["minutes"].get("ship", 0.0) + (time.perf_counter() - t) / 60, 3
        )
        self.write_summary()
        if members:
            tar = self.work / "bundle.tar"
            with tarfile.open(tar, "w") as tf:
                for p, name in members:
                    tf.add(p, arcname=name)
            subprocess.run(
                ["bash", str(REPO / "benchmarks/gpu/parts.sh"), "split", str(tar), str(self.out)], check=True
            )


_SAVE_BF16 = """import sys, torch
from flashdraft.drafter import DFlashDrafter
DFlashDrafter.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2], dtype=torch.bfloat16)"""


def _size(p: Path) -> int:
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _card() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 — the summary names what it can
        return "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--stint", type=int, required=True, help="stint index: picks seed, temperature, turns")
    p.add_argument("--phases", default="regen,merge,train,eval", help="comma-separated, in this order")
    p.add_argument(
        "--budget-min",
        type=float,
        default=9.0,
        help="minutes this call may use (a device call: at most 10; keep ~1 for start-up)",
    )
    p.add_argument("--regen-min", type=float, default=3.0)
    p.add_argument(
        "--eval-min", type=float, default=0.0, help="0: no eval phase (the trainer's val/* still log)"
    )
    p.add_argument("--target", default=os.environ.get("TARGET", str(gpu_dir("work") / "smollm2-bf16")))
    p.add_argument("--eval-target", default=None, help="the eval's float32 target (default: --target)")
    p.add_argument(
        "--init-from", default="models/smollm2-135m-instruct-dflash-b16", help="the last shipped weights"
    )
    p.add_argument(
        "--prev-data",
        action="append",
        default=[],
        help="an earlier stint's dataset, merged in (a folder, or a .fdpack file that is unpacked first; repeatable)",
    )
    p.add_argument(
        "--prev-packs", default=None, metavar="DIR",
        help="every campaign-stint-K.fdpack in DIR (make_stage.py --packs: $STAGE), merged in stint order after "
        "--prev-data",
    )  # fmt: skip
    p.add_argument("--data", default=None, help="train on this dataset instead of regen + merge")
    p.add_argument(
        "--input", action="append", default=None, help="training prompts (default: the staged ShareGPT)"
    )
    p.add_argument(
        "--humaneval",
        default=str(gpu_dir("stage") / "HumanEval.jsonl.gz"),
        help="HumanEval for contamination",
    )
    p.add_argument("--max-new-tokens", type=int, default=512, help="regeneration cap per answer")
    p.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "sdpa", "varlen"],
        help="regeneration's decode attention",
    )
    p.add_argument(
        "--temperature", type=float, default=None, help="instead of the stint's (0: greedy answers)"
    )
    p.add_argument("--max-turns", type=int, default=None, help="instead of the stint's: user turns answered")
    p.add_argument(
        "--self-prompts", type=int, default=0, metavar="N",
        help="first write N user messages with the target itself (`flashdraft data self-prompts`, seeded by the stint) "
        "and answer them too; with no --input, only them",
    )  # fmt: skip
    p.add_argument(
        "--self-opening", action="append", default=[],
        help="text a share of those messages starts with (repeatable; `flashdraft data self-prompts --opening`)",
    )
    p.add_argument("--skip", type=int, default=0, help="regenerate from the (N+1)-th conversation on")
    p.add_argument(
        "--limit", type=int, default=None, help="regenerate at most this many conversations after --skip"
    )
    p.add_argument(
        "--continue-from", action="append", default=[],
        help="an earlier stint's dataset (a folder, or a .fdpack file that is unpacked first; repeatable): answer only "
        "the later turns of the conversations it answered, given its answers as history (`flashdraft data "
        "regenerate --continue-from`)",
    )  # fmt: skip
    p.add_argument(
        "--max-batch-tokens", type=int, default=2_500_000,
        help="regeneration's rows x (max length + new tokens) per batch: a KV cache of ~23 KB a token for "
        "SmolLM2-135M in bf16. 512 rows x 3,584 = 1.8M tokens (39 GiB) fit under 2.5M; an out-of-memory "
        "retry halves it",
    )  # fmt: skip
    p.add_argument("--val-every", type=int, default=1000, help="trainer validation interval (eval.every)")
    p.add_argument(
        "--val-references", default=None, help="the trainer's validation references (a frozen reference file)"
    )
    p.add_argument("--eval-set", action="append", default=None, help="NAME=SPEC@LIMIT (repeatable)")
    p.add_argument(
        "--feature-pass", choices=("hf", "native"), default="native",
        help="the target's training feature pass (native: compiled too; hf: transformers', the fallback)",
    )  # fmt: skip
    p.add_argument("--train-extra", nargs="*", default=[], help="more key=value training overrides")
    p.add_argument(
        "--schedule-steps", type=int, default=None,
        help="train a part of one LR schedule this many optimizer steps long (optim.schedule_steps), from "
        "--schedule-start on, instead of a schedule of this call's own: a campaign spread over stints as one run",
    )  # fmt: skip
    p.add_argument(
        "--schedule-start", type=int, default=0,
        help="the step of --schedule-steps' schedule this stint starts at: the last stint's schedule end "
        "(its stint.json 'schedule')",
    )  # fmt: skip
    p.add_argument(
        "--bundle-mib", type=float, default=60.0, help="new data rides in the bundle below this size"
    )
    p.add_argument("--work", default=None, help="work folder (default $WORK/stint-K)")
    p.add_argument("--out", default=None, help="what comes back (default $OUT)")
    p.add_argument(
        "--dry-run", action="store_true", help="print the plan and command lines as JSON; run nothing"
    )
    a = p.parse_args(argv)
    if a.input is None:
        a.input = [] if a.self_prompts else [f"sharegpt:{gpu_dir('stage') / 'sharegpt_compact.json.gz'}"]
    for spec in a.input:
        check_training_input(spec)
    if a.prev_packs is not None:
        a.prev_data = [*a.prev_data, *map(str, staged_packs(Path(a.prev_packs)))]
    if a.schedule_steps is not None and not 0 <= a.schedule_start < a.schedule_steps:
        p.error(f"--schedule-start {a.schedule_start} must be in [0, --schedule-steps {a.schedule_steps})")
    return a


def commands(a: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    """Every command line the stint would run this call (the dry run's output; tests parse them with the CLI)."""
    work = Path(a.work or gpu_dir("work") / f"stint-{a.stint}")
    data = Path(a.data) if a.data else work / "data"
    out: dict[str, Any] = {"plan": asdict(stint_plan(a)), "budget": asdict(budget)}
    phases = a.phases.split(",")
    if "regen" in phases and not a.data:
        if a.self_prompts:
            out["self-prompts"] = self_prompts_args(a, stint_plan(a), work / SELF_PROMPTS)
        out["regen"] = regen_args(a, stint_plan(a), work / "new", budget.regen)
    if "merge" in phases and not a.data and a.prev_data:
        prev = [prev_dataset(p, work) for p in a.prev_data]
        out["merge"] = merge_args(a, merge_sources(prev, work / "new", "regen" in phases), data)
    if "train" in phases:
        out["train"] = train_args(a, data, work / "train-1", a.init_from, budget.train)
    if "eval" in phases and budget.eval > 0:
        out["eval"] = [
            eval_args(a, work / "drafter-bf16", s, n, work / "eval" / k) for k, (s, n) in eval_sets(a).items()
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    st: Stint | None = None
    try:
        a = parse_args(argv)
        phases = [p for p in a.phases.split(",") if p]
        unknown = set(phases) - {"regen", "merge", "train", "eval"}
        if unknown:
            raise StintError(f"--phases: unknown {sorted(unknown)}; use regen, merge, train, eval")
        regen = a.regen_min if "regen" in phases and not a.data else 0.0
        budget = Budget.split(a.budget_min, regen, a.eval_min if "eval" in phases else 0.0)
        if a.dry_run:
            print(json.dumps(commands(a, budget), indent=1))
            return 0
        if not Path(a.humaneval).is_file():
            raise StintError(
                f"--humaneval {a.humaneval}: not found (stage it: the contamination check needs it)"
            )
        st = Stint(a)
        st.work.mkdir(parents=True, exist_ok=True)
        st.out.mkdir(parents=True, exist_ok=True)
        st.state["calls"] += 1
        if "regen" in phases and not a.data:
            st.regen(budget.regen)
            st.ship()  # the new data comes back even if the machine goes before training ends
        if "merge" in phases and not a.data:
            st.merge()
        if "train" in phases:
            # the rest of this call's minutes, less eval and shipping (regen may have ended early or late)
            left = a.budget_min - st.elapsed_min() - budget.eval - SHIP_MIN
            if left >= 1.0:
                st.train(round(left, 2))
            st.ship()
        if "eval" in phases and budget.eval > 0 and (st.work / "drafter-bf16").is_dir():
            st.evaluate(budget.eval, st.work / "drafter-bf16")
            st.ship()
        st.save_state()
        return 0
    except StintError as e:
        if st is not None and st.work.is_dir():  # a failed phase's minutes count too (stint.json, next call)
            st.out.mkdir(parents=True, exist_ok=True)
            st.write_summary()
        print(f"campaign_stint: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
