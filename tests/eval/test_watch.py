"""`--watch`: a checkpoint written by a concurrent trainer (temp folder + rename) is evaluated and logged, with
paths relative to the run, one console line each, τ in the run's TensorBoard, the trainer's pace while evaluating;
the watcher stops once the run is finished; its thread cap and priority on CPU."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from flashdraft.drafter import DFlashDrafter
from flashdraft.eval.evaluate import DrafterReport, EvalReport, MethodSummary, ReferenceStats, evaluate
from flashdraft.eval.watch import (
    WatchResources,
    checkpoint_step,
    eval_windows,
    resolve_drafter,
    run_finished,
    trainer_pace,
    watch,
    watch_table,
)
from tests.conftest import tiny_drafter, tiny_target

PROMPTS = [[3, 5, 7, 9], [4, 6, 8, 10, 12]]


def _write_checkpoint(run: Path, step: int, drafter: DFlashDrafter, total_steps: int | None = None) -> None:
    """As training does: everything into a temp folder, then one rename."""
    root = run / "checkpoints"
    tmp = root / f".tmp-step-{step:08d}"
    drafter.save_pretrained(tmp / "drafter")
    state = {"step": step} if total_steps is None else {"step": step, "total_steps": total_steps}
    (tmp / "trainer_state.json").write_text(json.dumps(state))
    tmp.rename(root / f"step-{step:08d}")


def test_watch_picks_up_a_new_checkpoint(tmp_path: Path) -> None:
    target = tiny_target("llama")
    run = tmp_path / "run"
    _write_checkpoint(run, 10, tiny_drafter(target, seed=1))
    later = tiny_drafter(target, seed=2)
    seen: list[str] = []

    def one(folder: Path, name: str):  # type: ignore[no-untyped-def]
        seen.append(name)
        d = DFlashDrafter.from_pretrained(folder, dtype=torch.float64)
        return evaluate(
            target,
            {name: d},
            PROMPTS,
            budgets=[2, 4],
            topk=2,
            max_new_tokens=10,
            stop_token_ids=[],
            cache_dir=tmp_path / "cache",
            progress=False,
        )

    writer = threading.Thread(target=lambda: (time.sleep(1.0), _write_checkpoint(run, 20, later)))
    writer.start()
    printed: list[str] = []
    res = watch(run, one, poll_s=0.1, max_evaluations=2, timeout_s=120, echo=printed.append)
    writer.join()
    assert res.evaluated == [10, 20] and seen == ["step-10", "step-20"]
    lines = [json.loads(x) for x in (run / "eval" / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [10, 20]
    assert set(lines[1]["tau_ddtree"]) == {"2", "4"} and lines[1]["tau_chain"] >= 1.0
    # one console line per checkpoint: step, chain, each budget, top-k, seconds
    assert len(printed) == 2 and printed[1].startswith(
        f"step 20  chain {lines[1]['tau_chain']:.3f}  ddtree-2 "
    )
    assert "ddtree-4 " in printed[1] and "topk-2 " in printed[1] and " s  trainer" in printed[1]
    # paths relative to the run, so they stay right after the run folder is renamed (runs archive)
    assert lines[1]["checkpoint"] == "checkpoints/step-00000020"
    full = json.loads((run / "eval" / "step-00000020.json").read_text())
    assert full["drafters"]["step-20"]["path"] == "checkpoints/step-00000020/drafter"
    assert (run / "eval" / "step-00000020.json").is_file() and (run / "eval" / "tau_over_steps.png").is_file()
    # the evaluator writes only under RUN/eval/
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "eval"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000010", "step-00000020"]
    # nothing new: a second pass evaluates nothing
    assert watch(run, one, once=True).evaluated == []
    # --drafter RUN_DIR means the newest checkpoint
    assert resolve_drafter(run) == (run / "checkpoints" / "step-00000020" / "drafter", 20)


def test_watch_skips_a_checkpoint_rotated_away(tmp_path: Path) -> None:
    import shutil

    target = tiny_target("llama")
    run = tmp_path / "run"
    _write_checkpoint(run, 5, tiny_drafter(target, seed=1))

    def one(folder: Path, name: str):  # type: ignore[no-untyped-def]
        shutil.rmtree(folder.parent)  # training's keep_last deletes it between listing and reading
        return DFlashDrafter.from_pretrained(folder)

    res = watch(run, one, once=True)
    assert res.evaluated == [] and res.skipped == [5]
    assert not (run / "eval" / "log.jsonl").exists()


def _report(tau: float, budgets: tuple[int, ...] = (2, 4), topk: tuple[int, ...] = (2,)) -> EvalReport:
    """A report whose τ for chain, ddtree-b and topk-k is tau, tau + b / 10 and tau + k / 100."""
    taus = {
        "chain": tau,
        **{f"ddtree-{b}": tau + b / 10 for b in budgets},
        **{f"topk-{k}": tau + k / 100 for k in topk},
    }
    d = DrafterReport(
        name="d", path="", block_size=4, num_layers=1,
        methods={m: MethodSummary(t, t, t, 1, [1, 0, 0, 0]) for m, t in taus.items()},
        slot_accuracy=[0.5, 0.2, 0.1], slot_accuracy_conditional=[0.5, 0.3, 0.2], samples=1, seconds=0.0,
        drafter_forwards=1, drafter_blocks=1,
    )  # fmt: skip
    refs = ReferenceStats(1, "local", 0.0, 10, 0, 1, 0.0, 0, 0, None, 0)
    return EvalReport(
        target="t", dataset="x", template="token ids", max_new_tokens=10, temperature=0.0, budgets=list(budgets),
        topk=list(topk), methods=list(taus), device="cpu", dtype="float64", references=refs, drafters={"d": d},
        seconds=0.0, teacher_forced_seconds=0.0,
    )  # fmt: skip


def _fake_evaluator(taus: dict[int, float]):  # type: ignore[no-untyped-def]
    def one(folder: Path, name: str) -> EvalReport:
        return _report(taus[checkpoint_step(folder.parent)])

    return one


def test_watch_writes_tau_to_the_runs_tensorboard(tmp_path: Path) -> None:
    """τ per method at the checkpoint's step, in an event file of its own under RUN/tensorboard/eval."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    target = tiny_target("llama")
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)  # the trainer logs to TensorBoard
    for step in (10, 20):
        _write_checkpoint(run, step, tiny_drafter(target, seed=step))
    assert watch(run, _fake_evaluator({10: 1.25, 20: 1.5}), once=True).evaluated == [10, 20]
    ea = EventAccumulator(str(run / "tensorboard" / "eval"))
    ea.Reload()
    tags = ea.Tags()["scalars"]
    assert sorted(tags) == ["eval/tau_chain", "eval/tau_ddtree-2", "eval/tau_ddtree-4", "eval/tau_topk-2"]
    chain = [(e.step, e.value) for e in ea.Scalars("eval/tau_chain")]
    assert chain == [(10, 1.25), (20, 1.5)]
    assert [(e.step, round(e.value, 4)) for e in ea.Scalars("eval/tau_ddtree-4")] == [(10, 1.65), (20, 1.9)]
    # a run that does not log to TensorBoard gets no TensorBoard folder from the watcher
    quiet = tmp_path / "quiet"
    _write_checkpoint(quiet, 5, tiny_drafter(target, seed=1))
    watch(quiet, _fake_evaluator({5: 1.0}), once=True)
    assert not (quiet / "tensorboard").exists()


def test_watch_stops_once_the_run_is_finished(tmp_path: Path) -> None:
    target = tiny_target("llama")
    run = tmp_path / "run"
    d = tiny_drafter(target, seed=1)
    _write_checkpoint(run, 10, d, total_steps=20)
    assert not run_finished(run)
    writer = threading.Thread(target=lambda: (time.sleep(0.5), _write_checkpoint(run, 20, d, total_steps=20)))
    writer.start()
    printed: list[str] = []
    res = watch(run, _fake_evaluator({10: 1.2, 20: 1.4}), poll_s=0.05, timeout_s=60, echo=printed.append)
    writer.join()
    assert run_finished(run)
    assert res.finished and res.evaluated == [10, 20] and len(printed) == 2
    # --keep-watching: a finished run is polled until stopped
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    res = watch(run, _fake_evaluator({}), poll_s=0.05, keep_watching=True, stop=stop)
    assert not res.finished and res.evaluated == []


def test_run_finished_reads_what_the_trainer_leaves(tmp_path: Path) -> None:
    """False at every step of a live run (its checkpoints included), True once the trainer returned."""
    from tests.train.test_trainer import make_trainer

    seen: list[bool] = []
    tr = make_trainer(
        tmp_path,
        ["optim.max_steps=3", "checkpoint.every=1"],
        on_step_end=lambda t, step: seen.append(run_finished(t.run_dir)),
    )
    assert tr.run().stopped == "max_steps"
    assert seen == [False, False, False] and run_finished(tr.run_dir)


def _metrics(run: Path, lines: list[tuple[int, float, float]]) -> None:
    """Append (step, unix time, step_time_s) lines to RUN/metrics.jsonl, as the trainer logs them."""
    with open(run / "metrics.jsonl", "a") as f:
        for step, t, per in lines:
            f.write(json.dumps({"step": step, "time": t, "step_time_s": per, "loss": 1.0}) + "\n")


def test_trainer_pace_inside_and_outside_evaluations() -> None:
    # 2 steps a line: 0.5 s/step before the window [100, 110], 1.0 s/step inside it, one line across its end
    # up to step 20 at t=100, then up to step 30 at t=110
    rows = [{"step": 2 * i, "time": 90.0 + i, "step_time_s": 0.5} for i in range(11)]
    rows += [{"step": 20 + 2 * i, "time": 100.0 + 2 * i, "step_time_s": 1.0} for i in range(1, 6)]
    rows += [{"step": 32, "time": 111.0, "step_time_s": 1.0}]  # [109, 111]: across the window's end, left out
    rows += [{"step": 34, "time": 112.5, "step_time_s": 0.75}]  # [111, 112.5]: outside
    pace = trainer_pace(rows, [(100.0, 110.0)])
    assert pace.during_s == 1.0 and pace.during_steps == 10
    assert pace.outside_steps == 20 + 2 and pace.outside_s == (20 * 0.5 + 2 * 0.75) / 22
    assert "while evaluating" in pace.describe() and f"({pace.slowdown:.2f}x)" in pace.describe()
    # a log line written before lines carried 'started': the window ends at 'time' and lasted eval_seconds
    assert eval_windows([{"step": 5, "time": 110.0, "eval_seconds": 10.0}]) == [(100.0, 110.0)]
    # no line inside the window: said so, no number made up
    assert (
        trainer_pace(rows[:11], [(200.0, 210.0)]).describe()
        == "trainer: no logged step inside the evaluation"
    )


def test_each_line_and_the_table_report_the_trainers_slowdown(tmp_path: Path) -> None:
    target = tiny_target("llama")
    run = tmp_path / "run"
    _write_checkpoint(run, 4, tiny_drafter(target, seed=1), total_steps=8)
    now = time.time()
    _metrics(run, [(0, now - 5, 0.1), (2, now - 4, 0.01), (4, now - 3, 0.01)])  # 0.01 s/step before

    def slow(folder: Path, name: str) -> EvalReport:  # the trainer logs 2 steps at 0.05 s/step meanwhile
        time.sleep(0.2)
        t = time.time()
        _metrics(run, [(6, t, 0.05)])  # [t - 0.1, t]: inside the evaluation
        time.sleep(0.05)
        return _report(1.3)

    printed: list[str] = []
    assert watch(run, slow, once=True, echo=printed.append).evaluated == [4]
    assert printed[0].endswith("trainer 0.050 s/step while evaluating, 0.010 outside (5.00x)")
    table = watch_table(run).splitlines()
    assert (
        table[0]
        == "| step | chain | ddtree-2 | ddtree-4 | topk-2 | seconds | trainer s/step while evaluating |"
    )
    assert table[2].startswith("| 4 | 1.300 | 1.500 | 1.700 | 1.320 | ") and table[2].endswith(" | 0.050 |")
    assert table[-1].startswith("trainer 0.050 s/step while evaluating, 0.010 outside (5.00x)")


def test_resources_on_cpu_beside_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    r = WatchResources.resolve("cpu", None, None, watching=True, cores=16)
    assert (r.threads, r.nice) == (4, 10)
    assert WatchResources.resolve("cpu", None, None, watching=True, cores=2).threads == 1
    assert WatchResources.resolve("cpu", 3, 0, watching=True, cores=16) == WatchResources(3, 0)
    assert WatchResources.resolve("cuda:0", None, None, watching=True) == WatchResources(None, 0)
    assert WatchResources.resolve("cpu", None, None, watching=False) == WatchResources(None, 0)
    for bad, msg in (((0, None), "--threads 0 must be >= 1"), ((None, -5), "--nice -5 must be >= 0")):
        with pytest.raises(ValueError, match=msg):
            WatchResources.resolve("cpu", *bad, watching=True)
    niced: list[int] = []
    monkeypatch.setattr(os, "nice", niced.append)
    WatchResources(2, 7).apply()
    assert torch.get_num_threads() == 2 and niced == [7]


def test_cli_watch_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`eval --watch`: --threads/--nice reach the process (defaults on CPU: a quarter of the cores, nice 10); a
    finished run is evaluated, then the watcher stops by itself and prints the table; --once prints it too."""
    from typer.testing import CliRunner

    from flashdraft.cli import app
    from flashdraft.eval import watch as watch_mod

    target = tiny_target("qwen3")
    target.model.save_pretrained(tmp_path / "target")
    run = tmp_path / "run"
    _write_checkpoint(run, 5, tiny_drafter(target, seed=1), total_steps=5)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"q{i}", "input_ids": [3 + i, 8, 13]}) + "\n" for i in range(2))
    )
    niced: list[int] = []
    monkeypatch.setattr(os, "nice", niced.append)
    base = [
        "eval", "--watch", str(run), "--target", str(tmp_path / "target"), "--dataset", str(prompts),
        "--max-new-tokens", "8", "--budgets", "2", "--topk", "", "--dtype", "float64", "--poll", "0.05",
        "--cache-dir", str(tmp_path / "cache"), "--no-progress",
    ]  # fmt: skip
    r = CliRunner().invoke(app, [*base, "--threads", "2", "--nice", "3"])
    assert r.exit_code == 0, r.output
    assert niced == [3] and torch.get_num_threads() == 2 and "2 torch threads, nice +3" in r.output
    assert [ln for ln in r.output.splitlines() if ln.startswith("step 5  chain ")]
    assert "run finished" in r.output and "| step | chain | ddtree-2 | seconds |" in r.output
    monkeypatch.setattr(watch_mod, "_cores", lambda: 12)
    r = CliRunner().invoke(app, [*base, "--once"])
    assert r.exit_code == 0, r.output
    assert niced == [3, 10] and torch.get_num_threads() == 3 and "3 torch threads, nice +10" in r.output
    assert "| step | chain | ddtree-2 |" in r.output and not [
        ln for ln in r.output.splitlines() if ln.startswith("step ")
    ]
    r = CliRunner().invoke(app, [*base, "--threads", "0"])
    assert r.exit_code == 2 and "error: --threads 0 must be >= 1" in r.output


def test_run_finished_follows_the_heartbeat(tmp_path: Path) -> None:
    """With RUN/heartbeat.json the trainer's own state decides: a run stopped by its time limit or a signal
    is over (no checkpoint at total_steps needed); a live process is not; a dead "running" one is over."""
    import os
    import socket

    from flashdraft.train.lifecycle import write_json_atomic

    run = tmp_path / "run"
    _write_checkpoint(run, 10, tiny_drafter(tiny_target("llama"), seed=1), total_steps=20)
    beat = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "every_s": 15.0,
            "heartbeat": time.time(), "state": "running", "reason": None}  # fmt: skip
    write_json_atomic(run / "heartbeat.json", beat)
    assert not run_finished(run)
    for state, reason in (("finished", "time_limit"), ("stopped", "SIGTERM"), ("failed", "RuntimeError: x")):
        write_json_atomic(run / "heartbeat.json", {**beat, "state": state, "reason": reason})
        assert run_finished(run), state
    write_json_atomic(run / "heartbeat.json", {**beat, "heartbeat": time.time() - 3600})
    assert run_finished(run)  # "running", but no beat for an hour: the process is gone
