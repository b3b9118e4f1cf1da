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
