"""`flashdraft eval` / `flashdraft bench` end to end on a tiny saved target: report files, side-by-side
drafters, bad pairs rejected with the one-line error."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flashdraft.cli import app
from tests.conftest import tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli")
    target = tiny_target("qwen3")
    target.model.save_pretrained(root / "target")
    tiny_drafter(target, seed=1).save_pretrained(root / "d1")
    tiny_drafter(target, seed=2, layers=1).save_pretrained(root / "d2")
    tiny_drafter(tiny_target("qwen3", hidden=48), seed=1).save_pretrained(root / "wrong")
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"q{i}", "input_ids": [3 + i, 8, 13, 21]}) + "\n" for i in range(3))
    )
    return {"root": root, "target": root / "target", "prompts": prompts}


def test_eval_side_by_side_writes_reports(setup: dict[str, Path]) -> None:
    out = setup["root"] / "out"
    r = CliRunner().invoke(app, [
        "eval", "--target", str(setup["target"]), "--drafter", str(setup["root"] / "d1"),
        "--drafter", str(setup["root"] / "d2"), "--dataset", str(setup["prompts"]), "--max-new-tokens", "12",
        "--budgets", "2,4,8", "--topk", "2,4", "--dtype", "float64", "--out", str(out),
        "--cache-dir", str(setup["root"] / "cache"), "--no-progress",
    ])  # fmt: skip
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "report.json").read_text())
    assert set(rep["drafters"]) == {"d1", "d2"}
    for name in ("d1", "d2"):  # which weights were scored: a report adopted elsewhere is checked against them
        want = hashlib.sha256((setup["root"] / name / "model.safetensors").read_bytes()).hexdigest()
        assert rep["drafters"][name]["weights_sha256"] == want
    assert rep["methods"] == ["chain", "ddtree-2", "ddtree-4", "ddtree-8", "topk-2", "topk-4"]
    assert rep["max_new_tokens"] == 12 and rep["template"].startswith("token ids")
    assert rep["references"]["source"] == "local-batched"  # the default on CPU (--ref-batch 16)
    md = (out / "report.md").read_text()
    assert "| d1 |" in md and "| d2 |" in md and "top-k streak" in md
    assert "server/batched references cut at the first disagreement" in md
    # where the seconds went
    assert re.search(r"Time: .*\(\d+ computed, \d+ read\).*replays: d1 [\d.]+ s, d2 ", md)
    for png in ("report_tau.png", "report_slots.png", "report_histogram.png"):
        assert (out / png).stat().st_size > 5000
    assert "| drafter | chain | ddtree-2" in r.output


def test_eval_ref_batch(setup: dict[str, Path]) -> None:
    """--ref-batch 1 gives exact single-sequence AR references; < 1 is refused with the fix."""
    out = setup["root"] / "out-ar"
    base = [
        "eval", "--target", str(setup["target"]), "--drafter", str(setup["root"] / "d1"),
        "--dataset", str(setup["prompts"]), "--max-new-tokens", "6", "--budgets", "2", "--topk", "",
        "--dtype", "float64", "--out", str(out), "--cache-dir", str(setup["root"] / "cache"), "--no-progress",
    ]  # fmt: skip
    r = CliRunner().invoke(app, [*base, "--ref-batch", "1"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "report.json").read_text())["references"]["source"] == "local"
    r = CliRunner().invoke(app, [*base, "--ref-batch", "0"])
    assert r.exit_code == 2 and "--ref-batch 0 must be >= 1" in r.output


def test_eval_group_changes_speed_only(setup: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """--group N replays N references together (one drafter forward for all): every prompt's τ is the one it
    gets alone; < 1 is refused."""
    from flashdraft.eval import evaluate as evaluate_mod

    sizes: list[int] = []
    replay = evaluate_mod.replay_batch
    monkeypatch.setattr(evaluate_mod, "replay_batch", lambda t, d, items, *a, **k: sizes.append(len(items))
                        or replay(t, d, items, *a, **k))  # fmt: skip
    base = [
        "eval", "--target", str(setup["target"]), "--drafter", str(setup["root"] / "d1"),
        "--dataset", str(setup["prompts"]), "--max-new-tokens", "12", "--budgets", "2,8", "--topk", "2",
        "--dtype", "float64", "--cache-dir", str(setup["root"] / "cache"), "--no-progress",
    ]  # fmt: skip
    per_sample = {}
    for g in (1, 3):
        out = setup["root"] / f"out-group-{g}"
        r = CliRunner().invoke(app, [*base, "--group", str(g), "--out", str(out)])
        assert r.exit_code == 0, r.output
        rows = json.loads((out / "report.json").read_text())["drafters"]["d1"]["per_sample"]
        per_sample[g] = {s["id"]: s["tau"] for s in rows}
    assert sizes == [1, 1, 1, 3]  # the three prompts one at a time, then together
    assert len(per_sample[3]) == 3 and per_sample[3] == per_sample[1]
    r = CliRunner().invoke(app, [*base, "--group", "0", "--out", str(setup["root"] / "out-group-0")])
    assert r.exit_code == 2 and "--group 0 must be >= 1" in r.output


def test_eval_rejects_bad_pair(setup: dict[str, Path]) -> None:
    r = CliRunner().invoke(app, [
        "eval", "--target", str(setup["target"]), "--drafter", str(setup["root"] / "wrong"),
        "--dataset", str(setup["prompts"]), "--dtype", "float64", "--no-progress",
    ])  # fmt: skip
    assert r.exit_code == 2
    assert "hidden_size 48 != target hidden_size 32" in r.output
    assert len([ln for ln in r.output.splitlines() if ln.startswith("error:")]) == 1


def test_bench_reports_speed_and_identity(setup: dict[str, Path]) -> None:
    out = setup["root"] / "bench"
    r = CliRunner().invoke(app, [
        "bench", "--target", str(setup["target"]), "--drafter", str(setup["root"] / "d1"),
        "--dataset", str(setup["prompts"]), "--limit", "2", "--methods", "ar,chain,ddtree:4",
        "--max-new-tokens", "10", "--dtype", "float64", "--out", str(out), "--no-progress",
    ])  # fmt: skip
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "bench.json").read_text())
    rows = {x["method"]: x for x in rep["rows"]}
    assert list(rows) == ["ar", "chain", "ddtree:4"] and rep["engine"] == "reference"
    assert rows["ar"]["speedup"] == pytest.approx(1.0) and rows["ar"]["tau"] is None
    for m in ("chain", "ddtree:4"):
        assert (
            rows[m]["identical_to_ar"] == 2
            and rows[m]["tau"] >= 1.0
            and rows[m]["tokens"] == rows["ar"]["tokens"]
        )
    assert "speedup vs AR" in (out / "bench.md").read_text()


def test_bench_on_the_fast_engine_builds_one_engine(fast_engine_builds: list[int]) -> None:
    """Methods take turns on each prompt: AR between drafted methods must not rebuild the fast engine (each
    rebuild recaptured the CUDA graphs of every method inside the timed calls, on a GPU ~0.2 s a prompt)."""
    from flashdraft.eval.bench import bench
    from flashdraft.eval.prompts import EvalPrompt

    target = tiny_target("qwen3")
    prompts = [EvalPrompt(f"q{i}", [3 + i, 8, 13, 21], "token ids") for i in range(2)]
    rep = bench(target, tiny_drafter(target, seed=1), prompts, methods="ar,chain,ddtree:4", max_new_tokens=10,
                engine="fast", progress=False)  # fmt: skip
    assert rep.engine == "fast" and len(fast_engine_builds) == 1
    assert all(r.identical_to_ar == 2 for r in rep.rows if r.method != "ar")


def test_bench_sizes_its_engine_for_the_longest_prompt_and_rotates_the_first_method(
    fast_engine_builds: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt past the default 2,048 rows does not rebuild the engine inside the timed runs (the engine is
    built for the longest prompt in the warm-up), and each method in turn runs first on a prompt."""
    from flashdraft.decode import engine as fast
    from flashdraft.eval import bench as bench_mod
    from flashdraft.eval.prompts import EvalPrompt

    calls: list[tuple[int, str]] = []

    def recording(target, drafter, input_ids, **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append((len(input_ids), kw["method"]))
        return fast.generate(target, drafter, input_ids, **kw)

    monkeypatch.setattr(bench_mod, "pick_engine", lambda *a: ("fast", recording))
    target = tiny_target("qwen3")
    long = [3 + i % 40 for i in range(2100)]
    prompts = [
        EvalPrompt(name, ids, "ids") for name, ids in [("a", [3, 8, 13]), ("b", [4, 8, 13, 21]), ("c", long)]
    ]
    rep = bench_mod.bench(target, tiny_drafter(target, seed=1), prompts, methods="ar,chain,ddtree:4",
                          max_new_tokens=6, engine="fast", progress=False)  # fmt: skip
    assert len(fast_engine_builds) == 1 and fast._ENGINE["engine"].max_len == 2106
    timed = calls[3:]  # after the warm-up's three
    assert [m for _, m in timed[::3]] == ["ar", "chain", "ddtree"]  # the first method of each prompt
    assert [n for n, _ in timed[::3]] == [3, 4, 2100]
    assert all(r.identical_to_ar == 3 for r in rep.rows if r.method != "ar")


def test_bench_compile_runs_the_compiled_fast_engine(fast_engine_builds: list[int]) -> None:
    """`compile=True`: one fast engine with the target's and the drafter's forwards through torch.compile (float64:
    AR's tokens from every method, the report's engine "fast-compiled"); the reference engine refuses it in one
    line."""
    from flashdraft.decode import engine as fast
    from flashdraft.eval.bench import bench
    from flashdraft.eval.prompts import EvalPrompt

    target = tiny_target("llama", layers=2)
    drafter = tiny_drafter(target, layers=1, seed=1)
    prompts = [EvalPrompt("q", [3, 8, 13, 21], "token ids")]
    rep = bench(target, drafter, prompts, methods="ar,chain", max_new_tokens=8, engine="fast", compile=True,
                warmup=0, progress=False)  # fmt: skip
    eng = fast._ENGINE["engine"]
    assert len(fast_engine_builds) == 1 and eng.compile_target and eng.compile_drafter
    assert eng.native._compiled is not None and eng.ndrafter._compiled is not None
    assert rep.rows[1].identical_to_ar == 1 and rep.engine == "fast-compiled"
    with pytest.raises(ValueError, match="--compile: only the fast engine"):
        bench(target, drafter, prompts, methods="ar", engine="reference", compile=True, progress=False)


def test_bench_graph_prefill_captures_every_prompts_prefill_before_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    """`graph_prefill`: the warm-up runs each prompt once with AR and once drafted (one token), so that each
    prompt-length bucket's prefill graph is captured there, not in a timed run (the refusals: test_backend)."""
    from flashdraft.decode import engine as fast
    from flashdraft.eval import bench as bench_mod
    from flashdraft.eval.prompts import EvalPrompt

    calls: list[tuple[int, str, int]] = []

    def recording(target, drafter, input_ids, **kw):  # noqa: ANN001, ANN003, ANN202
        calls.append((len(input_ids), kw["method"], kw["max_new_tokens"]))
        return fast.generate(target, drafter, input_ids, **kw)

    seen: list[tuple] = []
    monkeypatch.setattr(bench_mod, "pick_engine", lambda *a: seen.append(a) or ("fast-graph-prefill", recording))
    target = tiny_target("qwen3")
    prompts = [EvalPrompt(name, ids, "ids") for name, ids in [("a", [3, 8, 13]), ("b", [4, 8, 13, 21, 5])]]
    rep = bench_mod.bench(target, tiny_drafter(target, seed=1), prompts, methods="ar,ddtree:4", max_new_tokens=6,
                          engine="fast", graph_prefill=True, progress=False)  # fmt: skip
    assert seen[0][-1] is True and rep.engine == "fast-graph-prefill"
    assert calls[2:4] == [(5, "ar", 1), (5, "chain", 1)]  # after each method's warm-up on the first prompt
    assert all(n == 6 for _, _, n in calls[4:])  # then only timed runs
