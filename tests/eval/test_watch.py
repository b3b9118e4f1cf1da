"""`--watch`: a checkpoint written by a concurrent trainer (temp folder + rename) is evaluated and logged."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch

from flashdraft.drafter import DFlashDrafter
from flashdraft.eval.evaluate import evaluate
from flashdraft.eval.watch import resolve_drafter, watch
from tests.conftest import tiny_drafter, tiny_target

PROMPTS = [[3, 5, 7, 9], [4, 6, 8, 10, 12]]


def _write_checkpoint(run: Path, step: int, drafter: DFlashDrafter) -> None:
    """As training does: everything into a temp folder, then one rename."""
    root = run / "checkpoints"
    tmp = root / f".tmp-step-{step:08d}"
    drafter.save_pretrained(tmp / "drafter")
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))
    tmp.rename(root / f"step-{step:08d}")


def test_watch_picks_up_a_new_checkpoint(tmp_path: Path) -> None:
    target = tiny_target("llama")
    run = tmp_path / "run"
    _write_checkpoint(run, 10, tiny_drafter(target, seed=1))
    later = tiny_drafter(target, seed=2)
    seen: list[str] = []

    def one(folder: Path, name: str):  # type: ignore[no-untyped-def]
        seen.append(name)
        d = DFlashDrafter.from_pretrained(folder, dtype=torch.float64)
        return evaluate(
            target,
            {name: d},
            PROMPTS,
            budgets=[2, 4],
            topk=2,
            max_new_tokens=10,
            stop_token_ids=[],
            cache_dir=tmp_path / "cache",
            progress=False,
        )

    writer = threading.Thread(target=lambda: (time.sleep(1.0), _write_checkpoint(run, 20, later)))
    writer.start()
    res = watch(run, one, poll_s=0.1, max_evaluations=2, timeout_s=120)
    writer.join()
    assert res.evaluated == [10, 20] and seen == ["step-10", "step-20"]
    lines = [json.loads(x) for x in (run / "eval" / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [10, 20]
    assert set(lines[1]["tau_ddtree"]) == {"2", "4"} and lines[1]["tau_chain"] >= 1.0
    assert lines[1]["checkpoint"].endswith("step-00000020")
    assert (run / "eval" / "step-00000020.json").is_file() and (run / "eval" / "tau_over_steps.png").is_file()
    # the evaluator writes only under RUN/eval/
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "eval"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000010", "step-00000020"]
    # nothing new: a second pass evaluates nothing
    assert watch(run, one, once=True).evaluated == []
    # --drafter RUN_DIR means the newest checkpoint
    assert resolve_drafter(run) == (run / "checkpoints" / "step-00000020" / "drafter", 20)


def test_watch_skips_a_checkpoint_rotated_away(tmp_path: Path) -> None:
    import shutil

    target = tiny_target("llama")
    run = tmp_path / "run"
    _write_checkpoint(run, 5, tiny_drafter(target, seed=1))

    def one(folder: Path, name: str):  # type: ignore[no-untyped-def]
        shutil.rmtree(folder.parent)  # training's keep_last deletes it between listing and reading
        return DFlashDrafter.from_pretrained(folder)

    res = watch(run, one, once=True)
    assert res.evaluated == [] and res.skipped == [5]
    assert not (run / "eval" / "log.jsonl").exists()
