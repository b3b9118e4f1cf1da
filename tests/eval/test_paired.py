"""The paired per-prompt comparison of a report's later drafters against its first: mean Δτ, its standard error,
n and the two-SE verdict, in report.json and report.md."""

from __future__ import annotations

import json
import math

import pytest

from flashdraft.eval.evaluate import PairedMethod, evaluate, paired_comparison, paired_method
from flashdraft.eval.report import markdown_table, report_json
from tests.conftest import tiny_drafter, tiny_target
from tests.eval.test_report import _tables


def _samples(taus: dict[str, float], method: str = "chain") -> list[dict]:
    return [{"id": i, "tokens": 10, "tau": {method: t}} for i, t in taus.items()]


def test_known_mean_se_and_verdicts() -> None:
    better = paired_method([1.0, 2.0, 3.0])  # mean 2, sample sd 1, SE 1/√3
    assert better.n == 3 and better.delta == 2.0 and better.se == pytest.approx(1 / math.sqrt(3))
    assert better.verdict == "better"
    worse = paired_method([-0.5, -0.7, -0.6, -0.6])  # mean −0.6, SE ≈ 0.041
    assert worse.verdict == "worse" and worse.delta == pytest.approx(-0.6)
    # mean 0.5, sd √((0.25·2 + 2.25 + 2.25)/3) = √(5/3), SE = √(5/12) ≈ 0.645 > 0.25: within two SE
    assert paired_method([1.0, 0.0, 2.0, -1.0]).verdict == "neither"
    assert paired_method([0.0, 0.0, 0.0]) == PairedMethod(0.0, 0.0, 3, "neither")  # the same drafter twice
    assert paired_method([0.25, 0.25]) == PairedMethod(0.25, 0.0, 2, "better")  # SE 0, a real gain


def test_fewer_than_two_prompts_give_no_verdict() -> None:
    assert paired_method([]) == PairedMethod(None, None, 0, None)
    assert paired_method([0.7]) == PairedMethod(0.7, None, 1, None)


def test_only_the_prompts_both_ran_are_paired() -> None:
    base = _samples({"a": 2.0, "b": 3.0, "c": 1.0})
    other = _samples({"b": 4.0, "c": 3.0, "d": 9.0})  # d: the baseline has none; a: the other has none
    p = paired_comparison("old", base, other, ["chain", "ddtree-8"])
    assert p.baseline == "old"
    chain = p.methods["chain"]  # Δ = 1.0 and 2.0: mean 1.5, sd √0.5, SE 0.5; 1.5 ≥ 1.0
    assert (chain.n, chain.delta, chain.se, chain.verdict) == (2, 1.5, pytest.approx(0.5), "better")
    assert p.methods["ddtree-8"] == PairedMethod(None, None, 0, None)  # no prompt has that method


def test_evaluate_pairs_every_later_drafter_with_the_first() -> None:
    target = tiny_target("llama")
    a = tiny_drafter(target, seed=1, layers=1, block_size=4)
    b = tiny_drafter(target, seed=2, layers=1, block_size=4)
    report = evaluate(
        target, {"a": a, "b": b, "a-again": a}, [[3, 5, 7, 9], [4, 6, 8, 10, 12], [7, 7, 8]], budgets=[2],
        topk=2, max_new_tokens=10, stop_token_ids=[], progress=False, cache_dir=None,
    )  # fmt: skip
    assert report.drafters["a"].paired is None
    same = report.drafters["a-again"].paired
    assert same is not None and same.baseline == "a"
    assert {m: (p.delta, p.n, p.verdict) for m, p in same.methods.items()} == {
        m: (0.0, 3, "neither") for m in report.methods
    }
    pb = report.drafters["b"].paired
    base = {s["id"]: s["tau"] for s in report.drafters["a"].per_sample}
    for m in report.methods:
        deltas = [s["tau"][m] - base[s["id"]][m] for s in report.drafters["b"].per_sample]
        assert pb.methods[m].delta == pytest.approx(sum(deltas) / 3) and pb.methods[m].n == 3
    d = json.loads(report_json(report))
    assert d["drafters"]["a"]["paired"] is None
    assert d["drafters"]["b"]["paired"]["baseline"] == "a"
    assert set(d["drafters"]["b"]["paired"]["methods"]["chain"]) == {"delta", "se", "n", "verdict"}
    md = markdown_table(report)
    assert "Paired per prompt against a:" in md
    table = next(t for t in _tables(md) if t[0][:2] == ["drafter", "n"])
    assert {len(row) for row in table} == {len(table[0])} and table[0][2:] == report.methods
    assert [row[:2] for row in table[2:]] == [["b", "3"], ["a-again", "3"]]
    assert table[3][2] == "+0.00 ± 0.00"  # neither: no verdict word


def test_one_drafter_has_no_paired_table() -> None:
    target = tiny_target("llama")
    report = evaluate(
        target, {"a": tiny_drafter(target, layers=1, block_size=4)}, [[3, 5, 7, 9]], budgets=[2], topk=2,
        max_new_tokens=6, stop_token_ids=[], progress=False, cache_dir=None,
    )  # fmt: skip
    assert "Paired" not in markdown_table(report)
