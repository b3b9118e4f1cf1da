"""`regenerate --continue-from`: later turns of conversations whose first turns an earlier dataset answered,
given those answers as history — the same samples as one run answering every turn (greedy, tiny target)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flashdraft.data.dataset import open_dataset, write_dataset
from flashdraft.data.generate import GenerationParams, LocalGenerator
from flashdraft.data.regenerate import RegenConfig, RegenError, regenerate
from flashdraft.data.template import ChatTemplate
from tests.conftest import tiny_target
from tests.data.tokenizers import make_tokenizer

VOCAB = 320
# user turns per conversation; c3 has a system prompt; c4 is in the eval split (0.3)
TURNS = {"c0": 5, "c1": 2, "c2": 1, "c3": 4, "c4": 3, "c5": 4}


def _conv(cid: str, n: int, *, system: str | None = None, change: int | None = None) -> dict:
    msgs = [{"role": "system", "content": system}] if system else []
    for k in range(n):
        user = f"Question {k} of chat {cid}: tell me a story." + (" (another)" if k == change else "")
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": "old"}]
    return {"id": cid, "messages": msgs}


def _write(path, convs: list[dict]) -> str:
    path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return f"messages:{path}"


def _inputs(tmp_path) -> str:
    return _write(
        tmp_path / "in.jsonl",
        [_conv(c, n, system="Be brief." if c == "c3" else None) for c, n in TURNS.items()],
    )


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab=VOCAB)


@pytest.fixture(scope="module")
def tpl():
    return ChatTemplate(make_tokenizer("chatml"))


def _run(
    tmp_path, target, tpl, out: str, max_turns: int, inputs: str | None = None, engine: str = "loop", **kw
):
    params = GenerationParams(max_new_tokens=6, temperature=0.0, stop_ids=tpl.stop_ids)
    overwrite = kw.pop("overwrite", False)
    cfg = RegenConfig(
        inputs=[inputs or _inputs(tmp_path)], out=str(tmp_path / out), target="tiny", max_new_tokens=6,
        shard_size=4, block_size=1, eval_fraction=kw.pop("eval_fraction", 0.3), split_turns=True,
        max_turns=max_turns, contamination_sources=[],
        continue_from=[str(tmp_path / d) for d in kw.pop("continue_from", [])], **kw,
    )  # fmt: skip
    return regenerate(
        cfg, tpl, LocalGenerator(target, params, engine=engine, batch_size=3), overwrite=overwrite
    )


def _dump(path) -> dict:
    """sample id -> (split, input_ids, loss_mask, meta), both splits."""
    return {
        s.id: (split, s.input_ids.tolist(), s.loss_mask.tolist(), s.meta)
        for split in ("train", "eval")
        for s in open_dataset(path, split)
    }


@pytest.mark.parametrize("engine", ["loop", "native"])
def test_continued_turns_equal_one_run_of_every_turn(tmp_path, target, tpl, engine):
    """Turns 0-1 (A), then 2-3 continuing A (B), then 4 continuing A and B (D): every sample of B and D is
    the sample of one run of turns 0-4 (C) of that turn, token for token, meta and split included."""
    a = _run(tmp_path, target, tpl, "A", 2, engine=engine)
    b = _run(tmp_path, target, tpl, "B", 4, engine=engine, continue_from=["A"])
    d = _run(tmp_path, target, tpl, "D", 5, engine=engine, continue_from=["A", "B"])
    _run(tmp_path, target, tpl, "C", 5, engine=engine)
    A, B, C, D = (_dump(tmp_path / x) for x in "ABCD")
    assert "dropped" not in a.manifest or not a.manifest["dropped"]  # every turn's sample kept: no gaps
    assert {s[3]["conversation_id"] for s in C.values()} == {f"messages/{c}" for c in TURNS}
    want = {k: v for k, v in C.items() if 2 <= v[3]["turns"][0] < 4}
    assert (
        sorted(B)
        == sorted(want)
        == sorted(f"messages/{c}#t{t}" for c, n in TURNS.items() for t in range(2, min(n, 4)))
    )
    assert B == want
    assert D == {k: v for k, v in C.items() if v[3]["turns"][0] == 4} and list(D) == ["messages/c0#t4"]
    assert A == {k: v for k, v in C.items() if v[3]["turns"][0] < 2}
    assert {v[0] for v in B.values()} == {"train", "eval"}  # histories read from both splits
    # the history is prompt: B's first loss token comes after the whole of A's sample of that turn
    t1, t2 = C["messages/c0#t1"], B["messages/c0#t2"]
    assert t2[1][: len(t1[1])] == t1[1] and not any(t2[2][: len(t1[1])])
    assert t2[3]["turns"] == [2, 3] and [m["content"] for m in t2[3]["prompt"]][-1].startswith("Question 2 ")
    assert b.manifest["dropped"] == {"continue_nothing_left": 2}  # c2 (1 turn), c1 (2 turns)
    assert d.manifest["dropped"] == {"continue_nothing_left": 5}
    assert b.manifest["continue_from"][0]["path"] == str(tmp_path / "A")
    assert "continue_from" not in b.manifest["generation"]


def test_history_mismatch_absent_gap_and_nothing_left_are_counted(tmp_path, target, tpl):
    _run(tmp_path, target, tpl, "A", 2)
    A = _dump(tmp_path / "A")
    # A without c5's turn 0 (as if dropped there): c5's history has a gap
    kept = [
        s
        for split in ("train", "eval")
        for s in open_dataset(tmp_path / "A", split)
        if s.id != "messages/c5#t0"
    ]
    m = json.loads((tmp_path / "A" / "manifest.json").read_text())
    write_dataset(
        kept, tmp_path / "A2", manifest_extra={"target": "tiny", "template": m["template"]}, eval_fraction=0.3,
        contamination_sources=[],
    )  # fmt: skip
    assert len(_dump(tmp_path / "A2")) == len(A) - 1
    convs = [
        _conv("c0", 5, change=1),  # turn 1's user text is not A's
        _conv("c1", 3),  # continued
        _conv("c2", 1),  # nothing left
        _conv("c3", 4, system="Be long."),  # another system prompt
        _conv("c5", 4),  # gap
        _conv("new", 3),  # absent from A
    ]
    res = _run(
        tmp_path, target, tpl, "B", 4, inputs=_write(tmp_path / "b.jsonl", convs), continue_from=["A2"]
    )
    assert res.manifest["dropped"] == {
        "continue_history_mismatch": 2, "continue_nothing_left": 1, "continue_history_gap": 1,
        "continue_no_history": 1,
    }  # fmt: skip
    assert sorted(_dump(tmp_path / "B")) == ["messages/c1#t2"]
    with pytest.raises(RegenError, match=r"no usable conversations .*'continue_no_history': 1"):
        _run(
            tmp_path,
            target,
            tpl,
            "E",
            4,
            inputs=_write(tmp_path / "e.jsonl", [_conv("new", 3)]),
            continue_from=["A"],
        )


def test_continue_from_errors_and_fingerprint(tmp_path, target, tpl):
    with pytest.raises(RegenError, match=rf"--continue-from {tmp_path / 'nowhere'}: .*no manifest"):
        _run(tmp_path, target, tpl, "B", 4, continue_from=["nowhere"])
    _run(tmp_path, target, tpl, "A", 2)
    with pytest.raises(RegenError, match="--eval-fraction 0.3"):
        _run(tmp_path, target, tpl, "B", 4, continue_from=["A"], eval_fraction=0.1)
    assert not (tmp_path / "B.partial").exists() and not (tmp_path / "B").exists()
    cfg = RegenConfig(inputs=["x"], out="y", continue_from=[str(tmp_path / "A")])
    fp = cfg.fingerprint(tpl)["continue_from"]
    assert "continue_from" not in RegenConfig(inputs=["x"], out="y").fingerprint(tpl)
    _run(tmp_path, target, tpl, "A", 1, overwrite=True)  # rewritten: other histories, another fingerprint
    assert cfg.fingerprint(tpl)["continue_from"] != fp


def test_split_turns_of_a_continued_sample_lists_the_history_prompts():
    from flashdraft.data.dataset import Sample
    from flashdraft.data.regenerate import split_by_turn

    users = [{"role": "user", "content": f"u{k}"} for k in range(4)]
    meta = {"conversation_id": "c", "turns": [2, 4], "prompt": users, "finish": ["stop", "length"]}
    mask = np.array([0, 0, 1, 0, 1, 1], bool)
    parts = split_by_turn(Sample("c#t2", np.arange(6), mask, meta))
    assert [p.id for p in parts] == ["c#t2", "c#t3"]
    assert [p.meta["prompt"] for p in parts] == [users[:3], users[:4]]
    assert [p.meta["turns"] for p in parts] == [[2, 3], [3, 4]] and parts[1].meta["finish"] == ["length"]


def test_continue_turns_script_counts_what_a_continuation_would_answer(tmp_path, target, tpl, monkeypatch, capsys):
    """benchmarks/continue_turns.py: the conversations and turns `--continue-from` would take, before a GPU runs."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "continue_turns.py"
    spec = importlib.util.spec_from_file_location("continue_turns", path)
    ct = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(ct)  # type: ignore[union-attr]
    _run(tmp_path, target, tpl, "A", 2)
    monkeypatch.setattr(ct, "load_tokenizer", lambda _: make_tokenizer("chatml"))
    ct.main(["--input", _inputs(tmp_path), "--max-turns", "4", str(tmp_path / "A")])
    # c0 (5 turns, cut to 4), c3, c4, c5 have 2, 2, 1, 2 turns after A's two; c1 and c2 have none left
    assert capsys.readouterr().out.strip() == (
        "6 conversations read; 4 continued, 7 user turns to answer; skipped {'continue_nothing_left': 2}"
    )
