"""The one worker that owns the model: a bounded queue of jobs, generated one at a time.

Generation is single-stream, so requests wait in a bounded FIFO in front of one thread that
runs `flashdraft.decode.generate`. Text is streamed out of the `on_tokens` callback, which is
also where a job is stopped: a stop string, a client that went away, or a deadline all make
it return False (the decoder then ends the generation after the current round).

    engine = Engine(target, drafter, EngineSettings(method="chain", max_queue=16, timeout=60))
    engine.start()
    engine.submit(job)        # raises APIError(429) when the queue is full
    ... job.emit(Delta(...)) / job.emit(Done(...)) / job.emit(Failed(...)) from the worker thread
    engine.stop()
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flashdraft.serve.errors import APIError, invalid
from flashdraft.serve.metrics import Metrics
from flashdraft.serve.protocol import Limits, SamplingParams
from flashdraft.serve.textstream import TextStream

log = logging.getLogger("flashdraft.serve")

# end-of-turn markers of common chat templates; whichever exist in the vocabulary also stop generation
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
)


@dataclass
class EngineSettings:
    method: str = "chain"  # "chain" | "ddtree" | "ar" | "auto" (flashdraft/decode/budget.py)
    budget: int | None = None  # DDTree nodes (root excluded)
    tau_report: str | None = None  # method auto: an eval report.json with the drafter's τ per budget
    max_queue: int = 16  # waiting requests beyond the one being generated; more -> 429
    timeout: float = 120.0  # seconds from arrival to the last token, queueing included
    model_id: str = "flashdraft"
    limits: Limits = field(default_factory=Limits)
    engine: str = "reference"  # what `generate` runs (flashdraft.decode.backend): auto's costs are per engine


# ----------------------------------------------------------------------------- events sent to a request


@dataclass
class Delta:
    text: str


@dataclass
class Done:
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    rounds: int
    mean_acceptance: float  # τ of this request: tokens committed per round
    seconds: float


@dataclass
class Failed:
    error: APIError


Event = Delta | Done | Failed


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams  # max_tokens resolved (never None here)
    emit: Callable[[Event], None]  # called from the worker thread
    deadline: float  # time.monotonic() after which the job is abandoned
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.monotonic)

    def cancel(self) -> None:
        self.cancelled.set()


def stop_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """The tokenizer's eos, the generation config's eos ids, and the template's end-of-turn tokens."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in gen if isinstance(gen, (list, tuple)) else [gen]:
        if i is not None:
            ids.add(int(i))
    vocab = tokenizer.get_vocab()
    for name in END_OF_TURN_TOKENS:
        if name in vocab:
            ids.add(int(vocab[name]))
    return sorted(ids)


class Engine:
    def __init__(
        self,
        target: Any,  # flashdraft.target.TargetModel
        drafter: Any | None,  # DFlashDrafter, or None for plain autoregressive decoding
        settings: EngineSettings,
        *,
        metrics: Metrics | None = None,
        generate: Callable[..., Any] | None = None,  # defaults to flashdraft.decode.generate
    ) -> None:
        if target.tokenizer is None:
            raise ValueError(
                f"target {target.name!r} has no tokenizer: the server needs one to read and write text"
            )
        if drafter is None and settings.method != "ar":
            raise ValueError(f"method {settings.method!r} needs a drafter: pass one, or use method 'ar'")
        if settings.max_queue < 0:
            raise ValueError(f"max_queue is {settings.max_queue}: use >= 0")
        self.target, self.drafter, self.settings = target, drafter, settings
        self.tokenizer = target.tokenizer
        self.metrics = metrics or Metrics()
        if generate is None:
            from flashdraft.decode import generate as generate_fn

            generate = generate_fn
        self._generate = generate
        # method auto: one policy for the server's life, calibrated here, learning from every request
        self.policy = None
        if settings.method == "auto" and drafter is not None:
            from flashdraft.decode.budget import auto_policy

            self.policy = auto_policy(
                target, drafter, generate, engine=settings.engine, tau_report=settings.tau_report
            )
        self.stop_ids = stop_token_ids(self.tokenizer, target.model)
        self.context_length = int(getattr(target.config, "max_position_embeddings", 0) or 2**31)
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max(settings.max_queue, 1))
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.busy = False
        self._mean_job_seconds = 1.0  # running estimate, for Retry-After
        # fast tokenizers raise "Already borrowed" when used from several threads at once
        # (request handlers encode while the worker decodes): one lock around every use
        self._tok_lock = threading.Lock()

    # -- prompts

    def decode(self, tokens: list[int]) -> str:
        with self._tok_lock:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise invalid(
                "this target has no chat template: use /v1/completions", "messages", "no_chat_template"
            )
        try:
            with self._tok_lock:
                out = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=True
                )
        except Exception as e:  # jinja raises for orders/roles a template refuses
            raise invalid(f"the chat template cannot format these messages: {e}", "messages") from None
        return [int(t) for t in out["input_ids"]]

    def text_prompt(self, text: str) -> list[int]:
        with self._tok_lock:
            return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def check_prompt(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        """Bounds of the prompt ids and the context; returns params with max_tokens resolved."""
        vocab = self.target.vocab_size
        if not ids:
            raise invalid("the prompt is empty after tokenization", "prompt")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})", "prompt")
        room = self.context_length - len(ids)
        if room < 1:
            raise invalid(
                f"the prompt is {len(ids)} tokens: the context holds {self.context_length}",
                "messages",
                "context_length_exceeded",
            )
        n = params.max_tokens
        if n is None:
            n = min(self.settings.limits.default_max_tokens, room)
        elif n > room:
            raise invalid(
                f"prompt ({len(ids)} tokens) + max_tokens ({n}) exceeds the context "
                f"({self.context_length} tokens)",
                "max_tokens",
                "context_length_exceeded",
            )
        return SamplingParams(n, params.temperature, params.top_p, params.seed, params.stop)

    # -- queue

    @property
    def queue_length(self) -> int:
        return self._queue.qsize()

    def retry_after(self) -> int:
        return max(1, math.ceil(self._mean_job_seconds * (self.queue_length + 1)))

    def submit(self, job: Job) -> None:
        if self._thread is None or not self._thread.is_alive():
            self.metrics.observe_error("worker_down")
            raise APIError(503, "the worker is not running", code="worker_down")
        try:
            if self.settings.max_queue == 0 and self.busy:
                raise queue.Full
            self._queue.put_nowait(job)
        except queue.Full:
            self.metrics.observe_error("rejected_queue_full")
            raise APIError(
                429,
                f"the server is busy ({self.queue_length} requests queued): retry later",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after())},
            ) from None

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="flashdraft-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        while True:  # cancel whatever still waits
            try:
                self._queue.get_nowait().cancel()
            except queue.Empty:
                break
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                job = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            self.busy = True
            try:
                self._run(job)
            except Exception as e:  # the worker never dies because of one request
                log.exception("generation failed")
                self.metrics.observe_error("server_error")
                _safe_emit(
                    job,
                    Failed(
                        APIError(500, f"generation failed: {type(e).__name__}: {e}", code="generation_failed")
                    ),
                )
            finally:
                self.busy = False

    # -- one generation

    def _run(self, job: Job) -> None:
        import torch

        if job.cancelled.is_set():
            self.metrics.observe_error("cancelled")
            return
        if time.monotonic() > job.deadline:
            self.metrics.observe_error("timeout")
            _safe_emit(job, Failed(APIError(504, "the request timed out while queued", code="timeout")))
            return
        p = job.params
        assert p.max_tokens is not None
        stream = TextStream(self.decode, p.stop)
        timed_out = False

        def on_tokens(new: list[int]) -> bool:
            nonlocal timed_out
            delta = stream.push(new)
            if delta:
                _safe_emit(job, Delta(delta))
            if stream.stopped or job.cancelled.is_set():
                return False
            if time.monotonic() > job.deadline:
                timed_out = True
                return False
            return True

        t0 = time.perf_counter()
        with torch.inference_mode():
            result = self._generate(
                self.target,
                self.drafter,
                torch.tensor([job.prompt_ids], dtype=torch.long, device=self.target.device),
                max_new_tokens=p.max_tokens,
                temperature=p.temperature,
                top_p=p.top_p,
                method=self.settings.method if self.drafter is not None else "ar",
                budget=self.settings.budget,
                stop_token_ids=self.stop_ids,
                seed=p.seed,
                on_tokens=on_tokens,
                **({"policy": self.policy} if self.policy is not None else {}),
            )
        seconds = time.perf_counter() - t0
        self._mean_job_seconds = 0.8 * self._mean_job_seconds + 0.2 * seconds
        tokens = list(result.tokens)
        acc = list(result.acceptance_lengths)
        if stream.stopped:
            finish, completion_tokens = "stop", stream.stop_tokens or len(tokens)
        elif (
            result.stop_reason == "cancelled"
        ):  # on_tokens said stop: the client left, or the deadline passed
            finish, completion_tokens = ("timeout" if timed_out else "cancelled"), len(tokens)
        else:
            tail = stream.finish()
            if tail:
                _safe_emit(job, Delta(tail))
            finish, completion_tokens = ("stop" if result.stop_reason == "stop" else "length"), len(tokens)
        self.metrics.observe_generation(
            prompt_tokens=len(job.prompt_ids),
            completion_tokens=completion_tokens,
            acceptance_lengths=acc,
            seconds=seconds,
            finish_reason=finish,
        )
        if finish == "cancelled":
            self.metrics.observe_error("cancelled")
            return
        if finish == "timeout":
            self.metrics.observe_error("timeout")
            _safe_emit(
                job,
                Failed(
                    APIError(504, f"the request timed out after {completion_tokens} tokens", code="timeout")
                ),
            )
            return
        tau = sum(acc) / len(acc) if acc else 0.0
        _safe_emit(job, Done(finish, len(job.prompt_ids), completion_tokens, len(acc), tau, seconds))


def _safe_emit(job: Job, event: Event) -> None:
    try:
        job.emit(event)
    except Exception:  # the request's event loop may be gone (client left, server stopping)
        log.debug("dropped an event for a finished request", exc_info=True)
