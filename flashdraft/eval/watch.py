"""Evaluate a live training run: every new checkpoint, as it appears, appended to RUN/eval/log.jsonl.

    flashdraft eval --watch runs/smollm2-b16 --dataset humaneval --limit 32 --budgets 8,32,128

Training never waits for this: the evaluator only reads `RUN/checkpoints/step-*/drafter` (a
checkpoint folder that exists is complete — training writes a temp folder and renames it) and
writes only under `RUN/eval/`:

    RUN/eval/log.jsonl            one line per evaluated checkpoint (the summary `flashdraft runs status` shows)
    RUN/eval/step-00001234.json   the full report of that checkpoint
    RUN/eval/tau_over_steps.png   τ over training steps

A checkpoint deleted by rotation before it is read is skipped with a warning. References are
computed once (first checkpoint) and cached, so later checkpoints cost only the replay.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashdraft.eval.evaluate import EvalReport

log = logging.getLogger("flashdraft.eval")

_STEP = re.compile(r"^step-(\d+)$")


def run_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint folders of a run, sorted by step (flashdraft.train.checkpoint when present)."""
    try:
        from flashdraft.train.checkpoint import list_checkpoints
    except ImportError:  # the training package is optional for evaluation
        root = Path(run_dir) / "checkpoints"
        found = [
            p
            for p in root.glob("step-*")
            if _STEP.match(p.name) and (p / "drafter" / "config.json").is_file()
        ]
        return sorted(found, key=checkpoint_step)
    return [p for p in list_checkpoints(run_dir) if (p / "drafter" / "config.json").is_file()]


def checkpoint_step(path: str | Path) -> int:
    m = _STEP.match(Path(path).name)
    if not m:
        raise ValueError(f"{path}: not a checkpoint folder (expected a name like step-00001234)")
    return int(m.group(1))


def resolve_drafter(path: str | Path) -> tuple[Path, int | None]:
    """(drafter folder, step or None): a drafter folder, a checkpoint folder, or a run (its newest checkpoint)."""
    p = Path(path)
    if (p / "config.json").is_file():
        step = checkpoint_step(p.parent) if p.name == "drafter" and _STEP.match(p.parent.name) else None
        return p, step
    if (p / "drafter" / "config.json").is_file():
        return p / "drafter", checkpoint_step(p) if _STEP.match(p.name) else None
    if (p / "checkpoints").is_dir():
        found = run_checkpoints(p)
        if not found:
            raise FileNotFoundError(
                f"{p}: the run has no complete checkpoint yet (checkpoints/step-*/drafter)"
            )
        return found[-1] / "drafter", checkpoint_step(found[-1])
    raise FileNotFoundError(
        f"{p}: not a drafter folder (config.json + model.safetensors), a checkpoint folder or a run folder"
    )


def evaluated_steps(run_dir: str | Path) -> set[int]:
    log_path = Path(run_dir) / "eval" / "log.jsonl"
    if not log_path.is_file():
        return set()
    steps = set()
    for line in log_path.read_text().splitlines():
        try:
            steps.add(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue  # a torn or foreign line is not fatal
    return steps


def log_line(report: EvalReport, step: int, checkpoint: Path) -> dict[str, Any]:
    """The one-line summary of a checkpoint (the contract `flashdraft runs status` reads)."""
    name, d = next(iter(report.drafters.items()))
    del name
    return {
        "step": step,
        "checkpoint": str(checkpoint),
        "tau_chain": d.methods["chain"].tau,
        "tau_ddtree": {str(b): round(d.methods[f"ddtree-{b}"].tau, 4) for b in report.budgets},
        "tau_topk": {str(k): round(d.methods[f"topk-{k}"].tau, 4) for k in report.topk},
        "dataset": report.dataset,
        "prompts": report.references.count,
        "max_new_tokens": report.max_new_tokens,
        "temperature": report.temperature,
        "slot_accuracy": [round(x, 4) for x in d.slot_accuracy],
        "eval_seconds": round(report.seconds, 1),
        "time": time.time(),
    }


@dataclass
class WatchResult:
    evaluated: list[int]  # steps evaluated by this call
    skipped: list[int]  # steps whose checkpoint vanished before it was read


def watch(
    run_dir: str | Path,
    evaluate_checkpoint: Callable[[Path, str], EvalReport],
    *,
    poll_s: float = 60.0,
    once: bool = False,
    max_evaluations: int | None = None,
    stop: threading.Event | None = None,
    timeout_s: float | None = None,
) -> WatchResult:
    """Poll `run_dir` and evaluate each checkpoint not yet in RUN/eval/log.jsonl, oldest first.

    `evaluate_checkpoint(drafter_dir, name)` returns the report (the CLI binds target, prompts
    and settings). `once`: evaluate what is there and return. Stops after `max_evaluations`,
    when `stop` is set, or after `timeout_s`.
    """
    from flashdraft.eval.report import atomic_write_text, plot_watch_log, report_json

    run = Path(run_dir)
    out = run / "eval"
    t0 = time.monotonic()
    result = WatchResult([], [])
    while True:
        done = evaluated_steps(run) | set(result.skipped)
        pending = [c for c in run_checkpoints(run) if checkpoint_step(c) not in done]
        for ckpt in pending:
            step = checkpoint_step(ckpt)
            try:
                report = evaluate_checkpoint(ckpt / "drafter", f"step-{step}")
            except Exception as e:
                if ckpt.exists():
                    raise
                # rotated away by training (keep_last) between listing and reading
                log.warning("checkpoint %s vanished before it was evaluated (%s): skipped", ckpt, e)
                result.skipped.append(step)
                continue
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out / f"step-{step:08d}.json", report_json(report))
            line = json.dumps(log_line(report, step, ckpt)) + "\n"
            with open(out / "log.jsonl", "a") as f:  # one write of one whole line
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            plot_watch_log(out / "log.jsonl", out / "tau_over_steps.png")
            result.evaluated.append(step)
            log.info(
                "step %d: tau chain %.3f",
                step,
                report.drafters[next(iter(report.drafters))].methods["chain"].tau,
            )
            if max_evaluations is not None and len(result.evaluated) >= max_evaluations:
                return result
        if once or (stop is not None and stop.is_set()):
            return result
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            return result
        if stop is not None:
            stop.wait(poll_s)
        else:
            time.sleep(poll_s)
