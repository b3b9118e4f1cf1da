"""Every `flashdraft` command answers --help (without loading a model)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flashdraft.cli import app

COMMANDS = [
    [], ["info"], ["quickstart"], ["generate"], ["eval"], ["bench"], ["train"], ["serve"], ["export"],
    ["data"], ["data", "regenerate"], ["data", "inspect"], ["features"], ["features", "dump"],
    ["runs"], ["runs", "list"], ["runs", "status"], ["runs", "archive"],
]  # fmt: skip


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "flashdraft")
def test_help(cmd):
    res = CliRunner().invoke(app, [*cmd, "--help"])
    assert res.exit_code == 0, res.output
    assert "Usage" in res.output
