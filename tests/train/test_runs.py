"""`flashdraft runs list|status|archive` on a real (tiny) run folder plus evaluator results."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from flashdraft.cli import app
from flashdraft.config import load_config
from flashdraft.train.config import TrainConfig
from flashdraft.train.launch import train
from flashdraft.train.runs import RunError, archive_run, list_runs, status_markdown, summarize
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
                      "tau_ddtree": {"8": 2.5}}) + "\n"
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
    assert "6/6" in lines[1] and "1.75" in lines[1]
    r = CliRunner().invoke(app, ["runs", "list", str(run)])
    assert r.exit_code == 0 and "alpha" in r.output


def test_status_prints_and_writes_markdown(run):
    r = CliRunner().invoke(app, ["runs", "status", str(run / "alpha")])
    assert r.exit_code == 0, r.output
    md = (run / "alpha" / "STATUS.md").read_text()
    assert md == r.output.rstrip("\n") + "\n"
    for part in ("# Run status: alpha", "config digest", "step 6 of 6", "tokens seen", "ETA",
                 "τ proxy", "queue: ", "| 3 | `checkpoints/step-00000003` | 1.25 |", "tau_ddtree"):  # fmt: skip
        assert part in md, part
    r = CliRunner().invoke(app, ["runs", "status", str(run / "not-a-run")])
    assert r.exit_code == 1 and "not a run folder" in r.output


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
