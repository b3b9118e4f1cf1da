"""`flashdraft quickstart`: the whole loop on the embedded default target, with flashdraft's own commands.

    flashdraft quickstart                       # CPU, ≤ 20 minutes on 2 cores (training takes what is left)
    flashdraft quickstart --device cuda         # larger sizes on a GPU

Stages (each one a real `flashdraft` command, printed before it runs, with its own progress bar):
1. data:     the target (SmolLM2-135M-Instruct) regenerates answers to ShareGPT prompts;
2. features: the selected target layers' outputs are dumped once (offline mode), so training
             epochs do not rerun the target;
3. train:    a small drafter is trained on them (on CPU it starts from the target's own layers:
             model.init_from_target=next);
4. eval:     exact offline τ (chain, DDTree budgets, top-k streak) on held-out ShareGPT prompts
             and on HumanEval (published wording), side by side with the shipped drafter in
             `models/` when there is one; a Markdown table, JSON and plots in WORK/report-*.

The sizes are chosen to finish on a 2-core CPU, so the drafter is small and briefly trained:
it shows the loop works and what a few minutes of CPU training reach, not what a GPU-trained drafter does.
"""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import typer

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2-b16.yaml"
SHIPPED = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct-dflash-b16"


@dataclass
class QuickstartSizes:
    prompts: int  # ShareGPT conversations regenerated (first user turn each)
    max_new_tokens: int  # per regenerated answer
    regen_batch: int
    max_length: int  # tokens per training sample
    layers: int  # drafter depth
    target_layer_ids: list[int] | None  # target layers feeding the drafter (None: the default of docs/method.md §2.2)
    block_size: int
    steps: int  # optimizer steps
    token_budget: int  # target tokens per micro-batch
    max_anchors: int  # blocks per document per step
    lr: float
    gamma: float | None  # loss decay over slots (None: the paper's per-B default)
    ema_decay: float  # optim.ema_decay: checkpoints hold a moving average of the weights (0: off)
    init_from_target: str  # model.init_from_target: none | last | next (start from target layers)
    softmax_vocab: int  # loss.softmax_vocab: the loss's softmax over this many most frequent label tokens (0: all)
    # training stops here even before `steps` (keeps the whole run in budget); with a limit the trainer fits its
    # steps and LR schedule to it after ~100 steps (runtime.fit_steps_to_time_limit), so `steps` is an upper bound
    train_minutes: float | None
    # the whole run's minutes: training gets at most what the data and features stages left of them, less
    # EVAL_RESERVE_MIN for the two evals (a slower machine trains fewer steps instead of running over)
    total_minutes: float | None
    eval_prompts: int  # held-out ShareGPT prompts and HumanEval problems, each
    eval_tokens: int  # reference length
    budgets: str
    # the target's dtype when it regenerates and dumps features, and the training compute dtype (bf16:
    # autocast with fp32 master weights); the eval always runs in float32 (exact references and τ)
    dtype: str


SIZES = {
    # CPU with native bf16 (AVX512-BF16 / AMX): the target regenerates and dumps features in bf16, training runs
    # autocast with fp32 master weights, the eval stays float32. A 2-layer b3 drafter started from target layers
    # 16–17 (init_from_target=next after feature layer 15; γ = 1: the head costs the same for every labelled slot,
    # so few slots and many anchors). The H200 screens (benchmarks/RESULTS.md, "Recipe screens" A–C)
    # found no recipe knob at these sizes (feature layer, init, lr, γ, weight decay, noise, anchors, answer length,
    # more prompts, weight averaging) that moves held-out τ by more than ±0.03; more steps do (Xeon-2c, 2026-12-05:
    # 2,800 → 4,000 steps, chain τ 1.48 → 1.52 on 100 held-out prompts). So training takes every minute the 20
    # leave (train_minutes 12, cut to what total_minutes leaves, steps and LR schedule fitted to them:
    # runtime.fit_steps_to_time_limit; `steps` is only a ceiling), and its steps are cheaper: the loss's softmax
    # over the 8,192 most frequent label tokens (loss.softmax_vocab; every training label here) — 0.105 s a step
    # instead of 0.153 (benchmarks/train_step_profile.py, Xeon-2c). Labelling the prompts too (target's greedy
    # tokens) measured no better (1.48 vs 1.48 at 2,800 steps, 1.51 vs 1.52 at ~5,300) for a 2.9× features pass:
    # removed. EMA 0.998, lr 2.5e-3 (screen C). On the 2-core AMX Xeon, empty cache (RESULTS "The CPU quickstart", 2026-12-05):
    # 18.0 min (data 236 s, features 152 s, 10.0 training minutes fitted to 4,230 steps, evals 53 + 56 s), held-out
    # chain τ 1.517 on 24 prompts and on 100 (the previous preset 1.483 on the 100; paired +0.041, se 0.013).
    "cpu": QuickstartSizes(
        prompts=1500,
        max_new_tokens=96,
        regen_batch=64,
        max_length=384,
        layers=2,
        target_layer_ids=[15],
        block_size=3,
        steps=8000,
        token_budget=1024,
        max_anchors=16,
        lr=2.5e-3,
        gamma=1.0,
        ema_decay=0.998,
        init_from_target="next",
        softmax_vocab=8192,
        train_minutes=12.0,
        total_minutes=20.0,
        eval_prompts=24,
        eval_tokens=96,
        budgets="8,32",
        dtype="bfloat16",
    ),  # fmt: skip
    "cuda": QuickstartSizes(
        prompts=4000,
        max_new_tokens=384,
        regen_batch=512,
        max_length=1024,
        layers=5,
        target_layer_ids=None,
        block_size=16,
        steps=1500,
        token_budget=16384,
        max_anchors=256,
        lr=6e-4,
        gamma=None,
        ema_decay=0.0,
        init_from_target="none",  # not measured on a GPU run yet; the paper trains from scratch
        softmax_vocab=0,
        train_minutes=None,
        total_minutes=None,
        eval_prompts=50,
        eval_tokens=256,
        budgets="8,16,32,64,128,256,512",
        dtype="bfloat16",
    ),  # fmt: skip
}


# CPU without native bf16 (no AVX512-BF16 / AMX: bf16 is emulated there, ~80× slower than float32): float32
# sizes, a 2-layer b3 drafter (target layers 16–17). Screened on the H200 as the CPU runs it (benchmarks/RESULTS.md,
# "Recipe screens" A: 60 held-out prompts): at equal steps 2 layers and b3 lose nothing against 4 layers and b4,
# and a step costs half as much on the CPU (0.32 s vs 0.67 s on a 2-core Zen 3 EPYC, 2026-12-03), so the same training
# minutes buy ~1,000 steps; with 450 prompts that gave held-out chain τ 1.385 / 1.375 (two seeds) against 1.285
# for the earlier 300 prompts × 460 steps of the 4-layer b4 drafter. No other knob (lr, γ, weight decay,
# feature / embedding noise, anchors) moved τ beyond the seed noise there. Batches of 32 rows regenerate
# faster than 64 on that CPU (the same 140 prompts: 125 s against 154 and 180 s; 24 rows 127 s, 16 rows 168 s).
# End to end on that CPU, idle, empty cache: 14.2 minutes (data 360 s, features 75 s, train 310 s = all 1,000
# steps, eval 55 + 51 s with batched references), held-out chain τ 1.38 (12 prompts; DDTree-8 1.63).
SIZES["cpu-fp32"] = dataclasses.replace(
    SIZES["cpu"], prompts=450, regen_batch=32, steps=1000, lr=4e-3, ema_decay=0.0, softmax_vocab=0,
    train_minutes=6.0, eval_prompts=12, dtype="float32",
)  # fmt: skip


# kept for the CPU evals (held-out ShareGPT and HumanEval, both drafters: 24 prompts each 66 + 72 s on a
# 2-core bf16 EPYC, 51 + 54 s on a 2-core AMX Xeon; 12 each 106 s on a 2-core AVX2 EPYC) and the train stage's start-up
# and last checkpoint, which its time limit does not count (~0.3 min) (benchmarks/RESULTS.md)
EVAL_RESERVE_MIN = 3.5


def train_minutes_for(sizes: QuickstartSizes, elapsed_min: float) -> float | None:
    """The training stage's time limit: `sizes.train_minutes`, cut to what `sizes.total_minutes` leaves after
    `elapsed_min` (data and features) and EVAL_RESERVE_MIN; at least one minute."""
    if sizes.total_minutes is None:
        return sizes.train_minutes
    left = max(1.0, round(sizes.total_minutes - elapsed_min - EVAL_RESERVE_MIN, 1))
    return left if sizes.train_minutes is None else min(sizes.train_minutes, left)


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 in hardware (x86 AVX512-BF16 or AMX, from /proc/cpuinfo): there bf16
    runs ~3.7× faster than float32 on the 2-core machine the CPU sizes were measured on; elsewhere bf16 is
    emulated and the float32 sizes are used."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def preset_for(device: str) -> str:
    if device.startswith("cuda"):
        return "cuda"
    return "cpu" if cpu_has_native_bf16() else "cpu-fp32"


def train_overrides(sizes: QuickstartSizes, run: Path, data: Path, feats: Path, device: str) -> list[str]:
    """The `flashdraft train` key=value overrides of configs/smollm2-b16.yaml for these sizes."""
    return [
        f"run_dir={run}", f"data.dataset={data}", f"data.max_length={sizes.max_length}",
        f"data.token_budget={sizes.token_budget}", f"data.max_anchors={sizes.max_anchors}",
        f"model.num_layers={sizes.layers}", f"model.block_size={sizes.block_size}",
        f"optim.max_steps={sizes.steps}", f"optim.lr={sizes.lr}", f"checkpoint.every={sizes.steps}",
        f"optim.ema_decay={sizes.ema_decay}",
        f"model.init_from_target={sizes.init_from_target}",
        *([f"model.target_layer_ids=[{','.join(map(str, sizes.target_layer_ids))}]"] if sizes.target_layer_ids else []),
        *([f"loss.gamma={sizes.gamma}"] if sizes.gamma is not None else []),
        f"loss.softmax_vocab={sizes.softmax_vocab}",
        *([f"runtime.time_limit_min={sizes.train_minutes}", "runtime.fit_steps_to_time_limit=true"]
          if sizes.train_minutes is not None else []),
        "pipeline.mode=offline", f"pipeline.features_dir={feats}", f"runtime.device={device}",
        f"runtime.dtype={sizes.dtype}",
        "eval.every=0",  # the config's validation computes references: CPU minutes the quickstart has not got
    ]  # fmt: skip


def regenerate_args(
    sizes: QuickstartSizes,
    prompts_file: Path,
    out: Path,
    device: str,
    dtype: str,
    *,
    batch_size: int | None = None,
    target: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`flashdraft data regenerate ...` (the subcommand words included) for these sizes: the quickstart's data
    stage, also run by benchmarks/gpu/qs_screen.py. `batch_size` overrides `sizes.regen_batch`; `target` adds
    `--target` (else the CLI's default target); `extra` goes just before `--out`."""
    return [
        "data", "regenerate", *(["--target", target] if target is not None else []),
        "--input", f"prompts:{prompts_file}", "--max-new-tokens", str(sizes.max_new_tokens),
        "--batch-size", str(sizes.regen_batch if batch_size is None else batch_size),
        "--max-length", str(sizes.max_length), "--block-size", str(sizes.block_size), "--eval-fraction", "0.1",
        "--device", device, "--dtype", dtype, *extra, "--out", str(out),
    ]  # fmt: skip


def features_args(
    sizes: QuickstartSizes,
    data: Path,
    out: Path,
    device: str,
    dtype: str,
    *,
    target: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """`flashdraft features dump ...` (the subcommand words included) for these sizes: the quickstart's
    features stage, also run by benchmarks/gpu/qs_screen.py. The target layers are `sizes.target_layer_ids`,
    else the default layers for a `sizes.layers`-layer drafter; `dtype` is both the features' and the target's
    dtype; `target` adds `--target`; `extra` goes at the end."""
    layers = (["--layers", ",".join(map(str, sizes.target_layer_ids))] if sizes.target_layer_ids
              else ["--drafter-layers", str(sizes.layers)])  # fmt: skip
    return [
        "features", "dump", *(["--target", target] if target is not None else []),
        "--dataset", str(data), "--out", str(out), *layers,
        "--max-length", str(sizes.max_length), "--token-budget", str(sizes.token_budget),
        "--dtype", dtype, "--target-dtype", dtype, "--device", device,
        *extra,
    ]  # fmt: skip


def _run(args: list[str], log: list[str]) -> None:
    cmd = [sys.executable, "-m", "flashdraft.cli", *args]
    line = "flashdraft " + " ".join(shlex.quote(a) for a in args)
    typer.secho(f"\n$ {line}", bold=True)
    log.append(line)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    if rc != 0:
        typer.secho(f"quickstart: stage failed (exit {rc}): {line}", fg="red", err=True)
        raise typer.Exit(rc)
    typer.echo(f"  ({time.perf_counter() - t0:.0f} s)")


def write_first_turns(path: Path, n: int, source: str = "sharegpt") -> None:
    """The first user turn of the first `n` ShareGPT conversations, as a prompts JSONL (one answer each:
    regenerating every turn of a conversation costs ~3.5× more on a CPU budget). The records the source
    skips are listed beside it (PATH.skipped.txt), and one line says how many."""
    import json

    from flashdraft.data.sources import SourceStats, load_conversations

    rows = []
    stats = SourceStats()
    convs = load_conversations(source, limit=n, stats=stats)
    if stats.bad:
        listing = path.with_name(path.stem + ".skipped.txt")
        stats.write_bad(listing)
        typer.echo(
            f"{source}: skipped {len(stats.bad)} bad record(s) before the first {n} usable ones; listed in {listing}"
        )
    for c in convs:
        user = next((t.content for t in c.turns if t.role == "user"), None)
        if user:
            rows.append(json.dumps({"id": c.id, "prompt": user}))
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(rows) + "\n")
    tmp.replace(path)


def set_aside_unfinished_run(run: Path) -> Path | None:
    """A quickstart killed before its first checkpoint leaves a run folder that `flashdraft train` refuses
    (it never appends to an old run): rename it beside itself, nothing deleted, and say so."""
    if not run.is_dir() or not any(run.iterdir()):
        return None
    aside = run.with_name(f"{run.name}.unfinished-{time.strftime('%Y%m%d-%H%M%S')}")
    run.rename(aside)
    typer.secho(f"{run} has no checkpoint (an earlier run stopped early): moved to {aside}", fg="yellow")
    return aside


def register(app: typer.Typer) -> None:
    @app.command()
    def quickstart(
        work: Path = typer.Option(Path("quickstart"), help="folder for the data, run and reports"),
        device: str = typer.Option("cpu", help="cpu | cuda (cuda scales the sizes up)"),
        prompts: int | None = typer.Option(None, help="override: ShareGPT prompts to regenerate"),
        steps: int | None = typer.Option(None, help="override: optimizer steps"),
        threads: int | None = typer.Option(None, help="torch CPU threads for every stage"),
        preset: str | None = typer.Option(
            None,
            help="sizes: cpu (a CPU with native bf16) | cpu-fp32 | cuda; default: from --device and the CPU",
        ),
    ) -> None:
        """Regenerate data, train a small drafter and evaluate it on the default target (SmolLM2)."""
        import os

        if preset is not None and preset not in SIZES:
            raise typer.BadParameter(f"{preset!r}: use one of {', '.join(SIZES)}", param_hint="--preset")
        why = (
            " (--preset)"
            if preset
            else {"cpu-fp32": " (this CPU has no native bf16)"}.get(preset_for(device), "")
        )
        preset = preset or preset_for(device)
        sizes = dataclasses.replace(SIZES[preset])
        if prompts is not None:
            sizes.prompts = prompts
        if steps is not None:
            sizes.steps = steps
        if threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(threads)
        work.mkdir(parents=True, exist_ok=True)
        data, feats, run = work / "data", work / "features", work / "run"
        dtype = sizes.dtype
        log: list[str] = []
        t0 = time.perf_counter()
        typer.secho(f"quickstart in {work}/ on {device}, sizes {preset!r}{why}: {sizes}", fg="cyan")
        if not (data / "manifest.json").is_file():
            first_turns = work / "prompts.jsonl"
            write_first_turns(first_turns, sizes.prompts)
            _run(regenerate_args(sizes, first_turns, data, device, dtype), log)
        if not (feats / "manifest.json").is_file():
            _run(features_args(sizes, data, feats, device, dtype), log)
        train_min = train_minutes_for(sizes, (time.perf_counter() - t0) / 60)
        if train_min != sizes.train_minutes:
            typer.secho(
                f"training limited to {train_min} min to keep the run within {sizes.total_minutes:g}",
                fg="cyan",
            )
        overrides = train_overrides(
            dataclasses.replace(sizes, train_minutes=train_min), run, data, feats, device
        )
        if not (run / "checkpoints").is_dir():  # a rerun evaluates what the first run trained
            set_aside_unfinished_run(run)
            _run(["train", str(CONFIG), *overrides], log)
        drafters = ["--drafter", str(run)]
        if (SHIPPED / "config.json").is_file() and any(SHIPPED.glob("model*.safetensors*")):
            drafters += ["--drafter", str(SHIPPED)]
        for name, dataset in (("sharegpt-heldout", str(data)), ("humaneval", "humaneval")):
            _run(["eval", "--target", "default", *drafters, "--dataset", dataset,
                  "--limit", str(sizes.eval_prompts), "--max-new-tokens", str(sizes.eval_tokens),
                  "--budgets", sizes.budgets, "--device", device, "--out", str(work / f"report-{name}")], log)  # fmt: skip
        (work / "COMMANDS.md").write_text(
            "# quickstart commands\n\n" + "\n".join(f"    {c}" for c in log) + "\n"
        )
        typer.secho(f"\nquickstart done in {(time.perf_counter() - t0) / 60:.1f} min; reports in {work}/report-*",
                    fg="green")  # fmt: skip
