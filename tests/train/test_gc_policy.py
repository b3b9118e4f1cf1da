"""runtime.gc_every: automatic GC off inside the policy and restored after (exceptions too), collections at
step boundaries and after checkpoints, gc_every=0 leaves the collector alone."""

from __future__ import annotations

import gc

import pytest

from flashdraft.train.gc_policy import GCPolicy
from flashdraft.train.trainer import Trainer
from tests.train.test_trainer import make_trainer


@pytest.fixture
def collects(monkeypatch):
    """gc.collect calls, recorded instead of run: [("collect", generation), ...]."""
    events: list[tuple[str, int]] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: events.append(("collect", generation)) or 0)
    return events


@pytest.fixture
def gc_on():
    was = gc.isenabled()
    gc.enable()
    yield
    gc.enable() if was else gc.disable()


def test_policy_disables_automatic_gc_inside_and_restores_it(gc_on, collects):
    with GCPolicy(2) as p:
        assert not gc.isenabled()
        for step in range(1, 6):
            p.step(step)
        p.after_checkpoint()
    assert gc.isenabled()
    assert collects == [("collect", 1), ("collect", 1), ("collect", 2)]  # steps 2 and 4, then the checkpoint

    with pytest.raises(RuntimeError, match="boom"), GCPolicy(3):
        assert not gc.isenabled()
        raise RuntimeError("boom")
    assert gc.isenabled()

    gc.disable()  # already off: stays off
    with GCPolicy(3):
        pass
    assert not gc.isenabled()


def test_gc_every_zero_leaves_gc_alone(gc_on, collects):
    with GCPolicy(0) as p:
        assert gc.isenabled()
        for step in range(1, 10):
            p.step(step)
        p.after_checkpoint()
    assert gc.isenabled() and collects == []
    with pytest.raises(ValueError, match="must be >= 0"):
        GCPolicy(-1)


def test_trainer_collects_every_n_steps_and_after_checkpoints(tmp_path, gc_on, collects):
    def hook(_tr: Trainer, step: int) -> None:
        collects.append(("step", step))
        assert not gc.isenabled()

    tr = make_trainer(
        tmp_path, ["optim.max_steps=7", "runtime.gc_every=3", "checkpoint.every=5"], on_step_end=hook
    )
    tr.run()
    assert gc.isenabled()
    # gen 1 right after steps 3 and 6 (before the step's hooks and logging), a full collection after step 5's
    # checkpoint; none after the final one (step 7): the policy ends there
    assert collects == [
        ("step", 1), ("step", 2), ("collect", 1), ("step", 3), ("step", 4), ("step", 5), ("collect", 2),
        ("collect", 1), ("step", 6), ("step", 7),
    ]  # fmt: skip


def test_trainer_restores_gc_after_an_exception_and_gc_every_zero_leaves_it_on(tmp_path, gc_on, collects):
    def fail(_tr: Trainer, step: int) -> None:
        assert not gc.isenabled()
        if step == 2:
            raise RuntimeError("boom")

    tr = make_trainer(tmp_path, ["optim.max_steps=5", "runtime.gc_every=1"], on_step_end=fail)
    with pytest.raises(RuntimeError, match="boom"):
        tr.run()
    assert gc.isenabled()

    def still_on(_tr: Trainer, _step: int) -> None:
        assert gc.isenabled()

    collects.clear()
    tr = make_trainer(tmp_path / "b", ["optim.max_steps=4", "runtime.gc_every=0", "checkpoint.every=2"],
                      on_step_end=still_on)  # fmt: skip
    tr.run()
    assert collects == []
