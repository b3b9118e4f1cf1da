"""`flashdraft serve` / `flashdraft export` command wiring (the server itself is tested in test_server.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flashdraft.cli import app
from tests.conftest import tiny_drafter, tiny_target

runner = CliRunner()


def test_serve_and_export_are_registered() -> None:
    r = runner.invoke(app, ["serve", "--help"])
    assert r.exit_code == 0
    for opt in (
        "--target",
        "--drafter",
        "--method",
        "--budget",
        "--host",
        "--port",
        "--api-key",
        "--max-queue",
        "--timeout",
        "--max-body-bytes",
        "--device",
        "--dtype",
    ):
        assert opt in r.output, opt
    r = runner.invoke(app, ["export", "--help"])
    assert r.exit_code == 0 and "--to" in r.output and "--dtype" in r.output


def test_serve_refuses_unknown_method_before_loading() -> None:
    r = runner.invoke(app, ["serve", "--method", "beam"])
    assert r.exit_code != 0 and "method 'beam' is unknown" in r.output


def test_export_command(tmp_path: Path) -> None:
    from tests.serve.test_export import tiny_tokenizer

    target = tiny_target("llama", dtype=torch.float32)
    tiny_drafter(target, block_size=16).float().save_pretrained(tmp_path / "src")
    tok = str(tiny_tokenizer(tmp_path / "tok"))
    args = ["export", str(tmp_path / "src"), "--to", str(tmp_path / "out"), "--target", tok]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "identical at bfloat16" in r.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    r = runner.invoke(app, args)  # the folder now holds the export: one line, nothing replaced
    assert r.exit_code != 0 and "is not empty: pass --overwrite" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, [*args, "--overwrite"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(
        app, ["export", str(tmp_path / "src"), "--to", str(tmp_path), "--overwrite", "--target", tok]
    )
    assert (
        r.exit_code != 0
        and "contains the source" in r.output
        and (tmp_path / "src" / "config.json").is_file()
    )
    r = runner.invoke(app, ["export", str(tmp_path / "nothing"), "--to", str(tmp_path / "o2")])
    assert r.exit_code != 0 and "no such folder" in r.output


def test_shipped_drafter_is_the_default_only_when_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flashdraft import target
    from flashdraft.serve import server

    shipped = tmp_path / "repo" / "models" / "smollm2-135m-instruct-dflash-b16"
    monkeypatch.setattr(target, "SHIPPED_ROOT", tmp_path / "repo")
    monkeypatch.chdir(tmp_path)
    assert server.resolve_drafter(None) is None  # nothing shipped: plain AR
    assert server.resolve_drafter("none") is None and server.resolve_drafter("x/d") == "x/d"
    shipped.mkdir(parents=True)
    (shipped / "config.json").write_text("{}")
    assert server.resolve_drafter(None) == str(shipped)
    assert server.resolve_drafter(None, target="some/other-model") is None  # it only fits the default target
    assert server.model_id_for("default") == "smollm2-135m-instruct"
    assert server.model_id_for("/m/Qwen3-8B/") == "Qwen3-8B" and server.model_id_for("a/b.gguf") == "b"


def test_serve_graph_prefill_needs_a_cuda_target(tmp_path: Path) -> None:
    t = tiny_target("llama", dtype=torch.float32)
    t.model.save_pretrained(tmp_path / "target")
    r = runner.invoke(app, ["serve", "--target", str(tmp_path / "target"), "--drafter", "none", "--graph-prefill"])
    assert r.exit_code == 2 and "--graph-prefill: only the fast engine on a CUDA target" in r.output


def test_serve_refuses_unknown_engine_before_loading() -> None:
    r = runner.invoke(app, ["serve", "--engine", "turbo"])
    assert r.exit_code != 0 and "--engine 'turbo': use auto, fast, reference" in r.output
