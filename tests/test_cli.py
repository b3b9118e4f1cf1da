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


def test_root_help_offers_debug():
    res = CliRunner().invoke(app, ["--help"])
    assert res.exit_code == 0 and "--debug" in res.output


def test_drafter_names_say_which_drafter(tmp_path):
    """`flashdraft eval` rows: a `drafter/` folder is named with its parent (`stage/drafter`, not `stage`),
    a run's checkpoint RUN@step-N, and two drafters never share a name (the shortest path tail that tells
    them apart; the same folder twice gets #2)."""
    from pathlib import Path

    from flashdraft.eval.cli import drafter_names

    a, b = tmp_path / "a" / "stage" / "drafter", tmp_path / "b" / "stage" / "drafter"
    ckpt = tmp_path / "runs" / "r1" / "checkpoints" / "step-00000200" / "drafter"
    other = tmp_path / "old" / "r1" / "checkpoints" / "step-00000200" / "drafter"
    z = Path("models") / "z-lab-b16"
    assert drafter_names([(a, None)]) == ["stage/drafter"]
    assert drafter_names([(a, None), (b, None), (z, None)]) == [
        "a/stage/drafter",
        "b/stage/drafter",
        "z-lab-b16",
    ]
    assert drafter_names([(ckpt, 200), (z, None)]) == ["r1@step-200", "z-lab-b16"]
    assert drafter_names([(ckpt, 200), (other, 200)]) == ["runs/r1@step-200", "old/r1@step-200"]
    assert drafter_names([(z, None), (z, None)]) == ["z-lab-b16", "z-lab-b16#2"]


def test_quickstart_prompts_report_skipped_records_in_one_line(tmp_path, capsys, caplog):
    """The quickstart's prompt file: one line with the count of skipped source records and the file listing
    them, instead of a warning per record."""
    import json
    import logging

    from flashdraft.quickstart import write_first_turns

    src = tmp_path / "chats.json"
    rows = [{"id": f"x{i}", "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(60)]
    for i in range(0, 60, 20):
        rows[i]["conversations"] = [{"from": "gpt", "value": "no user turn"}]
    src.write_text(json.dumps(rows, indent=1))
    with caplog.at_level(logging.WARNING, logger="flashdraft.data"):
        write_first_turns(tmp_path / "prompts.jsonl", 50, source=f"sharegpt:{src}")
    out = capsys.readouterr().out.splitlines()
    listing = tmp_path / "prompts.skipped.txt"
    assert out == [
        f"sharegpt:{src}: skipped 3 bad record(s) before the first 50 usable ones; listed in {listing}"
    ]
    assert caplog.text == ""
    assert len(listing.read_text().splitlines()) == 3 and "no user turn" in listing.read_text()
    assert len((tmp_path / "prompts.jsonl").read_text().splitlines()) == 50
