"""The OpenAI-compatible HTTP app (FastAPI), in front of one `Engine`.

    app = create_app(engine, AppSettings(api_key="secret"))
    # POST /v1/chat/completions, POST /v1/completions (SSE with "stream": true),
    # GET /v1/models, GET /health (never needs a key), GET /metrics (Prometheus text)

fastapi is imported here and nowhere else in the package: the GPU machine does not have it,
and nothing outside `flashdraft serve` needs it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashdraft.serve.errors import APIError
from flashdraft.serve.protocol import ParsedRequest, decode_json, parse_chat, parse_completion
from flashdraft.serve.worker import Delta, Done, Engine, Event, Failed, Job

log = logging.getLogger("flashdraft.serve")

POLL_SECONDS = 0.25  # how often a non-streaming request checks that its client is still there


@dataclass
class AppSettings:
    api_key: str | None = None  # bearer key for /v1/* and /metrics; None = open (bind to localhost!)
    max_body_bytes: int = 1 << 20


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class ObserveMiddleware:
    """Counts every response by endpoint and status, and times it to its last byte (streams too)."""

    def __init__(self, app: Any, metrics: Any) -> None:
        self.app, self.metrics = app, metrics
        self.state = app.state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500
        recorded = False

        async def send_wrapper(message: dict[str, Any]) -> None:
            nonlocal status, recorded
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and not recorded:
                recorded = True
                self.metrics.observe_request(scope.get("path", ""), status, time.perf_counter() - t0)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            if not recorded:  # the client left mid-stream, or the app raised
                self.metrics.observe_request(scope.get("path", ""), status, time.perf_counter() - t0)


def create_app(engine: Engine, settings: AppSettings | None = None) -> FastAPI:
    settings = settings or AppSettings()
    key = settings.api_key.encode() if settings.api_key else None
    app = FastAPI(title="flashdraft", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    metrics = engine.metrics

    # -- plumbing: metrics for every response, OpenAI-style errors for everything

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        # a bug in a handler: logged, counted, answered as JSON; the server keeps serving
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        metrics.observe_error("server_error")
        return _error_response(APIError(500, "internal server error", code="internal_error"))

    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        # not counted here: the worker counts the failures it reports, `run` counts its own timeouts
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(APIError(exc.status_code, str(exc.detail), code=code))

    def authorize(request: Request) -> None:
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        # constant-time comparison; the scheme check leaks nothing about the key
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode("utf-8", "replace"), key
        ):
            raise APIError(
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def read_body(request: Request) -> Any:
        limit = settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise APIError(400, "invalid Content-Length header", code="invalid_header")
            if int(declared) > limit:
                raise APIError(
                    413, f"request body is {declared} bytes: the limit is {limit}", code="body_too_large"
                )
        ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
        if ctype not in ("application/json", ""):
            raise APIError(
                415,
                f"content type {ctype!r} is not supported: send application/json",
                code="unsupported_media_type",
            )
        chunks, size = [], 0
        async for chunk in request.stream():  # counted as it arrives: chunked bodies have no length
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds {limit} bytes", code="body_too_large")
            chunks.append(chunk)
        return decode_json(b"".join(chunks))

    def check_model(req: ParsedRequest) -> None:
        if req.model != engine.settings.model_id:
            raise APIError(
                404,
                f"model {req.model[:200]!r} does not exist: this server serves {engine.settings.model_id!r}",
                param="model",
                code="model_not_found",
            )

    # -- endpoints

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": engine.settings.model_id,
            "queue_length": engine.queue_length,
            "busy": engine.busy,
        }

    @app.get("/metrics")
    async def get_metrics(request: Request) -> PlainTextResponse:
        authorize(request)
        text = metrics.render(
            queue_length=engine.queue_length, busy=engine.busy, max_queue=engine.settings.max_queue
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {
            "object": "list",
            "data": [
                {"id": engine.settings.model_id, "object": "model", "created": 0, "owned_by": "flashdraft"}
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        authorize(request)
        req = parse_chat(await read_body(request), engine.settings.limits)
        check_model(req)
        assert req.messages is not None
        ids = await asyncio.to_thread(engine.chat_prompt, req.messages)
        return await run(request, req, ids)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        req = parse_completion(await read_body(request), engine.settings.limits)
        check_model(req)
        ids = (
            req.prompt_ids
            if req.prompt_ids is not None
            else await asyncio.to_thread(engine.text_prompt, req.prompt)
        )
        return await run(request, req, ids)

    async def run(request: Request, req: ParsedRequest, ids: list[int]) -> Response:
        params = engine.check_prompt(ids, req.params)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(ev: Event) -> None:  # called from the worker thread
            loop.call_soon_threadsafe(events.put_nowait, ev)

        job = Job(ids, params, emit, deadline=time.monotonic() + engine.settings.timeout)
        engine.submit(job)  # 429 when full
        rid = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if req.stream:
            return StreamingResponse(
                sse(request, req, job, events, rid, created),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        text: list[str] = []
        # a little past the job's deadline: the worker reports timeouts itself, this only guards a stuck one
        give_up = job.deadline + 30.0
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), POLL_SECONDS)
                except TimeoutError:
                    if await request.is_disconnected():
                        job.cancel()
                        return Response(status_code=499)
                    if time.monotonic() > give_up:
                        job.cancel()
                        metrics.observe_error("timeout")
                        raise APIError(504, "the request timed out", code="timeout") from None
                    continue
                if isinstance(ev, Delta):
                    text.append(ev.text)
                elif isinstance(ev, Failed):
                    raise ev.error
                else:
                    return JSONResponse(final_body(req, rid, created, "".join(text), ev))
        finally:
            job.cancel()  # no-op when finished; stops the generation if this handler is torn down

    def final_body(req: ParsedRequest, rid: str, created: int, text: str, done: Done) -> dict[str, Any]:
        if req.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": done.finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason}
            obj = "text_completion"
        return {
            "id": rid,
            "object": obj,
            "created": created,
            "model": engine.settings.model_id,
            "choices": [choice],
            "usage": usage(done),
            "flashdraft": extra(done),
        }

    def usage(done: Done) -> dict[str, int]:
        return {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
        }

    def extra(done: Done) -> dict[str, Any]:
        return {
            "mean_acceptance_length": round(done.mean_acceptance, 4),
            "rounds": done.rounds,
            "method": engine.settings.method,
            "generation_seconds": round(done.seconds, 4),
        }

    async def sse(
        request: Request, req: ParsedRequest, job: Job, events: asyncio.Queue[Event], rid: str, created: int
    ) -> AsyncIterator[str]:
        chat_mode = req.kind == "chat"
        obj = "chat.completion.chunk" if chat_mode else "text_completion"
        model = engine.settings.model_id

        def chunk(delta_text: str | None, finish: str | None = None, role: bool = False, **more: Any) -> str:
            if chat_mode:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if delta_text:
                    delta["content"] = delta_text
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], **more}
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        try:
            if chat_mode:
                yield chunk(None, role=True)
            while True:
                ev = await events.get()  # a client that leaves cancels this generator (and so the job)
                if isinstance(ev, Delta):
                    yield chunk(ev.text)
                elif isinstance(ev, Failed):
                    yield f"data: {json.dumps(ev.error.body())}\n\n"
                    break
                else:
                    yield chunk(None, ev.finish_reason, flashdraft=extra(ev))
                    if req.include_usage:
                        body = {
                            "id": rid,
                            "object": obj,
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": usage(ev),
                        }
                        yield f"data: {json.dumps(body)}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()

    return ObserveMiddleware(app, metrics)  # type: ignore[return-value]
