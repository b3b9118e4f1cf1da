"""Evaluate a live training run: every new checkpoint, as it appears, appended to RUN/eval/log.jsonl.

    flashdraft eval --watch runs/smollm2-b16 --dataset humaneval --limit 32 --budgets 8,32,128
    flashdraft eval --watch runs/smollm2-b16 --once      # evaluate what is there, print the table, exit

Training never waits for this: the evaluator only reads `RUN/checkpoints/step-*/drafter` (a
checkpoint folder that exists is complete — training writes a temp folder and renames it) and
writes only under `RUN/eval/` and `RUN/tensorboard/eval/`:

    RUN/eval/log.jsonl            one line per evaluated checkpoint (the summary `flashdraft runs status` shows)
    RUN/eval/step-00001234.json   the full report of that checkpoint
    RUN/eval/tau_over_steps.png   τ over training steps
    RUN/tensorboard/eval/         τ per method at the checkpoint's step (only when the run logs to TensorBoard)

Paths in these files are relative to RUN, so they stay right after `flashdraft runs archive`.
One console line per checkpoint; the watcher stops by itself once the run is finished
(`run_finished`) and every checkpoint is evaluated. On CPU it takes a quarter of the cores at
nice 10 by default (`WatchResources`): each line says how much slower the trainer's steps were
while it evaluated, read from RUN/metrics.jsonl.

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


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every object of a JSONL file (missing: none; a line torn by a kill or foreign: skipped)."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def read_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """The lines of RUN/eval/log.jsonl that name a step, sorted by step."""
    rows = [r for r in _read_jsonl(Path(run_dir) / "eval" / "log.jsonl") if isinstance(r.get("step"), int)]
    return sorted(rows, key=lambda r: r["step"])


def evaluated_steps(run_dir: str | Path) -> set[int]:
    return {r["step"] for r in read_log(run_dir)}


def run_finished(run_dir: str | Path) -> bool:
    """Whether the run will write no more checkpoints.

    From the trainer's RUN/heartbeat.json (flashdraft/train/lifecycle.py) when there is one: finished,
    stopped or failed, or "running" while its process is gone. A run without one (written before
    heartbeats, or a `Trainer` used as a library) is finished when its newest checkpoint is the
    schedule's last step (`step == total_steps` in its trainer_state.json).
    """
    from flashdraft.train.lifecycle import process_gone, read_heartbeat

    beat = read_heartbeat(run_dir)
    if beat is not None:
        return beat.get("state") != "running" or process_gone(beat, time.time())
    found = run_checkpoints(run_dir)
    if not found:
        return False
    try:
        info = json.loads((found[-1] / "trainer_state.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    step, total = info.get("step"), info.get("total_steps")
    return isinstance(step, int) and isinstance(total, int) and step >= total


def log_line(report: EvalReport, step: int, checkpoint: str, started: float) -> dict[str, Any]:
    """The one-line summary of a checkpoint (the contract `flashdraft runs status` reads).

    `checkpoint` is relative to the run; `started` and `time` (unix seconds) bound the evaluation."""
    d = next(iter(report.drafters.values()))
    return {
        "step": step,
        "checkpoint": checkpoint,
        "tau_chain": d.methods["chain"].tau,
        "tau_ddtree": {str(b): round(d.methods[f"ddtree-{b}"].tau, 4) for b in report.budgets},
        "tau_topk": {str(k): round(d.methods[f"topk-{k}"].tau, 4) for k in report.topk},
        "dataset": report.dataset,
        "prompts": report.references.count,
        "max_new_tokens": report.max_new_tokens,
        "temperature": report.temperature,
        "slot_accuracy": [round(x, 4) for x in d.slot_accuracy],
        "eval_seconds": round(report.seconds, 1),
        "started": started,
        "time": time.time(),
    }


# ----------------------------------------------------------------------------- the trainer's pace


@dataclass
class TrainerPace:
    """The trainer's seconds per step (RUN/metrics.jsonl) inside evaluation windows and outside all of them."""

    during_s: float | None  # over the logged intervals that lie wholly inside a window
    during_steps: int
    outside_s: float | None  # over the logged intervals that touch no window
    outside_steps: int

    @property
    def slowdown(self) -> float | None:
        if self.during_s is None or not self.outside_s:
            return None
        return self.during_s / self.outside_s

    def describe(self) -> str:
        if self.during_s is None:
            return "trainer: no logged step inside the evaluation"
        text = f"trainer {self.during_s:.3f} s/step while evaluating"
        if self.outside_s is None:
            return text + " (none logged outside evaluations yet)"
        return text + f", {self.outside_s:.3f} outside ({self.slowdown:.2f}x)"


def _intervals(metrics: list[dict[str, Any]]) -> list[tuple[float, float, int]]:
    """(start, end, steps) of each logged interval: it ends at the line's `time` and lasted step_time_s per step
    since the previous line (the first line, which holds the start-up, is left out)."""
    out, prev = [], None
    for m in metrics:
        step, end, per = m.get("step"), m.get("time"), m.get("step_time_s")
        if not isinstance(step, int):
            continue
        timed = isinstance(end, (int, float)) and isinstance(per, (int, float))
        if prev is not None and step > prev and timed:
            out.append((end - per * (step - prev), float(end), step - prev))
        prev = step
    return out


def eval_windows(rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(start, end) unix seconds of each evaluation in RUN/eval/log.jsonl."""
    out = []
    for r in rows:
        end = r.get("time")
        start = r.get("started", end - r.get("eval_seconds", 0.0) if isinstance(end, (int, float)) else None)
        if isinstance(start, (int, float)) and isinstance(end, (int, float)):
            out.append((float(start), float(end)))
    return out


def trainer_pace(
    metrics: list[dict[str, Any]],
    windows: list[tuple[float, float]],
    inside: list[tuple[float, float]] | None = None,
) -> TrainerPace:
    """Step time inside `inside` (default: every window) vs outside every one of `windows`."""
    inside = windows if inside is None else inside
    d_time = d_steps = o_time = o_steps = 0.0
    for start, end, n in _intervals(metrics):
        if any(a <= start and end <= b for a, b in inside):
            d_time, d_steps = d_time + (end - start), d_steps + n
        elif not any(start < b and a < end for a, b in windows):
            o_time, o_steps = o_time + (end - start), o_steps + n
    during = d_time / d_steps if d_steps else None
    return TrainerPace(during, int(d_steps), o_time / o_steps if o_steps else None, int(o_steps))


def run_pace(run_dir: str | Path, inside: list[tuple[float, float]] | None = None) -> TrainerPace:
    run = Path(run_dir)
    return trainer_pace(_read_jsonl(run / "metrics.jsonl"), eval_windows(read_log(run)), inside)


# ----------------------------------------------------------------------------- console


def format_line(row: dict[str, Any], pace: TrainerPace | None = None) -> str:
    """The console line of one evaluated checkpoint."""
    parts = [f"step {row['step']}", f"chain {row['tau_chain']:.3f}"]
    parts += [f"ddtree-{b} {v:.3f}" for b, v in row.get("tau_ddtree", {}).items()]
    parts += [f"topk-{k} {v:.3f}" for k, v in row.get("tau_topk", {}).items()]
    if isinstance(row.get("started"), (int, float)):
        parts.append(f"{row['time'] - row['started']:.1f} s")
    if pace is not None:
        parts.append(pace.describe())
    return "  ".join(parts)


def watch_table(run_dir: str | Path) -> str:
    """Every evaluated checkpoint of RUN/eval/log.jsonl as a Markdown table, then the trainer's pace."""
    run = Path(run_dir)
    rows = read_log(run)
    if not rows:
        return f"{run}: no checkpoint evaluated yet ({run / 'eval' / 'log.jsonl'})\n"
    budgets = sorted({int(b) for r in rows for b in r.get("tau_ddtree", {})})
    topk = sorted({int(k) for r in rows for k in r.get("tau_topk", {})})
    metrics = _read_jsonl(run / "metrics.jsonl")
    windows = eval_windows(rows)
    head = ["step", "chain", *(f"ddtree-{b}" for b in budgets), *(f"topk-{k}" for k in topk), "seconds",
            "trainer s/step while evaluating"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]

    def cell(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, (int, float)) else "—"

    for r in rows:
        own = eval_windows([r])
        pace = trainer_pace(metrics, windows, own) if own else None
        cells = [str(r["step"]), cell(r.get("tau_chain"))]
        cells += [cell(r.get("tau_ddtree", {}).get(str(b))) for b in budgets]
        cells += [cell(r.get("tau_topk", {}).get(str(k))) for k in topk]
        cells.append(f"{own[0][1] - own[0][0]:.1f}" if own else "—")
        cells.append(cell(pace.during_s if pace else None))
        lines.append("| " + " | ".join(cells) + " |")
    overall = trainer_pace(metrics, windows)
    lines += ["", overall.describe() + f" (steps logged: {overall.during_steps} while evaluating, "
              f"{overall.outside_steps} outside)"]  # fmt: skip
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- resources


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass
class WatchResources:
    """What the evaluator may take from a machine it shares with the trainer."""

    threads: int | None  # torch intra-op threads; None: as they are
    nice: int  # added to the process's niceness (higher = lower priority); 0: none

    @classmethod
    def resolve(
        cls, device: str, threads: int | None, nice: int | None, watching: bool, cores: int | None = None
    ) -> WatchResources:
        """Given values win; beside a run on CPU (`watching`), a quarter of the cores at nice 10, so that the
        trainer keeps most of the machine (benchmarks/watch_slowdown.py measures what it still costs)."""
        if threads is not None and threads < 1:
            raise ValueError(f"--threads {threads} must be >= 1")
        if nice is not None and nice < 0:
            raise ValueError(f"--nice {nice} must be >= 0 (a process can only lower its own priority)")
        beside = watching and device.split(":")[0] == "cpu"
        if threads is None and beside:
            threads = max(1, (cores or _cores()) // 4)
        return cls(threads, nice if nice is not None else (10 if beside else 0))

    def apply(self) -> None:
        import torch

        if self.threads is not None:
            torch.set_num_threads(self.threads)
        if self.nice:
            os.nice(self.nice)

    def describe(self) -> str:
        import torch

        return f"{torch.get_num_threads()} torch threads, nice +{self.nice}"


# ----------------------------------------------------------------------------- the loop


class _EvalEvents:
    """τ per method into RUN/tensorboard/eval/ at the checkpoint's step: an event file of its own beside the
    trainer's (TensorBoard shows it as the run `eval`). Written only when the run logs to TensorBoard."""

    def __init__(self, run: Path) -> None:
        self.root = run / "tensorboard"
        self.writer: Any = None
        self.off = False

    def write(self, step: int, report: EvalReport) -> None:
        if self.off or not self.root.is_dir():
            return
        if self.writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                log.warning("eval results not written to TensorBoard (%s); they are in eval/log.jsonl", e)
                self.off = True
                return
            self.writer = SummaryWriter(str(self.root / "eval"))
        d = next(iter(report.drafters.values()))
        for m in report.methods:
            self.writer.add_scalar(f"eval/tau_{m}", d.methods[m].tau, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@dataclass
class WatchResult:
    evaluated: list[int]  # steps evaluated by this call
    skipped: list[int]  # steps whose checkpoint vanished before it was read
    finished: bool = False  # the run was finished and every checkpoint evaluated


def watch(
    run_dir: str | Path,
    evaluate_checkpoint: Callable[[Path, str], EvalReport],
    *,
    poll_s: float = 60.0,
    once: bool = False,
    keep_watching: bool = False,
    max_evaluations: int | None = None,
    stop: threading.Event | None = None,
    timeout_s: float | None = None,
    echo: Callable[[str], None] | None = None,
) -> WatchResult:
    """Poll `run_dir` and evaluate each checkpoint not yet in RUN/eval/log.jsonl, oldest first.

    `evaluate_checkpoint(drafter_dir, name)` returns the report (the CLI binds target, prompts
    and settings); `echo` gets one line per evaluated checkpoint. Returns once the run is finished
    and every checkpoint is evaluated (unless `keep_watching`); `once`: evaluate what is there and
    return. Also stops after `max_evaluations`, when `stop` is set, or after `timeout_s`.
    """
    from flashdraft.eval.report import atomic_write_text, plot_watch_log, report_json

    run = Path(run_dir)
    out = run / "eval"
    t0 = time.monotonic()
    result = WatchResult([], [])
    events = _EvalEvents(run)
    try:
        while True:
            finished = run_finished(run)  # read first: a finished run writes no checkpoint after this listing
            done = evaluated_steps(run) | set(result.skipped)
            pending = [c for c in run_checkpoints(run) if checkpoint_step(c) not in done]
            for ckpt in pending:
                step = checkpoint_step(ckpt)
                started = time.time()
                try:
                    report = evaluate_checkpoint(ckpt / "drafter", f"step-{step}")
                except Exception as e:
                    if ckpt.exists():
                        raise
                    # rotated away by training (keep_last) between listing and reading
                    log.warning("checkpoint %s vanished before it was evaluated (%s): skipped", ckpt, e)
                    result.skipped.append(step)
                    continue
                for d in report.drafters.values():  # relative to the run: right after `runs archive` too
                    d.path = str(ckpt.relative_to(run) / "drafter")
                out.mkdir(parents=True, exist_ok=True)
                atomic_write_text(out / f"step-{step:08d}.json", report_json(report))
                row = log_line(report, step, str(ckpt.relative_to(run)), started)
                with open(out / "log.jsonl", "a") as f:  # one write of one whole line
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                plot_watch_log(out / "log.jsonl", out / "tau_over_steps.png")
                events.write(step, report)
                result.evaluated.append(step)
                (echo or log.info)(format_line(row, run_pace(run, [(row["started"], row["time"])])))
                if max_evaluations is not None and len(result.evaluated) >= max_evaluations:
                    return result
            if finished and not keep_watching:
                result.finished = True
                return result
            if once or (stop is not None and stop.is_set()):
                return result
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                return result
            if stop is not None:
                stop.wait(poll_s)
            else:
                time.sleep(poll_s)
    finally:
        events.close()
