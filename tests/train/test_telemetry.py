"""Telemetry: providers merged into every line as host scalars, TensorBoard files, W&B optional, GPU stats."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types

import pytest
import torch

from flashdraft.config import ConfigError
from flashdraft.train.metrics import read_metrics
from flashdraft.train.telemetry import GpuStats, TelemetryLogger


def test_providers_are_merged_as_detached_host_scalars(tmp_path):
    calls = []

    def provider() -> dict:
        calls.append(1)
        return {"pipeline/queue_depth": 3.0, "extra/tensor": torch.tensor(2.5, requires_grad=True) * 2}

    log = TelemetryLogger(tmp_path, providers=[provider], tensorboard=True)
    log.log(1, {"loss": torch.tensor(1.5), "slot_acc": [torch.tensor(0.5), 0.25]})
    log.log(2, {"loss": 1.25})
    log.close()
    lines = read_metrics(tmp_path)
    assert len(calls) == 2 and [m["step"] for m in lines] == [1, 2]
    assert lines[0]["loss"] == 1.5 and lines[0]["slot_acc"] == [0.5, 0.25]
    assert lines[0]["extra/tensor"] == 5.0 and lines[1]["pipeline/queue_depth"] == 3.0
    json.dumps(lines)  # plain JSON values only
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_disabled_rank_writes_nothing_but_still_drains_providers(tmp_path):
    drained = []
    log = TelemetryLogger(tmp_path / "r1", providers=[lambda: drained.append(1) or {}], enabled=False)
    log.log(1, {"loss": 1.0})
    assert drained == [1] and not (tmp_path / "r1").exists()


def test_wandb_only_when_configured_with_a_clear_message_when_missing(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    TelemetryLogger(tmp_path / "a", tensorboard=False).close()  # not configured: never needed
    with pytest.raises(ConfigError, match="pip install wandb, or drop telemetry.wandb_project"):
        TelemetryLogger(tmp_path / "b", tensorboard=False, wandb_project="proj")


def test_wandb_receives_the_scalars_when_configured(tmp_path, monkeypatch):
    seen: dict = {"log": []}

    class _Run:
        def log(self, values: dict, step: int) -> None:
            seen["log"].append((step, values))

        def finish(self) -> None:
            seen["finished"] = True

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: seen.update(init=kw) or _Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = TelemetryLogger(tmp_path, providers=[lambda: {"gpu0/util_pct": 87.0}], tensorboard=False,
                          wandb_project="proj", config={"a": 1})  # fmt: skip
    log.log(7, {"loss": 2.0})
    log.close()
    assert seen["init"]["project"] == "proj" and seen["finished"]
    assert seen["log"] == [(7, {"loss": 2.0, "gpu0/util_pct": 87.0})]


def test_gpu_stats_are_empty_on_cpu():
    assert GpuStats(torch.device("cpu"))() == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_stats_on_cuda(capsys):
    x = torch.empty(1 << 20, device="cuda")  # something allocated
    s = GpuStats(torch.device("cuda"))()
    assert s["cuda/allocated_gb"] > 0 and s["cuda/reserved_gb"] >= s["cuda/allocated_gb"]
    assert 0.0 <= s["cuda/fragmentation"] <= 1.0 and s["cuda/peak_allocated_gb"] >= s["cuda/allocated_gb"]
    if importlib.util.find_spec("pynvml") is not None:
        assert "gpu0/util_pct" in s and "gpu0/temp_c" in s and "gpu0/power_w" in s
    else:
        assert "NVML skipped" in capsys.readouterr().err
    assert all(isinstance(v, float) for v in s.values())
    del x


def _event_steps(run) -> dict[int, int]:  # noqa: ANN001
    """How many times each step's loss is in the run's TensorBoard event files (read raw, every file)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    counts: dict[int, int] = {}
    for path in sorted((run / "tensorboard").glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            if any(v.tag == "loss" for v in event.summary.value):
                counts[event.step] = counts.get(event.step, 0) + 1
    return counts


def test_tensorboard_after_resume_has_each_step_once(tmp_path):
    from flashdraft.config import load_config
    from flashdraft.train.config import TrainConfig
    from flashdraft.train.launch import train
    from tests.conftest import tiny_target
    from tests.train.helpers import make_docs

    def cfg():  # noqa: ANN202
        over = ["model.num_layers=1", "model.block_size=8", "data.max_length=48", "data.token_budget=96",
                "data.max_anchors=6", "data.pad_multiple=1", "telemetry.log_every=1", "telemetry.progress=false",
                "runtime.dtype=float32", "optim.max_steps=6", "checkpoint.every=3", f"run_dir={tmp_path / 'run'}"]  # fmt: skip
        return load_config(TrainConfig, None, over)

    def crash_at_5(_tr, step: int) -> None:  # noqa: ANN001
        if step == 5:  # steps 1-4 logged, the checkpoint is step 3's
            raise RuntimeError("killed")

    kw = dict(target=tiny_target("llama", dtype=torch.float32), samples=make_docs([40, 30, 20, 45, 25, 33]))
    with pytest.raises(RuntimeError, match="killed"):
        train(cfg(), on_step_end=crash_at_5, **kw)
    assert _event_steps(tmp_path / "run") == {1: 1, 2: 1, 3: 1, 4: 1}
    train(cfg(), resume=True, **kw)  # replays step 4
    assert _event_steps(tmp_path / "run") == {s: 1 for s in range(1, 7)}
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
