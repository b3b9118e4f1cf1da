"""Prompts the target writes itself: the prefix it continues, what is kept, the file regeneration reads."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from flashdraft.data.generate import GenerationParams, LocalGenerator
from flashdraft.data.loop import Generation
from flashdraft.data.self_prompts import self_prompts, user_prefix
from flashdraft.data.sources import load_conversations, write_prompts
from flashdraft.data.template import ChatTemplate
from tests.conftest import tiny_target
from tests.data.tokenizers import make_tokenizer


class Scripted:
    """A generator that answers round r with the texts of script[r] (None: a message cut by max_new_tokens)."""

    def __init__(self, tpl: ChatTemplate, script: list[list[str | None]]) -> None:
        self.tpl, self.script, self.calls = tpl, script, []

    def generate(self, prompts: list[list[int]], seed: int) -> list[Generation]:
        self.calls.append((prompts, seed))
        texts = self.script[len(self.calls) - 1]
        assert len(texts) >= len(prompts)
        stop = self.tpl.stop_ids[0]
        return [
            Generation(self.tpl.encode("cut off here"), "length") if t is None else Generation([*self.tpl.encode(t), stop], "stop")
            for t in texts[: len(prompts)]
        ]  # fmt: skip


def test_the_prefix_is_the_template_up_to_a_users_message() -> None:
    tpl = ChatTemplate(make_tokenizer("chatml"))
    prefix = user_prefix(tpl)
    assert prefix == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n"
    )
    assert user_prefix(ChatTemplate(make_tokenizer("llama3"))).endswith("<|start_header_id|>user<|end_header_id|>\n\n")


def test_kept_messages_ended_their_turn_are_long_enough_clean_and_distinct() -> None:
    tpl = ChatTemplate(make_tokenizer("chatml"))
    first = ["How do I sort a list in place?", None, "Hi there", "how do  I sort a list in PLACE?",
             "Tell me a joke <|im_start|>user about cats"]  # fmt: skip
    second = ["Why is the sky blue today?", "What is a good name for a cat?", "Explain recursion to a child, please.",
              "extra one never kept ok"]  # fmt: skip
    gen = Scripted(tpl, [first, second])
    got, stats = self_prompts(tpl, gen, 4, seed=3)
    assert [p["prompt"] for p in got] == ["How do I sort a list in place?", "Why is the sky blue today?",
                                          "What is a good name for a cat?", "Explain recursion to a child, please."]  # fmt: skip
    assert stats.dropped == {"unfinished": 1, "too_few_words": 1, "duplicate": 1, "template_marker": 1, "beyond_n": 1}
    assert stats.asked == 5 + 4 and stats.kept == 4
    # round r asks 1.25x the missing ones, each with its own seed; every row is the prefix
    assert [(len(p), s) for p, s in gen.calls] == [(5, 3000), (4, 3001)]
    assert all(row == tpl.encode(user_prefix(tpl)) for row in gen.calls[0][0])
    assert got[0]["id"].startswith("self-") and len({p["id"] for p in got}) == 4


def test_openings_start_the_rows_messages_in_turn() -> None:
    tpl = ChatTemplate(make_tokenizer("chatml"))
    gen = Scripted(tpl, [[" sorts a list.", " is the sky blue?", " reverses a string.", " do birds sing?"]])
    got, _ = self_prompts(tpl, gen, 3, seed=0, openings=["Write a Python function that", "Why"], min_words=2)
    assert [p["prompt"] for p in got] == ["Write a Python function that sorts a list.", "Why is the sky blue?",
                                          "Write a Python function that reverses a string."]  # fmt: skip
    rows = gen.calls[0][0]
    assert rows[0] == tpl.encode(user_prefix(tpl) + "Write a Python function that") and rows[1] != rows[0]


def test_the_file_is_a_prompts_source_and_is_never_overwritten_unasked(tmp_path: Path) -> None:
    out = tmp_path / "self.jsonl.gz"
    prompts = [{"id": "self-a", "prompt": "How do I sort a list?"}, {"id": "self-b", "prompt": "Why is it blue?"}]
    write_prompts(out, prompts)
    first = out.read_bytes()
    assert [json.loads(x) for x in gzip.decompress(first).decode().splitlines()] == prompts
    got = load_conversations(f"prompts:{out}")
    assert [(c.id, c.user_turns) for c in got] == [("self-a", ["How do I sort a list?"]), ("self-b", ["Why is it blue?"])]
    with pytest.raises(FileExistsError, match="--overwrite"):
        write_prompts(out, prompts[:1])
    write_prompts(out, prompts, overwrite=True)
    assert out.read_bytes() == first and [p.name for p in tmp_path.iterdir()] == ["self.jsonl.gz"]


@pytest.mark.parametrize("engine", ["loop", "native"])
def test_a_real_generator_writes_distinct_finished_messages(engine: str) -> None:
    """The tiny random target, sampled: whatever it keeps obeys the rules, the same seed gives the same prompts,
    and the rows of one batch differ (one generator for the batch, not one seed per identical row)."""
    tok = make_tokenizer("chatml", vocab_size=320)
    tpl = ChatTemplate(tok)
    target = tiny_target("llama", vocab=320, dtype=torch.float32)
    params = GenerationParams(max_new_tokens=48, temperature=1.0, stop_ids=tpl.stop_ids)
    runs = [
        self_prompts(tpl, LocalGenerator(target, params, engine=engine, batch_size=64), 40, seed=5, min_words=1)
        for _ in "ab"
    ]
    (got, stats), (again, _) = runs
    assert got == again and stats.asked >= 50 and stats.kept == len(got) > 0
    assert len({p["prompt"] for p in got}) == len(got)
    assert stats.dropped["unfinished"] > 0  # random weights: many never stop within 48 tokens
