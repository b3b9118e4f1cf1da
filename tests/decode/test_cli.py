"""`flashdraft generate` on a tiny saved target/drafter: output equals generate(), errors are one line."""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from flashdraft.cli import app
from flashdraft.decode import generate
from flashdraft.decode.cli import resolve_drafter_path
from flashdraft.target import load_target
from tests.conftest import tiny_drafter, tiny_target


def test_generate_command(tmp_path):
    t = tiny_target("llama", dtype=torch.float32, layers=4)
    t.model.save_pretrained(tmp_path / "target")
    d = tiny_drafter(t, layers=1, block_size=8)
    run_dir = tmp_path / "run"
    d.save_pretrained(run_dir / "checkpoints" / "step-00000010" / "drafter")
    d.save_pretrained(run_dir / "checkpoints" / "step-00000020" / "drafter")
    assert resolve_drafter_path(str(run_dir)).parent.name == "step-00000020"
    loaded = load_target(str(tmp_path / "target"))
    expected = generate(loaded, d.float(), [5, 6, 7, 8], max_new_tokens=12, method="ddtree", budget=4).tokens

    runner = CliRunner()
    args = ["generate", "--target", str(tmp_path / "target"), "--drafter", str(run_dir), "--prompt-ids", "5,6,7,8",
            "--max-new-tokens", "12"]  # fmt: skip
    res = runner.invoke(app, [*args, "--method", "ddtree", "--budget", "4"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().splitlines()[0] == " ".join(map(str, expected))
    assert "[ddtree-4] 12 tokens" in res.stderr and "mean τ" in res.stderr and "tok/s" in res.stderr
    res = runner.invoke(app, [*args, "--method", "chain"])
    assert res.exit_code == 0 and res.stdout.strip().splitlines()[0] == " ".join(map(str, expected))

    # errors: a CPU prefill as a CUDA graph, ddtree without a budget, a drafter made for another target, no prompt
    res = runner.invoke(app, [*args, "--method", "chain", "--graph-prefill"])
    assert res.exit_code == 2 and "--graph-prefill: only the fast engine on a CUDA target" in res.output
    res = runner.invoke(app, [*args, "--method", "chain", "--graph-prefill", "--engine", "fast"])
    assert res.exit_code == 2 and "--graph-prefill: CUDA graphs need a CUDA target" in res.output
    res = runner.invoke(app, [*args, "--method", "ddtree"])
    assert res.exit_code != 0 and "--budget" in res.output
    other = tiny_target("llama", dtype=torch.float32, layers=6)
    tiny_drafter(other, layers=1).save_pretrained(tmp_path / "other-drafter")
    args[4] = str(tmp_path / "other-drafter")
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and "error: drafter expects a 6-layer target" in res.stderr
    res = runner.invoke(app, ["generate", "--target", str(tmp_path / "target"), "--method", "ar"])
    assert res.exit_code != 0 and "--prompt" in res.output


def test_generate_refuses_unknown_engine_before_loading() -> None:
    r = CliRunner().invoke(
        app, ["generate", "--target", "/no/such/target", "--prompt", "hi", "--engine", "turbo"]
    )
    assert r.exit_code == 2 and "'turbo': use auto, fast, reference" in r.output
