"""Loss masks and exact ids per chat template (ChatML, Llama-3-style, Qwen3-style), multi-turn, system prompts."""

from __future__ import annotations

import numpy as np
import pytest

from flashdraft.data.sources import Conversation, Turn
from flashdraft.data.template import ChatTemplate, ConversationBuilder, TemplateError
from tests.data.tokenizers import make_tokenizer

RESPONSES = [
    "Hello there! How can I help you today?",
    "The answer is 42.",
    "Why did the chicken cross the road?",
]
THINKING = [
    "<think>\nThe user says hello.\n</think>\n\nHello there!",
    "<think>\nadd them\n</think>\n\nThe answer is 42.",
]


def _conv(system: str | None, users: list[str]) -> Conversation:
    turns = ([Turn("system", system)] if system else []) + [
        t for u in users for t in (Turn("user", u), Turn("assistant", "old human answer"))
    ]
    return Conversation("c1", turns, source="test")


def _run(tpl: ChatTemplate, conv: Conversation, responses: list[str], max_length: int | None = None):
    """Answer every turn with the canonical ids of a scripted response + the stop token."""
    b = ConversationBuilder(tpl, conv, max_length=max_length)
    prompts, gens = [], []
    while (p := b.next_prompt()) is not None:
        gen = tpl.encode(responses[len(gens)]) + [tpl.stop_ids[0]]
        prompts.append(p)
        gens.append(gen)
        b.add_response(gen, "stop")
    return b.samples(), prompts, gens


def _serving_prompt(tok, system, users, responses, k, thinking):
    """How a server renders the prompt of turn k: full chat template over text history, tokenized."""
    msgs = [{"role": "system", "content": system}] if system else []
    for u, r in zip(users[:k], responses[:k], strict=True):
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": r}]
    msgs.append({"role": "user", "content": users[k]})
    kw = {} if thinking is None else {"enable_thinking": thinking}
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
    return tok(text, add_special_tokens=False)["input_ids"]


def _loss_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


@pytest.mark.parametrize("kind", ["chatml", "llama3"])
@pytest.mark.parametrize("system", [None, "Be brief."])
def test_prefix_templates_one_sample_per_conversation(kind, system):
    tok = make_tokenizer(kind)
    tpl = ChatTemplate(tok)
    users = ["Tell me a joke.", "def add(a, b)?", "Why?"]
    samples, prompts, gens = _run(tpl, _conv(system, users), RESPONSES)
    assert len(samples) == 1
    s = samples[0]
    runs = _loss_runs(s.loss_mask)
    assert len(runs) == 3
    for k, (a, b) in enumerate(runs):
        # the loss covers exactly the generated ids, stop token included ...
        assert s.input_ids[a:b].tolist() == gens[k] and s.input_ids[b - 1] == tok.eos_token_id
        # ... and everything before it is what a server renders as that turn's prompt
        assert (
            s.input_ids[:a].tolist() == _serving_prompt(tok, system, users, RESPONSES, k, None) == prompts[k]
        )
    if kind == "llama3":
        assert s.input_ids[0] == tok.bos_token_id and (s.input_ids == tok.bos_token_id).sum() == 1
    if system:
        assert "Be brief." in tok.decode(s.input_ids[: runs[0][0]])
    assert s.meta["prompt"][0]["role"] == ("system" if system else "user")
    assert s.meta["finish"] == ["stop"] * 3 and s.id == "c1"


def test_qwen3_non_thinking_excludes_empty_think_block_and_splits_turns():
    tok = make_tokenizer("qwen3")
    tpl = ChatTemplate(tok, enable_thinking=False)
    users = ["Tell me a joke.", "Why?"]
    samples, prompts, gens = _run(tpl, _conv("Be brief.", users), RESPONSES)
    # the template drops the empty thinking block from history, so turn 2 is not an extension: 2 samples
    assert [s.id for s in samples] == ["c1", "c1#t1"]
    think_ids = tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    for k, s in enumerate(samples):
        ((a, b),) = _loss_runs(s.loss_mask)
        assert s.input_ids[a:b].tolist() == gens[k]
        assert s.input_ids[:a].tolist() == _serving_prompt(tok, "Be brief.", users, RESPONSES, k, False)
        assert s.input_ids[a - len(think_ids) : a].tolist() == think_ids  # template-inserted: no loss
        assert not s.loss_mask[a - len(think_ids) : a].any()
    assert samples[1].meta["turns"] == [1, 2]


def test_qwen3_thinking_history_drops_reasoning():
    tok = make_tokenizer("qwen3")
    tpl = ChatTemplate(tok, enable_thinking=True)
    assert tpl.strip_reasoning_in_history
    users = ["Hello there!", "What is 40 + 2?"]
    samples, prompts, gens = _run(tpl, _conv(None, users), THINKING)
    assert len(samples) == 2
    for k, s in enumerate(samples):
        ((a, b),) = _loss_runs(s.loss_mask)
        assert s.input_ids[a:b].tolist() == gens[k]  # the reasoning is generated: it is in the loss
        assert s.input_ids[:a].tolist() == _serving_prompt(tok, None, users, THINKING, k, True)
    assert "The user says hello" not in tok.decode(samples[1].input_ids)
    # ChatML keeps reasoning in history (its template does not drop it): one sample
    chat = ChatTemplate(make_tokenizer("chatml"))
    assert not chat.strip_reasoning_in_history
    assert len(_run(chat, _conv(None, users), THINKING)[0]) == 1


def test_ids_are_never_retokenized():
    """A non-canonical generation (ids a tokenizer would never produce for its text) is stored as is."""
    tok = make_tokenizer("chatml")
    tpl = ChatTemplate(tok)
    b = ConversationBuilder(tpl, _conv(None, ["Hello there!", "Why?"]))
    p = b.next_prompt()
    canon = tpl.encode("Hello")
    odd = [tok.convert_tokens_to_ids(c) for c in "Hello"]  # one id per character
    assert odd != canon and tok.decode(odd) == tok.decode(canon)
    b.add_response(odd + [tok.eos_token_id], "stop")
    p2 = b.next_prompt()
    assert p2[len(p) : len(p) + 6] == odd + [tok.eos_token_id]
    b.add_response(canon, "length")  # no stop token: the template's end marker is a prompt token
    (s,) = b.samples()
    assert s.input_ids[len(p) : len(p) + 5].tolist() == odd
    assert s.meta["finish"] == ["stop", "length"]
    assert s.loss_mask.sum() == len(odd) + 1 + len(canon)


def test_max_length_stops_the_conversation():
    tok = make_tokenizer("chatml")
    tpl = ChatTemplate(tok)
    users = ["Tell me a joke.", "Why?", "And?"]
    full, prompts, _ = _run(tpl, _conv(None, users), RESPONSES)
    samples, cut_prompts, _ = _run(tpl, _conv(None, users), RESPONSES, max_length=len(prompts[1]))
    assert len(cut_prompts) == 1  # turn 2's prompt reaches max_length: not generated
    assert samples[0].meta["turns"] == [0, 1]
    assert samples[0].input_ids.tolist() == full[0].input_ids[: len(samples[0].input_ids)].tolist()


@pytest.mark.parametrize("kind", ["chatml", "qwen3"])
def test_stop_keeps_the_answered_turns_and_drops_the_waiting_prompt(kind):
    """A builder stopped while its third prompt waits (regeneration's time limit) gives the sample a builder of
    the conversation's first two turns gives: the waiting prompt is in no sample, and nothing more is asked."""
    tpl = ChatTemplate(make_tokenizer(kind), enable_thinking=False if kind == "qwen3" else None)
    users = ["Hi!", "What is 6 x 7?", "A joke?"]
    short, _, gens = _run(tpl, _conv("Be brief.", users[:2]), RESPONSES)  # Qwen3: one sample per turn
    b = ConversationBuilder(tpl, _conv("Be brief.", users))
    for gen in gens:
        b.next_prompt()
        b.add_response(gen, "stop")
    assert b.next_prompt() is not None  # the third prompt waits for an answer that never comes
    b.stop()
    assert b.next_prompt() is None
    got = b.samples()
    assert [(x.id, x.input_ids.tolist(), x.loss_mask.tolist(), x.meta) for x in got] == [
        (x.id, x.input_ids.tolist(), x.loss_mask.tolist(), x.meta) for x in short
    ]
    assert got[-1].meta["turns"][1] == 2 and got[-1].loss_mask[-1]  # it ends with the second answer


def test_template_that_rewrites_assistant_content_is_refused():
    tok = make_tokenizer("chatml")
    bad = ChatTemplate(tok)
    bad.tokenizer = make_tokenizer("chatml", vocab_size=321)
    bad.tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}[hidden]{% else %}{{ m['content'] }}"
        "{% endif %}{% endfor %}"
    )
    with pytest.raises(TemplateError, match="rewrites or drops assistant content"):
        bad.prompt_ids(None, [("hi", [5, 2])], "again")


@pytest.mark.parametrize("kind", ["chatml", "qwen3"])
def test_history_answers_only_the_later_turns(kind):
    """A builder given turns 0-1 as history asks for turn 2 with the prompt of a builder that answered them,
    and its one sample starts at turn 2 (`c1#t2`): the history is prompt, the later answer the only loss."""
    tpl = ChatTemplate(make_tokenizer(kind), enable_thinking=False if kind == "qwen3" else None)
    conv = _conv("Be brief.", ["Hi!", "What is 6 x 7?", "A joke?"])
    _, prompts, gens = _run(tpl, conv, RESPONSES)
    users = conv.user_turns
    b = ConversationBuilder(tpl, conv, history=list(zip(users[:2], gens[:2], strict=True)))
    assert b.turn == 2 and b.next_prompt() == prompts[2]
    b.add_response(gens[2], "stop")
    (s,) = b.samples()
    assert s.id == "c1#t2" and s.meta["turns"] == [2, 3] and s.meta["finish"] == ["stop"]
    assert s.input_ids.tolist() == prompts[2] + gens[2]
    assert _loss_runs(s.loss_mask) == [(len(prompts[2]), len(s.input_ids))]
    assert [m["content"] for m in s.meta["prompt"]] == ["Be brief.", *users]  # the history's user turns too
    with pytest.raises(ValueError, match="first user turns"):
        ConversationBuilder(tpl, conv, history=[("Hello!", gens[0])])
