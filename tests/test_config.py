from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from flashdraft.config import ConfigError, load_config


@dataclass
class Optim:
    lr: float = 6e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])


@dataclass
class Run:
    name: str = "run"
    steps: int = 10
    bf16: bool = True
    budget: int | None = None
    optim: Optim = field(default_factory=Optim)


def test_yaml_plus_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: x\noptim:\n  lr: 1e-3\n")
    cfg = load_config(Run, p, ["steps=20", "optim.betas=[0.8,0.9]", "bf16=false", "budget=none"])
    assert (cfg.name, cfg.steps, cfg.bf16, cfg.budget) == ("x", 20, False, None)
    assert cfg.optim.lr == 1e-3 and cfg.optim.betas == [0.8, 0.9]


@pytest.mark.parametrize(
    "text, overrides, msg",
    [("stepz: 3\n", [], "unknown config key 'stepz' \\(did you mean 'steps'"),
     ("", ["optim.lrr=1"], "unknown config key 'optim.lrr'"),
     ("steps: 2.5\n", [], "steps: expected an integer"),
     ("bf16: maybe\n", [], "bf16: expected true/false"),
     ("steps: [1\n", [], "line 2 invalid YAML"),
     ("", ["steps"], "not key=value")],
)
def test_strict_errors(tmp_path, text, overrides, msg):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=msg):
        load_config(Run, p, overrides)
