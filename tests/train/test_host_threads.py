"""runtime.host_threads: the resolver (auto = 1 on CUDA, torch's count on CPU), HostThreads' set/restore (exceptions
too), and Trainer.run applying it."""

from __future__ import annotations

import pytest
import torch

from flashdraft.config import ConfigError, load_config
from flashdraft.train.config import TrainConfig
from flashdraft.train.host import HostThreads, resolve_host_threads
from flashdraft.train.trainer import Trainer
from tests.train.test_trainer import make_trainer


@pytest.fixture
def two_threads():
    """torch at 2 intra-op threads (whatever the machine's default), restored after."""
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(was)


def test_resolver():
    assert resolve_host_threads(None, "cpu") == 0  # CPU: torch's count (the CPU trains with those threads)
    assert resolve_host_threads(None, torch.device("cpu")) == 0
    assert resolve_host_threads(None, "cuda") == 1  # CUDA: the host only queues kernels, builds small tensors
    assert resolve_host_threads(None, torch.device("cuda:1")) == 1
    for device in ("cpu", "cuda:0"):
        assert [resolve_host_threads(n, device) for n in (0, 1, 4)] == [0, 1, 4]
    with pytest.raises(ValueError, match="must be >= 0"):
        resolve_host_threads(-1, "cuda")


def test_host_threads_sets_and_restores(two_threads):
    with HostThreads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="boom"), HostThreads(1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2
    with HostThreads(0):  # torch's count left alone
        assert torch.get_num_threads() == 2
    p = HostThreads(1)
    p.stop()  # unstarted: nothing to restore
    p.start()
    p.start()  # twice: still restores the count the first start found
    p.stop()
    p.stop()
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="must be >= 0"):
        HostThreads(-2)


@pytest.mark.parametrize(("value", "ok"), [("null", True), ("0", True), ("3", True), ("-1", False)])
def test_config_validates_host_threads(value, ok):
    cfg = load_config(TrainConfig, None, ["data.dataset=x", f"runtime.host_threads={value}"])
    if ok:
        cfg.validate()
        assert cfg.runtime.host_threads == (None if value == "null" else int(value))
    else:
        with pytest.raises(ConfigError, match="runtime.host_threads -1 must be >= 0"):
            cfg.validate()


def test_trainer_sets_threads_during_run_and_restores_them(tmp_path, two_threads):
    seen: list[int] = []

    def hook(_tr: Trainer, _step: int) -> None:
        seen.append(torch.get_num_threads())

    tr = make_trainer(tmp_path / "a", ["optim.max_steps=3", "runtime.host_threads=1"], on_step_end=hook)
    tr.run()
    assert seen == [1, 1, 1] and torch.get_num_threads() == 2

    seen.clear()  # unset on CPU: torch's count
    tr = make_trainer(tmp_path / "b", ["optim.max_steps=2"], on_step_end=hook)
    assert tr.cfg.runtime.host_threads is None
    tr.run()
    assert seen == [2, 2] and torch.get_num_threads() == 2


def test_trainer_restores_threads_after_an_exception(tmp_path, two_threads):
    def fail(_tr: Trainer, step: int) -> None:
        assert torch.get_num_threads() == 1
        if step == 2:
            raise RuntimeError("boom")

    tr = make_trainer(tmp_path, ["optim.max_steps=5", "runtime.host_threads=1"], on_step_end=fail)
    with pytest.raises(RuntimeError, match="boom"):
        tr.run()
    assert torch.get_num_threads() == 2
