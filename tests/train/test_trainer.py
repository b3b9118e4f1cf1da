"""Trainer: schedule, checkpoints and run layout, SIGUSR1, NaN guard, OOM message, exact resume after SIGKILL."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flashdraft.config import ConfigError, load_config
from flashdraft.drafter import DFlashDrafter
from flashdraft.train import trainer as trainer_mod
from flashdraft.train.blocks import DraftBatch
from flashdraft.train.checkpoint import latest_checkpoint, list_checkpoints, prune_checkpoints
from flashdraft.train.config import TrainConfig
from flashdraft.train.flops import step_flops
from flashdraft.train.launch import build_drafter, train
from flashdraft.train.metrics import read_metrics
from flashdraft.train.source import InProcessSource
from flashdraft.train.trainer import Interval, LRSchedule, Trainer, TrainingError, lr_schedule
from tests.conftest import tiny_target
from tests.train.helpers import make_docs

REPO = Path(__file__).resolve().parents[2]

SMALL = [
    "model.num_layers=1", "model.block_size=8", "data.max_length=48", "data.token_budget=96",
    "data.max_anchors=6", "data.pad_multiple=1", "telemetry.log_every=1", "telemetry.tensorboard=false",
    "telemetry.progress=false", "optim.lr=3e-3", "runtime.dtype=float32", "data.dataset=<in-memory>",
]  # fmt: skip


def make_trainer(tmp_path: Path, overrides: list[str], wrap=None, on_step_end=None) -> Trainer:  # noqa: ANN001
    cfg = load_config(TrainConfig, None, [f"run_dir={tmp_path / 'run'}", *SMALL, *overrides])
    t = tiny_target("llama", dtype=torch.float32)
    drafter = build_drafter(cfg, t, torch.device("cpu"), torch.float32)
    docs = make_docs([40, 30, 20, 45, 25, 33], seed=0)
    source = InProcessSource(
        docs, t, drafter.target_layer_ids, max_length=cfg.data.max_length, token_budget=cfg.data.token_budget,
        epochs=None, seed=cfg.runtime.seed,
    )  # fmt: skip
    return Trainer(
        cfg, t, drafter, wrap(source) if wrap else source, run_dir=cfg.run_dir, on_step_end=on_step_end
    )


def test_lr_schedule_warmup_then_cosine():
    s = LRSchedule(peak=1.0, total_steps=100, warmup_steps=4, min_ratio=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == pytest.approx(1.0)
    assert s(52) == pytest.approx(0.1 + 0.9 * 0.5)
    assert s(100) == pytest.approx(0.1)
    assert s(70) < s(60) < s(50)


def test_a_long_schedule_split_over_runs_is_the_whole_schedule_after_each_ramp():
    """optim.schedule_steps: runs that each take a part of one schedule (from the last one's weights) follow it
    step for step, but for the ramp a run starting past step 0 climbs to the schedule's rate with (fresh moments)."""
    over = ["optim.lr=1.0", "optim.warmup_ratio=0.1", "optim.min_lr_ratio=0.1", "optim.schedule_steps=200"]
    whole = lr_schedule(load_config(TrainConfig, None, [*SMALL, *over]).optim, 200)
    assert whole == LRSchedule(peak=1.0, total_steps=200, warmup_steps=20, min_ratio=0.1)
    first = lr_schedule(load_config(TrainConfig, None, [*SMALL, *over, "optim.max_steps=80"]).optim, 80)
    assert [first(i) for i in range(80)] == [whole(i) for i in range(80)]  # from step 0: no ramp
    o = load_config(TrainConfig, None, [*SMALL, *over, "optim.schedule_start=80"]).optim
    second = lr_schedule(o, 120)
    assert (second.offset, second.ramp_steps) == (80, 12)
    assert second(0) == pytest.approx(whole(80) / 12) and second(5) == pytest.approx(whole(85) * 6 / 12)
    assert [second(i) for i in range(12, 120)] == [whole(i) for i in range(92, 200)]
    assert second(119) == pytest.approx(0.1, abs=1e-4)  # the schedule's end, not a fresh cosine's middle
    # a long part (a campaign stint asks for 10^6 steps and fits them to its time) ramps over 100 steps at most,
    # done before the first fit to the time limit could change the run's length under it
    part = ["optim.schedule_steps=60000", "optim.schedule_start=80"]
    o = load_config(TrainConfig, None, [*SMALL, *over, *part]).optim
    long = lr_schedule(o, 59920)
    assert long.ramp_steps == trainer_mod.PART_RAMP_MAX == 100 < trainer_mod.FIT_SKIP + trainer_mod.FIT_STEPS
    for bad, msg in (("optim.schedule_start=200", r"must be in \[0, optim.schedule_steps 200\)"),
                     ("optim.schedule_start=-1", "must be in")):  # fmt: skip
        with pytest.raises(ConfigError, match=msg):
            load_config(TrainConfig, None, [*SMALL, *over, bad]).validate()
    with pytest.raises(ConfigError, match="needs optim.schedule_steps"):
        load_config(TrainConfig, None, [*SMALL, "optim.schedule_start=5"]).validate()


def test_a_run_that_is_part_of_a_longer_schedule_ends_with_it(tmp_path):
    tr = make_trainer(tmp_path, ["optim.max_steps=100", "optim.schedule_steps=10", "optim.schedule_start=6"])
    res = tr.run()
    assert res.steps == 4 and tr.total_steps == 4
    lrs = [m["lr"] for m in read_metrics(tmp_path / "run")]
    assert lrs == pytest.approx([tr.schedule(i) for i in range(4)])
    assert tr.schedule.offset == 6


def test_checkpoints_layout_retention_and_best_by_eval(tmp_path):
    tr = make_trainer(tmp_path, ["optim.max_steps=6", "checkpoint.every=2", "checkpoint.keep_last=2"])
    result = tr.run()
    run = tmp_path / "run"
    assert result.steps == 6
    assert [p.name for p in list_checkpoints(run)] == ["step-00000004", "step-00000006"]
    assert latest_checkpoint(run) == run / "checkpoints" / "step-00000006"
    # the drafter folder is a plain DFlash checkpoint holding the live weights
    loaded = DFlashDrafter.from_pretrained(latest_checkpoint(run) / "drafter")
    for k, v in tr.drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    state = json.loads((latest_checkpoint(run) / "trainer_state.json").read_text())
    assert state["step"] == 6 and "data" in state and "config_hash" in state
    steps = [m["step"] for m in read_metrics(run)]
    assert steps == [1, 2, 3, 4, 5, 6]
    m = read_metrics(run)[-1]
    for key in ("loss", "lr", "grad_norm", "slot_acc", "train_streak_tau", "tokens_per_s", "anchors_per_s"):
        assert key in m, key
    assert len(m["slot_acc"]) == 7 and m["train_streak_tau"] >= 1.0 and math.isfinite(m["loss"])
    # best-by-eval survives keep-last pruning
    (run / "eval").mkdir()
    (run / "eval" / "log.jsonl").write_text(
        json.dumps({"step": 4, "tau_chain": 3.0}) + "\n" + json.dumps({"step": 6, "tau_chain": 2.0}) + "\n"
    )
    tr2 = make_trainer(tmp_path, ["optim.max_steps=10", "checkpoint.every=2", "checkpoint.keep_last=1"])
    tr2.restore(latest_checkpoint(run))
    tr2.run()
    assert [p.name for p in list_checkpoints(run)] == ["step-00000004", "step-00000010"]
    assert prune_checkpoints(run, keep_last=1) == []


def test_sigusr1_writes_a_checkpoint_at_the_next_step(tmp_path, capsys):
    def poke(_tr: Trainer, step: int) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)

    tr = make_trainer(tmp_path, ["optim.max_steps=5", "checkpoint.every=1000"], on_step_end=poke)
    handler_before = signal.getsignal(signal.SIGUSR1)
    tr.run()
    names = [p.name for p in list_checkpoints(tmp_path / "run")]
    assert names == ["step-00000003", "step-00000005"]  # the signalled one, then the final one
    assert signal.getsignal(signal.SIGUSR1) == handler_before
    err = capsys.readouterr().err
    run = tmp_path / "run" / "checkpoints"
    assert f"checkpoint (SIGUSR1) at step 3: {run / 'step-00000003'}" in err
    assert f"checkpoint (final) at step 5: {run / 'step-00000005'}" in err


def test_time_limit_stops_with_a_checkpoint_and_resume_continues(tmp_path):
    tr = make_trainer(tmp_path, ["optim.max_steps=5", "checkpoint.every=1000", "runtime.time_limit_min=1e-6"])
    res = tr.run()
    assert (res.stopped, res.steps) == ("time_limit", 1)  # the limit is checked after every step
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-00000001"]
    again = make_trainer(tmp_path, ["optim.max_steps=5", "checkpoint.every=1000"])
    again.restore(latest_checkpoint(tmp_path / "run"))
    assert again.total_steps == 5 and again.run().stopped == "max_steps"
    assert latest_checkpoint(tmp_path / "run").name == "step-00000005"


class _StepClock:
    """The trainer's clock: 0.5 s per optimizer step up to step 110, 0.25 s after (on_step_end advances it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()

    def tick(self, _trainer: Trainer, step: int) -> None:
        self.now += 0.5 if step <= 110 else 0.25


def test_the_schedule_is_fitted_to_the_time_limit(tmp_path, monkeypatch):
    """A 180-s limit: timed over steps 10..110 at 0.5 s a step, it holds 110 + 0.97 × 125 / 0.5 = 352 steps of the
    1,000 asked for; at half the limit (90 s, step 250) the pace since step 110 is 0.25 s, and the fit is redone:
    250 + 0.97 × 90 / 0.25 = 599. The run ends there with its LR schedule decayed to the end, not cut off."""
    clock = _StepClock()
    monkeypatch.setattr(trainer_mod, "time", clock)
    over = ["optim.max_steps=1000", "checkpoint.every=1000", "runtime.time_limit_min=3",
            "runtime.fit_steps_to_time_limit=true", "optim.min_lr_ratio=0"]  # fmt: skip
    totals: list[int] = []

    def tick(tr: Trainer, step: int) -> None:
        clock.tick(tr, step)
        totals.append(tr.total_steps)

    tr = make_trainer(tmp_path, over, on_step_end=tick)
    res = tr.run()
    assert (res.stopped, res.steps, tr.total_steps) == ("max_steps", 599, 599)
    # fitted after step 110, then after step 250
    assert (totals[109], totals[110], totals[249], totals[250]) == (1000, 352, 352, 599)
    assert tr.schedule(598) < 1e-3 * tr.cfg.optim.lr and clock.now - 1000 < 180
    assert latest_checkpoint(tmp_path / "run").name == "step-00000599"
    again = make_trainer(tmp_path, over)  # a resumed run keeps the fitted schedule
    again.restore(latest_checkpoint(tmp_path / "run"))
    assert again.total_steps == 599 and again.schedule(100) == tr.schedule(100)
    roomy = make_trainer(tmp_path / "roomy", [*over[1:], "optim.max_steps=200", "runtime.time_limit_min=60"],
                         on_step_end=clock.tick)  # fmt: skip
    assert roomy.run().steps == 200  # a limit that holds every step changes nothing
    with pytest.raises(ConfigError, match="needs runtime.time_limit_min"):
        load_config(TrainConfig, None, [*SMALL, "runtime.fit_steps_to_time_limit=true"]).validate()


class _NaNAt:
    """Wraps a source; poisons the features of the listed micro-batches (1-based)."""

    def __init__(self, inner: InProcessSource, poisoned: set[int] | None) -> None:
        self.inner, self.poisoned, self.count = inner, poisoned, 0

    def __iter__(self):  # noqa: ANN204
        for fb in self.inner:
            self.count += 1
            if self.poisoned is None or self.count in self.poisoned:
                fb.features = torch.full_like(fb.features, float("nan"))
            yield fb

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def test_loop_anchor_weight_reaches_the_sampler(tmp_path, monkeypatch):
    from flashdraft.train.blocks import AnchorSampler

    seen: list[float] = []
    sample = AnchorSampler.sample

    def spy(self, *a, **k):  # noqa: ANN001, ANN202
        seen.append(a[4] if len(a) > 4 else k.get("loop_weight", 1.0))
        return sample(self, *a, **k)

    monkeypatch.setattr(AnchorSampler, "sample", spy)
    make_trainer(tmp_path, ["optim.max_steps=2", "data.loop_anchor_weight=0.25"]).run()
    assert seen and set(seen) == {0.25}


def test_nan_step_is_skipped_and_training_continues(tmp_path):
    weights: dict[int, dict[str, torch.Tensor]] = {}

    def snap(tr: Trainer, step: int) -> None:
        weights[step] = {k: v.clone() for k, v in tr.drafter.state_dict().items()}

    tr = make_trainer(tmp_path, ["optim.max_steps=5"], wrap=lambda s: _NaNAt(s, {3}), on_step_end=snap)
    tr.run()
    for k in weights[2]:
        assert torch.equal(weights[2][k], weights[3][k]), f"{k} changed on a skipped step"
    assert any(not torch.equal(weights[3][k], weights[4][k]) for k in weights[3])
    assert all(torch.isfinite(v).all() for v in weights[5].values())
    m = {r["step"]: r for r in read_metrics(tmp_path / "run")}
    assert m[3]["skipped_steps"] == 1 and m[4]["skipped_steps"] == 0 and math.isfinite(m[4]["loss"])


def test_nan_guard_stops_after_m_bad_steps_in_a_row(tmp_path):
    tr = make_trainer(
        tmp_path, ["optim.max_steps=20", "optim.max_bad_steps=3"], wrap=lambda s: _NaNAt(s, None)
    )
    with pytest.raises(TrainingError, match="3 optimizer steps in a row had a non-finite"):
        tr.run()
    assert read_metrics(tmp_path / "run")[-1]["step"] == 3


def test_out_of_memory_names_the_knobs(tmp_path, monkeypatch):
    def boom(*_a, **_k):  # noqa: ANN202
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(trainer_mod, "micro_step", boom)
    tr = make_trainer(tmp_path, ["optim.max_steps=2"])
    with pytest.raises(TrainingError, match=r"data\.token_budget.*data\.max_anchors.*data\.max_length"):
        tr.run()


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    """Σw over the global batch: 2 micro-batches of 1 row == 1 micro-batch of 2 rows (same docs)."""
    a = make_trainer(
        tmp_path / "a",
        ["optim.max_steps=1", "data.token_budget=48", "optim.grad_accum=2", "data.shuffle=false"],
    )
    b = make_trainer(tmp_path / "b", ["optim.max_steps=1", "data.token_budget=96", "data.shuffle=false"])
    a.run()
    b.run()
    la, lb = read_metrics(tmp_path / "a" / "run")[0], read_metrics(tmp_path / "b" / "run")[0]
    assert la["loss"] == pytest.approx(lb["loss"], rel=1e-5)
    assert la["grad_norm"] == pytest.approx(lb["grad_norm"], rel=1e-4)


def _run_recording_drafts(tmp_path: Path, overrides: list[str]) -> tuple[Trainer, list[list[DraftBatch]]]:
    """Run a trainer; also return each optimizer step's blocks (what optimizer_step hands back)."""
    tr = make_trainer(tmp_path, overrides)
    per_step: list[list[DraftBatch]] = []
    step = tr.optimizer_step

    def recording(micro: list[object], iv: Interval) -> list[DraftBatch]:
        per_step.append(step(micro, iv))
        return per_step[-1]

    tr.optimizer_step = recording  # type: ignore[method-assign]
    tr.run()
    return tr, per_step


def test_metrics_carry_model_flops_and_mfu_only_with_a_peak(tmp_path):
    """Each line's model_tflops_per_s × its wall time is the step's FLOP count (log_every=1: step_time_s is
    the interval's wall time), summed over both micro-batches; mfu only when telemetry.peak_tflops is set."""
    for name, extra in (("peak", ["telemetry.peak_tflops=0.5"]), ("no-peak", [])):
        tr, per_step = _run_recording_drafts(
            tmp_path / name, ["optim.max_steps=3", "optim.grad_accum=2", *extra]
        )
        assert tr.trainable_params == sum(p.numel() for p in tr.drafter.parameters()) > 0
        lines = read_metrics(tmp_path / name / "run")
        assert [len(d) for d in per_step] == [2, 2, 2] and len(lines) == 3
        for m, drafts in zip(lines, per_step, strict=True):
            flops = step_flops(drafts, tr.drafter.config, tr.trainable_params)
            assert m["model_tflops_per_s"] > 0
            assert m["model_tflops_per_s"] * 1e12 * m["step_time_s"] == pytest.approx(flops, rel=1e-9)
            if extra:
                assert m["mfu"] == pytest.approx(m["model_tflops_per_s"] / 0.5, rel=1e-12)
            else:
                assert "mfu" not in m


def test_static_shapes_give_the_same_losses_as_dynamic_shapes(tmp_path, monkeypatch):
    """data.blocks_per_row pads every micro-batch to [token_budget // max_length, max_length] and a fixed
    block count: with room for every anchor, the losses are those of the unpadded batches."""
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    real = trainer_mod.micro_step

    def spy(model, target, fb, draft, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append((tuple(fb.input_ids.shape), tuple(draft.block_ids.shape)))
        return real(model, target, fb, draft, *a, **k)

    runs = {}
    for name, extra in [("dynamic", []), ("static", ["data.blocks_per_row=24"])]:
        seen.clear()
        monkeypatch.setattr(trainer_mod, "micro_step", spy)
        make_trainer(tmp_path / name, ["optim.max_steps=6", *extra]).run()
        runs[name] = read_metrics(tmp_path / name / "run")
        shapes = set(seen)
    assert shapes == {((2, 48), (2, 24 * 8))}  # the static run: one shape, also for the epoch's last batch
    assert runs["static"] and len(runs["static"]) == len(runs["dynamic"])
    for a, b in zip(runs["dynamic"], runs["static"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["tokens_seen"] == a["tokens_seen"]


# ----------------------------------------------------------------------------- exact resume (subprocess)


def _write_run_inputs(tmp_path: Path) -> Path:
    from flashdraft.data.dataset import Sample, write_dataset

    t = tiny_target("llama", dtype=torch.float32)
    t.model.save_pretrained(tmp_path / "target")
    docs = make_docs([40, 30, 20, 45, 25, 33, 38, 27], seed=0)
    write_dataset(
        [Sample(d.id, d.input_ids, d.loss_mask) for d in docs], tmp_path / "data",
        eval_fraction=0.0, contamination_sources=(), check_eval_split_overlap=False,
    )  # fmt: skip
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        f"model:\n  target: {tmp_path / 'target'}\n  num_layers: 1\n  block_size: 8\n"
        f"data:\n  dataset: {tmp_path / 'data'}\n  max_length: 48\n  token_budget: 96\n  max_anchors: 6\n"
        "  pad_multiple: 1\noptim:\n  max_steps: 30\n  lr: 3.0e-3\n"
        "runtime:\n  deterministic: true\n  dtype: float32\n  device: cpu\n"
        "checkpoint:\n  every: 3\n  keep_last: 2\ntelemetry:\n  log_every: 1\n  progress: false\n"
    )
    return cfg


def _cli(cfg: Path, run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "flashdraft.cli", "train", str(cfg), f"run_dir={run}", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:  # noqa: ANN001
    """The run inputs and an uninterrupted 30-step run of them (in this process, one thread like the
    subprocesses), shared by the resume tests."""
    tmp_path = tmp_path_factory.mktemp("resume")
    cfg = _write_run_inputs(tmp_path)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    try:
        train(load_config(TrainConfig, cfg, [f"run_dir={tmp_path / 'full'}"]), command="reference")
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    return tmp_path


def test_exact_resume_after_sigkill(reference):
    tmp_path, cfg = reference, reference / "cfg.yaml"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # stderr unread would fill its pipe and stall the run before its checkpoints: to a file instead
    log = (tmp_path / "cut.log").open("w")
    proc = subprocess.Popen(_cli(cfg, tmp_path / "cut"), cwd=REPO, env=env, stderr=log, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        ck = latest_checkpoint(tmp_path / "cut")
        if ck is not None and ck.name >= "step-00000006":
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log.close()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = latest_checkpoint(tmp_path / "cut")
    assert killed_at is not None and killed_at.name < "step-00000030"
    from flashdraft.train.runs import summarize

    state = summarize(tmp_path / "cut").state  # the heartbeat still says running; its process is gone
    assert (
        state.state == "stopped" and "is gone" in state.line and "--resume restarts from step" in state.line
    )
    res = subprocess.run(  # a resume that hangs fails here instead of stalling the suite
        _cli(cfg, tmp_path / "cut", "--resume"),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"resumed from {killed_at}" in res.stderr
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    assert [m["step"] for m in b] == list(range(1, 31))
    assert [m["loss"] for m in a] == [m["loss"] for m in b]  # bit-identical, not approximately equal
    assert [m["grad_norm"] for m in a] == [m["grad_norm"] for m in b]
    wa = DFlashDrafter.from_pretrained(latest_checkpoint(tmp_path / "full") / "drafter").state_dict()
    wb = DFlashDrafter.from_pretrained(latest_checkpoint(tmp_path / "cut") / "drafter").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (tmp_path / "cut" / "command.txt").read_text().count("resume: ") == 1


def test_sigterm_writes_a_checkpoint_and_resume_loses_no_step(reference):
    """SIGTERM mid-run (no periodic checkpoint yet): a checkpoint of the live state at the next step, one line
    saying where, exit 143, `runs status` says stopped and that --resume loses nothing; the resumed run is
    bit-identical to the uninterrupted one."""
    from flashdraft.train.checkpoint import step_of
    from flashdraft.train.runs import summarize

    tmp_path, cfg = reference, reference / "cfg.yaml"
    run = tmp_path / "term"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        _cli(cfg, run, "checkpoint.every=1000"), cwd=REPO, env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and len(read_metrics(run)) < 3:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and 3 <= step_of(ckpt) < 30, "no checkpoint, or the run finished before SIGTERM"
    step = step_of(ckpt)
    assert [p.name for p in list_checkpoints(run)] == [ckpt.name]  # the signal's checkpoint is the only one
    assert f"checkpoint (SIGTERM) at step {step}: {ckpt}" in err
    assert err.rstrip().splitlines()[-1] == (
        f"stopped by SIGTERM at step {step}: checkpoint {ckpt}; continue with --resume"
    )
    assert max(m["step"] for m in read_metrics(run)) == step
    state = summarize(run).state
    assert state.state == "stopped" and f"stopped (SIGTERM) at step {step}" in state.line
    assert f"--resume restarts from step {step} (loses 0 steps)" in state.line
    res = subprocess.run(
        _cli(cfg, run, "checkpoint.every=1000", "--resume"),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    a, b = read_metrics(tmp_path / "full"), read_metrics(run)
    assert [m["step"] for m in b] == list(range(1, 31))
    assert [m["loss"] for m in a] == [m["loss"] for m in b]  # bit-identical, not approximately equal
    assert [m["grad_norm"] for m in a] == [m["grad_norm"] for m in b]
    assert summarize(run).state.state == "finished"


def test_out_of_memory_in_the_target_pass_names_the_knobs(tmp_path):
    class _Boom:
        def __init__(self, inner: InProcessSource) -> None:
            self.inner = inner

        def __iter__(self):  # noqa: ANN204
            raise torch.OutOfMemoryError("CUDA out of memory")
            yield  # pragma: no cover

        def __getattr__(self, name: str):  # noqa: ANN204
            return getattr(self.inner, name)

    tr = make_trainer(tmp_path, ["optim.max_steps=2"], wrap=_Boom)
    with pytest.raises(TrainingError, match=r"target feature pass.*data\.token_budget.*data\.max_length"):
        tr.run()


def test_drafter_started_from_the_target_trains(tmp_path):
    tr = make_trainer(tmp_path, ["optim.max_steps=12", "model.init_from_target=next"])
    t, d = tr.target, tr.drafter
    assert d.target_layer_ids == [3]  # 1 drafter layer on a 6-layer target: it copies layer 4
    assert torch.equal(d.layers[0].mlp.down_proj.weight, t.layers[4].mlp.down_proj.weight)
    assert torch.equal(d.layers[0].self_attn.q_proj.weight, t.layers[4].self_attn.q_proj.weight)
    start = {k: v.clone() for k, v in d.state_dict().items()}
    assert tr.run().steps == 12
    assert all(torch.isfinite(v).all() for v in d.state_dict().values())
    assert not torch.equal(
        start["layers.0.mlp.down_proj.weight"], d.state_dict()["layers.0.mlp.down_proj.weight"]
    )
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.init_from_target=first"], "use one of none, last, next"),
        (["model.init_from_target=last", "model.init_from=models/x"], "pick one starting point"),
        (["model.init_from_target=last", "model.intermediate_size=40"], "leave the drafter's heads"),
    ],
)
def test_init_from_target_config_errors(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_trainer(tmp_path, overrides)


def test_optim_epochs_sets_the_schedule_when_max_steps_is_unset(tmp_path):
    """optim.epochs: passes over the data, turned into optimizer steps; optim.max_steps overrides it."""
    trainers = [make_trainer(tmp_path / str(e), ["optim.max_steps=null", f"optim.epochs={e}"]) for e in (1, 3)]
    per_epoch = trainers[0].source.micro_batches_per_epoch()
    accum = trainers[0].cfg.optim.grad_accum
    assert per_epoch > 1
    assert [t.total_steps for t in trainers] == [math.ceil(per_epoch * e / accum) for e in (1, 3)]
    assert make_trainer(tmp_path / "m", ["optim.max_steps=5", "optim.epochs=3"]).total_steps == 5
