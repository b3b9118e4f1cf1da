"""The real server on a loopback port, driven by the official `openai` client and by httpx.

One module-scoped stack: the default SmolLM2 target (tokenizer + chat template) and a random
1-layer drafter saved to tmp and loaded back. Every completion is compared with
`flashdraft.decode.generate` on the same prompt. Side servers share the loaded models to
test the queue bound (429), client disconnects, timeouts and crashes without reloading.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")  # the serving extras are not installed everywhere (e.g. the GPU machine)
pytest.importorskip("uvicorn")
import httpx  # noqa: E402

from flashdraft.decode import generate
from flashdraft.drafter import DFlashDrafter
from flashdraft.serve.app import AppSettings, create_app
from flashdraft.serve.protocol import Limits
from flashdraft.serve.server import BackgroundServer
from flashdraft.serve.worker import Engine, EngineSettings

openai = pytest.importorskip("openai")

KEY = "test-key-0123456789"
MODEL = "smollm2-test"
N = 6  # max_tokens in generating tests: CPU time is scarce
CHAT = [{"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is"


@dataclass
class Stack:
    target: Any
    drafter: DFlashDrafter
    engine: Engine
    server: BackgroundServer

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, **kw: Any) -> Any:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=120, **kw)

    def reference(self, ids: list[int], max_tokens: int = N, **kw: Any) -> tuple[str, list[int]]:
        """What `flashdraft.decode.generate` gives on the same prompt, decoded like the server does."""
        with torch.inference_mode():
            res = generate(
                self.target,
                self.drafter,
                ids,
                max_new_tokens=max_tokens,
                method="chain",
                stop_token_ids=self.engine.stop_ids,
                **kw,
            )
        return self.engine.decode(res.tokens), res.tokens


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from flashdraft.target import drafter_config_for, load_target

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: OpenMP spinning across busy cores costs ~10x here
    target = load_target("default")
    torch.manual_seed(0)
    d = DFlashDrafter(drafter_config_for(target, num_layers=1, block_size=8))
    d.reset_parameters(0.02)
    folder = d.save_pretrained(tmp_path_factory.mktemp("drafter") / "d")
    drafter = DFlashDrafter.from_pretrained(folder).eval()
    engine = Engine(
        target,
        drafter,
        EngineSettings(
            method="chain", max_queue=4, timeout=120, model_id=MODEL, limits=Limits(max_tokens_cap=512)
        ),
    )
    engine.start()
    app = create_app(engine, AppSettings(api_key=KEY, max_body_bytes=64 * 1024))
    with BackgroundServer(app) as srv:
        yield Stack(target, drafter, engine, srv)
    engine.stop()
    torch.set_num_threads(threads)


def chat_ids(stack: Stack, messages: list[dict[str, str]]) -> list[int]:
    return stack.engine.chat_prompt(messages)


def metric(text: str, name: str) -> float:
    """Sum of the samples of metric `name` (all label sets) in Prometheus text."""
    samples = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return sum(float(v) for k, v in samples if k.split("{")[0] == name)


# ----------------------------------------------------------------------------- OpenAI client


def test_health_models_and_auth(stack: Stack) -> None:
    assert httpx.get(stack.url + "/health").json()["status"] == "ok"  # no key needed
    r = httpx.get(stack.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(stack.url + "/v1/models", headers={"Authorization": "Bearer " + KEY[:-1] + "X"})
    assert r.status_code == 401
    assert [m.id for m in stack.client().models.list().data] == [MODEL]


def test_chat_greedy_equals_generate(stack: Stack) -> None:
    ref_text, ref_tokens = stack.reference(chat_ids(stack, CHAT))
    r = stack.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == ref_text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(ref_tokens)
    assert r.usage.prompt_tokens == len(chat_ids(stack, CHAT))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason == ("stop" if ref_tokens[-1] in stack.engine.stop_ids else "length")
    extra = r.model_extra["flashdraft"]
    assert extra["method"] == "chain" and extra["rounds"] == len(ref_tokens) - 1
    assert extra["mean_acceptance_length"] >= 1.0

    # streaming gives the same text, a role chunk first, and usage at the end when asked
    chunks = list(stack.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref_tokens)


def test_completion_greedy_equals_generate_streaming_and_not(stack: Stack) -> None:
    ids = stack.engine.text_prompt(PROMPT)
    ref_text, ref_tokens = stack.reference(ids)
    c = stack.client()
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0)
    assert r.choices[0].text == ref_text and r.usage.completion_tokens == len(ref_tokens)
    assert r.usage.prompt_tokens == len(ids)
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == ref_text
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # a token-id prompt is the same request
    r2 = c.completions.create(model=MODEL, prompt=ids, max_tokens=N, temperature=0)
    assert r2.choices[0].text == ref_text


def test_stop_sequences_cut_the_output(stack: Stack) -> None:
    ids = stack.engine.text_prompt(PROMPT)
    full, tokens = stack.reference(ids, max_tokens=N)
    # a stop string that starts inside the greedy output, spanning from mid-text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop and stop in full
    want = full[: full.find(stop)]
    c = stack.client()
    r = c.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stop=[stop, "\x00never"]
    )
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert 1 <= r.usage.completion_tokens <= len(tokens)
    chunks = list(
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stop=stop, stream=True)
    )
    assert "".join(ch.choices[0].text for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeds_make_sampling_reproducible(stack: Stack) -> None:
    c = stack.client()
    kw: dict[str, Any] = dict(model=MODEL, messages=CHAT, max_tokens=N, temperature=1.0, top_p=0.95)
    a = c.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = c.chat.completions.create(seed=1234, **kw).choices[0].message.content
    ref, _ = stack.reference(chat_ids(stack, CHAT), temperature=1.0, top_p=0.95, seed=1234)
    assert a == b == ref


# ----------------------------------------------------------------------------- hostile input


def fuzz_requests() -> list[tuple[str, str, dict[str, Any], bytes]]:
    """≥ 200 malformed or hostile requests: (method, path, headers, body). Each must get a 4xx."""
    import random

    rng = random.Random(0)
    auth = {"Authorization": "Bearer " + KEY, "Content-Type": "application/json"}
    out: list[tuple[str, str, dict[str, Any], bytes]] = []
    good_chat = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
    good_cmpl = {"model": MODEL, "prompt": "hi", "max_tokens": 4}

    def add(path: str, body: Any, headers: dict[str, Any] | None = None, method: str = "POST") -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        out.append((method, path, auth if headers is None else headers, raw))

    # truncated JSON at every prefix of a valid body
    for path, good in (("/v1/chat/completions", good_chat), ("/v1/completions", good_cmpl)):
        raw = json.dumps(good).encode()
        for i in range(0, len(raw), 2):
            add(path, raw[:i])
    # random bytes, invalid UTF-8, JSON constants
    for _ in range(20):
        add("/v1/completions", bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))))
    add("/v1/chat/completions", b'{"model": "\xff\xfe", "messages": []}')
    add("/v1/chat/completions", b'{"model": "m", "messages": [], "temperature": NaN}')
    add("/v1/chat/completions", b"[" * 50_000 + b"]" * 50_000)  # nesting bomb (100 KB: also too large)
    add("/v1/chat/completions", b"[" * 20_000 + b"]" * 20_000)  # nesting bomb under the size limit
    # wrong types and values, field by field
    bad_values: dict[str, list[Any]] = {
        "model": [None, 1, [], {}, "", "gpt-4", "../../etc/passwd"],
        "messages": [
            None,
            "hi",
            {},
            [],
            [1],
            [None],
            [{"role": "user"}],
            [{"role": "root", "content": "x"}],
            [{"role": "user", "content": 3}],
            [{"role": "user", "content": [{"type": "image_url"}]}],
            [{"role": 1, "content": "x"}],
        ],
        "max_tokens": [-1, 0, 10**9, 2**70, "5", 1.5, True, [], {}],
        "temperature": [-1, 2.5, "0", [], True, 1e300],
        "top_p": [0, -0.5, 1.5, "1", []],
        "stop": [1, [1], [""], ["a"] * 5, ["x" * 1000], {}],
        "seed": ["1", 1.5, [], 2**70],
        "stream": ["true", 1, []],
        "n": [2, 0, -1, "1"],
        "stream_options": [{"include_usage": True}],  # without stream
        "logprobs": [True],
        "tools": [[{"type": "function", "function": {"name": "f"}}]],
        "response_format": [{"type": "json_object"}],
    }
    for field, values in bad_values.items():
        for v in values:
            add("/v1/chat/completions", {**good_chat, field: v})
    for v in [None, "", [], [[]], ["a", "b"], [1.5], [True], [-1], [10**9], {"p": 1}, 7]:
        add("/v1/completions", {**good_cmpl, "prompt": v} if v is not None else {"model": MODEL})
    add("/v1/completions", {**good_cmpl, "echo": True})
    add("/v1/completions", {**good_cmpl, "prompt": "x " * 20_000})  # too long for the context: 400
    add("/v1/chat/completions", {**good_chat, "messages": [{"role": "user", "content": "x"}] * 2000})
    add("/v1/chat/completions", [good_chat])  # not an object
    add("/v1/chat/completions", "just a string")
    # oversize bodies: declared, and chunked without a length
    add("/v1/chat/completions", {**good_chat, "pad": "x" * 70_000})
    big = json.dumps({**good_chat, "pad": "y" * 70_000}).encode()
    out.append(("POST", "/v1/completions", {**auth, "Transfer-Encoding": "chunked"}, big))
    # auth: missing, wrong, wrong scheme, garbage
    for h in [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Basic " + KEY},
        {"Authorization": "Bearer " + KEY + "x"},
        {"Authorization": b"Bearer " + "\u00e9".encode("latin-1") * 10},
        {"Authorization": "Bearer"},
        {"Authorization": "x" * 4000},
    ]:
        add("/v1/chat/completions", good_chat, {"Content-Type": "application/json", **h})
        add("/v1/models", b"", h, method="GET")
    # content type, methods, paths
    add("/v1/chat/completions", good_chat, {**auth, "Content-Type": "text/plain"})
    add("/v1/chat/completions", good_chat, {**auth, "Content-Type": "application/x-www-form-urlencoded"})
    add("/v1/chat/completions", b"", method="GET")
    add("/v1/chat/completions", b"", method="DELETE")
    add("/v1/completions", b"", method="PUT")
    add("/health", b"{}", method="POST")
    for path in [
        "/",
        "/v1",
        "/v2/chat/completions",
        "/v1/chat/completions/../../etc/passwd",
        "/%00",
        "/admin",
        "/v1/embeddings",
        "/v1/models/x/y",
        "/docs",
        "/openapi.json",
    ]:
        add(path, good_chat)
    return out


def test_fuzz_hostile_requests_get_4xx_and_server_survives(stack: Stack) -> None:
    reqs = fuzz_requests()
    assert len(reqs) >= 200
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        for method, path, headers, body in reqs:
            if headers.get("Transfer-Encoding") == "chunked":
                r = http.request(
                    method,
                    path,
                    headers={k: v for k, v in headers.items() if k != "Transfer-Encoding"},
                    content=iter([body[i : i + 4096] for i in range(0, len(body), 4096)]),
                )
            else:
                r = http.request(method, path, headers=headers, content=body)
            assert 400 <= r.status_code < 500, (method, path, body[:80], r.status_code, r.text[:200])
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], (path, body[:80])
        assert http.get("/health").status_code == 200
    assert {400, 401, 404, 405, 413, 415} <= set(statuses), statuses
    # a valid request still succeeds and nothing was counted as a server error
    r = stack.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert r.choices[0].message.content is not None
    text = httpx.get(stack.url + "/metrics", headers={"Authorization": "Bearer " + KEY}).text
    assert 'kind="server_error"' not in text
    assert metric(text, "flashdraft_completion_tokens_total") > 0
    assert 'flashdraft_requests_total{endpoint="/v1/chat/completions",status="400"}' in text
    assert metric(text, "flashdraft_mean_acceptance_length") >= 1.0


# ----------------------------------------------------------------------------- queue, disconnects, timeouts


class Gate:
    """Wraps the real `generate`: on_tokens blocks until released, so a test controls when a job ends."""

    def __init__(self, hold: float = 30.0, fail_on: int | None = None) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.hold = hold
        self.fail_on = fail_on
        self.results: list[Any] = []

    def __call__(self, *args: Any, **kw: Any) -> Any:
        if kw["max_new_tokens"] == self.fail_on:
            raise RuntimeError("injected failure")
        inner = kw.pop("on_tokens")

        def on_tokens(new: list[int]) -> bool | None:
            self.started.set()
            self.release.wait(self.hold)
            return inner(new)

        res = generate(*args, on_tokens=on_tokens, **kw)
        self.results.append(res)
        return res


@pytest.fixture
def side(stack: Stack) -> Iterator[Any]:
    """A second server over the same models, with a gated generate and settings per test."""
    made: list[tuple[Engine, BackgroundServer]] = []

    def make(gate: Gate, **settings: Any) -> tuple[Engine, BackgroundServer]:
        es = EngineSettings(**{"method": "chain", "model_id": MODEL, **settings})
        engine = Engine(stack.target, stack.drafter, es, generate=gate)
        engine.start()
        srv = BackgroundServer(create_app(engine)).start()
        made.append((engine, srv))
        return engine, srv

    yield make
    for engine, srv in made:
        srv.stop()
        engine.stop()


def test_queue_bound_gives_429_with_retry_after(side: Any) -> None:
    gate = Gate()
    engine, srv = side(gate, max_queue=1)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    results: list[int] = []

    def post() -> None:
        results.append(httpx.post(srv.url + "/v1/completions", json=body, timeout=120).status_code)

    first = threading.Thread(target=post)
    first.start()
    assert gate.started.wait(60)  # the worker is busy with the first request
    second = threading.Thread(target=post)
    second.start()
    t_end = time.monotonic() + 10
    while engine.queue_length < 1 and time.monotonic() < t_end:
        time.sleep(0.01)
    assert engine.queue_length == 1  # the second one waits
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)  # the third is refused
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == "queue_full"
    gate.release.set()
    first.join(120)
    second.join(120)
    assert results == [200, 200]
    assert 'flashdraft_errors_total{kind="rejected_queue_full"} 1' in httpx.get(srv.url + "/metrics").text


def test_client_disconnect_cancels_the_generation(side: Any) -> None:
    gate = Gate()
    engine, srv = side(gate, max_queue=2)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", srv.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert gate.started.wait(60)
            gate.release.set()
            next(r.iter_lines())  # the first chunk arrived; now the client goes away
    t_end = time.monotonic() + 60
    while not gate.results and time.monotonic() < t_end:
        time.sleep(0.05)
    assert gate.results and gate.results[0].stop_reason == "cancelled"
    assert len(gate.results[0].tokens) < 200  # stopped long before max_tokens
    assert 'flashdraft_errors_total{kind="cancelled"} 1' in httpx.get(srv.url + "/metrics").text

    # a non-streaming client that goes away mid-generation: the handler notices and cancels the job
    gate.started.clear()
    gate.release.clear()
    raw = json.dumps({**body, "stream": False}).encode()
    with socket.create_connection((srv.host, srv.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        assert gate.started.wait(60)  # generating (held after the prefill) when the client leaves
    time.sleep(1.0)  # > POLL_SECONDS: the handler has seen the disconnect
    gate.release.set()
    t_end = time.monotonic() + 60
    while len(gate.results) < 2 and time.monotonic() < t_end:
        time.sleep(0.05)
    assert gate.results[1].stop_reason == "cancelled" and len(gate.results[1].tokens) == 1
    assert 'flashdraft_errors_total{kind="cancelled"} 2' in httpx.get(srv.url + "/metrics").text


def test_timeout_gives_504_and_worker_failure_gives_500(side: Any) -> None:
    gate = Gate(hold=1.5, fail_on=3)
    engine, srv = side(gate, timeout=1.0)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 50, "temperature": 0}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert gate.results[-1].stop_reason == "cancelled" and len(gate.results[-1].tokens) < 50
    # an exception inside generation: 500 with an error object, then the worker keeps serving
    r = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 3}, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    gate.hold = 0.0
    engine.settings.timeout = 60.0
    r = httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    text = httpx.get(srv.url + "/metrics").text
    assert 'kind="timeout"} 1' in text and 'kind="server_error"} 1' in text


def test_ddtree_server_equals_generate(stack: Stack, side: Any) -> None:
    gate = Gate(hold=0.0)
    engine, srv = side(gate, method="ddtree", budget=4)
    ids = stack.engine.text_prompt(PROMPT)
    with torch.inference_mode():
        ref = generate(
            stack.target,
            stack.drafter,
            ids,
            max_new_tokens=4,
            method="ddtree",
            budget=4,
            stop_token_ids=engine.stop_ids,
        )
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text == engine.decode(ref.tokens)
    assert r.model_extra["flashdraft"]["method"] == "ddtree" and gate.results[0].budget == 4


def test_fast_engine_server_equals_generate(stack: Stack) -> None:
    """`flashdraft serve --engine fast` (the default on CUDA; here the CUDA-graph engine's phases run eagerly on the
    CPU): the reference decoder's text, streamed or not."""
    from flashdraft.decode.backend import pick_engine

    name, gen = pick_engine(stack.target, "fast")
    engine = Engine(stack.target, stack.drafter, EngineSettings(model_id=MODEL, engine=name), generate=gen)
    engine.start()
    srv = BackgroundServer(create_app(engine)).start()
    try:
        ref_text, _ = stack.reference(stack.engine.text_prompt(PROMPT))
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0)
        assert r.choices[0].text == ref_text and r.model_extra["flashdraft"]["method"] == "chain"
        chunks = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in chunks) == ref_text
    finally:
        srv.stop()
        engine.stop()
