"""Every `flashdraft` command answers a bad input with one line, `error: ...`, and a non-zero exit (no
traceback); `--debug` / FLASHDRAFT_DEBUG=1 show the traceback; a bug keeps its traceback."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from flashdraft.cli import app
from flashdraft.data.dataset import DatasetError, Sample, write_dataset
from flashdraft.errors import UserError, is_expected, one_line
from tests.conftest import tiny_drafter, tiny_target
from tests.data.tokenizers import make_tokenizer

VOCAB = 320


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("errors")
    t = tiny_target("llama", dtype=torch.float32, vocab=VOCAB, layers=4)
    t.model.save_pretrained(root / "target")
    make_tokenizer("chatml").save_pretrained(root / "target")
    d = tiny_drafter(t, layers=1, block_size=8)
    d.save_pretrained(root / "good" / "drafter")
    d.save_pretrained(root / "truncated" / "drafter")
    st = root / "truncated" / "drafter" / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    for name in ("ds", "ds-bad"):
        samples = [
            Sample(f"{name}{i}", np.arange(3 + i, 40 + i, dtype=np.int32), np.r_[np.zeros(5, bool), np.ones(32, bool)],
                   {"conversation_id": f"c{i}"})
            for i in range(8)
        ]  # fmt: skip
        write_dataset(samples, root / name, contamination_sources=[], eval_fraction=0.25,
                      manifest_extra={"target": str(root / "target"), "template": {}})  # fmt: skip
    shard = next((root / "ds-bad" / "train").glob("*.parquet"))
    shard.write_bytes(shard.read_bytes()[:100])
    (root / "binary.yaml").write_bytes(b"\xff\xfe\x00 not yaml \x80\x81")
    run = root / "runs" / "broken"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_bytes(b"\x00\xff\xfe garbage\n")
    return {
        "root": root, "target": root / "target", "good": root / "good" / "drafter",
        "truncated": root / "truncated" / "drafter", "st": st, "ds": root / "ds", "ds-bad": root / "ds-bad",
        "shard": shard, "binary": root / "binary.yaml", "runs": root / "runs", "run": run,
    }  # fmt: skip


def one_error(args: list[str], code: int | None = 2, **env: str) -> str:
    """Run `flashdraft ARGS`; assert it failed with one `error:` line (stderr's last line) and no traceback."""
    r = CliRunner().invoke(app, args, env=env or None)
    assert isinstance(r.exception, SystemExit), (r.exception, r.output)  # nothing escaped the handler
    assert r.exit_code != 0 and (code is None or r.exit_code == code), r.output
    assert "Traceback" not in r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and r.stderr.rstrip().splitlines()[-1] == errors[0], r.stderr
    return errors[0]


def test_info(files: dict[str, Path]) -> None:
    msg = one_error(["info", "--target", str(files["root"] / "no-such-target")])
    assert "no-such-target" in msg and "the path does not exist" in msg and "Repo id" not in msg
    msg = one_error(["info", "--target", str(files["target"]), "--drafter", str(files["truncated"])])
    assert str(files["st"]) in msg and "truncated or corrupt" in msg


def test_generate(files: dict[str, Path]) -> None:
    base = ["generate", "--target", str(files["target"]), "--drafter", str(files["good"])]
    msg = one_error([*base, "--prompt-ids", f"5,{VOCAB}"])  # the server answers the same with a 400
    assert f"prompt token id {VOCAB} is outside the vocabulary (0..{VOCAB - 1})" in msg
    msg = one_error([*base, "--prompt-ids", "-1"])
    assert "prompt token id -1 is outside" in msg
    msg = one_error(["generate", "--target", "./missing/model", "--method", "ar", "--prompt-ids", "5"])
    assert "'./missing/model': the path does not exist" in msg
    msg = one_error(["generate", "--target", str(files["target"]), "--drafter", str(files["truncated"]),
                     "--prompt-ids", "5"])  # fmt: skip
    assert str(files["st"]) in msg
    msg = one_error([*base, "--method", "beam", "--prompt-ids", "5"])  # a usage error is one line too
    assert "unknown method 'beam'" in msg and "flashdraft generate --help" in msg


def test_eval_and_bench(files: dict[str, Path]) -> None:
    msg = one_error(["eval", "--target", str(files["target"]), "--drafter", str(files["truncated"])])
    assert str(files["st"]) in msg
    msg = one_error(["eval", "--target", str(files["target"]), "--drafter", str(files["root"] / "nothing")])
    assert "nothing" in msg
    msg = one_error(["bench", "--target", str(files["target"]), "--drafter", str(files["truncated"])])
    assert str(files["st"]) in msg


def test_serve_and_export(files: dict[str, Path]) -> None:
    msg = one_error(["serve", "--target", str(files["target"]), "--drafter", str(files["truncated"])])
    assert str(files["st"]) in msg and "Invalid value" not in msg
    msg = one_error(["export", str(files["truncated"]), "--to", str(files["root"] / "exported")])
    assert str(files["st"]) in msg
    assert not (files["root"] / "exported").exists()


def test_data_commands(files: dict[str, Path]) -> None:
    msg = one_error(["data", "inspect", str(files["ds-bad"]), "--tokenizer", "none"])
    assert str(files["shard"]) in msg and "truncated or corrupt" in msg
    msg = one_error(["data", "merge", str(files["ds"]), str(files["ds-bad"]), "--out", str(files["root"] / "m"),
                     "--contamination", "none"])  # fmt: skip
    assert str(files["shard"]) in msg and not (files["root"] / "m").exists()
    msg = one_error(["data", "inspect", str(files["binary"])])
    assert "no manifest" in msg
    out = files["root"] / "regen"
    msg = one_error(["data", "regenerate", "--target", str(files["target"]), "--input",
                     f"messages:{files['root'] / 'missing.jsonl'}", "--out", str(out)])  # fmt: skip
    assert "missing.jsonl" in msg
    assert not out.exists() and not out.with_name("regen.partial").exists()


def test_regenerate_with_nothing_usable_fails(files: dict[str, Path]) -> None:
    """Every prompt is longer than --max-length: one line with the drop counts; nothing written."""
    prompts = files["root"] / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"Tell me a joke number {i}."}) + "\n" for i in range(4))
    )
    out = files["root"] / "regen-short"
    msg = one_error(["data", "regenerate", "--target", str(files["target"]), "--input", f"prompts:{prompts}",
                     "--out", str(out), "--max-length", "8", "--block-size", "2", "--contamination", "none"])  # fmt: skip
    assert "nothing usable remains of 4 conversations" in msg and "'conversation_over_max_length': 4" in msg
    assert not out.exists() and not out.with_name("regen-short.partial").exists()
    msg = one_error(["data", "regenerate", "--target", str(files["target"]), "--input", f"prompts:{prompts}",
                     "--out", str(out), "--engine", "native", "--attention", "varlen"])  # fmt: skip
    assert "--attention varlen: needs CUDA (device cpu)" in msg
    assert not out.exists() and not out.with_name("regen-short.partial").exists()


def test_features_dump(files: dict[str, Path]) -> None:
    msg = one_error(["features", "dump", "--target", str(files["target"]), "--dataset", str(files["ds-bad"]),
                     "--out", str(files["root"] / "feats"), "--device", "cpu", "--layers", "1"], code=None)  # fmt: skip
    assert str(files["shard"]) in msg
    msg = one_error(["features", "dump", "--target", str(files["target"]), "--dataset", str(files["ds"]),
                     "--out", str(files["root"] / "feats"), "--device", "cpu", "--target-dtype", "fp8"])  # fmt: skip
    assert "--target-dtype 'fp8': use one of" in msg


@pytest.mark.parametrize(
    "override, field",
    [("optim.lr=nan", "optim.lr"), ("optim.lr=inf", "optim.lr"), ("optim.lr=-inf", "optim.lr"),
     ("optim.grad_clip=.nan", "optim.grad_clip"), ("loss.gamma=1e999", "loss.gamma"),
     ("runtime.device=tpu", "runtime.device"), ("runtime.device=cuda:x", "runtime.device"),
     ("runtime.target_device=tpu:0", "runtime.target_device")],
)  # fmt: skip
def test_train_config_validation(override: str, field: str) -> None:
    msg = one_error(["train", "configs/smollm2-b16.yaml", override, "data.dataset=/nonexistent"], code=None)
    assert field in msg


def test_train_binary_yaml(files: dict[str, Path]) -> None:
    msg = one_error(["train", str(files["binary"])], code=None)
    assert f"{files['binary']}: not a text YAML file" in msg


def test_train_corrupt_dataset(files: dict[str, Path]) -> None:
    msg = one_error(["train", "configs/smollm2-b16.yaml", f"data.dataset={files['ds-bad']}",
                     f"model.target={files['target']}", "runtime.device=cpu",
                     f"run_dir={files['root'] / 'run-bad-data'}"], code=None)  # fmt: skip
    assert str(files["shard"]) in msg


def test_runs(files: dict[str, Path]) -> None:
    msg = one_error(["runs", "status", str(files["run"])])
    assert "should be UTF-8 text" in msg
    one_error(["runs", "archive", str(files["root"] / "no-run")], code=None)
    assert "no such folder" in one_error(["runs", "list", str(files["root"] / "no-runs-here")])
    r = CliRunner().invoke(app, ["runs", "list", str(files["runs"])])  # a broken run is a line, not a failure
    assert (
        r.exit_code == 0 and "broken" in r.output and "unreadable" in r.output and "Traceback" not in r.output
    )


def test_quickstart() -> None:
    msg = one_error(["quickstart", "--preset", "tiny"])
    assert "'tiny': use one of" in msg


def test_debug_shows_the_traceback(files: dict[str, Path]) -> None:
    args = ["data", "inspect", str(files["ds-bad"]), "--tokenizer", "none"]
    r = CliRunner().invoke(app, ["--debug", *args])
    assert isinstance(r.exception, DatasetError)  # re-raised: the traceback is printed by Python
    r = CliRunner().invoke(app, args, env={"FLASHDRAFT_DEBUG": "1"})
    assert isinstance(r.exception, DatasetError)


def test_a_bug_keeps_its_traceback(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import flashdraft.data.inspect as inspect_mod

    def buggy(*a: object, **k: object) -> str:
        return {}["missing"]  # a KeyError: not an expected failure

    monkeypatch.setattr(inspect_mod, "inspect_dataset", buggy)
    r = CliRunner().invoke(app, ["data", "inspect", str(files["ds"])])
    assert isinstance(r.exception, KeyError)


def test_which_errors_are_expected() -> None:
    from flashdraft.eval.bench import parse_methods

    def caught(fn) -> BaseException:  # type: ignore[no-untyped-def]
        try:
            fn()
        except Exception as e:
            return e
        raise AssertionError("no exception")

    assert is_expected(
        caught(lambda: parse_methods("beam"))
    )  # a message flashdraft wrote: `raise ValueError`
    # a builtin's ValueError inside flashdraft code ("²".isdigit() but int("²") fails): a bug, traceback kept
    assert not is_expected(caught(lambda: parse_methods("ddtree:²")))
    assert not is_expected(caught(lambda: torch.zeros(2) @ torch.zeros(3)))  # from inside torch
    assert not is_expected(ValueError("raised nowhere"))
    assert is_expected(UserError("x")) and is_expected(FileNotFoundError(2, "No such file", "/x"))
    assert (
        one_line(FileNotFoundError(2, "No such file or directory", "/x/y"))
        == "/x/y: No such file or directory"
    )
    assert one_line(UserError("first\n  second")) == "first second"


def test_truncated_target_weights(files: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    bad = tmp_path / "target"
    shutil.copytree(files["target"], bad)
    st = bad / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    msg = one_error(["generate", "--target", str(bad), "--method", "ar", "--prompt-ids", "5"])
    assert str(bad) in msg and "truncated or corrupt" in msg
