"""Data parallelism on CPU (gloo, 2 processes): DDP and FSDP2 equal a 1-process run with the same
global batch; rank 0 writes plain checkpoints; a 2-rank run resumes exactly."""

from __future__ import annotations

import os
import random
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from flashdraft.config import load_config
from flashdraft.drafter import DFlashDrafter
from flashdraft.train.checkpoint import list_checkpoints
from flashdraft.train.config import TrainConfig
from flashdraft.train.metrics import read_metrics
from flashdraft.train.source import InProcessSource
from tests.conftest import tiny_target
from tests.train.helpers import make_docs

# 8 documents of ~40 tokens, one per 48-token row: 8 micro-batches of 1 row per epoch (even: no rank drops one)
LENGTHS = [40, 30, 44, 45, 25, 33, 38, 27]
STEPS = 4


def _cfg(run: Path, extra: list[str]) -> TrainConfig:
    return load_config(
        TrainConfig, None,
        [f"run_dir={run}", "model.num_layers=1", "model.block_size=8", "data.max_length=48",
         "data.token_budget=48", "data.max_anchors=64",  # every valid anchor: no per-rank sampling randomness
         "data.pad_multiple=1", "telemetry.log_every=1", "telemetry.tensorboard=false", "telemetry.progress=false",
         "runtime.dtype=float32", "runtime.device=cpu", f"optim.max_steps={STEPS}", "optim.lr=3e-3",
         "checkpoint.every=2", "checkpoint.keep_last=5", *extra],
    )  # fmt: skip


def _free_port() -> int:
    """A free port below Linux's ephemeral range (32768+): a port the OS hands out for port 0 can be
    reused by the first run's gloo pair connections before the second run's rendezvous binds it
    (seen once: the FSDP2 rendezvous hung)."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def _record_params(path: Path):  # noqa: ANN202
    """on_step_end hook: the trainer's trainable parameter count (model FLOPs) and whether its drafter is sharded."""

    def record(trainer, _step: int) -> None:  # noqa: ANN001
        path.write_text(f"{trainer.trainable_params} {int(trainer.sharded)}")

    return record


def _worker(rank: int, root: str, ports: list[int]) -> None:
    from flashdraft.train.launch import train

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    t = tiny_target("llama", dtype=torch.float32)
    docs = make_docs(LENGTHS, seed=0)
    for i, (name, strategy) in enumerate([("ddp", "ddp"), ("fsdp2", "fsdp2")]):
        os.environ["MASTER_PORT"] = str(ports[i])
        cfg = _cfg(Path(root) / name, [f"distributed.strategy={strategy}"])
        train(cfg, target=t, samples=docs, on_step_end=_record_params(Path(root) / f"params-{name}-{rank}"))
    # resume: drop the last checkpoint, continue from step 2 (rank 0 deletes before anyone starts)
    for i, strategy in enumerate(["ddp", "fsdp2"]):
        run = Path(root) / strategy
        if rank == 0:
            shutil.copytree(run, Path(root) / f"{strategy}-resumed")
            shutil.rmtree(Path(root) / f"{strategy}-resumed" / "checkpoints" / f"step-{STEPS:08d}")
        os.environ["MASTER_PORT"] = str(ports[2 + i])
        # rank 1 cannot race the copy: it reads the folder only after rank 0 joined the group
        cfg = _cfg(Path(root) / f"{strategy}-resumed", [f"distributed.strategy={strategy}"])
        train(cfg, target=t, samples=docs, resume=True)


def test_two_gloo_ranks_equal_one_process_with_the_same_global_batch(tmp_path):
    from flashdraft.train.launch import train

    assert (
        InProcessSource(
            make_docs(LENGTHS), None, [1], max_length=48, token_budget=48
        ).micro_batches_per_epoch()
        == 8
    )
    train(_cfg(tmp_path / "one", ["optim.grad_accum=2"]), target=tiny_target("llama", dtype=torch.float32),
          samples=make_docs(LENGTHS, seed=0))  # fmt: skip
    ports: list[int] = []
    while len(ports) < 4:  # one rendezvous port per run, all different
        if (port := _free_port()) not in ports:
            ports.append(port)
    procs = mp.spawn(_worker, args=(str(tmp_path), ports), nprocs=2, join=False)
    deadline = time.monotonic() + 600  # a hung rank fails the test instead of stalling the suite
    while not procs.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in procs.processes:
                proc.kill()
            pytest.fail("the two gloo ranks did not finish in 600 s")

    one = read_metrics(tmp_path / "one")
    assert [m["step"] for m in one] == list(range(1, STEPS + 1))
    ref_w = DFlashDrafter.from_pretrained(tmp_path / "one" / "checkpoints" / f"step-{STEPS:08d}" / "drafter")
    for name in ("ddp", "fsdp2"):
        two = read_metrics(tmp_path / name)
        assert [m["step"] for m in two] == [m["step"] for m in one], name
        for a, b in zip(one, two, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (name, a["step"])
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (name, a["step"])
            assert b["tokens_seen"] == a["tokens_seen"]  # logged globally, not rank 0's share
            assert b["acc"] == pytest.approx(a["acc"], abs=1e-9)
        # every rank counts the whole drafter for model FLOPs (FSDP2: not its shard)
        full = sum(p.numel() for p in ref_w.parameters())
        sharded = int(name == "fsdp2")
        for rank in (0, 1):
            assert (tmp_path / f"params-{name}-{rank}").read_text() == f"{full} {sharded}", (name, rank)
        # rank 0 wrote plain DFlash checkpoints (FSDP2: gathered full weights)
        assert [p.name for p in list_checkpoints(tmp_path / name)] == ["step-00000002", "step-00000004"]
        w = DFlashDrafter.from_pretrained(tmp_path / name / "checkpoints" / f"step-{STEPS:08d}" / "drafter")
        for k, v in ref_w.state_dict().items():
            torch.testing.assert_close(w.state_dict()[k], v, rtol=1e-4, atol=1e-6)
        # the resumed 2-rank run continues exactly where the uninterrupted one went
        resumed = read_metrics(tmp_path / f"{name}-resumed")
        assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
        assert [m["loss"] for m in resumed] == [m["loss"] for m in two], name


def test_distributed_backend_reaches_the_process_group(monkeypatch):
    """distributed.backend: auto is gloo on CPU (nccl on CUDA); an explicit one wins, and a non-gloo group gets
    a gloo control group beside it for the host-side flags."""
    import torch.distributed as dist

    from flashdraft.train.distributed import init_distributed

    seen: list[str] = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, rank, world_size: seen.append(backend))
    monkeypatch.setattr(dist, "new_group", lambda backend: ("group", backend))
    assert init_distributed("auto", "cpu").control is None and seen == ["gloo"]
    assert init_distributed("nccl", "cpu").control == ("group", "gloo") and seen[-1] == "nccl"
