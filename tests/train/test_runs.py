"""`flashdraft runs list|status|archive` on a real (tiny) run folder plus evaluator results."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from flashdraft.cli import app
from flashdraft.config import load_config
from flashdraft.train.config import TrainConfig
from flashdraft.train.launch import train
from flashdraft.train.lifecycle import HEARTBEAT_FILE
from flashdraft.train.runs import RunError, archive_run, list_runs, queue_health, status_markdown, summarize
from tests.conftest import tiny_target
from tests.train.helpers import make_docs


@pytest.fixture(scope="module")
def run(tmp_path_factory):  # noqa: ANN201
    root = tmp_path_factory.mktemp("runs")
    cfg = load_config(
        TrainConfig, None,
        [f"run_dir={root / 'alpha'}", "model.num_layers=1", "model.block_size=8", "data.max_length=48",
         "data.token_budget=96", "data.max_anchors=6", "data.pad_multiple=1", "telemetry.log_every=2",
         "telemetry.tensorboard=false", "telemetry.progress=false", "runtime.dtype=float32",
         "optim.max_steps=6", "checkpoint.every=3"],
    )  # fmt: skip
    train(cfg, target=tiny_target("llama", dtype=torch.float32), samples=make_docs([40, 30, 20, 45, 25, 33]))
    ev = root / "alpha" / "eval"
    ev.mkdir()
    (ev / "log.jsonl").write_text(
        json.dumps({"step": 3, "checkpoint": "checkpoints/step-00000003", "tau_chain": 1.25}) + "\n"
        + json.dumps({"step": 6, "checkpoint": "checkpoints/step-00000006", "tau_chain": 1.75,
                      "tau_ddtree": {"8": 2.5, "32": 2.75}, "tau_topk": {"4": 1.5}}) + "\n"
    )  # fmt: skip
    (root / "not-a-run").mkdir()
    return root


def test_summary_reads_the_run_folder(run):
    s = summarize(run / "alpha")
    assert s.step == 6 and s.total_steps == 6 and s.eta_s == 0
    assert [c.step for c in s.checkpoints] == [3, 6]
    assert s.checkpoints[0].eval["tau_chain"] == 1.25 and s.last_eval["tau_chain"] == 1.75
    assert s.tokens_seen > 0 and s.tokens_per_s > 0 and len(s.config_digest) == 12
    assert "pipeline/consumer_wait_frac" in s.last


def test_list_one_line_per_run(run):
    lines = list_runs(run)
    assert len(lines) == 2 and lines[1].startswith("alpha")  # header + one run; not-a-run skipped
    assert "6/6" in lines[1] and "1.75" in lines[1] and lines[1].split()[1] == "finished"
    r = CliRunner().invoke(app, ["runs", "list", str(run)])
    assert r.exit_code == 0 and "alpha" in r.output


def test_status_prints_and_writes_markdown(run):
    r = CliRunner().invoke(app, ["runs", "status", str(run / "alpha")])
    assert r.exit_code == 0, r.output
    md = (run / "alpha" / "STATUS.md").read_text()
    assert md == r.output.rstrip("\n") + "\n"
    for part in ("# Run status: alpha", "config digest", "step 6 of 6", "tokens seen", "ETA",
                 "τ proxy", "queue: ", "| 3 | `checkpoints/step-00000003` | 1.25 |", "- finished (max_steps) at step 6",
                 "- started 20", "; elapsed "):  # fmt: skip
        assert part in md, part
    r = CliRunner().invoke(app, ["runs", "status", str(run / "not-a-run")])
    assert r.exit_code == 1 and "not a run folder" in r.output


def test_status_names_the_drafters_depth_as_its_config_decides_it() -> None:
    from flashdraft.train.runs import _drafter_shape

    assert _drafter_shape({"num_layers": 5}) == "5 layers"
    assert _drafter_shape({"num_layers": 5, "init_from": "models/d"}) == "from `models/d`"
    assert _drafter_shape({"init_from": "models/d", "grow_layers": 3}) == "from `models/d` with 3 layers added"


def test_status_says_where_a_run_sits_in_the_longer_schedule_it_is_part_of(run):
    s = summarize(run / "alpha")  # 6 steps, a schedule of its own
    assert "LR schedule" not in status_markdown(s)
    s.config["optim"] = {**(s.config.get("optim") or {}), "schedule_steps": 9000, "schedule_start": 3000}
    assert "- LR schedule: a part of one 9,000 steps long, from its step 3,000; now at 3,006" in status_markdown(s)


def test_status_shows_model_flops_and_mfu_when_logged(run):
    s = summarize(run / "alpha")  # trained without telemetry.peak_tflops: model FLOP/s, no mfu
    assert s.model_tflops_per_s > 0 and s.mfu is None
    md = status_markdown(s)
    assert "TFLOP/s per device (rank 0, attention included); MFU - (set telemetry.peak_tflops)" in md
    cfg = {**s.config, "telemetry": {**s.config["telemetry"], "peak_tflops": 790.0}}
    md = status_markdown(replace(s, model_tflops_per_s=213.3, mfu=0.27, config=cfg))
    line = "- model 213 TFLOP/s per device (rank 0, attention included); MFU 27.0% of 790 TFLOP/s peak\n"
    assert line in md
    # a run logged before the trainer counted model FLOPs: no line
    md = status_markdown(replace(s, model_tflops_per_s=None, mfu=None))
    assert "TFLOP/s" not in md and "- throughput" in md


def test_archive_moves_the_run_aside(run, tmp_path):
    import shutil

    copy = tmp_path / "beta"
    shutil.copytree(run / "alpha", copy)
    dest = archive_run(copy, now=0)
    assert not copy.exists() and dest.name == "beta.archived-19700101-000000"
    assert (dest / "checkpoints" / "step-00000006" / "drafter" / "config.json").is_file()
    shutil.copytree(dest, copy)
    assert archive_run(copy, now=0).name == "beta.archived-19700101-000000-1"  # never merges into an old one
    with pytest.raises(RunError):
        archive_run(copy)


def _copy_with_heartbeat(run, tmp_path, **beat):  # noqa: ANN001, ANN003, ANN202
    copy = tmp_path / "beta"
    shutil.copytree(run / "alpha", copy)
    path = copy / HEARTBEAT_FILE
    path.write_text(json.dumps({**json.loads(path.read_text()), **beat}))
    return copy


def test_status_of_a_finished_run(run):
    s = summarize(run / "alpha")
    assert s.state.state == "finished" and s.state.line.startswith("finished (max_steps) at step 6")
    assert s.state.started is not None and s.state.elapsed_s >= 0


def test_status_of_a_killed_run_says_what_resume_restarts_from(run, tmp_path):
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(gone.stdout)  # a process that has exited: the heartbeat still says running
    copy = _copy_with_heartbeat(
        run, tmp_path, state="running", reason=None, pid=pid, step=8, heartbeat=time.time()
    )
    s = summarize(copy)
    assert s.state.state == "stopped", s.state.line
    assert f"the process (pid {pid} on {socket.gethostname()}) is gone" in s.state.line
    assert "--resume restarts from step 6 (loses 2 steps)" in s.state.line
    md = status_markdown(s)
    assert "ETA - (not running)" in md and "- stopped: the process" in md
    assert list_runs(copy)[1].split()[1] == "stopped"
    # another host: only the heartbeat's age tells; 4 missed beats is dead
    copy2 = _copy_with_heartbeat(run, tmp_path / "b", state="running", host="elsewhere", pid=1,
                                 heartbeat=time.time() - 61, every_s=15)  # fmt: skip
    assert summarize(copy2).state.state == "stopped"


def test_status_of_a_live_run(run, tmp_path):
    now = time.time()
    copy = _copy_with_heartbeat(run, tmp_path, state="running", reason=None, pid=os.getpid(),
                                host=socket.gethostname(), started=now - 300, heartbeat=now - 3)  # fmt: skip
    s = summarize(copy)
    assert s.state.state == "running"
    assert s.state.line.startswith(f"running: pid {os.getpid()} on {socket.gethostname()}, step 6")
    assert 300 <= s.state.elapsed_s < 400
    assert list_runs(copy)[1].split()[1] == "running"
    copy2 = _copy_with_heartbeat(run, tmp_path / "b", state="running", host="elsewhere", pid=1,
                                 heartbeat=now - 20, every_s=15)  # fmt: skip
    assert summarize(copy2).state.state == "running"


def test_status_eval_table_has_every_evaluated_step_and_marks_the_best(run, tmp_path):
    copy = tmp_path / "beta"
    shutil.copytree(run / "alpha", copy)
    shutil.rmtree(copy / "checkpoints" / "step-00000003")  # deleted by keep_last: its results stay
    with (copy / "eval" / "log.jsonl").open("a") as f:
        f.write(json.dumps({"step": 1, "tau_chain": 1.5, "tau_ddtree": {"8": 2.0}}) + "\n")
    md = status_markdown(summarize(copy))
    table = md[md.index("## Evaluations") :].splitlines()[2:]
    assert table == [
        "| step | chain τ | DDTree 8 τ | DDTree 32 τ | top-4 τ | checkpoint |",
        "|---:|---:|---:|---:|---:|---|",
        "| 1 | 1.500 | 2.000 | - | - | deleted |",
        "| 3 | 1.250 | - | - | - | deleted |",
        "| **6** | **1.750** | **2.500** | **2.750** | **1.500** | **on disk** ← best tau_chain |",
    ]


def test_queue_health_names_the_producers_host_stages() -> None:
    last = {"pipeline/consumer_wait_frac_window": 0.12, "pipeline/queue_depth": 0.0, "pipeline/queue_capacity": 0.0,
            "pipeline/producer_s_per_batch": 0.0094, "pipeline/host_pack_ms": 0.8, "pipeline/host_target_ms": 8.4}  # fmt: skip
    line = queue_health(last)
    assert line.startswith("STARVED: trainer waits 12.0% of the time")
    assert line.endswith("producer 0.009 s/batch, pack 0.8 ms, target 8.4 ms")
    assert queue_health({}) == "- (no pipeline metrics)"
    # on CUDA with the producer on side streams the stream's idle time decides: a hidden host wait is fine
    hidden = queue_health({**last, "pipeline/stream_idle_frac_window": 0.004})
    assert hidden.startswith("ok: trainer's CUDA stream idle 0.4% of the time, its thread waits 12.0%")
    assert queue_health({**last, "pipeline/stream_idle_frac_window": 0.3}).startswith(
        "STARVED: trainer's CUDA"
    )
