"""Load the models and run the HTTP server (uvicorn), in the foreground or in a background thread.

flashdraft serve                                  # default target + shipped drafter, 127.0.0.1:8000
flashdraft serve --drafter none                   # plain autoregressive decoding

engine = build_engine(ServeOptions(target="default", drafter="none", method="ar"))
with BackgroundServer(create_app(engine), port=0) as srv:   # tests and benchmarks
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashdraft.serve.protocol import Limits
from flashdraft.serve.worker import Engine, EngineSettings

log = logging.getLogger("flashdraft.serve")

DEFAULT_TARGET_MODEL_ID = "smollm2-135m-instruct"


@dataclass
class ServeOptions:
    target: str = "default"
    drafter: str | None = None  # a DFlash folder, "none" (plain AR), or None = the shipped drafter if present
    method: str = "chain"  # "chain" | "ddtree" | "ar"
    budget: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    model_id: str | None = None  # the id clients send as "model"; derived from the target when None
    max_queue: int = 16
    timeout: float = 120.0
    limits: Limits = field(default_factory=Limits)
    engine: str = "auto"  # flashdraft.decode.backend: the CUDA-graph engine on CUDA, else the reference
    compile: bool = False  # the fast engine's forwards through torch.compile
    graph_prefill: bool = False  # the fast engine's prefill as a CUDA graph per prompt-length bucket


def model_id_for(target: str) -> str:
    if target == "default":
        return DEFAULT_TARGET_MODEL_ID
    name = Path(target.rstrip("/")).name or target
    return re.sub(r"\.gguf$", "", name)


def resolve_drafter(option: str | None, target: str = "default") -> str | None:
    """The drafter folder to load, or None for plain autoregressive decoding."""
    if option is None:
        from flashdraft.target import shipped_drafter

        folder = shipped_drafter(target)  # the default target's shipped drafter, if present
        return str(folder) if folder is not None else None
    if option.lower() in ("none", "ar", ""):
        return None
    return option


def build_engine(opts: ServeOptions) -> Engine:
    """Load target and drafter, check they fit, and wrap them in a started Engine."""
    from flashdraft.decode.backend import check_engine_name, pick_engine
    from flashdraft.drafter import DFlashDrafter
    from flashdraft.target import _parse_dtype, check_pair, load_target

    check_engine_name(opts.engine)
    if opts.method not in ("chain", "ddtree", "ar", "auto"):
        raise ValueError(f"method {opts.method!r} is unknown: use auto, chain, ddtree or ar")
    target = load_target(opts.target, dtype=opts.dtype, device=opts.device)
    folder = resolve_drafter(opts.drafter, opts.target)
    drafter = None
    method = opts.method
    if folder is not None:
        drafter = DFlashDrafter.from_pretrained(folder, dtype=_parse_dtype(opts.dtype), device=opts.device)
        check_pair(target, drafter.config)
        log.info(
            "drafter %s (%d layers, block %d)", folder, drafter.config.num_hidden_layers, drafter.block_size
        )
    else:
        if method != "ar":
            log.warning("no drafter: serving plain autoregressive decoding")
        method = "ar"
    if method == "ddtree" and opts.budget is None:
        raise ValueError("method ddtree needs --budget N (tree nodes, root excluded)")
    engine_name, generate = pick_engine(target, opts.engine, opts.compile, opts.graph_prefill)
    log.info("decoding with the %s engine", engine_name)
    settings = EngineSettings(
        method=method,
        budget=opts.budget if method == "ddtree" else None,
        max_queue=opts.max_queue,
        timeout=opts.timeout,
        model_id=opts.model_id or model_id_for(opts.target),
        limits=opts.limits,
        engine=engine_name,
    )
    engine = Engine(target, drafter, settings, generate=generate)
    engine.start()
    return engine


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class BackgroundServer:
    """uvicorn serving `app` in a daemon thread on a loopback port; a context manager."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(
            app,
            host=self.host,
            port=self.port,
            log_level=log_level,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="flashdraft-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        t_end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve_forever(engine: Engine, app: Any, host: str, port: int) -> None:
    import uvicorn

    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding to %s: the server is reachable from other machines", host)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        engine.stop()
