"""Request parsing and validation for the OpenAI-compatible endpoints, by hand (no pydantic).

Every rejection is an `APIError` (4xx) that names the offending field. Unknown fields that
only tune behaviour we do not offer (e.g. `frequency_penalty`, `user`) are ignored, as
OpenAI-compatible servers commonly do; fields that would change what the client gets back
(`n > 1`, `logprobs`, `tools`, `echo`) are refused so nobody silently gets less than asked.

    body = decode_json(raw_bytes)
    req = parse_chat(body, limits)       # -> ParsedRequest
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from flashdraft.serve.errors import invalid

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 256


@dataclass
class Limits:
    """Server-side bounds a request is checked against."""

    max_tokens_cap: int = 4096  # largest max_tokens a client may ask for
    default_max_tokens: int = 256  # used when the client sends none (clamped to the context left)
    max_messages: int = 1024


@dataclass
class SamplingParams:
    max_tokens: int | None  # None = server default, clamped to the context left
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass
class ParsedRequest:
    kind: str  # "chat" | "completion"
    model: str
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    messages: list[dict[str, str]] | None = None  # chat: [{"role", "content"}], content flattened to text
    prompt: str | None = None  # completion: text prompt
    prompt_ids: list[int] | None = None  # completion: token-id prompt


def decode_json(raw: bytes) -> Any:
    """Strict UTF-8 JSON (no NaN/Infinity); anything else is a 400 with the reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from None
    if not text.strip():
        raise invalid("request body is empty: send a JSON object", code="invalid_json")

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(text, parse_constant=no_constants)
    except json.JSONDecodeError as e:
        raise invalid(
            f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}", code="invalid_json"
        ) from None
    except (ValueError, RecursionError) as e:
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise invalid(f"malformed JSON: {reason}", code="invalid_json") from None


# ----------------------------------------------------------------------------- typed getters


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "integer" if isinstance(v, int) else "number" if isinstance(v, float) else type(v).__name__
    )


def _int(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"'{key}' must be an integer, got {_type_name(v)}", key, "invalid_type")
    if not lo <= v <= hi:
        shown = v if abs(v) < 10**30 else "out of range"  # a JSON integer may have thousands of digits
        raise invalid(f"'{key}' is {shown}: it must be in {lo}..{hi}", key)
    return v


def _float(
    body: dict[str, Any], key: str, lo: float, hi: float, default: float, lo_open: bool = False
) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(f"'{key}' must be a number, got {_type_name(v)}", key, "invalid_type")
    bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
    try:
        v = float(v)
    except OverflowError:  # a JSON integer beyond float range (JSON has no size limit)
        raise invalid(f"'{key}' is out of range: it must be in {bound}", key) from None
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v <= lo):
        raise invalid(f"'{key}' is {v}: it must be in {bound}", key)
    return v


def _bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(f"'{key}' must be a boolean, got {_type_name(v)}", key, "invalid_type")
    return v


def _stop(body: dict[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid("'stop' must be a string or an array of strings", "stop", "invalid_type")
    if len(items) > MAX_STOP_SEQUENCES:
        raise invalid(f"'stop' has {len(items)} sequences: at most {MAX_STOP_SEQUENCES} are allowed", "stop")
    for s in items:
        if not s:
            raise invalid("'stop' sequences must be non-empty strings", "stop")
        if len(s) > MAX_STOP_CHARS:
            raise invalid(f"a 'stop' sequence is {len(s)} characters: at most {MAX_STOP_CHARS}", "stop")
    return list(items)


def _common(body: Any, kind: str, limits: Limits) -> tuple[str, SamplingParams, bool, bool]:
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {_type_name(body)}", code="invalid_type")
    model = body.get("model")
    if model is None:
        raise invalid("'model' is required: see GET /v1/models", "model", "missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise invalid("'model' must be a non-empty string", "model", "invalid_type")
    _int(body, "n", 1, 1)  # one choice per request: generation is single-stream
    if body.get("best_of") not in (None, 1):
        raise invalid(
            "'best_of' is not supported: only 1 choice per request", "best_of", "unsupported_parameter"
        )
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise invalid("'logprobs' is not supported by this server", "logprobs", "unsupported_parameter")
    if body.get("tools") or body.get("functions") or body.get("tool_choice") not in (None, "none"):
        raise invalid("tool calling is not supported by this server", "tools", "unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise invalid(
            "'response_format' other than text is not supported", "response_format", "unsupported_parameter"
        )
    if kind == "completion" and (_bool(body, "echo") or body.get("suffix") is not None):
        raise invalid("'echo' and 'suffix' are not supported", "echo", "unsupported_parameter")
    max_tokens = _int(body, "max_tokens", 1, limits.max_tokens_cap)
    mct = _int(body, "max_completion_tokens", 1, limits.max_tokens_cap)
    if max_tokens is not None and mct is not None and max_tokens != mct:
        raise invalid("'max_tokens' and 'max_completion_tokens' disagree: send one", "max_tokens")
    max_tokens = max_tokens if max_tokens is not None else mct
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_float(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
        seed=_int(body, "seed", -(2**63), 2**64 - 1),
        stop=_stop(body),
    )
    stream = _bool(body, "stream")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise invalid("'stream_options' must be an object", "stream_options", "invalid_type")
        if not stream:
            raise invalid("'stream_options' is only allowed with stream=true", "stream_options")
        include_usage = _bool(so, "include_usage")
    return model, params, stream, include_usage


def _message_text(content: Any, i: int) -> str:
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(f"{where}[{j}] must be a text part {{'type': 'text', 'text': ...}}", where)
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(
        f"{where} must be a string or an array of text parts, got {_type_name(content)}",
        where,
        "invalid_type",
    )


def parse_chat(body: Any, limits: Limits) -> ParsedRequest:
    model, params, stream, include_usage = _common(body, "chat", limits)
    msgs = body.get("messages")
    if msgs is None:
        raise invalid("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list):
        raise invalid(f"'messages' must be an array, got {_type_name(msgs)}", "messages", "invalid_type")
    if not msgs:
        raise invalid("'messages' is empty: send at least one message", "messages")
    if len(msgs) > limits.max_messages:
        raise invalid(f"'messages' has {len(msgs)} entries: at most {limits.max_messages}", "messages")
    out: list[dict[str, str]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise invalid(
                f"messages[{i}].role is {role!r}: use one of {', '.join(CHAT_ROLES)}", f"messages[{i}].role"
            )
        if "content" not in m or m["content"] is None:
            raise invalid(
                f"messages[{i}].content is required", f"messages[{i}].content", "missing_required_parameter"
            )
        out.append(
            {"role": "system" if role == "developer" else role, "content": _message_text(m["content"], i)}
        )
    return ParsedRequest("chat", model, params, stream, include_usage, messages=out)


def parse_completion(body: Any, limits: Limits) -> ParsedRequest:
    model, params, stream, include_usage = _common(body, "completion", limits)
    p = body.get("prompt")
    if p is None:
        raise invalid("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    req = ParsedRequest("completion", model, params, stream, include_usage)
    if isinstance(p, str):
        if not p:
            raise invalid("'prompt' is empty", "prompt")
        req.prompt = p
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        req.prompt_ids = list(p)
    elif isinstance(p, list) and not p:
        raise invalid("'prompt' is empty", "prompt")
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise invalid(
            "batched prompts are not supported: send one prompt per request",
            "prompt",
            "unsupported_parameter",
        )
    else:
        raise invalid("'prompt' must be a string or an array of token ids", "prompt", "invalid_type")
    return req
