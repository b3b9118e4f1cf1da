"""Run folders at a glance: list, handoff status (also written to RUN/STATUS.md), archive.

    flashdraft runs list runs/
    flashdraft runs status runs/smollm2-b16
    flashdraft runs archive runs/smollm2-b16

Everything is read from the run folder contract (flashdraft/train/checkpoint.py): config.yaml,
command.txt, metrics.jsonl, heartbeat.json (flashdraft/train/lifecycle.py), checkpoints/step-*/,
eval/log.jsonl. Nothing here needs the target, so it works on a machine that only has the folder.

A run's state: running (pid and host) / finished (why) / stopped or failed (why, what `--resume`
restarts from and how many steps that loses); a "running" heartbeat whose process is gone is stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashdraft.train.checkpoint import STATE_JSON, list_checkpoints, resume_checkpoint, step_of
from flashdraft.train.lifecycle import process_gone, read_heartbeat
from flashdraft.train.metrics import read_jsonl, read_metrics

STATUS_FILE = "STATUS.md"
STARVED = 0.05  # consumer wait fraction above which the queue is reported unhealthy (pipeline default)


class RunError(ValueError):
    pass


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    eval: dict[str, Any] | None  # the checkpoint's line in eval/log.jsonl, if evaluated


@dataclass
class RunState:
    state: str  # "running" | "finished" | "stopped" | "failed" | "unknown" (no heartbeat.json)
    line: str  # the state in one line
    started: float | None = None  # unix time this process started (a resumed run: the resume)
    elapsed_s: float | None = None  # to now while running, else to its last heartbeat


@dataclass
class RunSummary:
    path: Path
    config_digest: str
    config: dict[str, Any]
    command: str
    step: int
    total_steps: int | None
    epoch: int | None
    tokens_seen: int | None
    last: dict[str, Any]  # the last metrics line
    step_time_s: float | None  # mean over the last logged lines
    tokens_per_s: float | None
    model_tflops_per_s: float | None = None  # mean over the last logged lines (rank 0's device)
    mfu: float | None = None  # likewise, when the run set telemetry.peak_tflops
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    last_eval: dict[str, Any] | None = None
    updated: float | None = None  # unix time of the newest metrics line
    evals: list[dict[str, Any]] = field(default_factory=list)  # eval/log.jsonl, one per step, by step
    state: RunState | None = None
    last_val: dict[str, Any] | None = None  # the last metrics line with a validation (val/*, eval.every)

    @property
    def eta_s(self) -> float | None:
        if self.total_steps is None or self.step_time_s is None:
            return None
        return max(0, self.total_steps - self.step) * self.step_time_s


def _read_config(run: Path) -> tuple[dict[str, Any], str]:
    path = run / "config.yaml"
    if not path.is_file():
        return {}, "-"
    import yaml

    text = path.read_text()
    try:
        cfg = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        cfg = {}
    return cfg, hashlib.sha256(text.encode()).hexdigest()[:12]


def is_run(path: Path) -> bool:
    return path.is_dir() and any((path / n).exists() for n in ("config.yaml", "metrics.jsonl", "checkpoints"))


def _recent_mean(metrics: list[dict[str, Any]], key: str) -> float | None:
    """Mean of `key` over the last 10 logged lines that have it (None: none has)."""
    v = [m[key] for m in metrics[-10:] if isinstance(m.get(key), (int, float))]
    return sum(v) / len(v) if v else None


def summarize(run: str | os.PathLike[str]) -> RunSummary:
    run = Path(run)
    if not is_run(run):
        raise RunError(f"{run}: not a run folder (no config.yaml, metrics.jsonl or checkpoints/)")
    cfg, digest = _read_config(run)
    metrics = read_metrics(run)
    last = metrics[-1] if metrics else {}
    evals = {int(e["step"]): e for e in read_jsonl(run / "eval" / "log.jsonl") if "step" in e}
    ckpts = [CheckpointInfo(p, step_of(p), evals.get(step_of(p))) for p in list_checkpoints(run)]
    state: dict[str, Any] = {}
    if ckpts:
        try:
            state = json.loads((ckpts[-1].path / STATE_JSON).read_text())
        except (OSError, json.JSONDecodeError):
            state = {}
    optim = cfg.get("optim", {}) if isinstance(cfg, dict) else {}
    total = state.get("total_steps") or optim.get("max_steps")
    step = max(int(last.get("step", 0)), ckpts[-1].step if ckpts else 0)
    command = (
        (run / "command.txt").read_text().strip().splitlines() if (run / "command.txt").is_file() else []
    )
    beat = read_heartbeat(run)
    if beat is not None and isinstance(beat.get("step"), int):
        step = max(step, beat["step"])
    if beat is not None and not total and isinstance(beat.get("total_steps"), int):
        total = beat["total_steps"]
    return RunSummary(
        path=run, config_digest=digest, config=cfg if isinstance(cfg, dict) else {},
        command=command[-1] if command else "-", step=step, total_steps=int(total) if total else None,
        epoch=last.get("epoch", state.get("epoch")), tokens_seen=last.get("tokens_seen", state.get("tokens_seen")),
        last=last, step_time_s=_recent_mean(metrics, "step_time_s"), tokens_per_s=_recent_mean(metrics, "tokens_per_s"),
        model_tflops_per_s=_recent_mean(metrics, "model_tflops_per_s"), mfu=_recent_mean(metrics, "mfu"),
        checkpoints=ckpts, last_eval=evals[max(evals)] if evals else None,
        updated=last.get("time") if metrics else None, evals=[evals[k] for k in sorted(evals)],
        state=run_state(run, beat, step, time.time()),
        last_val=next((m for m in reversed(metrics) if "val/chain_tau" in m), None),
    )  # fmt: skip


def _resume_loss(run: Path, step: int) -> str:
    ckpt = resume_checkpoint(run)
    if ckpt is None:
        return f"--resume has no checkpoint to restart from (all {step} steps lost)"
    lost = max(0, step - step_of(ckpt))
    return f"--resume restarts from step {step_of(ckpt)} (loses {lost} step{'s' if lost != 1 else ''})"


def run_state(run: Path, beat: dict[str, Any] | None, step: int, now: float) -> RunState:
    """What the run's process is doing, from RUN/heartbeat.json (see flashdraft/train/lifecycle.py)."""
    if beat is None:
        return RunState(
            "unknown", "unknown: no heartbeat.json (a run from before heartbeats, or not started)"
        )
    started, last = beat.get("started"), beat.get("heartbeat")
    started = started if isinstance(started, (int, float)) else None
    last = last if isinstance(last, (int, float)) else None
    state, reason = str(beat.get("state", "unknown")), beat.get("reason")
    where = f"pid {beat.get('pid', '-')} on {beat.get('host', '-')}"
    ago = _duration(now - last) + " ago" if last is not None else "never"
    if state == "running" and not process_gone(beat, now):
        line = f"running: {where}, step {step}; last heartbeat {ago}"
        return RunState("running", line, started, now - started if started else None)
    elapsed = last - started if started and last else None
    if state == "running":
        state, line = (
            "stopped",
            f"stopped: the process ({where}) is gone (killed: SIGKILL, out of memory, lost machine); last heartbeat {ago}",
        )
    elif state == "finished":
        return RunState(state, f"finished ({reason}) at step {step}, {ago}", started, elapsed)
    else:
        line = f"{state} ({reason}) at step {step}, {ago}"
    return RunState(state, f"{line}; {_resume_loss(run, step)}", started, elapsed)


# ----------------------------------------------------------------------------- formatting


def _num(v: Any, fmt: str = ".3f") -> str:
    if isinstance(v, (int, float)) and not (isinstance(v, float) and not math.isfinite(v)):
        return format(v, fmt)
    return "-" if v is None else str(v)


def _utc(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t is not None else "-"


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d"


def _streak(last: dict[str, Any]) -> Any:
    """The training streak τ proxy (`tau_proxy` in metrics written before it was named train_streak_tau)."""
    return last.get("train_streak_tau", last.get("tau_proxy"))


def _val_line(v: dict[str, Any] | None) -> list[str]:
    """The last validation (eval.every), or none."""
    if v is None:
        return []
    topk = f", top-k streak {_num(v.get('val/topk_streak'), '.2f')}" if "val/topk_streak" in v else ""
    se = f" ± {_num(v.get('val/chain_tau_se'), '.2f')} SE" if "val/chain_tau_se" in v else ""
    return [
        f"- validation at step {v.get('step', '-')}: chain τ {_num(v.get('val/chain_tau'), '.2f')}{se}, DDTree τ "
        f"{_num(v.get('val/ddtree_tau'), '.2f')} (budget {_num(v.get('val/ddtree_budget'), '.0f')}){topk}"
    ]


def _eval_tau(e: dict[str, Any] | None) -> str:
    return _num(e.get("tau_chain"), ".2f") if e else "-"


def _keys(evals: list[dict[str, Any]], field_name: str) -> list[str]:
    """The budgets (or k's) of a per-budget field across every eval line, in numeric order."""
    found = {k for e in evals if isinstance(e.get(field_name), dict) for k in e[field_name]}
    return sorted(found, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))


def eval_table(s: RunSummary, best_metric: str = "tau_chain") -> list[str]:
    """Every evaluated step of eval/log.jsonl as a Markdown table (also of checkpoints deleted since), the
    best by `best_metric` marked."""
    if not s.evals:
        return ["none yet (`flashdraft eval --watch RUN` writes eval/log.jsonl)"]
    budgets, topk = _keys(s.evals, "tau_ddtree"), _keys(s.evals, "tau_topk")
    scored = [e for e in s.evals if isinstance(e.get(best_metric), (int, float))]
    best = max(scored, key=lambda e: e[best_metric])["step"] if scored else None
    on_disk = {c.step for c in s.checkpoints}
    head = [
        "step",
        "chain τ",
        *(f"DDTree {b} τ" for b in budgets),
        *(f"top-{k} τ" for k in topk),
        "checkpoint",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * (len(head) - 1) + "---|"]
    for e in s.evals:
        step = int(e["step"])
        cells = [str(step), _num(e.get("tau_chain"), ".3f")]
        cells += [_num((e.get("tau_ddtree") or {}).get(b), ".3f") for b in budgets]
        cells += [_num((e.get("tau_topk") or {}).get(k), ".3f") for k in topk]
        cells.append("on disk" if step in on_disk else "deleted")
        if step == best:
            cells = [f"**{c}**" for c in cells]
            cells[-1] += f" ← best {best_metric}"
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def queue_health(last: dict[str, Any]) -> str:
    frac = last.get("pipeline/consumer_wait_frac_window", last.get("pipeline/consumer_wait_frac"))
    if not isinstance(frac, (int, float)):
        return "- (no pipeline metrics)"
    # with the producer on side streams (CUDA) the host's wait overlaps queued device work: the stream's idle
    # time is what starvation costs (flashdraft.train.pipeline.StreamIdle)
    idle = last.get("pipeline/stream_idle_frac_window")
    if isinstance(idle, (int, float)):
        verdict = "STARVED" if idle > STARVED else "ok"
        what = f"trainer's CUDA stream idle {idle:.1%} of the time, its thread waits {frac:.1%}"
    else:
        verdict = "STARVED" if frac > STARVED else "ok"
        what = f"trainer waits {frac:.1%} of the time"
    return (
        f"{verdict}: {what}; queue {_num(last.get('pipeline/queue_depth'), '.1f')}"
        f"/{_num(last.get('pipeline/queue_capacity'), '.0f')} ready; producer "
        f"{_num(last.get('pipeline/producer_s_per_batch'), '.3f')} s/batch"
        + "".join(
            f", {k.removeprefix('pipeline/host_').removesuffix('_ms')} {v:.1f} ms"
            for k, v in last.items()
            if k.startswith("pipeline/host_") and isinstance(v, (int, float))
        )
    )


def list_runs(root: str | os.PathLike[str]) -> list[str]:
    """One line per run folder under `root` (or `root` itself if it is a run)."""
    root = Path(root)
    if not root.is_dir():
        return []
    runs = [root] if is_run(root) else sorted(p for p in root.iterdir() if is_run(p))
    now = time.time()
    lines = [f"{'run':<32} {'state':<9} {'step':>12} {'loss':>8} {'τ proxy':>8} {'eval τ':>7} {'age':>7}"]
    for p in runs:
        try:
            s = summarize(p)
        except (RunError, OSError, ValueError) as e:
            lines.append(f"{p.name:<32} unreadable: {e}")
            continue
        total = f"/{s.total_steps}" if s.total_steps else ""
        age = _duration(now - s.updated) if s.updated else "-"
        state = s.state.state if s.state else "-"
        lines.append(
            f"{p.name:<32} {state:<9} {str(s.step) + total:>12} {_num(s.last.get('loss')):>8} "
            f"{_num(_streak(s.last), '.2f'):>8} {_eval_tau(s.last_eval):>7} {age:>7}"
        )
    return lines


def _model_flops_line(s: RunSummary) -> list[str]:
    """The model FLOP/s line, or none for runs logged before the trainer counted model FLOPs."""
    if s.model_tflops_per_s is None:
        return []
    if s.mfu is not None:
        peak = (s.config.get("telemetry") or {}).get("peak_tflops")
        mfu = f"MFU {s.mfu:.1%} of {_num(peak, 'g')} TFLOP/s peak"
    else:
        mfu = "MFU - (set telemetry.peak_tflops)"
    return [
        f"- model {_num(s.model_tflops_per_s, '.3g')} TFLOP/s per device (rank 0, attention included); {mfu}"
    ]


def _drafter_shape(model: dict[str, Any]) -> str:
    """The drafter's depth as the config decides it: its own, or that of the drafter it started from."""
    if not model.get("init_from"):
        return f"{model.get('num_layers', '-')} layers"
    grow = model.get("grow_layers") or 0
    return f"from `{model['init_from']}`" + (f" with {grow} layers added" if grow else "")


def _schedule_lines(s: RunSummary) -> list[str]:
    """Where the run sits in a longer LR schedule it is one part of (optim.schedule_steps), or no line."""
    o = s.config.get("optim") or {}
    if not o.get("schedule_steps"):
        return []
    start, total = int(o.get("schedule_start") or 0), int(o["schedule_steps"])
    now = start + s.step
    return [f"- LR schedule: a part of one {total:,} steps long, from its step {start:,}; now at {now:,}"]


def status_markdown(s: RunSummary, now: float | None = None) -> str:
    now = time.time() if now is None else now
    cfg = s.config
    model, data = cfg.get("model", {}) or {}, cfg.get("data", {}) or {}
    last = s.last
    lines = [
        f"# Run status: {s.path.name}",
        "",
        f"_written {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(now))} by `flashdraft runs status`_",
        "",
        "## Config",
        f"- folder: `{s.path}`",
        f"- config digest: `{s.config_digest}` (sha256 of config.yaml)",
        f"- target: `{model.get('target', '-')}`; drafter {_drafter_shape(model)}, "
        f"block {model.get('block_size', '-')}; dataset `{data.get('dataset', '-')}`",
        f"- pipeline: {(cfg.get('pipeline') or {}).get('mode', '-')}; "
        f"distributed: {(cfg.get('distributed') or {}).get('strategy', '-')}",
        f"- command: `{s.command}`",
        "",
        "## State",
        f"- {s.state.line if s.state else '-'}",
        f"- started {_utc(s.state.started) if s.state else '-'}; elapsed {_duration(s.state.elapsed_s) if s.state else '-'}",
        "",
        "## Progress",
        f"- step {s.step}" + (f" of {s.total_steps} ({s.step / s.total_steps:.1%})" if s.total_steps else ""),
        *_schedule_lines(s),
        f"- epoch {_num(s.epoch, 'd') if isinstance(s.epoch, int) else _num(s.epoch)}; "
        f"tokens seen {_num(s.tokens_seen, ',') if isinstance(s.tokens_seen, int) else _num(s.tokens_seen)}",
        f"- last update {_duration(now - s.updated) + ' ago' if s.updated else '-'}",
        f"- throughput {_num(s.tokens_per_s, ',.0f')} target tokens/s; {_num(s.step_time_s, '.3f')} s/step",
        *_model_flops_line(s),
        f"- ETA {_duration(s.eta_s) if s.state is None or s.state.state in ('running', 'unknown') else '- (not running)'}",
        "",
        "## Last metrics (step " + str(last.get("step", "-")) + ")",
        f"- loss {_num(last.get('loss'))}, acc {_num(last.get('acc'))}, τ proxy {_num(_streak(last), '.2f')} "
        "(mean streak of correct slots + 1 over every training anchor: a proxy, not a decoding τ)",
        *_val_line(s.last_val),
        f"- lr {_num(last.get('lr'), '.2e')}, grad norm {_num(last.get('grad_norm'))}, "
        f"skipped steps {last.get('skipped_steps', '-')}",
        f"- queue: {queue_health(last)}",
    ]
    gpu = {k: v for k, v in last.items() if k.startswith(("cuda/", "gpu"))}
    if gpu:
        lines.append("- GPU: " + ", ".join(f"{k} {_num(v, '.2f')}" for k, v in sorted(gpu.items())))
    lines += ["", "## Checkpoints", ""]
    if s.checkpoints:
        lines += ["| step | folder | eval τ (chain) |", "|---:|---|---:|"]
        for c in s.checkpoints:
            lines.append(f"| {c.step} | `{c.path.relative_to(s.path)}` | {_eval_tau(c.eval)} |")
    else:
        lines.append("none yet")
    best_metric = str((cfg.get("checkpoint") or {}).get("best_metric", "tau_chain"))
    lines += ["", "## Evaluations (eval/log.jsonl)", "", *eval_table(s, best_metric)]
    return "\n".join(lines) + "\n"


def write_status(run: str | os.PathLike[str]) -> str:
    """The handoff summary as Markdown, also written to RUN/STATUS.md (atomically)."""
    s = summarize(run)
    text = status_markdown(s)
    dest = s.path / STATUS_FILE
    tmp = dest.with_name(f".{STATUS_FILE}.tmp")
    tmp.write_text(text)
    tmp.replace(dest)
    return text


def archive_run(run: str | os.PathLike[str], now: float | None = None) -> Path:
    """RUN → RUN.archived-<UTC time> (one rename: atomic on one filesystem); returns the new path."""
    run = Path(run)
    if not is_run(run):
        raise RunError(f"{run}: not a run folder (no config.yaml, metrics.jsonl or checkpoints/)")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    dest = run.with_name(f"{run.name}.archived-{stamp}")
    n = 1
    while dest.exists():
        dest = run.with_name(f"{run.name}.archived-{stamp}-{n}")
        n += 1
    os.rename(run, dest)  # fails rather than merging if dest appeared meanwhile
    return dest
