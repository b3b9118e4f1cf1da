"""The server's worker on the fast engine, as `flashdraft serve` runs it on a GPU: requests decoded in the worker
thread, under inference_mode, streamed round by round through `on_tokens`, give the tokens the same engine gives
when called directly. No HTTP stack (the GPU machine has no fastapi): `Engine.submit` is what a request handler
calls. The CPU variant runs the engine's phases eagerly in float64; the GPU one replays its CUDA graphs in bf16,
eager and compiled (`flashdraft serve --compile`)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from flashdraft.decode.backend import pick_engine
from flashdraft.serve.protocol import SamplingParams
from flashdraft.serve.worker import Delta, Done, Engine, EngineSettings, Failed, Job
from tests.conftest import tiny_drafter, tiny_target


class IdTokenizer:
    """Each token id as "<id>": what the worker needs of a tokenizer (decode, eos, vocab) on a random target."""

    eos_token_id = None

    def get_vocab(self) -> dict[str, int]:
        return {}

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(f"<{i}>" for i in ids)


def submit(engine: Engine, ids: list[int], max_tokens: int) -> tuple[str, Done]:
    """One greedy request through the worker: the streamed text and its Done event."""
    events: list[Any] = []
    finished = threading.Event()

    def emit(ev: Any) -> None:
        events.append(ev)
        if isinstance(ev, (Done, Failed)):
            finished.set()

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    engine.submit(Job(ids, params, emit, deadline=time.monotonic() + 600))
    assert finished.wait(600), "the worker did not finish the request"
    assert not any(isinstance(ev, Failed) for ev in events), [ev for ev in events if isinstance(ev, Failed)]
    done = events[-1]
    assert isinstance(done, Done)
    return "".join(ev.text for ev in events if isinstance(ev, Delta)), done


def check_worker_equals_direct(target: Any, drafter: Any, compile: bool) -> None:
    target.tokenizer = IdTokenizer()
    name, gen = pick_engine(target, "fast", compile)
    for method, budget in [("chain", None), ("ddtree", 8), ("ar", None)]:
        settings = EngineSettings(method=method, budget=budget, model_id="t", engine=name)
        engine = Engine(target, drafter, settings, generate=gen)
        engine.start()
        try:
            for prompt in ([5, 9, 11], [7, 3, 20, 8, 6, 40]):
                text, done = submit(engine, prompt, 24)
                with torch.inference_mode():
                    ref = gen(target, drafter, prompt, max_new_tokens=24, method=method, budget=budget,
                              stop_token_ids=engine.stop_ids)  # fmt: skip
                assert text == IdTokenizer().decode(ref.tokens), (method, budget, prompt)
                assert done.completion_tokens == len(ref.tokens) and done.rounds == ref.rounds
        finally:
            engine.stop()


def test_worker_on_the_fast_engine_equals_the_engine_on_cpu() -> None:
    target = tiny_target("llama", layers=3)
    check_worker_equals_direct(target, tiny_drafter(target, layers=1), compile=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", [False, True])
def test_worker_on_the_fast_engine_equals_the_engine_on_gpu(compile: bool) -> None:
    """bf16 CUDA graphs captured and replayed in the worker thread (and compiled there with `compile`): the same
    graphs at the same state as a direct call, so the same tokens bit for bit."""
    torch._dynamo.reset()
    target = tiny_target("llama", layers=4, hidden=64, dtype=torch.bfloat16)
    target.model.cuda()
    check_worker_equals_direct(target, tiny_drafter(target, layers=1).cuda(), compile)
