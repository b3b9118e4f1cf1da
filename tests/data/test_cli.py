"""`flashdraft data regenerate|inspect|sources` through the CLI, on a tiny target saved to a folder."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from flashdraft.cli import app
from tests.conftest import tiny_target
from tests.data.tokenizers import make_tokenizer


def test_regenerate_then_inspect(tmp_path):
    folder = tmp_path / "tiny"
    target = tiny_target("llama", vocab=320)
    target.model.save_pretrained(folder)
    make_tokenizer("chatml").save_pretrained(folder)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Tell me a joke number {i}."}) for i in range(6)))
    out = tmp_path / "ds"
    runner = CliRunner()
    args = [
        "data",
        "regenerate",
        "--target",
        str(folder),
        "--input",
        f"prompts:{prompts}",
        "--out",
        str(out),
        "--max-new-tokens",
        "8",
        "--block-size",
        "2",
        "--batch-size",
        "4",
        "--eval-fraction",
        "0.3",
        "--contamination",
        "none",
    ]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "wrote" in r.output and "tok/s" in r.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["train"] + m["counts"]["eval"] == 6 and m["engine"] == "loop"
    assert m["command"].startswith("flashdraft")
    assert m["filters"]["contamination"]["sources"] == ["eval_split"]  # humaneval check switched off
    r = runner.invoke(app, args)  # the dataset exists: refused, not overwritten
    assert (
        r.exit_code == 2 and r.stderr.splitlines()[-1].startswith("error: ") and "already exists" in r.stderr
    )

    r = runner.invoke(app, ["data", "inspect", str(out), "--tokenizer", str(folder)])
    assert r.exit_code == 0, r.output
    assert "length histogram" in r.output and "[[" in r.output and "Tell me a joke number" in r.output
    assert "loss tokens" in r.output
    r = runner.invoke(app, ["data", "inspect", str(out), "--tokenizer", "none"])
    assert r.exit_code == 0 and "[[" in r.output

    r = runner.invoke(app, ["data", "sources"])
    assert r.exit_code == 0 and "sharegpt" in r.output and "humaneval" in r.output


def test_regenerate_continue_from(tmp_path):
    """--continue-from (repeatable) reaches the config: turn 1 of two-turn chats whose turn 0 a first run
    answered; a folder that is no dataset is one error line naming it."""
    folder = tmp_path / "tiny"
    tiny_target("llama", vocab=320).model.save_pretrained(folder)
    make_tokenizer("chatml").save_pretrained(folder)
    chats = tmp_path / "c.jsonl"
    chats.write_text("".join(
        json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"Tell me a joke number {i}."},
                                                {"role": "user", "content": "Another one."}]}) + "\n"
        for i in range(4)
    ))  # fmt: skip
    runner = CliRunner()
    args = ["data", "regenerate", "--target", str(folder), "--input", f"messages:{chats}", "--max-new-tokens", "8",
            "--block-size", "2", "--contamination", "none"]  # fmt: skip
    r = runner.invoke(app, [*args, "--out", str(tmp_path / "first"), "--max-turns", "1"])
    assert r.exit_code == 0, r.output
    more = [*args, "--out", str(tmp_path / "second"), "--continue-from", str(tmp_path / "first")]
    r = runner.invoke(app, [*more, "--continue-from", str(tmp_path / "first")])
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "second" / "manifest.json").read_text())
    assert [c["path"] for c in m["continue_from"]] == [str(tmp_path / "first")] * 2
    counts = m["counts"]["train"] + m["counts"]["eval"]
    assert counts == 4 and "dropped" in m and not m["dropped"]
    r = runner.invoke(app, [*more[:-1], str(tmp_path / "nowhere"), "--overwrite"])
    assert r.exit_code == 2 and r.stderr.splitlines()[-1].startswith("error: --continue-from ")
    assert str(tmp_path / "nowhere") in r.stderr


def test_self_prompts_then_regenerate_reads_them(tmp_path):
    folder = tmp_path / "tiny"
    tiny_target("llama", vocab=320).model.save_pretrained(folder)
    make_tokenizer("chatml").save_pretrained(folder)
    out = tmp_path / "self.jsonl.gz"
    runner = CliRunner()
    args = ["data", "self-prompts", "--target", str(folder), "--out", str(out), "--n", "6", "--min-words", "1",
            "--max-new-tokens", "48", "--seed", "1"]  # fmt: skip
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert f"wrote {out}: " in res.stdout and "prompts kept of" in res.stdout and "round 1:" in res.stderr
    res = runner.invoke(app, args)  # an existing file: refused, untouched
    assert res.exit_code == 2 and "exists: pass --overwrite" in res.output
    res = runner.invoke(app, [*args, "--overwrite", "--temperature", "0"])
    assert res.exit_code == 2 and "use a temperature > 0" in res.output
    ds = tmp_path / "ds"
    res = runner.invoke(app, ["data", "regenerate", "--target", str(folder), "--input", f"prompts:{out}", "--out",
                              str(ds), "--max-new-tokens", "8", "--block-size", "2", "--contamination", "none"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads((ds / "manifest.json").read_text())["counts"]["train"] > 0
