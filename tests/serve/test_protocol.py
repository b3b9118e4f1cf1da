"""Request validation by hand: every bad field is a 4xx APIError naming the field."""

from __future__ import annotations

import pytest

from flashdraft.serve.errors import APIError
from flashdraft.serve.protocol import Limits, decode_json, parse_chat, parse_completion

LIMITS = Limits(max_tokens_cap=64)
MSG = [{"role": "user", "content": "hi"}]


def test_valid_chat_and_completion() -> None:
    req = parse_chat(
        {
            "model": "m",
            "messages": MSG,
            "max_tokens": 8,
            "temperature": 0,
            "top_p": 0.5,
            "seed": 3,
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
            "frequency_penalty": 0.0,
            "user": "x",
        },
        LIMITS,
    )
    assert req.kind == "chat" and req.messages == MSG and req.stream and req.include_usage
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop) == (8, 0.0, 0.5, 3, ["\n"])
    parts = [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert parse_chat({"model": "m", "messages": parts}, LIMITS).messages == [
        {"role": "system", "content": "ab"}
    ]
    c = parse_completion({"model": "m", "prompt": ["once"], "max_completion_tokens": 4}, LIMITS)
    assert c.prompt == "once" and c.params.max_tokens == 4 and c.params.temperature == 1.0
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}, LIMITS).prompt_ids == [1, 2, 3]


@pytest.mark.parametrize(
    "body, param",
    [
        ([], None),
        ({"messages": MSG}, "model"),
        ({"model": 3, "messages": MSG}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        ({"model": "m", "messages": MSG, "max_tokens": -1}, "max_tokens"),
        ({"model": "m", "messages": MSG, "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": MSG, "max_tokens": 10**12}, "max_tokens"),
        ({"model": "m", "messages": MSG, "max_tokens": "8"}, "max_tokens"),
        ({"model": "m", "messages": MSG, "max_tokens": True}, "max_tokens"),
        ({"model": "m", "messages": MSG, "max_tokens": 2.5}, "max_tokens"),
        ({"model": "m", "messages": MSG, "temperature": -0.1}, "temperature"),
        ({"model": "m", "messages": MSG, "temperature": 3}, "temperature"),
        ({"model": "m", "messages": MSG, "temperature": "hot"}, "temperature"),
        ({"model": "m", "messages": MSG, "top_p": 0}, "top_p"),
        ({"model": "m", "messages": MSG, "seed": 1.5}, "seed"),
        ({"model": "m", "messages": MSG, "stop": ["a", 1]}, "stop"),
        ({"model": "m", "messages": MSG, "stop": [""]}, "stop"),
        ({"model": "m", "messages": MSG, "stop": ["a"] * 5}, "stop"),
        ({"model": "m", "messages": MSG, "n": 2}, "n"),
        ({"model": "m", "messages": MSG, "stream": "yes"}, "stream"),
        ({"model": "m", "messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": "m", "messages": MSG, "logprobs": True}, "logprobs"),
        ({"model": "m", "messages": MSG, "tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_bad_chat_requests(body: object, param: str | None) -> None:
    with pytest.raises(APIError) as e:
        parse_chat(body, LIMITS)
    assert e.value.status == 400 and e.value.param == param
    err = e.value.body()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt", [None, "", [], [1, "a"], ["a", "b"], 5, {"x": 1}, [True]])
def test_bad_completion_prompts(prompt: object) -> None:
    body = {"model": "m"} if prompt is None else {"model": "m", "prompt": prompt}
    with pytest.raises(APIError) as e:
        parse_completion(body, LIMITS)
    assert e.value.status == 400 and e.value.param == "prompt"


@pytest.mark.parametrize(
    "raw, code",
    [
        (b"", "invalid_json"),
        (b"{", "invalid_json"),
        (b"\xff\xfe{}", "invalid_encoding"),
        (b'{"temperature": NaN}', "invalid_json"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
    ],
)
def test_decode_json_rejects(raw: bytes, code: str) -> None:
    with pytest.raises(APIError) as e:
        decode_json(raw)
    assert e.value.status == 400 and e.value.code == code


HUGE = "1" + "0" * 400  # a JSON integer beyond float range: float() raises OverflowError


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "n"]
)
@pytest.mark.parametrize("value", [HUGE, "-" + HUGE, "1e400", "-1e400"])
def test_huge_numbers_are_400(kind: str, field: str, value: str) -> None:
    """Every numeric field of the protocol: a number no float holds is the client's error (400), never a 500."""
    rest = '"messages": [{"role": "user", "content": "hi"}]' if kind == "chat" else '"prompt": "hi"'
    raw = f'{{"model": "m", {rest}, "{field}": {value}}}'.encode()
    parse = parse_chat if kind == "chat" else parse_completion
    with pytest.raises(APIError) as e:
        parse(decode_json(raw), LIMITS)
    assert e.value.status == 400 and e.value.param == field and len(e.value.message) < 200
