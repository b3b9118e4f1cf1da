"""benchmarks/gpu/recipe_screen.py on a CPU: every variant is campaign_stint.py's training phase with its overrides
last (parsed into a valid training config), a call trains what its budget holds and never retries a tried variant,
the eval puts the start first and the table pairs each variant against the first one."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashdraft.config import load_config
from flashdraft.eval.cli import drafter_names
from flashdraft.train.config import TrainConfig
from tests.test_quickstart import _parse

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / "gpu" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = mod  # dataclasses look their module up while the script is executed
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


cs = _load("campaign_stint")
rs = _load("recipe_screen")


@pytest.fixture(autouse=True)
def _gpu_folders(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STAGE", "/st")
    monkeypatch.setenv("WORK", str(tmp_path / "wk"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))


def test_each_variant_is_a_training_phase_with_its_overrides_last(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["--stint", "8", "--minutes", "2.6", "--variant", "base", "--variant", "g4=loss.gamma=4,optim.lr=3e-4",
            "--dry-run"]  # fmt: skip
    assert rs.main(argv) == 0
    cmds = json.loads(capsys.readouterr().out)
    assert list(cmds) == ["base", "g4"]
    for name, cmd in cmds.items():
        assert cmd[1].endswith("benchmarks/gpu/campaign_stint.py")
        a = cs.parse_args(cmd[2:])
        assert a.phases == "train" and a.work == str(tmp_path / "wk/stint-8/screen" / name)
        assert a.data == str(tmp_path / "wk/stint-8/data") and a.out == f"{a.work}/out"
        budget = cs.Budget.split(a.budget_min, 0.0, 0.0)
        assert budget.train == pytest.approx(2.7)  # --minutes (+0.1) after the minutes kept for shipping
        train = _parse(cs.train_args(a, Path(a.data), Path(a.work) / "train-1", a.init_from, budget.train))
        cfg = load_config(TrainConfig, train["config"], train["overrides"])
        cfg.validate()
        assert cfg.pipeline.inline_ahead == 1  # every variant's common override
        assert cfg.eval.references.endswith("benchmarks/yardstick/humaneval-164.jsonl")
        if name == "g4":
            assert (cfg.loss.gamma, cfg.optim.lr) == (4.0, 3e-4)
            assert train["overrides"][-2:] == ["loss.gamma=4", "optim.lr=3e-4"]
        else:
            assert cfg.loss.gamma is None  # the block size's default (7 for B = 16)


@pytest.mark.parametrize("spec", ["two words", "g=loss.gamma", "=loss.gamma=4"])
def test_a_bad_variant_is_a_one_line_error(spec: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert rs.main(["--stint", "8", "--variant", spec, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("recipe_screen: --variant") and err.count("\n") == 1


def _fake_training(work: Path, steps: int, ok: bool = True) -> list[str]:
    """A command that leaves what campaign_stint.py's training phase leaves (or, not ok, only its state)."""
    code = f"""
import json, pathlib
w = pathlib.Path({str(work)!r}); (w / "out").mkdir(parents=True, exist_ok=True)
(w / "state.json").write_text("{{}}")
if {ok}:
    (w / "drafter-bf16").mkdir(exist_ok=True); (w / "drafter-bf16" / "config.json").write_text("{{}}")
    (w / "out" / "stint.json").write_text(json.dumps({{"train_steps": {steps}, "val": {{"val/chain_tau": 3.9}}}}))
"""
    return [sys.executable, "-c", code]


def test_a_call_trains_what_its_budget_holds_and_never_retries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "wk/stint-8/data"
    data.mkdir(parents=True)
    (data / "manifest.json").write_text("{}")
    argv = ["--stint", "8", "--minutes", "1", "--variant", "base", "--variant", "bad=loss.gamma=4",
            "--variant", "g10=loss.gamma=10"]  # fmt: skip
    ran: list[str] = []

    def fake(self, name: str) -> list[str]:
        ran.append(name)
        return _fake_training(self.work(name), 100, ok=name != "bad")

    monkeypatch.setattr(rs.Screen, "train_command", fake)
    assert rs.main([*argv, "--budget-min", "1.9"]) == 0  # 1 + 0.6 start-up + 0.4 shipping: no room
    assert ran == [] and "base waits for the next call" in capsys.readouterr().out
    assert rs.main([*argv, "--budget-min", "9"]) == 0
    assert ran == ["base", "bad", "g10"]
    assert rs.main([*argv, "--budget-min", "9"]) == 0
    assert ran == ["base", "bad", "g10"]  # tried, the failed one too: not again


def _report(names: list[str], taus: dict[str, list[float]]) -> dict:
    """A flashdraft eval report.json with per-prompt chain τ (every drafter but the first paired against it)."""
    drafters = {}
    for n in names:
        per = [{"id": str(i), "tau": {"chain": t, "ddtree-512": t + 2}} for i, t in enumerate(taus[n])]
        mean = sum(taus[n]) / len(taus[n])
        drafters[n] = {"methods": {"chain": {"tau": mean}, "ddtree-512": {"tau": mean + 2}}, "per_sample": per,
                       "paired": None if n == names[0] else
                       {"methods": {"chain": {"delta": 0.5, "se": 0.1, "n": 4, "verdict": "better"}}}}  # fmt: skip
    return {"drafters": drafters}


def test_the_eval_scores_the_start_first_and_the_table_pairs_against_the_first_variant(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    wk = tmp_path / "wk/stint-8"
    for name in ("base", "g4", "bad"):
        (wk / "screen" / name / "out").mkdir(parents=True)
        (wk / "screen" / name / "state.json").write_text("{}")
    for name, steps in (("base", 1200), ("g4", 1150)):
        (wk / "screen" / name / "drafter-bf16").mkdir()
        (wk / "screen" / name / "drafter-bf16" / "config.json").write_text("{}")
        (wk / "screen" / name / "out" / "stint.json").write_text(
            json.dumps({"train_steps": steps, "val": {"val/chain_tau": 3.95}})
        )
    target = tmp_path / "fp32"
    target.mkdir()
    (target / "config.json").write_text("{}")
    reuse = tmp_path / "earlier/humaneval-164"
    reuse.mkdir(parents=True)
    (reuse / "report.json").write_text("{}")
    calls: list[list[str]] = []
    taus = {"start": [3.0, 3.0, 3.0, 3.0], "base/drafter-bf16": [3.1, 3.4, 3.2, 3.3],
            "g4/drafter-bf16": [3.2, 3.6, 3.2, 3.6]}  # fmt: skip

    def fake_run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
        calls.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        names = drafter_names([(Path(cmd[i + 1]), None) for i, x in enumerate(cmd) if x == "--drafter"])
        assert names[1:] == ["base/drafter-bf16", "g4/drafter-bf16"]  # as the eval names them
        names[0] = "start"
        (out / "report.json").write_text(json.dumps(_report(names, taus)))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(rs.subprocess, "run", fake_run)
    argv = ["--stint", "8", "--variant", "base", "--variant", "g4=loss.gamma=4", "--variant", "bad=x.y=1", "--eval",
            "--eval-target", str(target), "--init-from", "models/start", "--reuse", str(tmp_path / "earlier")]  # fmt: skip
    monkeypatch.setattr(rs.Screen, "train", lambda self: None)
    assert rs.main(argv) == 0
    assert len(calls) == 2  # HumanEval-164 and ShareGPT-100
    he, sg = calls
    drafters = [he[i + 1] for i, x in enumerate(he) if x == "--drafter"]
    screen = wk / "screen"
    assert drafters == ["models/start", str(screen / "base/drafter-bf16"), str(screen / "g4/drafter-bf16")]
    assert he[he.index("--reuse") + 1] == str(reuse / "report.json")
    assert "--reuse" not in sg  # no earlier ShareGPT report in that folder
    table = (tmp_path / "out/screen.md").read_text().splitlines()
    base, g4, bad = table[2:]
    assert base.startswith("| base | 1200 | 3.950 | 3.250 | 5.250 | — | +0.500 ± 0.100 better |")
    # g4 minus base per prompt: +0.1, +0.2, 0, +0.3 → mean 0.15, SE 0.0645
    assert g4.startswith("| g4 | 1150 | 3.950 | 3.400 | 5.400 | +0.150 ± 0.065 better |")
    assert bad.startswith("| bad | failed | — | — | — | — | — |")
