"""optim.ema_decay: the average's arithmetic, checkpoints holding it, and exact resume with it."""

from __future__ import annotations

import json

import pytest
import torch

from flashdraft.config import ConfigError, load_config
from flashdraft.drafter import DFlashDrafter
from flashdraft.train.checkpoint import checkpoint_dir
from flashdraft.train.config import TrainConfig
from flashdraft.train.ema import WeightEMA
from tests.train.test_trainer import make_trainer


def test_average_follows_the_warmed_up_decay():
    m = torch.nn.Linear(3, 2, bias=False)
    frozen = torch.nn.Parameter(torch.ones(1), requires_grad=False)
    m.register_parameter("frozen", frozen)
    ema = WeightEMA(m, decay=0.9)
    assert ema.names == ["weight"]  # frozen parameters are not averaged
    assert [ema.decay_at(s) for s in (1, 2, 100)] == [pytest.approx(2 / 11), pytest.approx(3 / 12), 0.9]
    w0 = m.weight.detach().clone()
    expected = w0.clone()
    for step in (1, 2, 3):
        with torch.no_grad():
            m.weight.add_(1.0)
        ema.update(step)
        d = ema.decay_at(step)
        expected = d * expected + (1 - d) * m.weight.detach()
    torch.testing.assert_close(ema.state_dict()["weight"], expected)
    torch.testing.assert_close(m.weight.detach(), w0 + 3)  # the module keeps its own weights
    with pytest.raises(ValueError, match="ema_decay"):
        WeightEMA(m, decay=1.0)


def test_checkpoints_hold_the_average_and_resume_is_exact(tmp_path):
    ema = ["optim.ema_decay=0.8"]
    full = make_trainer(tmp_path / "a", ["optim.max_steps=6", "checkpoint.every=3", *ema])
    full.run()
    run = tmp_path / "a" / "run"
    saved = DFlashDrafter.from_pretrained(checkpoint_dir(run, 6) / "drafter").state_dict()
    live = full.drafter.state_dict()
    averaged = full.ema.state_dict()
    for k in live:
        assert torch.equal(saved[k], averaged[k]), k
    assert any(not torch.equal(saved[k], live[k]) for k in live)  # the average is not the trained weights
    info = json.loads((checkpoint_dir(run, 6) / "trainer_state.json").read_text())
    assert info["ema_decay"] == 0.8

    # resume from step 3 in a fresh trainer: the trained weights and the average both continue exactly
    part = make_trainer(tmp_path / "a", ["optim.max_steps=6", "checkpoint.every=3", *ema])
    part.restore(checkpoint_dir(run, 3))
    part.run()
    for k, v in live.items():
        assert torch.equal(part.drafter.state_dict()[k], v), k
        assert torch.equal(part.ema.state_dict()[k], averaged[k]), k


def test_ema_decay_out_of_range_is_a_config_error():
    cfg = load_config(TrainConfig, None, ["data.dataset=x.jsonl", "optim.ema_decay=1.5"])
    with pytest.raises(ConfigError, match="optim.ema_decay 1.5 must be in"):
        cfg.validate()
