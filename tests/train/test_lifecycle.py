"""A run's lifecycle: stop signals, SIGUSR1 outside the steps, a non-empty run folder, resume from broken
checkpoints or another architecture. (SIGTERM on a real subprocess run: tests/train/test_trainer.py.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashdraft.config import ConfigError, load_config
from flashdraft.train.checkpoint import list_checkpoints
from flashdraft.train.config import TrainConfig
from flashdraft.train.launch import train
from flashdraft.train.lifecycle import HEARTBEAT_FILE, RunSignals
from flashdraft.train.metrics import read_metrics
from tests.conftest import tiny_target
from tests.train.helpers import make_docs

REPO = Path(__file__).resolve().parents[2]

SMALL = [
    "model.num_layers=1", "model.block_size=8", "data.max_length=48", "data.token_budget=96",
    "data.max_anchors=6", "data.pad_multiple=1", "telemetry.log_every=1", "telemetry.tensorboard=false",
    "telemetry.progress=false", "runtime.dtype=float32",
]  # fmt: skip
DOCS = [40, 30, 20, 45, 25, 33]


def _train(run: Path, *overrides: str, resume: bool = False):  # noqa: ANN202
    cfg = load_config(TrainConfig, None, [f"run_dir={run}", *SMALL, *overrides])
    return train(
        cfg, resume=resume, target=tiny_target("llama", dtype=torch.float32), samples=make_docs(DOCS)
    )


def test_a_second_stop_signal_or_one_before_training_exits_at_once(capfd):
    s = RunSignals()
    with pytest.raises(SystemExit) as e:  # not armed: no step has run, nothing to save
        s._on_stop(signal.SIGTERM, None)
    assert e.value.code == 128 + signal.SIGTERM
    s.armed = True
    s._on_stop(signal.SIGINT, None)  # the first one only asks for a checkpoint and a stop
    assert s.stop_name == "SIGINT"
    with pytest.raises(SystemExit) as e:
        s._on_stop(signal.SIGINT, None)
    assert e.value.code == 128 + signal.SIGINT
    err = capfd.readouterr().err.splitlines()
    assert err == [
        "SIGTERM: exiting at once (no training step has run yet); no checkpoint written",
        "SIGINT: writing a checkpoint at the end of this step, then stopping (send it again to exit at once)",
        "SIGINT: exiting at once (a second stop signal); no checkpoint written",
    ]


_USR1_OUTSIDE_THE_STEPS = """
import os, signal, sys
import torch
from flashdraft.config import load_config
from flashdraft.train import launch
from flashdraft.train.config import TrainConfig
from flashdraft.train.trainer import Trainer
from tests.conftest import tiny_target
from tests.train.helpers import make_docs

build, run = launch.build_drafter, Trainer.run

def build_and_poke(*a, **k):
    os.kill(os.getpid(), signal.SIGUSR1)  # while the run loads
    return build(*a, **k)

def run_and_poke(self):
    result = run(self)
    os.kill(os.getpid(), signal.SIGUSR1)  # after the last step
    return result

launch.build_drafter, Trainer.run = build_and_poke, run_and_poke
cfg = load_config(TrainConfig, None, [f"run_dir={sys.argv[1]}", *sys.argv[2:]])
res = launch.train(cfg, target=tiny_target("llama", dtype=torch.float32), samples=make_docs([40, 30, 20, 45]))
print("done", res.steps, res.stopped)
"""


def test_sigusr1_while_loading_is_kept_for_the_first_step_and_after_the_last_step_ignored(tmp_path):
    run = tmp_path / "run"
    argv = [sys.executable, "-c", _USR1_OUTSIDE_THE_STEPS, str(run), *SMALL, "optim.max_steps=3",
            "checkpoint.every=1000"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "done 3 max_steps" in res.stdout
    assert [p.name for p in list_checkpoints(run)] == ["step-00000001", "step-00000003"]
    assert f"checkpoint (SIGUSR1) at step 1: {run / 'checkpoints' / 'step-00000001'}" in res.stderr
    assert f"checkpoint (final) at step 3: {run / 'checkpoints' / 'step-00000003'}" in res.stderr


def test_a_non_empty_run_folder_is_refused_without_resume(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 3.0}) + "\n")  # metrics, no checkpoint
    with pytest.raises(ConfigError, match=r"is not empty \(metrics.jsonl\).*`flashdraft runs archive .*run`"):
        _train(run, "optim.max_steps=2")
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]  # nothing written into it
    assert read_metrics(run) == [{"step": 5, "loss": 3.0}]


# ----------------------------------------------------------------------------- resume from a broken checkpoint


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:  # noqa: ANN001
    run = tmp_path_factory.mktemp("resume") / "run"
    _train(run, "optim.max_steps=6", "checkpoint.every=3")
    assert [p.name for p in list_checkpoints(run)] == ["step-00000003", "step-00000006"]
    return run


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


CORRUPTIONS = {
    "truncated drafter weights": (lambda c: _truncate(c / "drafter" / "model.safetensors"), "drafter/model.safetensors"),
    "truncated trainer tensors": (lambda c: _truncate(c / "trainer_state.safetensors"), "trainer_state.safetensors"),
    "truncated trainer json": (lambda c: _truncate(c / "trainer_state.json"), "trainer_state.json: invalid JSON"),
    "missing drafter folder": (lambda c: shutil.rmtree(c / "drafter"), "drafter/config.json is missing"),
}  # fmt: skip


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_resume_skips_a_broken_latest_checkpoint_with_a_warning(
    two_checkpoints, tmp_path, capsys, corruption
):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    corrupt, problem = CORRUPTIONS[corruption]
    corrupt(run / "checkpoints" / "step-00000006")
    res = _train(run, "optim.max_steps=6", "checkpoint.every=3", resume=True)
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if line.startswith("warning: --resume: skipping")]
    assert len(warning) == 1 and str(run / "checkpoints" / "step-00000006") in warning[0]
    assert problem in warning[0], warning[0]
    assert f"resumed from {run / 'checkpoints' / 'step-00000003'} (step 3)" in err
    assert res.steps == 6 and [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4, 5, 6]


def test_resume_with_every_checkpoint_broken_is_one_line(two_checkpoints, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    for c in list_checkpoints(run):
        _truncate(c / "drafter" / "model.safetensors")
    with pytest.raises(ConfigError, match="no intact checkpoint in .*runs archive"):
        _train(run, "optim.max_steps=6", "checkpoint.every=3", resume=True)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.block_size=16", r"has block_size=8, this run.s drafter has 16: set model.block_size=8"),
        ("model.num_layers=2", r"has num_hidden_layers=1, this run's drafter has 2: set model.num_layers=1"),
    ],
)
def test_resume_with_another_architecture_names_the_setting(two_checkpoints, tmp_path, override, message):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    with pytest.raises(ConfigError, match=message):
        _train(run, "optim.max_steps=6", "checkpoint.every=3", override, resume=True)
    beat = json.loads((run / HEARTBEAT_FILE).read_text())
    assert beat["state"] == "failed" and beat["reason"].startswith("ConfigError: --resume:")


def test_a_grown_drafter_trains_its_new_layer_and_resumes(two_checkpoints, tmp_path):
    from safetensors.torch import load_file

    start = two_checkpoints / "checkpoints" / "step-00000006" / "drafter"
    run = tmp_path / "grown"
    grow = [f"model.init_from={start}", "model.grow_layers=1", "checkpoint.every=2"]
    _train(run, "optim.max_steps=2", *grow)
    saved = json.loads((run / "checkpoints" / "step-00000002" / "drafter" / "config.json").read_text())
    assert saved["num_hidden_layers"] == 2
    weights = load_file(str(run / "checkpoints" / "step-00000002" / "drafter" / "model.safetensors"))
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    assert weights["layers.1.self_attn.o_proj.weight"].abs().sum() > 0  # started at zero, trained since
    res = _train(run, "optim.max_steps=4", *grow, resume=True)  # resumes into the grown shape
    assert res.steps == 4 and [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]
