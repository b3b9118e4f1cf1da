"""`evaluate(reuse=...)` / `flashdraft eval --reuse`: a drafter an earlier report scored with the same weights,
settings and references is not replayed; its results, read back from report.json, are the ones a replay gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import flashdraft.eval.evaluate as ev
from flashdraft.eval.evaluate import ReusableReport, evaluate
from flashdraft.eval.report import report_json
from tests.conftest import tiny_drafter, tiny_target

PROMPTS = [[3, 5, 7, 9], [4, 6, 8, 10, 12], [7, 7, 8], [9]]


def _setup(tmp_path: Path):  # type: ignore[no-untyped-def]
    target = tiny_target("llama")
    drafters = {"a": tiny_drafter(target, seed=1, layers=1, block_size=4)}
    drafters["b"] = tiny_drafter(target, seed=2, layers=1, block_size=4)
    paths = {}
    for name, d in drafters.items():
        d.save_pretrained(tmp_path / name)
        paths[name] = str(tmp_path / name)
    return target, drafters, paths


def _eval(target, drafters, paths, **kw):  # type: ignore[no-untyped-def]
    opts = dict(budgets=[2, 4], topk=2, max_new_tokens=10, stop_token_ids=[], progress=False, cache_dir=None,
                dataset="tiny")  # fmt: skip
    return evaluate(target, drafters, PROMPTS, drafter_paths=paths, **{**opts, **kw})


def _saved(report, path: Path) -> ReusableReport:  # type: ignore[no-untyped-def]
    path.write_text(report_json(report))
    return ReusableReport(str(path), json.loads(path.read_text()))


def _results(report, name: str) -> dict:  # type: ignore[no-untyped-def]
    d = json.loads(report_json(report))["drafters"][name]
    return {
        k: d[k] for k in ("methods", "per_sample", "slot_accuracy", "slot_accuracy_conditional", "paired")
    }


def test_reused_results_equal_a_replay_and_nothing_is_replayed(tmp_path, monkeypatch) -> None:
    target, drafters, paths = _setup(tmp_path)
    first = _eval(target, drafters, paths)
    old = _saved(first, tmp_path / "report.json")
    calls: list[int] = []
    replay = ev.replay_batch
    monkeypatch.setattr(
        ev, "replay_batch", lambda t, d, *a, **k: calls.append(id(d)) or replay(t, d, *a, **k)
    )
    again = _eval(target, drafters, paths, reuse=[old])
    assert calls == []  # neither drafter replayed
    for name in ("a", "b"):
        assert again.drafters[name].reused_from == old.path
        assert _results(again, name) == _results(first, name)  # the paired Δ of b against a too
    assert sum("results reused from" in n for n in again.notes) == 2
    # a third drafter beside them is replayed, and paired with the reused first one
    drafters["c"] = tiny_drafter(target, seed=3, layers=1, block_size=4)
    drafters["c"].save_pretrained(tmp_path / "c")
    mixed = _eval(target, drafters, {**paths, "c": str(tmp_path / "c")}, reuse=[old])
    assert calls == [id(drafters["c"])] * len(calls) and calls
    assert mixed.drafters["c"].reused_from is None and mixed.drafters["c"].paired.baseline == "a"
    assert _results(mixed, "a") == _results(first, "a")


@pytest.mark.parametrize(
    "change",
    [{"max_new_tokens": 8}, {"budgets": [2]}, {"temperature": 1.0}, {"dataset": "other"}],
    ids=["length", "methods", "sampled", "dataset"],
)
def test_other_settings_are_replayed(tmp_path, change) -> None:
    target, drafters, paths = _setup(tmp_path)
    old = _saved(_eval(target, {"a": drafters["a"]}, {"a": paths["a"]}), tmp_path / "report.json")
    got = _eval(target, {"a": drafters["a"]}, {"a": paths["a"]}, reuse=[old], **change)
    assert got.drafters["a"].reused_from is None


def test_other_weights_or_another_target_are_replayed(tmp_path) -> None:
    target, drafters, paths = _setup(tmp_path)
    old = _saved(_eval(target, {"a": drafters["a"]}, {"a": paths["a"]}), tmp_path / "report.json")
    assert (
        _eval(target, {"b": drafters["b"]}, {"b": paths["b"]}, reuse=[old]).drafters["b"].reused_from is None
    )
    other = tiny_target("llama", seed=9)
    assert (
        _eval(other, {"a": drafters["a"]}, {"a": paths["a"]}, reuse=[old]).drafters["a"].reused_from is None
    )


def test_results_made_on_other_references_are_replayed_after_all(tmp_path) -> None:
    """The settings match but the references do not (a float near-tie cut one elsewhere): replayed, and said."""
    target, drafters, paths = _setup(tmp_path)
    first = _eval(target, drafters, paths)
    old = _saved(first, tmp_path / "report.json")
    old.report["drafters"]["a"]["per_sample"][1]["tokens"] -= 1
    got = _eval(target, drafters, paths, reuse=[old])
    assert got.drafters["a"].reused_from is None and got.drafters["b"].reused_from == old.path
    assert _results(got, "a") == _results(first, "a") and _results(got, "b") == _results(first, "b")
    assert any(n.startswith("a: not reused from") and "prompt" in n for n in got.notes)
    assert got.references.checked == first.references.checked  # each reference checked once


def test_cli_reuse_errors_are_one_line(tmp_path) -> None:
    from typer.testing import CliRunner

    from flashdraft.cli import app

    target, drafters, paths = _setup(tmp_path)
    target.model.save_pretrained(tmp_path / "target")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    notreport = tmp_path / "list.json"
    notreport.write_text("[1, 2]")
    for f, msg in ((bad, "not a readable report.json"), (notreport, "not a `flashdraft eval` report")):
        res = CliRunner().invoke(app, [
            "eval", "--target", str(tmp_path / "target"), "--drafter", paths["a"], "--dataset", "humaneval",
            "--reuse", str(f), "--no-progress",
        ])  # fmt: skip
        assert res.exit_code == 2 and msg in res.output and "Traceback" not in res.output, res.output
