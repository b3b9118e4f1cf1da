"""How much slower a CPU trainer's steps get while `flashdraft eval --watch` evaluates its checkpoints beside it.

    PYTHONPATH=$PWD python benchmarks/watch_slowdown.py --work /tmp/watch-slowdown \
        --setting "" --setting "--threads 2 --nice 0" --setting "" --setting "--threads 2 --nice 0"

Per setting (extra `eval --watch` options; "" = the watcher's defaults: a quarter of the cores at nice 10 on
CPU), one process trains a 2-layer b8 drafter for --steps steps on a random-weight Llama target (shapes below)
from random token documents, writing a checkpoint every --every steps, while a second process runs
`flashdraft eval --watch RUN` on random prompts until the run is finished. The trainer's s/step inside the
evaluation windows vs outside them comes from RUN/metrics.jsonl and RUN/eval/log.jsonl
(flashdraft/eval/watch.py: run_pace), as the watcher prints it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHAPES = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
)  # fmt: skip


@dataclass
class Doc:
    id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray


def make_target(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPES)).save_pretrained(folder)


def train_run(target: Path, run: Path, steps: int, every: int) -> None:
    """The trainer process: online features from the target, a checkpoint every `every` steps."""
    import torch

    from flashdraft.config import load_config
    from flashdraft.target import load_target
    from flashdraft.train.config import TrainConfig
    from flashdraft.train.launch import train

    rng = np.random.default_rng(0)
    docs = []
    for i in range(400):
        n = int(rng.integers(64, 128))
        docs.append(Doc(f"d{i}", rng.integers(3, SHAPES["vocab_size"], n), np.r_[np.zeros(n // 4, bool), np.ones(n - n // 4, bool)]))  # fmt: skip
    cfg = load_config(TrainConfig, None, [
        f"run_dir={run}", f"model.target={target}", "model.num_layers=2", "model.block_size=8",
        "data.max_length=128", "data.token_budget=512", "data.max_anchors=16", "data.dataset=<in-memory>",
        f"optim.max_steps={steps}", f"checkpoint.every={every}", "checkpoint.keep_last=1000",
        "telemetry.log_every=2", "telemetry.progress=false", "runtime.dtype=float32", "runtime.device=cpu",
    ])  # fmt: skip
    t = load_target(str(target), dtype=torch.float32, device="cpu")
    res = train(cfg, command="benchmarks/watch_slowdown.py", target=t, samples=docs)
    print(f"trainer: {res.steps} steps ({res.stopped})", file=sys.stderr)


def measure(work: Path, name: str, setting: str, steps: int, every: int, prompts: Path) -> dict[str, object]:
    from flashdraft.eval.watch import read_log, run_pace

    run = work / name
    if run.exists():
        sys.exit(f"{run} exists: pick a new --work folder")
    me = [sys.executable, __file__, "--work", str(work)]
    trainer = subprocess.Popen([*me, "--train-run", str(run), "--steps", str(steps), "--every", str(every)])
    subprocess.run(
        [sys.executable, "-c", "from flashdraft.cli import app; app()", "eval", "--watch", str(run),
         "--target", str(work / "target"), "--dataset", str(prompts), "--max-new-tokens", "64",
         "--budgets", "8,32", "--topk", "8", "--poll", "1", "--cache-dir", str(work / "cache"),
         "--no-progress", *shlex.split(setting)],
        check=True,
    )  # fmt: skip
    if trainer.wait() != 0:
        sys.exit(f"trainer of {run} failed")
    pace = run_pace(run)
    rows = read_log(run)
    return {
        "setting": setting or "(defaults)",
        "outside_s_per_step": pace.outside_s,
        "outside_steps": pace.outside_steps,
        "during_s_per_step": pace.during_s,
        "during_steps": pace.during_steps,
        "slowdown": pace.slowdown,
        "eval_seconds": [round(r["time"] - r["started"], 1) for r in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--setting", action="append", help="extra `eval --watch` options ('' = defaults)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--train-run", type=Path, help=argparse.SUPPRESS)  # the trainer subprocess
    a = ap.parse_args()
    if a.train_run is not None:
        return train_run(a.work / "target", a.train_run, a.steps, a.every)
    a.work.mkdir(parents=True, exist_ok=True)
    if not (a.work / "target").is_dir():
        make_target(a.work / "target")
    prompts = a.work / "prompts.jsonl"
    rng = np.random.default_rng(1)
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "input_ids": rng.integers(3, SHAPES["vocab_size"], 32).tolist()}) + "\n" for i in range(a.prompts)))  # fmt: skip
    results = []
    for i, setting in enumerate(a.setting or [""]):
        t0 = time.time()
        results.append(measure(a.work, f"run-{i}", setting, a.steps, a.every, prompts))
        results[-1]["wall_s"] = round(time.time() - t0, 1)
        print(json.dumps(results[-1]))
    (a.work / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
